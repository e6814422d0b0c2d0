"""One training micro-step, as `train.py` and the composition benchmark (`bench/composition.py`) both take it: the
loss on a noised batch, the hooks' `micro_batch` point, the backward pass and, at the end of a gradient
accumulation, the gradient clip, the divergence guard's agreed decision and the optimizer and LR-schedule steps.

What differs between its users is what they build it from (the model, the optimizer and its schedule, the loss, the
hooks), never the order of these operations; so a change here is what both the training runs and the benchmark's
numbers see.
"""

from __future__ import annotations

from accelerate import Accelerator

from imba.training.guard import DivergenceGuard
from imba.training.hooks import Hooks

__all__ = ["TrainStep"]


class TrainStep:
    """`step(n, batch, noised, cond, null, **loss_kwargs)` → (the loss's stats, whether optimizer step `n` was
    skipped). `n` is the optimizer step the micro-batch belongs to (counted from 1), `batch` what the hooks see of it,
    `noised` its noised inputs (`imba.objectives.NoisedBatch`), `cond` and `null` (embeds, mask) its captions and the
    null caption per row; `loss_kwargs` go to `loss_fn(predict, noised, cond, null, ...)` (e.g. a generator for the
    caption dropout). The stats gain `grad_norm` when the gradients are clipped (`grad_clip` > 0). A step is skipped
    (no optimizer update; the schedule still advances) when the guard finds its loss or gradient norm not finite on
    some rank; under fp16 the GradScaler judges the gradients itself. The caller steps the EMA unless skipped, when
    `accelerator.sync_gradients` says the optimizer step ended."""

    def __init__(self, accelerator: Accelerator, wrapped, optimizer, lr_scheduler, loss_fn, predict, hooks: Hooks,
                 guard: DivergenceGuard, grad_clip: float) -> None:
        self.accelerator, self.wrapped, self.optimizer, self.lr_scheduler = accelerator, wrapped, optimizer, lr_scheduler
        self.loss_fn, self.predict, self.hooks, self.guard, self.grad_clip = loss_fn, predict, hooks, guard, grad_clip

    def __call__(self, step: int, batch, noised, cond, null, **loss_kwargs) -> tuple[dict, bool]:
        accelerator = self.accelerator
        with accelerator.accumulate(self.wrapped):
            with accelerator.autocast():
                loss, stats = self.loss_fn(self.predict, noised, cond, null, **loss_kwargs)
                self.hooks.micro_batch(step, batch, stats, self.predict, noised, null)
            accelerator.backward(loss)  # under DeepSpeed this also steps, unless its overflow check skips
            self.guard.add_loss(loss)
            skip = False
            if accelerator.sync_gradients:
                if self.grad_clip > 0:
                    stats["grad_norm"] = accelerator.clip_grad_norm_(self.wrapped.parameters(), self.grad_clip)
                skip = self.guard.step_is_bad(stats.get("grad_norm"))  # one decision, agreed by every rank
            if not skip or accelerator.scaler is not None:  # fp16: the GradScaler skips non-finite gradients
                self.optimizer.step()
            self.lr_scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
        return stats, skip
