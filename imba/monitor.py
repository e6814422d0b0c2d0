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
            if name.endswith("_per_sample"):
                continue  # per-sample tensors are for the concept-bucket monitor, not scalar logs
            value = torch.as_tensor(value).detach()
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


class BucketMonitor:
    """The IMBA monitor (paper Fig. 6): per-sample stats averaged per concept-frequency bucket.

    Each sample is labelled with its caption's bucket (e.g. "tail" if it names a tail concept; labels come from the
    concept statistics, `data.concepts`); `means()` returns `monitor/<stat>_<bucket>` for the IMBA distance
    (how far the unconditional prediction is from the target: large where the model under-serves a concept) and
    the plain conditional error. Samples with another label (None: no known concept) are left out. Like
    `MetricWindow`, values stay tensors until `means()`, and every rank reports the same keys in the same order.
    """

    STATS = {"distance_per_sample": "distance", "loss_cond_per_sample": "loss_cond"}

    def __init__(self, buckets: tuple[str, ...] = ("head", "torso", "tail")) -> None:
        self.buckets = tuple(buckets)
        self._sums: dict[str, torch.Tensor] = {}
        self._counts: dict[str, torch.Tensor] = {}

    def add(self, labels, stats: dict) -> None:
        for key, name in self.STATS.items():
            if key not in stats:
                continue
            values = stats[key].detach().float().flatten()
            if values.numel() != len(labels):
                raise ValueError(f"BucketMonitor: {len(labels)} labels for {values.numel()} values of {key}")
            index = torch.tensor([self.buckets.index(b) if b in self.buckets else -1 for b in labels],
                                 device=values.device)
            keep = (index >= 0) & torch.isfinite(values)
            zeros = torch.zeros(len(self.buckets), device=values.device)
            sums = zeros.index_add(0, index[keep], values[keep])
            counts = zeros.index_add(0, index[keep], torch.ones_like(values[keep]))
            self._sums[name] = self._sums.get(name, 0.0) + sums
            self._counts[name] = self._counts.get(name, 0.0) + counts

    def means(self) -> dict[str, float]:
        out = {}
        for name in self._sums:
            sums, counts = self._sums[name].tolist(), self._counts[name].tolist()
            for bucket, total, count in zip(self.buckets, sums, counts):
                out[f"monitor/{name}_{bucket}"] = total / count if count else math.nan
            self._sums[name] = torch.zeros_like(self._sums[name])  # keep the keys: every window reports them
            self._counts[name] = torch.zeros_like(self._counts[name])
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
