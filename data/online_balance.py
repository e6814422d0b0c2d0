"""Online balancing (data.balance=imba): the count-based prior of data.balance=temperature, moved for a few groups
of samples of like rarity by the model's own IMBA distance, and only as far as that distance tells a group apart
from the average row beyond its own noise. Distances that carry no signal leave the stream at its prior.

Prior. A sample's prior factor is the temperature factor (`data.balance.balance_factors`): c_min^(-alpha) relative
to the head, c_min the count of its rarest entry (`data.balance.caption_entries`: its concepts, attribute:object
bindings and object pairs), each sample counted at its natural draw rate.

Groups. Samples fall into `groups` bands of equal width in log c_min, band 0 the rarest (a sample without entries
counts as the most frequent entry, as in the prior). Each sample is in one band, so a scored row credits one group
and no row is counted twice; a band holds many rows per refresh where a single rare entry holds a fraction of one.

Signal. For a scored row d is its IMBA distance (the mean over its tokens of (target - unconditional prediction)^2,
the quantity the IMBA loss weights tokens by), read against the running mean distance at its noise level t:
n = d / m(bin of t), over `bins` equal bins of t in [0, 1) (10 by default, what training uses); a row at a level
with no mean yet is read against the mean over all levels, and before the first refresh rows only feed the means.

Running statistics. Per group the sum of n and the rows; over all rows the sum of n, of n^2 and the rows (their
mean n-bar and variance s^2); per level bin the sums of d and rows. Every refresh first halves all of them (a refresh's window
weighs as much as everything before it), then adds the window since the last refresh. Every quantity is an integer
in fixed point, so sums over ranks (`refresh(reduce)`) are exact whatever their order or the number of processes,
and every rank derives the same factors.

Rule, at each refresh. A group's ratio r_g = (its mean n) / n-bar and that ratio's standard error under noise,
se_g = s / sqrt(its rows) / n-bar. The spread is pooled over all rows: when the distances carry no signal every
group's rows come from the same distribution, and a small group's own spread, read from a skewed distribution, is
too often small exactly when its mean is (the halved counts make se_g conservative otherwise). Its
evidence is the part of the deviation beyond `SIGNIFICANCE` standard errors: e_g = sign(r_g - 1) ·
max(0, |r_g - 1| - SIGNIFICANCE · se_g), and 0 for a group with fewer than `MIN_ROWS` rows. Its target multiplier is
T_g = clip((1 + e_g)^rate, 1 / max_factor, max_factor) (rate 4: a group 20 % further from its unconditional
prediction than the average row, beyond the noise, is drawn about twice its prior), and its multiplier moves half
way there in log: M_g <- sqrt(M_g · T_g). A sample's factor is prior × M of its group; the loader draws each sample
in proportion to natural rate × factor within its source (sources keep their shares).

Why groups and a threshold. A rule that multiplies a weight per entry by its score at every refresh is a random
walk when the score is noise, and with a floor at the natural rate it can only drift up: fed distances with no
signal, such a rule boosted most entries. Here the multiplier is a function of the current evidence, which is 0
when the distance does not separate a group from the average row, so noise returns every group to its prior.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Callable, ClassVar, Sequence

import numpy as np

from .balance import (BalanceRule, ConceptTable, NoBalance, TemperatureBalance, balance_factors, entry_counts,
                      reduce_over_entries)

__all__ = ["FACTOR_ONE", "MIN_ROWS", "SIGNIFICANCE", "ImbaBalance", "OnlineBalance", "rarity_groups"]

FACTOR_ONE = 1 << 16  # fixed point of multipliers, factors and scores: FACTOR_ONE = 1.0
DISTANCE_ONE = 1 << 20  # fixed point of the distances summed per level bin
# standard errors a group's ratio must clear before it moves the group: 4 groups are read at every refresh, hundreds
# of refreshes a run; fed skewed noise (exponential distances), 3 was crossed in about 2 % of refreshes, 4 in none
SIGNIFICANCE = 4.0
MIN_ROWS = 16  # rows a group needs (after fading) before its mean is read
MAX_SCORE = 64  # one row's n is clipped here: a single outlier row cannot move a group far
RULE = "prior-groups"  # what a saved state was made by: states of another rule are refused
_ARRAYS = ("bin_sum", "bin_rows", "group_sum", "group_rows", "row_sum", "row_sq", "row_count")


def rarity_groups(rarest: np.ndarray, groups: int) -> np.ndarray:
    """Each sample's band (0 = rarest) among `groups` bands of equal width in log `rarest` (the counts of the
    samples' rarest entries), int64; one band when every count is the same."""
    logs = np.log(np.maximum(np.asarray(rarest, np.float64), 1e-300))
    low, high = (float(logs.min()), float(logs.max())) if logs.size else (0.0, 0.0)
    if high <= low:
        return np.zeros(logs.size, np.int64)
    return np.minimum((groups * (logs - low) / (high - low)).astype(np.int64), groups - 1)


