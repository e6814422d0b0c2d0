"""Loader throughput: precomputed shards vs a raw tar read of the same shards, and vs image loading, in one run.

    python bench/loader_throughput.py                                  # synthetic set: 2,000 images at 256 px
    python bench/loader_throughput.py --num-workers 0 2 --repeats 5 --out outputs/loader_throughput.json
    python bench/loader_throughput.py --shards 'shards/{000000..000009}.tar'       # your image shards
    python bench/loader_throughput.py --precomputed features/                      # an existing precompute output
    python bench/loader_throughput.py --smoke                                      # tiny and fast (the test)

Data. By default a deterministic synthetic image set (`data.synthetic`) is written into the cache folder
(`--cache-dir`, default outputs/loader_throughput/) and precomputed once with the tiny random VAE and T5
(`data.precompute.precompute_shards`); both are reused by later runs. `--shards SPEC` measures your image shards
instead (precomputed with the tiny encoders into the cache folder). `--precomputed DIR` uses an existing precompute
output as is; its image shards are the `source` shards named in its manifest (measured when they exist locally).
The tiny T5 is 64 wide: with T5-XXL (4096 wide) a precomputed sample holds far more bytes; pass such an output
with `--precomputed` to measure it.

Readers, each reported as samples per second:
  (a) raw tar read, precomputed shards: every member of every shard read with python's `tarfile` (all bytes, no
      decoding, samples counted by key): the I/O + tar-parsing ceiling of one process;
  (b) precomputed loader: `make_precomputed_loader` with batches of `--batch-size`, for each `--num-workers`:
      samples/s to full batch tensors (latent moments, padded T5 states, masks);
  (c) raw tar read of the image shards, as (a);
  (d) image loader: `make_indexed_loader` (PNG/JPEG decode, resize + centre crop, tensor), as (b).
Reported: the median over `--repeats` rounds of each, (b)/(a) and (d)/(c) (the fraction of the raw read rate the
loader reaches), and (b)/(d) (the speed-up of loading precomputed features over loading images), per worker count.

Method. Indexes are built and every shard is read once before timing (warm-up), so all numbers are WARM page
cache: they measure parsing and decoding, not a cold disk or a network file system. Rounds are interleaved — in
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

from data.index import load_or_build_index  # noqa: E402
from data.indexed import make_indexed_loader  # noqa: E402
from data.precompute import PrecomputeSettings, precompute_shards  # noqa: E402
from data.precomputed import load_manifest, make_precomputed_loader  # noqa: E402
from data.urls import expand_urls  # noqa: E402
from data.synthetic import write_synthetic_shards  # noqa: E402

DEFAULTS = dict(samples=2000, samples_per_shard=250, resolution=256, batch_size=32, num_workers=[0, 2], repeats=5)
SMOKE = dict(samples=32, samples_per_shard=16, resolution=32, batch_size=4, num_workers=[0, 1], repeats=2)
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
                                    f"python -m data.precompute)")
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
    print(f"precomputed shards: {out} (tiny VAE + T5, resolution {args.resolution}; computed once)", flush=True)
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


def time_loader(make: Callable[[int], Any], num_workers: int, batches: int, batch_size: int) -> tuple[int, float]:
    """(samples, seconds) for `batches` batches of a fresh loader, after its warm-up batches."""
    loader = make(num_workers)
    it = iter(loader)
    for _ in range(warm_batches(num_workers)):
        next(it)
    samples = 0
    start = time.perf_counter()
    for _ in range(batches):
        batch = next(it)
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
    name: str  # key in the results, e.g. "precomputed_loader_w2"
    label: str  # row label
    data: str  # "precomputed" or "image"
    kind: str  # "raw" or "loader"
    workers: int | None
    run: Callable[[], tuple[int, float]]
    rates: list[float] = field(default_factory=list)
    samples: int = 0

    @property
    def median(self) -> float:
        return statistics.median(self.rates)


def build_readers(args, data: dict[str, Any]) -> tuple[list[Reader], dict[str, Any]]:
    """The readers to time and a description of the two shard sets (sizes, counts); runs the warm-up."""
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
        return make_precomputed_loader(data["precomputed"], args.batch_size, num_workers=workers, manifest=manifest)

    def make_image(workers: int):
        return make_indexed_loader(data["images"], manifest["resolution"], args.batch_size, num_workers=workers,
                                   caption_field=manifest["caption_field"], min_size=manifest.get("min_size", 0))

    def raw(paths: list[str]) -> Callable[[], tuple[int, float]]:
        def run() -> tuple[int, float]:
            start = time.perf_counter()
            samples = read_tar_members(paths)[0]
            return samples, time.perf_counter() - start
        return run

    for name in sets:
        per_epoch = info[name]["indexed_samples"] // args.batch_size
        if per_epoch < 1:
            raise ValueError(f"the {name} shards hold {info[name]['indexed_samples']} samples, fewer than one batch "
                             f"of {args.batch_size}: use more samples or a smaller --batch-size")
        batches = args.batches or max(1, per_epoch - max(warm_batches(w) for w in args.num_workers))
        info[name]["timed_batches"] = batches
        info[name]["timed_samples_per_loader_run"] = batches * args.batch_size

    readers = [Reader("raw_tar_precomputed", "raw tar read", "precomputed", "raw", None, raw(sets["precomputed"]))]
    for w in args.num_workers:
        readers.append(Reader(f"precomputed_loader_w{w}", "precomputed loader", "precomputed", "loader", w,
                              lambda w=w: time_loader(make_precomputed, w, info["precomputed"]["timed_batches"],
                                                      args.batch_size)))
    if "image" in sets:
        readers.append(Reader("raw_tar_image", "raw tar read", "image", "raw", None, raw(sets["image"])))
        for w in args.num_workers:
            readers.append(Reader(f"image_loader_w{w}", "image loader (decode + resize)", "image", "loader", w,
                                  lambda w=w: time_loader(make_image, w, info["image"]["timed_batches"],
                                                          args.batch_size)))
    return readers, info


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


def summarise(readers: list[Reader], info: dict[str, Any]) -> dict[str, Any]:
    """Per-reader medians and the ratios, as stored in the JSON (unrounded)."""
    by_name = {r.name: r for r in readers}
    results = []
    ratios: dict[str, dict[str, float]] = {"precomputed_vs_raw": {}, "image_vs_raw": {}, "precomputed_vs_image": {}}
    for r in readers:
        raw = by_name[f"raw_tar_{r.data}"]
        row = {"name": r.name, "reader": r.label, "data": r.data, "kind": r.kind, "workers": r.workers,
               "samples_per_run": r.samples, "samples_per_s": r.rates, "median_samples_per_s": r.median,
               "median_mb_per_s": r.median * info[r.data]["bytes_per_sample"] / 1e6,
               "ratio_to_raw": r.median / raw.median}
        if r.kind == "loader":
            key = "precomputed_vs_raw" if r.data == "precomputed" else "image_vs_raw"
            ratios[key][str(r.workers)] = row["ratio_to_raw"]
            if r.data == "precomputed" and f"image_loader_w{r.workers}" in by_name:
                speedup = r.median / by_name[f"image_loader_w{r.workers}"].median
                row["speedup_over_image_loader"] = speedup
                ratios["precomputed_vs_image"][str(r.workers)] = speedup
        results.append(row)
    return {"results": results, "ratios": ratios}


def print_table(summary: dict[str, Any]) -> None:
    print("\n| reader | data | workers | samples/s (median) | min–max | MB/s | ratio to its raw tar read | "
          "precomputed ÷ image |")
    print("|---|---|---|---|---|---|---|---|")
    for row in summary["results"]:
        workers = "—" if row["workers"] is None else str(row["workers"])
        speedup = row.get("speedup_over_image_loader")
        print(f"| {row['reader']} | {row['data']} | {workers} | {row['median_samples_per_s']:,.0f} | "
              f"{min(row['samples_per_s']):,.0f}–{max(row['samples_per_s']):,.0f} | {row['median_mb_per_s']:,.1f} | "
              f"{row['ratio_to_raw']:.3f}× | {'—' if speedup is None else f'{speedup:.2f}×'} |")
    print("\n(MB/s = samples/s × shard file bytes per sample of that set; warm page cache.)")
    for key, what in (("precomputed_vs_raw", "precomputed loader ÷ raw tar read of the precomputed shards"),
                      ("image_vs_raw", "image loader ÷ raw tar read of the image shards"),
                      ("precomputed_vs_image", "precomputed loader ÷ image loader (speed-up)")):
        if summary["ratios"][key]:
            print(f"{what}: " + ", ".join(f"{v:.3f}× ({k} workers)" for k, v in summary["ratios"][key].items()))


# --------------------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shards", help="image shards (brace pattern, glob, folder); default: a synthetic set")
    p.add_argument("--precomputed", help="an existing precompute output folder (data.precompute); default: "
                                         "precompute the image shards with the tiny encoders into --cache-dir")
    p.add_argument("--cache-dir", default=str(DEFAULT_CACHE), help=f"where data is written (default {DEFAULT_CACHE})")
    p.add_argument("--samples", type=int, help=f"synthetic samples (default {DEFAULTS['samples']})")
    p.add_argument("--samples-per-shard", type=int, help=f"synthetic (default {DEFAULTS['samples_per_shard']})")
    p.add_argument("--resolution", type=int, help=f"image side in pixels (default {DEFAULTS['resolution']})")
    p.add_argument("--batch-size", type=int, help=f"loader batch size (default {DEFAULTS['batch_size']})")
    workers = " ".join(map(str, DEFAULTS["num_workers"]))
    p.add_argument("--num-workers", type=int, nargs="+", help=f"DataLoader worker counts (default {workers})")
    p.add_argument("--repeats", type=int, help=f"interleaved rounds; medians are reported (default "
                                               f"{DEFAULTS['repeats']})")
    p.add_argument("--batches", type=int, default=None, help="timed batches per loader run (default: the rest of "
                                                             "one epoch after the warm-up batches)")
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--smoke", action="store_true", help="tiny fast run: " + ", ".join(f"{k}={v}" for k, v in
                                                                                      SMOKE.items()))
    args = p.parse_args(argv)
    args.resolution_given = args.resolution is not None
    for key, value in (SMOKE if args.smoke else DEFAULTS).items():
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


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    data = prepare_data(args)
    readers, info = build_readers(args, data)
    env = environment()
    manifest = data["manifest"]
    print(f"\nprecomputed: {info['precomputed']['indexed_samples']} samples in {info['precomputed']['shards']} shards, "
          f"{info['precomputed']['bytes_per_sample'] / 1e3:.1f} kB/sample (latent {manifest['latent_shape']}, "
          f"T5 width {manifest['text_hidden_size']}, {manifest['max_text_tokens']} tokens max)")
    if "image" in info:
        print(f"images: {info['image']['indexed_samples']} samples in {info['image']['shards']} shards, "
              f"{info['image']['bytes_per_sample'] / 1e3:.1f} kB/sample, loaded at {manifest['resolution']} px")
    print(f"batch {args.batch_size}, workers {args.num_workers}, {args.repeats} interleaved rounds; torch "
          f"{env['torch']}, {env['torch_threads']} threads, {env['cpus_usable']} CPUs; WARM page cache (every shard "
          f"read once before timing)", flush=True)
    measure(readers, args.repeats)
    summary = summarise(readers, info)
    print_table(summary)
    result = {
        "benchmark": "loader_throughput",
        "warm_cache": True,
        "settings": {"batch_size": args.batch_size, "num_workers": args.num_workers, "repeats": args.repeats,
                     "batches": args.batches, "smoke": args.smoke, "resolution": manifest["resolution"],
                     "samples": args.samples if not (args.shards or args.precomputed) else None},
        "data": {"precomputed_dir": _shown(data["precomputed"]), "latent_shape": manifest["latent_shape"],
                 "text_hidden_size": manifest["text_hidden_size"], "max_text_tokens": manifest["max_text_tokens"],
                 "text_dtype": manifest["text_dtype"], **{f"{k}_shards": v for k, v in info.items()}},
        "environment": env,
        **summary,
    }
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
