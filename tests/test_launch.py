"""launch/: accelerate and DeepSpeed configs, SLURM scripts. No GPU, no SLURM.

The configs are read by accelerate's own loader and resolved by its own launch code (nothing is started); the
DeepSpeed JSON goes through accelerate's DeepSpeedPlugin and DeepSpeed's own config parser. The SLURM scripts run
under bash with fake `srun`, `scontrol` and `accelerate` first on PATH; the fake accelerate starts a fake training
process (Python) that behaves like train.py on pre-emption: catch SIGUSR1/SIGTERM, exit 75.
"""

from __future__ import annotations

import copy
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
ACCELERATE_DIR = REPO / "launch" / "accelerate"
DEEPSPEED_DIR = REPO / "launch" / "deepspeed"
SLURM_DIR = REPO / "launch" / "slurm"
SCRIPTS = sorted(SLURM_DIR.glob("*.sh")) + sorted(SLURM_DIR.glob("*.sbatch"))
SINGLE = SLURM_DIR / "train_single_node.sbatch"
MULTI = SLURM_DIR / "train_multi_node.sbatch"
JOB_ID = 4242
JOB_PORT = str(29500 + JOB_ID % 1000)

# distributed_type, num_processes, num_machines, (DeepSpeed JSON, ZeRO stage) or None
EXPECTED = {
    "single_gpu.yaml": ("NO", 1, 1, None),
    "multi_gpu.yaml": ("MULTI_GPU", 8, 1, None),
    "zero2.yaml": ("DEEPSPEED", 8, 1, ("launch/deepspeed/zero2.json", 2)),
    "zero3.yaml": ("DEEPSPEED", 8, 1, ("launch/deepspeed/zero3.json", 3)),
    "multi_node.yaml": ("DEEPSPEED", 16, 2, ("launch/deepspeed/zero2.json", 2)),
}

# a guard against a hang, far beyond what a step takes on a loaded machine; its failure says it timed out
HANG_S = 300


# ---- accelerate configs -------------------------------------------------------------------------------------------

