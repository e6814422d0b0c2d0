"""`python train.py` exactly as a newcomer runs it: its samples show the colours the prompts ask for."""

import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import REPO


def object_colour(image) -> np.ndarray:
    """Mean RGB of the pixels that stand out from the light background (the objects), in [0, 255]."""
    pixels = np.asarray(image.convert("RGB"), dtype=np.float64).reshape(-1, 3)
    background = np.median(pixels, axis=0)
    objects = pixels[np.linalg.norm(pixels - background, axis=1) > 60]
    assert len(objects) > 0.01 * len(pixels), "no object in the sample"
    return objects.mean(axis=0)


@pytest.mark.slow
def test_the_default_run_draws_red_for_red_and_blue_for_blue(tmp_path):
    from diffusers import PixArtAlphaPipeline

    from models.pipeline import sample_images

    out = tmp_path / "tiny"
    done = subprocess.run([sys.executable, str(REPO / "train.py"), f"train.output_dir={out}"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (out / "samples" / "step_0001200.png").is_file()

    pipe = PixArtAlphaPipeline.from_pretrained(out / "export")
    pipe.set_progress_bar_config(disable=True)
    shapes, seeds = ("circle", "square", "triangle"), [11, 12, 13, 14]
    redness = {}  # R - B of the objects' mean colour, per sample
    for colour in ("red", "blue"):
        prompts = [f"a {colour} {shape}" for shape in shapes for _ in seeds]
        with torch.random.fork_rng(devices=[]):
            images = sample_images(pipe, prompts, 128, 4.5, 20, seeds * len(shapes), 64)
        redness[colour] = [float(c[0] - c[2]) for c in map(object_colour, images)]
    # measured: R - B of +137..+169 for every red sample, -145..-174 for every blue one
    assert all(r > 0 for r in redness["red"]) and all(b < 0 for b in redness["blue"]), redness
    assert np.mean(redness["red"]) - np.mean(redness["blue"]) > 150, redness
