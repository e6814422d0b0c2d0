"""Resuming a run: which checkpoint, in which form, and where the LR schedule and the data continue.

Same process count: `load_state` reads the checkpoint as it is. Another process count: DDP checkpoints hold full
states and load as they are; DeepSpeed ZeRO-1/2/3 checkpoints partition the fp32 weights and AdamW moments per
rank, so the main process first converts them to DeepSpeed's universal form (`checkpoints.to_universal`), which the
engine re-partitions over the new ranks (`checkpoint.load_universal`). The LR schedule is re-counted in the new
unit.

Where the data continues (`stream_position`): at the samples of the global stream the run consumed, counted step by
step into the checkpoint (`TrainState.samples`), so any sequence of changes of process count, batch size or gradient
accumulation neither replays nor skips a sample of the weighted stream. A checkpoint that does not record it
continues at step x grad_accum x its processes x batch size, which is right when its run never changed them.

Which checkpoint: the main process verifies (`checkpoints.resolve_resume`: `latest` passes over damaged ones) and
every rank gets its answer, so the checkpoint is read once per run rather than once per rank, and all ranks raise
the same one-line error together.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from accelerate import Accelerator
from accelerate.utils import broadcast_object_list

from imba.training.checkpoints import (UNIVERSAL_DIR, TrainState, list_checkpoints, load_checkpoint, resolve_resume,
                                       saved_world_size, to_universal)
from imba.training.config import ConfigError
from imba.training.distributed import parameter_digest


@dataclass
class ResumePlan:
    checkpoint: Path | None  # what the run resumes from; None for a fresh run
    load_from: Path | None  # what `load_state` reads: the checkpoint itself or its universal form
    saved_world_size: int  # processes that wrote the checkpoint (the current count for a fresh run)


def plan_resume(resume: str, root: Path, accelerator: Accelerator, checksums: bool = True) -> ResumePlan:
    """Before `accelerator.prepare`: DeepSpeed reads `checkpoint.load_universal` when the engine is built.
    A fresh run into a folder that already holds checkpoints is refused (it would overwrite them). `checksums=False`
    verifies the checkpoint's file names and sizes only (see `checkpoints.verify_checkpoint`)."""
    now = accelerator.num_processes
    checkpoint = _resolve_on_main(resume, root, accelerator, checksums)
    if checkpoint is None:
        if list_checkpoints(root):
            raise ConfigError(f"{root} already holds checkpoints: resume (train.resume=latest, the default) "
                              "or pick another train.output_dir")
        return ResumePlan(None, None, now)
    saved = saved_world_size(checkpoint) or now
    load_from = checkpoint if saved == now else prepare_world_size_change(checkpoint, saved, accelerator)
    return ResumePlan(checkpoint, load_from, saved)


def _resolve_on_main(resume: str, root: Path, accelerator: Accelerator, checksums: bool = True) -> Path | None:
    """`resolve_resume` run by the main process (which prints what it passes over); every rank returns its result
    or raises its error. Every rank must call this."""
    outcome: list = [None]
    if accelerator.is_main_process:
        try:
            outcome = [resolve_resume(resume, root, checksums=checksums)]
        except (ConfigError, FileNotFoundError) as err:
            outcome = [err]
    if accelerator.num_processes > 1:
        broadcast_object_list(outcome)
    if isinstance(outcome[0], Exception):
        raise outcome[0]
    return outcome[0]


def prepare_world_size_change(checkpoint: Path, saved: int, accelerator: Accelerator) -> Path:
    """The folder to `load_state` a checkpoint written by `saved` processes from, on the current process count.
    DDP: the checkpoint itself (full states on every rank). DeepSpeed ZeRO-1/2/3: its universal form, converted
    once by the main process. Anything else: a one-line refusal."""
    checkpoint, now, plugin = Path(checkpoint), accelerator.num_processes, accelerator.state.deepspeed_plugin
    carried = "weights, optimizer, LR schedule and EMA carry over; the data continues where the run stopped"
    if plugin is None:
        accelerator.print(f"resuming a {saved}-process checkpoint on {now} processes: {carried}")
        return checkpoint
    if plugin.zero_stage not in (1, 2, 3):
        raise ConfigError(f"this checkpoint was written by {saved} processes; another process count is supported "
                          f"with DDP and DeepSpeed ZeRO-1/2/3, not ZeRO-{plugin.zero_stage}: "
                          f"resume with {saved} processes")
    universal = checkpoint / UNIVERSAL_DIR
    if accelerator.is_main_process and not universal.is_dir():
        print(f"converting the {saved}-process DeepSpeed checkpoint {checkpoint} to the universal format")
        to_universal(checkpoint)
    accelerator.wait_for_everyone()
    plugin.deepspeed_config.setdefault("checkpoint", {})["load_universal"] = True
    accelerator.print(f"resuming a {saved}-process ZeRO-{plugin.zero_stage} checkpoint on {now} processes through "
                      f"{universal}: {carried}")
    return universal


