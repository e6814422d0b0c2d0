"""Plot the IMBA monitor (paper Fig. 6) from a run's metrics.jsonl: one panel per monitored stat, one line per
concept-frequency bucket, over training steps.

    python -m imba.monitor_plot outputs/tiny/metrics.jsonl            # → outputs/tiny/monitor.png
    python -m imba.monitor_plot outputs/tiny/metrics.jsonl --out fig6.png

Reads the `monitor/<stat>_<bucket>` columns that `imba.monitor.BucketMonitor` writes (train.concept_stats).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

BUCKET_COLOURS = {"head": (33, 102, 172), "torso": (120, 120, 120), "tail": (203, 24, 29)}
TITLES = {"distance": "IMBA distance (target vs unconditional)", "loss_cond": "conditional loss"}


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


def plot_monitor(series: dict, out: Path, panel: tuple[int, int] = (460, 280)) -> Path:
    from PIL import Image, ImageDraw

    if not series:
        raise ValueError("no monitor/* columns in the metrics: was the run trained with train.concept_stats?")
    width, height = panel
    left, top, bottom = 60, 30, 50
    stats = sorted(series, key=lambda s: (s not in TITLES, s))
    image = Image.new("RGB", (width * len(stats), height + top + bottom), "white")
    draw = ImageDraw.Draw(image)
    for k, stat in enumerate(stats):
        x0, x1 = k * width + left, (k + 1) * width - 20
        y0, y1 = top, top + height - 20
        points = [p for line in series[stat].values() for p in line]
        steps = [s for s, _ in points]
        values = [v for _, v in points]
        s_lo, s_hi = min(steps), max(steps) if max(steps) > min(steps) else min(steps) + 1
        v_lo, v_hi = min(0.0, min(values)), max(values) * 1.05 or 1.0

        def xy(step, value):
            return (x0 + (x1 - x0) * (step - s_lo) / (s_hi - s_lo), y1 - (y1 - y0) * (value - v_lo) / (v_hi - v_lo))

        draw.rectangle((x0, y0, x1, y1), outline=(160, 160, 160))
        draw.text((x0, 8), TITLES.get(stat, stat), fill="black")
        for frac in (0.0, 0.5, 1.0):
            value = v_lo + frac * (v_hi - v_lo)
            draw.text((x0 - 55, xy(s_lo, value)[1] - 6), f"{value:.3g}", fill="black")
            step = s_lo + frac * (s_hi - s_lo)
            draw.text((xy(step, v_lo)[0] - 10, y1 + 4), f"{step:.0f}", fill="black")
        draw.text(((x0 + x1) / 2 - 15, y1 + 18), "step", fill="black")
        for b, (bucket, line) in enumerate(sorted(series[stat].items())):
            colour = BUCKET_COLOURS.get(bucket, (0, 0, 0))
            if len(line) > 1:
                draw.line([xy(s, v) for s, v in line], fill=colour, width=2)
            else:
                x, y = xy(*line[0])
                draw.ellipse((x - 2, y - 2, x + 2, y + 2), fill=colour)
            draw.text((x1 - 60, y0 + 6 + 14 * b), bucket, fill=colour)
    out = Path(out)
    image.save(out)
    return out


def main(argv: list[str] | None = None) -> int:
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
