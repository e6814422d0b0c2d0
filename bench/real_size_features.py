"""Precomputed feature shards at the real model's sizes, without its weights: SD-VAE-shaped latent moments
(4 channels, 8x downsampling) and T5-XXL-shaped caption states (4,096 wide), random values, written through
the precompute writer (`data.precompute.feature_members`, the shard records, the null text and the manifest)
so that the training reader reads them exactly as it reads a real precompute output.

Caption lengths: n ~ round(Normal(mean_tokens, max_text_tokens / 4)) clipped to [8, max_text_tokens], so that
re-captioned (long) captions often reach the truncation length. State values: x_jd = z_jd · c_d with z ~ N(0, 1)
and per-channel scales c_d = 0.1 · LogNormal(0, 1), so a few channels are far larger than the rest, as in the
encoder states of large transformers; the int8 format's error depends on that spread (`state_errors`).

    python bench/real_size_features.py OUT_DIR --resolution 256 --text-dtype int8 --samples 1000
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data.precompute import PrecomputeSettings, feature_members  # noqa: E402
from data.precompute_output import ShardOutput, plan_outputs, write_manifest, write_null_text, write_record  # noqa: E402
from data.precomputed import load_manifest  # noqa: E402
from data.text_states import TEXT_DTYPES, bytes_per_token, encode_states, states_from_numpy  # noqa: E402

T5_XXL_WIDTH = 4096
SD_VAE = {"latent_channels": 4, "vae_downsample": 8, "vae_scaling_factor": 0.18215, "vae_shift_factor": None}
MIN_TOKENS = 8


def token_counts(samples: int, max_tokens: int, mean_tokens: float, rng: np.random.Generator) -> np.ndarray:
    counts = np.rint(rng.normal(mean_tokens, max_tokens / 4, size=samples))
    return np.clip(counts, MIN_TOKENS, max_tokens).astype(np.int64)


def channel_scales(width: int, seed: int = 0) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    return torch.from_numpy(0.1 * rng.lognormal(0.0, 1.0, size=width)).float()


def random_states(tokens: int, scales: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(tokens, scales.numel(), generator=generator) * scales


def write_feature_set(out_dir: str | os.PathLike, *, samples: int, samples_per_shard: int, resolution: int,
                      text_dtype: str, max_text_tokens: int = 120, mean_tokens: float | None = None,
                      width: int = T5_XXL_WIDTH, seed: int = 0) -> dict[str, Any]:
    """Write (once: a complete folder is reused) and return the manifest of a real-size precomputed set."""
    out_dir = os.path.abspath(os.fspath(out_dir))
    if resolution % SD_VAE["vae_downsample"]:
        raise ValueError(f"resolution {resolution} is not a multiple of {SD_VAE['vae_downsample']}")
    settings = PrecomputeSettings(resolution=resolution, vae="random SD-VAE-shaped moments",
                                  text_encoder=f"random T5-shaped states ({width} wide)",
                                  max_text_tokens=max_text_tokens, text_dtype=text_dtype)
    shards = -(-samples // samples_per_shard)
    sources = [f"real-size-features/{k:06d}.tar" for k in range(shards)]  # there are no input image shards
    try:
        manifest = load_manifest(out_dir)
        if manifest["settings"] == settings.as_dict() and manifest["samples"] == samples:
            return manifest
    except (FileNotFoundError, ValueError):
        pass
    os.makedirs(out_dir, exist_ok=True)
    latent_size = resolution // SD_VAE["vae_downsample"]
    info = {**SD_VAE, "latent_size": latent_size, "text_hidden_size": width}
    rng = np.random.default_rng(seed)
    generator = torch.Generator().manual_seed(seed)
    scales = channel_scales(width, seed)
    counts = token_counts(samples, max_text_tokens, 0.75 * max_text_tokens if mean_tokens is None else mean_tokens,
                          rng)
    write_null_text(out_dir, random_states(1, scales, generator), text_dtype)
    key = 0
    for (source, name) in plan_outputs(sources, out_dir):
        out = ShardOutput(out_dir, name)
        for _ in range(min(samples_per_shard, samples - key)):
            moments = torch.randn(2, 4, latent_size, latent_size, generator=generator)
            n = int(counts[key])
            meta = {"precompute": {"source": source, "resolution": resolution, "text_tokens": n}}
            out.writer.write(feature_members(f"{key:09d}", moments, random_states(n, scales, generator),
                                             f"caption {key}", meta, text_dtype))
            out.samples += 1
            key += 1
        nbytes = out.commit()
        write_record(out_dir, name, source, settings, info, out.samples, {}, {}, nbytes)
    write_manifest(out_dir, sources, settings)
    return load_manifest(out_dir)


def state_errors(text_dtype: str, tokens: int = 4096, width: int = T5_XXL_WIDTH, seed: int = 1) -> dict[str, float]:
    """Reconstruction error of storing `tokens` random real-shaped states as `text_dtype`: relative RMS error
    ||x' - x|| / ||x||, the largest error relative to its token's largest |x|, and the stored bytes per token."""
    states = random_states(tokens, channel_scales(width), torch.Generator().manual_seed(seed))
    values, scale = encode_states(states, text_dtype)
    back = states_from_numpy(values, scale, text_dtype)
    err = (back - states).abs()
    per_token_max = states.abs().amax(dim=1, keepdim=True)
    return {"relative_rms_error": float(torch.linalg.vector_norm(back - states) / torch.linalg.vector_norm(states)),
            "max_error_over_token_absmax": float((err / per_token_max).max()),
            "bytes_per_token": bytes_per_token(text_dtype, width)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir")
    p.add_argument("--resolution", type=int, default=256)
    p.add_argument("--text-dtype", default="float16", choices=TEXT_DTYPES)
    p.add_argument("--samples", type=int, default=1000)
    p.add_argument("--samples-per-shard", type=int, default=250)
    p.add_argument("--max-text-tokens", type=int, default=120)
    args = p.parse_args(argv)
    manifest = write_feature_set(args.out_dir, samples=args.samples, samples_per_shard=args.samples_per_shard,
                                 resolution=args.resolution, text_dtype=args.text_dtype,
                                 max_text_tokens=args.max_text_tokens)
    print(f"{manifest['samples']} samples -> {manifest['__path__']}")
    for dtype in TEXT_DTYPES:
        print(dtype, state_errors(dtype))
    return 0


if __name__ == "__main__":
    sys.exit(main())
