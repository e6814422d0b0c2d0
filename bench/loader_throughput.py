"""Loader throughput: precomputed shards vs a raw tar read of the same shards, and vs image loading, in one run.

    python bench/loader_throughput.py                                  # synthetic set: 2,000 images at 256 px
    python bench/loader_throughput.py --num-workers 0 2 --repeats 5 --out outputs/loader_throughput.json
    python bench/loader_throughput.py --shards 'shards/{000000..000009}.tar'       # your image shards
    python bench/loader_throughput.py --precomputed features/                      # an existing precompute output
    python bench/loader_throughput.py --smoke                                      # tiny and fast (the test)

Data. By default a deterministic synthetic image set (`data.synthetic`) is written into the cache folder
(`--cache-dir`, default outputs/loader_throughput/) and precomputed once with the default encoders (the shipped shapes VAE, the tiny random T5)
(`data.precompute.precompute_shards`); both are reused by later runs. `--shards SPEC` measures your image shards
instead (precomputed with those encoders into the cache folder). `--precomputed DIR` uses an existing precompute
output as is; its image shards are the `source` shards named in its manifest (measured when they exist locally).
The tiny T5 is 64 wide: with T5-XXL (4096 wide) a precomputed sample holds ~30x the bytes. `--real-size` writes
shards of the real sizes instead (bench/real_size_features.py: SD-VAE latents, T5-XXL-shaped states, random values,
for each of --resolutions x --text-dtypes), or pass a real precompute output with `--precomputed`.

Readers, each reported as samples per second:
  (a) raw tar read, precomputed shards: every member of every shard read with python's `tarfile` (all bytes, no
      decoding, samples counted by key): the I/O + tar-parsing ceiling of one process;
  (b) precomputed loader: `make_precomputed_loader` with batches of `--batch-size`, for each `--num-workers`
      (worker processes) and each `--threads` (reader threads in this process): samples/s of batches that have
      reached this process (their stored bytes, packed; every page of each batch touched, as the copy to the
      device would);
  (c) raw tar read of the image shards, as (a);
  (d) image loader: `make_indexed_loader` (PNG/JPEG decode, resize + centre crop, tensor), as (b).
Reported: the median over `--repeats` rounds of each, (b)/(a) and (d)/(c) (the fraction of the raw read rate the
loader reaches), and (b)/(d) (the speed-up of loading precomputed features over loading images), per worker count.

Method. Indexes are built and every shard is read once before timing (warm-up), so the numbers are WARM page
cache: they measure parsing and decoding, not a cold disk or a network file system. `--cold` adds every reader
again with the set's pages evicted from the page cache before each of its runs (POSIX_FADV_DONTNEED). Rounds are interleaved — in
each round every reader runs once, the order reversed every other round — so machine noise hits all of them alike.
A loader measurement builds a fresh loader (untimed: index from cache, worker start), draws max(1, 2 × workers)
batches untimed to fill the prefetch pipeline, then times `--batches` batches (default: the rest of one epoch)
and shuts its workers down before the next reader runs. One process, `OMP_NUM_THREADS` as set by the caller.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import hashlib
import json
import logging
import multiprocessing
import os
import platform
import re
import statistics
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from data.balance import TemperatureBalance  # noqa: E402
from data.draw_plan import plan_draws  # noqa: E402
from data.index import load_or_build_index  # noqa: E402
from data.indexed import make_indexed_loader  # noqa: E402
from data.precompute import PrecomputeSettings, precompute_shards  # noqa: E402
from data.precomputed import load_manifest, make_precomputed_loader  # noqa: E402
from data.read_spec import ReadSpec  # noqa: E402
from data.urls import expand_urls  # noqa: E402
from data.synthetic import write_synthetic_shards  # noqa: E402
from data.sources import Source, SourceMix  # noqa: E402
from data.text_states import TEXT_DTYPES  # noqa: E402
from data.weighted import StreamBatchSampler, WeightedOrder  # noqa: E402
from real_size_features import state_errors, write_feature_set  # noqa: E402

DEFAULTS = dict(samples=2000, samples_per_shard=250, resolution=256, batch_size=32, num_workers=[0, 2], repeats=5)
SMOKE = dict(samples=32, samples_per_shard=16, resolution=32, batch_size=4, num_workers=[0, 1], repeats=2)
REAL_DEFAULTS = dict(resolutions=[256, 512], text_dtypes=["float16", "int8"], max_text_tokens=120, samples=1000)
REAL_SMOKE = dict(resolutions=[32], text_dtypes=["float16", "int8"], max_text_tokens=16)
DEFAULT_CACHE = REPO / "outputs" / "loader_throughput"
_KEY = re.compile(r"^((?:.*/|)[^.]+)[.]")  # the sample key: member name up to the first dot of its basename


# --------------------------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------------------------


def _digest(*parts: Any) -> str:
    return hashlib.sha256("\n".join(map(str, parts)).encode("utf-8")).hexdigest()[:12]


def prepare_data(args) -> dict[str, Any]:
    """Image shard paths (or None), the precomputed folder and its manifest; writes/precomputes into the cache."""
    cache = Path(args.cache_dir).expanduser().resolve()
    if args.precomputed:
        if not os.path.isdir(os.path.expanduser(args.precomputed)):
            raise FileNotFoundError(f"--precomputed {args.precomputed}: no such folder (give the output folder of "
                                    f"python -m data.prep.precompute)")
        manifest = load_manifest(os.path.expanduser(args.precomputed))
        if args.resolution_given and args.resolution != manifest["resolution"]:
            raise ValueError(f"--resolution {args.resolution} differs from the precomputed resolution "
                             f"{manifest['resolution']} in {manifest['__path__']}: drop --resolution")
        if args.shards:
            images = expand_urls(args.shards)
        else:
            sources = [s["source"] for s in manifest["shards"]]
            images = sources if all(os.path.isfile(s) for s in sources) else None
            if images is None:
                print(f"note: the source image shards of {args.precomputed} are not all local files; measuring the "
                      f"precomputed shards only (pass --shards to name the image shards)", flush=True)
        return {"images": images, "precomputed": os.path.dirname(manifest["__path__"]), "manifest": manifest}

    if args.shards:
        images = [os.path.abspath(p) for p in expand_urls(args.shards)]
        out = cache / f"precomputed-{_digest(*images, args.resolution)}"
    else:
        folder = cache / f"synthetic-{args.samples}-{args.samples_per_shard}-{args.resolution}px"
        print(f"synthetic image shards: {folder} ({args.samples} samples at {args.resolution} px; written once)",
              flush=True)
        images = write_synthetic_shards(folder, num_samples=args.samples, samples_per_shard=args.samples_per_shard,
                                        resolution=args.resolution)
        out = cache / f"{folder.name}-precomputed"
    print(f"precomputed shards: {out} (shapes VAE, tiny T5, resolution {args.resolution}; computed once)", flush=True)
    start = time.perf_counter()
    report = precompute_shards(images, out, PrecomputeSettings(resolution=args.resolution), batch_size=32)
    if report["written"]:
        print(f"  precomputed {report['samples']} samples in {len(report['written'])} shards in "
              f"{time.perf_counter() - start:.1f} s", flush=True)
    if report["manifest"] is None:
        raise RuntimeError(f"precompute into {out} did not complete")
    return {"images": images, "precomputed": str(out), "manifest": load_manifest(out)}


# --------------------------------------------------------------------------------------------------------------
# Readers
# --------------------------------------------------------------------------------------------------------------


def read_tar_members(paths: Sequence[str]) -> tuple[int, int, int]:
    """Read every regular member of every shard in full, no decoding: (samples, members, bytes of member data)."""
    samples = members = nbytes = 0
    for path in paths:
        current = None
        with open(path, "rb") as f, tarfile.open(fileobj=f, mode="r:") as tf:
            while True:
                info = tf.next()
                if info is None:
                    break
                if info.isreg():
                    nbytes += len(tf.extractfile(info).read())
                    members += 1
                    match = _KEY.match(info.name)
                    key = match.group(1) if match else info.name
                    if key != current:
                        samples += 1
                        current = key
                tf.members.clear()  # keep memory flat on big shards
    return samples, members, nbytes


def _wait_for_workers(timeout: float = 60.0) -> None:
    """Return once no DataLoader worker of ours is alive, so the next reader runs on an idle machine."""
    deadline = time.monotonic() + timeout
    while multiprocessing.active_children():
        if time.monotonic() > deadline:
            print(f"warning: {len(multiprocessing.active_children())} loader workers still alive after {timeout:.0f} s",
                  file=sys.stderr, flush=True)
            return
        time.sleep(0.01)


def warm_batches(num_workers: int) -> int:
    return max(1, 2 * num_workers)  # fills the DataLoader's prefetch queue (prefetch_factor 2 per worker)


def touch(batch: dict[str, Any]) -> None:
    """Read one byte of every page of the batch's tensors, as the training step's copy to the device would: a
    batch from a worker arrives as shared memory that this process has not mapped in yet."""
    for value in batch.values():
        if isinstance(value, torch.Tensor) and value.numel():
            value.contiguous().view(-1).view(torch.uint8)[::4096].sum()


def time_loader(make: Callable[[int], Any], num_workers: int, batches: int, batch_size: int,
                before: Callable[[], None] = lambda: None) -> tuple[int, float]:
    """(samples, seconds) for `batches` batches of a fresh loader, after its warm-up batches; `before` runs
    first (untimed), e.g. to evict the shards from the page cache."""
    before()
    loader = make(num_workers)
    it = iter(loader)
    for _ in range(warm_batches(num_workers)):
        touch(next(it))
    samples = 0
    start = time.perf_counter()
    for _ in range(batches):
        batch = next(it)
        touch(batch)
        samples += len(batch["keys"])
    seconds = time.perf_counter() - start
    if samples != batches * batch_size:
        raise RuntimeError(f"expected full batches of {batch_size}, got {samples} samples in {batches} batches")
    it.close()
    del it, loader, batch
    gc.collect()  # the DataLoader iterator shuts its workers down when it is freed
    _wait_for_workers()
    return samples, seconds


@dataclass
class Reader:
    name: str  # key in the results, e.g. "precomputed_loader_w2", or "256px-int8/cold/precomputed_loader_w2"
    label: str  # row label
    data: str  # "precomputed" or "image"
    kind: str  # "raw" or "loader"
    workers: int | None
    run: Callable[[], tuple[int, float]]
    group: str = ""  # the shard set (real-size mode: "256px-float16", ...)
    cache: str = "warm"  # "warm" or "cold" (the set's pages evicted before each run)
    threads: int = 0  # reader threads of the precomputed loader (in the main process; workers is then 0)
    weighted: bool = False  # drawn by the weighted stream (--weighted) instead of the uniform order
    rates: list[float] = field(default_factory=list)
    samples: int = 0

    @property
    def median(self) -> float:
        return statistics.median(self.rates)


def weighted_stream(data: dict[str, Any], args) -> WeightedOrder:
    """The weighted stream a run with data.sources + data.balance draws over the precomputed shards: the first half
    of the shards one source (30 % of the draws), the rest another (70 %), balanced by temperature (alpha 1) from
    the stored captions; the plan is stored in the cache folder like a run's."""
    paths = sorted(expand_urls(data["precomputed"]))
    if len(paths) < 2:
        raise ValueError("--weighted splits the shards into two sources: it needs 2 shards or more")
    half = len(paths) // 2
    sources = [Source("first", paths[:half], share=0.3), Source("second", paths[half:], share=0.7)]
    index = load_or_build_index(paths)
    mix = SourceMix(sources, index.nsamples)
    plan = plan_draws(index, mix, TemperatureBalance(alpha=1.0),
                      Path(args.cache_dir).expanduser() / f"plan-{_digest(*paths)}")
    print(f"weighted stream: {plan.report['sources'][0]['samples']} + {plan.report['sources'][1]['samples']} samples "
          f"at 30 / 70 %, largest repeat {plan.report['largest_repeat']['draws_per_epoch']:.2f}x per epoch", flush=True)
    return WeightedOrder(plan.units, plan.samples_per_epoch, seed=0)


