"""The draw plan of a run: how often each sample is drawn per epoch, from its source's share (`data.sources`) and
its captions' concepts (`data.balance`); computed once, stored with a fingerprint, and described before training.

Expected draws. Source s gives D_s draws per epoch (`SourceMix`); within it, sample i gets a part proportional to
its balance factor b_i (`data.balance`): e_i = D_s * b_i / sum over s's samples of b_j. The sources' shares are
therefore exactly what the config says, balanced or not; balancing moves draws between the samples of a source.
The concept counts that the factors come from are taken over all sources, each sample at its natural rate, so a
concept that is rare in one source and common in another is not boosted.

Storage. `plan_draws` writes `draws.npy` (int64 units, `data.weighted`) and `draws.json` (the fingerprint and the
report) into the run's folder, and reuses them while the fingerprint holds: the shards (paths, sizes, times), the
sources' weights, the epoch size, the balance settings and the concept extractor. Every rank reads the same file,
so every rank draws the same stream.

The report (`draws.json`, printed by `describe_plan`, drawn by `plot_plan`): samples per epoch, each source's draws
and repeat factor, the largest expected draws of one sample per epoch, the expected share of distinct samples an
epoch shows (sum of min(1, e_i) over N; a sample of e < 1 is drawn in a fraction e of the epochs), and each
concept's draws per epoch, natural vs planned.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from .balance import (BalanceRule, ConceptTable, balance_factors, build_concept_table, entry_counts,
                      is_combination)
from .concepts.captions import iter_shard_captions
from .files import atomic_write, read_json_object, write_json
from .image_clusters import cluster_table, default_clusters, join_tables, kmeans
from .index import ShardIndex
from .remote import is_indexable_remote
from .sources import SourceMix
from .weighted import UNIT, expected_draws_to_units

__all__ = ["PLAN_VERSION", "DrawPlan", "plan_draws", "plan_fingerprint", "load_plan", "index_captions",
           "describe_plan", "plot_plan", "entry_table", "load_entry_table"]

log = logging.getLogger(__name__)

PLAN_VERSION = 1
UNITS_NAME, REPORT_NAME, PLOT_NAME = "draws.npy", "draws.json", "draws.png"
TABLE_NAME = "entries.npz"  # data.balance=imba: every sample's entries, for the online balance
REPORTED_COMBINATIONS = 20  # the most boosted pairs and bindings listed in the report


class DrawPlan:
    """`units` (int64, one per sample of the index, summing to samples_per_epoch * UNIT) and the report."""

    def __init__(self, units: np.ndarray, samples_per_epoch: int, report: dict[str, Any]):
        self.units = units
        self.samples_per_epoch = samples_per_epoch
        self.report = report

    @property
    def expected(self) -> np.ndarray:
        return self.units / UNIT


def index_captions(index: ShardIndex, caption_field: str = "caption") -> Iterator[str]:
    """The caption of every sample of `index`, in index order ("" when a sample has none), without reading images.
    A shard whose captions do not line up with its index (damaged since it was indexed) is padded or cut to its
    indexed count, with a warning."""
    for shard, (url, expected) in enumerate(zip(index.urls, index.nsamples)):
        skipped: Counter = Counter()
        got, fd, path, fetched = 0, None, url, True
        if expected and is_indexable_remote(url):
            try:  # the cache's copy, read through an open descriptor: another process's eviction cannot take it
                fd = index.open(shard)
                path = f"/dev/fd/{fd}"
            except OSError as exn:  # a shard the store does not give: its samples count as captionless
                log.warning("shard %s: %s; its %d samples are read as captionless", url, exn, expected)
                fetched = False
        try:
            for caption in iter_shard_captions(path, caption_field, skipped, keep_missing=True) if fetched else ():
                if got < expected:
                    yield caption
                got += 1
        finally:
            if fd is not None:
                os.close(fd)
        if got != expected and fetched:
            log.warning("shard %s: %d captions for %d indexed samples; the shard changed since it was indexed "
                        "(balancing treats the missing ones as captionless)", url, got, expected)
        yield from [""] * max(0, expected - got)


def _extractor(needed: bool, extractor: Callable | None) -> Callable | None:
    """`extractor`, or the default vocabulary's when none is given and one is `needed`."""
    if extractor is None and needed:
        from .concepts import default_extractor

        return default_extractor()
    return extractor


def plan_fingerprint(index: ShardIndex, mix: SourceMix, balance: BalanceRule,
                     extractor: Callable | None = None) -> str:
    """What the stored plan must have been made for to be reused: shards, sources, epoch, balance, vocabulary."""
    # The extractor counts even for a plan that reads no captions: data.balance=imba keys its entry table by it.
    extractor = _extractor(True, extractor)
    describe = getattr(extractor, "describe", lambda: {"name": type(extractor).__name__})
    parts = {
        "version": PLAN_VERSION,
        "shards": index.identity(),
        "sources": mix.describe(),
        "source_settings": mix.settings(),  # every setting of every source's kind, as data: none can be left out
        "samples_per_epoch": mix.samples_per_epoch,
        "balance": balance.settings(),
        "extractor": describe(),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:20]


