"""The named choices of the method's settings and the error for a value outside them, without torch: the loss and
the objectives check their arguments against them, and the training config (`imba.loss_settings`,
`imba.objective_settings`) reads them to answer `train.py --help` and a bad config before torch is imported."""

DISTANCES = ("mse", "l1", "l2")  # IMBALoss(distance=)
REFERENCES = ("target", "cond")  # IMBALoss(reference=)
NORMALIZATIONS = ("none", "batch_mean", "timestep_mean")  # IMBALoss(normalize=)
ESTIMATORS = ("literal", "efficient")  # ImbaTrainingLoss(estimator=)
# The beta schedules that both diffusers' DDPMScheduler (training) and DPMSolverMultistepScheduler (sampling, the
# export's scheduler) implement; DDPMScheduler alone also has "sigmoid".
BETA_SCHEDULES = ("linear", "scaled_linear", "squaredcos_cap_v2")


class LossSettingError(ValueError):
    """A loss setting outside what it accepts; `setting` names it, `problem` says what it must be."""

    def __init__(self, setting: str, problem: str) -> None:
        super().__init__(f"IMBALoss: {setting} {problem}")
        self.setting, self.problem = setting, problem
