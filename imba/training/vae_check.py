"""Whether the run's VAE can represent its images, judged on the first batch before the first step.

The DiT learns the VAE's latents, and the grids and the export decode them: a VAE that cannot reconstruct the
images (the shipped `shapes` VAE, made for flat coloured shapes, on photographs) trains a model of its blur,
without a sign in the loss. One encode and decode of the first micro-batch, on the main process, measures the
reconstruction's PSNR; below `MIN_PSNR_DB` the run says so in one line with the fix. The shapes VAE reaches 14 dB on
its own scenes at 32 px and 20–25 dB at 64–256 px, and 5–6 dB on a photograph (tests/test_vae_check.py); an SD-VAE
reaches well over 20 dB on photographs.
"""

from __future__ import annotations

import torch

from models.settings import TINY_VAE, ModelConfig
from models.vae import reconstruction_error

MIN_PSNR_DB = 12.0
CHECKED_IMAGES = 8  # of the first micro-batch: enough for a mean, cheap for a 1B run's SD-VAE


def vae_warning(vae_name: str, vae, batch: dict, fine_tuning: bool = False) -> str | None:
    """The warning for a VAE (`vae`, named `vae_name` in model.vae) that reconstructs the images of `batch` (a
    loader's batch, pixels in [-1, 1]) below `MIN_PSNR_DB`, else None. Batches of precomputed latents have no pixels
    and the random `tiny` VAE reconstructs nothing by design: both are not judged. `fine_tuning` (model.pretrained):
    the base learnt this VAE's latents, so the fix is another base, not another VAE."""
    pixels = batch.get("pixels")
    if pixels is None or vae_name == TINY_VAE:
        return None
    device = next(vae.parameters()).device
    psnr = reconstruction_error(vae, pixels[:CHECKED_IMAGES].to(device))["psnr"]
    if psnr >= MIN_PSNR_DB:
        return None
    fix = ("fine-tune a base trained with an SD-VAE: this base learnt this VAE's latents, another VAE would not "
           "match them" if fine_tuning else
           "set model.vae to an SD-VAE, e.g. a local folder of stabilityai/sd-vae-ft-ema (or that hub id)")
    return (f"warning: model.vae={vae_name} reconstructs this run's first images at {psnr:.1f} dB PSNR (below "
            f"{MIN_PSNR_DB:g} dB: it cannot represent them, and the DiT would learn its blur); {fix}")


def check_vae(accelerator, model: ModelConfig, features, first_batches: list[dict]) -> None:
    """Print `vae_warning` for the first micro-batch, on the main process (`features`: the run's frozen encoders;
    precomputed features hold no VAE and are not judged)."""
    vae = getattr(features, "vae", None)
    if not accelerator.is_main_process or vae is None or not first_batches:
        return
    with torch.no_grad():
        line = vae_warning(model.vae, vae, first_batches[0], fine_tuning=bool(model.pretrained))
    if line is not None:
        accelerator.print(line)