def test_every_accelerate_config_is_checked():
    assert sorted(p.name for p in ACCELERATE_DIR.glob("*.yaml")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_accelerate_config_loads_with_accelerates_loader(name):
    from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file
    from accelerate.utils import ComputeEnvironment, DistributedType

    dist_type, num_processes, num_machines, deepspeed = EXPECTED[name]
    cfg = load_config_from_file(str(ACCELERATE_DIR / name))  # raises on unknown top-level keys
    assert isinstance(cfg, ClusterConfig)
    assert cfg.compute_environment == ComputeEnvironment.LOCAL_MACHINE
    assert cfg.distributed_type == DistributedType(dist_type)
    assert (cfg.num_processes, cfg.num_machines, cfg.machine_rank) == (num_processes, num_machines, 0)
    assert cfg.use_cpu is False
    if deepspeed is None:
        assert cfg.deepspeed_config == {}
    else:
        json_path, _ = deepspeed
        assert cfg.deepspeed_config["deepspeed_config_file"] == json_path
        assert (REPO / json_path).is_file()
        # one torchrun per node (srun starts them), not `deepspeed --hostfile` over pdsh/ssh
        assert cfg.deepspeed_config["deepspeed_multinode_launcher"] == "standard"
        # accelerate refuses mixed_precision from the config file next to a deepspeed_config_file
        assert cfg.mixed_precision is None
    if name == "multi_gpu.yaml":
        assert cfg.mixed_precision == "bf16"


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_deepspeed_keys_are_accelerate_launch_options(name):
    """`accelerate launch` copies each deepspeed_config key onto its parsed arguments: a misspelt key is ignored."""
    from accelerate.commands.launch import launch_command_parser

    options = {action.dest for action in launch_command_parser()._actions}
    keys = yaml.safe_load((ACCELERATE_DIR / name).read_text()).get("deepspeed_config", {})
    assert set(keys) <= options


def resolve_launch(argv: list[str]):
    """What `accelerate launch ARGV train.py ...` resolves to, without starting anything (accelerate 1.15 code)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    args = launch_command_parser().parse_args([*argv, "train.py", "--config", "configs/1b_256.yaml"])
    return _validate_launch_command(args)


def deepspeed_launch_env(args, defaults, mp_from_config) -> tuple[list | None, dict[str, str]]:
    """The command and ACCELERATE_* environment of accelerate's DeepSpeed launcher (as launch_command() sets up)."""
    from accelerate.utils.launch import prepare_deepspeed_cmd_env

    fields = list(defaults.deepspeed_config) + (["mixed_precision"] if mp_from_config else [])
    args.deepspeed_fields_from_accelerate_config = ",".join(fields)
    cmd, env = prepare_deepspeed_cmd_env(args)
    return cmd, {k: v for k, v in env.items() if k.startswith("ACCELERATE_")}


@pytest.mark.parametrize("name, kind, num_processes", [
    ("single_gpu.yaml", "simple", 1),
    ("multi_gpu.yaml", "multi_gpu", 8),
    ("zero2.yaml", "deepspeed", 8),
    ("zero3.yaml", "deepspeed", 8),
])
def test_launch_resolution(name, kind, num_processes, monkeypatch):
    monkeypatch.chdir(REPO)
    args, _, _ = resolve_launch(["--config_file", f"launch/accelerate/{name}"])
    assert (args.multi_gpu, args.use_deepspeed) == (kind == "multi_gpu", kind == "deepspeed")
    assert args.num_processes == num_processes
    args, _, _ = resolve_launch(["--config_file", f"launch/accelerate/{name}", "--num_processes", "4"])
    assert args.num_processes == 4  # the command line overrides the file


def test_multi_node_cli_flags_override_the_file(monkeypatch):
    monkeypatch.chdir(REPO)
    args, defaults, mp_from_config = resolve_launch([
        "--config_file", "launch/accelerate/multi_node.yaml", "--num_machines", "4", "--num_processes", "32",
        "--machine_rank", "3", "--main_process_ip", "gpu-a", "--main_process_port", "12345"])
    assert (defaults.num_machines, defaults.machine_rank, defaults.main_process_port) == (2, 0, 29500)
    assert args.use_deepspeed
    assert (args.num_machines, args.num_processes, args.machine_rank) == (4, 32, 3)
    assert (args.main_process_ip, args.main_process_port) == ("gpu-a", 12345)
    cmd, env = deepspeed_launch_env(args, defaults, mp_from_config)
    assert cmd is None  # torchrun in-process on this node, not `deepspeed --hostfile ...`
    assert (args.nnodes, args.node_rank, args.nproc_per_node) == ("4", 3, "8")
    assert args.rdzv_endpoint == "gpu-a:12345"
    assert env["ACCELERATE_DEEPSPEED_CONFIG_FILE"] == "launch/deepspeed/zero2.json"


def find_auto(tree, prefix=""):
    if isinstance(tree, dict):
        return [p for k, v in tree.items() for p in find_auto(v, f"{prefix}{k}.")]
    return [prefix[:-1]] if tree == "auto" else []


@pytest.mark.parametrize("name, stage", [("zero2.yaml", 2), ("zero3.yaml", 3), ("multi_node.yaml", 2)])
def test_deepspeed_config_through_accelerate_and_deepspeed(name, stage, monkeypatch):
    """YAML → launcher env → DeepSpeedPlugin (as in each training process) → the values prepare() fills →
    DeepSpeed's own config parser. Every "auto" must be one that accelerate fills."""
    from accelerate.utils import DeepSpeedPlugin
    from deepspeed.runtime.config import DeepSpeedConfig

    monkeypatch.chdir(REPO)
    _, env = deepspeed_launch_env(*resolve_launch(["--config_file", f"launch/accelerate/{name}",
                                                   "--num_machines", "1", "--main_process_port", "0"]))
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    plugin = DeepSpeedPlugin()  # raises if the YAML sets keys that conflict with the JSON file
    plugin.set_mixed_precision("bf16")  # Accelerator(mixed_precision=cfg.train.mixed_precision)
    assert plugin.zero_stage == stage and plugin.zero3_init_flag is False
    config = plugin.deepspeed_config
    assert "optimizer" not in config and "scheduler" not in config  # torch AdamW from train.py
    assert sorted(find_auto(config)) == ["gradient_accumulation_steps", "gradient_clipping", "train_batch_size",
                                         "train_micro_batch_size_per_gpu"]

    # accelerator.prepare(): gradient accumulation from the Accelerator, clipping 1.0, batch sizes. The micro batch
    # is the one value train.py must set itself (it prepares no DataLoader): 4 here, world size 1.
    config["train_micro_batch_size_per_gpu"] = 4
    plugin.fill_match("gradient_accumulation_steps", must_match=False, gradient_accumulation_steps=2)
    plugin.deepspeed_config_process(must_match=False, gradient_clipping=1.0, train_batch_size=4 * 2 * 1,
                                    **{"zero_optimization.stage3_gather_16bit_weights_on_model_save": False})
    assert find_auto(config) == []
    parsed = DeepSpeedConfig(copy.deepcopy(config))  # strict: unknown zero_optimization keys raise
    assert parsed.zero_optimization_stage == stage
    assert parsed.bfloat16_config.enabled and not parsed.float16_config.enabled
    assert (parsed.train_micro_batch_size_per_gpu, parsed.gradient_accumulation_steps) == (4, 2)
    assert parsed.gradient_clipping == 1.0
    assert parsed.optimizer_name is None
    assert parsed.zero_config.overlap_comm and parsed.zero_config.contiguous_gradients
    assert parsed.zero_config.gather_16bit_weights_on_model_save == (stage == 3)


PREPARE_PROBE = """
import json, sys
from pathlib import Path
import torch
from imba.training.config import load_config
from imba.training.distributed import configure_deepspeed, make_accelerator
cfg = load_config(["train.grad_accum=2", "data.batch_size=4", "train.trackers=none"])
accelerator = make_accelerator(cfg, Path(sys.argv[1]))
configure_deepspeed(accelerator, cfg.data.batch_size)
model = torch.nn.Linear(8, 8)
engine, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
print("ENGINE", json.dumps({
    "stage": engine.zero_optimization_stage(), "micro": engine.train_micro_batch_size_per_gpu(),
    "accum": engine.gradient_accumulation_steps(), "clip": engine.gradient_clipping(),
    "train_batch": engine.train_batch_size(), "bf16": engine.bfloat16_enabled(), "fp16": engine.fp16_enabled(),
    "zero_optimizer": type(engine.optimizer).__name__, "world": accelerator.num_processes}))
"""


@pytest.mark.slow
def test_zero2_yaml_gives_the_engine_the_loops_settings_after_prepare(tmp_path):
    """What DeepSpeed really holds after `accelerator.prepare()` when launched with the shipped YAML (one process
    over gloo): the loop's micro batch, accumulation and clipping, ZeRO-2 partitioning the torch AdamW."""
    script = tmp_path / "probe.py"
    script.write_text(PREPARE_PROBE)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO),
           "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR",
                                                  str(Path.home() / ".cache" / "imba-torch-ext"))}
    proc = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                           "launch/accelerate/zero2.yaml", "--num_processes", "1", "--num_machines", "1",
                           "--main_process_port", "0", "--mixed_precision", "no", str(script), str(tmp_path)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    engine = json.loads(proc.stdout.split("ENGINE ", 1)[1].splitlines()[0])
    assert engine == {"stage": 2, "micro": 4, "accum": 2, "clip": 1.0, "train_batch": 8, "bf16": False,
                      "fp16": False, "zero_optimizer": "DeepSpeedZeroOptimizer", "world": 1}


