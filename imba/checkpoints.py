"""Checkpoint folders: `<output_dir>/checkpoints/step_0000100/`, each a complete `accelerator.save_state`.

A checkpoint is written under a temporary name and renamed once every rank has finished, so a folder named
`step_*` is always complete; `latest` resolves to the newest of them. Only the newest `keep` are kept.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from accelerate import Accelerator

_STEP_DIR = re.compile(r"^step_(\d+)$")


class TrainState:
    """The loop's own counters, saved and restored with the checkpoint (accelerate `register_for_checkpointing`)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under root, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return [p for _, p in sorted(found)]


def resolve_resume(resume: str | None, root: Path) -> Path | None:
    """None → None; "latest" → newest checkpoint under root, or None if there is none; a path → that folder."""
    if not resume:
        return None
    if resume == "latest":
        found = list_checkpoints(root)
        return found[-1] if found else None
    path = Path(resume)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint {resume!r} not found; pass --resume latest or a step_* folder")
    return path


def save_checkpoint(accelerator: Accelerator, root: Path, step: int, keep: int) -> Path:
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
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        for old in list_checkpoints(root)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final
