"""The run says, before its first step, when its VAE cannot represent its images: the shipped shapes VAE on a
photograph is below the bar, on its own scenes above it, at every resolution a run uses."""

import os

import matplotlib
import numpy as np
import pytest
import torch
from PIL import Image

from imba.training import shapes_vae
from imba.training.vae_check import MIN_PSNR_DB, vae_warning
from models.vae import SHAPES, TINY, load_vae, reconstruction_error

PHOTO = os.path.join(matplotlib.get_data_path(), "sample_data", "grace_hopper.jpg")  # a photograph shipped with it


def photo(resolution: int) -> torch.Tensor:
    image = Image.open(PHOTO).convert("RGB").resize((resolution, resolution), Image.BICUBIC)
    return torch.from_numpy(np.array(image)).permute(2, 0, 1).float().div(127.5).sub(1)[None]


@pytest.fixture(scope="module")
def vae():
    return load_vae(SHAPES)


@pytest.mark.parametrize("resolution", [32, 64, 128])
def test_the_shapes_vae_is_above_the_bar_on_its_own_scenes_and_far_below_it_on_a_photograph(vae, resolution):
    own = shapes_vae.render(range(8), shapes_vae.CHECK_SEED, resolution)
    assert reconstruction_error(vae, own)["psnr"] > MIN_PSNR_DB + 1
    assert reconstruction_error(vae, photo(resolution))["psnr"] < MIN_PSNR_DB - 4
    assert vae_warning(SHAPES, vae, {"pixels": own}) is None


def test_photographs_through_the_shapes_vae_are_said_in_one_line_with_the_fix(vae):
    line = vae_warning(SHAPES, vae, {"pixels": photo(64).repeat(3, 1, 1, 1)})
    assert line.startswith("warning: model.vae=shapes reconstructs this run's first images at ")
    assert "set model.vae to an SD-VAE" in line and "\n" not in line
    tuned = vae_warning(SHAPES, vae, {"pixels": photo(64)}, fine_tuning=True)  # the base learnt these latents
    assert "fine-tune a base trained with an SD-VAE" in tuned and "set model.vae" not in tuned


def test_batches_without_pixels_and_the_random_tiny_vae_are_not_judged(vae):
    assert vae_warning(SHAPES, vae, {"latents": torch.zeros(1, 4, 8, 8)}) is None  # precomputed features
    assert vae_warning(TINY, load_vae(TINY), {"pixels": photo(32)}) is None
