"""Metric windows and the JSONL log."""

import json
import math

import torch

from imba.monitor import JsonlLogger, MetricWindow


def test_window_averages_scalars_skips_vectors_and_clears():
    w = MetricWindow()
    w.add({"loss": torch.tensor(1.0), "distance_per_sample": torch.ones(4), "lr": 0.5})
    w.add({"loss": torch.tensor(3.0), "lr": 0.5})
    assert w.means() == {"loss": 2.0, "lr": 0.5}
    assert w.means() == {}


def test_non_finite_values_keep_their_key_but_not_their_value():
    w = MetricWindow()
    w.add({"weight_mean": torch.tensor(float("nan")), "loss": torch.tensor(1.0)})
    w.add({"weight_mean": torch.tensor(2.0), "loss": torch.tensor(float("inf"))})
    assert w.means() == {"weight_mean": 2.0, "loss": 1.0}
    w.add({"weight_mean": torch.tensor(float("nan"))})
    means = w.means()
    assert list(means) == ["weight_mean"] and math.isnan(means["weight_mean"])


def test_jsonl_appends_rows_and_writes_nan_as_null(tmp_path):
    log = JsonlLogger(tmp_path / "m" / "metrics.jsonl")
    log.log(1, {"loss": 0.5})
    log.log(2, {"loss": float("nan")})
    rows = [json.loads(line) for line in (tmp_path / "m" / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"step": 1, "loss": 0.5}, {"step": 2, "loss": None}]
