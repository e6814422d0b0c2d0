"""Validation loss: the EMA on a fixed held-out set with fixed noise, logged per noise quarter and concept bucket,
identical after a resume, split over ranks without changing the result, and never touching the training's
random streams."""

import contextlib
import json
import re
import shutil
from types import SimpleNamespace

import pytest
import torch

from imba.training.config import ConfigError
from test_train_precomputed import RES, TOKENS, args as precomputed_args, precomputed, run_main  # noqa: F401

TINY = ["data.resolution=64", "data.batch_size=2", "data.synthetic_samples=24", "data.val_samples=10",
        "train.log_every=2", "train.save_every=3", "train.sample_every=0", "sample.steps=2",
        "sample.prompts=[a red circle]", "train.trackers=none", "train.max_steps=6"]


def rows(out):
    return {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


def digest(output: str) -> str:
    return re.search(r"rank 0/1: parameters ([0-9a-f]{16})", output).group(1)


@pytest.mark.slow
def test_validation_is_logged_exact_after_a_resume_and_leaves_training_untouched(tmp_path, capsys):
    full = tmp_path / "full"
    assert run_main([*TINY, "train.val_every=3", f"train.output_dir={full}"]) == 0
    with_val = digest(capsys.readouterr().out)
    logged = rows(full)
    assert sorted(logged) == [2, 3, 4, 6]  # log points, plus the validation step 3
    # the fixed set's noise levels are the same at every validation: the same quarters (those with samples) and
    # buckets each time, never a null
    keys = {k for k in logged[3] if k.startswith("val/")}
    assert {"val/loss", *(f"val/loss_{b}" for b in ("head", "torso", "tail"))} <= keys
    assert keys <= {"val/loss", *(f"val/loss_t{q}" for q in range(1, 5)), "val/loss_head", "val/loss_torso",
                    "val/loss_tail"} and any(k.startswith("val/loss_t") for k in keys)
    assert keys == {k for k in logged[6] if k.startswith("val/")} and "val/loss" not in logged[4]
    assert all(isinstance(logged[step][k], float) for step in (3, 6) for k in keys)
    assert logged[6]["val/loss"] < logged[3]["val/loss"]  # the EMA learns
    assert (full / "synthetic_val").is_dir()  # a held-out synthetic set, apart from the training shards

    # no validation: the same weights, bitwise (building and running it draws nothing from the training's RNG)
    assert run_main([*TINY, "train.val_every=0", f"train.output_dir={tmp_path / 'none'}"]) == 0
    assert digest(capsys.readouterr().out) == with_val
    assert not any(k.startswith("val/") for r in rows(tmp_path / "none").values() for k in r)

    # resumed after step 3: the same validation losses at step 6, bitwise
    split = tmp_path / "split"
    shutil.copytree(full / "checkpoints" / "step_0000003", split / "checkpoints" / "step_0000003")
    (split / "checkpoints" / "latest").write_text("step_0000003\n")
    assert run_main([*TINY, "train.val_every=3", f"train.output_dir={split}"]) == 0
    assert {k: rows(split)[6][k] for k in keys} == {k: logged[6][k] for k in keys}


def test_validation_on_precomputed_features_and_a_mismatched_set(precomputed, tmp_path):
    out = tmp_path / "run"
    common = precomputed_args(out, precomputed, "train.max_steps=2", "train.val_every=2",
                              f"data.val_shards={precomputed}", "data.val_samples=5")
    assert run_main(common) == 0
    assert rows(out)[2]["val/loss"] > 0  # no concept statistics for data.shards: no bucket keys
    assert "val/loss_head" not in rows(out)[2]
    images = tmp_path / "images"
    from data.synthetic import write_synthetic_shards

    write_synthetic_shards(images, num_samples=4, resolution=RES)
    with pytest.raises(ConfigError, match="data.val_shards must be precomputed features like data.shards"):
        run_main(precomputed_args(tmp_path / "bad", precomputed, "train.max_steps=1", "train.val_every=1",
                                  f"data.val_shards={images}"))


def test_the_shares_of_two_ranks_give_the_one_rank_result(precomputed):
    """Two ranks evaluate disjoint halves of the same fixed set (same noise per sample); their summed losses equal
    one rank's. The accelerator here carries only what the validator reads of it; test_distributed runs the real
    2-process reduction."""
    from data.precomputed import PrecomputedFeatures, find_manifest
    from imba.objectives import build_objective
    from imba.training.config import load_config
    from imba.training.ema import make_ema
    from imba.training.validation import Validator
    from models.dit import build_transformer

    cfg = load_config([f"data.val_shards={precomputed}", f"data.resolution={RES}",
                       f"model.max_text_tokens={TOKENS}", "model.text_encoder=tiny", "data.val_samples=7",
                       "data.batch_size=3"])
    manifest = find_manifest(str(precomputed), resolution=RES, max_text_tokens=TOKENS, vae=cfg.model.vae,
                             vae_subfolder="", text_encoder=cfg.model.text_encoder, text_encoder_subfolder="",
                             tokenizer_subfolder="")
    features = PrecomputedFeatures(manifest, "cpu")
    torch.manual_seed(0)
    dit = build_transformer("tiny", sample_size=RES // 8, caption_channels=features.caption_channels)
    ema = make_ema(dit.parameters())
    parts = []

    def accelerator(rank, world):
        return SimpleNamespace(process_index=rank, num_processes=world, device=torch.device("cpu"),
                               reduce=lambda t, reduction: parts.append(t) or t,
                               main_process_first=contextlib.nullcontext)

    objective = build_objective("flow")
    shards = [str(p) for p in sorted(precomputed.glob("*.tar"))]
    whole = Validator(cfg, accelerator(0, 1), shards, features, manifest, objective).run(dit, ema)
    # a noise quarter without samples has no key (never a null in metrics.jsonl); those with samples have theirs
    counts = parts[-1][1]
    assert set(whole) == {"val/loss", *(f"val/loss_t{q}" for q in range(1, 5) if counts[q] > 0)}
    assert all(v == v for v in whole.values())
    halves = [Validator(cfg, accelerator(r, 2), shards, features, manifest, objective) for r in (0, 1)]
    assert [v.size for v in halves] == [4, 3]
    parts.clear()
    for v in halves:
        v.run(dit, ema)
    summed = parts[0] + parts[1]
    assert summed[1, 0] == 7
    # the same samples in batches of other compositions ([3, 1] and [3] against [3, 3, 1]): float32 rounding of
    # the loss, rel=1e-5 ≈ 100 roundings (2^-24); a sample lost or counted twice moves the mean by ~1/7
    assert (summed[0, 0] / summed[1, 0]).item() == pytest.approx(whole["val/loss"], rel=1e-5)
