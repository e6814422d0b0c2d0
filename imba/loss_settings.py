"""The `loss` section of the training config: which loss trains the DiT (`imba.training_loss.TrainingLoss`), with
its choices and checks (a config section, as `models/settings.py` says). Its fields are `TrainingLoss`'s keywords,
so a setting added to the loss is added here once and reaches it through `kwargs()`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from imba.loss import DISTANCES, NORMALIZATIONS, REFERENCES, LossSettingError
from imba.training_loss import ESTIMATORS, LOSS_KINDS, TrainingLoss


@dataclass
class LossConfig:
    # plain (MSE + caption dropout; the default: it wins the composition benchmark at equal compute,
    # bench/README.md) | imba (token level, the paper's form) | imba_sample (sample level)
    kind: str = "plain"
    gamma: float = 0.8
    lam: float = 0.9  # IMBA: weight of the conditional term; plain: caption dropout p = 1 - lam
    distance: str = "mse"  # mse | l1 | l2
    reference: str = "target"  # target (paper) | cond (unbiased optimum, docs/method.md)
    normalize: str = "none"  # none | batch_mean | timestep_mean (running mean of D per timestep bin)
    # literal: cond + uncond passes with grad on every sample (≈ 2× a plain step); efficient: unbiased estimator of
    # the same gradient, caption dropout 1 - lam + no-grad uncond pass on the kept samples (≈ 1.3×)
    estimator: str = "literal"
    # min-SNR weighting of each sample's loss, min(SNR, γ) / SNR (γ = 5 in its paper): 0 = off; ε-prediction only
    # (objective.kind=ddpm); with IMBA it multiplies IMBA's own weights
    min_snr_gamma: float = 0.0

    CHOICES: ClassVar[dict] = {"kind": LOSS_KINDS, "distance": DISTANCES, "reference": REFERENCES,
                               "normalize": NORMALIZATIONS, "estimator": ESTIMATORS}
    RANGES: ClassVar[dict] = {"min_snr_gamma": ">= 0 (0 = off)"}

    def kwargs(self) -> dict:
        """Keyword arguments of `TrainingLoss` (the run adds the patch size and how ranks share the loss's state)."""
        return dataclasses.asdict(self)

    def describe(self) -> str:
        """One line: the loss and its settings, as the model card states it. A kind without a line here is a
        KeyError, never another kind's line."""
        snr = f", min-SNR weighting γ = {self.min_snr_gamma:g}" if self.min_snr_gamma else ""
        if self.kind == "plain":
            return f"plain diffusion MSE with caption dropout {1 - self.lam:g}{snr}"
        level = {"imba": "token level", "imba_sample": "sample level"}[self.kind]
        return (f"IMBA ({level}): γ = {self.gamma:g}, λ = {self.lam:g}, distance {self.distance}, reference "
                f"{self.reference}, normalisation {self.normalize}, estimator {self.estimator}{snr}")

    def check(self) -> None:
        """The loss's own checks (`LossSettingError`), as a one-line ValueError naming the config key."""
        try:
            TrainingLoss(**self.kwargs())
        except LossSettingError as err:
            raise ValueError(f"config key 'loss.{err.setting}' {err.problem}") from err
