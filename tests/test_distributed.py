"""Real 2-process runs over gloo on CPU: DDP, DeepSpeed ZeRO-2 and ZeRO-3.

Each test asserts the world size it really got (a known pitfall: `accelerate launch --cpu --num_processes 2` quietly
starts one process), that both ranks end with bitwise-identical parameters, and that stopping at a checkpoint and
resuming reproduces the uninterrupted run exactly: same per-step losses, same final parameters. Checkpoints also
resume on another process count: DDP as they are, ZeRO-2/3 through DeepSpeed's universal format. ZeRO-3 (parameters
and EMA partitioned over the ranks) trains like ZeRO-2, and its checkpoints export like any other.
"""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from imba.training.checkpoints import load_ema_state, write_manifest
from imba.training.resume import prepare_world_size_change
from imba.training.config import ConfigError

REPO = Path(__file__).resolve().parents[1]
RUN = [
    "data.resolution=64", "data.batch_size=2", "data.synthetic_samples=24", "train.log_every=1",
    "train.sample_every=0", "sample.steps=2", "sample.prompts=[a red circle]", "optim.warmup_steps=2",
    # the tiny model at lr 1e-3: three AdamW steps move weights by ~3e-3, the scale the cross-engine bounds below
    # are fractions of
    "train.trackers=none", "model.preset=tiny", "optim.lr=1e-3",
    # the IMBA loss with running means of D per timestep bin: state that must be the same on every rank for an
    # exact resume
    "loss.kind=imba", "loss.normalize=timestep_mean",
    # the efficient estimator with caption dropout 0.7: at some steps one rank drops every row (no kept row, so no
    # no-grad pass of its own) while the other does not: DDP must not hang, ZeRO-3 must run the same passes
    "loss.estimator=efficient", "loss.lam=0.3",
    # validation every 3 steps: each rank evaluates its share of the held-out set, one reduction
    "train.val_every=3", "data.val_samples=5",
]
LAUNCHERS = {
    # the CPU form that really starts 2 processes (gloo)
    "ddp": (["--multi_gpu"], {"ACCELERATE_USE_CPU": "true"}),
    "zero2": (["--use_deepspeed", "--zero_stage", "2", "--gradient_accumulation_steps", "1",
               "--gradient_clipping", "1.0"], {}),
    "zero3": (["--use_deepspeed", "--zero_stage", "3", "--zero3_init_flag", "false", "--gradient_accumulation_steps",
               "1", "--gradient_clipping", "1.0"], {}),
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


def launch(kind, args, tmp_path, num_processes=2):
    _, extra_env = LAUNCHERS[kind]
    env = launch_env(extra_env)
    cmd = [*launch_command(kind, num_processes), str(REPO / "train.py"), *RUN, *args]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:  # pytest.fail prints the whole log, where an assert's message is cut to a few lines
        pytest.fail(f"exit {proc.returncode}\n--- stdout ---\n{proc.stdout[-3000:]}\n"
                    f"--- stderr ---\n{proc.stderr[-8000:]}", pytrace=False)
    return proc.stdout + proc.stderr


def digests(output: str) -> dict[int, str]:
    return {int(rank): digest for rank, digest in re.findall(r"rank (\d+)/\d+: parameters ([0-9a-f]{16})", output)}


def losses(out_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row["loss"] for row in rows}


@pytest.fixture(scope="module")
def full_runs(tmp_path_factory):
    """`full_runs(kind)`: (output folder, log) of an uninterrupted 6-step 2-process run with checkpoints and sample
    grids at steps 3 and 6, launched once per module and shared by the tests that need it."""
    cache = {}

    def run(kind):
        if kind not in cache:
            root = tmp_path_factory.mktemp(f"full_{kind}")
            out = root / "full"
            cache[kind] = out, launch(kind, [f"train.output_dir={out}", "train.max_steps=6", "train.save_every=3",
                                             "train.sample_every=3"], root)
        return cache[kind]
    return run


def ema_state(checkpoint: Path) -> dict:
    return load_ema_state(checkpoint)


def copy_checkpoint(run: Path, step: int, dest: Path) -> Path:
    """`dest` as the output folder of a run killed right after saving `run`'s checkpoint at `step` (the same save a
    run ending at that step makes), for resuming without retraining the first steps."""
    name = f"step_{step:07d}"
    shutil.copytree(run / "checkpoints" / name, dest / "checkpoints" / name)
    (dest / "checkpoints" / "latest").write_text(name + "\n")
    return dest / "checkpoints" / name


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ddp", "zero2", "zero3"])
def test_two_processes_train_identically_and_resume_exactly(tmp_path, kind, full_runs):
    full, uninterrupted = full_runs(kind)
    expected_type = "MULTI_CPU" if kind == "ddp" else f"DEEPSPEED, ZeRO-{kind[-1]}"
    # the mode, the ZeRO stage and the threads each process took: 2 cores or more shared by 2 processes
    assert re.search(rf"world size 2 \({expected_type}\), device cpu(:\d)?, \d+ CPU threads per process",
                     uninterrupted)
    full_digests = digests(uninterrupted)  # ZeRO-3: gathered from both ranks' partitions
    assert set(full_digests) == {0, 1} and full_digests[0] == full_digests[1]  # ranks agree bitwise
    # the mean over ranks of the dropped share (2 rows per rank) reaches 0.75 only when one rank dropped both rows
    rows = [json.loads(line) for line in (full / "metrics.jsonl").read_text().splitlines()]
    assert any(r["caption_dropout_rate"] >= 0.75 for r in rows)

    split = tmp_path / "split"
    step3 = copy_checkpoint(full, 3, split)  # "killed" after step 3
    resumed = launch(kind, [f"train.output_dir={split}", "train.max_steps=6"], tmp_path)  # resume=latest
    assert f"resumed from {step3} at step 3" in resumed
    resumed_digests = digests(resumed)
    # same final parameters, bitwise, on both ranks, although the uninterrupted run sampled a grid at step 3
    assert resumed_digests == full_digests
    assert [losses(split)[s] for s in (4, 5, 6)] == [losses(full)[s] for s in (4, 5, 6)]  # same batches, noise
    # the validation loss of the same EMA weights on the same fixed set: bitwise the same after the resume
    val = {out: {r["step"]: r.get("val/loss") for r in map(json.loads, (out / "metrics.jsonl").read_text()
                                                             .splitlines())} for out in (full, split)}
    assert val[full][3] > 0 and val[split][6] == val[full][6] > 0
    checkpoint = split / "checkpoints" / "step_0000006"
    assert (checkpoint / "random_states_0.pkl").is_file() and (checkpoint / "random_states_1.pkl").is_file()
    split_ema, full_ema = ema_state(checkpoint), ema_state(full / "checkpoints" / "step_0000006")
    assert split_ema["optimization_step"] == full_ema["optimization_step"] == 6
    assert all(torch.equal(a, b) for a, b in zip(split_ema["shadow_params"], full_ema["shadow_params"], strict=True))


def train_single_process(args, tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(REPO / "train.py"), *RUN, *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_ddp_checkpoint_resumes_on_another_process_count(tmp_path, full_runs):
    out = tmp_path / "run"
    copy_checkpoint(full_runs("ddp")[0], 3, out)
    proc = train_single_process([f"train.output_dir={out}", "train.max_steps=5"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "world size 1" in proc.stdout and "resumed from" in proc.stdout
    assert "resuming a 2-process checkpoint on 1 processes" in proc.stdout
    # the weights the two processes saved, bitwise (a run that started from fresh weights prints another digest)
    assert f"resumed from {out / 'checkpoints' / 'step_0000003'} at step 3, parameters {saved_digest(out)}" in (
        proc.stdout)
    assert "done: step 5" in proc.stdout
    step5 = out / "checkpoints" / "step_0000005"
    assert scheduler_steps(step5) == 5  # 3 × 2 processes, then 2 × 1, not 3 × 2 + 2
    # AdamW continued from the saved moments: its step count is 3 + 2, not the 2 of a fresh optimizer
    adam = torch.load(step5 / "optimizer.bin", weights_only=False)["state"]
    assert {state["step"].item() for state in adam.values()} == {5.0}
    # the data continues after the 3 steps × 2 ranks × 2 samples the saved run had read
    assert "data: each rank continues after 6 batches of 2" in proc.stdout
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [4, 5] and all(r["nonfinite_steps"] == 0 for r in rows)


def saved_digest(run: Path, step: int = 3) -> str:
    """The parameter digest train.py prints, of the weights in a DDP (plain) checkpoint's model.safetensors."""
    from imba.training.distributed import parameter_digest
    from models.dit import build_transformer

    weights = load_file(run / "checkpoints" / f"step_{step:07d}" / "model.safetensors")
    model = build_transformer("tiny", sample_size=8, caption_channels=weights["caption_projection.linear_1.weight"]
                              .shape[1], in_channels=weights["pos_embed.proj.weight"].shape[1])
    model.load_state_dict(weights)  # strict: every parameter, in the model's own order
    return parameter_digest(model)


def zero_states(checkpoint: Path, world: int) -> tuple[dict, dict, torch.Tensor, dict]:
    """A ZeRO-1/2 checkpoint's full weights and AdamW moments per parameter, stitched here from its per-rank flat
    partitions (not with DeepSpeed's converter): the partitions in rank order form the flat parameter group."""
    engine = checkpoint / "pytorch_model"
    model = torch.load(engine / "mp_rank_00_model_states.pt", weights_only=False, map_location="cpu")
    parts = [torch.load(engine / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt", weights_only=False,
                        map_location="cpu")["optimizer_state_dict"] for rank in range(world)]
    flat = {"fp32": torch.cat([part["single_partition_of_fp32_groups"][0] for part in parts]),
            **{key: torch.cat([part["base_optimizer_state"]["state"][0][key] for part in parts])
               for key in ("exp_avg", "exp_avg_sq")}}
    full, offset = {}, 0
    for name, shape in model["param_shapes"][0].items():  # parameter order = the group's flattening order
        full[name] = {key: values[offset:offset + shape.numel()].view(shape) for key, values in flat.items()}
        offset += shape.numel()
    base = parts[0]["base_optimizer_state"]
    return model["module"], full, base["state"][0]["step"], base["param_groups"][0]


def write_plain_copy(checkpoint: Path, dest: Path, world: int) -> None:
    """The same checkpoint as a single-process (no DeepSpeed) one: the reference a ZeRO resume must match."""
    dest.mkdir(parents=True)
    for item in checkpoint.iterdir():
        if item.is_file():  # LR schedule, EMA, step, RNG states, config
            shutil.copy2(item, dest / item.name)
    module, full, step, group = zero_states(checkpoint, world)
    assert all(torch.equal(module[name], states["fp32"]) for name, states in full.items())  # stitched right
    torch.save(module, dest / "pytorch_model.bin")
    adam = {index: {"step": step.clone(), "exp_avg": states["exp_avg"].clone(),
                    "exp_avg_sq": states["exp_avg_sq"].clone()} for index, states in enumerate(full.values())}
    torch.save({"state": adam, "param_groups": [{**group, "params": list(adam)}]}, dest / "optimizer.bin")
    write_manifest(dest)  # a checkpoint of this new layout: the copied manifest listed the DeepSpeed shards
    (dest.parent / "latest").write_text(dest.name + "\n")


def adam_steps(checkpoint: Path, world: int) -> list[float]:
    """AdamW's step count in each rank's optimizer partition."""
    return [torch.load(checkpoint / "pytorch_model" / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt",
                       weights_only=False)["optimizer_state_dict"]["base_optimizer_state"]["state"][0]["step"].item()
            for rank in range(world)]


def scheduler_steps(checkpoint: Path) -> int:
    return torch.load(checkpoint / "scheduler.bin", weights_only=False)["last_epoch"]


@pytest.mark.slow
def test_zero2_checkpoint_resumes_on_another_process_count(tmp_path, full_runs):
    out, reference = tmp_path / "run", tmp_path / "reference"
    step3 = copy_checkpoint(full_runs("zero2")[0], 3, out)  # written by 2 processes
    write_plain_copy(step3, reference / "checkpoints" / step3.name, world=2)
    # the reference: the same state resumed by a plain single-process run (torch AdamW, no DeepSpeed)
    plain = train_single_process([f"train.output_dir={reference}", "train.max_steps=6"], tmp_path)
    assert plain.returncode == 0, plain.stderr[-3000:]
    saved_digest = re.search(r"at step 3, parameters ([0-9a-f]{16})", plain.stdout).group(1)

    # 2 → 1 process: converted once to <checkpoint>/universal/, loaded with DeepSpeed's load_universal
    shrunk = launch("zero2", [f"train.output_dir={out}", "train.max_steps=6"], tmp_path, num_processes=1)
    assert "world size 1 (DEEPSPEED, ZeRO-2)" in shrunk
    assert f"resuming a 2-process ZeRO-2 checkpoint on 1 processes through {step3 / 'universal'}" in shrunk
    assert f"resumed from {step3} at step 3, parameters {saved_digest}" in shrunk  # the saved weights, bitwise
    assert "done: step 6" in shrunk and (step3 / "universal" / "pytorch_model" / "zero").is_dir()
    # same data, noise, weights and AdamW moments → same losses and weights up to float rounding (DeepSpeed and
    # torch AdamW sum in other orders); with the moments and step reset instead, the weights at step 6 differ by
    # about twice what the three steps move them, and the losses at steps 5-6 by 4% and 23%.
    # Losses: rel=1e-5, ~100 float32 roundings (2^-24) of the loss: the loss sees the weights' rounding only (the
    # parameters on which AdamW amplifies it have gradients ~0, so the loss hardly depends on them)
    resumed_losses, reference_losses = losses(out), losses(reference)
    assert [resumed_losses[s] for s in (4, 5, 6)] == pytest.approx([reference_losses[s] for s in (4, 5, 6)],
                                                                    rel=1e-5, abs=1e-6)
    step6 = out / "checkpoints" / "step_0000006"
    weights = torch.load(step6 / "pytorch_model" / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    expected = load_file(reference / "checkpoints" / "step_0000006" / "model.safetensors")
    assert weights.keys() == expected.keys()
    # Weights: a fraction of what the resumed steps move them, not a rounding constant. On parameters whose
    # gradient is zero in exact arithmetic (attention key biases: softmax ignores them), AdamW turns rounding noise
    # into steps as large as those parameters' whole movement (~1e-5), still a small fraction of the ~3e-3 the
    # steps move the weights; a wrong resume (moments or step lost, the wrong partition loaded) is of the order of
    # `moved` or more
    saved = torch.load(reference / "checkpoints" / step3.name / "pytorch_model.bin", weights_only=False)
    moved = max((expected[k] - saved[k]).abs().max().item() for k in expected)
    gap = max((weights[k] - expected[k]).abs().max().item() for k in weights)
    assert moved > 1e-4 and gap <= 0.05 * moved, (gap, moved)
    # AdamW's step count and the LR schedule continue (accelerate steps the schedule once per process per step)
    assert adam_steps(step6, world=1) == [6.0] and scheduler_steps(step6) == 6

    # 1 → 2 processes: the 1-process ZeRO-2 checkpoint re-partitioned over two ranks
    grown = launch("zero2", [f"train.output_dir={out}", "train.max_steps=8"], tmp_path)
    assert "world size 2 (DEEPSPEED, ZeRO-2)" in grown
    assert f"resumed from {step6} at step 6, parameters {digests(shrunk)[0]}" in grown
    grown_digests = digests(grown)
    assert set(grown_digests) == {0, 1} and grown_digests[0] == grown_digests[1]
    step8 = out / "checkpoints" / "step_0000008"
    assert adam_steps(step8, world=2) == [8.0, 8.0] and scheduler_steps(step8) == 16


def test_deepspeed_without_zero_on_another_process_count_is_refused_in_one_line(tmp_path):
    plugin = SimpleNamespace(zero_stage=0, deepspeed_config={})
    accelerator = SimpleNamespace(num_processes=1, state=SimpleNamespace(deepspeed_plugin=plugin),
                                  is_main_process=True, print=print)
    with pytest.raises(ConfigError) as err:
        prepare_world_size_change(tmp_path, 2, accelerator)
    assert str(err.value) == ("this checkpoint was written by 2 processes; another process count is supported with "
                              "DDP and DeepSpeed ZeRO-1/2/3, not ZeRO-0: resume with 2 processes")
    assert plugin.deepspeed_config == {}  # nothing converted or switched


@pytest.mark.slow
def test_zero3_trains_like_zero2_holds_the_ema_whole_and_exports(tmp_path, full_runs):
    """ZeRO-3 partitions the parameters and the EMA over the ranks: the loop must not read full weights outside
    the engine's forward, checkpoints hold the EMA whole, and the training is ZeRO-2's up to float rounding."""
    (zero3, zero3_log), (zero2, _) = full_runs("zero3"), full_runs("zero2")
    step3, step6 = zero3 / "checkpoints" / "step_0000003", zero3 / "checkpoints" / "step_0000006"
    assert (step6 / "pytorch_model" / "zero_pp_rank_1_mp_rank_00_model_states.pt").is_file()  # really partitioned
    assert sorted(p.name for p in (zero3 / "samples").iterdir()) == ["step_0000003.png", "step_0000006.png"]

    # ZeRO-2 (whole parameters, diffusers' EMAModel) on the same data: the same losses and EMA up to rounding.
    # Losses: rel=1e-5, ~100 float32 roundings (2^-24) of the loss, as in the resume test above; training on other
    # weights (a lost or stale update, AdamW's moments reset) changes them by percents
    assert [losses(zero3)[s] for s in range(1, 7)] == pytest.approx([losses(zero2)[s] for s in range(1, 7)],
                                                                    rel=1e-5, abs=1e-6)
    ema = ema_state(step6)["shadow_params"]
    reference = ema_state(zero2 / "checkpoints" / "step_0000006")["shadow_params"]
    assert [t.shape for t in ema] == [t.shape for t in reference]  # whole tensors, not this rank's slices
    gap = max((a - b).abs().max().item() for a, b in zip(ema, reference))
    moved = max((a - b).abs().max().item() for a, b in zip(ema, ema_state(step3)["shadow_params"]))
    # EMA: a fraction of what three steps move it (~3e-3 at lr 1e-3), not a rounding constant. The engines sum in
    # other orders, and on parameters whose gradient is zero in exact arithmetic (attention key biases: softmax
    # ignores them) AdamW turns that rounding noise into steps as large as those parameters' whole movement
    # (~1e-5); a real fault (an EMA update skipped, a stale partition or the wrong shard averaged in) is of the
    # order of `moved` itself or more
    assert moved > 1e-4 and gap <= 0.05 * moved, (gap, moved)

    # a ZeRO-3 checkpoint exports in a plain process, to the weights the run itself exported
    export = tmp_path / "exported"
    proc = subprocess.run([sys.executable, str(REPO / "train.py"), "--export", str(step6), str(export)], cwd=tmp_path,
                          env=launch_env({}), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    exported = load_file(export / "transformer" / "diffusion_pytorch_model.safetensors")
    expected = load_file(zero3 / "export" / "transformer" / "diffusion_pytorch_model.safetensors")
    assert exported.keys() == expected.keys() and all(torch.equal(exported[k], expected[k]) for k in expected)

    # 2 → 1 process through the universal form: the saved weights, bitwise (on a copy: the shared run stays as is)
    copy_checkpoint(zero3, 6, tmp_path / "run")
    shrunk = launch("zero3", [f"train.output_dir={tmp_path / 'run'}", "train.max_steps=7"], tmp_path, num_processes=1)
    assert "resuming a 2-process ZeRO-3 checkpoint on 1 processes" in shrunk
    assert f"at step 6, parameters {digests(zero3_log)[0]}" in shrunk and "done: step 7" in shrunk


def test_the_documented_zero_command_on_the_cpu_is_the_one_tested_here():
    text = (REPO / "docs" / "cluster.md").read_text()
    (command,) = re.findall(r"^accelerate launch --use_deepspeed (.*?) train\.py$", text.replace("\\\n  ", ""), re.M)
    flags = ["--use_deepspeed", *command.split()]
    assert flags == [*LAUNCHERS["zero2"][0], "--num_processes", "2"] and LAUNCHERS["zero2"][1] == {}


def test_a_deepspeed_launch_that_accelerate_drops_on_the_cpu_is_warned(monkeypatch, tmp_path, capsys):
    from accelerate.state import AcceleratorState

    from imba.training.config import load_config
    from imba.training.distributed import make_accelerator

    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2")
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    try:
        accelerator = make_accelerator(load_config(["train.trackers=none"]), tmp_path / "run")
        assert accelerator.state.deepspeed_plugin is None
        assert capsys.readouterr().out.strip() == (
            f"warning: the launch asked for DeepSpeed, but ACCELERATE_USE_CPU=true makes accelerate run "
            f"{accelerator.distributed_type.value} without it: no ZeRO, DDP checkpoints; for ZeRO on the CPU launch "
            "without ACCELERATE_USE_CPU")
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED")
    try:
        make_accelerator(load_config(["train.trackers=none"]), tmp_path / "run")
        assert "warning" not in capsys.readouterr().out
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
