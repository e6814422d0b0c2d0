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
"""

from __future__ import annotations

import collections
from typing import Iterator, Sequence

import numpy as np

from .order import feistel_permute
from .seeds import derive_seed

__all__ = ["UNIT", "expected_draws_to_units", "WeightedOrder", "StreamBatchSampler"]

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
    scaled = exp * (total / exp.sum())
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


class WeightedOrder:
    """The stream of sample indices for integer weights `units` (see the module doc): `samples(positions)` maps
    stream positions to samples, `epoch_counts(e)` tells how often each sample is drawn in epoch e."""

    def __init__(self, units: np.ndarray | Sequence[int], samples_per_epoch: int, seed: int = 0):
        units = np.asarray(units, dtype=np.int64).reshape(-1)
        if units.size == 0 or samples_per_epoch < 1:
            raise ValueError(f"need samples and samples_per_epoch >= 1 (got {units.size}, {samples_per_epoch})")
        if units.min() < 0 or units.sum() != samples_per_epoch * UNIT:
            raise ValueError(f"units must be >= 0 and sum to samples_per_epoch * UNIT "
                             f"({samples_per_epoch} * {UNIT}); make them with expected_draws_to_units")
        self.units = units
        self.num_samples = int(units.size)
        self.samples_per_epoch = int(samples_per_epoch)
        self.seed = seed
        self._epochs: collections.OrderedDict[int, np.ndarray] = collections.OrderedDict()

    def _cumulative(self, epoch: int) -> np.ndarray:
        """C_j: the units of π_e(0..j) summed, for epoch `epoch` (cached for the last two epochs)."""
        cum = self._epochs.get(epoch)
        if cum is None:
            order = feistel_permute(np.arange(self.num_samples), self.num_samples, "weighted-draw", self.seed, epoch)
            cum = np.cumsum(self.units[order])
            self._epochs[epoch] = cum
            while len(self._epochs) > 2:
                self._epochs.popitem(last=False)
        return cum

    def _offset(self, epoch: int) -> int:
        return derive_seed("weighted-offset", self.seed, epoch) % UNIT

    def epoch_slots(self, epoch: int, slots: np.ndarray) -> np.ndarray:
        """The samples at draw slots `slots` of epoch `epoch` (slot order: samples in π_e order, repeats adjacent)."""
        points = np.asarray(slots, dtype=np.int64) * UNIT + self._offset(epoch)
        j = np.searchsorted(self._cumulative(epoch), points, side="right")
        return feistel_permute(j, self.num_samples, "weighted-draw", self.seed, epoch)

    def samples(self, positions: np.ndarray | Sequence[int]) -> np.ndarray:
        """Sample indices at stream positions `positions` (any non-negative ints)."""
        pos = np.asarray(positions, dtype=np.int64)
        out = np.empty_like(pos)
        epochs = pos // self.samples_per_epoch
        for epoch in np.unique(epochs):
            sel = epochs == epoch
            slots = feistel_permute(pos[sel] - epoch * self.samples_per_epoch, self.samples_per_epoch,
                                    "weighted-slots", self.seed, int(epoch))
            out[sel] = self.epoch_slots(int(epoch), slots)
        return out

    def epoch_counts(self, epoch: int) -> np.ndarray:
        """How many times each sample is drawn in epoch `epoch` (sums to samples_per_epoch)."""
        points = np.arange(self.samples_per_epoch, dtype=np.int64) * UNIT + self._offset(epoch)
        j = np.searchsorted(self._cumulative(epoch), points, side="right")
        sample = feistel_permute(j, self.num_samples, "weighted-draw", self.seed, epoch)
        return np.bincount(sample, minlength=self.num_samples)

    def expected_draws(self) -> np.ndarray:
        """Each sample's expected draws per epoch (float)."""
        return self.units / UNIT


class StreamBatchSampler:
    """Infinite stream of this rank's batches (lists of sample indices) from a `WeightedOrder`: batch t holds stream
    positions samples_done + (t * world_size + rank) * batch_size + [0, batch_size) (see the module doc).

    `samples_done` is what all ranks consumed together before this loader (0 for a fresh run; after a resume,
    step * grad_accum * saved_world_size * batch_size), so the stream continues exactly on any process count.
    """

    def __init__(self, order: WeightedOrder, batch_size: int, *, rank: int = 0, world_size: int = 1,
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
