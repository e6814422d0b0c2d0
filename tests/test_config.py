"""Typed config: YAML + dotted overrides, and one-line errors for the mistakes users make."""

import subprocess
import sys
from pathlib import Path

import pytest

from imba.training.config import ConfigError, flat_dict, load_config, save_config

REPO = Path(__file__).resolve().parents[1]


def test_defaults_yaml_and_overrides_in_order(tmp_path):
    f = tmp_path / "exp.yaml"
    f.write_text("loss:\n  gamma: 0.5\n  kind: imba_sample\ntrain:\n  max_steps: 7\n")  # the kind is read first
    cfg = load_config(["--config", str(f), "loss.gamma=1", "data.shards=/x/{0..3}.tar", "--resume", "latest"])
    assert cfg.loss.gamma == 1.0 and isinstance(cfg.loss.gamma, float)  # CLI beats YAML; int → float
    assert cfg.loss.KIND == "imba_sample" and cfg.train.max_steps == 7
    assert cfg.data.shards == "/x/{0..3}.tar"
    assert cfg.train.resume == "latest"
    assert cfg.loss.lam == 0.9  # untouched default


def test_list_and_null_values():
    cfg = load_config(["sample.prompts=[a cat, a dog]", "data.shards=null", "train.resume=latest"])
    assert cfg.sample.prompts == ["a cat", "a dog"]
    assert cfg.data.shards is None


def test_saved_config_round_trips(tmp_path):
    cfg = load_config(["loss=imba", "loss.reference=cond", "model.preset=small"])
    save_config(cfg, tmp_path / "c.yaml")
    again = load_config(["--config", str(tmp_path / "c.yaml")])
    assert again == cfg


@pytest.mark.parametrize("args,message", [
    (["loss=imba", "loss.gama=0.5"], "unknown config key 'loss.gama' (loss kind imba reads min_snr_gamma, gamma, lam, "
                                     "distance, reference, normalize, estimator; did you mean loss.gamma?)"),
    (["loss.gamma=0.5"], "unknown config key 'loss.gamma' (loss kind plain reads min_snr_gamma, lam)"),
    (["optim.lrr=0.1"], "unknown config key 'optim.lrr' (did you mean optim.lr?)"),
    (["trian.max_steps=3"], "unknown config key 'trian' (did you mean train?)"),
    (["xyz.max_steps=3"], "unknown config key 'xyz' (valid: model, data, loss, objective, optim, speed, sample, train)"),
    (["train.max_steps=abc"], "config key 'train.max_steps' expects int, got 'abc'"),
    (["train.max_steps=1.5"], "expects int"),
    (["loss=imba", "loss.gamma=true"], "expects float"),
    (["loss.kind=focal"], "'loss' must be one of plain, imba, imba_sample (its kind), got 'focal'"),
    (["objective.kind=edm"], "must be one of flow, ddpm"),
    (["loss=3"], "'loss' must be one of plain, imba, imba_sample (its kind), got '3'"),
    (["optim=3"], "is a section"),
    # every named choice says the name closest to a misspelling
    (["loss=imab"], "'loss' must be one of plain, imba, imba_sample (its kind), got 'imab'; did you mean imba?"),
    (["model.preset=tinny"], "must be one of micro, tiny, small, base, 1b, got 'tinny'; did you mean tiny?"),
    (["train.trackers=tensorboard,wandbb"], "got 'wandbb'; did you mean wandb?"),
    (["model.text_encoder=tiny-word"], "model.text_encoder=tiny-word is not a folder here, and not one of the code's "
                                       "own auto, tiny, tiny-words; did you mean tiny-words? (or a hub id"),
    (["model.vae=shape"], "model.vae=shape is not a folder here, and not one of the code's own shapes, tiny; did you "
                          "mean shapes?"),
    (["max_steps"], "overrides look like section.key=value"),
    (["--config", "nope.yaml"], "config file 'nope.yaml' not found"),
])
def test_mistakes_give_one_clear_line(args, message):
    with pytest.raises(ConfigError) as err:
        load_config(args)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("value", ["google/t5-v1_1-xxl", "t5-small", "tiny", "tiny-words"])
def test_a_hub_id_or_a_name_of_the_codes_own_text_encoders_is_taken_as_given(value):
    assert load_config([f"model.text_encoder={value}"]).model.text_encoder == value


