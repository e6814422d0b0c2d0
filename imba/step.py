"""The loss of one training batch: which forward passes to run and which loss to apply.

`TrainingLoss` is model-agnostic: it receives a `predict(noisy, timesteps, text_embeds, text_mask)` callable, so
any network with conditional and null text inputs can use it.

- `imba` / `imba_sample`: conditional and unconditional predictions for every sample, run as one batched forward
  of size 2B (one pass over the weights, twice the tokens), then `IMBALoss`. Caption dropout is not used: the
  (1 − λ)·L_u term trains the unconditional model instead.
- `plain`: the baseline: captions replaced by the null caption with probability 1 − λ, then MSE.
"""

from __future__ import annotations

from typing import Callable

import torch

from imba.loss import IMBALoss, plain_loss
from imba.objectives import NoisedBatch

Predict = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
LOSS_KINDS = ("imba", "imba_sample", "plain")


class TrainingLoss:
    def __init__(self, kind: str = "imba", gamma: float = 0.8, lam: float = 0.9, patch_size: int = 2,
                 distance: str = "mse", reference: str = "target", normalize: str = "none"):
        if kind not in LOSS_KINDS:
            raise ValueError(f"unknown loss kind {kind!r}; choose one of {', '.join(LOSS_KINDS)}")
        self.kind = kind
        self.lam = lam
        self.imba = IMBALoss(gamma=gamma, lam=lam, patch_size=patch_size, distance=distance, reference=reference,
                             normalize=normalize, granularity="sample" if kind == "imba_sample" else "token")

    def __call__(self, predict: Predict, noised: NoisedBatch, cond: tuple[torch.Tensor, torch.Tensor],
                 null: tuple[torch.Tensor, torch.Tensor], generator: torch.Generator | None = None):
        embeds, mask = cond
        null_embeds, null_mask = null
        b = noised.noisy.shape[0]
        if self.kind == "plain":
            drop = torch.rand((b,), generator=generator, device=embeds.device) < (1.0 - self.lam)
            embeds = torch.where(drop[:, None, None], null_embeds, embeds)
            mask = torch.where(drop[:, None], null_mask, mask)
            pred = predict(noised.noisy, noised.timesteps, embeds, mask)
            loss, stats = plain_loss(pred, noised.target)
            stats["caption_dropout_rate"] = drop.float().mean()
            return loss, stats
        both = predict(
            torch.cat([noised.noisy, noised.noisy]),
            torch.cat([noised.timesteps, noised.timesteps]),
            torch.cat([embeds, null_embeds]),
            torch.cat([mask, null_mask]),
        )
        pred_cond, pred_uncond = both[:b], both[b:]
        return self.imba(pred_cond, pred_uncond, noised.target)
