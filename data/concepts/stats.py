"""The statistics files of a caption set, and reading them back.

`write_stats` writes into one folder: concepts.csv (concept, count, fraction, rank, bucket), concepts.json (the
same rows with each concept's kind, plus totals, the bucket definition, per-bucket ranges, the equivalent count
thresholds and every pair of concepts seen together), long_tail.png (`data.concepts.plot.plot_long_tail`) and
cooccurrence.csv (`cooccurrence_table`). `fraction` = count / number of non-empty captions read; `rank` = 1 for the
most frequent concept, ties broken alphabetically (ordinal ranks, as plotted). `load_stats`, `load_buckets`,
`extractor_from_stats` and `CaptionBucketer.from_stats` read a concepts.json back.
"""

from __future__ import annotations

import csv
import json
import os
from typing import Any, Mapping, Sequence

from .buckets import BUCKETS, assign_buckets, bucket_summary, caption_bucket
from .cooccurrence import cooccurrence_table
from .counting import ConceptStats
from .vocab import Extractor, default_extractor, make_extractor

__all__ = [
    "STATS_FORMAT",
    "PLOT_SIZE",
    "write_stats",
    "load_stats",
    "load_buckets",
    "extractor_from_stats",
    "CaptionBucketer",
]

STATS_FORMAT = "imba-concept-stats/1"
PLOT_SIZE = (960, 640)  # long_tail.png, in pixels


def _bucket_settings(method: str, head_share: float, torso_share: float, head_min_count: int, torso_min_count: int):
    if method == "share":
        return {"method": "share", "head_share": head_share, "torso_share": torso_share,
                "definition": f"head: concepts before which less than {head_share:g} of all concept occurrences "
                              f"lie (most frequent first); torso: less than {head_share + torso_share:g}; tail: rest"}
    return {"method": "count", "head_min_count": head_min_count, "torso_min_count": torso_min_count,
            "definition": f"head: count >= {head_min_count}; torso: count >= {torso_min_count}; tail: rest"}


