"""The project's figures, drawn with matplotlib on an Agg canvas (no pyplot, so no global backend or figure state).

- ``plot_monitor``: the IMBA monitor over training, one panel per stat, one line per bucket (``imba.monitor_plot``).
- ``plot_grouped_bars``: grouped bars with confidence-interval whiskers (``bench/composition.py``).
- ``plot_scatter_2d``: 2-D sample scatters, one panel each (``bench/toy2d.py``).
- ``plot_block_diagnostics``: alignment and probe accuracy per network block, one line per bucket
  (``imba.eval.representations.diagnose``).
- ``plot_series``: panels of named point series, as lines or as scatter (``bench/composition.py``'s levers).

The figure of the concept statistics, ``plot_long_tail``, is ``data.concepts.plot``'s, and so are the pieces every
figure shares (the bucket colours, the style, ``figure``): the buckets are defined in data.concepts, and data/
never imports imba. Every function writes one PNG of exactly ``size`` pixels and returns its path; head, torso and
tail have the same colour in every figure. Only the plotting code needs matplotlib: ``import imba`` does not import
this module, and the callers import it inside the function that draws.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from data.concepts.plot import bucket_colour, figure, ordered_buckets

# one colour per series (benchmark variants) where buckets are told apart by position: Paul Tol's muted scheme
# without its greens, so no series reads as a bucket
SERIES_COLOURS = ("#777777", "#332288", "#88CCEE", "#DDCC77", "#CC6677", "#882255", "#AA4499", "#999933")
MONITOR_TITLES = {"distance": "IMBA distance (target vs unconditional)", "loss_cond": "conditional loss"}
MONITOR_YLABELS = {"distance": "mean per-token distance d", "loss_cond": "mean squared error"}


def plot_monitor(
    series: Mapping[str, Mapping[str, Sequence[tuple[int, float]]]],
    path: str | os.PathLike,
    title: str | None = "IMBA monitor per concept-frequency bucket",
    size: tuple[int, int] | None = None,
    ylabel: str | None = None,
) -> Path:
    """The IMBA monitor over training: one panel per stat (``{stat: {bucket: [(step, value), ...]}}``, as
    ``imba.monitor_plot.read_monitor`` returns it), one line per bucket, training steps on x. ``size`` defaults to
    560 x 440 pixels per panel; ``ylabel`` (one for every panel) defaults to each known stat's own label."""
    stats = [s for s in sorted(series, key=lambda s: (s not in MONITOR_TITLES, s))
             if any(len(line) for line in series[s].values())]
    if not stats:
        raise ValueError("no monitor/* columns in the metrics: was the run trained with train.concept_stats?")
    with figure(path, size or (560 * len(stats), 440)) as fig:
        axes = fig.subplots(1, len(stats), squeeze=False)[0]
        for ax, stat in zip(axes, stats):
            names = ordered_buckets(b for b, line in series[stat].items() if line)
            lowest = min(v for line in series[stat].values() for _, v in line)
            for bucket in names:
                line = series[stat][bucket]
                steps, values = zip(*line)
                ax.plot(steps, values, color=bucket_colour(bucket, names), linewidth=2, label=bucket,
                        marker="o" if len(line) <= 30 else None, markersize=4)
            if lowest >= 0:
                ax.set_ylim(bottom=0)
            ax.set_title(MONITOR_TITLES.get(stat, stat))
            ax.set_xlabel("training step")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.set_ylabel(ylabel or MONITOR_YLABELS.get(stat, stat))
            ax.legend(title="bucket", loc="best")
        if title:
            fig.suptitle(title)
    return Path(path)