def _concept_rows(table: ConceptTable, natural: np.ndarray, planned: np.ndarray) -> tuple[list, list]:
    """(single concepts, most boosted combinations): [entry, natural draws, planned draws] per epoch."""
    nat, plan = entry_counts(table, natural), entry_counts(table, planned)
    rows = [[e, float(n), float(p)] for e, n, p in zip(table.entries, nat, plan)]
    singles = sorted((r for r in rows if not is_combination(r[0])), key=lambda r: (-r[1], r[0]))
    # the largest boost first; among equal boosts (the many rare combinations one rule treats alike) the rarest
    combos = sorted((r for r in rows if is_combination(r[0]) and r[1] > 0),
                    key=lambda r: (-round(r[2] / r[1], 9), r[1], r[0]))
    return singles, combos[:REPORTED_COMBINATIONS]


def plan_draws(
    index: ShardIndex, mix: SourceMix, balance: BalanceRule, folder: str | os.PathLike, *,
    extractor: Callable | None = None, caption_field: str = "caption", workers: int = 1, progress: bool = False,
    captions: Callable[[], Iterator[str]] | None = None, features: Callable[[], np.ndarray] | None = None,
) -> DrawPlan:
    """The run's draw plan, from `folder` when its fingerprint still holds, else computed and written there.

    `captions` (default: read from the shards) returns the captions in index order; only `data.balance` reads
    them. `features` returns one row of image features per sample in index order (`data.image_clusters.
    latent_features`), which a rule balancing by image clusters (`by` images or both) needs; the clusters follow
    from the features alone (k-means, seed 0), which the shards' fingerprint covers. Call it in one process (the
    main one); the others wait for `load_plan(folder, plan_fingerprint(...))`."""
    if mix.num_samples != len(index):
        raise ValueError(f"the sources hold {mix.num_samples} samples, the index {len(index)}")
    balance.check()
    reads_captions = balance.READS_CAPTIONS
    extractor = _extractor(reads_captions, extractor)
    fingerprint = plan_fingerprint(index, mix, balance, extractor)
    plan = load_plan(folder, fingerprint)
    if plan is not None:
        balance.restore(plan.report.get("balance_found", {}))
        return plan
    natural = mix.rate
    table = image_clusters = None
    if not reads_captions:
        factors = np.ones(mix.num_samples)
    else:
        stream = captions() if captions is not None else index_captions(index, caption_field)
        table = build_concept_table(stream, extractor, workers=workers, progress=progress)
        if len(table) != mix.num_samples:
            raise ValueError(f"the concept statistics cover {len(table)} captions, the shards {mix.num_samples} "
                             f"samples: they do not belong to these shards")
        weighed = table
        if getattr(balance, "reads_images", False):
            if features is None:
                raise ValueError(f"data.balance.by={balance.by} clusters the samples' VAE latents: it needs "
                                 "precomputed features (data.precompute=true, or shards written by python -m "
                                 "data.prep.precompute)")
            rows = features()
            labels = kmeans(rows, default_clusters(len(rows)), seed=0)
            clusters = cluster_table(labels)
            weighed = clusters if balance.by == "images" else join_tables(table, clusters)
            sizes = np.bincount(labels)
            image_clusters = {"clusters": len(clusters.entries), "largest": int(sizes.max()),
                              "smallest": int(sizes[sizes > 0].min()), "features": int(rows.shape[1])}
        factors = balance_factors(weighed, balance, natural)
    expected = np.empty(mix.num_samples)
    for s, (a, b) in enumerate(zip(mix.starts[:-1], mix.starts[1:])):
        expected[a:b] = mix.draws[s] * factors[a:b] / factors[a:b].sum()
    units = expected_draws_to_units(expected, mix.samples_per_epoch)
    planned = units / UNIT
    largest = int(np.argmax(planned))
    report: dict[str, Any] = {
        "fingerprint": fingerprint,
        "num_samples": mix.num_samples,
        "samples_per_epoch": mix.samples_per_epoch,
        "sources": mix.describe(),
        "source_settings": mix.settings(),
        "balance": balance.settings(),
        "balance_line": balance.describe(),
        "balance_found": balance.found(),
        "largest_repeat": {"draws_per_epoch": float(planned[largest]), "sample": largest,
                           "source": mix.sources[int(mix.source_of([largest])[0])].name},
        "distinct_share": float(np.minimum(planned, 1.0).sum() / mix.num_samples),
        "natural_distinct_share": float(np.minimum(natural, 1.0).sum() / mix.num_samples),
    }
    if image_clusters is not None:
        report["image_clusters"] = image_clusters
    if table is not None:
        report["captions_without_entries"] = int((table.lengths() == 0).sum())
        report["concepts"], report["most_boosted_combinations"] = _concept_rows(table, natural, planned)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write(folder / UNITS_NAME, lambda f: np.save(f, units))
    write_json(folder / REPORT_NAME, report)  # written last: its fingerprint marks the plan complete
    return DrawPlan(units, mix.samples_per_epoch, report)


