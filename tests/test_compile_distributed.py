"""`speed.compile` as a GPU run takes it, rehearsed over gloo: compiled after `accelerator.prepare`, with gradient
checkpointing, bf16 autocast and the efficient IMBA estimator, under DDP and DeepSpeed ZeRO-2 with two CPU
processes. Dynamo compiles the DiT twice and no more: once for the training passes and once for the estimator's
no-grad pass (it guards on the grad mode); a recompilation on every step, as ZeRO-3's parameter hooks cause (refused
in one line, tests/test_run_errors.py), would show here as a larger count. The ranks end bitwise equal."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from test_distributed import LAUNCHERS, RUN, digests, launch_command, launch_env

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
COMPILED = ["speed.compile=true", "speed.gradient_checkpointing=true", "train.mixed_precision=bf16",
            "train.val_every=0", "train.max_steps=3"]


@pytest.mark.parametrize("kind", ["ddp", "zero2"])
def test_a_compiled_checkpointed_bf16_efficient_run_compiles_once_per_grad_mode(tmp_path, kind):
    env = launch_env({**LAUNCHERS[kind][1], "TORCH_LOGS": "recompiles"})
    cmd = [*launch_command(kind), str(REPO / "train.py"), *RUN, *COMPILED, f"train.output_dir={tmp_path / 'run'}"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1200)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert "estimator efficient" in output  # whose no-grad pass is the second graph
    recompiled = re.findall(r"\[rank0\].*Recompiling function (\S+) in (\S+)", output)
    assert len(recompiled) == 1, recompiled  # the no-grad pass: the grad mode changed
    assert "GLOBAL_STATE changed: grad_mode" in output
    ranks = digests(output)
    assert set(ranks) == {0, 1} and ranks[0] == ranks[1]
