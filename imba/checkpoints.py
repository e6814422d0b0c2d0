"""Checkpoint folders: `<output_dir>/checkpoints/step_0000100/`, each a complete `accelerator.save_state`.

Writing order, so that a crash or pre-emption at any moment leaves only complete checkpoints behind:
1. every rank writes into `.tmp_step_…` (DeepSpeed writes shards on every rank; accelerate's DDP save writes on the
   main process), plus the resolved `config.yaml`;
2. once all ranks are done, the main process renames the folder to `step_…`;
3. the `latest` pointer file is rewritten (atomically) to name it;
4. checkpoints beyond the newest `keep` are deleted.
`resume latest` follows the pointer, or falls back to the newest `step_*` folder if the pointer is missing.

Resuming on another process count (`prepare_world_size_change`): DDP checkpoints hold full states and load as they
are. DeepSpeed ZeRO-1/2/3 checkpoints partition the fp32 weights and AdamW moments per rank, so the main process first
converts the engine's part with DeepSpeed's `ds_to_universal` into `<checkpoint>/universal/` (once, tmp → rename;
`python -m imba.checkpoints to-universal CHECKPOINT` does it ahead of time) and the engine loads that with
`checkpoint.load_universal`, re-partitioning the states over the new ranks.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import re
import shutil
import sys
from pathlib import Path

import torch
from accelerate import Accelerator

from imba.config import ConfigError
from imba.ema import is_partitioned

_STEP_DIR = re.compile(r"^step_(\d+)$")
LATEST = "latest"
# accelerate names registered objects by registration order; train.py registers the EMA, then the TrainState
EMA_STATE_FILE = "custom_checkpoint_0.pkl"
TRAIN_STATE_FILE = "custom_checkpoint_1.pkl"
DEEPSPEED_TAG = "pytorch_model"  # the folder accelerate's save_state gives the DeepSpeed engine's shards
UNIVERSAL_DIR = "universal"  # <checkpoint>/universal/: the same checkpoint with the engine's part in universal form


class TrainState:
    """The loop's own counters, saved and restored with the checkpoint (accelerate `register_for_checkpointing`).

    `world_size` is the number of processes that wrote the checkpoint (None before the first save or load).
    """

    def __init__(self, world_size: int | None = None) -> None:
        self.step = 0
        self.world_size = world_size

    def state_dict(self) -> dict:
        return {"step": self.step, "world_size": self.world_size}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
        self.world_size = state.get("world_size")


def saved_world_size(checkpoint: Path) -> int | None:
    """How many processes wrote the checkpoint, read before loading it (None if it does not say)."""
    state = torch.load(Path(checkpoint) / TRAIN_STATE_FILE, weights_only=False, map_location="cpu")
    return state.get("world_size")


def to_universal(checkpoint: Path, workers: int = 1) -> Path:
    """`<checkpoint>/universal/`, written once: the DeepSpeed ZeRO-1/2/3 shards converted by DeepSpeed's
    `ds_to_universal` (full fp32 weights, AdamW exp_avg/exp_avg_sq and step per parameter, loadable on any process
    count) next to links to the checkpoint's other files (LR schedule, EMA, step, RNG states)."""
    checkpoint = Path(checkpoint)
    final, source = checkpoint / UNIVERSAL_DIR, checkpoint / DEEPSPEED_TAG
    if final.is_dir():
        return final
    if not any(source.glob("*_optim_states.pt")):
        raise ConfigError(f"{checkpoint} holds no DeepSpeed ZeRO optimizer shards ({source}/*_optim_states.pt)")
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    tmp = checkpoint / f".tmp_{UNIVERSAL_DIR}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    # workers > 1 forks processes: only from a plain process, not from inside a distributed run
    ds_to_universal(argparse.Namespace(input_folder=str(source), output_folder=str(tmp / DEEPSPEED_TAG),
                                       num_extract_workers=workers, num_merge_workers=workers,
                                       keep_temp_folder=False, strict=True, inject_missing_state=True))
    for item in checkpoint.iterdir():
        if item.is_file():
            try:
                os.link(item, tmp / item.name)  # the EMA can be large: link rather than copy where possible
            except OSError:
                shutil.copy2(item, tmp / item.name)
    tmp.rename(final)
    return final


def prepare_world_size_change(checkpoint: Path, saved: int, accelerator: Accelerator) -> Path:
    """Before `accelerator.prepare` (DeepSpeed reads `checkpoint.load_universal` when the engine is built): the folder
    to `load_state` a checkpoint written by `saved` processes from on the current process count. DDP: the checkpoint
    itself (full states on every rank). DeepSpeed ZeRO-1/2/3: its universal form, converted once by the main process.
    Anything else: a one-line refusal."""
    checkpoint, now, plugin = Path(checkpoint), accelerator.num_processes, accelerator.state.deepspeed_plugin
    carried = "weights, optimizer, LR schedule and EMA carry over; data continues after the same number of samples"
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


def rescale_schedule(lr_scheduler, saved: int, now: int) -> None:
    """accelerate steps a prepared scheduler once per process per optimizer step: after a change of process count,
    count the steps taken so far in the new unit, so that the warm-up continues where it was."""
    if saved != now:
        schedule = getattr(lr_scheduler, "scheduler", lr_scheduler)
        schedule.last_epoch = schedule.last_epoch // saved * now


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under root, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return [p for _, p in sorted(found)]


def resolve_resume(resume: str | None, root: Path) -> Path | None:
    """"none"/None → None; "latest" → the checkpoint the pointer names (else the newest), or None if there is
    none yet; a path → that folder."""
    if not resume or resume == "none":
        return None
    root = Path(root)
    if resume == LATEST:
        pointer = root / LATEST
        if pointer.is_file():
            named = root / pointer.read_text().strip()
            if _STEP_DIR.match(named.name) and named.is_dir():
                return named
        found = list_checkpoints(root)
        return found[-1] if found else None
    path = Path(resume)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint {resume!r} not found; pass --resume latest or a step_* folder")
    return path


def save_checkpoint(accelerator: Accelerator, root: Path, step: int, keep: int, config_text: str = "") -> Path:
    """Every rank must call this (DeepSpeed saves shards on every rank)."""
    root = Path(root)
    final = root / f"step_{step:07d}"
    tmp = root / f".tmp_step_{step:07d}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        root.mkdir(parents=True, exist_ok=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        if config_text:
            (tmp / "config.yaml").write_text(config_text)
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        pointer_tmp = root / f".{LATEST}.tmp"
        pointer_tmp.write_text(final.name + "\n")
        os.replace(pointer_tmp, root / LATEST)
        for old in list_checkpoints(root)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def parameter_digest(model: torch.nn.Module) -> str:
    """A short hash of every parameter's bytes: equal on all ranks iff their weights are bitwise identical.
    Under ZeRO-3 the parameters are gathered first, a collective: call it on every rank."""
    params = list(model.parameters())
    gathered = contextlib.nullcontext()
    if is_partitioned(params):
        import deepspeed

        gathered = deepspeed.zero.GatheredParameters(params)
    digest = hashlib.sha256()
    with gathered:
        for p in params:
            digest.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


if __name__ == "__main__":  # python -m imba.checkpoints to-universal CHECKPOINT [WORKERS]
    if sys.argv[1:2] != ["to-universal"] or len(sys.argv) not in (3, 4):
        sys.exit("usage: python -m imba.checkpoints to-universal CHECKPOINT_FOLDER [WORKERS]")
    try:
        print(f"wrote {to_universal(Path(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) == 4 else 4)}")
    except ConfigError as err:
        sys.exit(f"error: {err}")
