"""The parts of a run built from its config: frozen encoders (or precomputed features), the DiT, the loss, the
optimizer and its schedule. Weights a user names that cannot load give a one-line `ConfigError`."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoTokenizer

from data.precomputed import PrecomputedFeatures, find_manifest
from data.synthetic import CAPTION_WORDS
from imba.training.config import Config, ConfigError
from imba.training_loss import TrainingLoss
from models.dit import build_transformer, load_pretrained_transformer
from models.encoders import DTYPES, FrozenEncoders
from models.lora import add_lora
from models.pipeline import pipeline_kind_of, unsamplable_reason
from models.settings import TINY, TINY_WORDS
from models.text_encoder import load_text_encoder, load_tokenizer
from models.vae import load_vae


def load_encoders(cfg: Config, device, dtype: torch.dtype | None = None) -> FrozenEncoders:
    """Frozen tokenizer + T5 and VAE in `dtype` (default model.encoder_dtype); "tiny-words" tokenizes the synthetic
    captions' words."""
    try:
        return FrozenEncoders.load(**cfg.model.encoders(), device=device,
                                   dtype=dtype or DTYPES[cfg.model.encoder_dtype], words=CAPTION_WORDS)
    except OSError as err:
        raise ConfigError(str(err)) from err


def load_text_encoder_alone(cfg: Config, device):
    """(tokenizer, frozen T5 on `device`) of the run, in model.encoder_dtype, without the VAE."""
    m = cfg.model
    try:
        tokenizer, t5 = load_text_encoder(m.text_encoder, m.text_encoder_subfolder, m.tokenizer_subfolder,
                                          dtype=DTYPES[m.encoder_dtype], words=CAPTION_WORDS)
    except OSError as err:
        raise ConfigError(str(err)) from err
    return tokenizer, t5.to(device)


def load_vae_alone(cfg: Config, device):
    """The run's frozen VAE on `device`, in model.encoder_dtype, without the text encoder."""
    try:
        return load_vae(cfg.model.vae, cfg.model.vae_subfolder, dtype=DTYPES[cfg.model.encoder_dtype]).to(device)
    except OSError as err:
        raise ConfigError(str(err)) from err


def precomputed_manifest(cfg: Config, shards, key: str = "data.shards") -> dict | None:
    """The manifest of `shards` if `python -m data.prep.precompute` wrote them for this run's encoders, resolution and
    text length; None for image shards; a one-line `ConfigError` (naming `key`) for features of other settings."""
    try:
        return find_manifest(shards, resolution=cfg.data.resolution, **cfg.model.encoders())
    except ValueError as err:  # precomputed with other encoders, resolution or text length
        raise ConfigError(str(err) if key == "data.shards" else f"{key}: {err}") from err


def load_features(cfg: Config, shards, device) -> tuple[FrozenEncoders | PrecomputedFeatures, dict | None]:
    """(what turns a batch of `shards` into latents and text states, the precomputed manifest or None). Shards
    written by `python -m data.prep.precompute` already hold both: then neither the VAE nor T5 is loaded to train."""
    manifest = precomputed_manifest(cfg, shards)
    return (PrecomputedFeatures(manifest, device) if manifest else load_encoders(cfg, device)), manifest


def pipeline_kind(cfg: Config) -> str:
    """The stock pipeline the run samples its grids with and exports for: model.pipeline, or for `auto` the one
    model.pretrained's model_index.json names (PixArt-α for a transformer-only model or a model from scratch)."""
    m = cfg.model
    if m.pipeline != "auto":
        return m.pipeline
    return (m.pretrained and pipeline_kind_of(m.pretrained, m.pretrained_subfolder)) or "alpha"


