"""Checkpoint folders: `<output_dir>/checkpoints/step_0000100/`, each a complete `accelerator.save_state` plus the
parts registered here (EMA, the loop's counters, per-rank state), the run's config and a manifest.

Writing order, so that a crash, a pre-emption, a power loss or a full disk at any moment leaves only complete
checkpoints behind:
1. every rank writes into `.tmp_step_…` (DeepSpeed writes shards on every rank; accelerate's DDP save writes on the
   main process, and so do the registered parts, but for each rank's own `rank_state/` file);
2. once all ranks are done, the main process adds the resolved `config.yaml` and `manifest.json` (every file's
   relative path, size and SHA-256: `imba.training.integrity`), flushes every file and folder to disk, renames the
   folder to `step_…` and flushes the parent folder: a power loss cannot leave a `step_…` name without its data;
3. the `latest` pointer file is rewritten (atomically) to name it, and the parent folder flushed again;
4. checkpoints older than the new one are deleted beyond the newest `keep` (counting the new one).
A save that fails (a full disk reaches here as OSError, or from accelerate's writers as torch's `RuntimeError: …
unexpected pos …` or a `SafetensorError`) removes its partial folder, leaves the earlier checkpoints and `latest`
as they were, and raises a one-line `CheckpointError` on every rank.

Resuming (`resolve_resume`): `latest` tries the checkpoint the pointer names (or the newest `step_*` folder if the
pointer is missing), then the others newest first, and takes the first that verifies (`verify_checkpoint`); each
one passed over is reported in one line. A folder named explicitly (`train.resume=PATH`, `train.py --export PATH`)
must verify (`require_intact`). If checkpoints exist but none is intact, a one-line error: a run never silently
starts over from step 0.

A folder without a manifest cannot be verified. This module always writes one, so such a folder predates manifests
or is a copy that lost it. `latest` passes over it like a damaged one: resuming it unverified is exactly how a
truncated file used to surface as a raw safetensors traceback, and a careful user wants the choice to be theirs. The
error then names the override: naming the folder explicitly is that choice, and it is used with a one-line warning
if it holds a checkpoint's config and EMA state.

Verification reads the whole checkpoint once more (SHA-256 at about 1.3 s per GB on one core, files hashed in
parallel: some 10-20 s for the ~16 GB checkpoint of a 1B model); `checksums=False` checks names and sizes only
(missing and truncated files), at no cost.

The universal form (`to_universal`): DeepSpeed ZeRO-1/2/3 checkpoints partition the fp32 weights and AdamW moments
per rank; DeepSpeed's `ds_to_universal` converts the engine's part into `<checkpoint>/universal/` (once, tmp →
rename), which loads on any process count (`imba.training.resume`). `python -m imba.training.checkpoints
to-universal CHECKPOINT` converts ahead of time. It is derived from a verified checkpoint and not in the manifest.

The layout (format 2, `FORMAT`; `manifest.json` says `"format": 2`): accelerate's `save_state` files (model or
DeepSpeed shards, optimizer, LR schedule, `random_states_<rank>.pkl`), then the parts registered here (`register`),
each in a file named by what it holds: `<name>.pt` for state equal on every rank (the main process's is saved:
`ema.pt`, `train_state.pt`, `loss.pt`), `rank_state/rank_<rank, 5 digits>.pt` for state that differs per rank (every rank
writes its own: {name: state}). On a resume, rank r reads `rank_state/rank_r` if the checkpoint has it, else its
per-rank parts start fresh (a run on more processes than wrote the checkpoint), and files of ranks that no longer
exist are not read. A part the checkpoint does not hold (registered by newer code) starts fresh, in one line; the
training loss's state (`loss.pt`) is read from `train_state.pt`'s entry "loss" in checkpoints that kept it there.
Format 1 (a manifest without `format`) let accelerate's `register_for_checkpointing` name the EMA and the counters
`custom_checkpoint_0.pkl` and `custom_checkpoint_1.pkl` by registration order; it is read as it is. A format newer
than this code's is a one-line error.

This module is the one place that knows the file layout inside a checkpoint folder.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import sys
import tempfile
import weakref
from pathlib import Path
from typing import Callable, Iterator

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object

from data.files import atomic_write, read_json_object, write_json
from imba.training.config import ConfigError
from imba.training.integrity import check_manifest, folder_manifest, fsync_dir, fsync_tree
from imba.training.run_folder import CHECKPOINTS_DIR

_STEP_DIR = re.compile(r"^step_(\d+)$")
_TMP_PREFIX = ".tmp_step_"
LATEST = "latest"
FORMAT = 2  # the layout this code writes (the module docstring), as "format" in manifest.json; none there: 1
EMA_STATE_FILE = "ema.pt"  # the registered part "ema": `<name>.pt`
TRAIN_STATE_FILE = "train_state.pt"
RANK_STATE_DIR = "rank_state"  # rank_state/rank_00000.pt ...: each rank's own parts
# format 1: accelerate's `register_for_checkpointing` named the parts by registration order (EMA, then TrainState)
FORMAT1_FILES = {"ema": "custom_checkpoint_0.pkl", "train_state": "custom_checkpoint_1.pkl"}
# parts that checkpoints of formats 1 and 2 written before they had a file of their own kept as an entry of
# train_state's (the training loss's running means)
INSIDE_TRAIN_STATE = ("loss",)
_ACCELERATE_CUSTOM = re.compile(r"^custom_checkpoint_\d+\.pkl$")  # what accelerate's load_state counts
_PART_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
CONFIG_FILE = "config.yaml"  # the run's resolved config, written into every checkpoint
MANIFEST_FILE = "manifest.json"  # every other file's relative path, size and SHA-256
DEEPSPEED_TAG = "pytorch_model"  # the folder accelerate's save_state gives the DeepSpeed engine's shards
UNIVERSAL_DIR = "universal"  # <checkpoint>/universal/: the same checkpoint with the engine's part in universal form
_FULL_DISK_BYTES = 64 << 20  # a failed write with less than this free on the disk is put down to a full disk


class CheckpointError(ConfigError):
    """A checkpoint that cannot be written or trusted. A ConfigError, so that entry points print it as one line."""


class TrainState:
    """The loop's own counters, saved and restored with the checkpoint (`train_state.pt`, see `register_state`).

    `world_size` is the number of processes that wrote the checkpoint (None before the first save or load).
    `samples`: the samples of the global stream the run has consumed, counted step by step, so that a resume
    continues at the right place after any sequence of changes of process count, batch size or accumulation (None
    after loading a checkpoint that does not record it); the loader continues from it. `samples_per_step`: the
    global batch of the run that wrote the checkpoint (processes x grad_accum x batch size; None: not recorded).
    `data`: the fingerprint of the samples that position counts in (`data.stream.reader_fingerprint`; None: not
    recorded, or a stream without one).
    """

    def __init__(self, world_size: int | None = None) -> None:
        self.step = 0
        self.world_size = world_size
        self.samples: int | None = 0
        self.samples_per_step: int | None = None
        self.data: str | None = None

    def advance(self, samples: int) -> None:
        """One optimizer step done, which consumed `samples` samples of the global stream."""
        self.step += 1
        self.samples += samples

    def state_dict(self) -> dict:
        return {"step": self.step, "world_size": self.world_size, "samples": self.samples,
                "samples_per_step": self.samples_per_step, "data": self.data}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
        self.world_size = state.get("world_size")
        self.samples = None if state.get("samples") is None else int(state["samples"])
        self.samples_per_step = state.get("samples_per_step")
        self.data = state.get("data")


class _Parts:
    """The objects (with `state_dict`/`load_state_dict`) an accelerator's checkpoints carry, by name."""

    def __init__(self) -> None:
        self.shared: dict = {}  # equal on every rank: <name>.pt
        self.per_rank: dict = {}  # each rank's own: rank_state/rank_<r>.pt


