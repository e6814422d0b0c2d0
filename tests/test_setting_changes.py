"""A resume checks its settings against the checkpoint's config: changes that break the weights, the loss state or
the data position are refused in one line naming each setting and both values; safe ones are allowed and named."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import typing
from fnmatch import fnmatchcase
from pathlib import Path

import pytest
import torch

from imba.training.build import apply_optim_settings, build_optimizer
from imba.training.checkpoints import CONFIG_FILE
from imba.training.config import Config, ConfigError, dump_config, load_config
from imba.training.ema import make_ema
from imba.training.setting_changes import (ALLOWED, NOTED, REFUSED, VERDICTS, check_resumed_settings, compare_settings,
                                           judge)
from tests.test_checkpoints import TinyRun

REPO = Path(__file__).resolve().parents[1]

R, A, N = REFUSED, ALLOWED, NOTED
# Every setting's verdict on resume, written out one by one: a setting added to the config without a line here fails
# test_every_setting_has_its_pinned_verdict, and a verdict changed in the module fails it too.
EXPECTED = {
    "model.preset": R, "model.pretrained": R, "model.pretrained_subfolder": R, "model.pipeline": R,
    "model.text_encoder": R, "model.text_encoder_subfolder": R, "model.tokenizer_subfolder": R,
    "model.max_text_tokens": R, "model.vae": R, "model.vae_subfolder": R, "model.encoder_dtype": N,
    "model.lora_rank": R, "model.lora_alpha": R, "model.lora_targets": R,
    "data.shards": R, "data.mode": R, "data.cache_dir": A, "data.cache_limit": A,
    "data.store_timeout": A, "data.store_attempts": A, "data.max_bad_shards": A,
    "data.shard_window": R,  # which shards are read together: the order the saved position counts in
    "data.resolution": R, "data.batch_size": N, "data.num_workers": N, "data.loader_threads": N,
    "data.shuffle_buffer": R, "data.caption_field": R, "data.min_size": R, "data.bucketing": R, "data.precompute": R,
    "data.synthetic_samples": R, "data.synthetic_dir": R, "data.val_shards": A, "data.val_samples": A,
    "data.sources": R, "data.epoch_samples": R, "data.record_draws": A,
    "data.balance.kind": R, "data.balance.alpha": R, "data.balance.cap": R, "data.balance.every": R,
    "data.balance.keep": R, "data.balance.by": R,
    "data.balance.fraction": R, "data.balance.groups": R, "data.balance.max_factor": R, "data.balance.rate": R,
    "loss.kind": R, "loss.min_snr_gamma": R, "loss.lam": R, "loss.gamma": R, "loss.distance": R,
    "loss.reference": R, "loss.normalize": R, "loss.estimator": R,
    "objective.kind": R, "objective.logit_mean": R, "objective.logit_std": R, "objective.shift": R,
    "objective.beta_schedule": R, "objective.beta_start": R, "objective.beta_end": R,
    # the optimizer's and the EMA's saved state carry these: this run's values replace them, from this step on
    "optim.lr": N, "optim.weight_decay": N, "optim.adam_beta1": N, "optim.adam_beta2": N, "optim.adam_eps": N,
    "optim.ema_decay": N, "optim.warmup_steps": N, "optim.grad_clip": N,
    "speed.attention": A, "speed.gradient_checkpointing": A, "speed.compile": A, "speed.tf32": A,
    "sample.prompts": A, "sample.guidance_scale": A, "sample.steps": A, "sample.seed": A,
    "train.output_dir": A, "train.max_steps": A, "train.grad_accum": N,
    "train.mixed_precision": N,  # between no and bf16; to or from fp16 refused (below)
    "train.seed": R, "train.log_every": A, "train.save_every": A, "train.keep_checkpoints": A,
    "train.sample_every": A, "train.val_every": A, "train.resume": A, "train.max_bad_steps": A, "train.trackers": A,
    "train.concept_stats": A,  # without a balance; with one it is the vocabulary the draws count by (below)
}


def config_keys() -> list[str]:
    """Every setting's dotted key, walked from the config's dataclasses: each section's fields, each kind's settings
    (loss, objective, data.balance) and its `kind`; a list of kinds (data.sources) is one setting."""
    sections = typing.get_type_hints(Config)
    keys = []
    for section in dataclasses.fields(Config):
        name = section.name
        if name in Config.KINDS:
            keys += [f"{name}.kind", *(f"{name}.{f.name}" for kind in Config.KINDS[name].values()
                                       for f in dataclasses.fields(kind))]
            continue
        cls = sections[name]
        for f in dataclasses.fields(cls):
            key = f"{name}.{f.name}"
            if f.name in getattr(cls, "KINDS", {}):
                keys += [f"{key}.kind", *(f"{key}.{g.name}" for kind in cls.KINDS[f.name].values()
                                          for g in dataclasses.fields(kind))]
            else:
                keys.append(key)
    return list(dict.fromkeys(keys))


def test_every_setting_has_its_pinned_verdict():
    keys = config_keys()
    assert "data.balance.every" in keys and "loss.gamma" in keys and "data.shard_window" in keys
    assert sorted(set(keys) - set(EXPECTED)) == [], "a new setting: judge it in VERDICTS and pin it in EXPECTED"
    assert sorted(set(EXPECTED) - set(keys)) == [], "EXPECTED names a setting the config no longer has"
    default = load_config([])
    judged = {key: judge(key, default, default) for key in keys}
    assert {k: v for k, (v, _) in judged.items() if v != EXPECTED[k]} == {}
    assert [k for k, (_, why) in judged.items() if why == "not known to be safe"] == []  # each by its own entry
    for pattern in VERDICTS:
        assert any(fnmatchcase(k, pattern) for k in keys), f"VERDICTS entry {pattern} names no setting"


@pytest.mark.parametrize("change", [
    "train.max_steps=9000", "train.save_every=7", "train.val_every=3", "train.output_dir=elsewhere",
    "data.batch_size=16", "train.grad_accum=2", "data.num_workers=4", "data.val_samples=8", "optim.grad_clip=0.5",
    "optim.warmup_steps=0", "speed.compile=true", "sample.steps=4", "data.cache_dir=/elsewhere",
    "data.cache_limit=5GB", "train.mixed_precision=bf16", "train.trackers=none", "data.record_draws=true",
    "model.encoder_dtype=bfloat16", "train.concept_stats=none",
])
def test_safe_changes_are_allowed_and_named(change):
    key, value = change.split("=", 1)
    refused, allowed = compare_settings(load_config([]), load_config([change]))
    assert refused == [] and len(allowed) == 1 and allowed[0].startswith(f"{key} ") and f" -> {value} (" in allowed[0]


@pytest.mark.parametrize("change", [
    "model.preset=tiny", "model.pipeline=sigma", "model.text_encoder=tiny", "model.max_text_tokens=32",
    "model.tokenizer_subfolder=tokenizer", "model.vae=tiny", "data.resolution=64", "loss.kind=imba",
    "loss.gamma=0.5", "objective.kind=ddpm", "train.seed=1", "data.shards=photos/", "data.balance=temperature",
    "data.balance.alpha=0.3", "data.balance.every=5", "data.min_size=64", "data.shuffle_buffer=10",
    "data.caption_field=text",
    "data.synthetic_samples=100", "data.bucketing=true", "data.precompute=false", "data.epoch_samples=10",
    "train.mixed_precision=fp16", "data.shard_window=4", "model.pretrained=some/export",
])
def test_changes_that_break_the_state_or_the_position_are_refused(change):
    key = change.split("=", 1)[0]
    prompts = "sample.prompts=[a red circle]"  # on your own data they would be left to the run (auto)
    kind = {"data.balance.": "data.balance=imba", "loss.": "loss=imba"}  # the kind whose setting it is
    base = [prompts, *(v for prefix, v in kind.items() if key.startswith(prefix) and key != "loss.kind")]
    refused, allowed = compare_settings(load_config(base), load_config([*base, change]))
    # a kind setting's change of kind is named as its .kind
    assert allowed == [] and {key, f"{key}.kind"} & {line.split()[0] for line in refused}


def test_fp16_is_refused_both_ways_and_bf16_is_not():
    fp16, bf16, no = (load_config([f"train.mixed_precision={v}"]) for v in ("fp16", "bf16", "no"))
    assert compare_settings(fp16, bf16)[0] == ["train.mixed_precision fp16 -> bf16 (the fp16 loss scaler's state)"]
    assert compare_settings(no, fp16)[0] == ["train.mixed_precision 'no' -> fp16 (the fp16 loss scaler's state)"]
    assert compare_settings(bf16, no) == ([], ["train.mixed_precision bf16 -> 'no' (the precision of the passes (to "
                                               "or from fp16: refused))"])


def checkpoint_with(tmp_path: Path, args: list[str]) -> Path:
    folder = tmp_path / "step_0000010"
    folder.mkdir()
    (folder / CONFIG_FILE).write_text(dump_config(load_config(args)))
    return folder


def test_the_refusal_is_one_line_with_every_refused_change_and_what_to_do(tmp_path):
    checkpoint = checkpoint_with(tmp_path, ["data.batch_size=8"])
    with pytest.raises(ConfigError) as err:
        check_resumed_settings(load_config(["data.batch_size=16", "model.preset=tiny", "loss.kind=imba"]), checkpoint)
    assert str(err.value) == (
        f"cannot resume {checkpoint} with changed settings: model.preset micro -> tiny (the DiT's shape); loss.kind "
        "plain -> imba (the objective and the loss's state). Set them back, or start a new train.output_dir "
        "(fine-tune: model.pretrained=an export of this run)")


def test_allowed_changes_are_one_line_and_no_change_says_nothing(tmp_path):
    checkpoint = checkpoint_with(tmp_path, ["data.batch_size=8", "train.max_steps=100"])
    line = check_resumed_settings(load_config(["data.batch_size=16", "train.max_steps=200"]), checkpoint)
    assert line == ("resuming with changed settings: data.batch_size 8 -> 16 (the stream continues at the samples "
                    "consumed; the global batch changes); train.max_steps 100 -> 200 (how long the run goes on)")
    assert check_resumed_settings(load_config(["data.batch_size=8", "train.max_steps=100"]), checkpoint) is None


def test_the_automatic_text_encoder_of_a_resumed_run_is_compared_resolved(tmp_path):
    # a checkpoint of the synthetic run (tiny-words, 16 tokens) resumed on your own shards: auto would pick tiny
    checkpoint = checkpoint_with(tmp_path, [])
    with pytest.raises(ConfigError, match=r"model.text_encoder tiny-words -> tiny \(what the DiT learned to read\); "
                                          r"model.max_text_tokens 16 -> 64"):
        check_resumed_settings(load_config(["data.shards=photos/"]), checkpoint)


def test_train_py_refuses_a_changed_preset_before_any_work_and_writes_nothing(tmp_path):
    out = tmp_path / "run"
    run = TinyRun(out / "checkpoints")
    run.accelerator.free_memory()
    saved = run.save()
    (saved / CONFIG_FILE).write_text(dump_config(load_config([f"train.output_dir={out}"])))
    from imba.training.checkpoints import write_manifest
    write_manifest(saved)  # the config above replaces TinyRun's: the manifest must list it as it is
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(REPO / "train.py"), f"train.output_dir={out}", "model.preset=tiny"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: cannot resume {saved} with changed settings: model.preset micro -> tiny (the DiT's shape). Set them "
        "back, or start a new train.output_dir (fine-tune: model.pretrained=an export of this run)")
    assert sorted(p.name for p in out.iterdir()) == ["checkpoints"]  # no synthetic set, features or config.yaml


def test_a_setting_without_a_verdict_is_refused():
    default = load_config([])
    assert judge("train.a_setting_added_later", default, default) == (REFUSED, "not known to be safe")


def test_the_vocabulary_is_refused_where_the_balance_counts_by_it_and_allowed_where_it_only_logs():
    balanced = ["sample.prompts=[a red circle]", "data.balance=temperature"]
    refused, allowed = compare_settings(load_config(balanced), load_config([*balanced, "train.concept_stats=c.json"]))
    assert allowed == [] and refused == ["train.concept_stats auto -> c.json (the data stream the position counts in "
                                         "(data.balance counts the captions' entries by its vocabulary))"]
    refused, allowed = compare_settings(load_config([]), load_config(["train.concept_stats=c.json"]))
    assert refused == [] and allowed == ["train.concept_stats auto -> c.json (what it logs (refused where data.balance "
                                         "counts by its vocabulary))"]


def test_a_resumed_run_trains_with_its_own_optimizer_settings_not_the_checkpoints():
    refused, allowed = compare_settings(load_config([]), load_config(["optim.lr=0.0001", "optim.ema_decay=0.99"]))
    assert refused == [] and allowed == [
        "optim.lr 0.002 -> 0.0001 (the learning rate from this step on, at the schedule's step)",
        "optim.ema_decay 0.999 -> 0.99 (the EMA's decay from this step on (its average so far is kept))"]
    # what the resume restores (the optimizer's, the schedule's and the EMA's states), then this run's settings
    saved, resumed = (load_config(["optim.warmup_steps=4", *extra]) for extra in ([], [
        "optim.lr=1e-4", "optim.weight_decay=0", "optim.adam_beta1=0.8", "optim.adam_beta2=0.99",
        "optim.adam_eps=1e-6", "optim.ema_decay=0.9"]))
    model = torch.nn.Linear(2, 2)
    optimizer, schedule = build_optimizer(saved, model.parameters(), num_processes=1)
    ema = make_ema(model.parameters(), decay=saved.optim.ema_decay)
    for _ in range(3):  # 3 of the 4 warm-up steps
        optimizer.step()
        schedule.step()
    states = optimizer.state_dict(), schedule.state_dict(), ema.state_dict()
    optimizer, schedule = build_optimizer(resumed, model.parameters(), num_processes=1)
    ema = make_ema(model.parameters(), decay=resumed.optim.ema_decay)
    optimizer.load_state_dict(states[0]), schedule.load_state_dict(states[1]), ema.load_state_dict(states[2])
    assert optimizer.param_groups[0]["lr"] == pytest.approx(2e-3 * 3 / 4)  # the checkpoint's, as restored
    apply_optim_settings(resumed, schedule, ema)
    (group,) = optimizer.param_groups
    assert group["lr"] == pytest.approx(1e-4 * 3 / 4) and schedule.get_last_lr() == [group["lr"]]
    assert (group["weight_decay"], group["betas"], group["eps"], ema.decay) == (0, (0.8, 0.99), 1e-6, 0.9)
    schedule.step()  # the warm-up ends at this run's rate
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-4)


def test_prompts_left_to_auto_take_the_checkpoints_and_given_prompts_are_kept(tmp_path):
    checkpoint = checkpoint_with(tmp_path, ["sample.prompts=[a red circle, a blue square]"])
    auto = load_config([])
    auto.sample.prompts = []  # left to auto
    assert check_resumed_settings(auto, checkpoint) is None
    assert auto.sample.prompts == ["a red circle", "a blue square"]
    given = load_config(["sample.prompts=[a cyan ring]"])
    assert check_resumed_settings(given, checkpoint) == (
        "resuming with changed settings: sample.prompts [a red circle, a blue square] -> [a cyan ring] "
        "(the grids only)")
    assert given.sample.prompts == ["a cyan ring"]
