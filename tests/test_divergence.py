"""The divergence guard: a step with a non-finite loss or gradient norm is skipped on every rank, a diverged run
stops before it saves or exports anything, and the checkpoints it leaves are all finite.

The non-finite loss comes from real data: one sample of precomputed shards whose stored VAE latent is `inf` (the
kind of damage bit rot or a bad encoder run leaves), drawn once per epoch by whichever rank the order gives it to.
"""

import io
import json
import re
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from accelerate import Accelerator
from safetensors.torch import load_file

from data.precomputed import LATENT_MEMBER, load_npy, npy_bytes
from imba.training.checkpoints import load_ema_state
from imba.training.guard import DIVERGED_EXIT_CODE, DivergenceGuard, all_finite

from test_distributed import digests, launch
from test_train_precomputed import RES, TOKENS, precomputed, run_main  # noqa: F401 (a fixture)



def test_one_bad_loss_or_grad_norm_makes_the_step_bad_and_only_consecutive_ones_diverge():
    guard = DivergenceGuard(Accelerator(cpu=True), max_bad_steps=2)
    guard.add_loss(torch.tensor(0.5))
    assert not guard.step_is_bad(torch.tensor(1.0))
    guard.add_loss(torch.tensor(float("nan")))  # one bad micro-batch spoils the whole step
    guard.add_loss(torch.tensor(0.5))
    assert guard.step_is_bad(None) and not guard.diverged
    guard.add_loss(torch.tensor(0.5))
    assert not guard.step_is_bad(1.0) and guard.consecutive == 0  # the window was reset
    guard.add_loss(torch.tensor(0.5))
    assert guard.step_is_bad(torch.tensor(float("inf"))) and guard.consecutive == 1
    guard.add_loss(torch.tensor(float("-inf")))
    assert guard.step_is_bad(1.0) and guard.diverged and guard.skipped == 3


def test_fp16_leaves_the_gradient_norm_to_the_grad_scaler():
    guard = DivergenceGuard(Accelerator(cpu=True), max_bad_steps=1, check_grad_norm=False)
    guard.add_loss(torch.tensor(0.5))
    assert not guard.step_is_bad(torch.tensor(float("inf")))  # an fp16 overflow: the scaler skips and rescales
    guard.add_loss(torch.tensor(float("nan")))
    assert guard.step_is_bad(torch.tensor(1.0))


def test_all_finite():
    accelerator = Accelerator(cpu=True)
    assert all_finite(accelerator, [torch.ones(3), torch.zeros(2, 2)])
    assert not all_finite(accelerator, [torch.ones(3), torch.tensor([1.0, float("nan")])])


