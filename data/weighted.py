"""Weighted sampling: samples drawn in proportion to weights (a mix of sources, concept balancing), as one global
stream that is a pure function of (seed, position), the same for any number of processes.

Weights. Sample i's weight is a whole number of *units*, `units[i]`; an epoch is `samples_per_epoch` (S) draws and
a sample is drawn `S * units[i] / sum(units)` times per epoch on average (its *expected draws*). Integer units keep
the arithmetic exact: every rank derives the same draws from the same stored array, on any machine (float sums
could differ in the last bit). `expected_draws_to_units` makes them from float expected draws.

The draw of an epoch (fractional weights become whole draws, no rejection). Epoch e visits the samples in a keyed
permutation π_e (the Feistel permutation of `data.order`) and lays their units end to end: sample π_e(j) owns the
interval [C_{j-1}, C_j) of the cumulative sums C. Draw slot q (0 <= q < S) falls at q * UNIT + u_e, with one offset
u_e in [0, UNIT) per epoch, and takes the sample whose interval holds that point: systematic sampling. So each
sample is drawn floor or ceil of its expected draws (a sample of expected draws 2.3 is drawn 2 or 3 times; one of
0.3, 0 or 1 time), the epoch has exactly S draws, and which samples round up changes from epoch to epoch with π_e
and u_e. Over many epochs every sample's draws average its expected draws.

The order of an epoch. Epoch position p reads slot q = σ_e(p), another keyed permutation of range(S), so the
repeats of a sample are spread over the epoch. Position p of the whole stream is (epoch p // S, p % S): epochs
are not cut to a whole number of batches, so nothing is dropped and the stream does not depend on the batch size
or the process count.

Processes. Global batch k is stream positions [k * W * B, (k + 1) * W * B) for W processes of batch size B; rank
r takes the r-th slice of B. A loader started at `samples_done` (the samples all ranks consumed together before a
checkpoint) continues the same stream on any W: resuming 2 processes' checkpoint on 1 gives the batches the
uninterrupted 2-process run would have drawn, concatenated. Batch t costs O(B log N) (a binary search per draw);
an epoch's first batch also builds that epoch's cumulative sums, O(N) time and 8 bytes per sample (kept for two
epochs, since a batch may straddle them).

Shard windows (`shard_sizes`, `window=k > 0`), for shards read through a cache smaller than the set: π_e is made
of windows instead of one permutation: the shards are shuffled and cut into groups of k, each group's samples are
shuffled among themselves, and the groups follow one another. A window owns the draw slots whose points fall in its
samples' units, and σ_e permutes slots within each window only, so the epoch reads window after window, at most k
shards at a time. Each sample is still drawn the floor or ceiling of its expected draws; only the order is local.

Aspect-ratio buckets (`WeightedBucketSampler`): each bucket draws its share of the epoch from its own weighted
order, and single-bucket batches of all buckets are shuffled together, as `data.order.BucketBatchSampler` does
for the uniform order; a bucket whose share of an epoch is less than one batch is not drawn.
"""

from __future__ import annotations

import collections
from typing import Iterator, Sequence

import numpy as np

from .order import BucketBatch, feistel_permute
from .seeds import derive_seed

__all__ = ["UNIT", "expected_draws_to_units", "reweighted_units", "WeightedOrder", "SegmentedOrder", "StreamBatchSampler",
           "WeightedBucketSampler"]

UNIT = 1 << 20  # units per expected draw: weights are exact to ~1e-6 of a draw


def expected_draws_to_units(expected: np.ndarray | Sequence[float], samples_per_epoch: int) -> np.ndarray:
    """int64 units (UNIT per expected draw) summing to exactly `samples_per_epoch * UNIT`, from float expected
    draws per epoch (rescaled to sum to `samples_per_epoch`). Each sample gets the floor of its share; the few units
    the floors leave over go one each to the samples with the largest remainders (ties: lower index)."""
    exp = np.asarray(expected, dtype=np.float64).reshape(-1)
    if exp.size == 0 or samples_per_epoch < 1:
        raise ValueError(f"need samples and samples_per_epoch >= 1 (got {exp.size} samples, {samples_per_epoch})")
    if not np.all(np.isfinite(exp)) or exp.min() < 0 or exp.sum() <= 0:
        raise ValueError("expected draws must be finite, >= 0 and not all 0")
    total = samples_per_epoch * UNIT
    return _round_to_total(exp * (total / exp.sum()), total)