def write_stats(
    stats: ConceptStats,
    out_dir: str | os.PathLike,
    top_k: int = 50,
    method: str = "share",
    head_share: float = 0.5,
    torso_share: float = 0.3,
    head_min_count: int = 101,
    torso_min_count: int = 11,
    extractor: Any = None,
    plot_size: tuple[int, int] = PLOT_SIZE,
) -> dict[str, str]:
    """Write concepts.csv, concepts.json, long_tail.png and cooccurrence.csv into `out_dir`; return their paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {name: os.path.join(out_dir, name)
             for name in ("concepts.csv", "concepts.json", "long_tail.png", "cooccurrence.csv")}
    ranked = stats.ranked()
    counts = dict(ranked)
    buckets = assign_buckets(counts, method, head_share, torso_share, head_min_count, torso_min_count)
    summary = bucket_summary(counts, buckets)
    n = max(stats.num_captions, 1)
    rows = [{"concept": c, "count": k, "fraction": k / n, "rank": r, "bucket": buckets[c],
             "kind": stats.kinds.get(c, "object")} for r, (c, k) in enumerate(ranked, 1)]

    with open(paths["concepts.csv"], "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["concept", "count", "fraction", "rank", "bucket"])
        for row in rows:
            writer.writerow([row["concept"], row["count"], f"{row['fraction']:.6g}", row["rank"], row["bucket"]])

    head_min = summary["head"]["min_count"]
    torso_min = summary["torso"]["min_count"]
    thresholds = {  # count thresholds equivalent to this split (see assign_buckets(thresholds=...))
        "head_min_count": head_min if head_min is not None else (ranked[0][1] + 1 if ranked else 1),
        "torso_min_count": torso_min if torso_min is not None else (head_min if head_min is not None else 1),
    }
    if method == "count":
        thresholds = {"head_min_count": head_min_count, "torso_min_count": torso_min_count}
    describe = getattr(extractor or default_extractor(), "describe", None)
    payload = {
        "format": STATS_FORMAT,
        "num_captions": stats.num_captions,
        "num_captions_with_concepts": stats.num_with_concepts,
        "num_occurrences": stats.num_occurrences,
        "num_concepts": len(ranked),
        "extractor": describe() if describe is not None else {"name": type(extractor).__name__},
        "buckets": dict(_bucket_settings(method, head_share, torso_share, head_min_count, torso_min_count),
                        **{name: summary[name] for name in BUCKETS}),
        "thresholds": thresholds,
        "skipped": dict(sorted(stats.skipped.items())),
        "sources": {"count": len(stats.sources), "first": stats.sources[:3]},
        "concepts": rows,
        # every pair seen together: [a, b, captions mentioning both] (a < b), most frequent first; the benchmark
        # builder leaves these out (at most V(V-1)/2 rows for a V-concept vocabulary)
        "pairs": [[a, b, k] for (a, b), k in sorted(stats.pair_counts.items(), key=lambda kv: (-kv[1], kv[0]))
                  if k > 0],
    }
    with open(paths["concepts.json"], "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=1)
        f.write("\n")

    from .plot import plot_long_tail  # matplotlib only where a plot is drawn

    title = f"Concept frequency: {len(ranked):,} concepts in {stats.num_captions:,} captions"
    plot_long_tail(ranked, buckets, paths["long_tail.png"], size=plot_size, title=title, summary=summary)

    with open(paths["cooccurrence.csv"], "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["a", "b", "count_a", "count_b", "count_ab", "npmi"])
        for row in cooccurrence_table(stats, top_k):
            writer.writerow([row["a"], row["b"], row["count_a"], row["count_b"], row["count_ab"], f"{row['npmi']:.6f}"])
    return paths


def load_stats(path: str | os.PathLike) -> dict[str, Any]:
    """The parsed concepts.json (a folder holding one is accepted); one-line errors for wrong files."""
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "concepts.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"concept statistics {path!r} not found: run "
                                "`python -m data.prep.concepts --out DIR` first")
    with open(path, encoding="utf-8") as f:
        try:
            payload = json.load(f)
        except ValueError as exn:
            raise ValueError(f"{path} is not valid JSON ({exn}); rerun `python -m data.prep.concepts`") from None
    if not isinstance(payload, dict) or payload.get("format") != STATS_FORMAT:
        raise ValueError(f"{path} is not a concepts.json written by data.concepts (format {STATS_FORMAT})")
    return payload


def load_buckets(path: str | os.PathLike) -> dict[str, str]:
    """concept -> bucket as recorded in concepts.json (for `caption_buckets` in a training monitor)."""
    return {row["concept"]: row["bucket"] for row in load_stats(path)["concepts"]}


def extractor_from_stats(stats: Mapping[str, Any] | str | os.PathLike):
    """The extractor that made a concepts.json (same vocabulary file or spaCy model), for `caption_buckets`."""
    if isinstance(stats, (str, os.PathLike)):
        stats = load_stats(stats)
    info = stats.get("extractor", {})
    if info.get("name") == "spacy":
        return make_extractor("spacy", spacy_model=info.get("model", "en_core_web_sm"))
    vocab = info.get("vocab", "default")
    return make_extractor("vocab", None if vocab == "default" else vocab)


class CaptionBucketer:
    """Caption → the bucket of its rarest concept ("head" / "torso" / "tail", None if it names no known concept),
    as recorded in a concepts.json: the labels of the training monitor (imba.monitor.BucketMonitor)."""

    def __init__(self, buckets: Mapping[str, str], extractor: Extractor | None = None):
        self.buckets = dict(buckets)
        self.extractor = extractor or default_extractor()

    @classmethod
    def from_stats(cls, path: str | os.PathLike) -> "CaptionBucketer":
        stats = load_stats(path)
        return cls({row["concept"]: row["bucket"] for row in stats["concepts"]}, extractor_from_stats(stats))

    def __call__(self, captions: Sequence[str]) -> list[str | None]:
        return [caption_bucket(c, self.buckets, self.extractor) for c in captions]