@pytest.fixture(scope="module")
def poisoned(precomputed, tmp_path_factory):
    """The precomputed shards (12 samples in 2 shards) with one sample's latent set to inf."""
    out = tmp_path_factory.mktemp("poisoned") / "features"
    shutil.copytree(precomputed, out)
    tar_path = sorted(Path(out).glob("*.tar"))[0]
    with tarfile.open(tar_path) as tar:
        members = [(info, tar.extractfile(info).read()) for info in tar.getmembers()]
    first = next(info.name for info, _ in members if info.name.endswith(LATENT_MEMBER))
    with tarfile.open(tar_path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for info, data in members:
            if info.name == first:
                data = npy_bytes(np.full_like(load_npy(data), np.inf))  # same dtype and shape, same size
            tar.addfile(info, io.BytesIO(data))
    for index in Path(out).glob("imba-index-*"):
        index.unlink()
    return out


def run_args(out, features, *extra):
    return [f"data.shards={features}", f"train.output_dir={out}", f"data.resolution={RES}",
            f"model.max_text_tokens={TOKENS}", "model.text_encoder=tiny", "data.batch_size=2", "train.log_every=1",
            "train.sample_every=0", "sample.steps=2", "sample.prompts=[a red circle]", "train.trackers=none",
            "optim.warmup_steps=1", *extra]  # the features' encoders: precompute's defaults


def metric_rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def checkpoint_weights(checkpoint: Path) -> dict:
    return load_file(checkpoint / "model.safetensors")


@pytest.mark.slow
def test_a_non_finite_loss_skips_the_step_and_the_ema_update(poisoned, tmp_path, capsys):
    out = tmp_path / "run"
    # one rank, 6 batches per epoch: the poisoned sample is drawn once in 6 steps
    assert run_main(run_args(out, poisoned, "train.max_steps=6", "train.save_every=1",
                               "train.keep_checkpoints=0")) == 0
    skipped = [int(s) for s in re.findall(r"warning: step (\d+) skipped", capsys.readouterr().out)]
    assert len(skipped) == 1 and metric_rows(out)[-1]["nonfinite_steps"] == 1
    step = skipped[0]
    # the skipped step's row has its loss, as null (JSON has no NaN): a missing key or a 0.0 loss is a fault
    row = next(r for r in metric_rows(out) if r["step"] == step)
    assert "loss" in row and row["loss"] is None
    ckpt = out / "checkpoints"
    # neither the optimizer nor the EMA took that step, and it was not checkpointed
    final = ckpt / "step_0000006"
    assert load_ema_state(final)["optimization_step"] == 5
    adam = torch.load(final / "optimizer.bin", weights_only=False)["state"]
    assert {int(s["step"]) for s in adam.values()} == {5}
    assert step == 6 or not (ckpt / f"step_{step:07d}").exists()
    for checkpoint in ckpt.glob("step_*"):
        assert all(torch.isfinite(t).all() for t in checkpoint_weights(checkpoint).values())
    assert (out / "export" / "model_index.json").is_file()


@pytest.mark.slow
def test_a_diverged_run_stops_without_saving_or_exporting_diverged_weights(tmp_path, capsys):
    out = tmp_path / "run"
    code = run_main([f"train.output_dir={out}", "optim.lr=10000.0", "optim.grad_clip=0", "optim.warmup_steps=0",
                       "train.max_steps=30", "data.resolution=64", "data.batch_size=4", "data.synthetic_samples=64",
                       "train.save_every=1", "train.sample_every=0", "train.max_bad_steps=5", "train.trackers=none",
                       "train.log_every=1",
                       "sample.steps=2", "sample.prompts=[a red circle]"])
    printed = capsys.readouterr().out
    assert code == DIVERGED_EXIT_CODE
    line = next(line for line in printed.splitlines() if line.startswith("error: training diverged"))
    checkpoints = sorted((out / "checkpoints").glob("step_*"))
    # the steps from the first non-finite loss on were skipped and never checkpointed
    first_bad = next(r["step"] for r in metric_rows(out) if r["nonfinite_steps"])
    assert [c.name for c in checkpoints] == [f"step_{s:07d}" for s in range(max(1, first_bad - 3), first_bad)]
    assert str(checkpoints[-1]) in line  # names the last good checkpoint
    assert not (out / "checkpoints" / "step_0000030").exists() and not (out / "export").exists()
    for checkpoint in checkpoints:
        assert all(torch.isfinite(t).all() for t in checkpoint_weights(checkpoint).values())
    assert metric_rows(out)[-1]["nonfinite_steps"] >= 1


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ddp", "zero2"])
def test_a_bad_step_on_one_rank_is_skipped_on_both(poisoned, tmp_path, kind):
    out = tmp_path / "run"
    # 2 ranks × 2 samples: 3 steps per epoch, the poisoned sample lands on one rank once per epoch
    log = launch(kind, run_args(out, poisoned, "train.max_steps=6", "train.save_every=0"), tmp_path)
    assert len(re.findall(r"warning: step \d+ skipped", log)) == 2
    assert metric_rows(out)[-1]["nonfinite_steps"] == 2
    ranks = digests(log)
    assert set(ranks) == {0, 1} and ranks[0] == ranks[1]  # no rank stepped alone
    exported = load_file(out / "export" / "transformer" / "diffusion_pytorch_model.safetensors")  # the EMA
    assert all(torch.isfinite(t).all() for t in exported.values())
    assert load_ema_state(out / "checkpoints" / "step_0000006")["optimization_step"] == 4  # 2 of 6 skipped