_REGISTERED: "weakref.WeakKeyDictionary[Accelerator, _Parts]" = weakref.WeakKeyDictionary()


def register(accelerator: Accelerator, name: str, obj, per_rank: bool = False) -> None:
    """Have `save_checkpoint` and `load_checkpoint` carry `obj` (anything with `state_dict`/`load_state_dict`) as
    `name`: in `<name>.pt`, or with `per_rank` in each rank's `rank_state/` file (the module docstring's rule)."""
    if not _PART_NAME.match(name):
        raise ValueError(f"checkpoint part name {name!r}: lower-case letters, digits and _ only")
    parts = _REGISTERED.setdefault(accelerator, _Parts())
    if name in parts.shared or name in parts.per_rank:
        raise ValueError(f"checkpoint part {name!r} is registered twice")
    (parts.per_rank if per_rank else parts.shared)[name] = obj


def register_state(accelerator: Accelerator, ema, state: TrainState, loss=None, parts: dict | None = None) -> None:
    """The run's checkpoint map: have the checkpoints carry the EMA (`ema.pt`), the loop's counters
    (`train_state.pt`), the training loss's running state (`loss.pt`) and `parts`, {name: (object, per rank)} (the
    hooks' states, `Hooks.checkpointed`)."""
    register(accelerator, "ema", ema)
    register(accelerator, "train_state", state)
    if loss is not None:
        register(accelerator, "loss", loss)
    for name, (obj, per_rank) in (parts or {}).items():
        register(accelerator, name, obj, per_rank=per_rank)


