"""Pre-emption: a signal mid-run → checkpoint at the current step → exit 75 → `--resume latest` finishes the run."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from imba.training.checkpoints import list_checkpoints, resolve_resume, write_manifest
from imba.training.preemption import SIGNALS, PreemptionHandler

REPO = Path(__file__).resolve().parents[1]
RUN = [
    "data.resolution=64", "data.batch_size=2", "data.synthetic_samples=16", "data.shuffle_buffer=8",
    "train.log_every=1", "train.save_every=0", "train.sample_every=0", "sample.steps=2",
    "sample.prompts=[a red circle]", "optim.warmup_steps=1", "train.trackers=none",
]


def logged_steps(metrics: Path) -> list[int]:
    if not metrics.is_file():
        return []
    return [json.loads(line)["step"] for line in metrics.read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("sig", SIGNALS, ids=["SIGUSR1", "SIGTERM"])
def test_both_signals_are_caught_and_the_previous_handlers_restored(sig):
    before = signal.getsignal(sig)
    handler = PreemptionHandler()
    try:
        assert handler.received is None
        os.kill(os.getpid(), sig)  # delivered to the main thread before kill returns
        assert handler.received == sig
    finally:
        handler.restore()
    assert signal.getsignal(sig) == before


@pytest.mark.slow
def test_signal_checkpoints_exits_75_and_resume_finishes(tmp_path):
    """End to end with SIGUSR1 (SLURM's --signal); SIGTERM reaches the same handler (test above)."""
    sig = signal.SIGUSR1
    out = tmp_path / "run"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(REPO / "train.py"), *RUN, f"train.output_dir={out}"]
    proc = subprocess.Popen([*cmd, "train.max_steps=100000"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 240
        while len(logged_steps(out / "metrics.jsonl")) < 3:  # training is under way
            assert proc.poll() is None and time.time() < deadline, "training did not start"
            time.sleep(0.2)
        proc.send_signal(sig)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 75, stderr[-2000:]
    assert "pre-empted: checkpoint at step" in stdout
    (checkpoint,) = list_checkpoints(out / "checkpoints")
    stopped_at = int(checkpoint.name.split("_")[1])
    assert stopped_at >= 3 and stopped_at == logged_steps(out / "metrics.jsonl")[-1]
    assert (out / "checkpoints" / "latest").read_text().strip() == checkpoint.name
    assert "max_steps: 100000" in (checkpoint / "config.yaml").read_text()
    assert not (out / "export").exists()  # a pre-empted run is not finished

    # the default resume=latest picks it up; the run finishes a few steps later
    done = subprocess.run([*cmd, f"train.max_steps={stopped_at + 2}"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"resumed from {checkpoint} at step {stopped_at}" in done.stdout
    assert logged_steps(out / "metrics.jsonl")[-2:] == [stopped_at + 1, stopped_at + 2]
    assert (out / "export" / "model_index.json").is_file()


def test_resume_none_refuses_to_overwrite_checkpoints(tmp_path):
    (tmp_path / "run" / "checkpoints" / "step_0000002").mkdir(parents=True)
    proc = subprocess.run([sys.executable, str(REPO / "train.py"), f"train.output_dir={tmp_path / 'run'}",
                           "train.resume=none"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    assert proc.returncode != 0
    assert "already holds checkpoints" in proc.stderr.strip().splitlines()[-1]


def test_latest_pointer_wins_and_falls_back_to_the_newest(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (2, 4, 6):
        folder = root / f"step_{step:07d}"
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"weights")
        write_manifest(folder)  # intact: test_checkpoints covers damaged ones
    (root / ".tmp_step_0000008").mkdir()  # an interrupted save is never picked
    assert resolve_resume("latest", root) == root / "step_0000006"
    (root / "latest").write_text("step_0000004\n")
    assert resolve_resume("latest", root) == root / "step_0000004"
    (root / "latest").write_text("step_0000099\n")  # pointer to a deleted checkpoint: fall back
    assert resolve_resume("latest", root) == root / "step_0000006"
    assert resolve_resume("none", root) is None
    assert resolve_resume("latest", tmp_path / "empty") is None
    with pytest.raises(FileNotFoundError, match="--resume latest"):
        resolve_resume(str(tmp_path / "nope"), root)
