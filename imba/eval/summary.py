"""Summary arithmetic of an evaluation: groups, success rates with Wilson intervals, means with bootstrap intervals.

Pure functions over result rows (dicts); no models. Groups of a row (`group_labels`):
    all                      every image
    category: <c>            rows with a "category" (T2I-CompBench colour/shape/texture, LC-Mis labels, ...)
    buckets: head+tail       rows with "buckets" (the inert-concept benchmark): the pair's buckets, in the order
                             head, torso, tail, others; "unknown" for a concept without a bucket
    rarest: tail             the rarest bucket of the row's concepts (the caption-bucket convention of
                             data.concepts: a prompt is as rare as its rarest concept)
Intervals are over images, treating each as an independent trial (several images of one prompt share the
prompt, so the interval is somewhat optimistic when --images-per-prompt > 1; `n_prompts` shows how many).
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Sequence

import numpy as np

Z95 = 1.959963984540054  # standard normal quantile 0.975
BUCKET_ORDER = ("head", "torso", "tail")


def wilson_interval(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion: (centre ∓ half) with
    centre = (p + z²/2n) / (1 + z²/n), half = z·sqrt(p(1−p)/n + z²/4n²) / (1 + z²/n). (0, 1) when n = 0."""
    if n <= 0:
        return 0.0, 1.0
    if not 0 <= successes <= n:
        raise ValueError(f"successes={successes} must be within 0..n={n}")
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def bootstrap_mean_interval(values: Sequence[float], confidence: float = 0.95, resamples: int = 2000,
                            seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean (seeded: the same values give the same interval)."""
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        return math.nan, math.nan
    if x.size == 1 or np.all(x == x[0]):
        return float(x[0]), float(x[0])
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, x.size, size=(resamples, x.size))].mean(axis=1)
    alpha = (1 - confidence) / 2
    lo, hi = np.quantile(means, [alpha, 1 - alpha])
    return float(lo), float(hi)


def _bucket_rank(bucket: Any) -> tuple[int, str]:
    name = str(bucket) if bucket else "unknown"
    return (BUCKET_ORDER.index(name), name) if name in BUCKET_ORDER else (len(BUCKET_ORDER), name)


def group_labels(row: dict[str, Any]) -> list[str]:
    labels = ["all"]
    if row.get("category"):
        labels.append(f"category: {row['category']}")
    buckets = row.get("buckets")
    if isinstance(buckets, (list, tuple)) and buckets:
        ranked = sorted(buckets, key=_bucket_rank)
        labels.append("buckets: " + "+".join(_bucket_rank(b)[1] for b in ranked))
        labels.append(f"rarest: {_bucket_rank(ranked[-1])[1]}")
    return labels


def _group_order(label: str) -> tuple:
    kind, _, value = label.partition(": ")
    kinds = ["all", "category", "buckets", "rarest"]
    if kind in ("buckets", "rarest"):
        return kinds.index(kind), tuple(_bucket_rank(b) for b in value.split("+"))
    return kinds.index(kind) if kind in kinds else len(kinds), value


def summarize(rows: Iterable[dict[str, Any]], metric: str) -> list[dict[str, Any]]:
    """One line per group: n (images), n_prompts, value, lo, hi (95 % interval); plus successes for "success".

    metric "success" (bools): value = success rate, Wilson interval. Any other metric (e.g. "clip_score"):
    value = mean, percentile bootstrap interval. Rows without the metric are left out.
    """
    groups: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        if row.get(metric) is None:
            continue
        for label in group_labels(row):
            groups.setdefault(label, []).append(row)
    lines = []
    for label in sorted(groups, key=_group_order):
        members = groups[label]
        prompts = {r.get("prompt_index", r.get("prompt")) for r in members}
        line: dict[str, Any] = {"group": label, "n": len(members), "n_prompts": len(prompts)}
        if metric == "success":
            k = sum(bool(r[metric]) for r in members)
            line["successes"] = k
            line["value"] = k / len(members)
            line["lo"], line["hi"] = wilson_interval(k, len(members))
        else:
            values = [float(r[metric]) for r in members]
            line["value"] = float(np.mean(values))
            line["lo"], line["hi"] = bootstrap_mean_interval(values)
        lines.append(line)
    return lines


def markdown_table(summary: list[dict[str, Any]], metric: str) -> str:
    if metric == "success":
        head = "| group | images | prompts | success rate | 95 % CI (Wilson) |\n|---|---|---|---|---|\n"
        body = [f"| {s['group']} | {s['n']} | {s['n_prompts']} | {s['value']:.3f} ({s['successes']}/{s['n']}) "
                f"| {s['lo']:.3f} – {s['hi']:.3f} |" for s in summary]
    else:
        head = f"| group | images | prompts | mean {metric} | 95 % CI (bootstrap) |\n|---|---|---|---|---|\n"
        body = [f"| {s['group']} | {s['n']} | {s['n_prompts']} | {s['value']:.2f} | {s['lo']:.2f} – {s['hi']:.2f} |"
                for s in summary]
    return head + "\n".join(body) + "\n"
