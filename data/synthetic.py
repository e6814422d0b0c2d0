"""Deterministic synthetic image–caption shards with long-tailed concepts.

Each image is a plain light background with one or two coloured shapes that do not overlap; its caption names
them ("a red circle and a blue square"). Shapes and colours are drawn independently from Zipf distributions over
`SHAPES` and `COLOURS` (listed head first), so some shape–colour pairs are common and others rare: a small,
self-contained long-tailed data set for exercising the IMBA loss without downloading anything.

Determinism: sample `i` depends only on (seed, i, resolution) — it is drawn from its own `random.Random` seeded
with a string (hashed with SHA-512 by Python, not with the per-process `hash()`), using only `Random.random()`,
whose stream is stable across Python versions. Tar members are written with a fixed mtime, so the same
(seed, num_samples, samples_per_shard, resolution) gives byte-identical shards (for a given Pillow/zlib build).
"""

from __future__ import annotations

import functools
import io
import json
import math
import os
import random
from typing import Any, BinaryIO

import webdataset as wds
from PIL import Image, ImageDraw

from .files import atomic_write, read_json_object, write_json
from .text import with_article

__all__ = [
    "SHAPES",
    "COLOURS",
    "CAPTION_WORDS",
    "COLOUR_RGB",
    "SAMPLE_PROMPTS",
    "ZIPF_EXPONENT",
    "GENERATOR_VERSION",
    "MANIFEST_NAME",
    "caption_for",
    "make_sample",
    "render_objects",
    "write_synthetic_shards",
]

# Head first: index 0 is the most frequent concept, the last one the rarest.
SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "star", "diamond", "cross", "hexagon", "ring")
COLOURS: tuple[str, ...] = ("red", "blue", "green", "yellow", "purple", "orange", "black", "cyan")
# Every word a caption is written with, the vocabulary of the word-level tiny T5 (`model.text_encoder=tiny-words`):
# its token ids follow this order, so appending keeps the ids of saved runs and reordering changes them.
CAPTION_WORDS: tuple[str, ...] = ("a", "an", "and", *COLOURS, *SHAPES)
COLOUR_RGB: dict[str, tuple[int, int, int]] = {
    "red": (215, 30, 35),
    "blue": (30, 75, 215),
    "green": (35, 150, 50),
    "yellow": (240, 200, 10),
    "purple": (125, 45, 170),
    "orange": (245, 125, 15),
    "black": (25, 25, 25),
    "cyan": (0, 180, 200),
}

ZIPF_EXPONENT = 1.2  # weight of the k-th concept ∝ 1 / (k + 1) ** ZIPF_EXPONENT; head/tail ≈ 8 ** 1.2 ≈ 12
# Mostly one large object: a shape is then 4–6 latent patches wide at 128 px, large enough for the CPU default's
# small DiT to learn it in minutes (at 0.30–0.48 of the frame with one scene in two holding two objects, its
# samples stayed shapeless blobs of the right colour); one scene in four composes two objects.
P_TWO_OBJECTS = 0.25
OBJECT_SIZES = {1: (0.45, 0.70), 2: (0.28, 0.42)}  # side of an object's box / the frame's, by objects in the scene
GENERATOR_VERSION = 2  # bump whenever the drawing or sampling changes: cached folders are then rewritten
MANIFEST_NAME = "synthetic.json"
SHARD_PATTERN = "synthetic-{:06d}.tar"

# Fixed prompts for sample grids: head pairs, a torso pair, tail pairs, and two-object compositions.
SAMPLE_PROMPTS: list[str] = [
    "a red circle",
    "a blue square",
    "a green triangle",
    "a purple star",
    "a cyan ring",  # tail shape + tail colour: the rarest pair
    "a black hexagon",  # tail pair
    "a red circle and a blue square",
    "a yellow cross and a cyan diamond",  # composition with a rare pair
]


def _zipf_cdf(n: int, exponent: float = ZIPF_EXPONENT) -> list[float]:
    weights = [1.0 / (k + 1) ** exponent for k in range(n)]
    total = sum(weights)
    cdf, acc = [], 0.0
    for w in weights:
        acc += w / total
        cdf.append(acc)
    cdf[-1] = 1.0
    return cdf


_SHAPE_CDF = _zipf_cdf(len(SHAPES))
_COLOUR_CDF = _zipf_cdf(len(COLOURS))


def _pick(rng: random.Random, items: tuple[str, ...], cdf: list[float]) -> str:
    u = rng.random()
    for item, c in zip(items, cdf):
        if u < c:
            return item
    return items[-1]


def _uniform(rng: random.Random, lo: float, hi: float) -> float:
    return lo + (hi - lo) * rng.random()


def caption_for(objects: list[dict[str, Any]]) -> str:
    """Caption naming the objects in order: "a red circle", "a red circle and an orange square"."""
    return " and ".join(with_article(f"{o['colour']} {o['shape']}") for o in objects)


def _boxes_apart(a: tuple[float, ...], b: tuple[float, ...], gap: float) -> bool:
    return a[2] + gap <= b[0] or b[2] + gap <= a[0] or a[3] + gap <= b[1] or b[3] + gap <= a[1]


