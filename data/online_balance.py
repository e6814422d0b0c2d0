"""Online balancing (data.balance=imba): sampling weights that follow the model's own IMBA distance, so the
concepts and combinations it under-serves are drawn more often, and less again once it serves them.

Signal. For a scored row (a sample of a training batch), d is its IMBA distance: the mean over its tokens of
(target − unconditional prediction)², the quantity the IMBA loss weights tokens by. d depends strongly on the noise
level t, so each row is read relative to the running mean distance at its level: n = d / m(bin of t), over `bins`
equal bins of t in [0, 1) (10 by default, what training uses). A row counts once for each of its sample's entries (`data.balance.caption_entries`: its
concepts, attribute:object bindings and object pairs). Before the first refresh rows only feed the means; a row at
a level with no mean yet is read against the mean over all levels.

Running statistics. Per entry e: S_e, the sum of the n of its rows, and C_e, their count; over all rows, the sum
of n and the count (their mean n̄); per level bin the sums of d and counts. Every refresh first halves all of them (older windows fade: a refresh's window weighs as much as
everything before it), then adds what the window since the last refresh observed. Every quantity is an integer
in fixed point, so sums over ranks (`refresh(reduce)`) are exact and do not depend on their order or the number of
processes: every rank derives the same weights.

Rule. An entry's score is its mean n relative to the average row's, shrunk towards 1 by a prior of `PRIOR_ROWS`
rows at the average: s_e = (S_e + PRIOR_ROWS · n̄) / ((C_e + PRIOR_ROWS) · n̄). Reading it relative to n̄ matters
while the loss falls: the level means come from earlier windows, so every row's n is then below 1, and only how far
an entry is from the average row tells it apart. At each refresh an entry observed in the window moves its
weight by a power of its score, w_e ← clip(w_e · s_e^rate, 1, max_factor) (rate 1/2 by default, the square
root): an entry whose rows the model
predicts worse than average without their caption (s > 1) is drawn more at every refresh until its distance comes
down to the average or its weight reaches `max_factor`; one whose distance has fallen below the average (s < 1)
gives its extra draws back, down to its natural rate (w = 1). Weights start at 1 (the natural stream), and an
entry never scored keeps 1. A sample's factor is the largest weight among its entries (1 for a sample without
entries): a rare combination of common words is boosted by its combination's entry. The loader then draws each
sample in proportion to natural rate × factor within its source (sources keep their shares), so no sample is
drawn more than `max_factor` times its natural rate relative to the unboosted ones.
"""

from __future__ import annotations

import hashlib
from typing import Callable, Sequence

import numpy as np

from .balance import ConceptTable, reduce_over_entries

__all__ = ["FACTOR_ONE", "PRIOR_ROWS", "OnlineBalance"]

FACTOR_ONE = 1 << 16  # fixed point of weights, factors and scores: FACTOR_ONE = 1.0
DISTANCE_ONE = 1 << 20  # fixed point of the distances summed per level bin
PRIOR_ROWS = 8  # rows at score 1 that every entry's mean score is shrunk with
MAX_SCORE = 64  # one row's n is clipped here: a single outlier row cannot move an entry's weight far
_ARRAYS = ("bin_sum", "bin_rows", "entry_sum", "entry_rows", "row_sum", "row_count")


