"""The figure of the concept statistics, and what every figure of the project draws with.

- ``plot_long_tail``: rank–frequency of concepts (log–log), coloured by head/torso/tail bucket (long_tail.png of
  ``python -m data.prep.concepts stats``).
- The shared pieces: the colour of each bucket (``BUCKET_COLOURS``, the colour-blind-safe Okabe–Ito blue, orange
  and bluish green, the same in every figure; ``bucket_colour``, ``ordered_buckets``), the style (``STYLE``,
  ``DPI``) and ``figure``, a figure of exactly ``size`` pixels saved as PNG. They live here because the buckets are
  defined here and data/ never imports imba; ``imba.plots`` draws the other figures with them.

Drawn with matplotlib on an Agg canvas (no pyplot, so no global backend or figure state). Only the plotting code
needs matplotlib: ``import data.concepts`` does not import this module, and the callers import it inside the
function that draws.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import matplotlib
import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.collections import LineCollection
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import LogLocator, NullFormatter

from .buckets import BUCKETS

DPI = 100
BUCKET_ORDER: tuple[str, ...] = BUCKETS  # of legends and lines: head, torso, tail
NAMED_CONCEPTS = 30  # concepts named on the x axis of the draws plot; beyond, the head's and the tail's halves

BUCKET_COLOURS = {"head": "#0072B2", "torso": "#E69F00", "tail": "#009E73"}
OTHER_COLOURS = ("#555555", "#CC79A7", "#56B4E9", "#D55E00")  # buckets outside head/torso/tail (e.g. held_out)
STYLE = {
    "font.size": 11,
    "axes.titlesize": 12,
    "axes.labelsize": 11,
    "xtick.labelsize": 10,
    "ytick.labelsize": 10,
    "legend.fontsize": 10,
    "figure.titlesize": 13,
    "axes.grid": True,
    "grid.color": "#e4e4e4",
    "grid.linewidth": 0.8,
    "axes.axisbelow": True,
    "axes.spines.top": False,
    "axes.spines.right": False,
}


def bucket_colour(bucket: str, others: Sequence[str] = ()) -> str:
    """The colour of a bucket: BUCKET_COLOURS for head/torso/tail, else one of OTHER_COLOURS by its place in
    ``others`` (the other bucket names of the same figure, so each gets its own colour)."""
    if bucket in BUCKET_COLOURS:
        return BUCKET_COLOURS[bucket]
    rest = [b for b in others if b not in BUCKET_COLOURS]
    return OTHER_COLOURS[rest.index(bucket) % len(OTHER_COLOURS) if bucket in rest else 0]


def ordered_buckets(buckets) -> list[str]:
    """head, torso, tail first (in that order), then any other bucket names sorted."""
    names = set(buckets)
    return [b for b in BUCKET_ORDER if b in names] + sorted(names - set(BUCKET_ORDER))


@contextmanager
def figure(path: str | os.PathLike, size: tuple[int, int]) -> Iterator[Figure]:
    """A constrained-layout figure of ``size`` pixels, saved to ``path`` as PNG when the block ends."""
    width, height = int(size[0]), int(size[1])
    if width < 100 or height < 100:
        raise ValueError(f"plot size must be at least 100 x 100 pixels, got {size!r}")
    with matplotlib.rc_context(STYLE):
        fig = Figure(figsize=(width / DPI, height / DPI), dpi=DPI, layout="constrained")
        FigureCanvasAgg(fig)
        yield fig
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, format="png", dpi=DPI)


def _bucket_legend_text(name: str, info: Mapping[str, Any]) -> str:
    text = f"{name}: {int(info['num_concepts']):,} concepts"
    if "occurrence_share" in info:
        text += f", {100 * info['occurrence_share']:.0f}% of mentions"
    if info.get("min_count") is not None:
        text += f", count ≥ {int(info['min_count']):,}"
    return text


def plot_long_tail(
    ranked: Sequence[tuple[str, int]],
    buckets: Mapping[str, str],
    path: str | os.PathLike,
    title: str | None = None,
    summary: Mapping[str, Mapping[str, Any]] | None = None,
    size: tuple[int, int] = (960, 640),
) -> Path:
    """Log–log rank–frequency plot of ``ranked`` [(concept, count), most frequent first], a PNG of ``size`` pixels.

    Points are coloured by ``buckets`` (concept -> head|torso|tail; a concept missing there counts as tail), dashed
    vertical lines mark the bucket boundaries, and the legend gives each bucket's concept count (with its share of
    mentions and lowest count when ``summary``, as ``data.concepts.bucket_summary`` returns it, is given). Concepts
    with count 0 are not drawn; with none left the figure says "no concepts found".
    """
    points = [(rank, n, buckets.get(c, "tail")) for rank, (c, n) in enumerate(ranked, 1) if n > 0]
    title = title or "Concept frequency (rank vs captions containing the concept)"
    with figure(path, size) as fig:
        ax = fig.add_subplot()
        ax.set_title(title)
        if not points:
            ax.set_axis_off()
            ax.text(0.5, 0.5, "no concepts found", ha="center", va="center", transform=ax.transAxes,
                    color="#5a5a5a", fontsize=13)
            return Path(path)
        ranks = np.array([r for r, _, _ in points], dtype=float)
        counts = np.array([n for _, n, _ in points], dtype=float)
        names = [b for _, _, b in points]
        others = ordered_buckets(names)
        colours = [bucket_colour(b, others) for b in names]
        ax.set_xscale("log")
        ax.set_yscale("log")
        if len(points) > 1:
            # segment i-1 -> i takes the colour of point i, so each bucket's stretch reads as one line
            segments = np.stack([np.column_stack([ranks[:-1], counts[:-1]]), np.column_stack([ranks[1:], counts[1:]])],
                                axis=1)
            ax.add_collection(LineCollection(segments, colors=colours[1:], linewidths=2, zorder=2))
        if len(points) <= 1000:  # dots only while they stay apart
            ax.scatter(ranks, counts, c=colours, s=22 if len(points) <= 200 else 8, zorder=3, linewidths=0)
        # whole decades on both axes, at least one on x, so at least two ticks carry a power-of-ten label
        low, high = np.floor(np.log10(counts.min())), np.ceil(np.log10(counts.max()))
        ax.set_xlim(1 / 1.12, max(10.0, ranks[-1]) * 1.12)
        ax.set_ylim(10**low / 1.12, 10 ** max(high, low + 1) * 1.12)
        for axis in (ax.xaxis, ax.yaxis):
            axis.set_major_locator(LogLocator(base=10))
            axis.set_minor_locator(LogLocator(base=10, subs=np.arange(2, 10)))
            axis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("concept rank (1 = most frequent)")
        ax.set_ylabel("captions containing the concept")
        ax.grid(True, which="major")

        boundaries = [(float(np.sqrt(ranks[i - 1] * ranks[i])), f"{names[i - 1]} | {names[i]}")
                      for i in range(1, len(names)) if names[i] != names[i - 1]]
        for x, label in boundaries:
            ax.axvline(x, color="#6e6e6e", linestyle="--", linewidth=1.2, zorder=1)
            ax.text(x, 0.03, f" {label} ", rotation=90, ha="right", va="bottom", color="#505050", fontsize=10,
                    transform=ax.get_xaxis_transform(), bbox=dict(facecolor="white", edgecolor="none", pad=1.5))

        handles = []
        for name in others:
            info = (summary or {}).get(name) or {"num_concepts": names.count(name)}
            if not info.get("num_concepts"):
                continue
            handles.append(Line2D([], [], color=bucket_colour(name, others), marker="o", linewidth=2,
                                  label=_bucket_legend_text(name, info)))
        if boundaries:
            handles.append(Line2D([], [], color="#6e6e6e", linestyle="--", linewidth=1.2, label="bucket boundary"))
        ax.legend(handles=handles, loc="upper right", framealpha=0.95)
    return Path(path)


def plot_drawn_vs_natural(
    concepts: Sequence[Sequence[Any]],
    path: str | os.PathLike,
    combinations: Sequence[Sequence[Any]] = (),
    title: str = "Draws per epoch by concept: natural vs planned",
    size: tuple[int, int] = (1200, 560),
) -> Path:
    """Draws per epoch of each concept, natural vs planned (rows [name, natural, planned], most frequent first), on a
    log scale; beside it, when given, the combinations (attribute:object, object + object) the plan boosts most."""
    ranks = np.arange(1, len(concepts) + 1)
    natural = np.array([float(r[1]) for r in concepts])
    planned = np.array([float(r[2]) for r in concepts])
    with figure(path, size) as fig:
        fig.suptitle(title)
        axes = fig.subplots(1, 2 if combinations else 1, squeeze=False)[0]
        ax = axes[0]
        ax.set_yscale("log")
        ax.plot(ranks, natural, color=BUCKET_COLOURS["head"], marker="o", markersize=4, linewidth=1.5,
                label="natural (the sources' shares alone)")
        ax.plot(ranks, planned, color=BUCKET_COLOURS["torso"], marker="o", markersize=4, linewidth=1.5,
                label="planned (balanced)")
        if len(concepts) <= NAMED_CONCEPTS:
            ax.set_xticks(ranks, [str(r[0]) for r in concepts], rotation=60, ha="right")
        else:  # the head's and the tail's names, the ranks between them unnamed
            shown = np.r_[0:NAMED_CONCEPTS // 2, len(concepts) - NAMED_CONCEPTS // 2:len(concepts)]
            ax.set_xticks(ranks[shown], [f"{concepts[i][0]} ({i + 1})" for i in shown], rotation=60, ha="right",
                          fontsize="small")
            ax.set_xlabel(f"concept (rank by natural frequency), the {NAMED_CONCEPTS // 2} most frequent and the "
                          f"{NAMED_CONCEPTS // 2} rarest of {len(concepts)} named")
        ax.set_ylabel("draws per epoch of samples naming it")
        ax.legend(loc="upper right", framealpha=0.95)
        if combinations:
            ax = axes[1]
            names = [str(r[0]) for r in combinations][::-1]
            y = np.arange(len(names))
            ax.set_xscale("log")
            ax.barh(y - 0.2, [float(r[1]) for r in combinations][::-1], height=0.4, color=BUCKET_COLOURS["head"],
                    label="natural")
            ax.barh(y + 0.2, [float(r[2]) for r in combinations][::-1], height=0.4, color=BUCKET_COLOURS["torso"],
                    label="planned")
            ax.set_yticks(y, names)
            ax.set_xlabel("draws per epoch")
            ax.set_title("most boosted combinations")
            # beside the bars, never over them
            ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), framealpha=0.95)
    return Path(path)
