"""Co-occurrence of concepts: normalised pointwise mutual information (NPMI) of the pairs of frequent concepts.

For the top-K concepts, p(a) = count_a / N, p(a, b) = count_ab / N (N = captions read) and
NPMI(a, b) = log(p(a,b) / (p(a) p(b))) / -log p(a,b), in [-1, 1]: 0 for independent concepts, 1 for concepts
that only occur together, and by convention -1 when they never co-occur (count_ab = 0) and 1 when p(a,b) = 1.
High-NPMI pairs among frequent concepts are the spurious correlations a model may learn (red <-> circle).
"""

from __future__ import annotations

import itertools
import math
from typing import Any

from .counting import ConceptStats

__all__ = ["npmi", "cooccurrence_table"]


def npmi(count_a: int, count_b: int, count_ab: int, n: int) -> float:
    """Normalised PMI of two concepts over n captions: -1 if they never co-occur, 1 if p(a,b) = 1."""
    if n <= 0 or count_a <= 0 or count_b <= 0:
        raise ValueError(f"npmi needs n > 0 and positive counts (got n={n}, count_a={count_a}, count_b={count_b})")
    if count_ab <= 0:
        return -1.0
    p_ab = count_ab / n
    if p_ab >= 1.0:
        return 1.0
    pmi = math.log(p_ab / ((count_a / n) * (count_b / n)))
    return pmi / -math.log(p_ab)


def cooccurrence_table(stats: ConceptStats, top_k: int = 50) -> list[dict[str, Any]]:
    """All pairs of the `top_k` most frequent concepts (a more frequent than b), sorted by NPMI, highest first."""
    top = [c for c, _ in stats.ranked()[:top_k]]
    rank = {c: i for i, c in enumerate(top)}
    rows = []
    for a, b in itertools.combinations(top, 2):
        ca, cb = stats.counts[a], stats.counts[b]
        cab = stats.pair_counts.get((a, b) if a < b else (b, a), 0)
        rows.append({"a": a, "b": b, "count_a": ca, "count_b": cb, "count_ab": cab,
                     "npmi": npmi(ca, cb, cab, stats.num_captions)})
    rows.sort(key=lambda r: (-r["npmi"], -r["count_ab"], rank[r["a"]], rank[r["b"]]))
    return rows
