"""Typed training configuration: nested dataclasses, one YAML file per experiment, dotted CLI overrides.

    python train.py --config configs/tiny.yaml loss=imba loss.gamma=0.5 train.max_steps=100 --resume latest

Precedence: dataclass defaults < YAML file < CLI overrides. Values are read as YAML; a float key also takes the
spellings YAML 1.1 leaves as strings (`1e-4`, `1E-4`, `+1e-4`), and a str key keeps a number as it was written
(`1.10`, `010`). Unknown keys, values of the wrong type and values out of range raise `ConfigError` with one line
that names the key and the fix; `train.py` prints it and exits.

`Config` composes the sections; each section lives beside the component it sets (`models/settings.py`: model and
speed; `data/settings.py`: data; `imba/loss_settings.py`: loss; `imba/objective_settings.py`: objective; here: the
training loop's optim, sample and train) and carries its own choices, ranges and checks, as `models/settings.py`
describes. This module reads them generically: types from the fields, `CHOICES` as each value is read, then every
section's `RANGES` and each `check()`; `imba.training.config_help` writes `--help` from the same tables.

Kind settings: `loss`, `objective` and `data.balance` take one of several kinds, each a dataclass of the settings
that kind reads (`imba.loss_settings.LOSS_SETTINGS`, `imba.objective_settings.OBJECTIVE_SETTINGS`,
`data.settings.BALANCE_RULES`): `loss=imba loss.gamma=0.5` on the command line,
`loss: {kind: imba, gamma: 0.5}` in a file. The kind is read first and another kind starts from its own defaults;
a setting the kind does not read is refused. The command line's overrides are read as one mapping (the later of
two values of a key wins), so a kind and its settings come in any order. A dumped config writes `kind` first.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import yaml

from data.settings import DataConfig
from imba.loss_settings import LOSS_SETTINGS, LossConfig, PlainLoss
from imba.objective_settings import OBJECTIVE_SETTINGS, FlowObjective, ObjectiveConfig
from imba.training.migrate import migrate_config
from models.settings import AUTO, SHAPES_VAE, TINY, TINY_VAE, TINY_WORDS, ModelConfig, SpeedConfig


class ConfigError(ValueError):
    """A user-facing configuration mistake; its message is one line."""


@dataclass
class OptimConfig:
    lr: float = 2e-3
    weight_decay: float = 0.03
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    warmup_steps: int = 20
    grad_clip: float = 1.0  # max gradient norm; 0 disables clipping
    ema_decay: float = 0.999

    RANGES: ClassVar[dict] = {"lr": "> 0", "weight_decay": ">= 0", "adam_beta1": "in [0, 1)", "adam_beta2": "in [0, 1)",
                              "adam_eps": "> 0", "warmup_steps": ">= 0", "grad_clip": ">= 0 (0 = no clipping)",
                              "ema_decay": "in [0, 1]"}


# The grids' prompts on the synthetic set, a 3 × 3 grid: its head pairs; rarer shapes (a cyan ring is its rarest pair);
# a head colour on another head shape, and two-object compositions
SYNTHETIC_PROMPTS = [
    "a red circle", "a blue square", "a green triangle",
    "a yellow star", "a black cross", "a cyan ring",
    "a blue circle", "a red circle and a blue square", "a green triangle and a yellow star",
]


@dataclass
class SampleConfig:
    # [] = auto: SYNTHETIC_PROMPTS on the synthetic set; on your own data, nine of its captions (data.val_shards'
    # first, else the training shards'), chosen when the run starts and written to its config.yaml
    prompts: list[str] = field(default_factory=list)
    guidance_scale: float = 4.5
    steps: int = 20
    seed: int = 0

    RANGES: ClassVar[dict] = {
        "guidance_scale": ">= 0",
        # PixArtAlphaPipeline reads a 1-step call as a distilled (DMD) model and indexes a tuple our schedulers lack
        "steps": ">= 2",
        "seed": f"in [{-2**63}, {2**63 - 1}]",  # torch.Generator's (image i gets seed + i)
    }

    def resolve(self, synthetic_data: bool) -> None:
        """prompts=[] on the synthetic set: its prompts (on your own data the run takes them from the captions)."""
        if not self.prompts and synthetic_data:
            self.prompts = list(SYNTHETIC_PROMPTS)


@dataclass
class TrainConfig:
    output_dir: str = "outputs/tiny"
    max_steps: int = 2500  # optimizer steps
    grad_accum: int = 1
    mixed_precision: str = "no"  # no | bf16 | fp16
    seed: int = 0
    log_every: int = 10
    save_every: int = 500  # checkpoint interval in steps; 0 = only at the end
    keep_checkpoints: int = 3
    sample_every: int = 500  # sample-grid interval in steps; 0 = only at the end
    # validation loss of the EMA weights every N steps (0 = off): fixed samples, noise and timesteps, so curves
    # compare across runs and resumes
    val_every: int = 250
    resume: str = "latest"  # latest (newest checkpoint in output_dir, if any) | none (start fresh) | a step_* folder
    # a step with a non-finite loss or gradient norm is skipped on every rank; after this many in a row the run
    # stops (exit status 3) without saving the diverged weights
    max_bad_steps: int = 20
    trackers: str = "tensorboard"  # accelerate trackers, comma-separated, or "none"; JSONL is always written
    # IMBA monitor: IMBA distance and conditional loss per head/torso/tail bucket of the captions' concepts.
    # A concepts.json from `python -m data.prep.concepts stats`; auto = computed for the synthetic data, off for
    # data.shards (counting a large set at start-up would stall the job); none = off
    concept_stats: str = "auto"

    CHOICES: ClassVar[dict] = {"mixed_precision": ("no", "bf16", "fp16")}
    RANGES: ClassVar[dict] = {
        "max_steps": ">= 1",
        "grad_accum": ">= 1",
        "seed": f"in [0, {2**32 - 1}]",  # numpy's seed range (accelerate's set_seed seeds numpy too)
        "log_every": ">= 1",
        "save_every": ">= 0 (0 = only at the end)",
        "keep_checkpoints": ">= 0 (0 = keep all)",
        "sample_every": ">= 0 (0 = only at the end)",
        "val_every": ">= 0 (0 = no validation)",
        "max_bad_steps": ">= 1",
    }

    def check(self) -> None:
        from accelerate.utils import LoggerType  # accelerate's tracker names; imported only to check them

        known = [t.value for t in LoggerType]
        unknown = [name for name in tracker_names(self.trackers) if name not in known]
        if unknown:
            raise ValueError(f"config key 'train.trackers' takes none or comma-separated names of accelerate's "
                             f"trackers ({', '.join(known)}), got {unknown[0]!r}{did_you_mean(unknown[0], known)}")


def did_you_mean(value: Any, names, prefix: str = "") -> str:
    """"; did you mean X?" for the name of `names` closest to a misspelt `value`, else "" (no name is close)."""
    close = difflib.get_close_matches(str(value), [str(n) for n in names], n=1, cutoff=0.75)
    return f"; did you mean {prefix}{close[0]}?" if close else ""


def tracker_names(trackers: str) -> list[str]:
    """train.trackers ("none", or accelerate tracker names separated by commas) → the list of names."""
    return [] if trackers == "none" else [name.strip() for name in trackers.split(",")]


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    loss: LossConfig = field(default_factory=PlainLoss)
    objective: ObjectiveConfig = field(default_factory=FlowObjective)
    optim: OptimConfig = field(default_factory=OptimConfig)
    speed: SpeedConfig = field(default_factory=SpeedConfig)
    sample: SampleConfig = field(default_factory=SampleConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    KINDS: ClassVar[dict] = {"loss": LOSS_SETTINGS, "objective": OBJECTIVE_SETTINGS}  # sections of kinds

    def global_batch(self, processes: int) -> int:
        """Samples per optimizer step over all processes: per process × accumulation steps × processes."""
        return self.data.batch_size * self.train.grad_accum * processes


# Decimal float spellings, with or without an exponent; YAML 1.1 reads the ones without a dot or an exponent sign
# (1e-4, 1E-4, +1e-4) as strings.
_FLOAT = re.compile(r"[-+]?(?:[0-9]+[.]?[0-9]*|[.][0-9]+)(?:[eE][-+]?[0-9]+)?")


@dataclass(frozen=True)
class _Spelled:
    """A YAML number, bool or date and the text it was written as: a str key takes the text (`1.10`, `no`,
    `2024-01-01`), the other keys the value."""

    value: Any
    text: str

    def __repr__(self) -> str:
        return repr(self.value)

    def __str__(self) -> str:
        return self.text


class _Loader(yaml.SafeLoader):
    """yaml.SafeLoader whose numbers, bools and dates are `_Spelled`."""


def _spelled(construct):
    return lambda loader, node: _Spelled(construct(loader, node), node.value)


for _kind in ("int", "float", "bool", "timestamp"):
    _Loader.add_constructor(f"tag:yaml.org,2002:{_kind}", _spelled(getattr(yaml.SafeLoader, f"construct_yaml_{_kind}")))


def _coerce(key: str, value, hint):
    """Check `value` against the type hint `hint`; int → float and a decimal string → float are the conversions."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in typing.get_args(hint):
            return None
        (inner,) = [a for a in typing.get_args(hint) if a is not type(None)]
        return _coerce(key, value, inner)
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            fields = ", ".join(f.name for f in dataclasses.fields(hint))
            raise ConfigError(f"config key {key!r} expects a mapping with keys {fields}, got {value!r}")
        item = hint()
        _apply(item, value, prefix=f"{key}.")
        return item
    if origin is list:
        (inner,) = typing.get_args(hint)
        if not isinstance(value, list):
            raise ConfigError(f"config key {key!r} expects a list, got {value!r}")
        return [_coerce(f"{key}[{i}]", v, inner) for i, v in enumerate(value)]
    if isinstance(value, _Spelled):
        if hint is str:
            return value.text  # e.g. a numeric hub revision or folder name, exactly as typed
        value = value.value
    if hint is float:
        if isinstance(value, str) and _FLOAT.fullmatch(value):
            value = float(value)
        elif isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"config key {key!r} expects a finite float, got {value!r}")
    if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
        raise ConfigError(f"config key {key!r} expects {hint.__name__}, got {value!r}")
    return value


