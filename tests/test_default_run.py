"""`python train.py` exactly as a newcomer runs it: its samples show the colours and shapes the prompts ask for."""

import random
import subprocess
import sys

import numpy as np
import pytest
import torch
from scipy import ndimage

from conftest import REPO
from data.synthetic import render_objects


def object_mask(image) -> np.ndarray:
    """The pixels that stand out from the light background (the objects)."""
    pixels = np.asarray(image.convert("RGB"), dtype=np.float64)
    background = np.median(pixels.reshape(-1, 3), axis=0)
    mask = np.linalg.norm(pixels - background, axis=2) > 60
    assert mask.mean() > 0.01, "no object in the sample"
    return mask


def object_colour(image) -> np.ndarray:
    """Mean RGB of the object pixels, in [0, 255]."""
    return np.asarray(image.convert("RGB"), dtype=np.float64)[object_mask(image)].mean(axis=0)


def fill_ratio(image) -> float:
    """Area of the largest object / the area of its bounding box: 1 for a square, π/4 for a circle, 1/2 for a
    triangle; a shapeless blob lands in between."""
    labels, count = ndimage.label(object_mask(image))
    largest = 1 + int(np.argmax(ndimage.sum(labels > 0, labels, range(1, count + 1))))
    ys, xs = np.nonzero(labels == largest)
    return len(ys) / ((ys.max() - ys.min() + 1) * (xs.max() - xs.min() + 1))


def reference_fill(shape: str) -> float:
    """The fill ratio of the training renders of `shape` (median of 20)."""
    return float(np.median([fill_ratio(render_objects(random.Random(i), [(shape, "red")], 128)[0])
                            for i in range(20)]))


@pytest.mark.slow
def test_the_default_run_draws_the_prompted_colours_and_shapes(tmp_path):
    from diffusers import PixArtAlphaPipeline

    from models.pipeline import sample_images

    out = tmp_path / "tiny"
    done = subprocess.run([sys.executable, str(REPO / "train.py"), f"train.output_dir={out}"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (out / "samples" / "step_0002500.png").is_file()

    pipe = PixArtAlphaPipeline.from_pretrained(out / "export")
    pipe.set_progress_bar_config(disable=True)
    shapes, seeds = ("circle", "square", "triangle"), [11, 12, 13, 14]
    redness, fills = {}, {}  # R - B of the objects' mean colour per sample; fill ratios per (colour, shape)
    for colour in ("red", "blue"):
        prompts = [f"a {colour} {shape}" for shape in shapes for _ in seeds]
        with torch.random.fork_rng(devices=[]):
            images = sample_images(pipe, prompts, 128, 4.5, 20, seeds * len(shapes), 64)
        redness[colour] = [float(c[0] - c[2]) for c in map(object_colour, images)]
        fills.update({(colour, shape): [fill_ratio(im) for im in images[i * 4:(i + 1) * 4]]
                      for i, shape in enumerate(shapes)})
    # measured: R - B of +145..+158 for every red sample, -136..-153 for every blue one
    assert all(r > 0 for r in redness["red"]) and all(b < 0 for b in redness["blue"]), redness
    assert np.mean(redness["red"]) - np.mean(redness["blue"]) > 150, redness
    # shapes: each sample is read as the shape whose renders' fill ratio is nearest to its own
    references = {shape: reference_fill(shape) for shape in shapes}
    read = {key: [min(shapes, key=lambda s: abs(references[s] - f)) for f in values] for key, values in fills.items()}
    right = np.mean([r == key[1] for key, reads in read.items() for r in reads])
    # measured: 20 of the 24 samples read as the prompted shape (chance: 1 in 3); median fill ratios 0.91
    # (squares), 0.75 (circles), 0.51 (triangles) against 1.00, 0.78, 0.51 for the renders
    assert right >= 0.6, (references, fills)
    median = {shape: np.median([f for (c, s), v in fills.items() if s == shape for f in v]) for shape in shapes}
    assert median["square"] > median["circle"] > median["triangle"], median
