"""Aspect-ratio buckets (PixArt-style): a table of (height, width) sizes of about the same area, and the bucket of
an image.

The table for base resolution R (rule of this module, not a copy of PixArt's lists):

  * every size is a multiple of `divisor` on both sides (VAE factor 8 x DiT patch 2 = 16 by default, so each
    bucket is a whole number of DiT tokens);
  * the shorter side s runs from R down in steps of `step` (default: R / 16 rounded to a multiple of the divisor,
    at least the divisor: 16 px at 256, 32 at 512, 64 at 1024), and the longer side is the multiple of the divisor
    nearest to R² / s, so every bucket has about R² pixels (within divisor / (2R) of it, relative);
  * s stops once longer / shorter would exceed `max_ratio` (4: from 1:4 to 4:1);
  * each size comes in both orientations (portrait h > w and landscape h < w) plus the square R x R.

R = 1024 gives 17 buckets from 512 x 2048 (h x w) to 2048 x 512; R = 256 also 17 (128 x 512 ... 512 x 128). The
table is sorted by h / w. An image goes to the bucket nearest in log aspect ratio |log(h/w) - log(bh/bw)| (ties:
the lower ratio); an image of unknown size (0 x 0 in the index) goes to the square bucket. `resize_to_bucket`
scales an image to cover the bucket and crops the centre, as `resize_center_crop` does for the square.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
from PIL import Image

from .images import resize_cover_crop

__all__ = ["bucket_sizes", "assign_buckets", "nearest_bucket", "resize_to_bucket"]


def bucket_sizes(
    resolution: int, divisor: int = 16, max_ratio: float = 4.0, step: int | None = None
) -> list[tuple[int, int]]:
    """The (height, width) buckets around `resolution`² pixels, sorted by height / width (see the module doc)."""
    if divisor < 1 or resolution < divisor or resolution % divisor:
        raise ValueError(
            f"the base resolution {resolution} must be a positive multiple of the bucket divisor {divisor} "
            f"(VAE downsampling x DiT patch size)"
        )
    if max_ratio < 1:
        raise ValueError(f"max_ratio must be >= 1, got {max_ratio}")
    if step is None:
        step = divisor * max(1, round(resolution / (16 * divisor)))
    if step < 1 or step % divisor:
        raise ValueError(f"step {step} must be a positive multiple of the divisor {divisor}")
    area = resolution * resolution
    sizes = {(resolution, resolution)}
    short = resolution - step
    while short >= divisor:
        long = max(short, divisor * round(area / short / divisor))
        if long > max_ratio * short + 1e-9:
            break
        sizes.add((short, long))  # landscape: height < width
        sizes.add((long, short))
        short -= step
    return sorted(sizes, key=lambda hw: (hw[0] / hw[1], hw[0]))


def assign_buckets(
    widths: np.ndarray | Sequence[int], heights: np.ndarray | Sequence[int], buckets: Sequence[tuple[int, int]]
) -> np.ndarray:
    """Index into `buckets` ((height, width) pairs) of the bucket nearest in log aspect ratio, per image.

    Images with a non-positive width or height (size unknown) get the bucket nearest to square. Ties go to the
    bucket of lower height / width. Works in chunks: flat memory for tens of millions of images.
    """
    w_all = np.asarray(widths).reshape(-1)
    h_all = np.asarray(heights).reshape(-1)
    if w_all.shape != h_all.shape:
        raise ValueError(f"widths and heights differ in length ({w_all.size} vs {h_all.size})")
    if not len(buckets):
        raise ValueError("no buckets given")
    table = np.log(np.asarray([bh / bw for bh, bw in buckets], dtype=np.float64))
    order = np.argsort(table, kind="stable")
    # nearest of sorted values = which interval between consecutive midpoints the value falls in; a value exactly
    # on a midpoint goes to the lower bucket (side="left"), as argmin of the distances would
    mids = (table[order][1:] + table[order][:-1]) / 2
    out = np.empty(w_all.size, dtype=np.int64)
    for start in range(0, w_all.size, 1 << 20):
        w = w_all[start : start + (1 << 20)].astype(np.float64)
        h = h_all[start : start + (1 << 20)].astype(np.float64)
        ratio = np.zeros_like(w)  # log(h / w); 0 = square for unknown sizes
        known = (w > 0) & (h > 0)
        ratio[known] = np.log(h[known]) - np.log(w[known])
        out[start : start + w.size] = order[np.searchsorted(mids, ratio, side="left")]
    return out


def nearest_bucket(width: int, height: int, buckets: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """The (height, width) bucket of an image of width x height pixels (nearest in log aspect ratio)."""
    return tuple(buckets[int(assign_buckets([width], [height], buckets)[0])])


def resize_to_bucket(img: Image.Image, size: tuple[int, int]) -> Image.Image:
    """Scale `img` (keeping its aspect ratio) to cover size = (height, width), then crop the centre to it."""
    height, width = size
    if height < 1 or width < 1:
        raise ValueError(f"bucket size must be positive, got {size}")
    return resize_cover_crop(img, width, height)
