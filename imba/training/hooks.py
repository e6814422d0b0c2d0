"""What the training loop calls beside the step itself, at named points: the hooks of a run.

A hook is any object with some of these methods; `Hooks` calls each hook that has one at its point, in the order
the hooks were added:
- `micro_batch(step, batch, stats, predict, noised, null)`: after each micro-batch's loss, before its backward pass:
  the optimizer step it belongs to (counted from 1), the batch, the loss's stats, and for a hook that measures the
  model on the batch the run's `predict(noisy, timesteps, embeds, mask)`, the batch's noised inputs and its null
  caption (embeds, mask) per row.
- `step_end(step, accelerator)`: after optimizer step `step`; returns a line for the log, or None.
- `evaluate(step, model, ema)`: after the EMA's update, every rank: metrics measured on the model (e.g. the EMA on
  the held-out set, on its own schedule), {} when it measures nothing at this step. The loop logs them at once and
  leaves their time out of the training rate.
- `means()`: at a logging step: the means of what the hook gathered since the last one, reduced over the ranks with
  the loss's own.
- `before_save(accelerator)`: before a checkpoint is written: the hook's reductions over the ranks, so that the state
  it saves is complete.
- `between_steps(step, model, ema)`: after the checkpoint, every rank, unless the run ends or stops at this step:
  work on the model that is no part of the training (e.g. a sample grid every train.sample_every steps), timed apart.
A hook with state also has `state_dict`/`load_state_dict` and names its checkpoint part `CHECKPOINT` (with
`CHECKPOINT_PER_RANK = True` for state that differs per rank); `Hooks.checkpointed` lists them for the run's
checkpoint map (`imba.training.checkpoints.register_state`).
"""

from __future__ import annotations

from typing import Any, Iterable

__all__ = ["Hooks"]

POINTS = ("micro_batch", "step_end", "evaluate", "means", "before_save", "between_steps")


class Hooks:
    """The run's hooks; None entries (a hook a setting turned off) are left out."""

    def __init__(self, accelerator, hooks: Iterable[Any] = ()) -> None:
        self.accelerator = accelerator
        self.hooks: list[Any] = []
        self.mapped = False  # whether `checkpointed` has given the run its checkpoint map
        for hook in hooks:
            self.add(hook)

    def add(self, hook: Any) -> None:
        if hook is None:
            return
        if not any(callable(getattr(hook, point, None)) for point in POINTS):
            raise TypeError(f"{type(hook).__name__} has none of the hook points {', '.join(POINTS)}")
        if self.mapped and getattr(hook, "CHECKPOINT", None) is not None:  # its state would never be saved
            raise ValueError(f"{type(hook).__name__} has state ({hook.CHECKPOINT}) but comes after the run's "
                             "checkpoint map was made (Hooks.checkpointed): add it before")
        self.hooks.append(hook)

    def _at(self, point: str) -> list:
        return [getattr(hook, point) for hook in self.hooks if callable(getattr(hook, point, None))]

    def micro_batch(self, step: int, batch: dict, stats: dict, predict, noised, null) -> None:
        for call in self._at("micro_batch"):
            call(step, batch, stats, predict, noised, null)

    def step_end(self, step: int) -> list[str]:
        """Each hook's line for the log after optimizer step `step` (those that have one)."""
        return [line for call in self._at("step_end") if (line := call(step, self.accelerator))]

    def evaluate(self, step: int, model, ema) -> dict[str, float]:
        """Every hook's metrics of step `step`, in one mapping."""
        return {name: value for call in self._at("evaluate") for name, value in call(step, model, ema).items()}

    def means(self) -> dict[str, float]:
        """Every hook's means since the last logging step, in one mapping."""
        return {name: value for call in self._at("means") for name, value in call().items()}

    def before_save(self) -> None:
        for call in self._at("before_save"):
            call(self.accelerator)

    def between_steps(self, step: int, model, ema) -> None:
        for call in self._at("between_steps"):
            call(step, model, ema)

    def checkpointed(self) -> dict[str, tuple[Any, bool]]:
        """{checkpoint part name: (hook, per rank)} of the hooks with state; a hook with state added later is
        refused."""
        self.mapped = True
        parts = {}
        for hook in self.hooks:
            name = getattr(hook, "CHECKPOINT", None)
            if name is not None:
                if name in parts:
                    raise ValueError(f"two hooks name the checkpoint part {name!r}")
                parts[name] = (hook, bool(getattr(hook, "CHECKPOINT_PER_RANK", False)))
        return parts
