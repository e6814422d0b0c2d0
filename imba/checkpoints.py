"""Checkpoint folders: `<output_dir>/checkpoints/step_0000100/`, each a complete `accelerator.save_state`.

Writing order, so that a crash or pre-emption at any moment leaves only complete checkpoints behind:
1. every rank writes into `.tmp_step_…` (DeepSpeed writes shards on every rank; accelerate's DDP save writes on the
   main process), plus the resolved `config.yaml`;
2. once all ranks are done, the main process renames the folder to `step_…`;
3. the `latest` pointer file is rewritten (atomically) to name it;
4. checkpoints beyond the newest `keep` are deleted.
`resume latest` follows the pointer, or falls back to the newest `step_*` folder if the pointer is missing.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from pathlib import Path

import torch
from accelerate import Accelerator

_STEP_DIR = re.compile(r"^step_(\d+)$")
LATEST = "latest"
# accelerate names registered objects by registration order; train.py registers the EMA, then the TrainState
EMA_STATE_FILE = "custom_checkpoint_0.pkl"
TRAIN_STATE_FILE = "custom_checkpoint_1.pkl"


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
    """A short hash of every parameter's bytes: equal on all ranks iff their weights are bitwise identical."""
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]