def checkpoint_format(folder: Path) -> int:
    """The layout of a checkpoint folder: its manifest's "format" (1 if it names none); without a manifest, what
    its files show. A format newer than this code's is a one-line CheckpointError."""
    folder = Path(folder)
    if not (folder / MANIFEST_FILE).is_file():
        return 1 if (folder / FORMAT1_FILES["ema"]).is_file() else FORMAT
    manifest = read_json_object(folder / MANIFEST_FILE) or {}
    found = manifest.get("format", 1)
    if not isinstance(found, int) or isinstance(found, bool) or not 1 <= found <= FORMAT:
        raise CheckpointError(f"{folder} is a checkpoint of format {found!r}, which this version of the code cannot "
                              f"read (it reads formats 1 to {FORMAT}): use the version that wrote it, or a newer one")
    return found


def part_file(checkpoint: Path, name: str) -> Path | None:
    """Where a checkpoint of its format keeps the part `name` (equal on every rank); None where the format has no
    place for it (a part format 1 did not save)."""
    checkpoint = Path(checkpoint)
    if checkpoint_format(checkpoint) == 1:
        return checkpoint / FORMAT1_FILES[name] if name in FORMAT1_FILES else None
    return checkpoint / f"{name}.pt"


def rank_file(checkpoint: Path, rank: int) -> Path:
    return Path(checkpoint) / RANK_STATE_DIR / f"rank_{rank:05d}.pt"


def _load(path: Path):
    return torch.load(path, weights_only=False, map_location="cpu")


def is_checkpoint(folder: Path) -> bool:
    """True for a folder `save_checkpoint` wrote, in any format (it holds the run's config and the EMA state)."""
    folder = Path(folder)
    return (folder / CONFIG_FILE).is_file() and any((folder / name).is_file()
                                                     for name in (EMA_STATE_FILE, FORMAT1_FILES["ema"]))


def load_ema_state(checkpoint: Path) -> dict:
    """The EMA's state dict as saved in a checkpoint, on the CPU (whole tensors in every mode: ZeRO-3's slices are
    gathered to save)."""
    return _load(part_file(checkpoint, "ema"))


def saved_world_size(checkpoint: Path) -> int | None:
    """How many processes wrote the checkpoint, read before loading it (None if it does not say)."""
    return _load(part_file(checkpoint, "train_state")).get("world_size")


def _inside_train_state(checkpoint: Path, name: str):
    """The state of part `name` where a checkpoint that holds no file of its own kept it (`INSIDE_TRAIN_STATE`), or
    None."""
    path = part_file(checkpoint, "train_state")
    if name not in INSIDE_TRAIN_STATE or path is None or not path.is_file():
        return None
    return _load(path).get(name)


def _save_parts(accelerator: Accelerator, folder: Path) -> None:
    """The registered parts into `folder`, beside `save_state`'s files. Every rank must call this: a part's
    `state_dict` may be a collective (the ZeRO-3 EMA gathers its slices)."""
    parts = _REGISTERED.get(accelerator)
    if parts is None:
        return
    for name, obj in parts.shared.items():  # the same order on every rank: the collectives pair up
        state = obj.state_dict()
        if accelerator.is_main_process:
            torch.save(state, folder / f"{name}.pt")
    if parts.per_rank:
        path = rank_file(folder, accelerator.process_index)
        path.parent.mkdir(exist_ok=True)
        torch.save({name: obj.state_dict() for name, obj in parts.per_rank.items()}, path)
        with open(path, "rb") as written:  # on disk before the barrier: its node's flush may have run already
            os.fsync(written.fileno())


