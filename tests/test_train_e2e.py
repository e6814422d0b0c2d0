"""End to end: `train.py` on synthetic shards saves, resumes to the same step, and exports a stock pipeline."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from imba.training.checkpoints import list_checkpoints, load_ema_state, write_manifest

REPO = Path(__file__).resolve().parents[1]
TINY_RUN = [
    "data.resolution=64", "data.batch_size=2", "data.synthetic_samples=24", "data.shuffle_buffer=8",
    "train.log_every=2", "train.save_every=2", "train.sample_every=0", "sample.steps=2",
    "sample.prompts=[a red circle, a blue square]", "optim.warmup_steps=1", "train.trackers=none",
]


def run_train(args, cwd):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "2"}
    proc = subprocess.run([sys.executable, str(REPO / "train.py"), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def ema_optimization_step(checkpoint: Path) -> int:
    # accelerate stores registered objects in registration order: 0 = EMA, 1 = TrainState
    state = load_ema_state(checkpoint)
    return state["optimization_step"]


@pytest.mark.slow
@pytest.mark.parametrize("loss_kind,objective,extra", [
    ("imba", "flow", ["train.grad_accum=2", "train.trackers=tensorboard", "model.encoder_dtype=bfloat16",
                      "loss.estimator=efficient", "loss.normalize=timestep_mean"]),
    ("plain", "ddpm", ["train.mixed_precision=bf16"]),
])
def test_train_save_resume_export(tmp_path, loss_kind, objective, extra):
    out = tmp_path / "run"
    common = [*TINY_RUN, f"train.output_dir={out}", f"loss.kind={loss_kind}", f"objective.kind={objective}", *extra]
    first = run_train([*common, "train.max_steps=4"], tmp_path)
    assert "done: step 4" in first.stdout
    assert [p.name for p in list_checkpoints(out / "checkpoints")] == ["step_0000002", "step_0000004"]
    assert ema_optimization_step(out / "checkpoints" / "step_0000004") == 4
    if loss_kind == "imba":  # once is enough (test_distributed exports a ZeRO-3 checkpoint the same way)
        # exporting that checkpoint later gives the same EMA transformer as the end-of-run export
        run_train(["--export", str(out / "checkpoints" / "step_0000004"), str(tmp_path / "from_ckpt")], tmp_path)
        from safetensors.torch import load_file

        at_end = load_file(out / "export" / "transformer" / "diffusion_pytorch_model.safetensors")
        later = load_file(tmp_path / "from_ckpt" / "transformer" / "diffusion_pytorch_model.safetensors")
        assert at_end.keys() == later.keys() and all(torch.equal(at_end[k], later[k]) for k in at_end)
        assert "| steps | 4 |" in (tmp_path / "from_ckpt" / "README.md").read_text()
        # a checkpoint whose config names another model than its EMA holds is refused in one line
        import shutil

        other = tmp_path / "other" / "checkpoints" / "step_0000004"
        shutil.copytree(out / "checkpoints" / "step_0000004", other)
        config = other / "config.yaml"
        config.write_text(config.read_text().replace("preset: micro", "preset: tiny"))
        write_manifest(other)
        refused = subprocess.run([sys.executable, str(REPO / "train.py"), "--export", str(other)], cwd=tmp_path,
                                 env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True)
        assert refused.returncode == 1 and refused.stderr.strip().splitlines()[-1] == (
            f"error: the EMA in {other} does not match the model its config.yaml describes")
        assert "Traceback" not in refused.stderr

    second = run_train([*common, "train.max_steps=6", "train.keep_checkpoints=2", "--resume", "latest"], tmp_path)
    assert f"resumed from {out / 'checkpoints' / 'step_0000004'} at step 4" in second.stdout
    assert "done: step 6" in second.stdout
    # the checkpoint records what its position counts in; the same data on resume: no line about it
    recorded = torch.load(out / "checkpoints" / "step_0000004" / "train_state.pt", weights_only=False)["data"]
    assert len(recorded) == 16 and "changed since the checkpoint" not in second.stdout
    # keep_checkpoints=2: the oldest is pruned, `latest` names the new one; the EMA continued from its saved state
    assert [p.name for p in list_checkpoints(out / "checkpoints")] == ["step_0000004", "step_0000006"]
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_0000006"
    assert ema_optimization_step(out / "checkpoints" / "step_0000006") == 6

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 4, 6]
    assert all(r["loss"] > 0 for r in rows)
    if loss_kind == "imba":
        assert {"weight_mean", "weight_std", "loss_cond_weighted", "loss_uncond"} <= rows[0].keys()
        # the IMBA monitor (concept statistics counted for the synthetic data): distance per concept bucket
        assert {f"monitor/distance_{b}" for b in ("head", "torso", "tail")} <= rows[0].keys()
        assert (out / "concepts" / "concepts.json").is_file()
    assert {f"monitor/loss_cond_{b}" for b in ("head", "torso", "tail")} <= rows[0].keys()
    assert (out / "config.yaml").is_file() and (out / "samples" / "step_0000006.png").is_file()
    if "train.trackers=tensorboard" in extra:
        assert list((out / "logs").rglob("events.out.tfevents.*"))

    # The export carries its model card (the Hub's model page) with the last grid
    from huggingface_hub import ModelCard

    card = ModelCard.load(out / "export" / "README.md")
    assert card.data.library_name == "diffusers" and f"loss-{loss_kind}" in card.data.tags
    assert "| steps | 6 |" in card.text and (out / "export" / "samples.png").read_bytes() == (
        out / "samples" / "step_0000006.png").read_bytes()

    # The export opens in a stock diffusers pipeline, offline, and generates at the trained size.
    from diffusers import PixArtAlphaPipeline

    pipe = PixArtAlphaPipeline.from_pretrained(out / "export")
    pipe.set_progress_bar_config(disable=True)
    image = pipe("a red circle", height=64, width=64, num_inference_steps=2, use_resolution_binning=False,
                 generator=torch.Generator().manual_seed(0)).images[0]
    assert image.size == (64, 64)


@pytest.mark.slow
def test_fine_tune_from_an_export_at_another_resolution(tmp_path):
    base, tuned = tmp_path / "base", tmp_path / "tuned"
    run_train([*TINY_RUN, f"train.output_dir={base}", "train.max_steps=2"], tmp_path)
    # a learning rate too small to move a float32 weight: the export must hold the base model's weights exactly,
    # which a run that silently started from random weights would not
    done = run_train([*TINY_RUN, f"train.output_dir={tuned}", "train.max_steps=2", "data.resolution=128",
                      f"model.pretrained={base / 'export'}", "optim.lr=1.0e-30"], tmp_path)
    assert "done: step 2" in done.stdout
    from diffusers import PixArtTransformer2DModel
    from safetensors.torch import load_file

    tuned_model = PixArtTransformer2DModel.from_pretrained(tuned / "export" / "transformer")
    assert tuned_model.config.sample_size == 16  # 128 px / 8
    weights = "transformer/diffusion_pytorch_model.safetensors"
    before, after = load_file(base / "export" / weights), load_file(tuned / "export" / weights)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.slow
def test_bad_samples_are_skipped_counted_and_reported(tmp_path):
    from PIL import Image

    from data.synthetic import write_synthetic_shards
    from shard_helpers import encode, write_tar

    shards = tmp_path / "shards"
    write_synthetic_shards(shards, num_samples=16, samples_per_shard=16, resolution=64)
    good = encode(Image.new("RGB", (64, 64), (200, 20, 20)), "PNG")
    write_tar(shards / "hostile.tar", [
        {"__key__": "corrupt", "png": good[:40], "txt": b"a red square"},  # truncated image
        {"__key__": "no-caption", "png": good, "txt": b"   "},
        {"__key__": "fine", "png": good, "txt": b"a red square"},
    ])
    out = tmp_path / "run"
    done = run_train([*TINY_RUN, f"train.output_dir={out}", f"data.shards={shards}", "train.max_steps=10",
                      "train.log_every=10", "data.batch_size=2"], tmp_path)
    # 10 steps × 2 samples: a 9-batch epoch of the 19 (one dropped) and a batch of the next; each bad sample is
    # replaced by its next good neighbour and counted once
    assert "skipped 2 (bad image: 1, missing or empty caption: 1)" in done.stdout
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["data_skipped"] == 2
