"""Frozen image autoencoder (SD-VAE) that maps pixels in [-1, 1] to scaled latents and back.

Real runs load the SD VAE (4 latent channels, 8× downsampling, scaling factor 0.18215) from a hub id or a local
folder, e.g. `stabilityai/sd-vae-ft-ema`. Two small ones with the same latent layout (4 channels, 8× downsampling)
need no download: `"shapes"`, trained on the synthetic shapes (`python -m imba.training.shapes_vae`) and shipped
with the code (`models/shapes_vae/`), the CPU default run's VAE, whose decoder shows what the DiT learned; and
`"tiny"`, random from a fixed seed, for tests that only need the plumbing.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from diffusers import AutoencoderKL

from models.settings import SHAPES_VAE as SHAPES, TINY_VAE as TINY

TINY_SEED = 4321
SHAPES_DIR = Path(__file__).resolve().parent / "shapes_vae"  # a diffusers folder: config.json + safetensors
SD_SCALING_FACTOR = 0.18215


def _tiny_vae() -> AutoencoderKL:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(TINY_SEED)
        return AutoencoderKL(
            in_channels=3, out_channels=3, latent_channels=4,
            down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
            block_out_channels=(8, 16, 16, 16), layers_per_block=1, norm_num_groups=8,
            scaling_factor=SD_SCALING_FACTOR,
        )


def load_vae(spec: str, subfolder: str = "", dtype: torch.dtype = torch.float32) -> AutoencoderKL:
    """A frozen AutoencoderKL in eval mode from "shapes", "tiny", a hub id or a local path."""
    if spec == TINY:
        vae = _tiny_vae() if dtype == torch.float32 else _tiny_vae().to(dtype)
    elif spec == SHAPES:
        vae = AutoencoderKL.from_pretrained(SHAPES_DIR, torch_dtype=dtype)
    else:
        try:
            vae = AutoencoderKL.from_pretrained(spec, subfolder=subfolder or None, torch_dtype=dtype)
        except OSError as err:
            raise OSError(f"cannot load the VAE from {spec!r} (subfolder {subfolder!r}): set model.vae to a local "
                          "folder or a reachable hub id, or 'tiny' for tests") from err
    return vae.eval().requires_grad_(False)


def vae_scale_factor(vae: AutoencoderKL) -> int:
    return 2 ** (len(vae.config.block_out_channels) - 1)


@torch.no_grad()
def encode_images(vae: AutoencoderKL, pixels: torch.Tensor, generator: torch.Generator | None = None):
    """Pixels (B, 3, H, W) in [-1, 1] → latents (B, 4, H/8, W/8) sampled from the posterior, times scaling."""
    posterior = vae.encode(pixels.to(vae.dtype)).latent_dist
    return posterior.sample(generator=generator).float() * vae.config.scaling_factor


@torch.no_grad()
def reconstruction_error(vae: AutoencoderKL, pixels: torch.Tensor) -> dict[str, float]:
    """Mean absolute error and PSNR of decode(encode(x)) (posterior mean) on pixels in [-1, 1], measured in [0, 1]."""
    recon = vae.decode(vae.encode(pixels.to(vae.dtype)).latent_dist.mean).sample.float().clamp(-1, 1)
    diff = (recon - pixels.float()) / 2
    mse = diff.pow(2).mean().item()
    return {"mae": diff.abs().mean().item(), "psnr": 10 * math.log10(1.0 / max(mse, 1e-12))}
