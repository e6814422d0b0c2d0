"""PixArt-style diffusion transformers, built on diffusers' `PixArtTransformer2DModel`.

Using the diffusers class (adaLN-single, cross-attention to T5 tokens, patch embedding) means every checkpoint this
project writes opens in a stock `PixArtAlphaPipeline` (or `PixArtSigmaPipeline`), and PixArt-α/Σ weights fine-tune
directly.

Presets (`models.settings.PRESETS`) are named widths/depths; the sample size and caption width come from the VAE
and text encoder in use.
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import PixArtTransformer2DModel
from diffusers.models import attention_processor

from models.settings import ATTENTION_PROCESSORS, PRESETS


def build_transformer(preset: str, sample_size: int, caption_channels: int, in_channels: int = 4,
                      patch_size: int = 2) -> PixArtTransformer2DModel:
    """A randomly initialised DiT of the named preset for latents of sample_size × sample_size."""
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; choose one of {', '.join(PRESETS)}")
    if sample_size % patch_size:
        raise ValueError(f"latent size {sample_size} is not divisible by patch_size={patch_size}; "
                         "pick a resolution that is a multiple of vae_scale_factor * patch_size")
    p = PRESETS[preset]
    return PixArtTransformer2DModel(
        num_attention_heads=p.num_attention_heads,
        attention_head_dim=p.attention_head_dim,
        in_channels=in_channels,
        out_channels=in_channels,  # no learned variance: the IMBA loss regresses only the mean
        num_layers=p.num_layers,
        cross_attention_dim=p.hidden_size,
        caption_channels=caption_channels,
        sample_size=sample_size,
        patch_size=patch_size,
        # Resolution/aspect micro-conditioning is off: diffusers would otherwise switch it on for sample_size 128.
        use_additional_conditions=False,
    )


ATTENTION_BACKENDS = {name: getattr(attention_processor, cls) for name, cls in ATTENTION_PROCESSORS.items()}


def apply_speed_settings(transformer: PixArtTransformer2DModel, attention: str = "sdpa",
                         gradient_checkpointing: bool = False, compile: bool = False) -> PixArtTransformer2DModel:
    """Switches that change speed and memory, not results (each is tested for equal outputs at tiny size).

    compile uses `nn.Module.compile`, which compiles in place: the module keeps its type, so accelerate,
    checkpoints and the diffusers export see the plain PixArtTransformer2DModel.
    """
    if attention not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {attention!r}; choose one of {', '.join(ATTENTION_BACKENDS)}")
    transformer.set_attn_processor(ATTENTION_BACKENDS[attention]())
    if gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
    else:
        transformer.disable_gradient_checkpointing()
    if compile:
        transformer.compile()
    return transformer


def count_parameters(preset: str, sample_size: int = 32, caption_channels: int = 4096) -> int:
    """Parameter count of a preset, computed on the meta device (no memory is allocated)."""
    with torch.device("meta"):
        model = build_transformer(preset, sample_size, caption_channels)
    return sum(p.numel() for p in model.parameters())


def load_pretrained_transformer(spec: str, sample_size: int, caption_channels: int, in_channels: int = 4,
                                subfolder: str = "") -> PixArtTransformer2DModel:
    """A diffusers-format PixArt transformer (PixArt-α/Σ, or our own export) to fine-tune at `sample_size`.

    Adapted where standard: the sin-cos position embedding is not learned, so a new resolution only rebuilds it
    (sample_size becomes the new latent size); the pretrained model's interpolation scale and micro-conditioning
    are kept, so positions and size conditioning mean what they meant in pre-training. A size-conditioned model
    (PixArt-α 1024-MS) keeps its sample_size instead: diffusers' PixArtAlphaPipeline passes the image size only to
    sample_size 128, and the transformer computes its position embedding for any input size, as the stock
    pipeline does when it samples that model at another resolution. Refused with a clear message: a different
    latent channel count (another VAE) or text width (another text encoder).
    """
    path = Path(spec)
    if not subfolder and path.is_dir() and not (path / "config.json").is_file() \
            and (path / "transformer" / "config.json").is_file():
        subfolder = "transformer"  # a pipeline folder, e.g. a PixArt repository or our export
    try:
        config = PixArtTransformer2DModel.load_config(spec, subfolder=subfolder or None)
    except OSError as err:
        raise OSError(f"cannot load a pretrained transformer from {spec!r} (subfolder {subfolder!r}): set "
                      "model.pretrained to a local folder or a reachable hub id") from err
    if config["in_channels"] != in_channels:
        raise ValueError(f"pretrained transformer {spec!r} takes {config['in_channels']}-channel latents but the "
                         f"VAE gives {in_channels}: use the VAE it was trained with")
    if config.get("caption_channels") != caption_channels:
        raise ValueError(f"pretrained transformer {spec!r} expects {config.get('caption_channels')}-d text "
                         f"embeddings but the text encoder gives {caption_channels}: use the text encoder it was "
                         "trained with (PixArt: T5 v1.1 XXL)")
    pretrained_size = config["sample_size"]
    size_conditioned = (config["use_additional_conditions"] if config.get("use_additional_conditions") is not None
                        else pretrained_size == 128)  # diffusers' default
    return PixArtTransformer2DModel.from_pretrained(
        spec, subfolder=subfolder or None, sample_size=pretrained_size if size_conditioned else sample_size,
        interpolation_scale=config.get("interpolation_scale") or max(pretrained_size // 64, 1),
        use_additional_conditions=size_conditioned,
    )


def predict(transformer: PixArtTransformer2DModel, noisy: torch.Tensor, timesteps: torch.Tensor,
            text_embeds: torch.Tensor, text_mask: torch.Tensor, vae_scale_factor: int = 8) -> torch.Tensor:
    """One DiT forward pass → the prediction with the latent's channel count.

    PixArt checkpoints with learned variance output 2·C channels; the first C are the mean prediction. Models with
    resolution/aspect micro-conditioning (PixArt-α 1024) get the image size in pixels, as the pipeline gives it.
    """
    added = {"resolution": None, "aspect_ratio": None}
    # read settings from the bare model: `transformer` may be a DDP/DeepSpeed wrapper, whose forward we must call
    bare = getattr(transformer, "module", transformer)
    if bare.dtype != torch.float32:  # DeepSpeed bf16/fp16 holds the weights in half precision: match its inputs
        noisy, text_embeds = noisy.to(bare.dtype), text_embeds.to(bare.dtype)
    if bare.use_additional_conditions:
        b, _, h, w = noisy.shape
        h, w = h * vae_scale_factor, w * vae_scale_factor
        added = {"resolution": noisy.new_tensor([[h, w]]).expand(b, 2),
                 "aspect_ratio": noisy.new_tensor([[h / w]]).expand(b, 1)}
    out = transformer(
        noisy,
        encoder_hidden_states=text_embeds,
        encoder_attention_mask=text_mask,
        timestep=timesteps,
        added_cond_kwargs=added,
        return_dict=False,
    )[0]
    return out[:, : noisy.shape[1]]
