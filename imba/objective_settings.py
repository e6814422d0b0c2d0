"""The `objective` section of the training config: how clean latents become the DiT's input and target
(`imba.objectives`), one kind with its own settings (a config section, as `models/settings.py` says):

    objective: {kind: flow, shift: 3.0}                     # python train.py objective=flow objective.shift=3
    objective: {kind: ddpm, beta_schedule: scaled_linear}   # python train.py objective=ddpm

Each kind is a dataclass of its settings, registered in OBJECTIVE_SETTINGS by its KIND; its fields are the
objective's constructor arguments (`build()`), and a setting its kind does not read is refused when the config
loads."""

from __future__ import annotations

import abc
import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from imba.choices import BETA_SCHEDULES


def _objectives() -> dict:
    """`imba.objectives.OBJECTIVES`, imported when an objective is built: reading the settings needs no torch."""
    from imba.objectives import OBJECTIVES

    return OBJECTIVES


@dataclass
class ObjectiveConfig(abc.ABC):
    """What every objective kind has; a kind is a subclass with its KIND, its settings and its line (a kind without
    its own `describe` cannot be made: TypeError)."""

    KIND: ClassVar[str] = ""
    CHOICES: ClassVar[dict] = {}
    RANGES: ClassVar[dict] = {}

    def kwargs(self) -> dict:
        """Constructor arguments of the objective (`imba.objectives.OBJECTIVES[KIND]`)."""
        return dataclasses.asdict(self)

    def build(self):
        """The objective these settings describe."""
        return _objectives()[self.KIND](**self.kwargs())

    @property
    def predicts_epsilon(self) -> bool:
        """Whether the DiT predicts the noise ε (what min-SNR weighting, loss.min_snr_gamma, is defined for)."""
        return _objectives()[self.KIND].predicts_epsilon

    @abc.abstractmethod
    def describe(self) -> str:
        """One line, as the model card states it."""

    def check(self) -> None:
        """A one-line ValueError for settings that cannot go together."""


@dataclass
class FlowObjective(ObjectiveConfig):
    """Rectified flow, velocity target: σ = sigmoid(N(logit_mean, logit_std²)), shifted towards noise by `shift`."""

    KIND: ClassVar[str] = "flow"
    RANGES: ClassVar[dict] = {"logit_std": "> 0", "shift": "> 0"}
    logit_mean: float = 0.0
    logit_std: float = 1.0
    shift: float = 1.0  # timestep shift towards noise (also used by the sampler)

    def describe(self) -> str:
        return "rectified flow (velocity prediction)"


@dataclass
class DdpmObjective(ObjectiveConfig):
    """ε-prediction on a discrete DDPM schedule (PixArt's: linear betas 1e-4 → 0.02)."""

    KIND: ClassVar[str] = "ddpm"
    RANGES: ClassVar[dict] = {"beta_start": "in (0, 1)", "beta_end": "in (0, 1)"}
    beta_schedule: str = "linear"
    beta_start: float = 0.0001
    beta_end: float = 0.02

    def describe(self) -> str:
        return "DDPM ε-prediction"

    def check(self) -> None:
        """A one-line ValueError for a noise schedule that cannot be built."""
        if self.beta_start > self.beta_end:
            raise ValueError(f"config key 'objective.beta_start' ({self.beta_start}) must not exceed "
                             f"objective.beta_end ({self.beta_end}): the noise schedule rises from beta_start to "
                             f"beta_end")
        if self.beta_schedule not in BETA_SCHEDULES:
            raise ValueError(f"config key 'objective.beta_schedule' must be a schedule diffusers' DDPM and DPM-Solver "
                             f"schedulers both implement ({', '.join(BETA_SCHEDULES)}), got {self.beta_schedule!r}")


OBJECTIVE_SETTINGS: dict[str, type[ObjectiveConfig]] = {kind.KIND: kind for kind in (FlowObjective, DdpmObjective)}