def _apply(cfg, updates: dict, prefix: str = "") -> None:
    hints = typing.get_type_hints(type(cfg))
    names = [f.name for f in dataclasses.fields(cfg)]
    kinds = getattr(cfg, "KINDS", {})
    for name, value in updates.items():
        key = f"{prefix}{name}"
        if name not in names:
            close = difflib.get_close_matches(name, names, n=1)
            hint = f"did you mean {prefix}{close[0]}?" if close else f"valid: {', '.join(names)}"
            if hasattr(cfg, "KIND"):  # a setting the chosen kind does not read is refused, not ignored
                reads = f"reads {', '.join(names)}" if names else "reads no settings"
                hint = f"{prefix[:-1]} kind {cfg.KIND} {reads}" + (f"; {hint}" if close else "")
            raise ConfigError(f"unknown config key {key!r} ({hint})")
        current = getattr(cfg, name)
        if name in getattr(cfg, "ITEM_KINDS", {}):  # a list of kinds: each item a kind's name or settings
            if not isinstance(value, list):
                raise ConfigError(f"config key {key!r} expects a list, got {value!r}")
            registry = cfg.ITEM_KINDS[name]
            first = next(iter(registry.values()))  # the kind of an item that names none
            for i, item in enumerate(value):
                if not isinstance(item, dict) and item not in registry:
                    raise ConfigError(f"config key '{key}[{i}]' expects a mapping of a kind's settings ({first.KIND}: "
                                      f"{', '.join(f.name for f in dataclasses.fields(first))}; or kind: one of "
                                      f"{', '.join(registry)}) or a kind's name, got {item!r}")
            setattr(cfg, name, [_kind_setting(f"{key}[{i}]", first(), item, registry) for i, item in enumerate(value)])
            continue
        if name in kinds:
            setattr(cfg, name, _kind_setting(key, current, value, kinds[name]))
            continue
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ConfigError(f"config key {key!r} is a section; set its fields, e.g. {key}.<field>=...")
            _apply(current, value, prefix=f"{key}.")
            continue
        value = _coerce(key, value, hints[name])
        choices = getattr(cfg, "CHOICES", {}).get(name)
        if choices is not None and value not in choices:
            raise ConfigError(f"config key {key!r} must be one of {', '.join(choices)}, got {value!r}"
                              f"{did_you_mean(value, choices)}")
        setattr(cfg, name, value)


