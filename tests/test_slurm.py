"""`launch/slurm/train_single_node.sbatch` under a real one-node SLURM (tests/slurm_cluster.py), with a 2-process
CPU training: pre-empted by its time limit twice and by `scancel --signal=USR1` once, the job requeues itself,
resumes from its checkpoints, ends COMPLETED, and its final weights equal an uninterrupted run's, bitwise.

SLURM makes a requeued job eligible again only two minutes after the requeue (Reason=BeginTime); the test starts it
at once with `scontrol update JobId=N StartTime=now`, as a user could, after checking that hold.
"""

import json
import math
import os
import re
import socket
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest

from slurm_cluster import Cluster, missing

REPO = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slow, pytest.mark.skipif(missing() is not None, reason=f"no one-node SLURM: {missing()}")]

# The training must outlast the two time-limited runs, or the job completes before it is pre-empted twice. Each run
# trains until SLURM's warning signal, which its controller sends on a periodic check (every 30 s), so up to ~45 s
# after the start. Machines differ by 4x in speed (9 to 40 steps/s with 2 processes), so the step count is sized
# from a short run of the same configuration: 1.5x the steps two 45-second runs could train.
TRAIN = ["data.resolution=32", "data.batch_size=2", "data.synthetic_samples=24", "train.save_every=0",
         "train.sample_every=0", "sample.steps=2", "sample.prompts=[a red circle]", "train.trackers=none",
         "train.log_every=20"]
GLOBAL_BATCH = 4  # 2 processes x data.batch_size


def job_env(extra: dict) -> dict:
    return {**os.environ, **extra, "ACCELERATE_USE_CPU": "true",
            "ACCELERATE_CONFIG": "launch/accelerate/multi_gpu.yaml", "GPUS_PER_NODE": "2", "CONFIG": "configs/tiny.yaml", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
            # `accelerate` must be on PATH for node_launch.sh, as in the venv a user activates
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def final_digest(log: str) -> str:
    found = set(re.findall(r"rank \d/2: parameters ([0-9a-f]{16})", log))
    assert len(found) == 1, found  # both ranks print the same digest
    return found.pop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cluster = Cluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.__enter__()
    except RuntimeError as err:  # installed, but this machine cannot run the daemons (no root cgroup, hostname)
        pytest.skip(str(err).splitlines()[0] + " (logs in " + str(cluster.folder) + ")")
    yield cluster
    cluster.__exit__(None, None, None)


def node_launch(tmp_path, name: str, max_steps: int) -> subprocess.CompletedProcess:
    """The training started by node_launch.sh directly, never interrupted."""
    return subprocess.run(["bash", "launch/slurm/node_launch.sh", *TRAIN, f"train.max_steps={max_steps}",
                           f"train.output_dir={tmp_path / name}"], cwd=REPO, env=job_env({"PORT": str(free_port())}),
                          capture_output=True, text=True, timeout=900)


def steps_for_two_runs(tmp_path) -> int:
    calibration = node_launch(tmp_path, "calibration", 100)
    assert calibration.returncode == 0, calibration.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "calibration" / "metrics.jsonl").read_text().splitlines()]
    steps_per_s = max(row["images_per_s"] for row in rows) / GLOBAL_BATCH
    return max(300, math.ceil(1.5 * steps_per_s * 2 * 45 / 100) * 100)


def test_a_preempted_job_requeues_itself_resumes_and_completes_with_the_uninterrupted_weights(cluster, tmp_path):
    max_steps = steps_for_two_runs(tmp_path)
    reference = node_launch(tmp_path, "reference", max_steps)
    assert reference.returncode == 0, reference.stderr[-3000:]
    expected = final_digest(reference.stdout)

    log = tmp_path / "job.out"
    submitted = subprocess.run(
        ["sbatch", "--parsable", "--gres=none", f"--cpus-per-task={os.cpu_count()}", "--mem=0",
         "--time=00:01:00", "--signal=B:USR1@50", f"--output={log}", "launch/slurm/train_single_node.sbatch", *TRAIN,
         f"train.max_steps={max_steps}", f"train.output_dir={tmp_path / 'run'}"],
        cwd=REPO, env=job_env(cluster.env), capture_output=True, text=True, timeout=60)
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.strip().split(";")[0]

    held, requeued_at, lifted, cancelled, state = [], None, False, False, "PENDING"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        state, restarts = cluster.job_state(job), int(cluster.job_field(job, "Restarts"))
        if state in ("COMPLETED", "FAILED", "TIMEOUT", "CANCELLED", "NODE_FAIL", "OUT_OF_MEMORY"):
            break
        output = log.read_text() if log.exists() else ""
        if state == "PENDING" and restarts > len(held) and cluster.job_field(job, "Reason") == "BeginTime":
            # SLURM's hold after a requeue; released only once the node has finished the last run (a job started
            # while its previous run is still being cleaned up fails: "Job credential revoked")
            if requeued_at is None:
                requeued_at = time.monotonic()
                eligible = datetime.fromisoformat(cluster.job_field(job, "EligibleTime"))
                hold = (eligible - datetime.now()).total_seconds()
            if cluster.node_state() == "idle" and time.monotonic() - requeued_at > 10:
                held.append(hold)
                requeued_at = None
                if restarts == 2 and not lifted:  # two time-limit pre-emptions are enough: let it run on
                    cluster.run("scontrol", "update", f"JobId={job}", "TimeLimit=00:15:00")
                    lifted = True
                cluster.run("scontrol", "update", f"JobId={job}", "StartTime=now")
        if lifted and not cancelled and state == "RUNNING" and output.count("resumed from") == 2:
            steps = re.findall(r"(\d+)/%d \[" % max_steps, output.rsplit("resumed from", 1)[1])
            if len(steps) > 3:  # training again, after the second resume
                cluster.run("scancel", "--signal=USR1", "--batch", job)
                cancelled = True
        time.sleep(0.5)
    output = log.read_text()
    assert state == "COMPLETED", (state, output[-4000:])
    assert cluster.job_field(job, "ExitCode") == "0:0"

    preempted = [int(s) for s in re.findall(r"pre-empted: checkpoint at step (\d+) saved", output)]
    resumed = [int(s) for s in re.findall(r"resumed from \S+ at step (\d+)", output)]
    # time limit, time limit, scancel; a job that finished first trained too few steps for this machine's speed
    assert len(preempted) == 3 and cancelled, (f"pre-empted at steps {preempted} of {max_steps}", output[-4000:])
    assert resumed == preempted and preempted == sorted(preempted) and preempted[-1] < max_steps
    assert output.count("requeueing job") == 3 and f"done: step {max_steps}" in output
    assert final_digest(output) == expected
    # SLURM 22.05 holds a requeued job for 2 minutes (launch/README.md)
    assert len(held) == 3 and all(90 < seconds <= 121 for seconds in held), held