def _layout(rng: random.Random, n: int, size_range: tuple[float, float] | None = None
            ) -> list[tuple[float, float, float, float]]:
    """n square boxes (x0, y0, x1, y1) in unit coordinates that do not overlap; sides drawn from size_range
    (default: OBJECT_SIZES of n)."""
    margin, gap = 0.04, 0.04
    lo, hi = size_range or OBJECT_SIZES[min(n, 2)]
    for _ in range(100):
        boxes: list[tuple[float, float, float, float]] = []
        for _ in range(n):
            s = _uniform(rng, lo, hi)
            x0 = _uniform(rng, margin, 1.0 - margin - s)
            y0 = _uniform(rng, margin, 1.0 - margin - s)
            boxes.append((x0, y0, x0 + s, y0 + s))
        if all(_boxes_apart(a, b, gap) for i, a in enumerate(boxes) for b in boxes[i + 1 :]):
            return boxes
    # Practically unreachable (two boxes of <= 0.42 fit side by side); a fixed fallback keeps it total.
    s = 0.4
    return [(0.05 + i * 0.5, 0.3, 0.05 + i * 0.5 + s, 0.3 + s) for i in range(n)]


def _regular_polygon(cx: float, cy: float, r: float, k: int, phase: float) -> list[tuple[float, float]]:
    angles = [phase + 2 * math.pi * j / k for j in range(k)]
    return [(cx + r * math.cos(a), cy + r * math.sin(a)) for a in angles]


def _draw_shape(draw: ImageDraw.ImageDraw, shape: str, box: tuple[float, ...], rgb: tuple[int, int, int]) -> None:
    x0, y0, x1, y1 = box
    s = x1 - x0
    cx, cy, r = (x0 + x1) / 2, (y0 + y1) / 2, s / 2
    if shape == "circle":
        draw.ellipse(box, fill=rgb)
    elif shape == "ring":
        draw.ellipse(box, outline=rgb, width=max(1, round(0.2 * s)))
    elif shape == "square":
        d = 0.1 * s
        draw.rectangle((x0 + d, y0 + d, x1 - d, y1 - d), fill=rgb)
    elif shape == "triangle":
        draw.polygon([(cx, y0), (x1, y1 - 0.07 * s), (x0, y1 - 0.07 * s)], fill=rgb)
    elif shape == "diamond":
        draw.polygon([(cx, y0), (x1, cy), (cx, y1), (x0, cy)], fill=rgb)
    elif shape == "cross":
        t = 0.17 * s
        draw.rectangle((cx - t, y0, cx + t, y1), fill=rgb)
        draw.rectangle((x0, cy - t, x1, cy + t), fill=rgb)
    elif shape == "hexagon":
        draw.polygon(_regular_polygon(cx, cy, r, 6, 0.0), fill=rgb)
    elif shape == "star":
        outer = _regular_polygon(cx, cy + 0.06 * s, r, 5, -math.pi / 2)
        inner = _regular_polygon(cx, cy + 0.06 * s, 0.42 * r, 5, -math.pi / 2 + math.pi / 5)
        draw.polygon([p for pair in zip(outer, inner) for p in pair], fill=rgb)
    else:  # pragma: no cover - SHAPES is closed
        raise ValueError(f"unknown shape {shape!r}")


def render_objects(rng: random.Random, pairs: list[tuple[str, str]], resolution: int,
                   size_range: tuple[float, float] | None = None) -> tuple[Image.Image, list[dict[str, Any]]]:
    """Draw (shape, colour) pairs at random non-overlapping places on a light background (randomness from rng).
    A colour is a name of COLOUR_RGB or an (r, g, b) tuple of 0–255 values.

    Returns the RGB image and the objects with shape, colour and pixel bbox.
    """
    boxes = _layout(rng, len(pairs), size_range)
    background = tuple(int(_uniform(rng, 228, 252)) for _ in range(3))
    ss = 4 if resolution <= 128 else 2  # supersample, then box-filter down: smooth edges, still deterministic
    canvas = resolution * ss
    img = Image.new("RGB", (canvas, canvas), background)
    draw = ImageDraw.Draw(img)
    objects = []
    for (shape, colour), box in zip(pairs, boxes):
        rgb = COLOUR_RGB[colour] if isinstance(colour, str) else tuple(int(v) for v in colour)
        _draw_shape(draw, shape, tuple(v * canvas for v in box), rgb)
        bbox = [min(resolution, max(0, round(v * resolution))) for v in box]
        objects.append({"shape": shape, "colour": colour, "bbox": bbox})
    return img.resize((resolution, resolution), Image.Resampling.BOX), objects