class OnlineBalance:
    """The running IMBA distance per entry of `table` and the entry weights it sets (see the module doc)."""

    def __init__(self, table: ConceptTable, max_factor: float = 16.0, bins: int = 10, rate: float = 0.5):
        if not (np.isfinite(max_factor) and max_factor >= 1):
            raise ValueError(f"max_factor must be >= 1 (1 = natural), got {max_factor}")
        if not (np.isfinite(rate) and rate > 0):
            raise ValueError(f"rate must be > 0, got {rate}")
        if bins < 1:
            raise ValueError(f"bins must be >= 1, got {bins}")
        self.table, self.max_factor, self.bins, self.rate = table, float(max_factor), int(bins), float(rate)
        entries = len(table.entries)
        sizes = {"bin_sum": bins, "bin_rows": bins, "entry_sum": entries, "entry_rows": entries, "row_sum": 1,
                 "row_count": 1}
        self.running = {k: np.zeros(n, np.int64) for k, n in sizes.items()}
        self.window = {k: np.zeros(n, np.int64) for k, n in sizes.items()}  # this process's, since the refresh
        self.weights = np.full(entries, FACTOR_ONE, np.int64)
        self.refreshes = 0

    # ---- observing --------------------------------------------------------------------------------------------
    def observe(self, indices: Sequence[int], distance: Sequence[float], level: Sequence[float]) -> None:
        """Rows of sample `indices` with IMBA distances `distance` at noise levels `level` in [0, 1); rows with a
        non-finite distance (rows the loss scored no distance for) are left out."""
        idx = np.asarray(indices, np.int64).reshape(-1)
        d = np.asarray(distance, np.float64).reshape(-1)
        t = np.asarray(level, np.float64).reshape(-1)
        if not idx.shape == d.shape == t.shape:
            raise ValueError(f"{idx.size} indices, {d.size} distances and {t.size} levels: one each per row")
        keep = np.isfinite(d) & np.isfinite(t)
        idx, d, t = idx[keep], np.maximum(d[keep], 0.0), t[keep]
        if idx.size and not (0 <= idx.min() and idx.max() < len(self.table)):
            raise IndexError(f"sample index out of range for {len(self.table)} samples")
        b = np.clip((t * self.bins).astype(np.int64), 0, self.bins - 1)
        np.add.at(self.window["bin_sum"], b, np.rint(d * DISTANCE_ONE).astype(np.int64))
        np.add.at(self.window["bin_rows"], b, 1)
        all_rows = int(self.running["bin_rows"].sum())
        if not all_rows:  # before the first refresh: no level's mean yet
            return
        rows = self.running["bin_rows"][b]
        pooled = int(self.running["bin_sum"].sum()) / all_rows
        mean = np.where(rows > 0, self.running["bin_sum"][b] / np.maximum(rows, 1), pooled)  # DISTANCE_ONE units
        n = np.minimum(d * DISTANCE_ONE / np.maximum(mean, 1.0), MAX_SCORE)
        score = np.rint(n * FACTOR_ONE).astype(np.int64)
        self.window["row_sum"][0] += score.sum()
        self.window["row_count"][0] += FACTOR_ONE * score.size
        ptr = self.table.ptr
        first, lengths = ptr[idx], ptr[idx + 1] - ptr[idx]
        if lengths.sum() == 0:
            return
        # the entry ids of every kept row, laid end to end
        offsets = np.repeat(first - np.concatenate([[0], np.cumsum(lengths)[:-1]]), lengths)
        ids = self.table.ids[np.arange(lengths.sum()) + offsets]
        np.add.at(self.window["entry_sum"], ids, np.repeat(score, lengths))
        np.add.at(self.window["entry_rows"], ids, FACTOR_ONE)

    # ---- refreshing -------------------------------------------------------------------------------------------
    def window_arrays(self) -> list[np.ndarray]:
        """This process's observations since the last refresh, in the order `refresh(reduce)` sums them."""
        return [self.window[k] for k in _ARRAYS]

    def absorb(self, window: Sequence[np.ndarray]) -> None:
        """Replace this process's window by `window` (the windows of all processes summed): what a checkpoint
        stores, so that a resume on any number of processes continues from the same totals."""
        for k, a in zip(_ARRAYS, window):
            self.window[k] = np.asarray(a, np.int64).copy()

    def refresh(self, reduce: Callable[[list[np.ndarray]], list[np.ndarray]] | None = None) -> None:
        """Fold the window (summed over processes by `reduce`, which must return the element-wise sums of every
        process's `window_arrays()`, e.g. an all-reduce) into the running statistics and update the weights."""
        window = reduce(self.window_arrays()) if reduce is not None else self.window_arrays()
        window = dict(zip(_ARRAYS, (np.asarray(a, np.int64) for a in window)))
        for k in _ARRAYS:
            self.running[k] = (self.running[k] >> 1) + window[k]
            self.window[k] = np.zeros_like(self.window[k])
        seen = window["entry_rows"] > 0
        score = self.scores()[seen]
        moved = np.rint(self.weights[seen] * score ** self.rate)
        self.weights[seen] = np.clip(moved, FACTOR_ONE, round(self.max_factor * FACTOR_ONE)).astype(np.int64)
        self.refreshes += 1

    # ---- reading ----------------------------------------------------------------------------------------------
    def scores(self) -> np.ndarray:
        """Each entry's current score s_e (float; 1 for an entry never scored)."""
        rows = int(self.running["row_count"][0])
        mean = int(self.running["row_sum"][0]) / rows if rows else 1.0  # n̄
        prior = PRIOR_ROWS * FACTOR_ONE
        return (self.running["entry_sum"] + prior * mean) / ((self.running["entry_rows"] + prior) * mean)

    def sample_factors(self, weights: np.ndarray | None = None) -> np.ndarray:
        """Each sample's factor, int64 in FACTOR_ONE units: the largest weight among its entries (of `weights`, by
        default the current ones)."""
        weights = self.weights if weights is None else weights
        factors = reduce_over_entries(weights.astype(np.float64), self.table, np.maximum, empty=FACTOR_ONE)
        return factors.astype(np.int64)  # weights are integers below 2**53: exact through float64

    def describe(self, top: int = 5) -> str:
        """One line: refreshes, boosted entries, and the most boosted ones."""
        boosted = np.flatnonzero(self.weights > FACTOR_ONE)
        order = boosted[np.argsort(-self.weights[boosted], kind="stable")][:top]
        most = ", ".join(f"{self.table.entries[k]} {self.weights[k] / FACTOR_ONE:.2f}x" for k in order)
        return (f"online balance: {self.refreshes} refreshes, {boosted.size} of {len(self.weights)} entries boosted"
                + (f" (most: {most})" if most else ""))

    # ---- checkpoint -------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"running": {k: v.copy() for k, v in self.running.items()},
                "window": {k: v.copy() for k, v in self.window.items()},
                "weights": self.weights.copy(), "refreshes": self.refreshes, "entries": len(self.table.entries),
                "entries_digest": _entries_digest(self.table.entries), "bins": self.bins, "max_factor": self.max_factor}

    def load_state_dict(self, state: dict) -> None:
        if state["entries"] != len(self.table.entries) or state["bins"] != self.bins:
            raise ValueError(f"the online balance state was saved for {state['entries']} entries and "
                             f"{state['bins']} level bins, this run has {len(self.table.entries)} and {self.bins}: "
                             f"the captions or their concept vocabulary changed")
        digest = _entries_digest(self.table.entries)
        if state.get("entries_digest", digest) != digest:  # a state saved without the digest holds only the count
            raise ValueError("the online balance state was saved for other entries (other names, or numbered in "
                             "another order) than this run's: the captions or their concept vocabulary changed")
        self.running = {k: np.asarray(v, np.int64).copy() for k, v in state["running"].items()}
        self.window = {k: np.asarray(v, np.int64).copy() for k, v in state["window"].items()}
        self.weights = np.asarray(state["weights"], np.int64).copy()
        self.refreshes = int(state["refreshes"])
        self.weights = np.minimum(self.weights, round(self.max_factor * FACTOR_ONE))  # a lowered max_factor holds


def _entries_digest(entries: Sequence[str]) -> str:
    """The entry names in their order, hashed: a state's weights are indexed by entry id."""
    return hashlib.sha256("\n".join(entries).encode()).hexdigest()