def _kind_setting(key: str, current, value, registry: dict[str, type]):
    """A setting whose `kind` picks its dataclass from `registry`: `value` is a kind's name, or a mapping of its
    settings with or without `kind` (without: the current kind's). Another kind starts from its defaults."""
    updates = dict(value) if isinstance(value, dict) else {"kind": value}
    kind = updates.pop("kind", current.KIND)
    kind = kind.text if isinstance(kind, _Spelled) else kind
    if not isinstance(kind, str) or kind not in registry:
        raise ConfigError(f"config key {key!r} must be one of {', '.join(registry)} (its kind), got {kind!r}"
                          f"{did_you_mean(kind, registry)}")
    chosen = current if type(current) is registry[kind] else registry[kind]()
    _apply(chosen, updates, prefix=f"{key}.")
    return chosen


def _merge(into: dict, tree: dict) -> None:
    """Fold the override `tree` into `into`, later values winning; a kind's name and a mapping of its settings given
    for the same key join (data.balance=cap data.balance.cap=20000, in either order)."""
    for name, value in tree.items():
        old = into.get(name)
        if isinstance(value, dict) and isinstance(old, dict):
            _merge(old, value)
        elif isinstance(value, dict) and name in into:
            into[name] = {"kind": old, **value}
        elif isinstance(old, dict):
            old["kind"] = value
        else:
            into[name] = value


