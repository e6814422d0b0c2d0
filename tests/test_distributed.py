"""Real 2-process runs over gloo on CPU: DDP and DeepSpeed ZeRO-2.

Each test asserts the world size it really got (DESIGN pitfall: `accelerate launch --cpu --num_processes 2` quietly
starts one process), that both ranks end with bitwise-identical parameters, and that stopping at a checkpoint and
resuming reproduces the uninterrupted run exactly: same per-step losses, same final parameters.
"""

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RUN = [
    "data.resolution=64", "data.batch_size=2", "data.synthetic_samples=24", "train.log_every=1",
    "train.sample_every=0", "sample.steps=2", "sample.prompts=[a red circle]", "optim.warmup_steps=2",
    "train.trackers=none",
]
LAUNCHERS = {
    # the CPU form that really starts 2 processes (gloo)
    "ddp": (["--multi_gpu"], {"ACCELERATE_USE_CPU": "true"}),
    "zero2": (["--use_deepspeed", "--zero_stage", "2", "--gradient_accumulation_steps", "1",
               "--gradient_clipping", "1.0"], {}),
}


def launch_env(extra: dict) -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **extra,
            # DeepSpeed JIT-compiles a shared-memory comm op once; keep it between runs
            "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR",
                                                   str(Path.home() / ".cache" / "imba-torch-ext"))}


def free_port() -> int:
    """A port nobody listens on now, so concurrent test runs do not collide on accelerate's default 29500."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_command(kind, num_processes=2):
    flags, _ = LAUNCHERS[kind]
    return [sys.executable, "-m", "accelerate.commands.launch", *flags, "--num_processes", str(num_processes),
            "--num_machines", "1", "--main_process_port", str(free_port()), "--mixed_precision", "no",
            "--dynamo_backend", "no"]


def launch(kind, args, tmp_path):
    _, extra_env = LAUNCHERS[kind]
    env = launch_env(extra_env)
    cmd = [*launch_command(kind), str(REPO / "train.py"), *RUN, *args]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-4000:])
    return proc.stdout + proc.stderr


def digests(output: str) -> dict[int, str]:
    return {int(rank): digest for rank, digest in re.findall(r"rank (\d)/2: parameters ([0-9a-f]{16})", output)}


def losses(out_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row["loss"] for row in rows}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ddp", "zero2"])
def test_two_processes_train_identically_and_resume_exactly(tmp_path, kind):
    full, split = tmp_path / "full", tmp_path / "split"
    uninterrupted = launch(kind, [f"train.output_dir={full}", "train.max_steps=6", "train.save_every=3"], tmp_path)
    expected_type = "MULTI_CPU" if kind == "ddp" else "DEEPSPEED"
    assert f"world size 2 ({expected_type})" in uninterrupted
    full_digests = digests(uninterrupted)
    assert set(full_digests) == {0, 1} and full_digests[0] == full_digests[1]  # ranks agree bitwise

    launch(kind, [f"train.output_dir={split}", "train.max_steps=3"], tmp_path)  # "killed" after step 3
    resumed = launch(kind, [f"train.output_dir={split}", "train.max_steps=6"], tmp_path)  # resume=latest
    assert f"resumed from {split / 'checkpoints' / 'step_0000003'} at step 3" in resumed
    resumed_digests = digests(resumed)
    assert resumed_digests == full_digests  # same final parameters, bitwise, on both ranks
    assert losses(split) == losses(full)  # steps 1-6: the same batches, noise and losses
    checkpoint = split / "checkpoints" / "step_0000006"
    assert (checkpoint / "random_states_0.pkl").is_file() and (checkpoint / "random_states_1.pkl").is_file()


def train_single_process(args, tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(REPO / "train.py"), *RUN, *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_ddp_checkpoint_resumes_on_another_process_count(tmp_path):
    out = tmp_path / "run"
    launch("ddp", [f"train.output_dir={out}", "train.max_steps=2"], tmp_path)
    proc = train_single_process([f"train.output_dir={out}", "train.max_steps=4"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "world size 1" in proc.stdout and "resumed from" in proc.stdout
    assert "resuming a 2-process checkpoint on 1 processes" in proc.stdout
    assert "done: step 4" in proc.stdout


@pytest.mark.slow
def test_zero2_checkpoint_on_another_process_count_is_refused_in_one_line(tmp_path):
    out = tmp_path / "run"
    launch("zero2", [f"train.output_dir={out}", "train.max_steps=2"], tmp_path)
    proc = subprocess.run([*launch_command("zero2", num_processes=1), str(REPO / "train.py"), *RUN,
                           f"train.output_dir={out}", "train.max_steps=4"],
                          cwd=tmp_path, env=launch_env({}), capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0
    assert ("error: this checkpoint was written by 2 processes and DeepSpeed partitions its optimizer states per "
            "rank: resume with 2 processes") in proc.stderr
