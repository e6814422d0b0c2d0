"""Training metrics: averaged over the logging window, written to a JSONL file and to accelerate's trackers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch


class MetricWindow:
    """Accumulates scalar stats between log points; `means()` returns and clears their averages.

    Non-finite values are not averaged in, but their key is kept (its mean is NaN if nothing finite came), so
    every rank reports the same keys in the same order and one collective can reduce them.

    Values are accumulated as tensors where they live and read (`.item()`) only in `means()`: reading every stat
    every step would force a GPU synchronisation per stat per step.
    """

    def __init__(self) -> None:
        self._sums: dict[str, torch.Tensor] = {}
        self._counts: dict[str, torch.Tensor] = {}

    def add(self, stats: dict) -> None:
        for name, value in stats.items():
            value = torch.as_tensor(value).detach()
            if value.numel() != 1:
                continue  # per-sample tensors are for bucketed monitors, not scalar logs
            value = value.reshape(()).float()
            finite = torch.isfinite(value)  # e.g. a weight statistic that is undefined for this batch
            self._sums[name] = self._sums.get(name, 0.0) + torch.where(finite, value, torch.zeros_like(value))
            self._counts[name] = self._counts.get(name, 0.0) + finite.float()

    def means(self) -> dict[str, float]:
        out = {}
        for name, total in self._sums.items():
            count = self._counts[name].item()
            out[name] = total.item() / count if count else math.nan
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
