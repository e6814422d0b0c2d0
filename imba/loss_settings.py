"""The `loss` section of the training config: which loss trains the DiT (`imba.training_loss`), one
kind with its own settings (a config section, as `models/settings.py` says):

    loss: {kind: plain, lam: 0.9}                              # python train.py loss=plain loss.lam=0.8
    loss: {kind: imba, gamma: 0.8, normalize: timestep_mean}   # python train.py loss=imba loss.gamma=0.5

Each kind is a dataclass of its settings, registered in LOSS_SETTINGS by its KIND, that builds its own training loss
(`build()`: a class of `imba.training_loss`); a setting its kind does not read is refused when the config loads. A new
kind is its dataclass here and its loss class there."""

from __future__ import annotations

import abc
import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from imba.choices import DISTANCES, ESTIMATORS, NORMALIZATIONS, REFERENCES, LossSettingError

_SNR_RANGE = {"min_snr_gamma": ">= 0 (0 = off)"}


@dataclass
class LossConfig(abc.ABC):
    """The settings every loss kind has; a kind is a subclass with its KIND, its own settings, the loss it builds
    and its line (a kind without its own `build` or `describe` cannot be made: TypeError)."""

    KIND: ClassVar[str] = ""
    CHOICES: ClassVar[dict] = {}
    RANGES: ClassVar[dict] = _SNR_RANGE
    # min-SNR weighting of each sample's loss, min(SNR, γ) / SNR (γ = 5 in its paper): 0 = off; ε-prediction only
    # (objective.kind=ddpm); with IMBA it multiplies IMBA's own weights
    min_snr_gamma: float = 0.0

    @abc.abstractmethod
    def build(self, patch_size: int = 2, same_passes_on_every_rank: bool = False, num_processes: int = 1):
        """This kind's training loss (an `imba.training_loss.TrainingLoss`; imports torch) for a DiT of `patch_size`
        trained by `num_processes` processes; `same_passes_on_every_rank`: every rank runs the same forward passes
        whatever its batch draws (DeepSpeed ZeRO-3). A kind takes what it needs of these."""

    @abc.abstractmethod
    def describe(self) -> str:
        """One line: the loss and its settings, as the start-up log and the model card state it."""

    def snr(self) -> str:
        return f", min-SNR weighting γ = {self.min_snr_gamma:g}" if self.min_snr_gamma else ""

    def check(self) -> None:
        """The loss's own checks (`LossSettingError`), as a one-line ValueError naming the config key."""
        try:
            self.build()  # torch: only once a config is checked, not for --help
        except LossSettingError as err:
            raise ValueError(f"config key 'loss.{err.setting}' {err.problem}") from err


@dataclass
class PlainLoss(LossConfig):
    """The plain diffusion loss (MSE) with caption dropout: the default, which wins the composition benchmark at
    equal compute (bench/README.md)."""

    KIND: ClassVar[str] = "plain"
    lam: float = 0.9  # caption dropout p = 1 - lam

    def build(self, patch_size: int = 2, same_passes_on_every_rank: bool = False, num_processes: int = 1):
        from imba.training_loss import PlainTrainingLoss

        return PlainTrainingLoss(**dataclasses.asdict(self))

    def describe(self) -> str:
        return f"plain diffusion MSE with caption dropout {1 - self.lam:g}{self.snr()}"


@dataclass
class ImbaLoss(LossConfig):
    """The IMBA loss at token level, the paper's form (docs/method.md)."""

    KIND: ClassVar[str] = "imba"
    GRANULARITY: ClassVar[str] = "token"  # one weight per patch token (IMBALoss's granularity)
    CHOICES: ClassVar[dict] = {"distance": DISTANCES, "reference": REFERENCES, "normalize": NORMALIZATIONS,
                               "estimator": ESTIMATORS}
    gamma: float = 0.8
    lam: float = 0.9  # weight of the conditional term
    distance: str = "mse"  # mse | l1 | l2
    reference: str = "target"  # target (paper) | cond (unbiased optimum, docs/method.md)
    normalize: str = "none"  # none | batch_mean | timestep_mean (running mean of D per timestep bin)
    # literal: cond + uncond passes with grad on every sample (≈ 2× a plain step); efficient: unbiased estimator of
    # the same gradient, caption dropout 1 - lam + no-grad uncond pass on the kept samples (≈ 1.3×)
    estimator: str = "literal"

    def build(self, patch_size: int = 2, same_passes_on_every_rank: bool = False, num_processes: int = 1):
        import torch

        from imba.training_loss import ImbaTrainingLoss

        # normalize=timestep_mean: the running means cover the global batch, so every rank holds the same state
        reduce = torch.distributed.all_reduce if num_processes > 1 else None
        return ImbaTrainingLoss(**dataclasses.asdict(self), granularity=self.GRANULARITY, patch_size=patch_size,
                                same_passes_on_every_rank=same_passes_on_every_rank, timestep_reduce=reduce)

    def describe(self) -> str:
        return (f"IMBA ({self.GRANULARITY} level): γ = {self.gamma:g}, λ = {self.lam:g}, distance {self.distance}, reference "
                f"{self.reference}, normalisation {self.normalize}, estimator {self.estimator}{self.snr()}")


@dataclass
class ImbaSampleLoss(ImbaLoss):
    """The IMBA loss at sample level: one weight per sample instead of per token."""

    KIND: ClassVar[str] = "imba_sample"
    GRANULARITY: ClassVar[str] = "sample"


LOSS_SETTINGS: dict[str, type[LossConfig]] = {kind.KIND: kind for kind in (PlainLoss, ImbaLoss, ImbaSampleLoss)}
