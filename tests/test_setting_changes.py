"""A resume checks its settings against the checkpoint's config: changes that break the weights, the loss state or
the data position are refused in one line naming each setting and both values; safe ones are allowed and named."""

from __future__ import annotations

import os
import subprocess
import sys
from fnmatch import fnmatchcase
from pathlib import Path

import pytest

from imba.training.checkpoints import CONFIG_FILE
from data.settings import BALANCE_RULES
from imba.loss_settings import LOSS_SETTINGS
from imba.training.config import ConfigError, dump_config, flat_dict, load_config
from imba.training.setting_changes import BREAKING, SAFE, check_resumed_settings, compare_settings
from tests.test_checkpoints import TinyRun

REPO = Path(__file__).resolve().parents[1]


def test_every_setting_is_judged_and_every_pattern_names_a_setting():
    kinds = [f"data.balance={kind}" for kind in BALANCE_RULES] + [f"loss={kind}" for kind in LOSS_SETTINGS]
    given = {"data.balance=cap": ["data.balance.cap=1"]}  # a setting without a valid default
    keys = list(dict.fromkeys(k for kind in kinds for k in flat_dict(load_config([kind, *given.get(kind, [])]))))
    assert "data.balance.every" in keys and "data.balance.cap" in keys and "loss.gamma" in keys
    unjudged = [k for k in keys if not any(fnmatchcase(k, p) for p in (*SAFE, *BREAKING))]
    assert unjudged == []
    for pattern in (*SAFE, *BREAKING):
        assert any(fnmatchcase(k, pattern) for k in keys), pattern


@pytest.mark.parametrize("change", [
    "train.max_steps=9000", "train.save_every=7", "train.val_every=3", "train.output_dir=elsewhere",
    "data.batch_size=16", "train.grad_accum=2", "data.num_workers=4", "data.val_samples=8", "optim.lr=0.0001",
    "optim.warmup_steps=0", "speed.compile=true", "sample.steps=4", "model.pretrained=some/export",
    "train.mixed_precision=bf16", "train.trackers=none", "data.record_draws=true",
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
    "train.mixed_precision=fp16",
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
                    "consumed); train.max_steps 100 -> 200 (how long the run goes on)")
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


def test_a_setting_in_neither_table_counts_as_unsafe():
    from imba.training.setting_changes import _judge

    safe, _ = _judge("train.a_setting_added_later", 1, 2)
    assert safe is False


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
