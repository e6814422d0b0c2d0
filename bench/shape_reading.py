"""Reading a sample of the synthetic shapes set: its objects' colour, and its shape from the largest object's
fill ratio (its area over its bounding box's: 1 for a square, π/4 for a circle, 1/2 for a triangle), compared with
the training renders of each shape. The fill ratio alone reads a ring as a triangle (0.51 both) and a cross between
the two; `shape_features` adds the solidity (area with holes filled over the convex hull's: star 0.56, cross 0.76,
convex shapes 1) and the hole share (ring 0.35, others 0). Used by the default-run test (fill ratio, head shapes)
and by `bench/default_balance.py` (all three, the six prompted shapes)."""

from __future__ import annotations

import random

import numpy as np
from scipy import ndimage
from scipy.spatial import ConvexHull

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


def largest_object(image) -> np.ndarray:
    """The mask of the largest connected object."""
    labels, count = ndimage.label(object_mask(image))
    return labels == 1 + int(np.argmax(ndimage.sum(labels > 0, labels, range(1, count + 1))))


def _fill(ys: np.ndarray, xs: np.ndarray) -> float:
    return len(ys) / ((ys.max() - ys.min() + 1) * (xs.max() - xs.min() + 1))


def fill_ratio(image) -> float:
    """Area of the largest object / the area of its bounding box; a shapeless blob lands between the shapes'."""
    return _fill(*np.nonzero(largest_object(image)))


def shape_features(image) -> np.ndarray:
    """(fill ratio, solidity, hole share) of the largest object."""
    obj = largest_object(image)
    ys, xs = np.nonzero(obj)
    filled = ndimage.binary_fill_holes(obj)
    area = float(filled.sum())
    hull = ConvexHull(np.c_[ys, xs].astype(np.float64)).volume if len(ys) >= 3 else area
    return np.array([_fill(ys, xs), area / max(hull, 1.0), (area - obj.sum()) / area])


def _renders(shape: str, resolution: int) -> list:
    return [render_objects(random.Random(i), [(shape, "red")], resolution)[0] for i in range(20)]


def reference_fill(shape: str, resolution: int = 128) -> float:
    """The fill ratio of the training renders of `shape` (median of 20)."""
    return float(np.median([fill_ratio(im) for im in _renders(shape, resolution)]))


def reference_features(shape: str, resolution: int = 128) -> np.ndarray:
    """`shape_features` of the training renders of `shape` (median of 20)."""
    return np.median([shape_features(im) for im in _renders(shape, resolution)], axis=0)


def read_shape(value, references: dict, tolerance: float | None = None) -> str:
    """The shape whose renders' reading (a fill ratio, or `shape_features`) is nearest to `value`; "blob" when
    `tolerance` is given and no reference is that near."""
    distance = {s: float(np.linalg.norm(np.subtract(ref, value))) for s, ref in references.items()}
    nearest = min(distance, key=distance.get)
    return "blob" if tolerance is not None and distance[nearest] > tolerance else nearest


def half_smallest_gap(references: dict) -> float:
    """Half the smallest distance between two references: a reading farther than that from every reference is
    nearer to no shape than the shapes are to each other (an irregular blob reads as none of them)."""
    names = list(references)
    return 0.5 * min(float(np.linalg.norm(np.subtract(references[a], references[b])))
                     for i, a in enumerate(names) for b in names[i + 1:])