@contextlib.contextmanager
def _for_load_state(folder: Path) -> Iterator[Path]:
    """`folder`, or for a format-1 checkpoint (or its universal form) a temporary folder of links to everything in
    it but `custom_checkpoint_N.pkl`: accelerate's `load_state` refuses a folder whose number of such files is not
    the number of objects registered with it, and this module loads those parts itself."""
    folder = Path(folder)
    if not any(_ACCELERATE_CUSTOM.match(item.name) for item in folder.iterdir()):
        yield folder
        return
    view = Path(tempfile.mkdtemp(prefix="checkpoint_view_"))  # per rank, on its own node
    try:
        for item in folder.iterdir():
            if not _ACCELERATE_CUSTOM.match(item.name):
                (view / item.name).symlink_to(item.resolve())
        yield view
    finally:
        shutil.rmtree(view, ignore_errors=True)  # removes the links, never what they point to


def load_checkpoint(accelerator: Accelerator, checkpoint: Path, load_from: Path | None = None,
                    log: Callable[[str], None] = print) -> None:
    """Everything `save_checkpoint` wrote, into the prepared model, optimizer and schedule (`load_state` from
    `load_from`, default the checkpoint itself: e.g. its universal form) and the registered parts (from the
    checkpoint, in its format). Every rank must call this."""
    checkpoint = Path(checkpoint)
    with _for_load_state(Path(load_from or checkpoint)) as folder:
        accelerator.load_state(str(folder))
    parts = _REGISTERED.get(accelerator) or _Parts()
    fresh = []
    for name, obj in parts.shared.items():
        path = part_file(checkpoint, name)
        if path is not None and path.is_file():
            obj.load_state_dict(_load(path))
        elif (state := _inside_train_state(checkpoint, name)) is not None:
            obj.load_state_dict(state)
        else:
            fresh.append(name)
    if fresh and accelerator.is_main_process:
        log(f"{checkpoint} holds no {', '.join(fresh)} (written by an earlier version): starting it fresh")
    if parts.per_rank:
        path = rank_file(checkpoint, accelerator.process_index)
        saved = _load(path) if path.is_file() else {}
        fresh = [name for name in parts.per_rank if name not in saved]
        for name, obj in parts.per_rank.items():
            if name in saved:
                obj.load_state_dict(saved[name])
        if fresh:
            log(f"rank {accelerator.process_index}: {checkpoint} holds no {RANK_STATE_DIR}/{path.name} entry for "
                f"{', '.join(fresh)}: starting it fresh on this rank")


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



def write_manifest(folder: Path) -> None:
    """`<folder>/manifest.json` for every file now in `folder` (flushed to disk), naming this code's `FORMAT`."""
    folder = Path(folder)
    write_json(folder / MANIFEST_FILE, {"format": FORMAT, **folder_manifest(folder, exclude=(MANIFEST_FILE,))})


def verify_checkpoint(folder: Path, checksums: bool = True) -> str | None:
    """None when `folder` is intact: every file its manifest lists is there with that size and, with `checksums`,
    that SHA-256. Else a one-line reason: no or unreadable manifest, a missing file, a size or checksum mismatch."""
    folder = Path(folder)
    if not folder.is_dir():
        return "not a folder"
    if not (folder / MANIFEST_FILE).is_file():
        return f"no {MANIFEST_FILE}, so it cannot be verified (written before checkpoints carried one?)"
    manifest = read_json_object(folder / MANIFEST_FILE)
    if manifest is None:
        return f"{MANIFEST_FILE} is unreadable"
    return check_manifest(folder, manifest, checksums)


