"""Training metrics: averaged over the logging window, written to a JSONL file and to accelerate's trackers."""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path

import torch


class MetricWindow:
    """Accumulates scalar stats between log points; `means()` returns and clears their averages.

    Non-finite values are not averaged in, but their key is kept (its mean is NaN if nothing finite came), so
    every rank reports the same keys in the same order and one collective can reduce them.
    """

    def __init__(self) -> None:
        self._sums: dict[str, float] = defaultdict(float)
        self._counts: dict[str, int] = defaultdict(int)

    def add(self, stats: dict) -> None:
        for name, value in stats.items():
            if isinstance(value, torch.Tensor):
                if value.numel() != 1:
                    continue  # per-sample tensors are for bucketed monitors, not scalar logs
                value = value.item()
            self._sums[name] += 0.0  # registers the key
            if not math.isfinite(value):
                continue  # e.g. a weight statistic that is undefined for this batch
            self._sums[name] += float(value)
            self._counts[name] += 1

    def means(self) -> dict[str, float]:
        out = {k: self._sums[k] / self._counts[k] if self._counts[k] else math.nan for k in self._sums}
        self._sums.clear()
        self._counts.clear()
        return out


class JsonlLogger:
    """Appends one JSON object per log point; survives resume (it appends), readable with pandas.read_json."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def log(self, step: int, metrics: dict) -> None:
        row = {"step": step, **{k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                                for k, v in metrics.items()}}
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
