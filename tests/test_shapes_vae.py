"""The shapes VAE: the shipped weights reconstruct scenes they never saw, and retraining them is deterministic."""

import torch

from data.synthetic import make_sample
from imba.training import shapes_vae
from models.vae import SHAPES, load_vae, reconstruction_error, vae_scale_factor

# The shipped weights measured 0.039 MAE and 24.1 dB PSNR (pixels in [0, 1]) on the first 32 held-out scenes at
# 128 px (0.042 and 23.9 dB on 64: python -m imba.training.shapes_vae --check); most of the error is the background's
# faint tint. The bounds leave room for other CPUs' arithmetic, not for a worse model: the random "tiny" VAE is at
# ~0.4 MAE.
MAX_MAE_128 = 0.05
MIN_PSNR_128 = 22.0


def test_the_shipped_vae_has_sd_vae_latents_and_reconstructs_held_out_scenes():
    vae = load_vae(SHAPES)
    assert vae_scale_factor(vae) == 8 and vae.config.latent_channels == 4 and not vae.training
    pixels = shapes_vae.render(range(32), shapes_vae.CHECK_SEED, 128)  # the default run's own data: held out
    err = reconstruction_error(vae, pixels)
    assert err["mae"] < MAX_MAE_128 and err["psnr"] > MIN_PSNR_128, err
    with torch.no_grad():
        latents = vae.encode(pixels).latent_dist.mean * vae.config.scaling_factor
    assert 0.7 < latents.std().item() < 1.4  # the scaling factor gives the DiT unit-scale latents


def test_each_object_keeps_its_colour_through_the_vae():
    vae = load_vae(SHAPES)
    for index in range(8):
        img, _, objects = make_sample(index, seed=shapes_vae.CHECK_SEED, resolution=128)
        pixels = shapes_vae.render(range(index, index + 1), shapes_vae.CHECK_SEED, 128)
        with torch.no_grad():
            recon = vae.decode(vae.encode(pixels).latent_dist.mean).sample.clamp(-1, 1)
        for obj in objects:
            x0, y0, x1, y1 = obj["bbox"]
            cx, cy = (x0 + x1) // 2, (y0 + y1) // 2
            if obj["shape"] == "ring":  # hollow: its centre is background
                continue
            # the centre 4×4 of a filled shape is its colour, before and after
            before = pixels[0, :, cy - 2:cy + 2, cx - 2:cx + 2].mean((1, 2))
            after = recon[0, :, cy - 2:cy + 2, cx - 2:cx + 2].mean((1, 2))
            assert (before - after).abs().max().item() < 0.15, (index, obj)


def test_retraining_is_deterministic_and_sets_the_scaling_factor():
    kwargs = dict(steps=3, batch_size=2, pool=4, resolution=32, progress=False)
    a, b = shapes_vae.train(**kwargs), shapes_vae.train(**kwargs)
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), name
    assert a.config.scaling_factor == b.config.scaling_factor > 0
    assert not a.training
