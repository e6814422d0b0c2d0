"""Concept balancing: sampling weights from the concepts the captions name, so that rare concepts and rare
combinations of common concepts are drawn more often (data.balance).

Entries. A caption's *entries* are what a sample can be rare for (`caption_entries`): each concept it names (the
concept extractor of `data.concepts`: "red", "cross", "dog"), each attribute bound to the object it describes (an
attribute followed by an object, in caption order: "red:cross"), and each pair of objects it shows together
("cross + ring", alphabetical). So "a red cross and a blue square" has the entries red, cross, blue, square,
red:cross, blue:square, "cross + square": a sample of a rare pair of common words is rare for its pair entry.

Counts. `c_e` is the number of samples with entry e, each sample counted at its natural draw rate (a sample of a
source drawn twice per epoch counts 2): how often the unbalanced stream shows e.

Weights (a sample's balance factor; its source's share of the draws is kept, see `data.draw_plan`):
- `temperature`, exponent α: factor = c_min^(-α), c_min the count of the sample's rarest entry. α = 0 is the
  natural stream; α = 1 draws the samples of each rarest entry about equally often in total (each entry's share
  ∝ c^(1-α)).
- `spread`, share k: temperature with α set from the data rather than by hand: the largest α in [0, 1] whose draws
  keep at least a share k of the natural stream's effective number of samples (the exponential of the draws'
  entropy over samples). A mild tail gets α near 1 (few samples need many repeats), a steep one a smaller α (its
  rarest samples would otherwise fill the epoch with repeats of a few images). For equal natural rates the share
  falls as α grows, so the α is found by bisection.
- `cap`, threshold t (MetaCLIP's balancing): p_e = min(1, t / c_e) and factor = 1 - Π_e (1 - p_e): a sample with
  any entry rarer than t keeps factor 1, samples whose entries are all common are drawn less, about t / c of them.
  MetaCLIP used t = 20,000 for 400M captions (their unit: captions per metadata entry).
- `by` (temperature, spread, cap): what the entries are. "captions" (the default) the above; "images" one entry per
  sample, its k-means cluster of the run's VAE latents (`data.image_clusters`), read from precomputed features, so
  no caption is read for the weights; "both" the caption entries and the cluster together (the rarest of them
  decides).
- A caption with no known entry (empty, or no concept the vocabulary knows) is weighted as if its only entry were
  the most frequent one: it is never drawn more often than the head, and never dropped.

Scale. Extraction runs over chunks of captions in `workers` processes and keeps entries as integer ids (CSR:
`ConceptTable.ptr`, `.ids`), so 10 million captions take a few hundred MB (bench/README.md#balanced-data).
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import itertools
import multiprocessing as mp
from dataclasses import dataclass, field
from typing import Callable, ClassVar, Iterable, Iterator, Sequence

import numpy as np

__all__ = ["BalanceRule", "NoBalance", "EntryRule", "TemperatureBalance", "SpreadBalance", "CapBalance", "ConceptTable",
           "caption_entries", "is_combination", "build_concept_table", "entry_counts", "reduce_over_entries",
           "balance_factors", "rarest_share", "effective_samples"]

BIND_JOIN, PAIR_JOIN = ":", " + "  # attribute:object, object + object
CHUNK = 20_000  # captions per extraction task


def caption_entries(concepts: Sequence[str], kind: Callable[[str], str]) -> list[str]:
    """The entries of a caption (see the module doc) from its concepts in caption order, every mention with its
    repeats (an extractor's `mentions`), and their kinds ("attribute" | "object")."""
    entries = list(dict.fromkeys(concepts))
    objects = []
    for here, following in itertools.zip_longest(concepts, concepts[1:]):
        if kind(here) == "object":
            objects.append(here)
        elif following is not None and kind(following) == "object":
            entries.append(f"{here}{BIND_JOIN}{following}")
    unique = sorted(set(objects))
    entries.extend(f"{a}{PAIR_JOIN}{b}" for a, b in itertools.combinations(unique, 2))
    return list(dict.fromkeys(entries))


def is_combination(entry: str) -> bool:
    """Whether an entry is a binding or a pair rather than a single concept."""
    return BIND_JOIN in entry or PAIR_JOIN in entry


@dataclass
class ConceptTable:
    """The entries of every sample: sample i's entry ids are `ids[ptr[i]:ptr[i+1]]`, names in `entries`."""

    entries: list[str]
    ptr: np.ndarray  # (N + 1,) int64
    ids: np.ndarray  # int32

    def __len__(self) -> int:
        return len(self.ptr) - 1

    def lengths(self) -> np.ndarray:
        return np.diff(self.ptr)

    def sample_entries(self, i: int) -> list[str]:
        return [self.entries[k] for k in self.ids[self.ptr[i]:self.ptr[i + 1]]]


def _extract_chunk(job: tuple[list[str], Callable]) -> tuple[list[str], np.ndarray, np.ndarray]:
    """Captions -> (local entry names, lengths, local ids): runs in worker processes."""
    captions, extractor = job
    kind = getattr(extractor, "kind", lambda concept: "object")
    mentions = getattr(extractor, "mentions", extractor)  # repeats kept: "red" binds in both "red circle", "red square"
    local: dict[str, int] = {}
    lengths = np.empty(len(captions), dtype=np.int64)
    ids: list[int] = []
    for row, caption in enumerate(captions):
        entries = caption_entries(mentions(caption), kind) if caption else []
        lengths[row] = len(entries)
        ids.extend(local.setdefault(e, len(local)) for e in entries)
    return list(local), lengths, np.asarray(ids, dtype=np.int32)


def _chunks(captions: Iterable[str], size: int) -> Iterator[list[str]]:
    it = iter(captions)
    while chunk := list(itertools.islice(it, size)):
        yield chunk


def build_concept_table(captions: Iterable[str], extractor: Callable, workers: int = 1,
                        progress: bool = False) -> ConceptTable:
    """The entries of each caption, in order ("" for a sample without a caption), in `workers` processes."""
    names: dict[str, int] = {}
    lengths: list[np.ndarray] = []
    ids: list[np.ndarray] = []

    def merge(part: tuple[list[str], np.ndarray, np.ndarray]) -> None:
        local, n, local_ids = part
        remap = np.asarray([names.setdefault(e, len(names)) for e in local], dtype=np.int32)
        lengths.append(n)
        ids.append(remap[local_ids] if local_ids.size else local_ids)
        if bar is not None:
            bar.update(len(n))

    jobs = ((chunk, extractor) for chunk in _chunks(captions, CHUNK))
    with contextlib.ExitStack() as stack:
        # the pool forks its workers before the bar starts its monitor thread: a fork must not copy a thread's locks
        pool = None
        if workers > 1:
            context = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
            pool = stack.enter_context(context.Pool(workers))
        bar = None
        if progress:
            from tqdm import tqdm

            bar = stack.enter_context(tqdm(desc="concepts", unit=" captions", unit_scale=True, mininterval=1.0,
                                           dynamic_ncols=True))
        for part in pool.imap(_extract_chunk, jobs) if pool is not None else map(_extract_chunk, jobs):
            merge(part)
        if pool is not None:
            pool.close()
            pool.join()
    n = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
    ptr = np.concatenate([[0], np.cumsum(n)]).astype(np.int64)
    flat = np.concatenate(ids) if ids else np.zeros(0, np.int32)
    return ConceptTable(list(names), ptr, flat.astype(np.int32))


def entry_counts(table: ConceptTable, rate: np.ndarray | None = None) -> np.ndarray:
    """c_e: samples with entry e, each counted at its natural draw rate `rate` (default 1). The rate is constant
    over long runs of samples (a source's), so each run is counted at once, without a weight per entry."""
    counts = np.zeros(len(table.entries))
    if rate is None:
        rate, bounds = np.ones(1), np.array([0, len(table)])
    else:
        rate = np.asarray(rate, dtype=np.float64)
        bounds = np.concatenate([[0], np.flatnonzero(np.diff(rate)) + 1, [len(rate)]])
    for a, b in zip(bounds[:-1], bounds[1:]):
        counts += rate[a] * np.bincount(table.ids[table.ptr[a]:table.ptr[b]], minlength=len(table.entries))
    return counts


ROWS_AT_ONCE = 1 << 20  # samples whose entries are gathered at once: bounds the memory of the reductions


def reduce_over_entries(values: np.ndarray, table: ConceptTable, ufunc: np.ufunc, empty: float) -> np.ndarray:
    """ufunc.reduce of values[entry id] over each sample's entries (float64); `empty` for samples without any."""
    out = np.full(len(table), empty, dtype=np.float64)
    for a in range(0, len(table), ROWS_AT_ONCE):
        b = min(a + ROWS_AT_ONCE, len(table))
        ptr = table.ptr[a:b + 1]
        has = np.diff(ptr) > 0
        if has.any():
            gathered = values[table.ids[ptr[0]:ptr[-1]]]
            out[a:b][has] = ufunc.reduceat(gathered, (ptr[:-1] - ptr[0])[has])
    return out


@dataclass
class BalanceRule(abc.ABC):
    """A `data.balance` rule: how each sample's balance factor is set from its captions' entries. A rule is one
    registered kind (`data.settings.BALANCE_RULES`); its dataclass fields are its settings, written in a config as
    `data.balance: {kind: KIND, field: value}`. RANGES bounds its numeric settings as a config section's do. A rule
    without its own `describe` or `factors` cannot be made (TypeError), so none borrows another's line."""

    KIND: ClassVar[str] = ""
    CHOICES: ClassVar[dict] = {}
    RANGES: ClassVar[dict] = {}
    ONLINE: ClassVar[bool] = False  # its factors move as the run goes (`plan_rule` is the rule its plan starts from)
    READS_CAPTIONS: ClassVar[bool] = True  # its factors come from the captions' entries (the plan reads them)

    @abc.abstractmethod
    def describe(self) -> str:
        """The rule and its settings in one line, as the start-up log and the model card print it ("" for none)."""

    def check(self) -> None:
        """A one-line ValueError for settings that cannot be used together."""

    @abc.abstractmethod
    def factors(self, table: ConceptTable, rate: np.ndarray | None = None) -> np.ndarray:
        """Each sample's balance factor (relative; see the module doc), float64, > 0 for every sample."""

    def plan_rule(self) -> "BalanceRule":
        """The rule the run's draw plan is made with (an online rule starts from the natural plan)."""
        return self

    def settings(self) -> dict:
        """Its kind and settings as data: what a draw plan's fingerprint records, so no setting can be left out."""
        return {"kind": self.KIND, **dataclasses.asdict(self)}

    def found(self) -> dict:
        """What the data gave the rule when its factors ran (not a setting): the draw plan stores it, so a run that
        reads the plan back describes the rule as the run that made it did."""
        return {}

    def restore(self, found: dict) -> None:
        """Take back what `found` returned when the plan was made."""


@dataclass
class NoBalance(BalanceRule):
    """The natural stream: every sample drawn at its source's rate."""

    KIND: ClassVar[str] = "none"
    READS_CAPTIONS: ClassVar[bool] = False

    def describe(self) -> str:
        return ""

    def factors(self, table: ConceptTable, rate: np.ndarray | None = None) -> np.ndarray:
        return np.ones(len(table))


BY = ("captions", "images", "both")


@dataclass
class EntryRule(BalanceRule):
    """An offline rule over each sample's entries, which `by` says where they come from (see the module doc)."""

    CHOICES: ClassVar[dict] = {"by": BY}
    by: str = field(default="captions", kw_only=True)

    @property
    def reads_images(self) -> bool:
        """Whether its entries include each sample's image cluster (the plan then needs the samples' latents)."""
        return self.by != "captions"

    def settings(self) -> dict:
        # the default is left out: the plans of runs made before `by` existed keep their fingerprints
        out = super().settings()
        if self.by == "captions":
            del out["by"]
        return out

    def balanced_by(self) -> str:
        """What its describe line says the samples are balanced by."""
        return {"captions": "concepts", "images": "image clusters", "both": "concepts and image clusters"}[self.by]


@dataclass
class TemperatureBalance(EntryRule):
    """factor = c_min^(-alpha), relative to the head (see the module doc)."""

    KIND: ClassVar[str] = "temperature"
    RANGES: ClassVar[dict] = {"alpha": ">= 0 (0 = natural, 1 = each rarest entry drawn about equally often)"}
    alpha: float = 0.5

    def describe(self) -> str:
        return f"balanced by {self.balanced_by()} (temperature, alpha {self.alpha:g})"

    def check(self) -> None:
        if not (np.isfinite(self.alpha) and self.alpha >= 0):
            raise ValueError(f"data.balance.alpha must be >= 0 (0 = natural, 1 = fully balanced), got {self.alpha}")

    def factors(self, table: ConceptTable, rate: np.ndarray | None = None) -> np.ndarray:
        return np.power(rarest_share(table, rate), -self.alpha)  # relative to the head: 1 for it, > 1 for rarer ones


def rarest_share(table: ConceptTable, rate: np.ndarray | None = None) -> np.ndarray:
    """Per sample, c_min / c_head: its rarest entry's count relative to the most frequent entry's (1 for a sample
    without entries)."""
    counts = entry_counts(table, rate)
    head = float(counts.max()) if counts.size else 1.0
    return reduce_over_entries(counts, table, np.minimum, empty=head) / head


def effective_samples(draws: np.ndarray) -> float:
    """exp(entropy) of the draw distribution ∝ `draws` over samples: N for uniform draws, 1 for one sample."""
    p = draws[draws > 0] / draws.sum()
    return float(np.exp(-(p * np.log(p)).sum()))


@dataclass
class SpreadBalance(EntryRule):
    """Temperature at the largest alpha in [0, 1] that keeps a share `keep` of the natural stream's effective
    samples (see the module doc); `alpha` of the last `factors` call (or of the stored plan) is kept for the log and
    the card."""

    KIND: ClassVar[str] = "spread"
    RANGES: ClassVar[dict] = {"keep": "in (0, 1] (1 = natural)"}
    keep: float = 0.6  # the share chosen on the composition benchmark's development worlds (bench/README.md)
    ITERATIONS: ClassVar[int] = 30  # bisection steps: alpha to 1e-9

    def __post_init__(self) -> None:
        self.alpha: float | None = None  # not a setting: what the data gave, once factors ran

    def describe(self) -> str:
        found = f", alpha {self.alpha:.3g}" if self.alpha is not None else ""
        return (f"balanced by {self.balanced_by()} (temperature{found}, set to keep {self.keep:.0%} of the effective "
                "samples)")

    def check(self) -> None:
        if not (np.isfinite(self.keep) and 0 < self.keep <= 1):
            raise ValueError(f"data.balance.keep must be in (0, 1] (the share of the natural stream's effective "
                             f"samples the balanced draws keep; 1 = natural), got {self.keep}")

    def factors(self, table: ConceptTable, rate: np.ndarray | None = None) -> np.ndarray:
        natural = np.ones(len(table)) if rate is None else np.asarray(rate, dtype=np.float64)
        log_boost = -np.log(rarest_share(table, rate))
        goal = self.keep * effective_samples(natural)

        def spread(alpha: float) -> float:
            return effective_samples(natural * np.exp(alpha * (log_boost - log_boost.max())))

        low, high = 0.0, 1.0
        if self.keep == 1:  # the natural stream itself (no alpha > 0 keeps every effective sample)
            high = low
        elif spread(high) >= goal:
            low = high
        else:
            for _ in range(self.ITERATIONS):
                mid = (low + high) / 2
                low, high = (mid, high) if spread(mid) >= goal else (low, mid)
        self.alpha = low
        return np.exp(low * log_boost)

    def found(self) -> dict:
        return {} if self.alpha is None else {"alpha": self.alpha}

    def restore(self, found: dict) -> None:
        self.alpha = found.get("alpha")


@dataclass
class CapBalance(EntryRule):
    """MetaCLIP's rule: factor = 1 - prod_e (1 - min(1, cap / c_e)) (see the module doc)."""

    KIND: ClassVar[str] = "cap"
    RANGES: ClassVar[dict] = {"cap": ">= 1 (MetaCLIP: 20000 for 400M captions)"}
    cap: int = 0  # the threshold t, in samples: no default, a run sets it (0 = not set)

    def describe(self) -> str:
        return f"balanced by {self.balanced_by()} (cap {self.cap})"

    def check(self) -> None:
        if self.cap < 1:
            raise ValueError("data.balance kind cap needs data.balance.cap=T >= 1: entries in more than T samples "
                             "are drawn less (MetaCLIP used 20000 for 400M captions)")

    def factors(self, table: ConceptTable, rate: np.ndarray | None = None) -> np.ndarray:
        counts = entry_counts(table, rate)
        head = float(counts.max()) if counts.size else 1.0
        keep = np.minimum(1.0, self.cap / np.maximum(counts, 1e-300))
        log_miss = np.log1p(-np.minimum(keep, 1.0 - 1e-16))  # log(1 - p_e); p_e = 1 counts as certain
        with np.errstate(divide="ignore"):  # a cap at or above the head: p = 1, log(1 - p) = -inf, the factor 1
            log_miss_head = np.log1p(-min(1.0, self.cap / head))
        missed = reduce_over_entries(log_miss, table, np.add, empty=log_miss_head)
        return -np.expm1(missed)


def balance_factors(table: ConceptTable, rule: BalanceRule, rate: np.ndarray | None = None) -> np.ndarray:
    """Each sample's balance factor under `rule` (relative; see the module doc), float64, > 0 for every sample."""
    rule.check()
    return rule.factors(table, rate)