def _parse_override(item: str) -> dict:
    """'a.b.c=value' → {'a': {'b': {'c': parsed value}}}; the value is read as YAML (numbers, bools, lists)."""
    if "=" not in item:
        raise ConfigError(f"cannot read argument {item!r}: overrides look like section.key=value "
                          "(python train.py --help lists them)")
    dotted, raw = item.split("=", 1)
    try:
        value = yaml.load(raw, Loader=_Loader) if raw else ""
    except (yaml.YAMLError, ValueError, TypeError):  # not YAML (or a tag that cannot build it): the text itself
        value = raw
    for part in reversed(dotted.split(".")):
        value = {part: value}
    return value


def _read_yaml(config_file: str):
    """The YAML document in `config_file`; a file that cannot be read or parsed is a one-line ConfigError."""
    try:
        return yaml.load(Path(config_file).read_text(encoding="utf-8"), Loader=_Loader)
    except UnicodeDecodeError as err:
        raise ConfigError(f"config file {config_file!r} is not UTF-8 text ({err.reason} at byte {err.start})") from None
    except OSError as err:
        raise ConfigError(f"cannot read config file {config_file!r}: {err.strerror or err}") from None
    except (yaml.YAMLError, ValueError, TypeError) as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or (str(err).splitlines() or [type(err).__name__])[0]
        raise ConfigError(f"config file {config_file!r} is not valid YAML: {problem}{where}") from None


def load_config(argv: list[str]) -> Config:
    """Build the config from `--config FILE`, `--resume latest|PATH` and `section.key=value` arguments."""
    cfg = Config()
    overrides, config_file, resume = [], None, None
    args = iter(argv)
    for arg in args:
        if arg in ("--config", "--resume"):
            value = next(args, None)
            if value is None:
                raise ConfigError(f"{arg} needs a value")
            config_file, resume = (value, resume) if arg == "--config" else (config_file, value)
        elif arg.startswith(("--config=", "--resume=")):
            flag, value = arg[2:].split("=", 1)
            config_file, resume = (value, resume) if flag == "config" else (config_file, value)
        else:
            overrides.append(arg)
    if config_file is not None:
        path = Path(config_file)
        if not path.is_file():
            raise ConfigError(f"config file {config_file!r} not found")
        loaded = _read_yaml(config_file) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {config_file!r} must hold a mapping of sections")
        _apply(cfg, migrate_config(loaded, config_file))  # keys earlier versions named
    merged: dict = {}
    for item in overrides:
        _merge(merged, _parse_override(item))
    _apply(cfg, migrate_config(merged, "the command line"))
    if resume is not None:
        cfg.train.resume = resume
    _validate(cfg)
    cfg.model.resolve(synthetic_data=cfg.data.synthetic())
    cfg.sample.resolve(synthetic_data=cfg.data.synthetic())
    return cfg