def require_intact(folder: Path, checksums: bool = True, log: Callable[[str], None] = print) -> Path:
    """`folder`, named by the user: a CheckpointError unless it verifies. Without a manifest, it is used with a
    one-line warning if it holds a checkpoint's config and EMA state (see the module docstring)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"checkpoint {str(folder)!r} not found")
    if not (folder / MANIFEST_FILE).is_file():
        if not is_checkpoint(folder):
            raise CheckpointError(f"{folder} is not a training checkpoint (no {MANIFEST_FILE}, {CONFIG_FILE} or "
                                  "EMA state)")
        log(f"warning: {folder} has no {MANIFEST_FILE} (written before checkpoints carried one): using it unverified")
        return folder
    reason = verify_checkpoint(folder, checksums)
    if reason is not None:
        raise CheckpointError(f"checkpoint {folder} is damaged: {reason}; use another checkpoint "
                              f"(train.resume={LATEST} picks the newest intact one)")
    return folder


def _step(folder: Path) -> int:
    return int(_STEP_DIR.match(folder.name).group(1))


def list_checkpoints(root: Path) -> list[Path]:
    """The `step_*` checkpoint folders under root, oldest first (not verified: see `verify_checkpoint`)."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name)), key=_step)


def _pointer_target(root: Path) -> Path | None:
    pointer = root / LATEST
    if pointer.is_file():
        named = root / pointer.read_text(errors="replace").strip()
        if _STEP_DIR.match(named.name) and named.is_dir():
            return named
    return None


def newest_intact(root: Path) -> Path | None:
    """The newest checkpoint under `root` whose files match its manifest in names and sizes, or None."""
    return next((c for c in reversed(list_checkpoints(root)) if verify_checkpoint(c, checksums=False) is None), None)


def resolve_resume(resume: str | None, root: Path, checksums: bool = True,
                   log: Callable[[str], None] = print) -> Path | None:
    """"none"/None → None. "latest" → the first intact checkpoint of: the one the pointer names, then the others
    newest first (each one passed over is logged in one line); None if there is none yet; a CheckpointError if
    there are some but none is intact. A path → that folder, which must verify (`require_intact`)."""
    if not resume or resume == "none":
        return None
    root = Path(root)
    if resume != LATEST:
        if not Path(resume).is_dir():
            raise FileNotFoundError(f"checkpoint {resume!r} not found; pass --resume latest or a step_* folder")
        if (Path(resume) / CHECKPOINTS_DIR).is_dir():
            raise FileNotFoundError(f"{resume!r} is a run's output folder, not a checkpoint: resume it with "
                                    f"train.output_dir={resume} --resume latest, or name one of its "
                                    f"{CHECKPOINTS_DIR}/step_* folders")
        return require_intact(Path(resume), checksums, log)
    candidates = list_checkpoints(root)[::-1]
    named = _pointer_target(root)
    if named is not None:
        candidates = [named, *(c for c in candidates if c != named)]
    for checkpoint in candidates:
        reason = verify_checkpoint(checkpoint, checksums)
        if reason is None:
            return checkpoint
        log(f"not resuming from {checkpoint}: {reason}")
        if checkpoint == candidates[0]:
            newest, newest_reason = checkpoint, reason
    if not candidates:
        return None
    hint = (f"; to resume it unverified, name it: train.resume={newest}"
            if not (newest / MANIFEST_FILE).is_file() else "")
    raise CheckpointError(f"no intact checkpoint in {root} ({len(candidates)} found; {newest.name}: "
                          f"{newest_reason}){hint}")


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _describe(err: BaseException, root: Path) -> tuple[str, bool]:
    """(a one-line description, whether it is the file system's doing: a full disk, quota, I/O error). Called while
    the partial folder still holds the space it took."""
    text = _first_line(err)
    if isinstance(err, OSError) or "No space left on device" in text or "Disk quota exceeded" in text:
        return text, True
    try:
        free = shutil.disk_usage(root).free
    except OSError:
        free = _FULL_DISK_BYTES
    if free < _FULL_DISK_BYTES:  # torch.save reports a full disk as "unexpected pos …": the free space tells
        return f"{type(err).__name__}: {text} (the disk is full: {free >> 20} MiB free)", True
    return f"{type(err).__name__}: {text}", False


def _first_failure(accelerator: Accelerator, described: tuple[str, bool] | None) -> str | None:
    """The first rank's failure, gathered from every rank (a collective: every rank must call it), so that all raise
    together rather than leave the others waiting in the next collective."""
    failures = [(rank, d[0]) for rank, d in enumerate(gather_object([described])) if d is not None]
    if not failures:
        return None
    rank, text = failures[0]
    return text if accelerator.num_processes == 1 else f"rank {rank}: {text}"


