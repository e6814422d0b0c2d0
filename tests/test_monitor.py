"""Metric windows and the JSONL log."""

import json
import math

import torch

import pytest

from imba.loss import IMBALoss
from imba.monitor import BucketMonitor
from imba.monitor_plot import main as plot_main
from imba.monitor_plot import read_monitor
from imba.training.metrics import JsonlLogger, MetricWindow
from imba.training_loss import PlainTrainingLoss


def test_window_averages_scalars_skips_vectors_and_clears():
    w = MetricWindow()
    w.add({"loss": torch.tensor(1.0), "distance_per_sample": torch.ones(4), "lr": 0.5})
    w.add({"loss": torch.tensor(3.0), "lr": 0.5})
    assert w.means() == {"loss": 2.0, "lr": 0.5}
    assert w.means() == {}


def test_window_skips_per_sample_stats_even_for_a_batch_of_one():
    w = MetricWindow()
    w.add({"loss": torch.tensor(1.0), "distance_per_sample": torch.ones(1), "loss_cond_per_sample": torch.ones(1)})
    assert w.means() == {"loss": 1.0}


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


def test_bucket_monitor_averages_per_bucket_and_ignores_unlabelled_and_nan():
    m = BucketMonitor()
    m.add(["head", "tail", None, "tail"], {"distance_per_sample": torch.tensor([1.0, 4.0, 100.0, 6.0]),
                                           "loss_cond_per_sample": torch.tensor([0.5, float("nan"), 9.0, 0.3])})
    m.add(["head"], {"distance_per_sample": torch.tensor([3.0]), "loss_cond_per_sample": torch.tensor([0.1])})
    got = m.means()
    assert got["monitor/distance_head"] == 2.0 and got["monitor/distance_tail"] == 5.0
    assert math.isnan(got["monitor/distance_torso"])
    assert got["monitor/loss_cond_head"] == pytest.approx(0.3) and got["monitor/loss_cond_tail"] == pytest.approx(0.3)
    # the keys stay (same keys on every rank and every window), the values reset
    again = m.means()
    assert list(again) == list(got) and all(math.isnan(v) for v in again.values())


def test_bucket_monitor_checks_label_count():
    with pytest.raises(ValueError, match="2 labels for 3 values"):
        BucketMonitor().add(["head", "tail"], {"distance_per_sample": torch.zeros(3)})


def test_loss_stats_feed_the_monitor_with_the_rows_they_define():
    torch.manual_seed(0)
    pc, pu, t = torch.randn(3, 4, 4, 4), torch.randn(3, 4, 4, 4), torch.randn(3, 4, 4, 4)
    drop = torch.tensor([False, True, False])
    _, stats = IMBALoss(patch_size=2, reference="cond")(pc, pu, t, drop=drop)
    assert torch.isnan(stats["loss_cond_per_sample"][1]) and torch.isnan(stats["distance_per_sample"][1])
    assert torch.allclose(stats["loss_cond_per_sample"][[0, 2]], (pc - t).pow(2).flatten(1).mean(1)[[0, 2]])
    # plain loss: rows trained with the null caption are not conditional errors
    noised = type("N", (), {"noisy": pc, "timesteps": torch.zeros(3), "target": t})()
    cond = (torch.ones(3, 2, 5), torch.ones(3, 2))
    null = (torch.zeros(3, 2, 5), torch.ones(3, 2))
    _, stats = PlainTrainingLoss()(lambda x, *_: x, noised, cond, null, drop=drop)
    per = stats["loss_cond_per_sample"]
    assert torch.isnan(per[1]) and torch.allclose(per[[0, 2]], (pc - t).pow(2).flatten(1).mean(1)[[0, 2]])


def test_monitor_plot_reads_jsonl_and_draws(tmp_path):
    log = JsonlLogger(tmp_path / "metrics.jsonl")
    for step in (10, 20, 30):
        log.log(step, {"loss": 1.0, "monitor/distance_head": 0.1 * step, "monitor/distance_tail": 0.2 * step,
                       "monitor/loss_cond_tail": float("nan"), "monitor/loss_cond_head": 1.0 / step})
    series = read_monitor(tmp_path / "metrics.jsonl")
    assert series["distance"]["tail"] == [(10, 2.0), (20, 4.0), (30, 6.0)]
    assert "tail" not in series["loss_cond"]  # NaN (logged as null) is skipped
    assert plot_main([str(tmp_path / "metrics.jsonl")]) == 0
    assert (tmp_path / "monitor.png").stat().st_size > 1000
    (tmp_path / "empty.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n")
    assert plot_main([str(tmp_path / "empty.jsonl")]) == 2


def test_monitor_plot_out_has_one_panel_per_stat(tmp_path):
    from PIL import Image

    rows = [{"step": s, "monitor/distance_head": 0.1 * s, "monitor/loss_cond_tail": 1.0 / s} for s in (1, 2)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert plot_main([str(tmp_path / "metrics.jsonl"), "--out", str(tmp_path / "fig6.png")]) == 0
    with Image.open(tmp_path / "fig6.png") as img:
        assert img.format == "PNG" and img.size == (2 * 560, 440)
    assert plot_main([str(tmp_path / "missing.jsonl")]) == 2


def test_auto_concept_stats_are_counted_again_when_the_synthetic_set_is_rewritten(tmp_path):
    import os
    from types import SimpleNamespace

    from data.synthetic import write_synthetic_shards
    from imba.training.config import load_config
    from imba.training.inputs import concept_bucketer

    cfg = load_config([])  # concept_stats=auto on the synthetic set
    accelerator = SimpleNamespace(is_main_process=True, wait_for_everyone=lambda: None)
    stats = tmp_path / "concepts" / "concepts.json"

    def counted(num_samples):
        shards = write_synthetic_shards(tmp_path / "shards", num_samples=num_samples, resolution=32)
        assert concept_bucketer(cfg, accelerator, shards, tmp_path) is not None
        return json.loads(stats.read_text())["num_captions"]

    assert counted(8) == 8
    os.utime(stats, (1, 1))  # older than the shards (file times may be coarse): counted again
    assert counted(8) == 8 and stats.stat().st_mtime > 1
    first = stats.stat().st_mtime
    assert counted(8) == 8 and stats.stat().st_mtime == first  # unchanged set: the file is reused
    assert counted(12) == 12  # other settings rewrite the set, and the statistics follow