def test_mixed_precision_in_a_deepspeed_yaml_is_refused(tmp_path, monkeypatch):
    """Why the ZeRO YAMLs carry no mixed_precision: accelerate rejects it next to a deepspeed_config_file."""
    from accelerate.utils import DeepSpeedPlugin

    monkeypatch.chdir(REPO)
    bad = yaml.safe_load((ACCELERATE_DIR / "zero2.yaml").read_text()) | {"mixed_precision": "bf16"}
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(bad))
    _, env = deepspeed_launch_env(*resolve_launch(["--config_file", str(tmp_path / "bad.yaml"),
                                                   "--main_process_port", "0"]))
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match="deepspeed_config_file"):
        DeepSpeedPlugin()


@pytest.mark.parametrize("name, stage", [("zero2.json", 2), ("zero3.json", 3)])
def test_deepspeed_json(name, stage):
    config = json.loads((DEEPSPEED_DIR / name).read_text())
    assert config["zero_optimization"]["stage"] == stage
    assert config["bf16"] == {"enabled": "auto"}
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping"):
        assert config[key] == "auto"
    assert "optimizer" not in config  # a DeepSpeed optimizer would JIT-compile cpu_adam/fused_adam


# ---- SLURM scripts: static checks ---------------------------------------------------------------------------------

