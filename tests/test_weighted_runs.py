"""Real runs of train.py on two sources with concept balancing (offline, and online by the IMBA distance): killed
with SIGKILL mid-epoch and resumed, the run ends with the uninterrupted run's parameters; a run on 2, then 1 (killed),
then 2 processes trains on the samples one uninterrupted process draws (data.record_draws)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from data.synthetic import write_synthetic_shards
from test_distributed import digests, launch_command, launch_env

REPO = Path(__file__).resolve().parents[1]
OFFLINE = ("data.balance=temperature", "data.balance.alpha=1")
# a refresh every step, every row scored: a new segment of the stream from every refresh on, 2 steps later (the
# in-process loader's lag); the kill at step 3 falls between a refresh and its segment
ONLINE = ("data.balance=imba", "data.balance.every=1", "data.balance.fraction=1")


def run_args(root: Path, out: Path, *extra: str, balance: tuple = OFFLINE) -> list[str]:
    return [
        str(REPO / "train.py"), f"train.output_dir={out}", "data.resolution=64", "data.batch_size=2",
        "model.preset=tiny", "train.log_every=1", "train.sample_every=0", "train.val_every=0", "sample.steps=2",
        "sample.prompts=[a red circle]", "optim.warmup_steps=2", "train.trackers=none", "data.precompute=true",
        f"data.sources=[{{shards: {root / 'big'}, share: 0.7, name: big}}, {{shards: {root / 'small'}, share: 0.3, "
        f"name: small}}]",
        # epochs of 10 draws: the kill at step 3 (6 samples) is mid-epoch and the resumed steps cross into epoch 1
        "data.epoch_samples=10", *balance, *extra,
    ]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("two_sources")
    write_synthetic_shards(root / "big", num_samples=30, samples_per_shard=16, resolution=64, seed=1)
    write_synthetic_shards(root / "small", num_samples=10, samples_per_shard=16, resolution=64, seed=2)
    return root


def env():
    return {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def train(args, cwd) -> str:
    proc = subprocess.run([sys.executable, *args], cwd=cwd, env=env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout + proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("balance", [OFFLINE, ONLINE], ids=["temperature", "imba"])
def test_a_killed_balanced_mix_resumes_to_the_uninterrupted_parameters(sources, tmp_path, balance):
    full = train(run_args(sources, tmp_path / "full", "train.max_steps=6", "train.save_every=3", balance=balance),
                 tmp_path)
    assert "big: 30 samples, 70.0% of the draws" in full
    if balance == OFFLINE:
        assert "balanced by concepts" in full
    else:  # refreshed before the kill, on a stream that starts at the temperature prior, not the natural one
        assert ("data: balanced online by the IMBA distance (the temperature prior, alpha 0.5, 4 rarity groups each "
                "moved within 4x of it, every 1 steps) over") in full
        assert "online balance: 2 refreshes; draws x prior" in full, full

    out = tmp_path / "killed"
    killed = kill_after_checkpoint(run_args(sources, out, "train.max_steps=6", "train.save_every=3", balance=balance),
                                   tmp_path, out, 3)
    assert killed == (-signal.SIGKILL, 3)
    assert not (out / "checkpoints" / "step_0000006").exists()  # killed between the two checkpoints

    resumed = train(run_args(sources, out, "train.max_steps=6", balance=balance), tmp_path)
    assert "resumed from" in resumed
    assert "the stream continues after 6 samples (the position the checkpoint recorded), epoch 0.60" in resumed
    assert digests(resumed) == digests(full)


def launch_two(args, cwd) -> str:
    """train.py with `args` on 2 DDP processes over gloo: its output."""
    proc = subprocess.run([*launch_command("ddp", 2), *args], cwd=cwd,
                          env=launch_env({"ACCELERATE_USE_CPU": "true"}), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def kill_after_checkpoint(args, cwd, out: Path, step: int) -> tuple[int, int]:
    """Run train.py with `args` on one process and SIGKILL it once a checkpoint at `step` or later is complete: its
    exit code and the step of the checkpoint it was killed after (later than `step` where the run outpaced the poll
    on a loaded machine)."""
    proc = subprocess.Popen([sys.executable, *args], cwd=cwd, env=env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    latest, reached = out / "checkpoints" / "latest", 0
    try:
        deadline = time.monotonic() + 300
        while reached < step:
            assert proc.poll() is None and time.monotonic() < deadline, f"the run ended before step {step}"
            time.sleep(0.02)
            name = latest.read_text().strip() if latest.is_file() else ""
            reached = int(name.removeprefix("step_")) if name.startswith("step_") else 0
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    return proc.returncode, reached


def global_stream(out: Path, processes: int) -> list[int]:
    """data.record_draws's rows of every rank, as positions of the global stream: per step, per micro-batch, the
    ranks in order."""
    rows = {}
    for rank in range(processes):
        lines = (out / "draws" / f"rank_{rank}.jsonl").read_text().splitlines()
        rows[rank] = [json.loads(line) for line in lines]
    steps = sorted({row["step"] for rank_rows in rows.values() for row in rank_rows})
    stream = []
    for step in steps:
        per_rank = [[row["indices"] for row in rows[r] if row["step"] == step] for r in rows]
        if not all(per_rank):  # a step of fewer processes: the ranks beyond them have no rows for it
            per_rank = [b for b in per_rank if b]
        for micro in zip(*per_rank):
            stream += [i for batch in micro for i in batch]
    return stream


@pytest.mark.slow
@pytest.mark.parametrize("balance", [OFFLINE, ONLINE], ids=["temperature", "imba"])
def test_two_then_one_then_two_processes_with_a_kill_train_on_the_stream_of_one_uninterrupted_process(
        sources, tmp_path, balance):
    # 3 steps of 2 processes (12 samples), k - 3 of 1 (killed after its step-k checkpoint, k = 5 unless the run
    # outpaced the poll: the rows of the steps it trained after it are dropped on resume), 2 of 2 (8): the samples of
    # the first steps of one uninterrupted process
    out, record = tmp_path / "run", "data.record_draws=true"
    two = launch_two(run_args(sources, out, "train.max_steps=3", record, balance=balance), tmp_path)
    assert "world size 2" in two
    ranks = digests(two)
    assert set(ranks) == {0, 1} and ranks[0] == ranks[1]
    one = run_args(sources, out, "train.max_steps=40", "train.save_every=5", record, balance=balance)
    killed, k = kill_after_checkpoint(one, tmp_path, out, 5)
    assert killed == -signal.SIGKILL
    again = launch_two(run_args(sources, out, f"train.max_steps={k + 2}", record, balance=balance), tmp_path)
    assert "resuming a 1-process checkpoint on 2 processes" in again
    # the old count, step x processes of the last checkpoint x batch, would say k x 1 x 2 (10 for k = 5, not 16)
    position = 12 + (k - 3) * 2
    assert (f"data: the stream continues after {position} samples (the position the checkpoint recorded), "
            f"epoch {position / 10:.2f}") in again
    assert "the global batch changes from 2 to 4 samples per step" in again
    resumed = global_stream(out, 2)
    assert len(resumed) == position + 8
    if balance == OFFLINE:  # a fixed plan: the stream is a pure function of the position
        full = tmp_path / "full"
        train(run_args(sources, full, f"train.max_steps={(position + 8) // 2}", record, balance=balance), tmp_path)
        assert resumed == global_stream(full, 1)  # nothing replayed, nothing skipped
