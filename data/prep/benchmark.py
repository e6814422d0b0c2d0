"""The inert-concept composition benchmark (the IMBA paper's Inert-CompBench recipe), built from concept statistics.

Concepts (objects only, count >= min_count) are split into `num_bins` bins of equal width in log(count), bin 0 the
rarest; `per_bin` concepts are drawn from each bin; pairs of the drawn concepts are taken round-robin over the bin
pairs (rarest bin pairs first: tail x tail, tail x next, ..., head x head) until `num_pairs`; each pair gets
`captions_per_pair` prompts from distinct templates. Pairs that co-occur in any training caption (`pairs` of
concepts.json) are left out, as in the paper, whose inert pairs never appear together (`allow_cooccurring=True` /
`--allow-cooccurring` keeps them). Every random choice uses `random.Random(seed).random()` only, whose stream is
stable across Python versions, so the same stats and seed give the same prompts.
"""

from __future__ import annotations

import itertools
import math
import os
import random
from typing import Any, Mapping, Sequence

from ..concepts.stats import load_stats
from ..text import noun_phrase

__all__ = ["TEMPLATES", "log_frequency_bins", "build_benchmark"]

# `{a}` and `{b}` are filled with the concepts including their article ("an apple", `data.text.noun_phrase`).
TEMPLATES: tuple[str, ...] = (
    "a photo of {a} and {b}",
    "{a} next to {b}",
    "{a} on top of {b}",
    "{a} and {b} side by side",
    "{a} in front of {b}",
    "{a} behind {b}",
    "{a} to the left of {b}",
    "{a} beneath {b}",
    "a close-up photo of {a} beside {b}",
    "a painting of {a} with {b}",
)


def _rand_index(rng, n: int) -> int:
    return min(n - 1, int(rng.random() * n))


def _shuffled(rng, items: Sequence) -> list:
    out = list(items)
    for i in range(len(out) - 1, 0, -1):  # Fisher-Yates with random() only (stable across Python versions)
        j = _rand_index(rng, i + 1)
        out[i], out[j] = out[j], out[i]
    return out


def log_frequency_bins(counts: Mapping[str, int], num_bins: int) -> tuple[list[list[str]], list[float]]:
    """Split concepts into `num_bins` bins of equal width in log(count), bin 0 the rarest.

    Returns (bins, edges): bins[i] = concepts (most frequent first, ties alphabetical), edges = num_bins + 1
    count values bounding them (bin i holds lo_i <= count < hi_i, the last bin includes its upper edge).
    """
    if num_bins < 1:
        raise ValueError(f"num_bins must be >= 1 (got {num_bins})")
    items = sorted(((c, n) for c, n in counts.items() if n > 0), key=lambda kv: (-kv[1], kv[0]))
    if not items:
        return [[] for _ in range(num_bins)], [1.0] * (num_bins + 1)
    lo, hi = math.log(items[-1][1]), math.log(items[0][1])
    width = (hi - lo) / num_bins
    bins: list[list[str]] = [[] for _ in range(num_bins)]
    for concept, n in items:
        index = 0 if width == 0 else min(num_bins - 1, int((math.log(n) - lo) / width))
        bins[index].append(concept)
    edges = [math.exp(lo + i * width) for i in range(num_bins + 1)]
    return bins, edges


def build_benchmark(
    stats: Mapping[str, Any] | str | os.PathLike,
    per_bin: int = 5,
    num_pairs: int = 50,
    captions_per_pair: int = 4,
    seed: int = 0,
    num_bins: int = 6,
    min_count: int = 1,
    include_attributes: bool = False,
    templates: Sequence[str] = TEMPLATES,
    allow_cooccurring: bool = False,
) -> list[dict[str, Any]]:
    """Inert-concept composition prompts from concept statistics (a concepts.json path or its parsed dict).

    Returns a list of {"prompt", "concepts": [a, b], "counts", "buckets", "bins", "template"}, deterministic in
    (stats, arguments). See the module docstring for the sampling recipe. Pairs seen together in a training
    caption are left out (so fewer than `num_pairs` may come out) unless `allow_cooccurring`.
    """
    if isinstance(stats, (str, os.PathLike)):
        stats = load_stats(stats)
    together: set[frozenset] = set()
    if not allow_cooccurring:
        if "pairs" not in stats:
            raise ValueError("these concept statistics hold no pair counts (written by an older data.concepts): "
                             "rerun `python -m data.prep.concepts stats`, or allow co-occurring pairs "
                             "(--allow-cooccurring)")
        together = {frozenset((a, b)) for a, b, k in stats["pairs"] if k > 0}
    if per_bin < 1 or num_pairs < 1 or captions_per_pair < 1:
        raise ValueError("per_bin, num_pairs and captions_per_pair must be >= 1")
    if not templates or any("{a}" not in t or "{b}" not in t for t in templates):
        raise ValueError("every template needs both {a} and {b}")
    rows = {r["concept"]: r for r in stats["concepts"]}
    counts = {c: r["count"] for c, r in rows.items()
              if r["count"] >= min_count and (include_attributes or r.get("kind", "object") == "object")}
    if len(counts) < 2:
        raise ValueError(f"need at least 2 concepts with count >= {min_count} to pair (have {len(counts)})")
    bins, _ = log_frequency_bins(counts, num_bins)
    bin_of: dict[str, int] = {}
    rng = random.Random(seed)
    for index, members in enumerate(bins):
        for concept in _shuffled(rng, members)[:per_bin]:
            bin_of[concept] = index
    chosen = sorted(bin_of, key=lambda c: (bin_of[c], -counts[c], c))

    groups: dict[tuple[int, int], list[tuple[str, str]]] = {}
    for a, b in itertools.combinations(chosen, 2):
        if frozenset((a, b)) in together:
            continue
        key = tuple(sorted((bin_of[a], bin_of[b])))
        groups.setdefault(key, []).append((a, b))
    order = sorted(groups, key=lambda k: (k[0] + k[1], k[0]))
    queues = {k: _shuffled(rng, groups[k]) for k in order}
    pairs: list[tuple[str, str]] = []
    while len(pairs) < num_pairs and any(queues.values()):
        for key in order:
            if queues[key] and len(pairs) < num_pairs:
                pairs.append(queues[key].pop())

    prompts = []
    for a, b in pairs:
        picks: list[int] = []
        while len(picks) < captions_per_pair:
            picks.extend(_shuffled(rng, range(len(templates)))[: captions_per_pair - len(picks)])
        for t in picks:
            first, second = (a, b) if rng.random() < 0.5 else (b, a)
            template = templates[t]
            prompts.append({
                "prompt": template.format(a=noun_phrase(first), b=noun_phrase(second)),
                "concepts": [first, second],
                "counts": [counts[first], counts[second]],
                "buckets": [rows[first].get("bucket"), rows[second].get("bucket")],
                "bins": [bin_of[first], bin_of[second]],
                "template": template,
            })
    return prompts