def build_dit(cfg: Config, features) -> torch.nn.Module:
    """The DiT (a random preset, or pretrained weights, with LoRA adapters where model.lora_rank is set) sized for
    the latents and text states `features` give.

    Refused before any training: a model that the run's stock pipeline (`pipeline_kind`) could not sample, since
    neither its grids nor its export would work."""
    latent_size, rest = divmod(cfg.data.resolution, features.vae_scale)
    if rest:
        raise ConfigError(f"data.resolution={cfg.data.resolution} must be a multiple of the VAE's "
                          f"downsampling factor {features.vae_scale}")
    sizes = (latent_size, features.caption_channels, features.latent_channels)
    if not cfg.model.pretrained:
        try:
            return build_transformer(cfg.model.preset, *sizes)
        except ValueError as err:  # e.g. a latent size the patch size does not divide
            raise ConfigError(f"data.resolution={cfg.data.resolution}: {err}") from err
    try:
        dit = load_pretrained_transformer(cfg.model.pretrained, *sizes, cfg.model.pretrained_subfolder)
    except (OSError, ValueError) as err:
        raise ConfigError(str(err)) from err
    reason = unsamplable_reason(dit.config, pipeline_kind(cfg))
    if reason:
        raise ConfigError(f"model.pretrained={cfg.model.pretrained}: {reason}")
    if cfg.model.lora_rank:  # the base frozen, adapters trained (models/lora.py)
        try:
            add_lora(dit, cfg.model.lora_rank, cfg.model.lora_alpha, cfg.model.lora_target_list())
        except ValueError as err:
            raise ConfigError(str(err)) from err
    return dit


def _encoder_with_tokenizer(tokenizer, pipeline: str) -> str:
    """The model.text_encoder settings that give `tokenizer` (a pipeline's own, from its folder or hub id): one of the
    code's tiny encoders when it is theirs, else the pipeline's own text_encoder/ and tokenizer/ folders."""
    vocab = tokenizer.get_vocab()
    for name in (TINY_WORDS, TINY):
        if load_tokenizer(name, words=CAPTION_WORDS).get_vocab() == vocab:
            return f"model.text_encoder={name}"
    return (f"model.text_encoder={pipeline} model.text_encoder_subfolder=text_encoder "
            "model.tokenizer_subfolder=tokenizer")


def fine_tune_source(cfg: Config) -> str:
    """What a fine-tune (model.pretrained) starts from, as one line for the log. Refused (`ConfigError`): a pipeline
    whose own tokenizer (its tokenizer/ folder) splits text otherwise than the run's, since the DiT would then read
    other text embeddings than it learned, whatever their width."""
    m = cfg.model
    path = Path(m.pretrained)
    if path.is_dir() and (path / "config.json").is_file() and (path.parent / "model_index.json").is_file():
        path = path.parent  # the transformer/ folder of a pipeline
    try:
        theirs = AutoTokenizer.from_pretrained(str(path), subfolder="tokenizer")
    except (OSError, ValueError):  # a transformer alone, or a hub id out of reach
        return (f"fine-tuning from {m.pretrained}: its transformer's weights (no tokenizer beside them to check "
                f"model.text_encoder={m.text_encoder} against)")
    try:
        ours = load_tokenizer(m.text_encoder, m.tokenizer_subfolder, words=CAPTION_WORDS)
    except OSError as err:
        raise ConfigError(str(err)) from err
    if theirs.get_vocab() != ours.get_vocab():
        trained_with = _encoder_with_tokenizer(theirs, str(path))
        hint = ""
        if trained_with == f"model.text_encoder={TINY_WORDS}":
            hint = (f" ({TINY_WORDS} reads only the synthetic shapes' words: to fine-tune on your own captions, start "
                    f"from a base trained with model.text_encoder={TINY}, docs/checkpoints.md#lora-fine-tuning)")
        raise ConfigError(f"model.pretrained={m.pretrained} was trained with {trained_with}, not "
                          f"model.text_encoder={m.text_encoder} ({len(theirs)} tokens, not {len(ours)}): the DiT would "
                          f"read text it never learned; set {trained_with}{hint}")
    return (f"fine-tuning from {m.pretrained}: its transformer's weights; its tokenizer is "
            f"model.text_encoder={m.text_encoder}'s")


def build_training_loss(cfg: Config, patch_size: int, same_passes_on_every_rank: bool,
                        num_processes: int = 1) -> TrainingLoss:
    """The run's training loss, as its kind's settings build it (`LossConfig.build`)."""
    return cfg.loss.build(patch_size=patch_size, same_passes_on_every_rank=same_passes_on_every_rank,
                          num_processes=num_processes)


