"""Pre-emption: a signal mid-run → checkpoint at the current step → exit 75 → `--resume latest` finishes the run."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from imba.training.checkpoints import list_checkpoints, resolve_resume, verify_checkpoint, write_manifest
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


def rank_pids(launcher_pid: int) -> dict[int, int]:
    """{rank: pid} of the training processes under an `accelerate launch` process (read from their environment)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = dict(item.split("=", 1) for item in (entry / "environ").read_text().split("\0") if "=" in item)
            cmdline = (entry / "cmdline").read_text()
        except OSError:
            continue
        if "train.py" in cmdline and "RANK" in env and env.get("TORCHELASTIC_RUN_ID") is not None \
                and "accelerate.commands.launch" not in cmdline and _descends_from(int(entry.name), launcher_pid):
            found[int(env["RANK"])] = int(entry.name)
    return found


def _descends_from(pid: int, ancestor: int) -> bool:
    while pid > 1:
        if pid == ancestor:
            return True
        try:
            pid = int((Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            return False
    return False


@pytest.mark.slow
def test_a_signal_to_one_rank_makes_both_ranks_save_the_same_step_and_exit_75(tmp_path):
    from test_distributed import RUN as DIST_RUN, launch_command, launch_env, LAUNCHERS

    out = tmp_path / "run"
    cmd = [*launch_command("ddp"), str(REPO / "train.py"), *DIST_RUN, f"train.output_dir={out}",
           "train.max_steps=100000", "train.save_every=0"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=launch_env(LAUNCHERS["ddp"][1]), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 300
        while len(logged_steps(out / "metrics.jsonl")) < 3:
            assert proc.poll() is None and time.time() < deadline, "training did not start"
            time.sleep(0.2)
        ranks = rank_pids(proc.pid)
        assert set(ranks) == {0, 1}, ranks
        os.kill(ranks[1], signal.SIGUSR1)  # only rank 1 hears it, as when a node-local signal arrives first
        stdout, stderr = proc.communicate(timeout=180)
    finally:
        proc.kill()
    # both ranks agreed on the step, saved it together and exited 75 (the launcher reports each exit code)
    assert "pre-empted: checkpoint at step" in stdout, stderr[-3000:]
    # torch elastic's failure table has a "rank : N ... exitcode : C" record per failed rank. Once one rank has
    # exited 75 the agent SIGTERMs the other if it has not exited yet (by then the checkpoint is complete: the save
    # ends in a barrier); so: 75 from at least one rank, and nothing but 75 or that SIGTERM from any.
    exited = dict(re.findall(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*\d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)", stderr))
    assert "75" in exited.values() and set(exited.values()) <= {"75", "-15"}, stderr[-3000:]
    (checkpoint,) = list_checkpoints(out / "checkpoints")
    step = int(checkpoint.name.split("_")[1])
    assert f"checkpoint at step {step} saved" in stdout and logged_steps(out / "metrics.jsonl")[-1] == step
    assert (checkpoint / "random_states_0.pkl").is_file() and (checkpoint / "random_states_1.pkl").is_file()
    assert verify_checkpoint(checkpoint) is None


@pytest.mark.slow
def test_a_signal_at_the_last_step_finishes_the_run_normally(tmp_path, monkeypatch):
    from test_train_precomputed import run_main

    real_init = PreemptionHandler.__init__

    def signalled(self, *a, **k):  # a signal that is already pending when the (only, last) step checks
        real_init(self, *a, **k)
        self.received = signal.SIGUSR1

    monkeypatch.setattr(PreemptionHandler, "__init__", signalled)
    out = tmp_path / "run"
    assert run_main([*RUN, f"train.output_dir={out}", "train.max_steps=1"]) == 0
    assert (out / "export" / "model_index.json").is_file()
    assert [p.name for p in list_checkpoints(out / "checkpoints")] == ["step_0000001"]
