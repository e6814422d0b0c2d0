"""Checkpoint integrity: every checkpoint carries a manifest, resume passes over damaged ones, a failed save (a full
disk) changes nothing, rotation keeps the newest good checkpoint, export refuses a damaged one.

The unit tests save real `accelerate` checkpoints of a tiny model in this process; the slow one runs `train.py`.
"""

import errno
import hashlib
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState

from imba.training import checkpoints
from imba.training.checkpoints import TrainState, list_checkpoints, register_state, resolve_resume, save_checkpoint
from data.files import read_json_object
from imba.training.config import ConfigError
from imba.training.ema import make_ema
from imba.training.resume import plan_resume, restore

REPO = Path(__file__).resolve().parents[1]
MANIFEST = "manifest.json"


class TinyRun:
    """A single-process accelerate run: a Linear model, AdamW, the EMA and the loop's counters registered as
    train.py registers them."""

    def __init__(self, root: Path):
        self.accelerator = Accelerator(cpu=True)
        model = torch.nn.Linear(8, 4)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        self.model, self.optimizer = self.accelerator.prepare(model, optimizer)
        self.ema = make_ema(self.model.parameters())
        self.state = TrainState(world_size=1)
        register_state(self.accelerator, self.ema, self.state)
        self.root = root

    def save(self, keep: int = 3) -> Path:
        """One optimizer step, then a checkpoint at the new step."""
        loss = self.model(torch.randn(2, 8)).square().mean()
        self.accelerator.backward(loss)
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.ema.step(self.model.parameters())
        self.state.step += 1
        return save_checkpoint(self.accelerator, self.root, self.state.step, keep, config_text="tiny: true\n")


@pytest.fixture
def run(tmp_path):
    yield TinyRun(tmp_path / "checkpoints")
    AcceleratorState._reset_state(reset_partial_state=True)


def truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def flip_a_byte(path: Path) -> None:
    """Same size, one byte changed in the middle (bit rot, a bad copy)."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_manifest_lists_every_file_with_its_size_and_sha256(run):
    checkpoint = run.save()
    manifest = read_json_object(checkpoint / MANIFEST)
    on_disk = {p.relative_to(checkpoint).as_posix() for p in checkpoint.rglob("*") if p.is_file()}
    assert set(manifest["files"]) == on_disk - {MANIFEST}
    assert {"model.safetensors", "optimizer.bin", checkpoints.EMA_STATE_FILE, checkpoints.CONFIG_FILE} <= on_disk
    for rel, entry in manifest["files"].items():
        data = (checkpoint / rel).read_bytes()
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert checkpoints.verify_checkpoint(checkpoint) is None
    assert not list(run.root.glob(".tmp*"))


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="names open files through /proc (Linux)")
def test_files_folder_and_parent_are_flushed_before_and_after_the_rename(run, monkeypatch):
    flushed = []
    real_fsync = os.fsync

    def recording_fsync(fd):
        flushed.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    checkpoint = run.save()
    tmp = str(run.root / ".tmp_step_0000001")
    files = {str(p.relative_to(checkpoint)) for p in checkpoint.rglob("*") if p.is_file()}
    assert files <= {os.path.relpath(p, tmp) for p in flushed if p.startswith(tmp + os.sep)}  # before the rename
    assert tmp in flushed  # the folder's own entries
    root = str(run.root)
    pointer = max(i for i, p in enumerate(flushed) if p.startswith(str(run.root / checkpoints.LATEST)))
    assert root in flushed[flushed.index(tmp) + 1:pointer]  # the rename
    assert root in flushed[pointer + 1:]  # the pointer's rename


def test_latest_falls_back_past_a_truncated_checkpoint_and_resumes(run, capsys):
    older, newest = run.save(), run.save()
    assert (run.root / "latest").read_text().strip() == newest.name
    truncate(newest / "model.safetensors")
    capsys.readouterr()
    assert resolve_resume("latest", run.root) == older
    line = one_line(capsys.readouterr().out)
    assert line.startswith(f"not resuming from {newest}: model.safetensors is ") and "the manifest says" in line

    plan = plan_resume("latest", run.root, run.accelerator)
    assert plan.checkpoint == plan.load_from == older
    run.state.step = 99
    restore(plan, run.accelerator, run.state, run.ema, None, run.model)
    assert run.state.step == 1 and f"resumed from {older} at step 1" in capsys.readouterr().out


def test_pointer_to_a_damaged_checkpoint_falls_back_to_the_newest_intact(run, capsys):
    _, second, third = run.save(), run.save(), run.save()
    (run.root / "latest").write_text(second.name + "\n")
    (second / checkpoints.EMA_STATE_FILE).unlink()
    assert resolve_resume("latest", run.root) == third
    assert f"missing file {checkpoints.EMA_STATE_FILE}" in capsys.readouterr().out


def test_a_changed_byte_of_equal_size_is_found_by_the_checksum(run):
    checkpoint = run.save()
    flip_a_byte(checkpoint / "optimizer.bin")
    reason = checkpoints.verify_checkpoint(checkpoint)
    assert reason is not None and "optimizer.bin" in reason and "sha256" in reason
    assert checkpoints.verify_checkpoint(checkpoint, checksums=False) is None  # sizes only: not seen


def test_damaged_explicit_path_is_a_one_line_config_error(run):
    checkpoint = run.save()
    flip_a_byte(checkpoint / "model.safetensors")
    with pytest.raises(ConfigError) as raised:
        resolve_resume(str(checkpoint), run.root)
    message = one_line(str(raised.value))
    assert str(checkpoint) in message and "damaged" in message and "model.safetensors" in message
    with pytest.raises(ConfigError, match="damaged"):
        plan_resume(str(checkpoint), run.root, run.accelerator)


def test_no_intact_checkpoint_is_an_error_never_a_fresh_start(run, capsys):
    checkpoint = run.save()
    truncate(checkpoint / checkpoints.EMA_STATE_FILE)
    with pytest.raises(ConfigError) as raised:
        plan_resume("latest", run.root, run.accelerator)
    message = one_line(str(raised.value))
    assert "no intact checkpoint" in message and checkpoint.name in message
    assert resolve_resume("latest", run.root.parent / "fresh") is None  # no checkpoints at all: a fresh run


def test_checkpoint_without_manifest_needs_to_be_named(run, capsys):
    checkpoint = run.save()
    (checkpoint / MANIFEST).unlink()  # as checkpoints written before manifests existed
    with pytest.raises(ConfigError) as raised:
        resolve_resume("latest", run.root)
    assert f"train.resume={checkpoint}" in one_line(str(raised.value))
    capsys.readouterr()
    assert resolve_resume(str(checkpoint), run.root) == checkpoint  # named: the user's decision, with a warning
    assert one_line(capsys.readouterr().out).startswith(f"warning: {checkpoint} has no manifest.json")
    (checkpoint / checkpoints.CONFIG_FILE).unlink()
    with pytest.raises(ConfigError, match="not a training checkpoint"):
        resolve_resume(str(checkpoint), run.root)


def fill_the_disk(path: Path) -> None:
    """What a write that runs out of space leaves: part of a file, then ENOSPC."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_bytes(b"\0" * 1000)
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


@pytest.mark.parametrize("where", ["save_state", "manifest"])
def test_full_disk_mid_save_changes_nothing_and_is_one_line(run, monkeypatch, where):
    earlier = run.save(keep=1)
    pointer = (run.root / "latest").read_text()
    if where == "save_state":
        monkeypatch.setattr(run.accelerator, "save_state", lambda folder: fill_the_disk(Path(folder) / "optimizer.bin"))
    else:
        monkeypatch.setattr(checkpoints, "write_json", lambda path, obj: fill_the_disk(Path(f"{path}.tmp-1")))
    with pytest.raises(ConfigError) as raised:  # a CheckpointError: train.py prints "error: <message>"
        run.save(keep=1)
    message = one_line(str(raised.value))
    assert "step_0000002" in message and "No space left on device" in message
    assert list_checkpoints(run.root) == [earlier]  # no rotation after a failed save
    assert (run.root / "latest").read_text() == pointer
    assert not list(run.root.glob(".tmp*"))
    assert checkpoints.verify_checkpoint(earlier) is None


def test_full_disk_reported_by_torch_save_is_one_line_and_a_bug_is_not_hidden(run, monkeypatch):
    earlier = run.save()

    def torch_save_on_a_full_disk(folder):
        Path(folder).mkdir()
        (Path(folder) / "optimizer.bin").write_bytes(b"\0" * 1000)
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")

    monkeypatch.setattr(run.accelerator, "save_state", torch_save_on_a_full_disk)
    with monkeypatch.context() as full:
        # full while the partial folder is there, as a real disk is: removing it frees the space
        full.setattr(checkpoints.shutil, "disk_usage",
                     lambda path: SimpleNamespace(free=1 << 20 if list(run.root.glob(".tmp*")) else 1 << 40))
        with pytest.raises(ConfigError, match="disk is full: 1 MiB free"):
            run.save()
    assert not list(run.root.glob(".tmp*"))
    # the same error with the disk not full is not the disk's doing: raised as it is, still cleaned up
    with pytest.raises(RuntimeError, match="unexpected pos") as raised:
        run.save()
    assert not isinstance(raised.value, ConfigError)
    assert not list(run.root.glob(".tmp*")) and list_checkpoints(run.root) == [earlier]


