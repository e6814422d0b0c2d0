"""The loss of one training batch, one class per loss kind: which forward passes the batch needs, which rows get the
null caption, and which loss applies. Each kind's settings (`imba.loss_settings`) build its class
(`LossConfig.build`); a script of its own can make one directly.

- `PlainTrainingLoss` (`plain`): the baseline: captions replaced by the null caption with probability 1 − λ, then
  MSE.
- `ImbaTrainingLoss` (`imba`, `imba_sample`), `estimator="literal"`: conditional and unconditional predictions for
  every sample, both with gradient, run as one batched forward of size 2B, then `IMBALoss`. Cost ≈ 2× a plain step.
- `ImbaTrainingLoss`, `estimator="efficient"`: the unbiased form. Each sample is dropped with probability 1 − λ;
  one forward of B samples with gradient (kept rows with their caption, dropped rows with the null caption — the
  same pass as plain training with caption dropout), plus a no-grad unconditional forward of the kept rows only,
  which supplies their weight D. Same expected loss and gradient as the literal form; cost ≈ 1.3× a plain step.

Every kind is called alike (`TrainingLoss.__call__`) with a `predict(noisy, timesteps, text_embeds, text_mask)`
callable, so any network with conditional and null text inputs can use it, and carries its own running state
(`state_dict`, empty for a kind without one). It needs torch alone (`NoisedBatch` is any object with `noisy`,
`timesteps` and `target`).
"""

from __future__ import annotations

import abc
from typing import Callable

import torch

from imba.choices import ESTIMATORS
from imba.loss import IMBALoss, LossSettingError, LossStats, plain_loss
from imba.objectives import NoisedBatch

Predict = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
Caption = tuple[torch.Tensor, torch.Tensor]  # (embeds, mask)


class TrainingLoss(abc.ABC):
    """What the trainer calls for each batch; a loss kind is a subclass with its own passes, caption dropout and
    state. `drop_rate`: the expected share of rows given the null caption in the pass with gradient."""

    drop_rate: float = 0.0

    @abc.abstractmethod
    def __call__(self, predict: Predict, noised: NoisedBatch, cond: Caption, null: Caption,
                 generator: torch.Generator | None = None, drop: torch.Tensor | None = None,
                 sample_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, LossStats]:
        """Loss and stats of one batch. `drop` (bool, (B,)) fixes which rows get the null caption where the kind
        drops captions; by default the kind draws it from `generator`. `sample_weights` (B,) weigh each sample's
        loss (offline re-balancing; min-SNR weighting multiplies them)."""

    def state_dict(self) -> dict:
        """The loss's running state, which every checkpoint carries: none unless the kind has some."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restores `state_dict()`; a kind without running state keeps none (a checkpoint of a kind with state
        resumes without it)."""


class PlainTrainingLoss(TrainingLoss):
    """Plain diffusion MSE with caption dropout p = 1 − λ; `min_snr_gamma` as `ImbaTrainingLoss`'s."""

    def __init__(self, lam: float = 0.9, min_snr_gamma: float = 0.0):
        check_min_snr_gamma(min_snr_gamma)
        if not 0.0 <= lam <= 1.0:
            raise LossSettingError("lam", f"must lie in [0, 1], got {lam}")
        self.lam, self.min_snr_gamma = lam, min_snr_gamma
        self.drop_rate = 1.0 - lam

    def __call__(self, predict, noised, cond, null, generator=None, drop=None, sample_weights=None):
        sample_weights = with_min_snr(sample_weights, noised, self.min_snr_gamma)
        if drop is None:
            drop = self.draw_drop(noised.noisy.shape[0], generator=generator, device=cond[0].device)
        pred = predict(noised.noisy, noised.timesteps, *null_where_dropped(drop, cond, null))
        loss, stats = plain_loss(pred, noised.target, sample_weights)
        # rows given the null caption trained the unconditional model: not a conditional error
        per_sample = stats.tensors.pop("loss_per_sample")
        stats.tensors["loss_cond_per_sample"] = per_sample.masked_fill(drop, float("nan"))
        stats["caption_dropout_rate"] = drop.float().mean()
        return loss, stats

    def draw_drop(self, batch_size: int, generator: torch.Generator | None = None, device=None) -> torch.Tensor:
        """The rows given the null caption: each with probability 1 − λ."""
        return draw_drop(self.lam, batch_size, generator, device)


