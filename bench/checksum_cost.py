"""What the shard checksum costs (`data.remote.checksum`, xxh3-128 of every downloaded shard, checked against the
index; BLAKE2b where xxhash is missing): each hash's own rate on a shard in the page cache, and the loader over shards on an S3 server on 127.0.0.1
(moto, in a process of its own: `bench/remote_loader.py`'s server and data) with the checksum and with it switched
off, against the raw read of the same bytes, from a cold cache (the index built: every shard downloaded and hashed
once) and warm (read from the cache: no hash).

    python bench/checksum_cost.py --samples 256 --samples-per-shard 16 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from data import remote  # noqa: E402
from data.remote import ShardCache  # noqa: E402
from real_size_features import write_feature_set  # noqa: E402
from remote_loader import loader_epoch, raw_read, start_server  # noqa: E402


def hash_rate(path: str, repeats: int, algorithm: str) -> float:
    """MB/s of `remote.checksum` with `algorithm` over `path`, read from the page cache."""
    remote.checksum(path)  # into the page cache
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        remote.checksum(path, f"{algorithm}:")
        times.append(time.perf_counter() - start)
    return os.path.getsize(path) / statistics.median(times) / 1e6


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=256)
    p.add_argument("--samples-per-shard", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--data", default=str(Path(tempfile.gettempdir()) / "imba-bench-remote-features"))
    args = p.parse_args(argv)

    write_feature_set(args.data, samples=args.samples, samples_per_shard=args.samples_per_shard, resolution=256,
                      text_dtype="float16")
    files = sorted(str(f) for f in Path(args.data).iterdir() if f.is_file())
    shards = [f for f in files if f.endswith(".tar")]
    rates = ", ".join(f"{a} {hash_rate(shards[0], 5, a):,.0f} MB/s" for a in ("xxh3_128", "blake2b"))
    print(f"{len(shards)} shards of {os.path.getsize(shards[0]) / 1e6:.1f} MB; hashed from the page cache: {rates}")
    server, urls = start_server(0.0, files)
    real_checksum = remote.checksum
    designs = ("raw", "cold, checksum", "cold, no checksum", "warm, checksum")
    times: dict[str, list[float]] = {name: [] for name in designs}
    try:
        for _ in range(args.repeats):
            for name in designs:
                folder = tempfile.mkdtemp(prefix="imba-bench-cache-")
                remote.checksum = real_checksum if "no checksum" not in name else (lambda source, like=None: "off:")
                if name.startswith("warm"):  # a first epoch builds the index and fills the cache; the second is timed
                    loader_epoch(urls, ShardCache(folder), args.batch_size, 0, args.samples)
                start = time.perf_counter()
                if name == "raw":
                    raw_read(urls, folder)
                else:
                    loader_epoch(urls, ShardCache(folder), args.batch_size, 0, args.samples)
                times[name].append(time.perf_counter() - start)
                shutil.rmtree(folder, ignore_errors=True)
    finally:
        remote.checksum = real_checksum
        server.stdin.close()
        server.wait()
    raw = statistics.median(times["raw"])
    print("| design | samples/s, median of %d (min–max) | vs raw |" % args.repeats)
    print("|---|---|---|")
    for name in designs:
        t = times[name]
        print(f"| {name} | {args.samples / statistics.median(t):,.0f} ({args.samples / max(t):,.0f}–"
              f"{args.samples / min(t):,.0f}) | **{raw / statistics.median(t):.2f}×** |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
