"""imba.plots and data.concepts.plot: each figure is a PNG of the requested pixel size; empty input fails with a clear message."""

import sys

import pytest
from PIL import Image

from data.concepts import plot as concepts_plot
from imba import plots


def png_size(path):
    with Image.open(path) as img:
        assert img.format == "PNG"
        return img.size


def test_import_imba_does_not_load_matplotlib():
    import subprocess

    code = ("import sys, imba, data.concepts; "
            "assert not {'matplotlib', 'imba.plots', 'data.concepts.plot'} & set(sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


def test_long_tail_has_the_exact_size_and_draws_an_empty_count(tmp_path):
    counts = {f"c{i}": max(1, 5000 // (i + 1)) for i in range(300)}
    ranked = sorted(counts.items(), key=lambda kv: -kv[1])
    buckets = {c: "head" if i < 5 else "torso" if i < 40 else "tail" for i, (c, _) in enumerate(ranked)}
    out = concepts_plot.plot_long_tail(ranked, buckets, tmp_path / "sub" / "long_tail.png", title="t",
                                       size=(777, 555))
    assert out == tmp_path / "sub" / "long_tail.png" and png_size(out) == (777, 555)
    # no concept counted: the figure says so instead of failing (a caption set may name none)
    assert png_size(concepts_plot.plot_long_tail([("a", 0)], {}, tmp_path / "empty.png")) == (960, 640)


def test_monitor_has_the_exact_size_and_rejects_an_empty_series(tmp_path):
    series = {"distance": {"head": [(1, 0.1), (2, 0.2)], "tail": [(1, 0.5)]}, "loss_cond": {"head": [(2, 1.0)]}}
    assert png_size(plots.plot_monitor(series, tmp_path / "m.png", size=(900, 400))) == (900, 400)
    assert png_size(plots.plot_monitor(series, tmp_path / "d.png")) == (1120, 440)
    with pytest.raises(ValueError, match="no monitor/\\* columns"):
        plots.plot_monitor({}, tmp_path / "none.png")


def test_grouped_bars_have_the_exact_size_and_reject_empty_input(tmp_path):
    panels = {"100 steps": {"a": {"head": (0.5, 0.1), "tail": (0.2, 0.0)}, "b": {"head": (0.9, 0.3), "tail": (1, 0)}},
              "200 steps": {"a": {"head": (0.6, 0.1), "tail": (0.3, 0.05)}}}
    out = plots.plot_grouped_bars(panels, ["head", "tail"], ["a", "b"], tmp_path / "b.png", ylabel="%", scale=100,
                                  ylim=(0, 100), size=(1000, 450))
    assert png_size(out) == (1000, 450)
    with pytest.raises(ValueError, match="nothing to draw"):
        plots.plot_grouped_bars({}, ["head"], ["a"], tmp_path / "none.png", ylabel="%")


def test_scatter_has_the_exact_size_and_rejects_no_panels(tmp_path):
    panel = plots.ScatterPanel("p", {"head": [[0.0, 0.0], [1.0, 1.0]], "tail": [[2.0, 0.5]]}, crosses=[(0, 0)],
                               rings=[(2.0, 0.5)])
    out = plots.plot_scatter_2d([panel] * 3, tmp_path / "s.png", xlim=(-3, 3), ylim=(-2, 2), size=(800, 700))
    assert png_size(out) == (800, 700)
    with pytest.raises(ValueError, match="no panels"):
        plots.plot_scatter_2d([], tmp_path / "none.png", xlim=(-3, 3), ylim=(-2, 2))


def test_a_too_small_size_is_refused(tmp_path):
    with pytest.raises(ValueError, match="at least 100 x 100"):
        concepts_plot.plot_long_tail([("a", 3)], {"a": "head"}, tmp_path / "x.png", size=(50, 400))
