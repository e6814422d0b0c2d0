"""The loss of one training batch: which forward passes to run and which loss to apply.

`TrainingLoss` is model-agnostic: it receives a `predict(noisy, timesteps, text_embeds, text_mask)` callable, so
any network with conditional and null text inputs can use it.

- `imba` / `imba_sample`, `estimator="literal"`: conditional and unconditional predictions for every sample, both
  with gradient, run as one batched forward of size 2B, then `IMBALoss`. Cost ≈ 2× a plain step.
- `imba` / `imba_sample`, `estimator="efficient"`: the unbiased form. Each sample is dropped with probability 1 − λ;
  one forward of B samples with gradient (kept rows with their caption, dropped rows with the null caption — the
  same pass as plain training with caption dropout), plus a no-grad unconditional forward of the kept rows only,
  which supplies their weight D. Same expected loss and gradient as the literal form; cost ≈ 1.3× a plain step.
- `plain`: the baseline: captions replaced by the null caption with probability 1 − λ, then MSE.

It needs torch alone (`NoisedBatch` is any object with `noisy`, `timesteps` and `target`).
"""

from __future__ import annotations

from typing import Callable

import torch

from imba.choices import ESTIMATORS
from imba.loss import IMBALoss, LossSettingError, LossStats, plain_loss
from imba.objectives import NoisedBatch

Predict = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
LOSS_KINDS = ("imba", "imba_sample", "plain")


class TrainingLoss:
    def __init__(self, kind: str = "imba", gamma: float = 0.8, lam: float = 0.9, patch_size: int = 2,
                 distance: str = "mse", reference: str = "target", normalize: str = "none",
                 estimator: str = "literal", same_passes_on_every_rank: bool = False, timestep_reduce="auto",
                 min_snr_gamma: float = 0.0):
        """`min_snr_gamma` γ > 0: min-SNR weighting (Hang et al., 2023), each sample's loss times min(SNR, γ) / SNR,
        which caps the weight of the nearly clean timesteps; ε-prediction only (the batch's `snr`), 0 = off.
        `same_passes_on_every_rank`: run the same forward passes whatever the batch draws. Under DeepSpeed
        ZeRO-3 every forward gathers the parameters from all ranks, so no rank may skip one (the efficient
        estimator's no-grad pass then runs on all B rows instead of the kept ones).
        `timestep_reduce`: how `normalize="timestep_mean"` sums its bins over processes (`TimestepMean`): "auto"
        (over torch.distributed's default group when one is initialised), an all-reduce function, or None."""
        if kind not in LOSS_KINDS:
            raise ValueError(f"unknown loss kind {kind!r}; choose one of {', '.join(LOSS_KINDS)}")
        if estimator not in ESTIMATORS:
            raise ValueError(f"unknown IMBA estimator {estimator!r}; choose one of {', '.join(ESTIMATORS)}")
        if not min_snr_gamma >= 0:
            raise LossSettingError("min_snr_gamma", f"must be >= 0 (0 = off), got {min_snr_gamma}")
        self.kind = kind
        self.estimator = estimator
        self.min_snr_gamma = min_snr_gamma
        self.lam = lam
        self.same_passes_on_every_rank = same_passes_on_every_rank
        self.imba = IMBALoss(gamma=gamma, lam=lam, patch_size=patch_size, distance=distance, reference=reference,
                             normalize=normalize, granularity="sample" if kind == "imba_sample" else "token",
                             timestep_reduce=timestep_reduce, stats_prefix="")  # train.py's log is its own

    def state_dict(self) -> dict:
        """The loss's running state (the timestep means of normalize="timestep_mean"; empty otherwise)."""
        return {} if self.kind == "plain" else self.imba.state_dict()

    def load_state_dict(self, state: dict) -> None:
        if "timestep_mean" in state and self.imba.timestep_mean is not None:
            self.imba.timestep_mean.load_state_dict(state["timestep_mean"])

    def __call__(self, predict: Predict, noised: NoisedBatch, cond: tuple[torch.Tensor, torch.Tensor],
                 null: tuple[torch.Tensor, torch.Tensor], generator: torch.Generator | None = None,
                 drop: torch.Tensor | None = None, sample_weights: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, LossStats]:
        """Loss and stats of one batch. `drop` (bool, (B,)) fixes which rows get the null caption (plain and
        efficient only); by default it is drawn with probability 1 − λ per row. `sample_weights` (B,) weigh each
        sample's loss (offline re-balancing, min-SNR); IMBA applies them on top of its own token weights."""
        if self.min_snr_gamma:
            sample_weights = _times(sample_weights, min_snr_weights(noised, self.min_snr_gamma))
        if drop is None and (self.kind == "plain" or self.estimator == "efficient"):
            drop = self.imba.draw_drop_mask(noised.noisy.shape[0], generator=generator, device=cond[0].device)
        if self.kind == "plain":
            pred = predict(noised.noisy, noised.timesteps, *_null_where_dropped(drop, cond, null))
            loss, stats = plain_loss(pred, noised.target, sample_weights)
            # rows given the null caption trained the unconditional model: not a conditional error
            per_sample = stats.tensors.pop("loss_per_sample")
            stats.tensors["loss_cond_per_sample"] = per_sample.masked_fill(drop, float("nan"))
            stats["caption_dropout_rate"] = drop.float().mean()
            return loss, stats
        if self.estimator == "efficient":
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
        pred = predict(noised.noisy, noised.timesteps, *_null_where_dropped(drop, cond, null))
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


def min_snr_weights(noised: NoisedBatch, gamma: float) -> torch.Tensor:
    """min(SNR, γ) / SNR per row of an ε-prediction batch (its `snr`); refused for a batch without one."""
    snr = getattr(noised, "snr", None)
    if snr is None:
        raise ValueError("min_snr_gamma needs the batch's SNR, which ε-prediction objectives give (NoisedBatch.snr; "
                         "objective.kind=ddpm): a flow objective weights timesteps by how it samples them")
    snr = snr.float()
    return snr.clamp(max=gamma) / snr


def _times(weights: torch.Tensor | None, more: torch.Tensor) -> torch.Tensor:
    return more if weights is None else weights * more.to(weights.dtype)


def _null_where_dropped(drop: torch.Tensor, cond, null):
    """(embeds, mask) with the null caption on the rows where `drop` is True."""
    embeds = torch.where(drop[:, None, None], null[0], cond[0])
    mask = torch.where(drop[:, None], null[1], cond[1])
    return embeds, mask
