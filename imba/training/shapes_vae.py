"""A small AutoencoderKL trained on the synthetic shapes: the VAE of the CPU default run, so that its grids show pictures.

A random VAE's decoder does not invert its encoder, so nothing a DiT learns on its latents can be seen in a sample.
This one is trained here, on renders of `data.synthetic` (a seed of its own, so the default run's shards are
held out), and shipped as a diffusers folder, `models/shapes_vae/` (loaded with `model.vae=shapes`). The trainer
sits above `data/` and `models/` because it needs both; `models/` itself imports nothing else of the project.
It keeps SD-VAE's latent layout (4 channels, 8× downsampling), so everything sized for the SD VAE fits it, and its
`scaling_factor` is measured the way SD's 0.18215 was: 1 / std of the latents of its training images.

    python -m imba.training.shapes_vae          # retrain, overwrite models/shapes_vae/ (deterministic; 12 min, 2 cores)
    python -m imba.training.shapes_vae --check  # reconstruction error of the shipped weights on held-out renders
"""

from __future__ import annotations

import argparse
import math
import random
import time
from pathlib import Path

import torch
from diffusers import AutoencoderKL

from data.images import image_to_tensor
from data.synthetic import COLOURS, SHAPES, make_sample, render_objects
from models.vae import SHAPES_DIR as WEIGHTS_DIR, reconstruction_error

TRAIN_SEED = 20261201  # seeds the training renders (uniform concepts), drawn apart from the data set's samples
CHECK_SEED = 0  # held-out renders: the default run's own data
RESOLUTION = 128  # the default run's (trained on smaller images, a VAE draws a frame inside larger ones)
OBJECT_WEIGHT = 4.0  # objects cover ~15 % of a scene: without extra weight their colours are the first thing lost
ARCHITECTURE = dict(
    in_channels=3, out_channels=3, latent_channels=4,
    down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
    block_out_channels=(8, 16, 32, 32), layers_per_block=1, norm_num_groups=8,
)
KL_WEIGHT = 1e-6  # as small as SD's: the latent should keep the picture, not match a unit Gaussian
INITIAL_LOG_VARIANCE = -6.0  # posterior std e^-3 ≈ 0.05 from the start


def build_untrained(seed: int = 0) -> AutoencoderKL:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vae = AutoencoderKL(**ARCHITECTURE)
    # quant_conv (after the encoder) gives the posterior's mean and log-variance. At diffusers' initialisation the
    # posterior std is ~1 while the means are ~0.1: its noise drowns all but the strongest signal (the shapes'
    # outlines; the colours were lost), and a KL weight this small never pulls it down in a short training.
    channels = ARCHITECTURE["latent_channels"]
    with torch.no_grad():
        vae.quant_conv.bias[channels:] = INITIAL_LOG_VARIANCE
        vae.quant_conv.weight[channels:] *= 0.1
    return vae


def render(indices: range, seed: int, resolution: int) -> torch.Tensor:
    """Samples `indices` of the synthetic data set as pixels (N, 3, H, W) in [-1, 1], as the training loop feeds them."""
    return torch.stack([image_to_tensor(make_sample(i, seed=seed, resolution=resolution)[0]) for i in indices])


def render_balanced(count: int, seed: int, resolution: int) -> torch.Tensor:
    """Scenes of one or two objects whose shapes and colours are drawn uniformly, not long-tailed as in the data set:
    trained on the data set's frequencies, the VAE paints its rare colours in the frequent ones."""
    rng = random.Random(f"shapes-vae/{seed}")
    scenes = []
    for _ in range(count):
        pairs = []
        while len(pairs) < 1 + (rng.random() < 0.5):
            pair = (SHAPES[int(rng.random() * len(SHAPES))], COLOURS[int(rng.random() * len(COLOURS))])
            if pair not in pairs:
                pairs.append(pair)
        scenes.append(image_to_tensor(render_objects(rng, pairs, resolution)[0]))  # the data set's object sizes
    return torch.stack(scenes)


def train(steps: int = 1800, batch_size: int = 8, pool: int = 3000, lr: float = 1e-3, resolution: int = RESOLUTION,
          seed: int = 0, progress: bool = True) -> AutoencoderKL:
    """Train from a fixed seed on a fixed pool of renders: the same arguments give the same weights on one machine."""
    images = render_balanced(pool, TRAIN_SEED, resolution)
    background = images.flatten(2).median(dim=2).values[:, :, None, None]
    weights = 1 + OBJECT_WEIGHT * ((images - background).abs().amax(1, keepdim=True) > 0.1).float()
    vae = build_untrained(seed).train()
    optimizer = torch.optim.AdamW(vae.parameters(), lr=lr, weight_decay=0.0)
    warmup = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(  # linear warm-up, then cosine to zero
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps))))
    gen = torch.Generator().manual_seed(seed)
    start = time.perf_counter()
    for step in range(steps):
        picks = torch.randint(0, pool, (batch_size,), generator=gen)
        batch, weight = images[picks], weights[picks]
        posterior = vae.encode(batch).latent_dist
        recon = vae.decode(posterior.sample(generator=gen)).sample
        l1 = ((recon - batch).abs() * weight).sum() / (weight.sum() * 3)
        loss = l1 + KL_WEIGHT * posterior.kl().mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if progress and (step % 100 == 0 or step == steps - 1):
            print(f"step {step + 1}/{steps}  object-weighted L1 {l1.item():.4f}  {time.perf_counter() - start:.0f} s",
                  flush=True)
    vae.eval().requires_grad_(False)
    with torch.no_grad():
        latents = torch.cat([vae.encode(images[i:i + 256]).latent_dist.mean for i in range(0, min(pool, 1024), 256)])
    vae.register_to_config(scaling_factor=round(1.0 / latents.std().item(), 5))
    return vae


@torch.no_grad()
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="only measure the shipped weights")
    parser.add_argument("--steps", type=int, default=1800)
    parser.add_argument("--out", type=Path, default=WEIGHTS_DIR)
    args = parser.parse_args(argv)
    if not args.check:
        vae = train(steps=args.steps)
        vae.save_pretrained(args.out)
        size = sum(f.stat().st_size for f in args.out.iterdir())
        print(f"wrote {args.out} ({size / 1024:.0f} kB), scaling_factor {vae.config.scaling_factor}")
    vae = AutoencoderKL.from_pretrained(args.out).eval()
    for resolution in (64, 128):
        err = reconstruction_error(vae, render(range(64), CHECK_SEED, resolution))
        print(f"held-out renders at {resolution} px: MAE {err['mae']:.4f}, PSNR {err['psnr']:.1f} dB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
