"""The order of the indexed reader: which samples each rank's batch t holds, a pure function of (seed, epoch,
position in the epoch), computed arithmetically, so a loader built with `start_batch = step * grad_accum`
continues exactly where the checkpointed run stopped, without decoding (or even reading) the skipped samples.

Order. Sample indices are visited in a permutation of range(N) that depends only on (seed, epoch): a keyed Feistel
network with cycle walking, a bijection computed position by position in O(1) memory, with no numpy/torch RNG
involved, so the order does not change with library versions. Optionally (`shard_window=k > 0`) the order is
shard-aware for locality: shards are permuted, grouped into windows of k consecutive shards, and samples are
permuted within each window, so at most ~k shards are read at a time (wids' ChunkedSampler does the same with
fixed chunks). Epoch e+1 uses a fresh permutation; the stream is infinite.

Ranks and batches. Epoch positions are cut into global batches of world_size * batch_size consecutive positions;
rank r takes the r-th slice of batch_size of each. Every rank therefore has exactly
`N // (world_size * batch_size)` batches per epoch (DDP never waits on a rank that ran out); the last
`N % (world_size * batch_size)` positions of each epoch are dropped, a different random set of samples each epoch.
Batches are index lists consumed by a map-style DataLoader, which returns them in sampler order whatever
`num_workers` is, and each batch is decoded by one worker: workers are disjoint and the order equals
`num_workers=0`.

Aspect-ratio buckets (`BucketBatchSampler`, tables in `data.buckets`): each sample's bucket comes from the image
size in the index (nothing is decoded to assign it); every batch holds samples of one bucket, cut to that bucket's
(height, width). Per epoch each bucket's samples are permuted (keyed by seed, epoch, bucket) and cut into full
batches (each bucket's last `count % batch_size` samples of that permutation are dropped, a different set each
epoch); all buckets' batches are permuted together (keyed by seed, epoch), and consecutive groups of world_size
batches form the global steps, rank r taking the r-th: every rank has the same number of batches per epoch,
`(sum over buckets of count // batch_size) // world_size` (the last few batches of an epoch that do not fill a
step are dropped too), and ranks may be in different buckets at one step (DDP needs equal shapes only within a
rank). Batch t is computed from (seed, epoch, t) in O(batch_size), so `start_batch` resume is exact here too.
"""

from __future__ import annotations

import functools
from typing import Any, Iterator, Sequence

import numpy as np

from .seeds import derive_seed

__all__ = [
    "feistel_permute",
    "batches_per_epoch",
    "IndexedBatchSampler",
    "BucketBatch",
    "BucketBatchSampler",
]

FEISTEL_ROUNDS = 8

_U64 = np.uint64


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser on uint64 arrays (wrapping arithmetic)."""
    x = (x ^ (x >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> _U64(27))) * _U64(0x94D049BB133111EB)
    return x ^ (x >> _U64(31))


@functools.lru_cache(maxsize=4096)
def _round_keys(*key: Any) -> tuple[int, ...]:
    return tuple(derive_seed("imba-indexed/feistel", *key, r) for r in range(FEISTEL_ROUNDS))


def feistel_permute(positions: np.ndarray | Sequence[int], n: int, *key: Any) -> np.ndarray:
    """perm(positions) for a pseudo-random permutation `perm` of range(n) chosen by `key` (any printable parts).

    A balanced Feistel network on the smallest even number of bits covering n, with cycle walking to stay inside
    range(n): a bijection, evaluated per position, identical on every machine and library version.
    """
    pos = np.asarray(positions, dtype=np.int64)
    if n < 1 or (pos.size and (pos.min() < 0 or pos.max() >= n)):
        raise ValueError(f"positions must lie in range({n})")
    bits = max(2, (n - 1).bit_length())
    half = (bits + 1) // 2
    mask = _U64((1 << half) - 1)
    keys = [_U64(k) for k in _round_keys(*key)]

    def rounds(x: np.ndarray) -> np.ndarray:
        left, right = x >> _U64(half), x & mask
        for k in keys:
            left, right = right, left ^ (_mix64(right ^ k) & mask)
        return (left << _U64(half)) | right

    out = pos.astype(np.uint64)
    todo = np.arange(out.size)
    while todo.size:
        out[todo] = rounds(out[todo])
        todo = todo[out[todo] >= _U64(n)]
    return out.astype(np.int64)


def batches_per_epoch(num_samples: int, batch_size: int, world_size: int = 1) -> int:
    """Batches each rank draws per epoch: num_samples // (world_size * batch_size) (the remainder is dropped)."""
    return num_samples // (world_size * batch_size)