def plot_grouped_bars(
    panels: Mapping[str, Mapping[str, Mapping[str, tuple[float, float]]]],
    groups: Sequence[str],
    series: Sequence[str],
    path: str | os.PathLike,
    ylabel: str,
    title: str | None = None,
    scale: float = 1.0,
    ylim: tuple[float, float] | None = None,
    size: tuple[int, int] | None = None,
) -> Path:
    """Grouped bars with whiskers: one panel per key of ``panels`` ({panel title: {series: {group: (mean,
    half-width of the confidence interval)}}}), one group of bars per entry of ``groups`` on x, one bar per entry
    of ``series`` (a series missing from a panel leaves its slot empty). Values are multiplied by ``scale``;
    whiskers are clipped to ``ylim``. Group labels that are bucket names take the bucket colours. ``size`` defaults
    to 620 x 520 pixels per panel (at least 900 wide) plus rows for the legend below."""
    if not panels or not groups or not series:
        raise ValueError("plot_grouped_bars: nothing to draw (no panels, groups or series)")
    colours = {s: SERIES_COLOURS[i % len(SERIES_COLOURS)] for i, s in enumerate(series)}
    width = 0.8 / len(series)
    legend_rows = -(-len(series) // 4)
    with figure(path, size or (max(620 * len(panels) + 60, 900), 520 + 26 * legend_rows + 40)) as fig:
        axes = fig.subplots(1, len(panels), squeeze=False, sharey=True)[0]
        for ax, (panel_title, values) in zip(axes, panels.items()):
            for g, group in enumerate(groups):
                ax.axvspan(g - 0.45, g + 0.45, color=bucket_colour(group, groups), alpha=0.07, linewidth=0, zorder=0)
            for s, name in enumerate(series):
                if name not in values:
                    continue
                xs = np.arange(len(groups)) - 0.4 + width * (s + 0.5)
                mean = np.array([values[name][g][0] for g in groups], dtype=float) * scale
                half = np.array([values[name][g][1] for g in groups], dtype=float) * scale
                lo, hi = mean - half, mean + half
                if ylim is not None:
                    lo, hi = np.clip(lo, *ylim), np.clip(hi, *ylim)
                ax.bar(xs, mean, width * 0.92, color=colours[name], zorder=2)
                shown = half > 0  # a single seed has no interval: no whisker rather than a flat cap
                ax.errorbar(xs[shown], mean[shown], yerr=[(mean - lo)[shown], (hi - mean)[shown]], fmt="none",
                            ecolor="black", elinewidth=1, capsize=2, zorder=3)
            ax.set_xticks(range(len(groups)), [g.replace("_", " ") for g in groups])
            for tick, group in zip(ax.get_xticklabels(), groups):
                tick.set_color(bucket_colour(group, groups))
                tick.set_fontweight("bold")
            ax.set_xlim(-0.5, len(groups) - 0.5)
            ax.grid(False, axis="x")
            if ylim is not None:
                ax.set_ylim(*ylim)
            ax.set_title(panel_title)
            ax.set_xlabel("pair bucket")
        axes[0].set_ylabel(ylabel)
        # below the panels: beside them, a one-panel figure's title would run into it
        fig.legend(handles=[Patch(color=colours[s], label=s) for s in series], loc="outside lower center",
                   ncols=min(len(series), 4), title="variant")
        if title:
            fig.suptitle(title)
    return Path(path)


def plot_block_diagnostics(
    result: Mapping[str, Any],
    path: str | os.PathLike,
    title: str | None = "Representation diagnostics per block",
    size: tuple[int, int] | None = None,
) -> Path:
    """What ``imba.eval.representations.diagnose`` returns, per block on x: linear CKA and mutual k-NN alignment
    with the caption features, one line per bucket ("all" dashed), then one panel per probe with its accuracy on
    each bucket's scored samples. A measure a bucket was too small for leaves a gap."""
    blocks = result["blocks"]
    if not blocks:
        raise ValueError("plot_block_diagnostics: no blocks to draw")
    probes = list(blocks[0]["probe"])
    names = ordered_buckets(result["groups"])
    x = np.arange(1, len(blocks) + 1)
    panels = [("linear CKA with the caption", "cka", None), ("mutual k-NN with the caption", "mutual_knn", None)]
    panels += [(f"linear probe for {p}: accuracy", "probe", p) for p in probes]
    with figure(path, size or (430 * len(panels), 420)) as fig:
        axes = fig.subplots(1, len(panels), squeeze=False)[0]
        for ax, (panel_title, key, probe) in zip(axes, panels):
            lines = names if probe else ["all", *names]
            for bucket in lines:
                if probe:
                    values = [b["probe"][probe].get("by_group", {}).get(bucket) for b in blocks]
                else:
                    values = [b[key].get(bucket) for b in blocks]
                y = np.array([np.nan if v is None else v for v in values], dtype=float)
                if np.isnan(y).all():
                    continue
                style = dict(color="black", linestyle="--") if bucket == "all" else dict(
                    color=bucket_colour(bucket, names))
                ax.plot(x, y, marker="o", linewidth=2, markersize=4, label=bucket.replace("_", " "), **style)
            ax.set_ylim(0, 1.02)
            ax.set_xticks(x)
            ax.set_xlabel("block")
            ax.set_title(panel_title)
            ax.legend(title="bucket", loc="best")
        if title:
            fig.suptitle(title)
    return Path(path)


def plot_series(
    panels: Mapping[str, Mapping[str, Any]],
    path: str | os.PathLike,
    ylabel: str,
    title: str | None = None,
    scatter: bool = False,
    size: tuple[int, int] | None = None,
) -> Path:
    """One panel per key of ``panels`` ({panel title: {"xlabel": str, "series": {name: [(x, y), ...]}}}), one
    colour per series name (the same in every panel), drawn as lines with markers or, with ``scatter``, as points.
    ``size`` defaults to 460 x 420 pixels per panel plus a legend row below."""
    names = list(dict.fromkeys(n for panel in panels.values() for n in panel["series"]))
    if not names:
        raise ValueError("plot_series: nothing to draw")
    colours = {n: SERIES_COLOURS[i % len(SERIES_COLOURS)] for i, n in enumerate(names)}
    legend_rows = -(-len(names) // 4)
    with figure(path, size or (max(460 * len(panels), 700), 420 + 26 * legend_rows + 40)) as fig:
        axes = fig.subplots(1, len(panels), squeeze=False, sharey=True)[0]
        for ax, (panel_title, panel) in zip(axes, panels.items()):
            for name, points in panel["series"].items():
                points = [(x, y) for x, y in points if x is not None and y is not None]
                if not points:
                    continue
                xs, ys = zip(*sorted(points) if not scatter else points)
                if scatter:
                    ax.scatter(xs, ys, color=colours[name], s=36, edgecolors="black", linewidths=0.5, zorder=2)
                else:
                    ax.plot(xs, ys, color=colours[name], marker="o", markersize=4, linewidth=2)
            if all(float(x).is_integer() for points in panel["series"].values() for x, _ in points if x is not None):
                ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.set_title(panel_title)
            ax.set_xlabel(panel["xlabel"])
        axes[0].set_ylabel(ylabel)
        fig.legend(handles=[Line2D([], [], color=colours[n], marker="o", linestyle="" if scatter else "-", label=n)
                            for n in names], loc="outside lower center", ncols=min(len(names), 4))
        if title:
            fig.suptitle(title)
    return Path(path)


@dataclass(frozen=True)
class ScatterPanel:
    """One panel of ``plot_scatter_2d``: ``points`` maps a label to (N, 2) coordinates (a bucket name as label
    picks that bucket's colour); ``crosses`` and ``rings`` are single points marked on top (e.g. true and
    estimated means)."""

    title: str
    points: Mapping[str, Any]
    crosses: Sequence[tuple[float, float]] = ()
    rings: Sequence[tuple[float, float]] = ()


def plot_scatter_2d(
    panels: Sequence[ScatterPanel],
    path: str | os.PathLike,
    xlim: tuple[float, float],
    ylim: tuple[float, float],
    title: str | None = None,
    cross_label: str = "true mean",
    ring_label: str = "mean of the samples",
    size: tuple[int, int] | None = None,
) -> Path:
    """Scatter panels in a grid of at most 2 columns, equal axis scales, one shared legend. ``size`` defaults to
    540 x 420 pixels per panel plus a title and legend row."""
    if not panels:
        raise ValueError("plot_scatter_2d: no panels to draw")
    columns = min(2, len(panels))
    rows = -(-len(panels) // columns)
    labels = ordered_buckets(label for panel in panels for label in panel.points)
    with figure(path, size or (540 * columns, 420 * rows + 90)) as fig:
        axes = fig.subplots(rows, columns, squeeze=False).ravel()
        for ax in axes[len(panels):]:
            ax.set_axis_off()
        for ax, panel in zip(axes, panels):
            for label in labels:
                if label in panel.points:
                    xy = np.asarray(panel.points[label], dtype=float).reshape(-1, 2)
                    ax.scatter(xy[:, 0], xy[:, 1], s=4, color=bucket_colour(label, labels), alpha=0.6,
                               linewidths=0, rasterized=True)
            for x, y in panel.crosses:
                ax.plot(x, y, marker="+", markersize=14, markeredgewidth=2.5, color="black", linestyle="none")
            for x, y in panel.rings:
                ax.plot(x, y, marker="o", markersize=11, markeredgewidth=2, markerfacecolor="none", color="black",
                        linestyle="none")
            ax.set_xlim(*xlim)
            ax.set_ylim(*ylim)
            ax.set_aspect("equal")
            ax.set_title(panel.title)
        for i, ax in enumerate(axes[:len(panels)]):
            # every panel has the same limits: label only the left column and the lowest panel of each column
            if i + columns >= len(panels):
                ax.set_xlabel("x₁")
            else:
                ax.tick_params(labelbottom=False)
            if i % columns == 0:
                ax.set_ylabel("x₂")
            else:
                ax.tick_params(labelleft=False)
        handles = [Line2D([], [], marker="o", linestyle="none", markersize=7, color=bucket_colour(label, labels),
                          label=f"{label} samples") for label in labels]
        if any(panel.crosses for panel in panels):
            handles.append(Line2D([], [], marker="+", markersize=12, markeredgewidth=2.5, color="black",
                                  linestyle="none", label=cross_label))
        if any(panel.rings for panel in panels):
            handles.append(Line2D([], [], marker="o", markersize=10, markeredgewidth=2, markerfacecolor="none",
                                  color="black", linestyle="none", label=ring_label))
        fig.legend(handles=handles, loc="outside lower center", ncols=len(handles))
        if title:
            fig.suptitle(title)
    return Path(path)