def test_scripts_exist():
    assert {p.name for p in SCRIPTS} >= {"node_launch.sh", "train_single_node.sbatch", "train_multi_node.sbatch"}


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_syntax_and_strict_mode(script):
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=300)  # hang guard
    assert result.returncode == 0, result.stderr
    text = script.read_text()
    assert text.startswith("#!/bin/bash\n")
    assert "\nset -euo pipefail\n" in text
    code = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    absolute = [line for line in code if re.search(r"(?<![\w.}])/(?!dev/null)[A-Za-z]", line)]
    assert absolute == []  # no machine-specific paths


@pytest.mark.parametrize("script", [SINGLE, MULTI], ids=lambda p: p.name)
def test_sbatch_directives(script):
    directives = re.findall(r"^#SBATCH (\S+)", script.read_text(), flags=re.M)
    for needed in ("--gres=gpu:8", "--signal=B:USR1@180", "--requeue", "--open-mode=append", "--ntasks-per-node=1"):
        assert needed in directives


# ---- SLURM scripts under bash with fakes --------------------------------------------------------------------------

FAKE_SCONTROL = """\
#!/bin/bash
echo "$*" >> "$FAKE_DIR/scontrol.log"
if [[ $1 == show && $2 == hostnames ]]; then printf '%s\\n' $FAKE_HOSTS; fi
"""

# Starts "$@" once per node with SLURM_NODEID/SLURM_PROCID set, forwards USR1/TERM to the tasks, exits with the
# highest task status.
FAKE_SRUN = """\
#!/bin/bash
printf '%s\\n' "$@" > "$FAKE_DIR/srun.args"
while [[ $1 == -* ]]; do shift; done
pids=()
forward() { interrupted=1; for p in "${pids[@]}"; do kill -s "$1" "$p" 2>/dev/null; done; }
trap 'forward USR1' USR1
trap 'forward TERM' TERM
for ((i = 0; i < SLURM_NNODES; i++)); do
    SLURM_NODEID=$i SLURM_PROCID=$i SLURM_LOCALID=0 "$@" &
    pids+=($!)
done
status=0
for p in "${pids[@]}"; do
    while :; do interrupted=0; rc=0; wait "$p" || rc=$?; (( interrupted )) || break; done
    if (( rc > status )); then status=$rc; fi
done
exit $status
"""

