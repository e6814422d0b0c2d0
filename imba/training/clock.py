"""The training loop's clock: what the loop decides at each micro-batch from its settings and counters alone.

`train.py` asks it, and the tests ask the same object, so the loop's bookkeeping is tested as it runs: the samples
a step consumes (the global batch: this run's processes x `train.grad_accum` x `data.batch_size`, whatever this
process read), when an optimizer step ends (accelerate's accumulation says so), the stream position the checkpoint
records (`TrainState.samples`), and at the end of each optimizer step whether to log, to checkpoint and to stop.
Grids, validation and the online balancer's refreshes keep their own cadences in their hooks.
"""

from __future__ import annotations

from dataclasses import dataclass

from imba.training.checkpoints import TrainState
from imba.training.config import Config

__all__ = ["LoopClock", "StepEnd"]


@dataclass(frozen=True)
class StepEnd:
    """The decisions at the end of optimizer step `step` (counted from 1)."""

    step: int
    last: bool  # train.max_steps reached: the loop ends after this step
    log: bool  # a metrics line: every train.log_every steps and at the last step
    periodic_save: bool  # a train.save_every checkpoint; never of a skipped step (it may be diverging)

    def saving(self, preempted: bool) -> bool:
        """Whether this step ends with a checkpoint: the last step, a periodic one, or a pre-emption's."""
        return self.last or self.periodic_save or preempted


class LoopClock:
    """Counts the micro-batches of a run into optimizer steps and stream positions, in `state` (the checkpointed
    counters, restored and continued with `imba.training.resume.continue_stream` before the loop starts)."""

    def __init__(self, cfg: Config, processes: int, state: TrainState) -> None:
        self.state = state
        self.global_batch = cfg.global_batch(processes)  # samples of the global stream per optimizer step
        self.max_steps, self.log_every, self.save_every = cfg.train.max_steps, cfg.train.log_every, cfg.train.save_every

    @property
    def running(self) -> bool:
        """Whether another optimizer step is to be trained."""
        return self.state.step < self.max_steps

    @property
    def next_step(self) -> int:
        """The optimizer step the next micro-batch belongs to (counted from 1)."""
        return self.state.step + 1

    def micro_batch_done(self, sync_gradients: bool, skipped: bool) -> StepEnd | None:
        """After a micro-batch: None inside a gradient accumulation (`sync_gradients` False: accelerate's
        `accumulate` has not reached the optimizer step), else the optimizer step that ended, counted with the
        global batch it consumed, and what follows it. `skipped`: the divergence guard skipped its update."""
        if not sync_gradients:
            return None
        self.state.advance(self.global_batch)
        step = self.state.step
        last = step == self.max_steps
        periodic = bool(self.save_every) and step % self.save_every == 0 and not skipped
        return StepEnd(step, last, log=step % self.log_every == 0 or last, periodic_save=periodic)