def load_plan(folder: str | os.PathLike, fingerprint: str | None = None) -> DrawPlan | None:
    """The plan stored in `folder` (None when absent, incomplete, or made for another fingerprint)."""
    report = read_json_object(Path(folder) / REPORT_NAME)
    if report is None or (fingerprint is not None and report.get("fingerprint") != fingerprint):
        return None
    try:
        units = np.load(Path(folder) / UNITS_NAME, allow_pickle=False)
    except (OSError, ValueError):
        return None
    total = report.get("samples_per_epoch")
    if units.dtype != np.int64 or units.ndim != 1 or len(units) != report.get("num_samples") \
            or int(units.sum()) != total * UNIT:
        return None
    return DrawPlan(units, int(total), report)


def describe_plan(plan: DrawPlan) -> list[str]:
    """What the plan draws, in a few lines for the log."""
    r = plan.report
    lines = [f"data: an epoch is {r['samples_per_epoch']:,} draws from {r['num_samples']:,} samples"
             + (f", {r['balance_line']}" if r.get("balance_line") else "")]
    for s in r["sources"]:
        lines.append(f"  {s['name']}: {s['samples']:,} samples, {s['share']:.1%} of the draws "
                     f"({s['draws']:,.0f} per epoch, each sample {s['repeat']:.3g}x)")
    top = r["largest_repeat"]
    lines.append(f"  largest repeat: sample {top['sample']} ({top['source']}) {top['draws_per_epoch']:.2f}x per epoch; "
                 f"an epoch shows {r['distinct_share']:.1%} of the samples (natural: {r['natural_distinct_share']:.1%})")
    if r.get("concepts"):
        rare = r["concepts"][-1]
        lines.append(f"  rarest concept {rare[0]!r}: {rare[1]:,.1f} -> {rare[2]:,.1f} draws per epoch; "
                     f"{r['captions_without_entries']:,} captions name no known concept (weighted like the head)")
    if r.get("image_clusters"):
        c = r["image_clusters"]
        lines.append(f"  image clusters: {c['clusters']} (k-means of {c['features']} latent features per sample), "
                     f"{c['smallest']:,} to {c['largest']:,} samples each")
    return lines


def plot_plan(plan: DrawPlan, folder: str | os.PathLike) -> Path | None:
    """draws.png in `folder`: each concept's draws per epoch, natural vs planned (log scale, most frequent first),
    and the most boosted combinations; None (nothing drawn) when the plan has no concepts. A draws.png newer than
    the stored plan's report shows that plan already and is kept (every resume reads the plan again)."""
    rows = plan.report.get("concepts")
    if not rows:
        return None
    png, report = Path(folder) / PLOT_NAME, Path(folder) / REPORT_NAME
    if png.is_file() and report.is_file() and png.stat().st_mtime_ns >= report.stat().st_mtime_ns:
        return png
    from .concepts.plot import plot_drawn_vs_natural

    combos = plan.report.get("most_boosted_combinations", [])
    return plot_drawn_vs_natural(rows, png, combinations=combos,
                                 title=f"Draws per epoch by concept: natural vs {plan.report['balance']['kind']}")



def entry_table(index: ShardIndex, folder: str | os.PathLike, fingerprint: str, extractor: Callable | None = None,
                caption_field: str = "caption", workers: int = 1, progress: bool = False) -> ConceptTable:
    """Every sample's entries (`data.balance.caption_entries`) in index order, from `folder` when stored there for
    `fingerprint`, else read from the captions and stored (`entries.npz`). Call it in the main process; the others
    wait for `load_entry_table(folder, fingerprint)`."""
    table = load_entry_table(folder, fingerprint)
    if table is not None:
        return table
    extractor = _extractor(True, extractor)
    table = build_concept_table(index_captions(index, caption_field), extractor, workers=workers, progress=progress)
    Path(folder).mkdir(parents=True, exist_ok=True)
    atomic_write(Path(folder) / TABLE_NAME, lambda f: np.savez(
        f, fingerprint=np.asarray(fingerprint), entries=np.asarray(table.entries, dtype=str), ptr=table.ptr,
        ids=table.ids))
    return table


def load_entry_table(folder: str | os.PathLike, fingerprint: str) -> ConceptTable | None:
    """The entry table stored in `folder` for `fingerprint` (None when absent, incomplete or for another one)."""
    try:
        with np.load(Path(folder) / TABLE_NAME, allow_pickle=False) as stored:
            if str(stored["fingerprint"]) != fingerprint:
                return None
            return ConceptTable([str(e) for e in stored["entries"]], stored["ptr"].astype(np.int64),
                                stored["ids"].astype(np.int32))
    except (OSError, ValueError, KeyError):
        return None
