"""The divergence guard: an optimizer step whose loss or gradient norm is not finite is skipped, on every rank.

One decision per optimizer step, agreed by all ranks through one small gather, so no rank ever steps alone
(its weights would leave the others' for good). A skipped step still counts as a step: its batches were consumed
and the LR schedule advances, so resume stays exact. The EMA is not updated on a skipped step. After
`max_bad_steps` consecutive skipped steps the weights are taken to have diverged and the run stops.

Under DeepSpeed the engine's own overflow check skips the update when the gradients are not finite (a non-finite
loss gives non-finite gradients on every rank after the reduction); the guard then only keeps the EMA and the
counters out of it. Under fp16 a non-finite gradient norm is the GradScaler's business (it skips the step and
lowers the scale), so only a non-finite loss counts as a bad step there.
"""

from __future__ import annotations

from typing import Iterable

import torch
from accelerate import Accelerator

DIVERGED_EXIT_CODE = 3


class DivergenceGuard:
    def __init__(self, accelerator: Accelerator, max_bad_steps: int, check_grad_norm: bool = True) -> None:
        self.accelerator = accelerator
        self.max_bad_steps = max_bad_steps
        self.check_grad_norm = check_grad_norm
        self.skipped = 0  # bad steps over the whole run (this process's view, equal on every rank)
        self.consecutive = 0
        self._loss_bad = torch.zeros((), device=accelerator.device)

    def add_loss(self, loss: torch.Tensor) -> None:
        """Note a micro-batch's loss; kept as a tensor until the step's decision (no synchronisation here)."""
        self._loss_bad = torch.maximum(self._loss_bad, (~torch.isfinite(loss.detach())).float())

    def step_is_bad(self, grad_norm=None) -> bool:
        """The agreed decision for the optimizer step that ends now (every rank must call it: a collective)."""
        bad = self._loss_bad
        if self.check_grad_norm and grad_norm is not None:
            bad = torch.maximum(bad, (~torch.isfinite(torch.as_tensor(grad_norm, device=bad.device))).float())
        agreed = bool(self.accelerator.gather(bad.reshape(1)).max().item() > 0)
        self._loss_bad = torch.zeros_like(self._loss_bad)
        self.skipped += agreed
        self.consecutive = self.consecutive + 1 if agreed else 0
        return agreed

    @property
    def diverged(self) -> bool:
        return self.consecutive >= self.max_bad_steps

    def divergence(self, saving: bool, model: torch.nn.Module, ema) -> str | None:
        """Why the run must stop now, or None: too many bad steps in a row, or, before a checkpoint (`saving`),
        weights of `model` or `ema` that are not finite on some rank (never checkpoint them, nor rotate good ones
        out). A collective when saving: every rank calls it."""
        if self.diverged:
            return f"{self.consecutive} consecutive steps with a non-finite loss or gradient norm"
        if saving and not all_finite(self.accelerator, local_weights(model, ema)):  # read only when saving
            return "the weights or their EMA are not finite"
        return None


def all_finite(accelerator: Accelerator, tensors: Iterable[torch.Tensor]) -> bool:
    """True on every rank iff every rank's `tensors` are finite (under ZeRO-3 pass each rank's own slices)."""
    # one flag per tensor, read once after the gather: a GPU synchronisation per check, not per tensor
    device = accelerator.device
    finite = [torch.isfinite(t).all().to(device) for t in tensors]
    bad = (~torch.stack(finite).all()).float().reshape(1) if finite else torch.zeros(1, device=device)
    return bool(accelerator.gather(bad).max().item() == 0)


def local_weights(model: torch.nn.Module, ema) -> list[torch.Tensor]:
    """The weights this rank holds: the model's parameters (their ZeRO-3 slices) and the EMA's shadows."""
    params = [getattr(p, "ds_tensor", p) for p in model.parameters()]
    return [*params, *ema.shadow_params]


def diverged_message(reason: str, step: int, last_good) -> str:
    """The one line a diverged run ends with: what happened, what was not written, where to resume from."""
    where = f"the last good checkpoint is {last_good}" if last_good else "no checkpoint was saved before it"
    return (f"training diverged at step {step}: {reason}; nothing was saved or exported from the diverged weights; "
            f"{where} (resume from it with a lower optim.lr or a gradient clip optim.grad_clip > 0, or check the data)")
