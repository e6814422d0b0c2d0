"""What concept balancing and weighted sampling cost as the data grows: a caption set of 10 million samples.

    python bench/balance_cost.py                                   # 10M captions, 2 worker processes
    python bench/balance_cost.py --samples 1000000 --workers 1 --out outputs/balance_cost.json
    python bench/balance_cost.py --smoke                           # 20,000 captions (the test)

Captions. A deterministic synthetic caption set (captions only, no images), written once as one caption per line
into `--cache-dir` (default outputs/balance_cost/): each caption names 1–3 objects of the bundled concept vocabulary
(Zipf over its ~1,000 objects, exponent 1.1), each with a colour half of the time, e.g. "a red dog and a car on a
table". Its long tail of pairs and bindings is what `data.balance` has to weigh.

Stages, each in a fresh process so that its peak memory is its own (`ru_maxrss` of the process and, separately, of
its worker processes):
  weights  the draw plan's balance step over all captions: concept entries extracted in `--workers` processes
           (`data.balance.build_concept_table`), temperature factors (alpha 0.5), expected draws -> integer units
           (`data.weighted.expected_draws_to_units`);
  sampler  for each N of `--sampler-sizes`: building a `WeightedOrder` + `StreamBatchSampler` over N random weights,
           the first batch (which builds the epoch's cumulative sums, O(N)), and the median of 200 later batches of
           `--batch-size` (O(batch log N): nearly flat in N).
  clusters for each N of `--cluster-sizes`: balancing by image clusters (data.balance.by=images): k-means
           (`data.image_clusters.kmeans`, k = sqrt(N)) over N rows of 64 features, what a 256 px latent pooled to
           4 x 4 cells gives (drawn from a mixture of 200 Gaussians), then the temperature factors over the clusters
           and, over N samples of a long-tailed entry (Zipf 1.3, 5,000 values), the spread rule's
           (data.balance=spread: a bisection for its alpha, the costliest case).
           Reading the features from precomputed shards comes on top (the run prints its rate).
Reported: seconds and peak resident memory per stage, captions per second of the extraction.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

DEFAULT_CACHE = REPO / "outputs" / "balance_cost"
COLOURS = ("red", "blue", "green", "yellow", "black", "white", "brown", "orange", "purple", "pink", "grey", "cyan")
RELATIONS = ("and", "next to", "on", "under", "with")


def write_captions(path: Path, samples: int, seed: int = 0) -> Path:
    """`samples` synthetic captions, one per line (written once; reused when present with the same count)."""
    if path.is_file():
        return path
    from data.concepts import load_vocabulary
    from data.text import with_article

    vocab = load_vocabulary()
    objects = sorted(n for n in vocab.names if vocab.kinds.get(n) == "object")
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, len(objects) + 1) ** 1.1
    weights /= weights.sum()
    tmp = path.with_suffix(".tmp")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(tmp, "w", encoding="utf-8") as f:
        for start in range(0, samples, 100_000):
            n = min(100_000, samples - start)
            count = rng.integers(1, 4, n)
            picks = rng.choice(len(objects), size=(n, 3), p=weights)
            colour = rng.integers(0, len(COLOURS), (n, 3))
            coloured = rng.random((n, 3)) < 0.5
            relation = rng.integers(0, len(RELATIONS), (n, 2))
            lines = []
            for i in range(n):
                words = []
                for k in range(count[i]):
                    noun = objects[picks[i, k]]
                    words.append(with_article(f"{COLOURS[colour[i, k]]} {noun}" if coloured[i, k] else noun))
                    if k + 1 < count[i]:
                        words.append(RELATIONS[relation[i, k]])
                lines.append(" ".join(words))
            f.write("\n".join(lines) + "\n")
    tmp.replace(path)
    return path


def peak_mb() -> dict[str, float]:
    """Peak resident memory of this process and of its (largest) finished child, MB (Linux reports KiB)."""
    return {"self_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "workers_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}


def stage_weights(captions: Path, workers: int) -> dict:
    from data.balance import TemperatureBalance, balance_factors, build_concept_table
    from data.concepts import default_extractor
    from data.weighted import expected_draws_to_units

    extractor = default_extractor()
    start = time.perf_counter()
    with open(captions, encoding="utf-8") as f:
        table = build_concept_table((line.rstrip("\n") for line in f), extractor, workers=workers)
    extracted = time.perf_counter()
    factors = balance_factors(table, TemperatureBalance(alpha=0.5))
    weighed = time.perf_counter()
    units = expected_draws_to_units(factors, len(table))
    done = time.perf_counter()
    return {"samples": len(table), "entries": len(table.entries), "entry_occurrences": int(table.ids.size),
            "extract_s": extracted - start, "factors_s": weighed - extracted, "units_s": done - weighed,
            "total_s": done - start, "captions_per_s": len(table) / (extracted - start),
            "largest_repeat": float(units.max() / 2**20), **peak_mb()}


def stage_sampler(n: int, batch_size: int) -> dict:
    from data.weighted import StreamBatchSampler, WeightedOrder, expected_draws_to_units

    rng = np.random.default_rng(0)
    units = expected_draws_to_units(rng.pareto(1.5, n) + 0.01, n)
    start = time.perf_counter()
    sampler = StreamBatchSampler(WeightedOrder(units, n, seed=0), batch_size)
    built = time.perf_counter()
    sampler.batch_indices(0)
    first = time.perf_counter()
    times = []
    for t in range(1, 201):
        t0 = time.perf_counter()
        sampler.batch_indices(t)
        times.append(time.perf_counter() - t0)
    return {"samples": n, "build_s": built - start, "first_batch_s": first - built,
            "batch_ms_median": 1000 * statistics.median(times), **peak_mb()}


def stage_clusters(n: int) -> dict:
    from data.balance import SpreadBalance, TemperatureBalance, balance_factors
    from data.image_clusters import cluster_table, default_clusters, kmeans

    rng = np.random.default_rng(0)
    centres = rng.normal(size=(200, 64))
    features = centres[rng.integers(200, size=n)] + 0.5 * rng.normal(size=(n, 64))
    start = time.perf_counter()
    labels = kmeans(features, default_clusters(n), seed=0)
    clustered = time.perf_counter()
    table = cluster_table(labels)
    balance_factors(table, TemperatureBalance(0.5))
    done = time.perf_counter()
    tail = cluster_table(np.minimum(rng.zipf(1.3, n), 5000))
    begun = time.perf_counter()
    rule = SpreadBalance(0.6)
    balance_factors(tail, rule)
    spread = time.perf_counter() - begun
    return {"samples": n, "clusters": default_clusters(n), "kmeans_s": clustered - start,
            "factors_s": done - clustered, "spread_s": spread, "spread_alpha": rule.alpha, **peak_mb()}


def in_fresh_process(args: list[str]) -> dict:
    proc = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"stage {args} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=10_000_000, help="captions (default 10,000,000)")
    p.add_argument("--workers", type=int, default=2, help="extraction processes (default 2)")
    p.add_argument("--sampler-sizes", type=int, nargs="+", default=[100_000, 1_000_000, 10_000_000],
                   help="N of the sampler stage (default 1e5 1e6 1e7)")
    p.add_argument("--cluster-sizes", type=int, nargs="+", default=[100_000, 1_000_000],
                   help="N of the clusters stage (default 1e5 1e6)")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--cache-dir", default=str(DEFAULT_CACHE))
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--smoke", action="store_true", help="20,000 captions, sampler sizes 1e3 1e4, clusters of 2,000")
    p.add_argument("--stage", choices=["weights", "sampler", "clusters"], help=argparse.SUPPRESS)
    p.add_argument("--captions", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.stage == "weights":
        print(json.dumps(stage_weights(Path(args.captions), args.workers)))
        return {}
    if args.stage == "sampler":
        print(json.dumps(stage_sampler(args.samples, args.batch_size)))
        return {}
    if args.stage == "clusters":
        print(json.dumps(stage_clusters(args.samples)))
        return {}
    if args.smoke:
        args.samples, args.sampler_sizes, args.cluster_sizes = 20_000, [1_000, 10_000], [2_000]
    start = time.perf_counter()
    captions = write_captions(Path(args.cache_dir) / f"captions-{args.samples}.txt", args.samples)
    print(f"captions: {captions} ({time.perf_counter() - start:.0f} s)", file=sys.stderr)
    results = {
        "date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "command": "python bench/balance_cost.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "weights": in_fresh_process(["--stage", "weights", "--captions", str(captions),
                                     "--workers", str(args.workers)]),
        "sampler": [in_fresh_process(["--stage", "sampler", "--samples", str(n), "--batch-size",
                                      str(args.batch_size)]) for n in args.sampler_sizes],
        "clusters": [in_fresh_process(["--stage", "clusters", "--samples", str(n)]) for n in args.cluster_sizes],
    }
    w = results["weights"]
    print(f"weights of {w['samples']:,} captions ({w['entries']:,} entries, {w['entry_occurrences']:,} occurrences), "
          f"{args.workers} workers: {w['total_s']:.1f} s (extraction {w['extract_s']:.1f} s, "
          f"{w['captions_per_s']:,.0f} captions/s; factors {w['factors_s']:.1f} s; units {w['units_s']:.1f} s), "
          f"peak {w['self_mb']:,.0f} MB + {w['workers_mb']:,.0f} MB per worker")
    for s in results["sampler"]:
        print(f"sampler over {s['samples']:,}: build {s['build_s'] * 1000:.1f} ms, first batch {s['first_batch_s']:.2f} "
              f"s (the epoch's cumulative sums), then {s['batch_ms_median']:.2f} ms per batch of {args.batch_size}; "
              f"peak {s['self_mb']:,.0f} MB")
    for c in results["clusters"]:
        print(f"image clusters of {c['samples']:,} samples: k-means into {c['clusters']:,} in {c['kmeans_s']:.1f} s, "
              f"factors {c['factors_s']:.2f} s (spread {c['spread_s']:.2f} s); peak {c['self_mb']:,.0f} MB")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    return results


if __name__ == "__main__":
    main()