def build_readers(args, data: dict[str, Any], group: str = "",
                  caches: Sequence[str] = ("warm",)) -> tuple[list[Reader], dict[str, Any]]:
    """The readers to time, for each page-cache state in `caches`, and a description of the two shard sets
    (sizes, counts); runs the warm-up."""
    manifest = data["manifest"]
    sets = {"precomputed": sorted(expand_urls(data["precomputed"]))}
    if data["images"]:
        sets["image"] = list(data["images"])
    info: dict[str, Any] = {}
    for name, paths in sets.items():
        # warm-up: indexes built/loaded, every byte read once into the page cache
        index = load_or_build_index(paths)
        samples, members, nbytes = read_tar_members(paths)
        file_bytes = sum(os.path.getsize(p) for p in paths)
        info[name] = {"shards": len(paths), "first_shard": _shown(paths[0]), "samples_in_tars": samples,
                      "indexed_samples": len(index), "members": members, "member_bytes": nbytes,
                      "file_bytes": file_bytes, "bytes_per_sample": file_bytes / max(1, samples)}

    def make_precomputed(workers: int):
        return make_precomputed_loader(data["precomputed"], ReadSpec(batch_size=args.batch_size, num_workers=workers),
                                       manifest=manifest)

    def make_threaded(threads: int):
        spec = ReadSpec(batch_size=args.batch_size, loader_threads=threads)
        return make_precomputed_loader(data["precomputed"], spec, manifest=manifest)

    weighted_order = weighted_stream(data, args) if args.weighted else None

    def make_weighted(workers: int, threads: int = 0):
        sampler = StreamBatchSampler(weighted_order, args.batch_size)
        spec = ReadSpec(batch_size=args.batch_size, num_workers=workers, loader_threads=threads)
        return make_precomputed_loader(data["precomputed"], spec, manifest=manifest, sampler=sampler)

    def make_weighted_threaded(threads: int):
        return make_weighted(0, threads)

    def make_image(workers: int):
        spec = ReadSpec(resolution=manifest["resolution"], batch_size=args.batch_size, num_workers=workers,
                        caption_field=manifest["caption_field"], min_size=manifest.get("min_size", 0))
        return make_indexed_loader(data["images"], spec)

    def raw(paths: list[str], before: Callable[[], None]) -> Callable[[], tuple[int, float]]:
        def run() -> tuple[int, float]:
            before()
            start = time.perf_counter()
            samples = read_tar_members(paths)[0]
            return samples, time.perf_counter() - start
        return run

    for name in sets:
        per_epoch = info[name]["indexed_samples"] // args.batch_size
        if per_epoch < 1:
            raise ValueError(f"the {name} shards hold {info[name]['indexed_samples']} samples, fewer than one batch "
                             f"of {args.batch_size}: use more samples or a smaller --batch-size")
        batches = args.batches or max(1, per_epoch - max(warm_batches(w) for w in [*args.num_workers, *args.threads]))
        info[name]["timed_batches"] = batches
        info[name]["timed_samples_per_loader_run"] = batches * args.batch_size

    readers = []
    prefix = f"{group}/" if group else ""
    for cache in caches:
        where = prefix + ("" if cache == "warm" else "cold/")
        for data_name, label, make in (("precomputed", "precomputed loader", make_precomputed),
                                       ("image", "image loader (decode + resize)", make_image)):
            if data_name not in sets:
                continue
            paths = sets[data_name]
            before = (lambda paths=paths: evict(paths)) if cache == "cold" else (lambda: None)
            readers.append(Reader(f"{where}raw_tar_{data_name}", "raw tar read", data_name, "raw", None,
                                  raw(paths, before), group, cache))
            for w in args.num_workers:
                readers.append(Reader(
                    f"{where}{data_name}_loader_w{w}", label, data_name, "loader", w,
                    lambda w=w, make=make, data_name=data_name, before=before: time_loader(
                        make, w, info[data_name]["timed_batches"], args.batch_size, before),
                    group, cache))
            if data_name == "precomputed" and weighted_order is not None:
                for w in args.num_workers:
                    readers.append(Reader(
                        f"{where}precomputed_weighted_w{w}", "precomputed loader, weighted stream", data_name,
                        "loader", w, lambda w=w, before=before: time_loader(
                            make_weighted, w, info["precomputed"]["timed_batches"], args.batch_size, before),
                        group, cache, weighted=True))
                for t in args.threads:
                    readers.append(Reader(
                        f"{where}precomputed_weighted_t{t}", f"precomputed loader, weighted stream, {t} reader threads",
                        data_name, "loader", 0, lambda t=t, before=before: time_loader(
                            make_weighted_threaded, t, info["precomputed"]["timed_batches"], args.batch_size, before),
                        group, cache, threads=t, weighted=True))
            if data_name == "precomputed":
                for t in args.threads:
                    readers.append(Reader(
                        f"{where}precomputed_loader_t{t}", f"precomputed loader, {t} reader threads", data_name,
                        "loader", 0, lambda t=t, before=before: time_loader(
                            make_threaded, t, info["precomputed"]["timed_batches"], args.batch_size, before),
                        group, cache, threads=t))
    return readers, info


