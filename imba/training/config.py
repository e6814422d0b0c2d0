"""Typed training configuration: nested dataclasses, one YAML file per experiment, dotted CLI overrides.

    python train.py --config configs/tiny.yaml loss.gamma=0.5 train.max_steps=100 --resume latest

Precedence: dataclass defaults < YAML file < CLI overrides. Values are read as YAML; a float key also takes the
spellings YAML 1.1 leaves as strings (`1e-4`, `1E-4`, `+1e-4`), and a str key keeps a number as it was written
(`1.10`, `010`). Unknown keys, values of the wrong type and values out of range raise `ConfigError` with one line
that names the key and the fix; `train.py` prints it and exits.
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
from typing import Any

import yaml
from accelerate.utils import LoggerType

from data.balance import BALANCE_METHODS
from data.sources import SourceConfig, check_source_configs
from imba.loss import DISTANCES, NORMALIZATIONS, REFERENCES, IMBALoss, LossSettingError
from imba.objectives import OBJECTIVES, DDPMEpsilon
from imba.training.migrate import migrate_config
from imba.training_loss import ESTIMATORS, LOSS_KINDS
from models.dit import ATTENTION_BACKENDS, PRESETS
from models.encoders import DTYPES
from models.pipeline import PIPELINES


class ConfigError(ValueError):
    """A user-facing configuration mistake; its message is one line."""


@dataclass
class ModelConfig:
    preset: str = "micro"  # a key of models.dit.PRESETS (micro, tiny, small, base, 1b); ignored when pretrained is set
    pretrained: str | None = None  # fine-tune: a diffusers PixArt transformer (hub id or folder, e.g. an export)
    pretrained_subfolder: str = ""  # "transformer" for pipeline repositories (auto-detected for local folders)
    # the stock pipeline of the grids and the export: alpha (PixArtAlphaPipeline) | sigma (PixArtSigmaPipeline) |
    # auto (the one model.pretrained's model_index.json names, else alpha); sigma for PixArt-Σ transformer-only
    # repositories (PixArt-Sigma-XL-2-256x256, -512-MS, -2K-MS)
    pipeline: str = "auto"
    # a hub id (google/t5-v1_1-xxl) or a local folder; "tiny-words" (a random tiny T5 with one token per word of the
    # synthetic shapes: the CPU default's) or "tiny" (a random tiny T5 over bytes, any text: for tests)
    text_encoder: str = "tiny-words"
    text_encoder_subfolder: str = ""  # e.g. "text_encoder" inside a PixArt repository
    tokenizer_subfolder: str = ""  # e.g. "tokenizer" inside a PixArt repository
    # the CPU default's captions are at most 8 word tokens; set it for a real T5: PixArt-α uses 120, PixArt-Σ 300
    max_text_tokens: int = 16
    # "shapes" (the small VAE trained on the synthetic shapes, shipped with the code), "tiny" (random, for tests),
    # a hub id (stabilityai/sd-vae-ft-ema) or a local folder
    vae: str = "shapes"
    vae_subfolder: str = ""
    encoder_dtype: str = "float32"  # dtype of the frozen T5 and VAE: float32 | bfloat16 | float16


@dataclass
class DataConfig:
    shards: str | None = None  # brace/glob pattern, folder or URL of img2dataset tar shards; None = synthetic
    # auto: indexed for local shards, streaming for remote URLs. indexed: exact resume, equal batches per rank.
    # streaming: webdataset with resampled shards (pipe:/http/s3, or sets too large to index)
    mode: str = "auto"
    resolution: int = 128  # images are resized and centre-cropped to this square size
    batch_size: int = 32  # per process, per micro-step
    num_workers: int = 0
    # precomputed features only, with num_workers=0: threads of the training process that make the batches ahead
    # of the step, in memory recycled from batch to batch (bench/README.md#at-the-real-models-sizes)
    loader_threads: int = 0
    shuffle_buffer: int = 1000
    caption_field: str = "caption"  # field of key.json used when a sample has no key.txt
    min_size: int = 0  # skip images whose shorter side is below this (pixels; "image too small"); 0 = off
    # aspect-ratio buckets around resolution² pixels (1:4 .. 4:1, sides multiples of 16; data/buckets.py): each batch
    # is one bucket's (h, w). Image shards in indexed mode only (not streaming, not precomputed features)
    bucketing: bool = False
    # true: encode the training and validation images once with the frozen VAE and T5 (`python -m data.precompute`'s
    # format, in <train.output_dir>/features/; reused on resume, redone when the shards or encoders change) and
    # train on the stored features, with no encoder pass per step: for sets read many times (the synthetic set,
    # small fine-tuning sets). auto: true for the synthetic set (unless bucketed or streamed), false for data.shards
    # (large sets: run data.precompute once and point data.shards at its output). false: encode every batch
    precompute: str = "auto"
    synthetic_samples: int = 2000  # size of the synthetic shard set written when shards is None
    synthetic_dir: str | None = None  # where it is written; None = <train.output_dir>/synthetic_shards
    # validation set (train.val_every): shards of the same kind as `shards` (images, or precomputed features); None
    # = a held-out synthetic set (other seed) for synthetic training, no validation for data.shards
    val_shards: str | None = None
    val_samples: int = 64  # the first N samples of the validation shards' seeded order, split over the ranks
    # several shard sets read as one, instead of data.shards: a list of {shards, name, share | repeat}
    # (data/sources.py, docs/data.md#mixing-sources); drawn by the weighted stream (exact resume on any process count)
    sources: list[SourceConfig] = field(default_factory=list)
    epoch_samples: int = 0  # draws per epoch with data.sources or data.balance; 0 = the samples of the sources
    # sampling weights from the captions' concepts (data/balance.py): none | temperature (weight = count of the
    # sample's rarest concept or combination ^ -balance_alpha) | cap (MetaCLIP: entries above balance_cap drawn less)
    balance: str = "none"
    balance_alpha: float = 0.5  # temperature: 0 = natural, 1 = every rarest entry drawn about equally often
    balance_cap: int = 0  # cap: the threshold count t (MetaCLIP: 20000 for 400M captions)

    def synthetic(self) -> bool:
        """Whether the run trains on the synthetic set (neither data.shards nor data.sources)."""
        return not self.shards and not self.sources

    def weighted(self) -> bool:
        """Whether the run reads the weighted stream (data.sources or data.balance) rather than the plain order."""
        return bool(self.sources) or self.balance != "none"


@dataclass
class LossConfig:
    # plain (MSE + caption dropout; the default: it wins the composition benchmark at equal compute,
    # bench/README.md) | imba (token level, the paper's form) | imba_sample (sample level)
    kind: str = "plain"
    gamma: float = 0.8
    lam: float = 0.9  # IMBA: weight of the conditional term; plain: caption dropout p = 1 - lam
    distance: str = "mse"  # mse | l1 | l2
    reference: str = "target"  # target (paper) | cond (unbiased optimum, docs/method.md)
    normalize: str = "none"  # none | batch_mean | timestep_mean (running mean of D per timestep bin)
    # literal: cond + uncond passes with grad on every sample (≈ 2× a plain step); efficient: unbiased estimator of
    # the same gradient, caption dropout 1 - lam + no-grad uncond pass on the kept samples (≈ 1.3×)
    estimator: str = "literal"


@dataclass
class ObjectiveConfig:
    kind: str = "flow"  # flow (rectified flow, velocity target) | ddpm (ε-prediction)
    logit_mean: float = 0.0  # flow: σ = sigmoid(N(logit_mean, logit_std²))
    logit_std: float = 1.0
    shift: float = 1.0  # flow: timestep shift towards noise (also used by the sampler)
    beta_schedule: str = "linear"  # ddpm: PixArt's schedule
    beta_start: float = 0.0001
    beta_end: float = 0.02

    def kwargs(self) -> dict:
        """Constructor arguments of the chosen objective (imba.objectives.build_objective(kind, **kwargs()))."""
        if self.kind == "flow":
            return dict(logit_mean=self.logit_mean, logit_std=self.logit_std, shift=self.shift)
        return dict(beta_schedule=self.beta_schedule, beta_start=self.beta_start, beta_end=self.beta_end)


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


@dataclass
class SpeedConfig:
    attention: str = "sdpa"  # sdpa (torch scaled_dot_product_attention) | eager
    gradient_checkpointing: bool = False  # recompute block activations in backward: less memory, ~30 % more compute
    compile: bool = False  # torch.compile the DiT (first steps are slow while it compiles)
    tf32: bool = True  # TF32 matmuls/convolutions on Ampere+ GPUs (no effect on CPU)


@dataclass
class SampleConfig:
    prompts: list[str] = field(default_factory=lambda: [
        # a 3 × 3 grid: the synthetic set's head pairs; rarer shapes (a cyan ring is its rarest pair); a head colour on
        # another head shape, and two-object compositions
        "a red circle", "a blue square", "a green triangle",
        "a yellow star", "a black cross", "a cyan ring",
        "a blue circle", "a red circle and a blue square", "a green triangle and a yellow star",
    ])
    guidance_scale: float = 4.5
    steps: int = 20
    seed: int = 0


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
    # A concepts.json from `python -m data.concepts stats`; auto = computed for the synthetic data, off for
    # data.shards (counting a large set at start-up would stall the job); none = off
    concept_stats: str = "auto"


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    speed: SpeedConfig = field(default_factory=SpeedConfig)
    sample: SampleConfig = field(default_factory=SampleConfig)
    train: TrainConfig = field(default_factory=TrainConfig)


CHOICES = {
    "model.preset": tuple(PRESETS),
    "model.encoder_dtype": tuple(DTYPES),
    "model.pipeline": ("auto", *PIPELINES),
    "data.mode": ("auto", "indexed", "streaming"),
    "data.precompute": ("auto", "true", "false"),
    "data.balance": BALANCE_METHODS,
    "loss.kind": LOSS_KINDS,
    "loss.distance": DISTANCES,
    "loss.reference": REFERENCES,
    "loss.normalize": NORMALIZATIONS,
    "loss.estimator": ESTIMATORS,
    "objective.kind": tuple(OBJECTIVES),
    "speed.attention": tuple(ATTENTION_BACKENDS),
    "train.mixed_precision": ("no", "bf16", "fp16"),
}


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
    for name, value in updates.items():
        key = f"{prefix}{name}"
        if name not in names:
            close = difflib.get_close_matches(name, names, n=1)
            hint = f" (did you mean {prefix}{close[0]}?)" if close else f" (valid: {', '.join(names)})"
            raise ConfigError(f"unknown config key {key!r}{hint}")
        current = getattr(cfg, name)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ConfigError(f"config key {key!r} is a section; set its fields, e.g. {key}.<field>=...")
            _apply(current, value, prefix=f"{key}.")
            continue
        value = _coerce(key, value, hints[name])
        if key in CHOICES and value not in CHOICES[key]:
            raise ConfigError(f"config key {key!r} must be one of {', '.join(CHOICES[key])}, got {value!r}")
        setattr(cfg, name, value)


def _parse_override(item: str) -> dict:
    """'a.b.c=value' → {'a': {'b': {'c': parsed value}}}; the value is read as YAML (numbers, bools, lists)."""
    if "=" not in item:
        raise ConfigError(f"cannot read argument {item!r}: overrides look like section.key=value")
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
    for item in overrides:
        _apply(cfg, _parse_override(item))
    if resume is not None:
        cfg.train.resume = resume
    _validate(cfg)
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


_AT_LEAST_1, _AT_LEAST_0, _POSITIVE = _Range(1), _Range(0), _Range(0, low_open=True)

RANGES = {
    "model.max_text_tokens": _AT_LEAST_1,
    "data.resolution": _AT_LEAST_1,
    "data.batch_size": _AT_LEAST_1,
    "data.num_workers": _Range(0, note="0 = read in the training process"),
    "data.loader_threads": _Range(0, note="0 = no reader threads"),
    "data.shuffle_buffer": _Range(0, note="0 = no shuffle buffer"),
    "data.min_size": _Range(0, note="0 = no minimum"),
    "data.synthetic_samples": _AT_LEAST_1,
    "data.val_samples": _AT_LEAST_1,
    "data.epoch_samples": _Range(0, note="0 = the samples of the sources"),
    "data.balance_alpha": _AT_LEAST_0,
    "data.balance_cap": _Range(0, note="0 = not set"),
    "train.val_every": _Range(0, note="0 = no validation"),
    "objective.logit_std": _POSITIVE,
    "objective.shift": _POSITIVE,
    "objective.beta_start": _Range(0, 1, low_open=True, high_open=True),
    "objective.beta_end": _Range(0, 1, low_open=True, high_open=True),
    "optim.lr": _POSITIVE,
    "optim.weight_decay": _AT_LEAST_0,
    "optim.adam_beta1": _Range(0, 1, high_open=True),
    "optim.adam_beta2": _Range(0, 1, high_open=True),
    "optim.adam_eps": _POSITIVE,
    "optim.warmup_steps": _AT_LEAST_0,
    "optim.grad_clip": _Range(0, note="0 = no clipping"),
    "optim.ema_decay": _Range(0, 1),
    "sample.guidance_scale": _AT_LEAST_0,
    # PixArtAlphaPipeline reads a 1-step call as a distilled (DMD) model and indexes a tuple our schedulers lack
    "sample.steps": _Range(2),
    "sample.seed": _Range(-(2**63), 2**63 - 1),  # torch.Generator's (image i gets seed + i)
    "train.max_steps": _AT_LEAST_1,
    "train.grad_accum": _AT_LEAST_1,
    "train.seed": _Range(0, 2**32 - 1),  # numpy's seed range (accelerate's set_seed seeds numpy too)
    "train.log_every": _AT_LEAST_1,
    "train.save_every": _Range(0, note="0 = only at the end"),
    "train.keep_checkpoints": _Range(0, note="0 = keep all"),
    "train.sample_every": _Range(0, note="0 = only at the end"),
    "train.max_bad_steps": _AT_LEAST_1,
}


def tracker_names(trackers: str) -> list[str]:
    """train.trackers ("none", or accelerate tracker names separated by commas) → the list of names."""
    return [] if trackers == "none" else [name.strip() for name in trackers.split(",")]


def _validate(cfg: Config) -> None:
    """Range and cross-field checks that the types alone do not catch."""
    for key, allowed in RANGES.items():
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if not allowed.holds(value):
            raise ConfigError(f"config key {key!r} must be {allowed}, got {value}")
    if not cfg.sample.prompts:
        raise ConfigError("config key 'sample.prompts' needs at least one prompt, e.g. sample.prompts=[a red circle]")
    o = cfg.objective
    if o.beta_start > o.beta_end:
        raise ConfigError(f"config key 'objective.beta_start' ({o.beta_start}) must not exceed objective.beta_end "
                          f"({o.beta_end}): the noise schedule rises from beta_start to beta_end")
    try:  # the name is diffusers': both the training and the sampling scheduler must know it
        DDPMEpsilon(beta_schedule=o.beta_schedule).sampling_scheduler()
    except NotImplementedError:
        raise ConfigError(f"config key 'objective.beta_schedule' must be a schedule diffusers' DDPM and DPM-Solver "
                          f"schedulers both implement (linear, scaled_linear, squaredcos_cap_v2), got "
                          f"{o.beta_schedule!r}") from None
    known = [t.value for t in LoggerType]
    unknown = [name for name in tracker_names(cfg.train.trackers) if name not in known]
    if unknown:
        raise ConfigError(f"config key 'train.trackers' takes none or comma-separated names of accelerate's trackers "
                          f"({', '.join(known)}), got {unknown[0]!r}")
    if cfg.data.precompute == "true" and cfg.data.bucketing:
        raise ConfigError("data.precompute=true stores one resolution: it cannot serve data.bucketing=true; set one "
                          "of them to false")
    if cfg.data.bucketing and cfg.data.mode == "streaming":
        raise ConfigError("data.bucketing=true needs data.mode=indexed (or auto with local shards): the streaming "
                          "reader has no image sizes to bucket by; set data.bucketing=false or use local shards")
    d = cfg.data
    if d.shards and d.sources:
        raise ConfigError("give data.shards or data.sources, not both (a single shard set is one source)")
    try:
        check_source_configs(d.sources)
    except ValueError as err:
        raise ConfigError(str(err)) from err
    if d.balance == "cap" and d.balance_cap < 1:
        raise ConfigError("data.balance=cap needs data.balance_cap=T >= 1: entries in more than T samples are drawn "
                          "less (MetaCLIP used 20000 for 400M captions)")
    if d.weighted() and d.mode == "streaming":
        raise ConfigError("data.sources and data.balance need indexed reading (local shards): the streaming reader "
                          "cannot draw by weight and resume exactly; set data.mode=auto or indexed")
    try:  # the loss checks its own settings; here they are reported under their config keys
        IMBALoss(gamma=cfg.loss.gamma, lam=cfg.loss.lam, distance=cfg.loss.distance, reference=cfg.loss.reference,
                 normalize=cfg.loss.normalize)
    except LossSettingError as err:
        raise ConfigError(f"config key 'loss.{err.setting}' {err.problem}") from err


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def flat_dict(cfg: Config) -> dict:
    """Tracker-friendly flat view ({"section.key": scalar}); TensorBoard hparams take scalars only."""
    flat = {}
    for section, values in to_dict(cfg).items():
        for key, value in values.items():
            flat[f"{section}.{key}"] = value if isinstance(value, (int, float, str, bool)) else str(value)
    return flat


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def save_config(cfg: Config, path: Path) -> None:
    path.write_text(dump_config(cfg))
