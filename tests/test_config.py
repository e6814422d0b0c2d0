"""Typed config: YAML + dotted overrides, and one-line errors for the mistakes users make."""

import subprocess
import sys
from pathlib import Path

import pytest

from imba.training.config import ConfigError, load_config, save_config

REPO = Path(__file__).resolve().parents[1]


def test_defaults_yaml_and_overrides_in_order(tmp_path):
    f = tmp_path / "exp.yaml"
    f.write_text("loss:\n  gamma: 0.5\n  kind: plain\ntrain:\n  max_steps: 7\n")
    cfg = load_config(["--config", str(f), "loss.gamma=1", "data.shards=/x/{0..3}.tar", "--resume", "latest"])
    assert cfg.loss.gamma == 1.0 and isinstance(cfg.loss.gamma, float)  # CLI beats YAML; int → float
    assert cfg.loss.kind == "plain" and cfg.train.max_steps == 7
    assert cfg.data.shards == "/x/{0..3}.tar"
    assert cfg.train.resume == "latest"
    assert cfg.loss.lam == 0.9  # untouched default


def test_list_and_null_values():
    cfg = load_config(["sample.prompts=[a cat, a dog]", "data.shards=null", "train.resume=latest"])
    assert cfg.sample.prompts == ["a cat", "a dog"]
    assert cfg.data.shards is None


def test_saved_config_round_trips(tmp_path):
    cfg = load_config(["loss.reference=cond", "model.preset=small"])
    save_config(cfg, tmp_path / "c.yaml")
    again = load_config(["--config", str(tmp_path / "c.yaml")])
    assert again == cfg


@pytest.mark.parametrize("args,message", [
    (["loss.gama=0.5"], "unknown config key 'loss.gama' (did you mean loss.gamma?)"),
    (["trian.max_steps=3"], "unknown config key 'trian'"),
    (["train.max_steps=abc"], "config key 'train.max_steps' expects int, got 'abc'"),
    (["train.max_steps=1.5"], "expects int"),
    (["loss.gamma=true"], "expects float"),
    (["loss.kind=focal"], "must be one of imba, imba_sample, plain"),
    (["objective.kind=edm"], "must be one of flow, ddpm"),
    (["loss=3"], "is a section"),
    (["max_steps"], "overrides look like section.key=value"),
    (["--config", "nope.yaml"], "config file 'nope.yaml' not found"),
])
def test_mistakes_give_one_clear_line(args, message):
    with pytest.raises(ConfigError) as err:
        load_config(args)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_train_py_prints_one_line_and_exits_nonzero_on_a_bad_key():
    proc = subprocess.run([sys.executable, "train.py", "loss.gama=0.5"], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last == "error: unknown config key 'loss.gama' (did you mean loss.gamma?)"


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_load(path):
    cfg = load_config(["--config", str(path)])
    assert cfg.train.output_dir.startswith("outputs/")


def test_tiny_yaml_spells_out_the_defaults():
    assert load_config(["--config", str(REPO / "configs" / "tiny.yaml")]) == load_config([])


@pytest.mark.parametrize("args,message", [
    (["sample.steps=1"], "'sample.steps' must be >= 2"),
    (["data.batch_size=0"], "'data.batch_size' must be >= 1"),
    (["loss.lam=1.5"], "'loss.lam' must lie in [0, 1]"),
])
def test_range_checks(args, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_config(args)


@pytest.mark.parametrize("override,message", [
    ("model.text_encoder=no/such-folder", "cannot load the text encoder from 'no/such-folder'"),
    ("model.vae=no/such-folder", "cannot load the VAE from 'no/such-folder'"),
    ("model.pretrained=no/such-folder", "cannot load a pretrained transformer from 'no/such-folder'"),
])
def test_unloadable_weights_give_one_line(override, message):
    """The run's loaders turn a failed load into a ConfigError, which train.py's entry point prints as one line (as
    the bad-key test above runs it)."""
    from imba.training.build import build_dit, load_encoders

    cfg = load_config([override])
    with pytest.raises(ConfigError) as err:
        build_dit(cfg, load_encoders(cfg, "cpu"))
    assert message in str(err.value) and "\n" not in str(err.value)