def evict(paths: Sequence[str]) -> None:
    """Drop the files' pages from the page cache (POSIX_FADV_DONTNEED: clean pages of these files only; no
    privileges needed), so that the next read comes from the storage device."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def measure(readers: list[Reader], repeats: int) -> None:
    """`repeats` interleaved rounds; the order is reversed every other round."""
    for r in range(repeats):
        order = readers if r % 2 == 0 else readers[::-1]
        for reader in order:
            samples, seconds = reader.run()
            reader.samples = samples
            reader.rates.append(samples / seconds)
        print(f"  round {r + 1}/{repeats}: " + ", ".join(f"{x.name} {x.rates[-1]:,.0f}/s" for x in readers),
              flush=True)


def _prefix(r: Reader) -> str:
    return (f"{r.group}/" if r.group else "") + ("" if r.cache == "warm" else "cold/")


def summarise(readers: list[Reader], infos: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per-reader medians and the ratios, as stored in the JSON (unrounded); `infos[group]` describes the shard
    sets of each group. Ratios are keyed by "[group/][cold/]workers"."""
    by_name = {r.name: r for r in readers}
    results = []
    ratios: dict[str, dict[str, float]] = {"precomputed_vs_raw": {}, "image_vs_raw": {}, "precomputed_vs_image": {},
                                           "weighted_vs_raw": {}, "weighted_vs_uniform": {}}
    for r in readers:
        prefix = _prefix(r)
        raw = by_name[f"{prefix}raw_tar_{r.data}"]
        info = infos[r.group][r.data]
        row = {"name": r.name, "group": r.group, "cache": r.cache, "reader": r.label, "data": r.data,
               "kind": r.kind, "workers": r.workers, "threads": r.threads, "samples_per_run": r.samples, "samples_per_s": r.rates,
               "median_samples_per_s": r.median, "median_mb_per_s": r.median * info["bytes_per_sample"] / 1e6,
               "ratio_to_raw": r.median / raw.median}
        if r.kind == "loader":
            row["mb_per_s_per_worker"] = row["median_mb_per_s"] / max(1, r.workers, r.threads)
            key = "weighted_vs_raw" if r.weighted else "precomputed_vs_raw" if r.data == "precomputed" else "image_vs_raw"
            ratios[key][f"{prefix}{f't{r.threads}' if r.threads else r.workers}"] = row["ratio_to_raw"]
            how = f"t{r.threads}" if r.threads else f"w{r.workers}"
            uniform = by_name.get(f"{prefix}precomputed_loader_{how}")
            if r.weighted and uniform is not None:
                row["ratio_to_uniform"] = r.median / uniform.median
                ratios["weighted_vs_uniform"][f"{prefix}{how.lstrip('w')}"] = row["ratio_to_uniform"]
            image = by_name.get(f"{prefix}image_loader_w{r.workers}")
            if r.data == "precomputed" and image is not None and not r.threads and not r.weighted:
                speedup = r.median / image.median
                row["speedup_over_image_loader"] = speedup
                ratios["precomputed_vs_image"][f"{prefix}{r.workers}"] = speedup
        results.append(row)
    return {"results": results, "ratios": ratios}