def _publish(tmp: Path, final: Path, config_text: str) -> None:
    """Main process, once every rank's files are in `tmp`: config, manifest, flush, rename, pointer."""
    root = final.parent
    if config_text:
        (tmp / CONFIG_FILE).write_text(config_text)
    write_manifest(tmp)
    fsync_tree(tmp)  # every file and folder on disk before the name `step_…` can exist
    shutil.rmtree(final, ignore_errors=True)  # a checkpoint of the same step (a rerun from an earlier one)
    tmp.rename(final)
    fsync_dir(root)
    try:
        atomic_write(root / LATEST, (final.name + "\n").encode())
        fsync_dir(root)
    except BaseException:
        shutil.rmtree(final, ignore_errors=True)  # a failed save leaves no new checkpoint behind
        raise


def _rotate(root: Path, step: int, keep: int) -> None:
    """Keep the newest `keep - 1` checkpoints older than `step` besides the one just saved. Folders of later steps
    (one the run fell back from as damaged, say) are neither counted nor deleted."""
    if keep <= 0:
        return
    older = [p for p in list_checkpoints(root) if _step(p) < step]
    for old in older[:max(len(older) - (keep - 1), 0)]:
        shutil.rmtree(old, ignore_errors=True)


def save_checkpoint(accelerator: Accelerator, root: Path, step: int, keep: int, config_text: str = "") -> Path:
    """`<root>/step_<step>`, written as the module docstring describes. Every rank must call this (DeepSpeed saves
    shards on every rank). A failure removes the partial folder and raises a CheckpointError on every rank (an
    error that is not the file system's is re-raised as it is on the rank it happened on)."""
    root = Path(root)
    final, tmp = root / f"step_{step:07d}", root / f"{_TMP_PREFIX}{step:07d}"
    main = accelerator.is_main_process
    if main:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(f"{_TMP_PREFIX}*"):  # left by interrupted saves: their space may be needed now
            shutil.rmtree(stale, ignore_errors=True)
    accelerator.wait_for_everyone()
    error, described = None, None
    try:
        accelerator.save_state(str(tmp))
        _save_parts(accelerator, tmp)
        if accelerator.is_local_main_process and not main:
            fsync_tree(tmp)  # this node's writes; the main process flushes its own node's in `_publish`
    except Exception as err:
        error, described = err, _describe(err, root)
    failure = _first_failure(accelerator, described)  # also the barrier: every rank's files are in `tmp`
    if failure is None:
        if main:
            try:
                _publish(tmp, final, config_text)
            except Exception as err:
                error, described = err, _describe(err, root)
        failure = _first_failure(accelerator, described)
    if failure is not None:
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
        if described is not None and not described[1]:
            raise error  # a bug rather than the disk: keep its traceback
        raise CheckpointError(f"could not save checkpoint {final}: {failure}; the partial folder was removed, the "
                              f"earlier checkpoints and the {LATEST} pointer are unchanged (a full disk: free space "
                              "or lower train.keep_checkpoints, then rerun to resume)") from error
    if main:
        _rotate(root, step, keep)
    accelerator.wait_for_everyone()
    return final


def main(argv: list[str] | None = None) -> None:
    """`python -m imba.training.checkpoints to-universal CHECKPOINT [WORKERS]`."""
    parser = argparse.ArgumentParser(prog="python -m imba.training.checkpoints",
                                     description="Tools for train.py's checkpoints.")
    commands = parser.add_subparsers(dest="command", required=True)
    universal = commands.add_parser(
        "to-universal", help="convert a DeepSpeed ZeRO-1/2/3 checkpoint to <checkpoint>/universal/ once, ahead of "
                             "a resume on another number of processes")
    universal.add_argument("checkpoint", type=Path, help="a checkpoint folder (outputs/RUN/checkpoints/step_N)")
    universal.add_argument("workers", type=int, nargs="?", default=4, help="conversion worker processes (4)")
    args = parser.parse_args(argv)
    try:
        print(f"wrote {to_universal(args.checkpoint, args.workers)}")
    except ConfigError as err:
        sys.exit(f"error: {err}")


if __name__ == "__main__":
    main()