class IndexedBatchSampler:
    """Infinite stream of this rank's batches (lists of sample indices), starting at batch `start_batch`.

    Batch t of rank r is positions [(k * world_size + r) * B, ... + B) of epoch e = t // batches_per_epoch,
    k = t % batches_per_epoch, mapped to sample indices by the epoch's permutation (`epoch_indices`).
    `shard_sizes` + `shard_window=k > 0` select the shard-aware order (see the module doc); 0 = uniform.
    """

    def __init__(
        self, num_samples: int, batch_size: int, *, seed: int = 0, rank: int = 0, world_size: int = 1,
        start_batch: int = 0, shard_sizes: Sequence[int] | None = None, shard_window: int = 0,
    ):
        if batch_size < 1 or world_size < 1 or start_batch < 0 or shard_window < 0:
            raise ValueError(
                f"need batch_size >= 1, world_size >= 1, start_batch >= 0, shard_window >= 0 "
                f"(got {batch_size}, {world_size}, {start_batch}, {shard_window})"
            )
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        if num_samples < world_size * batch_size:
            raise ValueError(
                f"{num_samples} samples are fewer than one global batch (world_size {world_size} x batch_size "
                f"{batch_size}); use more data or a smaller batch"
            )
        if shard_window and (shard_sizes is None or sum(shard_sizes) != num_samples):
            raise ValueError("shard_window needs shard_sizes that sum to num_samples")
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.start_batch = start_batch
        self.shard_window = shard_window
        self.shard_sizes = np.asarray(shard_sizes if shard_sizes is not None else [num_samples], dtype=np.int64)
        self.shard_starts = np.concatenate([[0], np.cumsum(self.shard_sizes)])
        self.batches_per_epoch = batches_per_epoch(num_samples, batch_size, world_size)
        self._windows: tuple[int, list[np.ndarray], np.ndarray] | None = None

    def _epoch_windows(self, epoch: int) -> tuple[list[np.ndarray], np.ndarray]:
        """Shard numbers of each window (in permuted order) and the windows' first positions, for one epoch."""
        if self._windows is None or self._windows[0] != epoch:
            m = len(self.shard_sizes)
            order = feistel_permute(np.arange(m), m, "shards", self.seed, epoch)
            groups = [order[i : i + self.shard_window] for i in range(0, m, self.shard_window)]
            starts = np.concatenate([[0], np.cumsum([self.shard_sizes[g].sum() for g in groups])])
            self._windows = (epoch, groups, starts)
        return self._windows[1], self._windows[2]

    def epoch_indices(self, epoch: int, positions: np.ndarray | Sequence[int]) -> np.ndarray:
        """Sample indices at `positions` of epoch `epoch`'s order (a permutation of range(num_samples))."""
        pos = np.asarray(positions, dtype=np.int64)
        if not self.shard_window:
            return feistel_permute(pos, self.num_samples, "samples", self.seed, epoch)
        groups, starts = self._epoch_windows(epoch)
        out = np.empty_like(pos)
        window = np.searchsorted(starts, pos, side="right") - 1
        for w in np.unique(window):
            sel = window == w
            shards = groups[w]
            sizes = self.shard_sizes[shards]
            local = feistel_permute(pos[sel] - starts[w], int(sizes.sum()), "window", self.seed, epoch, int(w))
            inner = np.concatenate([[0], np.cumsum(sizes)])
            which = np.searchsorted(inner, local, side="right") - 1
            out[sel] = self.shard_starts[shards[which]] + local - inner[which]
        return out

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The whole order of one epoch (all positions, including the dropped remainder)."""
        return self.epoch_indices(epoch, np.arange(self.num_samples))

    def batch_indices(self, t: int) -> list[int]:
        """Sample indices of this rank's batch t (counted from the start of training)."""
        epoch, k = divmod(t, self.batches_per_epoch)
        first = (k * self.world_size + self.rank) * self.batch_size
        return self.epoch_indices(epoch, np.arange(first, first + self.batch_size)).tolist()

    def __iter__(self) -> Iterator[list[int]]:
        t = self.start_batch
        while True:
            yield self.batch_indices(t)
            t += 1


