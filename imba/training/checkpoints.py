"""Checkpoint folders: `<output_dir>/checkpoints/step_0000100/`, each a complete `accelerator.save_state`.

Writing order, so that a crash or pre-emption at any moment leaves only complete checkpoints behind:
1. every rank writes into `.tmp_step_…` (DeepSpeed writes shards on every rank; accelerate's DDP save writes on the
   main process), plus the resolved `config.yaml`;
2. once all ranks are done, the main process renames the folder to `step_…`;
3. the `latest` pointer file is rewritten (atomically) to name it;
4. checkpoints beyond the newest `keep` are deleted.
`resume latest` follows the pointer, or falls back to the newest `step_*` folder if the pointer is missing.

The universal form (`to_universal`): DeepSpeed ZeRO-1/2/3 checkpoints partition the fp32 weights and AdamW moments
per rank; DeepSpeed's `ds_to_universal` converts the engine's part into `<checkpoint>/universal/` (once, tmp →
rename), which loads on any process count (`imba.training.resume`). `python -m imba.training.checkpoints
to-universal CHECKPOINT` converts ahead of time.

This module is the one place that knows the file layout inside a checkpoint folder.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
from pathlib import Path

import torch
from accelerate import Accelerator

from data.files import atomic_write
from imba.training.config import ConfigError

_STEP_DIR = re.compile(r"^step_(\d+)$")
LATEST = "latest"
# accelerate names registered objects by registration order: `register_state` registers the EMA, then the TrainState
EMA_STATE_FILE = "custom_checkpoint_0.pkl"
TRAIN_STATE_FILE = "custom_checkpoint_1.pkl"
CONFIG_FILE = "config.yaml"  # the run's resolved config, written into every checkpoint
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


def register_state(accelerator: Accelerator, ema, state: TrainState) -> None:
    """Have `save_state`/`load_state` carry the EMA and the loop's counters, in the order the file names above
    assume."""
    accelerator.register_for_checkpointing(ema, state)


def is_checkpoint(folder: Path) -> bool:
    """True for a folder `save_checkpoint` wrote (it holds the run's config and the EMA state)."""
    return (Path(folder) / CONFIG_FILE).is_file() and (Path(folder) / EMA_STATE_FILE).is_file()


def load_ema_state(checkpoint: Path) -> dict:
    """The EMA's state dict as saved in a checkpoint, on the CPU (whole tensors in every mode: ZeRO-3's slices are
    gathered to save)."""
    return torch.load(Path(checkpoint) / EMA_STATE_FILE, weights_only=False, map_location="cpu")


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
            (tmp / CONFIG_FILE).write_text(config_text)
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        atomic_write(root / LATEST, (final.name + "\n").encode())
        for old in list_checkpoints(root)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


if __name__ == "__main__":  # python -m imba.training.checkpoints to-universal CHECKPOINT [WORKERS]
    if sys.argv[1:2] != ["to-universal"] or len(sys.argv) not in (3, 4):
        sys.exit("usage: python -m imba.training.checkpoints to-universal CHECKPOINT_FOLDER [WORKERS]")
    try:
        print(f"wrote {to_universal(Path(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) == 4 else 4)}")
    except ConfigError as err:
        sys.exit(f"error: {err}")
