"""Two machines, rehearsed on one host: the multi-node launch line (`launch/slurm/node_launch.sh`, which
`train_multi_node.sbatch` runs once per node through `srun`) started twice on 127.0.0.1, machine ranks 0 and 1, one
CPU process each over gloo. The two-machine run trains and checkpoints; its checkpoint resumes on one machine (two
processes, one `accelerate launch`) to the parameters the two machines reached without stopping, bitwise."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from test_distributed import RUN, copy_checkpoint, digests, free_port, launch, launch_env, losses

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
HANG_S = 600  # a guard against a hang; a run here takes about a minute


def two_machines(out: Path, tmp_path: Path, *overrides: str) -> str:
    """Both machines' logs of one run of the multi-node launch line into `out`."""
    port = free_port()
    env = launch_env({
        "ACCELERATE_USE_CPU": "true", "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "CONFIG": str(REPO / "configs" / "tiny.yaml"), "ACCELERATE_CONFIG": "launch/accelerate/multi_gpu.yaml",
        "NUM_MACHINES": "2", "GPUS_PER_NODE": "1", "MAIN_PROCESS_IP": "127.0.0.1", "PORT": str(port)})
    env = {k: v for k, v in env.items() if not k.startswith("SLURM_")}
    logs = [tmp_path / f"machine{rank}.log" for rank in (0, 1)]
    machines = []
    for rank, log in enumerate(logs):
        with log.open("w") as sink:
            machines.append(subprocess.Popen(
                ["bash", str(REPO / "launch" / "slurm" / "node_launch.sh"), *RUN, f"train.output_dir={out}",
                 *overrides], cwd=REPO, env={**env, "MACHINE_RANK": str(rank)}, stdout=sink, stderr=subprocess.STDOUT))
    try:
        codes = [machine.wait(timeout=HANG_S) for machine in machines]
    finally:
        for machine in machines:
            if machine.poll() is None:
                machine.kill()
    text = "\n".join(log.read_text() for log in logs)
    assert codes == [0, 0], text[-4000:]
    return text


def test_two_machines_train_and_their_checkpoint_resumes_on_one_machine(tmp_path):
    full = tmp_path / "two_machines"
    log = two_machines(full, tmp_path, "train.max_steps=6", "train.save_every=3")
    assert "rank 0/2: accelerate launch" in log and "rank 1/2: accelerate launch" in log  # the launch line ran
    assert "--num_machines 2 --machine_rank 1" in log and "--main_process_ip 127.0.0.1" in log
    assert "world size 2 (MULTI_CPU)" in log
    reached = digests(log)
    assert set(reached) == {0, 1} and reached[0] == reached[1]  # the two machines agree bitwise

    split = tmp_path / "one_machine"
    step3 = copy_checkpoint(full, 3, split)  # the two-machine run "killed" after its step-3 checkpoint
    resumed = launch("ddp", [f"train.output_dir={split}", "train.max_steps=6"], tmp_path)  # one machine, 2 processes
    assert f"resumed from {step3} at step 3" in resumed
    assert digests(resumed) == reached
    assert [losses(split)[s] for s in (4, 5, 6)] == [losses(full)[s] for s in (4, 5, 6)]
    shutil.rmtree(full / "checkpoints")  # keep the test's disk small