class OnlineBalance:
    """The temperature prior of `table`'s samples and the per-group multipliers the IMBA distance sets on it (see the
    module doc). `rate`: the samples' natural draw rates, which the entry counts are taken at (default 1 each)."""

    def __init__(self, table: ConceptTable, alpha: float = 0.5, groups: int = 4, max_factor: float = 4.0,
                 bins: int = 10, rate: float = 4.0, natural: np.ndarray | None = None):
        if not (np.isfinite(max_factor) and max_factor >= 1):
            raise ValueError(f"max_factor must be >= 1 (1 = the prior), got {max_factor}")
        if not (np.isfinite(rate) and rate > 0):
            raise ValueError(f"rate must be > 0, got {rate}")
        if bins < 1 or groups < 1:
            raise ValueError(f"bins and groups must be >= 1, got {bins} and {groups}")
        self.table, self.max_factor, self.bins, self.rate = table, float(max_factor), int(bins), float(rate)
        self.alpha, self.groups = float(alpha), int(groups)
        prior = balance_factors(table, TemperatureBalance(self.alpha), natural)
        self.prior = np.rint(prior * FACTOR_ONE).astype(np.int64)  # >= FACTOR_ONE: the head's factor is 1
        counts = entry_counts(table, natural)
        head = float(counts.max()) if counts.size else 1.0
        self.rarest = reduce_over_entries(counts, table, np.minimum, empty=head)
        self.group_of = rarity_groups(self.rarest, self.groups)
        sizes = {"bin_sum": bins, "bin_rows": bins, "group_sum": groups, "group_rows": groups, "row_sum": 1,
                 "row_sq": 1, "row_count": 1}
        self.running = {k: np.zeros(n, np.int64) for k, n in sizes.items()}
        self.window = {k: np.zeros(n, np.int64) for k, n in sizes.items()}  # this process's, since the refresh
        self.weights = np.full(groups, FACTOR_ONE, np.int64)  # M_g, per group
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
        self.window["row_sq"][0] += ((score * score) >> 16).sum()  # n^2 in FACTOR_ONE units
        self.window["row_count"][0] += FACTOR_ONE * score.size
        g = self.group_of[idx]
        np.add.at(self.window["group_sum"], g, score)
        np.add.at(self.window["group_rows"], g, FACTOR_ONE)

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
        process's `window_arrays()`, e.g. an all-reduce) into the running statistics and move the multipliers."""
        window = reduce(self.window_arrays()) if reduce is not None else self.window_arrays()
        window = dict(zip(_ARRAYS, (np.asarray(a, np.int64) for a in window)))
        for k in _ARRAYS:
            self.running[k] = (self.running[k] >> 1) + window[k]
            self.window[k] = np.zeros_like(self.window[k])
        target = self.targets()
        moved = np.rint(np.sqrt(self.weights.astype(np.float64) * target))
        low, high = round(FACTOR_ONE / self.max_factor), round(FACTOR_ONE * self.max_factor)
        self.weights = np.clip(moved, low, high).astype(np.int64)
        self.refreshes += 1

    # ---- reading ----------------------------------------------------------------------------------------------
    def evidence(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per group (float): the ratio r_g, its standard error se_g and the evidence e_g (see the module doc)."""
        rows = self.running["group_rows"] / FACTOR_ONE
        count = int(self.running["row_count"][0])
        mean_all = int(self.running["row_sum"][0]) / count if count else 1.0  # n-bar
        var_all = max(int(self.running["row_sq"][0]) / count - mean_all ** 2, 0.0) if count else 0.0
        safe = np.maximum(rows, 1e-12)
        ratio = np.where(rows > 0, self.running["group_sum"] / FACTOR_ONE / safe / mean_all, 1.0)
        se = np.sqrt(var_all / safe) / mean_all
        excess = np.maximum(np.abs(ratio - 1) - SIGNIFICANCE * se, 0.0)
        evidence = np.where(rows >= MIN_ROWS, np.sign(ratio - 1) * excess, 0.0)
        return ratio, se, evidence

    def targets(self) -> np.ndarray:
        """Each group's target multiplier T_g in FACTOR_ONE units (float): (1 + e_g)^rate, within
        [1 / max_factor, max_factor]."""
        _, _, evidence = self.evidence()
        log_target = self.rate * np.log(np.maximum(1.0 + evidence, 1e-12))
        bound = np.log(self.max_factor)
        return FACTOR_ONE * np.exp(np.clip(log_target, -bound, bound))

    def sample_factors(self, weights: np.ndarray | None = None) -> np.ndarray:
        """Each sample's factor, int64 in FACTOR_ONE units: its prior times its group's multiplier (of `weights`,
        by default the current ones); at least 1."""
        weights = self.weights if weights is None else np.asarray(weights, np.int64)
        return np.maximum((self.prior * weights[self.group_of]) >> 16, 1)

    def describe(self) -> str:
        """One line: refreshes, and each rarity group's multiplier of its prior with the rarest-entry counts it
        spans."""
        parts = []
        for g in range(self.groups):
            members = self.rarest[self.group_of == g]
            if members.size:
                parts.append(f"{members.min():,.0f}-{members.max():,.0f}: {self.weights[g] / FACTOR_ONE:.2f}x")
        return (f"online balance: {self.refreshes} refreshes; draws x prior by rarest-entry count "
                + ", ".join(parts))

    # ---- checkpoint -------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"rule": RULE, "running": {k: v.copy() for k, v in self.running.items()},
                "window": {k: v.copy() for k, v in self.window.items()},
                "weights": self.weights.copy(), "refreshes": self.refreshes, "entries": len(self.table.entries),
                "entries_digest": _entries_digest(self.table.entries), "bins": self.bins, "groups": self.groups}

    def load_state_dict(self, state: dict) -> None:
        if state.get("rule") != RULE:
            raise ValueError("the online balance state was saved by the per-entry rule of an earlier version of "
                             "data.balance=imba: resume it with that version, or fine-tune from the checkpoint's "
                             "weights to start the balance afresh")
        if state["entries"] != len(self.table.entries) or state["bins"] != self.bins:
            raise ValueError(f"the online balance state was saved for {state['entries']} entries and "
                             f"{state['bins']} level bins, this run has {len(self.table.entries)} and {self.bins}: "
                             f"the captions or their concept vocabulary changed")
        if state["groups"] != self.groups:
            raise ValueError(f"the online balance state was saved for {state['groups']} rarity groups, this run has "
                             f"{self.groups} (data.balance.groups)")
        if state["entries_digest"] != _entries_digest(self.table.entries):
            raise ValueError("the online balance state was saved for other entries (other names, or numbered in "
                             "another order) than this run's: the captions or their concept vocabulary changed")
        self.running = {k: np.asarray(v, np.int64).copy() for k, v in state["running"].items()}
        self.window = {k: np.asarray(v, np.int64).copy() for k, v in state["window"].items()}
        self.refreshes = int(state["refreshes"])
        low, high = round(FACTOR_ONE / self.max_factor), round(FACTOR_ONE * self.max_factor)
        self.weights = np.clip(np.asarray(state["weights"], np.int64), low, high)  # a lowered max_factor holds


@dataclass
class ImbaBalance(BalanceRule):
    """`data.balance: {kind: imba}`: the rule of this module. The draw plan is the natural one; the run's balancer
    (`imba.training.balancing.OnlineBalancer`) draws from `build(...)`'s factors, refreshed every `every` steps."""

    KIND: ClassVar[str] = "imba"
    ONLINE: ClassVar[bool] = True
    RANGES: ClassVar[dict] = {"alpha": ">= 0", "every": ">= 1", "fraction": "in (0, 1]", "groups": ">= 1",
                              "max_factor": ">= 1 (1 = the prior)", "rate": "> 0"}
    alpha: float = 0.5  # the temperature prior's: 0 = natural, 1 = every rarest entry drawn about equally often
    every: int = 100  # steps between refreshes of the groups' multipliers
    # with the plain loss: share of each batch's rows scored by a no-grad unconditional pass (the IMBA loss scores
    # every row itself, at no extra cost)
    fraction: float = 0.125
    groups: int = 4  # bands of equal width in log(count of the rarest entry), each moved as one
    max_factor: float = 4.0  # a group is drawn between 1/max_factor and max_factor times its prior
    # a group whose distance ratio exceeds the average row's by e beyond noise targets (1 + e) ** rate its prior
    rate: float = 4.0

    def describe(self) -> str:
        return (f"balanced online by the IMBA distance (the temperature prior, alpha {self.alpha:g}, "
                f"{self.groups} rarity groups each moved within {self.max_factor:g}x of it, every {self.every} "
                f"steps)")

    def factors(self, table: ConceptTable, rate: np.ndarray | None = None) -> np.ndarray:
        return balance_factors(table, TemperatureBalance(self.alpha), rate)  # the prior, where the run starts

    def plan_rule(self) -> BalanceRule:
        return NoBalance()

    def build(self, table: ConceptTable, natural: np.ndarray | None = None) -> "OnlineBalance":
        """The online balance of `table`'s samples, their entry counts taken at the `natural` draw rates."""
        return OnlineBalance(table, alpha=self.alpha, groups=self.groups, max_factor=self.max_factor, rate=self.rate,
                             natural=natural)


def _entries_digest(entries: Sequence[str]) -> str:
    """The entry names in their order, hashed: the groups are derived from the entries' counts."""
    return hashlib.sha256("\n".join(entries).encode()).hexdigest()
