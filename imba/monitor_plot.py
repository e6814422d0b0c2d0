"""Plot the IMBA monitor (paper Fig. 6) from a run's metrics.jsonl: one panel per monitored stat, one line per
concept-frequency bucket, over training steps.

    python -m imba.monitor_plot outputs/tiny/metrics.jsonl            # → outputs/tiny/monitor.png
    python -m imba.monitor_plot outputs/tiny/metrics.jsonl --out fig6.png

Reads the `monitor/<stat>_<bucket>` columns that `imba.monitor.BucketMonitor` writes (train.concept_stats) and
draws them with `imba.plots.plot_monitor`.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path


def read_monitor(path: Path) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """{stat: {bucket: [(step, value), ...]}} from the monitor columns of a metrics.jsonl (missing values skipped;
    a resumed run appends, so a step logged twice keeps its last value)."""
    series: dict[str, dict[str, dict[int, float]]] = {}
    with Path(path).open() as f:
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)
            for key, value in row.items():
                if not key.startswith("monitor/") or value is None or not math.isfinite(value):
                    continue
                stat, _, bucket = key[len("monitor/"):].rpartition("_")
                series.setdefault(stat, {}).setdefault(bucket, {})[int(row["step"])] = float(value)
    return {stat: {bucket: sorted(points.items()) for bucket, points in buckets.items()}
            for stat, buckets in series.items()}


def main(argv: list[str] | None = None) -> int:
    from imba.plots import plot_monitor  # matplotlib is needed only here, not to read the metrics

    parser = argparse.ArgumentParser(description="Plot the IMBA monitor (distance and loss per concept bucket).")
    parser.add_argument("metrics", type=Path, help="a run's metrics.jsonl")
    parser.add_argument("--out", type=Path, default=None, help="PNG path (default: monitor.png next to the metrics)")
    args = parser.parse_args(argv)
    if not args.metrics.is_file():
        print(f"error: {args.metrics} does not exist", file=sys.stderr)
        return 2
    try:
        out = plot_monitor(read_monitor(args.metrics), args.out or args.metrics.parent / "monitor.png")
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