def print_table(summary: dict[str, Any]) -> None:
    print("\n| set | cache | reader | data | workers | samples/s (median) | min–max | MB/s | ratio to its raw tar "
          "read | precomputed ÷ image |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in summary["results"]:
        workers = "—" if row["workers"] is None else str(row["workers"])
        speedup = row.get("speedup_over_image_loader")
        print(f"| {row['group'] or 'default'} | {row['cache']} | {row['reader']} | {row['data']} | {workers} | "
              f"{row['median_samples_per_s']:,.0f} | {min(row['samples_per_s']):,.0f}–{max(row['samples_per_s']):,.0f}"
              f" | {row['median_mb_per_s']:,.1f} | {row['ratio_to_raw']:.3f}× | "
              f"{'—' if speedup is None else f'{speedup:.2f}×'} |")
    print("\n(MB/s = samples/s × shard file bytes per sample of that set.)")
    for key, what in (("precomputed_vs_raw", "precomputed loader ÷ raw tar read of the precomputed shards"),
                      ("image_vs_raw", "image loader ÷ raw tar read of the image shards"),
                      ("precomputed_vs_image", "precomputed loader ÷ image loader (speed-up)"),
                      ("weighted_vs_raw", "precomputed loader, weighted stream ÷ raw tar read"),
                      ("weighted_vs_uniform", "weighted stream ÷ uniform order, same loader")):
        if summary["ratios"][key]:
            print(f"{what}: " + ", ".join(f"{v:.3f}× ({k} workers)" for k, v in summary["ratios"][key].items()))


# --------------------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shards", help="image shards (brace pattern, glob, folder); default: a synthetic set")
    p.add_argument("--precomputed", help="an existing precompute output folder (data.precompute); default: "
                                         "precompute the image shards with the default encoders into --cache-dir")
    p.add_argument("--cache-dir", default=str(DEFAULT_CACHE), help=f"where data is written (default {DEFAULT_CACHE})")
    p.add_argument("--samples", type=int, help=f"synthetic samples (default {DEFAULTS['samples']})")
    p.add_argument("--samples-per-shard", type=int, help=f"synthetic (default {DEFAULTS['samples_per_shard']})")
    p.add_argument("--resolution", type=int, help=f"image side in pixels (default {DEFAULTS['resolution']})")
    p.add_argument("--batch-size", type=int, help=f"loader batch size (default {DEFAULTS['batch_size']})")
    workers = " ".join(map(str, DEFAULTS["num_workers"]))
    p.add_argument("--num-workers", type=int, nargs="+", help=f"DataLoader worker counts (default {workers})")
    p.add_argument("--threads", type=int, nargs="*", default=[],
                   help="also time the precomputed loader with this many reader threads in the main process "
                        "(data.loader_threads), e.g. --threads 1 2")
    p.add_argument("--repeats", type=int, help=f"interleaved rounds; medians are reported (default "
                                               f"{DEFAULTS['repeats']})")
    p.add_argument("--batches", type=int, default=None, help="timed batches per loader run (default: the rest of "
                                                             "one epoch after the warm-up batches)")
    p.add_argument("--real-size", action="store_true",
                   help="measure precomputed shards at the real model's sizes instead (SD-VAE latents, T5-XXL states "
                        "of --max-text-tokens tokens, random values: bench/real_size_features.py), one set per "
                        "--resolutions x --text-dtypes")
    p.add_argument("--resolutions", type=int, nargs="+", help="real-size mode: image sides (default 256 512)")
    p.add_argument("--text-dtypes", nargs="+", choices=TEXT_DTYPES,
                   help="real-size mode: storage of the T5 states (default float16 int8)")
    p.add_argument("--max-text-tokens", type=int, help="real-size mode: caption length limit (default 120, "
                                                       "PixArt-alpha's)")
    p.add_argument("--weighted", action="store_true",
                   help="also time the precomputed loader drawing the weighted stream of data.sources + data.balance "
                        "(the shards as two sources, 30 %% / 70 %% of the draws, temperature balance, alpha 1)")
    p.add_argument("--cold", action="store_true",
                   help="also time every reader on a cold page cache (the set's pages evicted before each run)")
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--smoke", action="store_true", help="tiny fast run: " + ", ".join(f"{k}={v}" for k, v in
                                                                                      SMOKE.items()))
    args = p.parse_args(argv)
    args.resolution_given = args.resolution is not None
    if args.real_size and (args.shards or args.precomputed):
        p.error("--real-size writes its own shards: drop --shards / --precomputed")
    defaults = dict(SMOKE if args.smoke else DEFAULTS)
    real = REAL_SMOKE if args.smoke else REAL_DEFAULTS
    defaults.update({k: v for k, v in real.items() if args.real_size or k != "samples"})
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if (args.samples < 1 or args.samples_per_shard < 1 or args.resolution < 8 or args.batch_size < 1
            or args.repeats < 1 or min(args.num_workers) < 0 or (args.batches is not None and args.batches < 1)):
        p.error("need --samples, --samples-per-shard, --batch-size, --repeats, --batches >= 1, --resolution >= 8, "
                "--num-workers >= 0")
    args.num_workers = list(dict.fromkeys(args.num_workers))
    return args


