"""The `objective` section of the training config: how clean latents become the DiT's input and target
(`imba.objectives`), with its ranges and checks (a config section, as `models/settings.py` says)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from imba.objectives import BETA_SCHEDULES, OBJECTIVES


@dataclass
class ObjectiveConfig:
    kind: str = "flow"  # flow (rectified flow, velocity target) | ddpm (ε-prediction)
    logit_mean: float = 0.0  # flow: σ = sigmoid(N(logit_mean, logit_std²))
    logit_std: float = 1.0
    shift: float = 1.0  # flow: timestep shift towards noise (also used by the sampler)
    beta_schedule: str = "linear"  # ddpm: PixArt's schedule
    beta_start: float = 0.0001
    beta_end: float = 0.02

    CHOICES: ClassVar[dict] = {"kind": tuple(OBJECTIVES)}
    RANGES: ClassVar[dict] = {"logit_std": "> 0", "shift": "> 0", "beta_start": "in (0, 1)", "beta_end": "in (0, 1)"}

    def kwargs(self) -> dict:
        """Constructor arguments of the chosen objective (imba.objectives.build_objective(kind, **kwargs()))."""
        if self.kind == "flow":
            return dict(logit_mean=self.logit_mean, logit_std=self.logit_std, shift=self.shift)
        return dict(beta_schedule=self.beta_schedule, beta_start=self.beta_start, beta_end=self.beta_end)

    def check(self) -> None:
        """A one-line ValueError for a noise schedule that cannot be built."""
        if self.beta_start > self.beta_end:
            raise ValueError(f"config key 'objective.beta_start' ({self.beta_start}) must not exceed "
                             f"objective.beta_end ({self.beta_end}): the noise schedule rises from beta_start to "
                             f"beta_end")
        if self.beta_schedule not in BETA_SCHEDULES:
            raise ValueError(f"config key 'objective.beta_schedule' must be a schedule diffusers' DDPM and DPM-Solver "
                             f"schedulers both implement ({', '.join(BETA_SCHEDULES)}), got {self.beta_schedule!r}")