# Records its arguments, environment and ignored-signal mask; FAKE_MODE=exit:N exits N, FAKE_MODE=worker starts a
# fake training process and, like `accelerate launch`, exits 1 when that process fails.
FAKE_ACCELERATE = """\
#!/bin/bash
node=${SLURM_NODEID:-0}
printf '%s\\n' "$@" > "$FAKE_DIR/accelerate.$node.args"
env > "$FAKE_DIR/accelerate.$node.env"
grep '^SigIgn:' /proc/$$/status > "$FAKE_DIR/accelerate.$node.sigign"
case $FAKE_MODE in
    exit:*) exit "${FAKE_MODE#exit:}" ;;
    requeue) echo "$IMBA_REQUEUE_FILE" > "$FAKE_DIR/requeue_file"; echo 75 > "$IMBA_REQUEUE_FILE"; exit 1 ;;
    worker) "$FAKE_PYTHON" "$FAKE_DIR/worker.py" "$node" && exit 0 || exit 1 ;;
esac
"""

FAKE_WORKER = """\
import os, signal, sys, time
node, out = sys.argv[1], os.environ["FAKE_DIR"]
open(os.path.join(out, f"starting.{node}"), "w").close()
time.sleep(float(os.environ.get("FAKE_STARTUP", "0")))  # "loading the models": SIGUSR1 is still ignored
got = []
signal.signal(signal.SIGUSR1, lambda *_: got.append("USR1"))
signal.signal(signal.SIGTERM, lambda *_: got.append("TERM"))
open(os.path.join(out, f"ready.{node}"), "w").close()
deadline = time.monotonic() + 300  # the test signals within moments; this only ends a forgotten worker
while not got and time.monotonic() < deadline:
    time.sleep(0.01)
time.sleep(0.3 if got else 0)  # "finish the step and write the checkpoint": the scripts must wait for it
open(os.path.join(out, f"worker.{node}"), "w").write(",".join(got) or "timeout")
sys.exit(75 if got else 3)  # like train.py: checkpoint, then 75 = pre-empted
"""


@pytest.fixture
def fakes(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("scontrol", FAKE_SCONTROL), ("srun", FAKE_SRUN), ("accelerate", FAKE_ACCELERATE)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    (tmp_path / "worker.py").write_text(FAKE_WORKER)
    return tmp_path


def run_sbatch(script: Path, fakes: Path, *args: str, nodes: int = 1, mode: str = "exit:0",
               send: signal.Signals | None = None, send_when: str = "ready", **env: str) -> subprocess.CompletedProcess:
    """Run the batch script as SLURM would (cwd anywhere, SLURM_* set); optionally signal it once every fake
    training process has installed its handlers (send_when="ready") or has only started ("starting")."""
    hosts = [f"gpu-{i + 7:02d}" for i in range(nodes)]
    full_env = {
        "PATH": f"{fakes / 'bin'}{os.pathsep}{os.environ['PATH']}", "HOME": str(fakes), "LANG": "C",
        "SLURM_JOB_ID": str(JOB_ID), "SLURM_SUBMIT_DIR": str(REPO), "SLURM_NNODES": str(nodes),
        "SLURM_JOB_NODELIST": f"gpu-[07-{6 + nodes:02d}]", "FAKE_HOSTS": " ".join(hosts),
        "FAKE_DIR": str(fakes), "FAKE_MODE": mode, "FAKE_PYTHON": sys.executable, **env,
    }
    out, err = fakes / "stdout.txt", fakes / "stderr.txt"
    with out.open("w") as stdout, err.open("w") as stderr:
        proc = subprocess.Popen(["bash", str(script), *args], cwd=fakes, env=full_env, stdout=stdout,
                                stderr=stderr, text=True, start_new_session=True)
    try:
        if send is not None:
            deadline = time.monotonic() + HANG_S
            while not all((fakes / f"{send_when}.{i}").exists() for i in range(nodes)):
                assert proc.poll() is None, "the script exited before the fake training started"
                assert time.monotonic() < deadline, f"timed out after {HANG_S} s: the fake training never started"
                time.sleep(0.01)
            proc.send_signal(send)
        proc.wait(timeout=HANG_S)  # the markers are read right after: the script must not exit before the training
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # anything the script left behind
        except ProcessLookupError:
            pass
        proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out.read_text(), err.read_text())


