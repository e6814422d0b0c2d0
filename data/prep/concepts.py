"""`python -m data.prep.concepts`: concept statistics of a caption set, and the inert-concept benchmark built from
them (`data.concepts` computes and writes the statistics; `data.prep.benchmark` builds the prompts)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections import Counter
from typing import Sequence

from ..concepts.buckets import BUCKET_ORDER, BUCKETS
from ..concepts.cooccurrence import cooccurrence_table
from ..concepts.counting import ConceptStats, collect_stats
from ..concepts.stats import load_stats, write_stats
from ..concepts.vocab import DEFAULT_VOCAB_PATH, ExtractorUnavailable, make_extractor

from .benchmark import build_benchmark

__all__ = ["main"]

_DESCRIPTION = """\
Concept statistics of a caption set and an inert-concept benchmark built from them.

  stats (default)   python -m data.prep.concepts --shards 'shards/{000000..000009}.tar' --out stats/
                    python -m data.prep.concepts --captions captions.jsonl --out stats/
  build-benchmark   python -m data.prep.concepts build-benchmark --stats stats/concepts.json --out prompts.json

`stats` writes into --out:
  concepts.csv      concept, count (captions mentioning it), fraction of captions, rank, bucket
  concepts.json     the same rows plus totals, the bucket definition, per-bucket ranges and the equivalent
                    count thresholds (read it with data.concepts.load_buckets for per-bucket monitoring),
                    and every pair of concepts seen together with its count (build-benchmark leaves them out)
  long_tail.png     log-log rank vs count, coloured by head/torso/tail, bucket boundaries dashed
  cooccurrence.csv  pairs of the top-K concepts: a, b, count_a, count_b, count_ab, npmi (highest first)