def adamw_implementation(parameters, device=None) -> dict[str, bool]:
    """AdamW's kernels for parameters that train on `device` (default: where they are now): `fused` (one kernel
    for all parameters) on CUDA, `foreach` (a few multi-tensor ops) elsewhere: on the CPU its update is bitwise
    the per-parameter loop's (torch's CPU default), so CPU runs and their checkpoints are unchanged by it."""
    devices = {torch.device(device).type} if device is not None else {p.device.type for p in parameters}
    return {"fused": True} if devices == {"cuda"} else {"foreach": True}


def build_adamw(parameters, *, lr: float, weight_decay: float, betas: tuple[float, float] = (0.9, 0.999),
                eps: float = 1e-8, warmup_steps: int, warmup_head_start: int = 0, device=None):
    """AdamW over the parameters that train (LoRA: the adapters alone) and its schedule: a linear warm-up over
    `warmup_steps` schedule steps, then the constant rate `lr`. The one builder of the trainer and the benchmarks.

    `warmup_head_start`: the schedule steps the warm-up counts as taken before the first step. 0, the trainer's
    (diffusers' `constant_with_warmup`), trains step 1 at a rate of 0, so that its update moves no weight but starts
    AdamW's moments; 1, the composition benchmark's, trains step 1 at lr / warmup_steps and reaches lr a step sooner.
    `device`: where the parameters will train (`accelerator.device`, when they are built on the CPU and moved by
    `accelerator.prepare`); it picks AdamW's kernels (`adamw_implementation`)."""
    if warmup_head_start < 0:
        raise ValueError(f"warmup_head_start={warmup_head_start} must be >= 0")
    trained = [p for p in parameters if p.requires_grad]
    kernels = adamw_implementation(trained, device)
    optimizer = torch.optim.AdamW(trained, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps, **kernels)

    def keep_kernels(opt) -> None:  # a checkpoint's param groups carry the kernels of the machine that wrote it
        for group in opt.param_groups:
            group.update({"fused": None, "foreach": None} | kernels)

    optimizer.register_load_state_dict_post_hook(keep_kernels)

    # a function, not a callable object: LambdaLR's state_dict then holds no state of it, as with diffusers' schedule
    def factor(step: int) -> float:
        counted = step + warmup_head_start
        return float(counted) / float(max(1.0, warmup_steps)) if counted < warmup_steps else 1.0

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def build_optimizer(cfg: Config, parameters, num_processes: int, device=None):
    """`build_adamw` with the run's `optim` settings. accelerate steps a prepared schedule once per process per
    optimizer step, hence the warm-up of `optim.warmup_steps` × `num_processes` schedule steps."""
    o = cfg.optim
    return build_adamw(parameters, lr=o.lr, weight_decay=o.weight_decay, betas=(o.adam_beta1, o.adam_beta2),
                       eps=o.adam_eps, warmup_steps=o.warmup_steps * num_processes, device=device)


def apply_optim_settings(cfg: Config, lr_scheduler, ema) -> None:
    """After a resume: this run's `optim` settings in the restored optimizer, schedule and EMA, whose saved states
    carry the checkpoint's (a lower `optim.lr` for a run that diverged must not be overridden by the old one). The
    schedule keeps its step count: the learning rate is this run's `optim.lr` times the schedule's factor there."""
    o = cfg.optim
    schedule = getattr(lr_scheduler, "scheduler", lr_scheduler)  # accelerate's wrapper, or the schedule itself
    schedule.base_lrs = [o.lr] * len(schedule.base_lrs)
    for group, factor in zip(schedule.optimizer.param_groups, schedule.lr_lambdas, strict=True):
        group.update(initial_lr=o.lr, lr=o.lr * factor(schedule.last_epoch), weight_decay=o.weight_decay,
                     betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps)
    schedule._last_lr = [group["lr"] for group in schedule.optimizer.param_groups]  # what get_last_lr() reports
    ema.decay = o.ema_decay