class ImbaTrainingLoss(TrainingLoss):
    """The IMBA loss, one weight per token (`imba`) or per sample (`imba_sample`), with its estimator's passes."""

    def __init__(self, gamma: float = 0.8, lam: float = 0.9, patch_size: int = 2, granularity: str = "token",
                 distance: str = "mse", reference: str = "target", normalize: str = "none",
                 estimator: str = "literal", same_passes_on_every_rank: bool = False, timestep_reduce="auto",
                 min_snr_gamma: float = 0.0):
        """The IMBA loss (`IMBALoss`: `gamma`, `lam`, `patch_size`, `granularity`, `distance`, `reference`,
        `normalize`) with the forward passes of its `estimator`, "literal" or "efficient".
        `min_snr_gamma` γ > 0: min-SNR weighting (Hang et al., 2023), each sample's loss times min(SNR, γ) / SNR,
        which caps the weight of the nearly clean timesteps; ε-prediction only (the batch's `snr`), 0 = off.
        `same_passes_on_every_rank`: run the same forward passes whatever the batch draws. Under DeepSpeed
        ZeRO-3 every forward gathers the parameters from all ranks, so no rank may skip one (the efficient
        estimator's no-grad pass then runs on all B rows instead of the kept ones).
        `timestep_reduce`: how `normalize="timestep_mean"` sums its bins over processes (`TimestepMean`): "auto"
        (over torch.distributed's default group when one is initialised), an all-reduce function, or None."""
        if estimator not in ESTIMATORS:
            raise ValueError(f"unknown IMBA estimator {estimator!r}; choose one of {', '.join(ESTIMATORS)}")
        check_min_snr_gamma(min_snr_gamma)
        self.estimator = estimator
        self.min_snr_gamma = min_snr_gamma
        self.same_passes_on_every_rank = same_passes_on_every_rank
        self.imba = IMBALoss(gamma=gamma, lam=lam, patch_size=patch_size, distance=distance, reference=reference,
                             normalize=normalize, granularity=granularity, timestep_reduce=timestep_reduce,
                             stats_prefix="")  # train.py's log is its own
        self.drop_rate = 1.0 - lam if estimator == "efficient" else 0.0

    def state_dict(self) -> dict:
        """The timestep means of normalize="timestep_mean"; empty otherwise."""
        return self.imba.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """The saved timestep means where this loss keeps them; a checkpoint without them (another
        normalisation's, another kind's) leaves them fresh."""
        if "timestep_mean" in state and self.imba.timestep_mean is not None:
            self.imba.timestep_mean.load_state_dict(state["timestep_mean"])

    def __call__(self, predict, noised, cond, null, generator=None, drop=None, sample_weights=None):
        """The literal form ignores `drop`: both of its passes see every row."""
        sample_weights = with_min_snr(sample_weights, noised, self.min_snr_gamma)
        if self.estimator == "efficient":
            if drop is None:
                drop = draw_drop(self.imba.lam, noised.noisy.shape[0], generator, cond[0].device)
            return self._efficient(predict, noised, cond, null, drop, sample_weights)
        b = noised.noisy.shape[0]
        both = predict(
            torch.cat([noised.noisy, noised.noisy]),
            torch.cat([noised.timesteps, noised.timesteps]),
            torch.cat([cond[0], null[0]]),
            torch.cat([cond[1], null[1]]),
        )
        return self.imba(both[:b], both[b:], noised.target, timesteps=noised.timesteps, sample_weights=sample_weights)

    def _efficient(self, predict, noised, cond, null, drop, sample_weights):
        # the only pass with gradient: exactly a plain step with caption dropout
        pred = predict(noised.noisy, noised.timesteps, *null_where_dropped(drop, cond, null))
        pred_uncond = pred
        # the kept rows' unconditional prediction only sets their weight D; pred's dropped rows hold unconditional
        # predictions with their gradient (`efficient_uncond`)
        if self.same_passes_on_every_rank:  # every row, so no rank skips a pass; selected by a mask, no host sync
            with torch.no_grad():
                uncond = predict(noised.noisy, noised.timesteps, *null)
            pred_uncond = self.imba.efficient_uncond(pred, uncond, drop)
        else:  # the kept rows only, (1 − λ)·B rows fewer; finding them waits for the device once
            kept = (~drop).nonzero(as_tuple=True)[0]
            if kept.numel():
                with torch.no_grad():
                    uncond = predict(noised.noisy[kept], noised.timesteps[kept], null[0][kept], null[1][kept])
                pred_uncond = self.imba.efficient_uncond(pred, uncond, drop, kept=kept)
        return self.imba(pred, pred_uncond, noised.target, drop=drop, timesteps=noised.timesteps,
                         sample_weights=sample_weights)


def check_min_snr_gamma(gamma: float) -> None:
    if not gamma >= 0:
        raise LossSettingError("min_snr_gamma", f"must be >= 0 (0 = off), got {gamma}")


def min_snr_weights(noised: NoisedBatch, gamma: float) -> torch.Tensor:
    """min(SNR, γ) / SNR per row of an ε-prediction batch (its `snr`); refused for a batch without one."""
    snr = getattr(noised, "snr", None)
    if snr is None:
        raise ValueError("min_snr_gamma needs the batch's SNR, which ε-prediction objectives give (NoisedBatch.snr; "
                         "objective.kind=ddpm): a flow objective weights timesteps by how it samples them")
    snr = snr.float()
    return snr.clamp(max=gamma) / snr


def with_min_snr(weights: torch.Tensor | None, noised: NoisedBatch, gamma: float) -> torch.Tensor | None:
    """`weights` (or none) times the min-SNR weights of γ = `gamma`; unchanged for γ = 0 (off)."""
    if not gamma:
        return weights
    more = min_snr_weights(noised, gamma)
    return more if weights is None else weights * more.to(weights.dtype)


def draw_drop(lam: float, batch_size: int, generator: torch.Generator | None = None, device=None) -> torch.Tensor:
    """Caption dropout: rows given the null caption, each with probability 1 − λ (`IMBALoss.draw_drop_mask`'s
    draws)."""
    return torch.rand((batch_size,), generator=generator, device=device) < (1.0 - lam)


def null_where_dropped(drop: torch.Tensor, cond: Caption, null: Caption) -> Caption:
    """(embeds, mask) with the null caption on the rows where `drop` is True."""
    embeds = torch.where(drop[:, None, None], null[0], cond[0])
    mask = torch.where(drop[:, None], null[1], cond[1])
    return embeds, mask
