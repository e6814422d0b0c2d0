"""What the training loop calls beside the step itself, at named points: the hooks of a run.

A hook is any object with some of these methods; `Hooks` calls each hook that has one at its point, in the order
the hooks were added:
- `micro_batch(step, batch, stats, predict, noised, null)`: after each micro-batch's loss, before its backward pass:
  the optimizer step it belongs to (counted from 1), the batch, the loss's stats, and for a hook that measures the
  model on the batch the run's `predict(noisy, timesteps, embeds, mask)`, the batch's noised inputs and its null
  caption (embeds, mask) per row.
- `step_end(step, accelerator)`: after optimizer step `step`; returns a line for the log, or None.
- `before_save(accelerator)`: before a checkpoint is written: the hook's reductions over the ranks, so that the state
  it saves is complete.
A hook with state also has `state_dict`/`load_state_dict` and names its checkpoint part `CHECKPOINT` (with
`CHECKPOINT_PER_RANK = True` for state that differs per rank); `Hooks.checkpointed` lists them for the run's
checkpoint map (`imba.training.checkpoints.register_state`).
"""

from __future__ import annotations

from typing import Any, Iterable

__all__ = ["Hooks"]

POINTS = ("micro_batch", "step_end", "before_save")


class Hooks:
    """The run's hooks; None entries (a hook a setting turned off) are left out."""

    def __init__(self, accelerator, hooks: Iterable[Any] = ()) -> None:
        self.accelerator = accelerator
        self.hooks: list[Any] = []
        for hook in hooks:
            self.add(hook)

    def add(self, hook: Any) -> None:
        if hook is None:
            return
        if not any(callable(getattr(hook, point, None)) for point in POINTS):
            raise TypeError(f"{type(hook).__name__} has none of the hook points {', '.join(POINTS)}")
        self.hooks.append(hook)

    def _at(self, point: str) -> list:
        return [getattr(hook, point) for hook in self.hooks if callable(getattr(hook, point, None))]

    def micro_batch(self, step: int, batch: dict, stats: dict, predict, noised, null) -> None:
        for call in self._at("micro_batch"):
            call(step, batch, stats, predict, noised, null)

    def step_end(self, step: int) -> list[str]:
        """Each hook's line for the log after optimizer step `step` (those that have one)."""
        return [line for call in self._at("step_end") if (line := call(step, self.accelerator))]

    def before_save(self) -> None:
        for call in self._at("before_save"):
            call(self.accelerator)

    def checkpointed(self) -> dict[str, tuple[Any, bool]]:
        """{checkpoint part name: (hook, per rank)} of the hooks with state."""
        parts = {}
        for hook in self.hooks:
            name = getattr(hook, "CHECKPOINT", None)
            if name is not None:
                if name in parts:
                    raise ValueError(f"two hooks name the checkpoint part {name!r}")
                parts[name] = (hook, bool(getattr(hook, "CHECKPOINT_PER_RANK", False)))
        return parts