def launched(fakes: Path, node: int = 0) -> list[str]:
    return (fakes / f"accelerate.{node}.args").read_text().splitlines()


def requeues(fakes: Path) -> list[str]:
    log = fakes / "scontrol.log"
    return [line for line in log.read_text().splitlines() if line.startswith("requeue")] if log.exists() else []


def usr1_ignored(fakes: Path, node: int = 0) -> bool:
    mask = int((fakes / f"accelerate.{node}.sigign").read_text().split()[1], 16)
    return bool(mask >> (signal.SIGUSR1 - 1) & 1)


def test_single_node_launch_command(fakes):
    result = run_sbatch(SINGLE, fakes, "train.max_steps=10", "data.shards=/d/{000..009}.tar")
    assert result.returncode == 0, result.stderr
    assert launched(fakes) == [
        "launch", "--config_file", "launch/accelerate/zero2.yaml", "--num_processes", "8",
        "--num_machines", "1", "--machine_rank", "0", "--main_process_port", JOB_PORT,
        "train.py", "--config", "configs/1b_256.yaml", "--resume", "latest",
        "train.max_steps=10", "data.shards=/d/{000..009}.tar"]
    env = dict(line.split("=", 1) for line in (fakes / "accelerate.0.env").read_text().splitlines() if "=" in line)
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert usr1_ignored(fakes)  # the launcher must survive SIGUSR1; the training processes handle it
    assert requeues(fakes) == []


def test_single_node_settings_from_environment(fakes):
    result = run_sbatch(SINGLE, fakes, CONFIG="configs/tiny.yaml", GPUS_PER_NODE="4", PORT="31000",
                        ACCELERATE_CONFIG="launch/accelerate/multi_gpu.yaml")
    assert result.returncode == 0, result.stderr
    args = launched(fakes)
    assert args[args.index("--config_file") + 1] == "launch/accelerate/multi_gpu.yaml"
    assert args[args.index("--num_processes") + 1] == "4"
    assert args[args.index("--main_process_port") + 1] == "31000"
    assert args[args.index("--config") + 1] == "configs/tiny.yaml"


def test_multi_node_launch_command(fakes):
    result = run_sbatch(MULTI, fakes, "train.max_steps=10", nodes=3)
    assert result.returncode == 0, result.stderr
    assert "show hostnames gpu-[07-09]" in (fakes / "scontrol.log").read_text()
    srun_args = (fakes / "srun.args").read_text().splitlines()
    assert {"--nodes=3", "--ntasks-per-node=1"} <= set(srun_args)
    for node in range(3):
        assert launched(fakes, node) == [
            "launch", "--config_file", "launch/accelerate/multi_node.yaml", "--num_processes", "24",
            "--num_machines", "3", "--machine_rank", str(node), "--main_process_port", JOB_PORT,
            "--main_process_ip", "gpu-07",
            "train.py", "--config", "configs/1b_256.yaml", "--resume", "latest", "train.max_steps=10"]
        assert usr1_ignored(fakes, node)
    assert requeues(fakes) == []


@pytest.mark.parametrize("script", [SINGLE, MULTI], ids=["single", "multi"])
@pytest.mark.parametrize("status, requeued", [(75, True), (3, False), (0, False)])
def test_exit_status_decides_requeue(fakes, script, status, requeued):
    result = run_sbatch(script, fakes, nodes=2 if script == MULTI else 1, mode=f"exit:{status}")
    assert requeues(fakes) == ([f"requeue {JOB_ID}"] if requeued else [])
    assert result.returncode == (0 if requeued else status), result.stderr


@pytest.mark.parametrize("script, nodes", [(SINGLE, 1), (MULTI, 2)], ids=["single", "multi"])
def test_usr1_reaches_training_and_requeues(fakes, script, nodes):
    """SIGUSR1 to the batch shell → every training process; they exit 75, the launcher reports 1 (as accelerate
    does), the node script reports 75, the batch script requeues."""
    result = run_sbatch(script, fakes, nodes=nodes, mode="worker", send=signal.SIGUSR1)
    for node in range(nodes):
        assert (fakes / f"worker.{node}").read_text() == "USR1"
    assert requeues(fakes) == [f"requeue {JOB_ID}"]
    assert result.returncode == 0, result.stderr