def _round_to_total(scaled: np.ndarray, total: int) -> np.ndarray:
    """int64 floors of `scaled` (>= 0, summing to about `total`), the units they leave over given one each to the
    largest remainders (ties: lower index), so they sum to exactly `total`."""
    units = np.floor(scaled).astype(np.int64)
    short = int(total - units.sum())
    if short > 0:  # floors lose < 1 unit each, so 0 <= short < N
        remainder = scaled - units
        top = np.argsort(-remainder, kind="stable")[:short]
        units[top] += 1
    elif short < 0:  # float rounding of `scaled` upwards; take units back from the largest
        top = np.argsort(-units, kind="stable")[: -short]
        units[top] -= 1
    return units


def reweighted_units(units: np.ndarray, factors: np.ndarray, starts: Sequence[int]) -> np.ndarray:
    """`units` re-spread within each group (group k: samples starts[k] to starts[k+1], e.g. the sources) in
    proportion to the integer `factors`, each group keeping its total. Exact integer sums and one division per group:
    every machine derives the same units from the same factors."""
    units = np.asarray(units, np.int64)
    factors = np.asarray(factors, np.int64)
    if factors.shape != units.shape or (factors.size and factors.min() < 1):
        raise ValueError(f"need one factor >= 1 per sample ({factors.size} factors for {units.size} samples)")
    out = np.zeros_like(units)
    for a, b in zip(starts[:-1], starts[1:]):
        total = int(units[a:b].sum())
        if total:
            out[a:b] = _round_to_total(factors[a:b] * (total / int(factors[a:b].sum())), total)
    return out