class BucketBatch(list):
    """A batch of sample indices from one aspect-ratio bucket; `size` = the bucket's (height, width) in pixels."""

    def __init__(self, indices: Sequence[int], size: tuple[int, int]):
        super().__init__(indices)
        self.size = (int(size[0]), int(size[1]))

    def __reduce__(self):
        return BucketBatch, (list(self), self.size)

    def __repr__(self) -> str:
        return f"BucketBatch({list(self)!r}, size={self.size})"


class BucketBatchSampler:
    """Infinite stream of this rank's single-bucket batches (`BucketBatch`), starting at batch `start_batch`.

    `bucket_ids[i]` is sample i's bucket, an index into `buckets` ((height, width) pairs). Epoch e: bucket b's
    samples (ascending sample index) are permuted by a Feistel permutation keyed (seed, e, b) and cut into
    `count_b // batch_size` full batches (the rest of that permutation is dropped for the epoch); all buckets'
    batches, numbered bucket after bucket, are permuted keyed (seed, e); global step k of the epoch is batches
    [k * world_size, (k + 1) * world_size) of that order and rank r takes the r-th. Every rank has
    `batches_per_epoch = (sum_b count_b // batch_size) // world_size` batches per epoch. Batch t is a pure function
    of (seed, t, rank, world_size, bucket_ids), computed in O(batch_size).
    """

    def __init__(
        self, bucket_ids: np.ndarray | Sequence[int], buckets: Sequence[tuple[int, int]], batch_size: int, *,
        seed: int = 0, rank: int = 0, world_size: int = 1, start_batch: int = 0,
    ):
        if batch_size < 1 or world_size < 1 or start_batch < 0:
            raise ValueError(
                f"need batch_size >= 1, world_size >= 1, start_batch >= 0 (got {batch_size}, {world_size}, "
                f"{start_batch})"
            )
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        ids = np.asarray(bucket_ids, dtype=np.int64).reshape(-1)
        self.buckets = [(int(h), int(w)) for h, w in buckets]
        if ids.size and (ids.min() < 0 or ids.max() >= len(self.buckets)):
            raise ValueError(f"bucket ids must lie in range({len(self.buckets)})")
        self.num_samples = int(ids.size)
        self.batch_size = batch_size
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.start_batch = start_batch
        index_dtype = np.int32 if self.num_samples < 2**31 else np.int64
        self.members = np.argsort(ids, kind="stable").astype(index_dtype)  # sample indices grouped by bucket
        self.counts = np.bincount(ids, minlength=len(self.buckets)).astype(np.int64)  # samples per bucket
        self.member_starts = np.concatenate([[0], np.cumsum(self.counts)])
        self.bucket_batches = self.counts // batch_size  # full batches per bucket and epoch
        self.batch_starts = np.concatenate([[0], np.cumsum(self.bucket_batches)])
        self.total_batches = int(self.batch_starts[-1])  # all ranks together, per epoch
        self.batches_per_epoch = self.total_batches // world_size
        if self.batches_per_epoch == 0:
            raise ValueError(
                f"aspect-ratio buckets give {self.total_batches} full batches of {batch_size} from {self.num_samples} "
                f"samples (per bucket: {self.describe()}), fewer than one per rank (world_size {world_size}); use "
                f"more data or a smaller batch"
            )

    @property
    def samples_per_epoch(self) -> int:
        """Samples all ranks together draw per epoch (the rest are dropped: per-bucket and per-step remainders)."""
        return self.batches_per_epoch * self.world_size * self.batch_size

    def describe(self) -> str:
        """The non-empty buckets as `HxW: count`."""
        return ", ".join(f"{h}x{w}: {int(c)}" for (h, w), c in zip(self.buckets, self.counts) if c) or "none"

    def batch_indices(self, t: int) -> BucketBatch:
        """Sample indices (and bucket size) of this rank's batch t (counted from the start of training)."""
        epoch, k = divmod(int(t), self.batches_per_epoch)
        slot = int(feistel_permute([k * self.world_size + self.rank], self.total_batches, "bucket-batches",
                                   self.seed, epoch)[0])
        b = int(np.searchsorted(self.batch_starts, slot, side="right")) - 1
        j = slot - int(self.batch_starts[b])
        pos = np.arange(j * self.batch_size, (j + 1) * self.batch_size)
        pos = feistel_permute(pos, int(self.counts[b]), "bucket-samples", self.seed, epoch, b)
        return BucketBatch(self.members[self.member_starts[b] + pos].tolist(), self.buckets[b])

    def __iter__(self) -> Iterator[BucketBatch]:
        t = self.start_batch
        while True:
            yield self.batch_indices(t)
            t += 1