@dataclass(frozen=True)
class _Range:
    """Allowed values of a numeric key: low ≤ (or <) value ≤ (or <) high; None = unbounded on that side."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    note: str = ""  # what a boundary value means, e.g. "0 = only at the end"

    def holds(self, value: float) -> bool:
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def __str__(self) -> str:
        if self.high is None:
            text = f"{'>' if self.low_open else '>='} {self.low}"
        else:
            text = f"in {'(' if self.low_open else '['}{self.low}, {self.high}{')' if self.high_open else ']'}"
        return f"{text} ({self.note})" if self.note else text

    @classmethod
    def parse(cls, spec: str) -> "_Range":
        """The range a section writes as its message shows it: ">= 1", "> 0", "in [0, 1)", "in (0, 1)", each
        optionally followed by " (what a bound means)"."""
        match = _RANGE_SPEC.fullmatch(spec)
        if match is None:
            raise ValueError(f"range {spec!r} is not written like '>= 0', '> 0' or 'in [0, 1)' (+ ' (note)')")
        if match["op"]:
            parsed = cls(_number(match["bound"]), low_open=match["op"] == ">", note=match["note"] or "")
        else:
            parsed = cls(_number(match["low"]), _number(match["high"]), low_open=match["left"] == "(",
                         high_open=match["right"] == ")", note=match["note"] or "")
        if str(parsed) != spec:
            raise ValueError(f"range {spec!r} reads back as {str(parsed)!r}")
        return parsed


_RANGE_SPEC = re.compile(r"(?:(?P<op>>=|>) (?P<bound>\S+)|in (?P<left>[\[(])(?P<low>[^,]+), (?P<high>[^\])]+)"
                         r"(?P<right>[\])]))(?: \((?P<note>.+)\))?")


def _number(text: str) -> int | float:
    """A bound as written: an int stays an int, so bounds beyond a float's precision (2**63 - 1) stay exact."""
    return int(text) if re.fullmatch(r"-?[0-9]+", text) else float(text)


SECTIONS: dict[str, type] = {f.name: typing.get_type_hints(Config)[f.name]  # section name → its dataclass
                              for f in dataclasses.fields(Config)}
# every setting with kinds, a section (loss) or a section's setting (data.balance): dotted key → {kind: dataclass}
KIND_SETTINGS: dict[str, dict[str, type]] = {**Config.KINDS, **{
    f"{section}.{name}": registry for section, kind in SECTIONS.items()
    for name, registry in getattr(kind, "KINDS", {}).items()}}
_FIXED = {section: kind for section, kind in SECTIONS.items() if section not in Config.KINDS}  # one dataclass
# every list of kinds (data.sources): dotted key → {kind: dataclass}
ITEM_KIND_SETTINGS: dict[str, dict[str, type]] = {f"{section}.{name}": registry for section, kind in SECTIONS.items()
                                                  for name, registry in getattr(kind, "ITEM_KINDS", {}).items()}

# Every section's choices and ranges under their dotted keys (a range written wrongly fails here, at import)
CHOICES = {f"{section}.{name}": allowed for section, kind in _FIXED.items()
           for name, allowed in getattr(kind, "CHOICES", {}).items()}
CHOICES |= {key: tuple(registry) for key, registry in KIND_SETTINGS.items()}  # the kinds of a kind setting
RANGES = {f"{section}.{name}": _Range.parse(spec) for section, kind in _FIXED.items()
          for name, spec in getattr(kind, "RANGES", {}).items()}
# the settings of each kind of a kind setting: dotted key → {kind: its range}, e.g. "data.balance.alpha" →
# {"temperature": >= 0, "imba": >= 0}
KIND_RANGES: dict[str, dict[str, _Range]] = {}
ITEM_KIND_RANGES: dict[str, dict[str, _Range]] = {}  # the same for the items of a list of kinds
for _ranges, _settings in ((KIND_RANGES, KIND_SETTINGS), (ITEM_KIND_RANGES, ITEM_KIND_SETTINGS)):
    for _key, _registry in _settings.items():
        for _choice, _rule in _registry.items():
            for _field, _spec in _rule.RANGES.items():
                _ranges.setdefault(f"{_key}.{_field}", {})[_choice] = _Range.parse(_spec)