def environment() -> dict[str, Any]:
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
    }


def _shown(path: str) -> str:
    """Paths inside the repository are recorded relative to it (results files are committed)."""
    try:
        return os.path.relpath(path, REPO) if Path(path).resolve().is_relative_to(REPO) else path
    except (OSError, ValueError):
        return path


def real_size_sets(args) -> dict[str, dict[str, Any]]:
    """{group: data} for each (resolution, text dtype) of the real-size mode, written into the cache once."""
    cache = Path(args.cache_dir).expanduser().resolve()
    groups = {}
    for resolution in args.resolutions:
        for text_dtype in args.text_dtypes:
            folder = cache / (f"real-size-{resolution}px-{text_dtype}-{args.samples}-{args.samples_per_shard}-"
                              f"{args.max_text_tokens}tok")
            start = time.perf_counter()
            manifest = write_feature_set(folder, samples=args.samples, samples_per_shard=args.samples_per_shard,
                                         resolution=resolution, text_dtype=text_dtype,
                                         max_text_tokens=args.max_text_tokens)
            print(f"real-size features {resolution} px, {text_dtype}: {folder} ({time.perf_counter() - start:.1f} s)",
                  flush=True)
            groups[f"{resolution}px-{text_dtype}"] = {"images": None, "precomputed": str(folder), "manifest": manifest}
    return groups


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    groups = real_size_sets(args) if args.real_size else {"": prepare_data(args)}
    caches = ("warm", "cold") if args.cold else ("warm",)
    readers, infos = [], {}
    for group, data in groups.items():
        group_readers, infos[group] = build_readers(args, data, group, caches)
        readers += group_readers
    env = environment()
    for group, data in groups.items():
        info, manifest = infos[group], data["manifest"]
        print(f"\n{group or 'precomputed'}: {info['precomputed']['indexed_samples']} samples in "
              f"{info['precomputed']['shards']} shards, {info['precomputed']['bytes_per_sample'] / 1e3:.1f} kB/sample "
              f"(latent {manifest['latent_shape']}, T5 width {manifest['text_hidden_size']}, "
              f"{manifest['max_text_tokens']} tokens max, {manifest['text_dtype']})")
        if "image" in info:
            print(f"images: {info['image']['indexed_samples']} samples in {info['image']['shards']} shards, "
                  f"{info['image']['bytes_per_sample'] / 1e3:.1f} kB/sample, loaded at {manifest['resolution']} px")
    cache_note = ("WARM page cache (every shard read once before timing) and COLD (the set's pages evicted "
                  "before each cold run)" if args.cold else "WARM page cache (every shard read once before timing)")
    print(f"batch {args.batch_size}, workers {args.num_workers}, {args.repeats} interleaved rounds; torch "
          f"{env['torch']}, {env['torch_threads']} threads, {env['cpus_usable']} CPUs; {cache_note}", flush=True)
    measure(readers, args.repeats)
    summary = summarise(readers, infos)
    print_table(summary)

    def described(group: str) -> dict[str, Any]:
        manifest, data = groups[group]["manifest"], groups[group]
        return {"precomputed_dir": _shown(data["precomputed"]), "resolution": manifest["resolution"],
                "latent_shape": manifest["latent_shape"], "text_hidden_size": manifest["text_hidden_size"],
                "max_text_tokens": manifest["max_text_tokens"], "text_dtype": manifest["text_dtype"],
                **{f"{k}_shards": v for k, v in infos[group].items()}}

    result = {
        "benchmark": "loader_throughput",
        "warm_cache": not args.cold,
        "caches": list(caches),
        "settings": {"batch_size": args.batch_size, "num_workers": args.num_workers, "repeats": args.repeats,
                     "batches": args.batches, "smoke": args.smoke, "real_size": args.real_size,
                     "weighted": args.weighted,
                     "samples": args.samples if not (args.shards or args.precomputed) else None},
        "data": described("") if not args.real_size else {g: described(g) for g in groups},
        "environment": env,
        **summary,
    }
    if args.real_size:
        result["settings"].update(resolutions=args.resolutions, text_dtypes=args.text_dtypes,
                                  max_text_tokens=args.max_text_tokens)
        result["text_state_errors"] = {dtype: state_errors(dtype) for dtype in TEXT_DTYPES}
        print("\nstorage of real-shaped T5 states (bench/real_size_features.py: 4,096 random tokens):")
        for dtype, err in result["text_state_errors"].items():
            print(f"  {dtype}: {err['bytes_per_token']:,.0f} bytes/token, relative RMS error "
                  f"{err['relative_rms_error']:.2e}, largest error {err['max_error_over_token_absmax']:.2e} of the "
                  f"token's largest |value|")
    else:
        result["settings"]["resolution"] = groups[""]["manifest"]["resolution"]
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"\nresults -> {out}")
    return result


if __name__ == "__main__":
    try:
        main()
    except (ValueError, FileNotFoundError) as err:
        sys.exit(f"error: {err}")