and prints the most correlated pairs (spurious-correlation candidates) and frequent pairs never seen together.
Buckets (default): head = most frequent concepts covering the first 50% of concept mentions, torso = next 30%,
tail = the rest. Run `python -m data.prep.concepts stats --help` for all options."""


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m data.prep.concepts", description=_DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="{stats,build-benchmark}")

    st = sub.add_parser("stats", help="count concepts, write concepts.csv/.json, long_tail.png, cooccurrence.csv",
                        description=_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    st.add_argument("--shards", nargs="+", metavar="SPEC",
                    help="tar shards: file, folder, glob or brace pattern ('dir/{000000..000009}.tar'), several OK")
    st.add_argument("--captions", nargs="+", metavar="FILE",
                    help="caption files instead of (or besides) shards: .txt (one per line), .jsonl, .json list")
    st.add_argument("--out", required=True, metavar="DIR", help="output folder (created)")
    st.add_argument("--caption-field", default="caption", help="json field holding the caption (default: caption)")
    st.add_argument("--extractor", choices=("vocab", "spacy"), default="vocab",
                    help="vocab: bundled-vocabulary noun matcher (default); spacy: noun-chunk heads (needs spaCy)")
    st.add_argument("--vocab", metavar="FILE", help=f"concept vocabulary replacing the bundled {DEFAULT_VOCAB_PATH}")
    st.add_argument("--spacy-model", default="en_core_web_sm", help="spaCy model for --extractor spacy")
    st.add_argument("--top-k", type=int, default=50, help="concepts in the co-occurrence table (default 50)")
    st.add_argument("--bucket-method", choices=("share", "count"), default="share",
                    help="share: by cumulative share of mentions (default); count: absolute count thresholds")
    st.add_argument("--head-share", type=float, default=0.5, help="share of mentions covered by head (0.5)")
    st.add_argument("--torso-share", type=float, default=0.3, help="share of mentions covered by torso (0.3)")
    st.add_argument("--head-min-count", type=int, default=101, help="--bucket-method count: head if count >= this")
    st.add_argument("--torso-min-count", type=int, default=11, help="--bucket-method count: torso if count >= this")
    st.add_argument("--min-pair-count", type=int, default=5,
                    help="printed correlated pairs must co-occur in at least this many captions (default 5)")
    st.add_argument("--show", type=int, default=10, help="pairs to print (default 10)")
    st.add_argument("--workers", type=int, default=1, help="processes, one shard at a time each (default 1)")
    st.add_argument("--no-progress", action="store_true", help="no progress bar")

    bb = sub.add_parser("build-benchmark", help="inert-concept composition prompts from concepts.json",
                        description="Sample concepts from log-frequency bins, pair them (tail x tail first, up to "
                                    "head x head) and write prompts from templates into a JSON list of "
                                    "{prompt, concepts, counts, buckets, bins, template}. Deterministic in --seed.")
    bb.add_argument("--stats", required=True, metavar="JSON", help="concepts.json written by `stats` (or its folder)")
    bb.add_argument("--out", required=True, metavar="JSON", help="prompt file to write")
    bb.add_argument("--per-bin", type=int, default=5, help="concepts drawn from each frequency bin (default 5)")
    bb.add_argument("--pairs", type=int, default=50, help="concept pairs (default 50)")
    bb.add_argument("--captions-per-pair", type=int, default=4, help="prompts per pair, distinct templates (default 4)")
    bb.add_argument("--bins", type=int, default=6, help="log-frequency bins (default 6, as in the IMBA paper)")
    bb.add_argument("--min-count", type=int, default=1, help="ignore concepts seen in fewer captions (default 1)")
    bb.add_argument("--include-attributes", action="store_true", help="also pair attribute concepts (colours)")
    bb.add_argument("--allow-cooccurring", action="store_true",
                    help="keep pairs seen together in a training caption (left out by default: inert pairs)")
    bb.add_argument("--seed", type=int, default=0)
    return parser


def _print_pairs(stats: ConceptStats, top_k: int, min_pair_count: int, show: int) -> None:
    table = cooccurrence_table(stats, top_k)
    positive = [r for r in table if r["count_ab"] >= min_pair_count and r["npmi"] > 0][:show]
    print(f"most correlated pairs among the top-{top_k} concepts (NPMI, together in >= {min_pair_count} captions); "
          "candidates for spurious correlations:")
    for r in positive:
        print(f"  {r['npmi']:+.3f}  {r['a']} + {r['b']}  (together {r['count_ab']:,}; {r['a']} {r['count_a']:,}, "
              f"{r['b']} {r['count_b']:,})")
    if not positive:
        print("  (none)")
    n = max(stats.num_captions, 1)
    never = [r for r in table if r["count_ab"] == 0 and r["count_a"] * r["count_b"] / n >= min_pair_count]
    never.sort(key=lambda r: -r["count_a"] * r["count_b"])
    if never:
        print("frequent pairs never seen together (expected together >= "
              f"{min_pair_count} if independent): compositions the model never saw:")
        for r in never[:show]:
            print(f"  {r['a']} + {r['b']}  (expected {r['count_a'] * r['count_b'] / n:,.1f})")


def _run_stats(args: argparse.Namespace) -> int:
    if not args.shards and not args.captions:
        raise FileNotFoundError("no input: give --shards (tar shards) or --captions (a caption file)")
    extractor = make_extractor(args.extractor, args.vocab, args.spacy_model)
    stats = collect_stats(args.shards, args.captions, extractor, args.caption_field, args.workers,
                          progress=not args.no_progress)
    if stats.num_captions == 0:
        skipped = ", ".join(f"{v} {k}" for k, v in stats.skipped.items()) or "nothing readable"
        raise ValueError(f"no captions read ({skipped}); check --caption-field and the input paths")
    paths = write_stats(stats, args.out, args.top_k, args.bucket_method, args.head_share, args.torso_share,
                        args.head_min_count, args.torso_min_count, extractor)
    summary = load_stats(paths["concepts.json"])
    skipped = "; skipped: " + ", ".join(f"{v:,} {k}" for k, v in sorted(stats.skipped.items())) if stats.skipped else ""
    print(f"read {stats.num_captions:,} captions from {len(stats.sources):,} source(s){skipped}")
    print(f"{summary['num_concepts']:,} concepts, {summary['num_occurrences']:,} mentions; "
          f"{stats.num_captions - stats.num_with_concepts:,} captions name no concept")
    for name in BUCKETS:
        b = summary["buckets"][name]
        if b["num_concepts"]:
            print(f"  {name:5s}: {b['num_concepts']:,} concepts, ranks {b['first_rank']}-{b['last_rank']}, "
                  f"counts {b['min_count']:,}-{b['max_count']:,}, {100 * b['occurrence_share']:.1f}% of mentions")
    _print_pairs(stats, args.top_k, args.min_pair_count, args.show)
    print("wrote " + ", ".join(paths.values()))
    return 0


def _run_benchmark(args: argparse.Namespace) -> int:
    prompts = build_benchmark(args.stats, args.per_bin, args.pairs, args.captions_per_pair, args.seed, args.bins,
                              args.min_count, args.include_attributes, allow_cooccurring=args.allow_cooccurring)
    folder = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(folder, exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(prompts, f, indent=1)
        f.write("\n")
    pairs = {tuple(p["concepts"]) if p["concepts"][0] < p["concepts"][1] else tuple(p["concepts"][::-1])
             for p in prompts}
    kinds = Counter(" x ".join(sorted(p["buckets"], key=BUCKET_ORDER.__getitem__)) for p in prompts)
    print(f"wrote {len(prompts)} prompts for {len(pairs)} concept pairs to {args.out} "
          f"({', '.join(f'{k}: {v}' for k, v in sorted(kinds.items()))})")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("stats", "build-benchmark", "-h", "--help"):
        argv.insert(0, "stats")
    args = _build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return _run_benchmark(args) if args.command == "build-benchmark" else _run_stats(args)
    except (FileNotFoundError, ValueError, ExtractorUnavailable) as exn:
        print(f"error: {exn}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