class WeightedOrder:
    """The stream of sample indices for integer weights `units` (see the module doc): `samples(positions)` maps
    stream positions to samples, `epoch_counts(e)` tells how often each sample is drawn in epoch e."""

    def __init__(self, units: np.ndarray | Sequence[int], samples_per_epoch: int, seed: int = 0,
                 shard_sizes: Sequence[int] | None = None, window: int = 0):
        units = np.asarray(units, dtype=np.int64).reshape(-1)
        if units.size == 0 or samples_per_epoch < 1:
            raise ValueError(f"need samples and samples_per_epoch >= 1 (got {units.size}, {samples_per_epoch})")
        if units.min() < 0 or units.sum() != samples_per_epoch * UNIT:
            raise ValueError(f"units must be >= 0 and sum to samples_per_epoch * UNIT "
                             f"({samples_per_epoch} * {UNIT}); make them with expected_draws_to_units")
        if window < 0 or (window and (shard_sizes is None or sum(shard_sizes) != units.size)):
            raise ValueError(f"a shard window needs window >= 0 and shard sizes that sum to the {units.size} samples")
        self.units = units
        self.num_samples = int(units.size)
        self.samples_per_epoch = int(samples_per_epoch)
        self.seed = seed
        self.window = int(window)
        self.shard_starts = None if not window else np.concatenate([[0], np.cumsum(shard_sizes, dtype=np.int64)])
        self._epochs: collections.OrderedDict[int, tuple] = collections.OrderedDict()

    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
        """(C, π_e as an array, the windows' first slots) of epoch `epoch`: C_j is the units of π_e(0..j) summed;
        the array and the slots exist with a shard window only (cached for the last two epochs)."""
        found = self._epochs.get(epoch)
        if found is None:
            if self.window:
                order, starts = self._windowed_permutation(epoch)
                found = (np.cumsum(self.units[order]), order, starts)
            else:
                order = feistel_permute(np.arange(self.num_samples), self.num_samples, "weighted-draw", self.seed,
                                        epoch)
                found = (np.cumsum(self.units[order]), None, None)
            self._epochs[epoch] = found
            while len(self._epochs) > 2:
                self._epochs.popitem(last=False)
        return found

    def _windowed_permutation(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """π_e with a shard window: the shards shuffled and cut into windows of `window` shards; each window's
        samples shuffled among themselves; the windows one after the other. With it, the first draw slot of each
        window (and S at the end)."""
        starts = self.shard_starts
        shards = feistel_permute(np.arange(len(starts) - 1), len(starts) - 1, "weighted-shards", self.seed, epoch)
        parts, ends = [], []
        for w, first in enumerate(range(0, len(shards), self.window)):
            members = np.concatenate([np.arange(starts[s], starts[s + 1]) for s in shards[first:first + self.window]])
            parts.append(members[feistel_permute(np.arange(members.size), members.size, "weighted-window", self.seed,
                                                 epoch, w)])
            ends.append(sum(p.size for p in parts))
        order = np.concatenate(parts)
        # window w owns the draw slots q whose point q * UNIT + u_e falls in its units: [first[w], first[w + 1])
        edges = np.cumsum(self.units[order])[np.asarray(ends) - 1]
        # a ceiling, within [0, S]: 0 <= u_e < UNIT, and the last window's edge is S * UNIT
        first = -(-(edges - self._offset(epoch)) // UNIT)
        return order, np.concatenate([[0], first])

    def _cumulative(self, epoch: int) -> np.ndarray:
        return self._epoch(epoch)[0]

    def _sample(self, epoch: int, j: np.ndarray) -> np.ndarray:
        """π_e(j): the sample at place j of epoch `epoch`'s permutation."""
        order = self._epoch(epoch)[1]
        return feistel_permute(j, self.num_samples, "weighted-draw", self.seed, epoch) if order is None else order[j]

    def _offset(self, epoch: int) -> int:
        return derive_seed("weighted-offset", self.seed, epoch) % UNIT

    def epoch_slots(self, epoch: int, slots: np.ndarray) -> np.ndarray:
        """The samples at draw slots `slots` of epoch `epoch` (slot order: samples in π_e order, repeats adjacent)."""
        points = np.asarray(slots, dtype=np.int64) * UNIT + self._offset(epoch)
        return self._sample(epoch, np.searchsorted(self._cumulative(epoch), points, side="right"))

    def _slots(self, epoch: int, places: np.ndarray) -> np.ndarray:
        """σ_e(places): which draw slot each place of the epoch reads. Without a window one permutation of all S
        slots; with one, each window's slots are permuted among themselves and read window after window."""
        if not self.window:
            return feistel_permute(places, self.samples_per_epoch, "weighted-slots", self.seed, epoch)
        starts = self._epoch(epoch)[2]
        window = np.searchsorted(starts, places, side="right") - 1
        out = np.empty_like(places)
        for w in np.unique(window):
            sel = window == w
            a, b = int(starts[w]), int(starts[w + 1])
            out[sel] = a + feistel_permute(places[sel] - a, b - a, "weighted-window-slots", self.seed, epoch, int(w))
        return out

    def samples(self, positions: np.ndarray | Sequence[int]) -> np.ndarray:
        """Sample indices at stream positions `positions` (any non-negative ints)."""
        pos = np.asarray(positions, dtype=np.int64)
        out = np.empty_like(pos)
        epochs = pos // self.samples_per_epoch
        for epoch in np.unique(epochs):
            sel = epochs == epoch
            slots = self._slots(int(epoch), pos[sel] - epoch * self.samples_per_epoch)
            out[sel] = self.epoch_slots(int(epoch), slots)
        return out

    def epoch_counts(self, epoch: int) -> np.ndarray:
        """How many times each sample is drawn in epoch `epoch` (sums to samples_per_epoch)."""
        return np.bincount(self.epoch_slots(epoch, np.arange(self.samples_per_epoch, dtype=np.int64)),
                           minlength=self.num_samples)

    def expected_draws(self) -> np.ndarray:
        """Each sample's expected draws per epoch (float)."""
        return self.units / UNIT


class SegmentedOrder:
    """A weighted stream whose weights change at stream positions (online balancing): segment k draws the positions
    from its start to the next segment's start by its own `WeightedOrder` (its units, keyed by the seed and its start
    position), so the stream stays a pure function of (seed, the segments, position) on any process count.

    `known_until`: the first position whose weights are not decided yet (None: no limit). Asking for it is a
    RuntimeError rather than a silent draw by outdated weights: whoever adds segments must keep it ahead of what the
    loader prefetches.
    """

    def __init__(self, units: np.ndarray | Sequence[int], samples_per_epoch: int, seed: int = 0):
        self.samples_per_epoch, self.seed = int(samples_per_epoch), seed
        self.segments: list[tuple[int, WeightedOrder]] = [(0, WeightedOrder(units, samples_per_epoch, seed))]
        self.num_samples = self.segments[0][1].num_samples
        self.known_until: int | None = None
        self._lowest = 0  # the first position of the latest request: segments that end before it are dropped

    def add(self, start: int, units: np.ndarray | Sequence[int]) -> None:
        """Draw positions from `start` on by `units` (a segment that started at or after `start` is replaced)."""
        if start < 0:
            raise ValueError(f"a segment cannot start at position {start}")
        order = WeightedOrder(units, self.samples_per_epoch, derive_seed("weighted-segment", self.seed, start))
        if order.num_samples != self.num_samples:
            raise ValueError(f"a segment of {order.num_samples} samples in a stream of {self.num_samples}")
        self.segments = [s for s in self.segments if s[0] < start] + [(start, order)]
        while len(self.segments) > 1 and self.segments[1][0] <= self._lowest:
            self.segments.pop(0)

    def samples(self, positions: np.ndarray | Sequence[int]) -> np.ndarray:
        """Sample indices at stream positions `positions` (as `WeightedOrder.samples`)."""
        pos = np.asarray(positions, dtype=np.int64)
        if pos.size and self.known_until is not None and pos.max() >= self.known_until:
            raise RuntimeError(f"stream position {int(pos.max())} is past {self.known_until}, the last position whose "
                               "weights are decided: the weights are refreshed too late for how far the loader reads "
                               "ahead")
        if pos.size:
            self._lowest = max(self._lowest, int(pos.min()))
        out = np.empty_like(pos)
        starts = [s for s, _ in self.segments]
        which = np.searchsorted(starts, pos, side="right") - 1
        if pos.size and which.min() < 0:
            raise ValueError(f"position {int(pos.min())} is before the stream's first segment ({starts[0]})")
        for k in np.unique(which):
            sel = which == k
            out[sel] = self.segments[k][1].samples(pos[sel])
        return out


class StreamBatchSampler:
    """Infinite stream of this rank's batches (lists of sample indices) from a `WeightedOrder`: batch t holds stream
    positions samples_done + (t * world_size + rank) * batch_size + [0, batch_size) (see the module doc).

    `samples_done` is what all ranks consumed together before this loader (0 for a fresh run; after a resume,
    step * grad_accum * saved_world_size * batch_size), so the stream continues exactly on any process count.
    """

    def __init__(self, order: WeightedOrder | SegmentedOrder, batch_size: int, *, rank: int = 0, world_size: int = 1,
                 samples_done: int = 0):
        if batch_size < 1 or world_size < 1 or samples_done < 0:
            raise ValueError(f"need batch_size >= 1, world_size >= 1, samples_done >= 0 (got {batch_size}, "
                             f"{world_size}, {samples_done})")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        self.order = order
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.samples_done = samples_done
        self.num_samples = order.num_samples
        self.seed = order.seed
        self.start_batch = 0  # batches are counted from samples_done
        # per rank; an epoch is not cut to whole batches, so this is the average, rounded down
        self.batches_per_epoch = max(1, order.samples_per_epoch // (world_size * batch_size))

    def batch_indices(self, t: int) -> list[int]:
        """Sample indices of this rank's batch t (counted from `samples_done`)."""
        first = self.samples_done + (t * self.world_size + self.rank) * self.batch_size
        return self.order.samples(np.arange(first, first + self.batch_size)).tolist()

    def __iter__(self) -> Iterator[list[int]]:
        t = 0
        while True:
            yield self.batch_indices(t)
            t += 1


class WeightedBucketSampler:
    """Infinite stream of this rank's single-bucket batches (`data.order.BucketBatch`) drawn by weight: aspect-ratio
    buckets (`data.buckets`) over the same plan as `StreamBatchSampler`.

    Bucket b gets S_b of the epoch's S draws, in proportion to its samples' units (largest remainders), and draws
    them by its own `WeightedOrder` (its samples' units rescaled to S_b). Per epoch each bucket's draws are cut into
    S_b // batch_size batches (the rest of that epoch's order is dropped, a different part each epoch); the batches
    of all buckets are permuted together (keyed by seed and epoch) into the epoch's global batches. Global batch g
    of the stream is rank (g % world_size)'s batch g // world_size; a sampler started at `samples_done` (a multiple
    of batch_size: what all ranks consumed) continues the same global batches on any process count.
    """

    def __init__(self, units: np.ndarray | Sequence[int], samples_per_epoch: int, bucket_ids: np.ndarray,
                 buckets: Sequence[tuple[int, int]], batch_size: int, *, seed: int = 0, rank: int = 0,
                 world_size: int = 1, samples_done: int = 0):
        if batch_size < 1 or world_size < 1 or samples_done < 0 or samples_done % batch_size:
            raise ValueError(f"need batch_size >= 1, world_size >= 1 and samples_done a multiple of the batch size "
                             f"(got {batch_size}, {world_size}, {samples_done})")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        units = np.asarray(units, dtype=np.int64)
        ids = np.asarray(bucket_ids, dtype=np.int64).reshape(-1)
        if ids.shape != units.shape:
            raise ValueError(f"{ids.size} bucket ids for {units.size} samples")
        self.buckets = [(int(h), int(w)) for h, w in buckets]
        self.batch_size, self.rank, self.world_size, self.seed = batch_size, rank, world_size, seed
        self.samples_done, self.start_batch, self.num_samples = samples_done, 0, int(units.size)
        totals = np.bincount(ids, weights=units, minlength=len(self.buckets))  # float: exact below 2**53 units
        share = totals / totals.sum() * samples_per_epoch
        draws = np.floor(share).astype(np.int64)
        draws[np.argsort(-(share - draws), kind="stable")[: samples_per_epoch - int(draws.sum())]] += 1
        self.members, self.orders = [], []
        for b in range(len(self.buckets)):
            members = np.flatnonzero(ids == b)
            self.members.append(members)
            self.orders.append(WeightedOrder(expected_draws_to_units(units[members], int(draws[b])), int(draws[b]),
                                             seed=derive_seed("bucket-order", seed, b))
                               if draws[b] >= batch_size else None)
        self.bucket_batches = np.asarray([d // batch_size if o is not None else 0
                                          for d, o in zip(draws, self.orders)], np.int64)
        self.batch_starts = np.concatenate([[0], np.cumsum(self.bucket_batches)])
        self.total_batches = int(self.batch_starts[-1])
        if self.total_batches < 1:
            raise ValueError(f"no aspect-ratio bucket gets a full batch of {batch_size} of the epoch's "
                             f"{samples_per_epoch} draws; use a smaller batch or a longer epoch (data.epoch_samples)")
        self.draws_per_bucket = draws
        self.batches_per_epoch = max(1, self.total_batches // world_size)

    def describe(self) -> str:
        """The buckets that draw batches, as `HxW: draws per epoch`."""
        return ", ".join(f"{h}x{w}: {int(d)}" for (h, w), d, n in zip(self.buckets, self.draws_per_bucket,
                                                                        self.bucket_batches) if n) or "none"

    def batch_indices(self, t: int) -> BucketBatch:
        """This rank's batch t (counted from `samples_done`): sample indices and the bucket's (height, width)."""
        g = self.samples_done // self.batch_size + t * self.world_size + self.rank
        epoch, k = divmod(g, self.total_batches)
        slot = int(feistel_permute([k], self.total_batches, "weighted-bucket-batches", self.seed, epoch)[0])
        b = int(np.searchsorted(self.batch_starts, slot, side="right")) - 1
        j = slot - int(self.batch_starts[b])
        order = self.orders[b]
        first = epoch * order.samples_per_epoch + j * self.batch_size
        local = order.samples(np.arange(first, first + self.batch_size))
        return BucketBatch(self.members[b][local].tolist(), self.buckets[b])

    def __iter__(self) -> Iterator[BucketBatch]:
        t = 0
        while True:
            yield self.batch_indices(t)
            t += 1