def test_node_launch_alone(fakes):
    """The per-node script by itself: a forwarded SIGUSR1 turns the launcher's failure into 75; otherwise the
    launcher's status passes through; several nodes need MAIN_PROCESS_IP."""
    env = {"PATH": f"{fakes / 'bin'}{os.pathsep}{os.environ['PATH']}", "FAKE_DIR": str(fakes),
           "FAKE_PYTHON": sys.executable, "FAKE_MODE": "worker"}
    proc = subprocess.Popen(["bash", str(SLURM_DIR / "node_launch.sh")], cwd=REPO, env=env, text=True,
                            stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + HANG_S
        while not (fakes / "ready.0").exists():
            assert proc.poll() is None, "the script exited before the fake training started"
            assert time.monotonic() < deadline, f"timed out after {HANG_S} s: the fake training never started"
            time.sleep(0.01)
        proc.send_signal(signal.SIGUSR1)
        proc.communicate(timeout=HANG_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 75
    assert (fakes / "worker.0").read_text() == "USR1"

    run = lambda **extra: subprocess.run(["bash", str(SLURM_DIR / "node_launch.sh")], cwd=REPO, env=env | extra,
                                         capture_output=True, text=True, timeout=300)  # a hang guard
    assert run(FAKE_MODE="exit:1").returncode == 1
    assert run(FAKE_MODE="exit:75").returncode == 75
    # a training process that asked for a requeue without a signal (a dead store): accelerate reports 1, the script 75
    asked = run(FAKE_MODE="requeue")
    assert asked.returncode == 75 and "asked for a requeue" in asked.stderr
    assert not Path((fakes / "requeue_file").read_text().strip()).exists()  # the script's file is gone
    missing = run(FAKE_MODE="exit:0", NUM_MACHINES="2")
    assert missing.returncode == 2 and "MAIN_PROCESS_IP" in missing.stderr


def test_sigterm_is_forwarded_without_requeue(fakes):
    """scancel / SLURM pre-emption: checkpoint on the way out, but leave requeueing to SLURM."""
    result = run_sbatch(SINGLE, fakes, mode="worker", send=signal.SIGTERM)
    assert (fakes / "worker.0").read_text() == "TERM"
    assert requeues(fakes) == []
    assert result.returncode == 1


def test_wrong_submit_directory_fails_clearly(fakes):
    result = run_sbatch(SINGLE, fakes, SLURM_SUBMIT_DIR=str(fakes))
    assert result.returncode == 2
    assert "repository root" in result.stderr
    assert not (fakes / "accelerate.0.args").exists()


# ---- the real launcher ---------------------------------------------------------------------------------------------

STUB_TRAINING = """\
import os, signal, sys, time
out = os.environ["FAKE_DIR"]
rank = os.environ["RANK"]
got = []
signal.signal(signal.SIGUSR1, lambda *_: got.append("USR1"))
open(os.path.join(out, f"ready.{rank}"), "w").write(" ".join(sys.argv[1:]))
deadline = time.monotonic() + 60
while not got and time.monotonic() < deadline:
    time.sleep(0.02)
open(os.path.join(out, f"worker.{rank}"), "w").write(",".join(got) or "timeout")
sys.exit(75 if got else 3)
"""


@pytest.mark.slow
def test_node_launch_with_real_accelerate_forwards_usr1(tmp_path):
    """Real `accelerate launch` (torchrun, 2 CPU processes, each in its own session): SIGUSR1 to node_launch.sh
    reaches both training processes, the launcher survives it, and the exit status is 75."""
    (tmp_path / "stub.py").write_text(STUB_TRAINING)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "ACCELERATE_"))}
    env.update(PATH=f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}", FAKE_DIR=str(tmp_path),
               ACCELERATE_USE_CPU="true", ACCELERATE_CONFIG="launch/accelerate/multi_gpu.yaml", GPUS_PER_NODE="2",
               PORT="0", TRAIN_SCRIPT=str(tmp_path / "stub.py"), OMP_NUM_THREADS="1", HF_HOME=str(tmp_path / "hf"))
    proc = subprocess.Popen(["bash", str(SLURM_DIR / "node_launch.sh"), "train.max_steps=3"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 300  # a hang guard
        while not ((tmp_path / "ready.0").exists() and (tmp_path / "ready.1").exists()):
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate(timeout=300)[0][-3000:]
            time.sleep(0.1)
        proc.send_signal(signal.SIGUSR1)
        output, _ = proc.communicate(timeout=300)  # a hang guard: TimeoutExpired says "timed out"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 75, output[-3000:]
    assert [(tmp_path / f"worker.{r}").read_text() for r in (0, 1)] == ["USR1", "USR1"]
    assert (tmp_path / "ready.0").read_text() == "--config configs/1b_256.yaml --resume latest train.max_steps=3"
    assert "exited with 1 after SIGUSR1" in output  # accelerate turns the workers' 75 into 1


def test_a_sigusr1_during_start_up_is_repeated_until_the_training_handles_it(fakes):
    # the training ignores SIGUSR1 for its first second (the launcher's inherited "ignore", before train.py
    # installs its handler): one forwarded signal would be lost and the job would run into its time limit
    result = run_sbatch(SINGLE, fakes, mode="worker", send=signal.SIGUSR1, send_when="starting", FAKE_STARTUP="1",
                        RESEND_EVERY="0.3")
    # a repeat may also land while the worker finishes its step (the handler only sets a flag): SIGUSR1s only
    assert set((fakes / "worker.0").read_text().split(",")) == {"USR1"}, result.stderr
    assert result.returncode == 0 and requeues(fakes) == [f"requeue {JOB_ID}"]


def test_processes_on_one_machine_share_its_threads_rather_than_each_taking_all(monkeypatch):
    import torch
    from accelerate import Accelerator

    from imba.training.distributed import describe_world, set_cpu_threads, threads_per_process

    assert [threads_per_process(a, p) for a, p in [(2, 1), (2, 2), (8, 2), (8, 3), (1, 4)]] == [2, 1, 4, 2, 1]
    accelerator = Accelerator(cpu=True)
    assert describe_world(accelerator) == "NO"
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(4)
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # this process as one of two on the machine
        assert set_cpu_threads(accelerator) == (", 2 CPU threads per process (4 available, 2 processes here; "
                                                "OMP_NUM_THREADS=N chooses)") and torch.get_num_threads() == 2
        monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user's choice is kept, and said
        torch.set_num_threads(3)
        assert set_cpu_threads(accelerator) == ", 3 CPU threads per process (OMP_NUM_THREADS)"
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


def test_deepspeeds_first_compile_on_the_cpu_is_announced_until_its_op_is_built(tmp_path, monkeypatch):
    from imba.training.distributed import DEEPSPEED_CPU_OP, deepspeed_build_notice

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    assert deepspeed_build_notice() is None  # not a DeepSpeed launch
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    assert deepspeed_build_notice() is None  # accelerate drops DeepSpeed then (said by make_accelerator)
    monkeypatch.delenv("ACCELERATE_USE_CPU")
    assert deepspeed_build_notice() == (f"DeepSpeed: compiling its C++ op for collectives on the CPU "
                                        f"({DEEPSPEED_CPU_OP}), once on this machine: a few minutes, kept in {tmp_path}")
    (tmp_path / DEEPSPEED_CPU_OP).mkdir()
    (tmp_path / DEEPSPEED_CPU_OP / f"{DEEPSPEED_CPU_OP}.so").write_bytes(b"")
    assert deepspeed_build_notice() is None  # built: nothing to wait for