def make_sample(index: int, seed: int = 0, resolution: int = 256) -> tuple[Image.Image, str, list[dict[str, Any]]]:
    """The `index`-th synthetic sample: (RGB image, caption, objects with shape, colour and pixel bbox)."""
    rng = random.Random(f"imba-synthetic/v{GENERATOR_VERSION}/{seed}/{index}")
    n = 2 if rng.random() < P_TWO_OBJECTS else 1
    pairs: list[tuple[str, str]] = []
    while len(pairs) < n:
        pair = (_pick(rng, SHAPES, _SHAPE_CDF), _pick(rng, COLOURS, _COLOUR_CDF))
        if pair not in pairs:  # never "a red circle and a red circle"
            pairs.append(pair)
    img, objects = render_objects(rng, pairs, resolution)
    return img, caption_for(objects), objects


def _params(num_samples: int, samples_per_shard: int, resolution: int, seed: int) -> dict[str, Any]:
    return {
        "generator": "imba-synthetic",
        "version": GENERATOR_VERSION,
        "num_samples": num_samples,
        "samples_per_shard": samples_per_shard,
        "resolution": resolution,
        "seed": seed,
    }


def _existing_set(out_dir: str, params: dict[str, Any]) -> list[str] | None:
    """Shard paths if `out_dir` holds a complete set written with `params`, else None."""
    manifest = read_json_object(os.path.join(out_dir, MANIFEST_NAME))
    if manifest is None or any(manifest.get(k) != v for k, v in params.items()):
        return None
    paths = []
    for shard in manifest.get("shards", []):
        path = os.path.join(out_dir, shard["name"])
        if not os.path.isfile(path) or os.path.getsize(path) != shard["size"]:
            return None
        paths.append(path)
    return paths or None


def _write_shard(f: BinaryIO, indices: range, seed: int, resolution: int, bar: Any = None) -> None:
    """Samples `indices` as one tar written into `f` (members in a fixed order, mtime 0: reproducible bytes)."""
    with wds.TarWriter(f, encoder=False, compress=False, mtime=0) as writer:
        for index in indices:
            img, caption, objects = make_sample(index, seed=seed, resolution=resolution)
            key = f"{index:09d}"
            png = io.BytesIO()
            img.save(png, format="PNG")
            meta = {"key": key, "caption": caption, "width": resolution, "height": resolution}
            meta["objects"] = objects
            writer.write(
                {
                    "__key__": key,
                    "png": png.getvalue(),
                    "txt": caption.encode("utf-8"),
                    "json": json.dumps(meta, sort_keys=True).encode("utf-8"),
                }
            )
            if bar is not None:
                bar.update(1)


def write_synthetic_shards(
    out_dir: str | os.PathLike,
    num_samples: int = 2000,
    samples_per_shard: int = 500,
    resolution: int = 256,
    seed: int = 0,
    progress: bool = False,
) -> list[str]:
    """Write img2dataset-layout shards `synthetic-000000.tar`, ... into `out_dir`; return their paths.

    Each sample `{key}` has `{key}.png`, `{key}.txt` (caption) and `{key}.json`
    ({"key", "caption", "width", "height", "objects": [{"shape", "colour", "bbox": [x0, y0, x1, y1]}]}).
    Shards are written under a temporary name and renamed; the manifest `synthetic.json` is written last, so a
    folder with a manifest matching the parameters holds a complete set and is returned as is, without rewriting.
    Not safe against two processes writing the same folder at the same time: call it on one rank, then barrier.
    """
    if num_samples < 1 or samples_per_shard < 1 or resolution < 8:
        raise ValueError(
            f"write_synthetic_shards: need num_samples >= 1, samples_per_shard >= 1, resolution >= 8 "
            f"(got {num_samples}, {samples_per_shard}, {resolution})"
        )
    out_dir = os.path.abspath(os.path.expanduser(out_dir))
    params = _params(num_samples, samples_per_shard, resolution, seed)
    existing = _existing_set(out_dir, params)
    if existing is not None:
        return existing

    os.makedirs(out_dir, exist_ok=True)
    manifest_path = os.path.join(out_dir, MANIFEST_NAME)
    if os.path.exists(manifest_path):
        os.remove(manifest_path)  # the folder is incomplete until the new manifest lands
    num_shards = math.ceil(num_samples / samples_per_shard)
    names = [SHARD_PATTERN.format(i) for i in range(num_shards)]
    for stale in os.listdir(out_dir):  # shards of an earlier, larger set would be picked up by a directory spec
        if stale.startswith("synthetic-") and stale.endswith(".tar") and stale not in names:
            os.remove(os.path.join(out_dir, stale))

    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=num_samples, desc=f"synthetic shards -> {out_dir}", unit="img")

    shards = []
    try:
        for shard_index, name in enumerate(names):
            path = os.path.join(out_dir, name)
            start = shard_index * samples_per_shard
            stop = min(num_samples, start + samples_per_shard)
            atomic_write(path, functools.partial(_write_shard, indices=range(start, stop), seed=seed,
                                                  resolution=resolution, bar=bar))
            shards.append({"name": name, "size": os.path.getsize(path), "num_samples": stop - start})
    finally:
        if bar is not None:
            bar.close()

    write_json(manifest_path, dict(params, shards=shards))
    return [os.path.join(out_dir, s["name"]) for s in shards]
