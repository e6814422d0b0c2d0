"""Balancing by what the images show: k-means clusters of per-image features (a run's VAE latents, pooled), each
cluster one more *entry* of its samples (`data.balance`), so a balance rule draws the samples of a rare cluster more
often as it draws those of a rare concept; no labels and no captions are read.

    features = latent_features(index, manifest)  # a run's precomputed latents, pooled: (N, C·4·4)
    labels = kmeans(features, k)                 # (N, D) features -> a cluster per sample, deterministic
    table = cluster_table(labels)                # entries "image:<j>", one per sample
    both = join_tables(caption_table, table)     # a sample's caption entries and its cluster

k-means: k-means++ seeding (Arthur & Vassilvitskii 2007) from a seeded generator, then Lloyd iterations in float64
until no sample changes cluster (or `iterations`), on a seeded subsample of at most FIT_ROWS samples (a large set's
centres are found on a part of it; every sample is then given its nearest); a cluster left empty takes the sample
farthest from its centre (identical samples always share a cluster, so with fewer distinct samples than k some
clusters stay empty).
The default k is round(sqrt(N)), so a cluster holds about sqrt(N) samples at the natural rate.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .balance import ConceptTable
from .index import ShardIndex
from .remote import ShardCache

__all__ = ["CLUSTER_PREFIX", "default_clusters", "pooled_features", "latent_features", "kmeans", "cluster_table",
           "join_tables"]

CLUSTER_PREFIX = "image:"


def default_clusters(num_samples: int) -> int:
    return max(1, round(math.sqrt(num_samples)))


def pooled_features(images: np.ndarray, grid: tuple[int, int]) -> np.ndarray:
    """(N, C, H, W) images or latents → (N, C·gh·gw): each channel averaged over a gh × gw grid of cells (H and W
    multiples of the grid): the coarse layout of colour, the part of an image a cluster can tell apart."""
    n, c, h, w = images.shape
    gh, gw = grid
    if h % gh or w % gw:
        raise ValueError(f"a {h} x {w} image does not split into a {gh} x {gw} grid of equal cells")
    cells = images.reshape(n, c, gh, h // gh, gw, w // gw).mean(axis=(3, 5))
    return cells.reshape(n, -1).astype(np.float64)


def latent_features(index: ShardIndex, manifest: dict[str, Any], cache: ShardCache | None = None,
                    progress: bool = False) -> np.ndarray:
    """(N, C·gh·gw) float64: each sample's latent mean (the VAE's, as precomputed) averaged over a grid of cells,
    4 × 4 where the latent's sides are multiples of 4, in index order: what `data.balance.by=images` clusters. A
    sample that cannot be read gives its substitute's row, as in training."""
    from .precomputed import PrecomputedShards  # the reader imports torch: only where the latents are read

    shards = PrecomputedShards(index, manifest, cache=cache)
    rows = range(len(shards))
    if progress:
        from tqdm import tqdm

        rows = tqdm(rows, desc="latent features", unit=" samples", unit_scale=True, mininterval=1.0,
                    dynamic_ncols=True)
    features = []
    for i in rows:
        mean = shards.get(i)["latent"][None, 0].astype(np.float32)
        features.append(pooled_features(mean, (math.gcd(mean.shape[2], 4), math.gcd(mean.shape[3], 4))))
    return np.concatenate(features) if features else np.zeros((0, 0))


FIT_ROWS = 1 << 16


def kmeans(features: np.ndarray, k: int, seed: int = 0, iterations: int = 100) -> np.ndarray:
    """A cluster index in [0, k) per row of `features` (N, D); the same features, k and seed give the same
    labels."""
    every = np.asarray(features, dtype=np.float64)
    if not 1 <= k <= len(every):
        raise ValueError(f"k-means needs 1 <= k <= the {len(every)} samples, got k = {k}")
    rng = np.random.default_rng(seed)
    fit = len(every) > FIT_ROWS
    x = every[np.sort(rng.choice(len(every), FIT_ROWS, replace=False))] if fit else every
    n = len(x)
    centres = np.empty((k, x.shape[1]))
    centres[0] = x[rng.integers(n)]
    nearest = ((x - centres[0]) ** 2).sum(1)
    for j in range(1, k):
        total = nearest.sum()
        pick = rng.choice(n, p=nearest / total) if total > 0 else rng.integers(n)
        centres[j] = x[pick]
        nearest = np.minimum(nearest, ((x - centres[j]) ** 2).sum(1))
    labels = np.full(n, -1)
    for _ in range(iterations):
        new, own = _assign(x, centres)
        if np.array_equal(new, labels):
            break
        labels = new
        for j in range(k):
            members = labels == j
            if members.any():
                centres[j] = x[members].mean(0)
            else:  # the sample farthest from its own centre starts this cluster anew at the next assignment
                far = int(own.argmax())
                centres[j], own[far] = x[far], -1.0  # not taken twice
    return _assign(every, centres)[0] if fit else labels


ROWS_AT_ONCE = 1 << 14  # rows whose distances to every centre are held at once


def _assign(x: np.ndarray, centres: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row's nearest centre and its squared distance to it."""
    labels, own = np.empty(len(x), dtype=np.int64), np.empty(len(x))
    square = (centres * centres).sum(1)
    for a in range(0, len(x), ROWS_AT_ONCE):
        rows = x[a:a + ROWS_AT_ONCE]
        distance = (rows * rows).sum(1)[:, None] - 2 * rows @ centres.T + square[None, :]
        labels[a:a + len(rows)] = distance.argmin(1)
        own[a:a + len(rows)] = distance[np.arange(len(rows)), labels[a:a + len(rows)]]
    return labels, own


def cluster_table(labels: np.ndarray) -> ConceptTable:
    """One entry per sample, its cluster ("image:<j>")."""
    labels = np.asarray(labels)
    names, ids = np.unique(labels, return_inverse=True)
    return ConceptTable([f"{CLUSTER_PREFIX}{j}" for j in names], np.arange(len(labels) + 1, dtype=np.int64),
                        ids.astype(np.int32))


def join_tables(a: ConceptTable, b: ConceptTable) -> ConceptTable:
    """Each sample's entries of `a` followed by its entries of `b` (the same samples, in the same order)."""
    if len(a) != len(b):
        raise ValueError(f"the tables cover {len(a)} and {len(b)} samples: they are not of the same samples")
    first, second = a.lengths(), b.lengths()
    ptr = np.concatenate([[0], np.cumsum(first + second)]).astype(np.int64)
    ids = np.empty(int(ptr[-1]), dtype=np.int32)
    for table, shift, skip in ((a, 0, 0), (b, len(a.entries), first)):
        sample = np.repeat(np.arange(len(table)), table.lengths())
        at = np.arange(len(sample)) - (table.ptr[sample] - table.ptr[0])  # position within the sample's entries
        ids[ptr[sample] + (skip[sample] if shift else 0) + at] = table.ids[table.ptr[0]:table.ptr[-1]] + shift
    return ConceptTable(a.entries + b.entries, ptr, ids)
