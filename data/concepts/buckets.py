"""Head / torso / tail buckets of concepts, and the buckets a caption touches.

Default, `method="share"`: order the concepts by count and accumulate their share of all concept occurrences (the
sum of all counts). A concept is
    head  if the concepts strictly more frequent than it hold less than `head_share` (0.5) of the occurrences,
    torso if they hold less than `head_share + torso_share` (0.5 + 0.3 = 0.8),
    tail  otherwise.
So head = the most frequent concepts that together make up the first 50 % of occurrences (the concept that
crosses the line is head), torso = the next 30 %, tail = the last 20 %; concepts with equal counts always share
a bucket, which makes the split independent of ordering and input order. The split is monotone in the count, so
it is equivalently given by two count thresholds, recorded in concepts.json: head if count >= head_min_count,
torso if count >= torso_min_count, else tail; `assign_buckets(counts, thresholds=...)` applies recorded ones.
Why shares and not quantiles of the concept list or absolute counts: a concept-list quantile moves when the
vocabulary gains or loses rare entries (and with a Zipf law nearly all concepts land in the tail), and absolute
counts depend on the data set size; a share of occurrences does neither, and it says what the training monitor
needs: head concepts are what half of the caption signal is about. `method="count"` (LVIS-like absolute
thresholds: head > 100 captions, torso 11..100, tail <= 10) is available for small sets where that reads better.
A caption's bucket is the bucket of its rarest concept (`caption_bucket`); `caption_buckets` lists every bucket it
touches, rarest first. Concepts absent from the table (never seen when the statistics were made) count as tail.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Mapping

from .vocab import Extractor, default_extractor

__all__ = ["BUCKETS", "BUCKET_ORDER", "assign_buckets", "bucket_summary", "caption_buckets", "caption_bucket"]

BUCKETS: tuple[str, ...] = ("head", "torso", "tail")  # most frequent first
BUCKET_ORDER = {"tail": 0, "torso": 1, "head": 2}  # rarest first


def assign_buckets(
    counts: Mapping[str, int],
    method: str = "share",
    head_share: float = 0.5,
    torso_share: float = 0.3,
    head_min_count: int = 101,
    torso_min_count: int = 11,
    thresholds: Mapping[str, int] | None = None,
) -> dict[str, str]:
    """concept -> "head" | "torso" | "tail" (definitions in the module docstring).

    method="share" (default): by cumulative share of occurrences (`head_share`, `torso_share`); "count": head if
    count >= head_min_count, torso if count >= torso_min_count. `thresholds` ({"head_min_count", "torso_min_count"},
    as recorded in concepts.json) overrides both and applies a recorded split to new counts.
    """
    if thresholds is not None:
        method, head_min_count, torso_min_count = "count", thresholds["head_min_count"], thresholds["torso_min_count"]
    if method == "count":
        if torso_min_count > head_min_count:
            raise ValueError(f"need torso_min_count <= head_min_count (got {torso_min_count} > {head_min_count})")
        return {
            c: "head" if n >= head_min_count else "torso" if n >= torso_min_count else "tail" for c, n in counts.items()
        }
    if method != "share":
        raise ValueError(f"unknown bucket method {method!r}: use 'share' or 'count'")
    if not (0 < head_share <= 1 and 0 <= torso_share and head_share + torso_share <= 1):
        raise ValueError(f"need 0 < head_share, 0 <= torso_share, head_share + torso_share <= 1 "
                         f"(got {head_share}, {torso_share})")
    total = sum(counts.values())
    if total <= 0:
        return {c: "tail" for c in counts}
    by_count: dict[int, int] = Counter()
    for n in counts.values():
        by_count[n] += n
    bucket_of_count: dict[int, str] = {}
    before = 0
    for n in sorted(by_count, reverse=True):
        share = before / total
        bucket_of_count[n] = "head" if share < head_share else "torso" if share < head_share + torso_share else "tail"
        before += by_count[n]
    return {c: bucket_of_count[n] if n > 0 else "tail" for c, n in counts.items()}


def bucket_summary(counts: Mapping[str, int], buckets: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    """Per bucket: number of concepts, count range, rank range (1-based) and share of all occurrences."""
    total = sum(counts.values()) or 1
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    out: dict[str, dict[str, Any]] = {}
    for name in BUCKETS:
        rows = [(rank, c, n) for rank, (c, n) in enumerate(ranked, 1) if buckets.get(c) == name]
        out[name] = {
            "num_concepts": len(rows),
            "min_count": min((n for _, _, n in rows), default=None),
            "max_count": max((n for _, _, n in rows), default=None),
            "first_rank": rows[0][0] if rows else None,
            "last_rank": rows[-1][0] if rows else None,
            "occurrence_share": sum(n for _, _, n in rows) / total,
        }
    return out


def caption_buckets(
    caption: str, buckets: Mapping[str, str], extractor: Extractor | None = None, unseen: str | None = "tail"
) -> tuple[str, ...]:
    """The buckets a caption's concepts fall in, rarest first (e.g. ("tail", "head")); () if it names none.

    The first entry is the caption's bucket (that of its rarest concept, `caption_bucket`). Concepts not in
    `buckets` count as `unseen` ("tail" by default: never seen when the statistics were made), or are ignored
    when `unseen` is None. `extractor` defaults to the bundled-vocabulary extractor.
    """
    found = set()
    for concept in (extractor or default_extractor())(caption):
        bucket = buckets.get(concept, unseen)
        if bucket is not None:
            found.add(bucket)
    return tuple(sorted(found, key=BUCKET_ORDER.__getitem__))


def caption_bucket(
    caption: str, buckets: Mapping[str, str], extractor: Extractor | None = None, unseen: str | None = "tail"
) -> str | None:
    """The bucket of the caption's rarest concept, or None if it names no known concept."""
    touched = caption_buckets(caption, buckets, extractor, unseen)
    return touched[0] if touched else None
