"""The loader over shards on object storage: samples/s from an S3 server on 127.0.0.1 (moto) against the raw
sequential read of the same bytes from it, bytes downloaded per sample trained, and what a cache smaller than the
set and a per-request latency do to each order.

Data: precomputed features at the real model's sizes (`bench/real_size_features.py`: SD-VAE latents at 256 px,
T5-XXL states of up to 120 tokens in float16, about 0.75 MB a sample). Designs, each from a cold cache:
- raw: every shard read once, in order, with the storage client's download call (fsspec `get_file`): the bar;
- indexed, cold cache: the training loader (`data.precomputed.make_precomputed_loader`, a uniform global shuffle)
  over the s3:// URLs from an empty cache: the index built first (which downloads every shard once, 8 at a time,
  into the cache), then one epoch read; warm cache: the next epoch (or a resumed run), read from the cache;
- small cache: the same with `data.cache_limit` a quarter of the set: a global shuffle then downloads a shard for
  almost every sample, and `shard_window=k` (k shards at a time, samples shuffled within them) trades shuffle quality
  for locality. Shuffle quality: the distinct shards of a batch divided by those of a uniform shuffle's batch
  (1 = as mixed as a full shuffle).
Each design is run `--repeats` times in turn (median, min and max); `--latency-ms` adds a wait before every answer
of the server, as a network round trip does. The server runs in a process of its own, as a store runs on another
machine; bytes downloaded are counted by the cache (`ShardCache.bytes_downloaded`).

    python bench/remote_loader.py --samples 512 --samples-per-shard 32 --repeats 3 --latency-ms 0 20
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))  # the S3 server the tests use

from data import remote  # noqa: E402
from data.order import IndexedBatchSampler  # noqa: E402
from data.precomputed import make_precomputed_loader  # noqa: E402
from data.read_spec import ReadSpec  # noqa: E402
from data.remote import ShardCache  # noqa: E402
from real_size_features import write_feature_set  # noqa: E402
from remote_servers import CREDENTIALS, Faults, S3Server  # noqa: E402


def raw_read(urls: list[str], folder: str) -> None:
    """Every shard downloaded once, in order, by the storage client call the cache makes (fsspec `get_file`)."""
    fs, _ = remote.filesystem(urls[0])
    for url in urls:
        fs.get_file(url, os.path.join(folder, "shard.tar"))


def loader_epoch(urls: list[str], cache: ShardCache, batch_size: int, window: int, samples: int) -> list[list[int]]:
    loader = make_precomputed_loader(urls, ReadSpec(batch_size=batch_size, shard_window=window), cache=cache)
    batches = []
    for batch in loader:
        batches.append(batch["indices"])
        if len(batches) * batch_size >= samples:
            return batches
    return batches


def mixing(batches: list[list[int]], shard_of, uniform: float) -> float:
    return statistics.mean(len({shard_of(i) for i in b}) for b in batches) / uniform


def serve(latency_ms: float) -> None:
    """The S3 server, answering after `latency_ms`, until stdin closes; prints its endpoint."""
    server = S3Server(Faults(delay_s=latency_ms / 1000))
    print(server.endpoint, flush=True)
    sys.stdin.read()
    server.close()


def start_server(latency_ms: float, files: list[str]) -> tuple[subprocess.Popen, list[str]]:
    """A server process answering after `latency_ms`, holding `files` in s3://bench/features/; their URLs."""
    proc = subprocess.Popen([sys.executable, __file__, "--serve", str(latency_ms)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    endpoint = proc.stdout.readline().strip()
    os.environ.update({**CREDENTIALS, "AWS_ENDPOINT_URL": endpoint})
    S3Server.upload_to(endpoint, "bench", "features", files)
    return proc, [f"s3://bench/features/{os.path.basename(f)}" for f in files if f.endswith(".tar")]


def main(argv=None) -> int:
    if argv is None and sys.argv[1:2] == ["--serve"]:
        serve(float(sys.argv[2]))
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=512)
    p.add_argument("--samples-per-shard", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--windows", type=int, nargs="+", default=[2, 4])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--latency-ms", type=float, nargs="+", default=[0.0, 20.0])
    p.add_argument("--data", default=str(Path(tempfile.gettempdir()) / "imba-bench-remote-features"))
    p.add_argument("--out", default=str(REPO / "bench" / "remote_loader_results.json"))
    args = p.parse_args(argv)

    manifest = write_feature_set(args.data, samples=args.samples, samples_per_shard=args.samples_per_shard,
                                 resolution=256, text_dtype="float16")
    files = sorted(str(f) for f in Path(args.data).iterdir() if f.is_file())
    total = sum(os.path.getsize(f) for f in files if f.endswith(".tar"))
    per_shard = args.samples_per_shard
    sampler = IndexedBatchSampler(args.samples, args.batch_size, seed=0)
    uniform = statistics.mean(len({i // per_shard for i in sampler.batch_indices(t)})
                              for t in range(args.samples // args.batch_size))
    shards = len([f for f in files if f.endswith(".tar")])
    print(f"{shards} shards, {args.samples} samples, {total / args.samples / 1e6:.2f} MB a sample "
          f"({manifest['text_dtype']} states, {manifest['resolution']} px)")

    designs = [("raw", None, 0), ("indexed, cold cache", 0, 0), ("indexed, warm cache", 0, 0)]
    designs += [("small cache, global shuffle", total // 4, 0)]
    designs += [(f"small cache, window {w}", total // 4, w) for w in args.windows]
    results = []
    for latency in args.latency_ms:
        server, urls = start_server(latency, files)
        times = {name: [] for name, _, _ in designs}
        bytes_read = {name: [] for name, _, _ in designs}
        mixed = {}
        for _ in range(args.repeats):
            for name, limit, window in designs:
                folder = tempfile.mkdtemp(prefix="imba-bench-cache-")
                if "warm" in name:  # a first epoch fills the cache (and builds the index); the second is timed
                    loader_epoch(urls, ShardCache(folder, limit), args.batch_size, window, args.samples)
                start = time.perf_counter()
                if limit is None:
                    raw_read(urls, folder)
                    bytes_read[name].append(total)
                else:
                    cache = ShardCache(folder, limit)
                    batches = loader_epoch(urls, cache, args.batch_size, window, args.samples)
                    mixed[name] = mixing(batches, lambda i: i // per_shard, uniform)
                    bytes_read[name].append(cache.bytes_downloaded)
                times[name].append(time.perf_counter() - start)
                shutil.rmtree(folder, ignore_errors=True)
        raw = statistics.median(times["raw"])
        for name, _, window in designs:
            t = times[name]
            row = {"latency_ms": latency, "design": name, "samples_per_s": args.samples / statistics.median(t),
                   "samples_per_s_min_max": [args.samples / max(t), args.samples / min(t)],
                   "vs_raw": raw / statistics.median(t),
                   "mb_per_sample": statistics.median(bytes_read[name]) / args.samples / 1e6,
                   "shuffle_quality": mixed.get(name)}
            results.append(row)
            quality = "" if row["shuffle_quality"] is None else f", shuffle quality {row['shuffle_quality']:.2f}"
            print(f"latency {latency:>4.0f} ms  {name:<30} {row['samples_per_s']:8.1f} samples/s  "
                  f"({row['vs_raw']:.2f}x raw)  {row['mb_per_sample']:.2f} MB/sample{quality}")
        server.stdin.close()
        server.wait()
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "data")}  # not where this machine kept them
    Path(args.out).write_text(json.dumps({"args": settings, "results": results}, indent=1) + "\n")
    print(f"-> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