def restore(plan: ResumePlan, accelerator: Accelerator, state: TrainState, ema, lr_scheduler, model) -> None:
    """After `prepare` and `checkpoints.register_state`: load the checkpoint into every registered part."""
    load_checkpoint(accelerator, plan.checkpoint, plan.load_from)
    ema.to(accelerator.device)  # accelerate loads registered objects onto the CPU
    rescale_schedule(lr_scheduler, plan.saved_world_size, accelerator.num_processes)
    digest = parameter_digest(model)  # equal to the one a run ending at that step prints: loaded intact
    accelerator.print(f"resumed from {plan.checkpoint} at step {state.step}, parameters {digest}")


def rescale_schedule(lr_scheduler, saved: int, now: int) -> None:
    """accelerate steps a prepared scheduler once per process per optimizer step: after a change of process count,
    count the steps taken so far in the new unit, so that the warm-up continues where it was."""
    if saved != now:
        schedule = getattr(lr_scheduler, "scheduler", lr_scheduler)
        schedule.last_epoch = schedule.last_epoch // saved * now


@dataclass(frozen=True)
class StreamPosition:
    """Where the run's data continues: after `step` optimizer steps and `samples` samples of the global stream (the
    positions all ranks read together). `recorded`: counted by the run and saved in its checkpoint; False: worked out
    from the step count of a checkpoint that does not record it."""

    step: int
    samples: int
    recorded: bool = True

    def describe(self) -> str:
        if self.recorded:
            return f"{self.samples:,} samples (the position the checkpoint recorded)"
        return (f"{self.samples:,} samples (step x train.grad_accum x the checkpoint's processes x data.batch_size: "
                "the checkpoint records no position, which is right if its run never changed them)")


def stream_position(state: TrainState, unrecorded_per_step: int) -> StreamPosition:
    """The data position of a run restored into `state` (a fresh run: 0). A checkpoint that records none is taken to
    have read `unrecorded_per_step` samples per step all along."""
    if state.samples is not None:
        return StreamPosition(state.step, state.samples)
    return StreamPosition(state.step, state.step * unrecorded_per_step, recorded=False)


def global_batch_change(state: TrainState, unrecorded_per_step: int, samples_per_step: int) -> str | None:
    """A line for the log when a resumed run's global batch (`samples_per_step`: processes x grad_accum x batch size)
    differs from the checkpoint's (`unrecorded_per_step` where the checkpoint does not record it); None when it is
    the same, and for a fresh run."""
    if state.step == 0:
        return None
    before = state.samples_per_step or unrecorded_per_step
    if before == samples_per_step:
        return None
    return (f"the global batch changes from {before} to {samples_per_step} samples per step (processes x "
            f"train.grad_accum x data.batch_size); the data continues at the same position. The LR schedule counts "
            f"steps, so warm-up and decay go on by step while each step now reads {samples_per_step / before:.3g}x "
            f"the samples: scale optim.lr yourself to keep the learning rate per sample")


def continue_stream(plan: ResumePlan, accelerator: Accelerator, state: TrainState, global_batch: int
                    ) -> StreamPosition:
    """After `restore` (or for a fresh run): where the data continues, with a line when the global batch changed;
    `state` then counts in this run's processes and global batch (`global_batch` samples a step)."""
    # what a checkpoint that records no position read per step: its processes, this run's batch and accumulation
    unrecorded = global_batch // accelerator.num_processes * plan.saved_world_size
    if change := global_batch_change(state, unrecorded, global_batch):
        accelerator.print(change)
    position = stream_position(state, unrecorded)
    state.world_size, state.samples, state.samples_per_step = accelerator.num_processes, position.samples, global_batch
    return position
