"""The IMBA monitor: per-sample loss statistics averaged per concept-frequency bucket (paper Fig. 6)."""

from __future__ import annotations

import math

import torch


class BucketMonitor:
    """The IMBA monitor (paper Fig. 6): per-sample stats averaged per concept-frequency bucket.

    Each sample is labelled with its caption's bucket (e.g. "tail" if it names a tail concept; labels come from the
    concept statistics, `data.concepts`); `means()` returns `monitor/<stat>_<bucket>` for the IMBA distance
    (how far the unconditional prediction is from the target: large where the model under-serves a concept) and
    the plain conditional error. Samples with another label (None: no known concept) are left out. Values stay
    tensors until `means()` (no GPU synchronisation per step), and every rank reports the same keys in the same
    order, so one collective reduces them.
    """

    STATS = {"distance_per_sample": "distance", "loss_cond_per_sample": "loss_cond"}

    def __init__(self, buckets: tuple[str, ...] = ("head", "torso", "tail")) -> None:
        self.buckets = tuple(buckets)
        self._sums: dict[str, torch.Tensor] = {}
        self._counts: dict[str, torch.Tensor] = {}

    def add(self, labels, stats: dict) -> None:
        """`stats`: a loss's `LossStats` (its per-sample tensors) or a dict of per-sample tensors."""
        tensors = getattr(stats, "tensors", stats)
        for key, name in self.STATS.items():
            if key not in tensors:
                continue
            values = tensors[key].detach().float().flatten()
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