def test_train_py_prints_one_line_and_exits_nonzero_on_a_bad_key():
    proc = subprocess.run([sys.executable, "train.py", "loss=imba", "loss.gama=0.5"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: unknown config key 'loss.gama' (loss kind imba reads ")
    assert last.endswith("; did you mean loss.gamma?)")



@pytest.mark.parametrize("argv", [["--help"], ["loss=imba", "loss.gama=0.5"], ["--config", "nowhere.yaml"]])
def test_train_py_answers_help_and_config_mistakes_before_torch_is_imported(argv):
    # what a user waits for before the answer: torch and diffusers take seconds, minutes on a busy machine
    code = ("import runpy, sys\n"
            f"sys.argv = ['train.py', *{argv!r}]\n"
            "try:\n    runpy.run_path('train.py', run_name='__main__')\nexcept SystemExit as exit:\n"
            "    print('exit', exit.code, file=sys.stderr)\n"
            "print(sorted({'torch', 'diffusers', 'transformers', 'webdataset'} & set(sys.modules)))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip().splitlines()[-1] == "[]", proc.stderr[-2000:]
    if argv != ["--help"]:
        assert "exit error: " in proc.stderr  # the one-line error, from this early answer


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_train_py_help_prints_the_help_text(flag):
    from imba.training.config_help import help_text

    proc = subprocess.run([sys.executable, "train.py", "loss.gama=0.5", flag], cwd=REPO, capture_output=True,
                          text=True, timeout=120)  # --help wins over a mistake beside it
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout == help_text() + "\n"


def test_the_help_text_lists_every_setting_with_its_default_and_rule():
    import dataclasses

    from imba.training.config import Config
    from imba.training.config_help import help_text
    text = help_text()
    listed = [line for line in text.splitlines() if " default " in line]
    # a kind setting's settings are listed once for each kind that reads them, with the kind
    lines = {line.split()[0] + (line.split("(kind ")[1].split(")")[0] if "(kind " in line else ""): line
             for line in listed}
    assert len(lines) == len(listed)
    defaults = Config()
    keys = []
    for section in dataclasses.fields(Config):
        if section.name in Config.KINDS:  # a kind section: its kind, then each kind's settings
            keys += [section.name] + [f"{section.name}.{g.name}{kind}" for kind, rule in
                                      Config.KINDS[section.name].items() for g in dataclasses.fields(rule)]
            continue
        kinds = getattr(getattr(defaults, section.name), "KINDS", {})
        for f in dataclasses.fields(getattr(defaults, section.name)):
            keys.append(f"{section.name}.{f.name}")
            keys += [f"{section.name}.{f.name}.{g.name}{kind}" for kind, rule in kinds.get(f.name, {}).items()
                     for g in dataclasses.fields(rule)]
            # a list of kinds: the settings every kind has once, then each kind's own with its kind
            registry = getattr(getattr(defaults, section.name), "ITEM_KINDS", {}).get(f.name, {})
            shared = set.intersection(*({g.name for g in dataclasses.fields(r)} for r in registry.values())) \
                if registry else set()
            keys += sorted({f"{section.name}.{f.name}[].{g.name}" + ("" if g.name in shared else kind)
                            for kind, rule in registry.items() for g in dataclasses.fields(rule)})
    assert sorted(lines) == sorted(keys)
    assert lines["data.sources"].split(None, 1)[1] == ("list       default []; each item a kind, default shards, one of "
                                                       "shards, synthetic")
    assert lines["data.sources[].share"].endswith("float      default 0.0 (every kind)")
    assert lines["data.sources[].samplessynthetic"].endswith("default 2000 (kind synthetic), must be >= 1")
    assert text.startswith("usage: python train.py [--config FILE]")
    assert lines["model.text_encoder"].split()[1:] == ["str", "default", "auto"]
    assert lines["model.max_text_tokens"].endswith("default 0, must be >= 0 (0 = the text encoder's own)")
    assert lines["data.batch_size"].endswith("int        default 32, must be >= 1")
    assert lines["data.balance"].endswith("default none, one of none, temperature, spread, cap, imba")
    assert lines["data.balance.fractionimba"].endswith("default 0.125 (kind imba), must be in (0, 1]")
    assert lines["data.balance.alphatemperature"].split()[1:5] == ["float", "default", "0.5", "(kind"]
    assert lines["optim.grad_clip"].endswith("default 1.0, must be >= 0 (0 = no clipping)")
    assert lines["model.preset"].endswith("default micro, one of micro, tiny, small, base, 1b")
    assert lines["loss"].split()[1:] == ["kind", "default", "plain,", "one", "of", "plain,", "imba,", "imba_sample"]
    assert lines["loss.distanceimba"].split()[1:] == ["str", "default", "mse", "(kind", "imba),", "one", "of", "mse,",
                                                      "l1,", "l2"]
    assert lines["objective.shiftflow"].endswith("float      default 1.0 (kind flow), must be > 0")
    assert lines["train.mixed_precision"].split()[1:4] == ["str", "default", "'no',"]
    assert lines["data.shards"].split()[1:] == ["str", "|", "None", "default", "null"]

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
    ("model.text_encoder=no/such-folder", "cannot load the tokenizer of 'no/such-folder'"),
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


# ---------------------------------------------------------------------------------------------------------------
# how values are written
# ---------------------------------------------------------------------------------------------------------------

FLOAT_SPELLINGS = [("1e-4", 1e-4), ("1E-4", 1e-4), ("+1e-4", 1e-4), ("2e-5", 2e-5), (".5e-3", 5e-4), ("5.", 5.0),
                   ("1.0e4", 1e4), ("1.0e+4", 1e4), ("3", 3.0), ("-0.25", -0.25)]


@pytest.mark.parametrize("text,value", FLOAT_SPELLINGS)
def test_float_keys_take_scientific_notation_in_overrides_and_files(tmp_path, text, value):
    assert load_config([f"objective.logit_mean={text}"]).objective.logit_mean == value
    f = tmp_path / "exp.yaml"
    f.write_text(f"objective:\n  logit_mean: {text}\n")
    cfg = load_config(["--config", str(f)])
    assert cfg.objective.logit_mean == value and type(cfg.objective.logit_mean) is float


def test_yaml_file_with_a_small_learning_rate(tmp_path):
    f = tmp_path / "exp.yaml"
    f.write_text("optim:\n  lr: 2e-5\n  adam_eps: 1E-8\n")
    cfg = load_config(["--config", str(f), "optim.weight_decay=1e-2"])
    assert (cfg.optim.lr, cfg.optim.adam_eps, cfg.optim.weight_decay) == (2e-5, 1e-8, 1e-2)


@pytest.mark.parametrize("text", ["1e4", "1.10", "010", "0x1F", "1_000", "no", "on", "2024-01-01", ".inf"])
def test_str_keys_keep_what_was_written(tmp_path, text):
    """A str key takes the text itself, even where YAML reads a number, a bool or a date."""
    cfg = load_config([f"model.pretrained={text}", f"train.output_dir={text}", f"sample.prompts=[{text}, b]"])
    assert cfg.model.pretrained == cfg.train.output_dir == text and cfg.sample.prompts == [text, "b"]
    f = tmp_path / "exp.yaml"
    f.write_text(f"model:\n  vae_subfolder: {text}\n")
    assert load_config(["--config", str(f)]).model.vae_subfolder == text


def test_mixed_precision_no_is_a_choice_not_a_bool(tmp_path):
    assert load_config(["train.mixed_precision=no"]).train.mixed_precision == "no"
    f = tmp_path / "exp.yaml"
    f.write_text("train:\n  mixed_precision: no\n")
    assert load_config(["--config", str(f)]).train.mixed_precision == "no"


@pytest.mark.parametrize("args,message", [
    (["optim.lr=abc"], "config key 'optim.lr' expects float, got 'abc'"),
    (["optim.lr=1e-4x"], "config key 'optim.lr' expects float, got '1e-4x'"),
    (["optim.lr=e-4"], "expects float, got 'e-4'"),
    (["optim.lr=.inf"], "config key 'optim.lr' expects a finite float, got inf"),
    (["objective.logit_mean=.nan"], "expects a finite float, got nan"),
    (["train.max_steps=1e3"], "config key 'train.max_steps' expects int, got '1e3'"),
    (["speed.compile=maybe"], "config key 'speed.compile' expects bool, got 'maybe'"),
    (["sample.prompts=a cat"], "config key 'sample.prompts' expects a list, got 'a cat'"),
])
def test_non_numbers_are_still_refused(args, message):
    with pytest.raises(ConfigError) as err:
        load_config(args)
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("text,message", [
    ("optim:\n  lr: [1\n", "is not valid YAML"),
    ("optim:\n\tlr: 1\n", "is not valid YAML"),
    ("optim:\n  lr: 1\n lr2: 3\n", "at line 3"),
    (b"optim:\n  lr: 1 # caf\xe9\n", "is not UTF-8 text"),
])
def test_unreadable_yaml_file_is_one_line(tmp_path, text, message):
    f = tmp_path / "exp.yaml"
    f.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ConfigError) as err:
        load_config(["--config", str(f)])
    assert message in str(err.value) and str(f) in str(err.value) and "\n" not in str(err.value)


# ---------------------------------------------------------------------------------------------------------------
# value checks
# ---------------------------------------------------------------------------------------------------------------

BAD_VALUES = [
    ("optim.lr=-1", "'optim.lr' must be > 0, got -1.0"),
    ("optim.lr=0", "'optim.lr' must be > 0"),
    ("optim.weight_decay=-0.1", "'optim.weight_decay' must be >= 0"),
    ("optim.adam_beta1=1", "'optim.adam_beta1' must be in [0, 1), got 1.0"),
    ("optim.adam_beta2=-0.5", "'optim.adam_beta2' must be in [0, 1)"),
    ("optim.adam_eps=0", "'optim.adam_eps' must be > 0"),
    ("optim.warmup_steps=-1", "'optim.warmup_steps' must be >= 0"),
    ("optim.grad_clip=-1", "'optim.grad_clip' must be >= 0 (0 = no clipping)"),
    ("optim.ema_decay=1.5", "'optim.ema_decay' must be in [0, 1]"),
    ("model.preset=huge", "'model.preset' must be one of micro, tiny, small, base, 1b, got 'huge'"),
    ("objective.shift=0", "'objective.shift' must be > 0"),
    ("objective.logit_std=-1", "'objective.logit_std' must be > 0"),
    ("objective=ddpm objective.beta_start=0", "'objective.beta_start' must be in (0, 1)"),
    ("objective=ddpm objective.beta_end=1", "'objective.beta_end' must be in (0, 1)"),
    ("objective=ddpm objective.beta_start=0.5", "'objective.beta_start' (0.5) must not exceed objective.beta_end (0.02)"),
    ("objective=ddpm objective.beta_schedule=sigmoid", "'objective.beta_schedule' must be a schedule diffusers' DDPM "
     "and DPM-Solver schedulers both implement (linear, scaled_linear, squaredcos_cap_v2), got 'sigmoid'"),
    ("objective=ddpm objective.beta_start=0.021", "(0.021) must not exceed objective.beta_end (0.02)"),
    ("data.num_workers=-1", "'data.num_workers' must be >= 0"),
    ("data.shuffle_buffer=-1", "'data.shuffle_buffer' must be >= 0"),
    ("data.synthetic_samples=0", "'data.synthetic_samples' must be >= 1"),
    ("train.save_every=-1", "'train.save_every' must be >= 0 (0 = only at the end)"),
    ("train.sample_every=-1", "'train.sample_every' must be >= 0"),
    ("train.keep_checkpoints=-1", "'train.keep_checkpoints' must be >= 0 (0 = keep all)"),
    ("train.seed=-1", "'train.seed' must be in [0, 4294967295], got -1"),
    ("train.max_bad_steps=0", "'train.max_bad_steps' must be >= 1, got 0"),
    ("train.trackers=tensorbord", "'train.trackers' takes none or comma-separated names of accelerate's trackers"),
    ("sample.guidance_scale=-1", "'sample.guidance_scale' must be >= 0"),
    ("sample.seed=1e30", "expects int"),
]


@pytest.mark.parametrize("override,message", BAD_VALUES, ids=[o for o, _ in BAD_VALUES])
def test_out_of_range_values_give_one_line(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(override.split(" "))  # a kind's setting after its kind
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_kind_given_again_keeps_its_settings_and_another_kind_starts_from_its_defaults(tmp_path):
    f = tmp_path / "exp.yaml"
    f.write_text("loss:\n  kind: imba\n  gamma: 0.5\n")
    assert load_config(["--config", str(f), "loss=imba"]).loss.gamma == 0.5
    assert load_config(["--config", str(f), "loss=imba_sample"]).loss.gamma == 0.8


def test_the_trackers_view_is_flat_and_scalar():
    flat = flat_dict(load_config(["data.balance=temperature", "sample.prompts=[a cat]"]))
    assert flat["data.balance.kind"] == "temperature" and flat["data.balance.alpha"] == 0.5
    assert flat["loss.kind"] == "plain" and flat["data.batch_size"] == 32 and flat["speed.tf32"] is True
    assert flat["sample.prompts"] == "['a cat']" and flat["data.shards"] == "None"  # non-scalars as text


def test_a_constant_noise_schedule_is_allowed():
    assert load_config(["objective=ddpm", "objective.beta_start=0.01", "objective.beta_end=0.01"]).objective.beta_start \
        == 0.01


def test_presets_are_the_models_presets():
    from models.dit import PRESETS

    for name in PRESETS:
        assert load_config([f"model.preset={name}"]).model.preset == name


def test_max_bad_steps():
    assert load_config([]).train.max_bad_steps == 20
    assert load_config(["train.max_bad_steps=1"]).train.max_bad_steps == 1


def test_train_py_prints_one_line_for_a_value_out_of_range():
    proc = subprocess.run([sys.executable, "train.py", "optim.lr=-1"], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == "error: config key 'optim.lr' must be > 0, got -1.0"


def test_a_resolution_the_patch_size_does_not_divide_is_one_line():
    from imba.training.build import build_dit, load_encoders

    cfg = load_config(["data.resolution=24"])  # 3×3 latents for patch size 2
    with pytest.raises(ConfigError, match="data.resolution=24: latent size 3 is not divisible") as err:
        build_dit(cfg, load_encoders(cfg, "cpu"))
    assert "\n" not in str(err.value)