def setting(cfg, key: str):
    """The value of the dotted `key` ("data.balance", "loss.gamma") in `cfg`."""
    for name in key.split("."):
        cfg = getattr(cfg, name)
    return cfg


def _kind_settings(cfg: Config) -> list[tuple[str, Any, dict[str, dict[str, _Range]]]]:
    """(dotted key, value, its kinds' ranges) of every kind setting and list item, e.g. ("data.balance",
    TemperatureBalance(alpha=0.5), KIND_RANGES), ("data.sources[1]", SyntheticSource(...), ITEM_KIND_RANGES)."""
    found = [(key, setting(cfg, key), KIND_RANGES) for key in KIND_SETTINGS]
    for key in ITEM_KIND_SETTINGS:
        found += [(f"{key}[{i}]", item, ITEM_KIND_RANGES) for i, item in enumerate(setting(cfg, key))]
    return found


def _validate(cfg: Config) -> None:
    """Each section's ranges, then each section's own checks (`check()`, across its fields), then the checks across
    sections."""
    for key, allowed in RANGES.items():
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if not allowed.holds(value):
            raise ConfigError(f"config key {key!r} must be {allowed}, got {value}")
    for key, rule, ranges in _kind_settings(cfg):
        for name in rule.RANGES:
            allowed, value = ranges[f"{key.split('[')[0]}.{name}"][rule.KIND], getattr(rule, name)
            if not allowed.holds(value):
                raise ConfigError(f"config key '{key}.{name}' must be {allowed}, got {value}")
        try:
            if ranges is KIND_RANGES:  # an item of a list is checked by its section, which knows its name
                rule.check()
        except ValueError as err:
            raise ConfigError(str(err)) from err
    for section in _FIXED:
        check = getattr(getattr(cfg, section), "check", None)
        if check is not None:
            try:
                check()
            except ValueError as err:
                raise ConfigError(str(err)) from err
    for key, value, names in (("model.text_encoder", cfg.model.text_encoder, (AUTO, TINY, TINY_WORDS)),
                              ("model.vae", cfg.model.vae, (SHAPES_VAE, TINY_VAE))):
        # a hub id or a folder is any other value: only one close to the code's own names and not a folder here is
        # refused, at once, rather than after minutes of start-up as a hub id that cannot be found
        if value not in names and (hint := did_you_mean(value, names)) and not Path(value).exists():
            raise ConfigError(f"{key}={value} is not a folder here, and not one of the code's own {', '.join(names)}"
                              f"{hint} (or a hub id such as org/name)")
    # across sections
    if cfg.loss.min_snr_gamma and not cfg.objective.predicts_epsilon:
        raise ConfigError(f"loss.min_snr_gamma weights ε-prediction (objective.kind=ddpm), not "
                          f"objective.kind={cfg.objective.KIND}: a flow objective weights its timesteps by how it "
                          "samples them (objective.logit_mean, logit_std, shift)")


def written(value) -> str:
    """A setting's value as an override writes it (YAML: true, null, [a, b])."""
    return yaml.safe_dump(value, default_flow_style=True, width=10**6).strip().removesuffix("\n...")


def as_data(value):
    """A setting's value as plain data (dicts, lists, scalars); a kind setting's mapping starts with its `kind`."""
    if dataclasses.is_dataclass(value):
        kind = {"kind": value.KIND} if hasattr(type(value), "KIND") else {}
        return kind | {f.name: as_data(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [as_data(v) for v in value]
    return value


def flat_settings(cfg: Config) -> dict:
    """Every setting under its dotted key ({"section.key": value}; a kind setting's as "section.key.kind", ...)."""
    flat = {}

    def add(prefix: str, values: dict) -> None:
        for key, value in values.items():
            if isinstance(value, dict):
                add(f"{prefix}{key}.", value)
            else:
                flat[f"{prefix}{key}"] = value

    add("", as_data(cfg))
    return flat


def flat_dict(cfg: Config) -> dict:
    """Tracker-friendly flat view of `flat_settings`: TensorBoard hparams take scalars only."""
    return {key: value if isinstance(value, (int, float, str, bool)) else str(value)
            for key, value in flat_settings(cfg).items()}


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(as_data(cfg), sort_keys=False)


def save_config(cfg: Config, path: Path) -> None:
    path.write_text(dump_config(cfg))