def test_keep_zero_keeps_every_checkpoint(run):
    for _ in range(4):
        run.save(keep=0)
    assert [p.name for p in list_checkpoints(run.root)] == [f"step_{i:07d}" for i in range(1, 5)]
    assert resolve_resume("latest", run.root).name == "step_0000004"


def test_rotation_never_deletes_the_checkpoint_just_saved(run):
    for _ in range(3):
        run.save(keep=2)
    assert [p.name for p in list_checkpoints(run.root)] == ["step_0000002", "step_0000003"]
    # a later checkpoint the run fell back from (damaged), then a save at an earlier step: keep=1
    damaged = run.root / "step_0000010"
    (run.root / "step_0000003").rename(damaged)
    truncate(damaged / "model.safetensors")
    saved = run.save(keep=1)
    assert saved.name == "step_0000004"
    assert list_checkpoints(run.root) == [saved, damaged]  # the older one rotated out; the later one left alone
    assert checkpoints.verify_checkpoint(saved) is None and resolve_resume("latest", run.root) == saved


def train_py(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(REPO / "train.py"), *args], env=env, capture_output=True, text=True,
                          timeout=600)


def test_export_of_a_damaged_checkpoint_is_a_one_line_error(run, tmp_path):
    checkpoint = run.save()
    flip_a_byte(checkpoint / checkpoints.EMA_STATE_FILE)
    proc = train_py("--export", str(checkpoint), str(tmp_path / "export"))
    assert proc.returncode != 0
    line = one_line(proc.stderr)
    assert line.startswith(f"error: checkpoint {checkpoint} is damaged: {checkpoints.EMA_STATE_FILE}")
    assert not (tmp_path / "export").exists()


TINY_RUN = [
    "data.resolution=64", "data.batch_size=2", "data.synthetic_samples=24", "data.shuffle_buffer=8",
    "train.log_every=2", "train.save_every=2", "train.sample_every=0", "sample.steps=2",
    "sample.prompts=[a red circle]", "optim.warmup_steps=1", "train.trackers=none", "train.max_steps=4",
]


def final_digest(stdout: str) -> str:
    (digest,) = re.findall(r"rank 0/1: parameters ([0-9a-f]{16})", stdout)
    return digest


@pytest.mark.slow
def test_rerun_after_a_truncated_checkpoint_resumes_from_the_previous_one_exactly(tmp_path):
    out = tmp_path / "run"
    command = [*TINY_RUN, f"train.output_dir={out}"]
    uninterrupted = train_py(*command)
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-3000:]
    step2, step4 = out / "checkpoints" / "step_0000002", out / "checkpoints" / "step_0000004"
    assert list_checkpoints(out / "checkpoints") == [step2, step4]
    truncate(step4 / "model.safetensors")  # a node crash, a full disk, a copy cut short

    rerun = train_py(*command)  # the same command: train.resume=latest
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"not resuming from {step4}: model.safetensors is " in rerun.stdout
    assert f"resumed from {step2} at step 2" in rerun.stdout
    assert final_digest(rerun.stdout) == final_digest(uninterrupted.stdout)
    assert checkpoints.verify_checkpoint(step4) is None  # saved again, whole


def test_to_universal_refuses_a_checkpoint_without_deepspeed_shards(run):
    saved = run.save()
    with pytest.raises(ConfigError, match="holds no DeepSpeed ZeRO optimizer shards"):
        checkpoints.to_universal(saved)
    assert not (saved / checkpoints.UNIVERSAL_DIR).exists()


def test_the_to_universal_command_says_what_is_wrong_in_one_line(run, capsys):
    saved = run.save()
    with pytest.raises(SystemExit, match=r"^error: .* holds no DeepSpeed ZeRO optimizer shards"):
        checkpoints.main(["to-universal", str(saved)])
    with pytest.raises(SystemExit) as usage:  # a missing checkpoint argument: argparse's usage line, status 2
        checkpoints.main(["to-universal"])
    assert usage.value.code == 2 and "the following arguments are required: checkpoint" in capsys.readouterr().err
