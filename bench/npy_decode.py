"""Side by side in one process: decoding precomputed `.npy` members with `np.load` against
`data.precomputed.load_npy` (headers parsed once per distinct header), per sample and through the whole loader.

    OMP_NUM_THREADS=1 .venv/bin/python bench/npy_decode.py                 # the set bench/loader_throughput.py wrote
    OMP_NUM_THREADS=1 .venv/bin/python bench/npy_decode.py --precomputed DIR --rounds 7

Rounds alternate between the two decoders; medians are reported.
"""

from __future__ import annotations

import argparse
import glob
import io
import statistics
import sys
import tarfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import data.precomputed as precomputed  # noqa: E402
from data.read_spec import ReadSpec  # noqa: E402

DEFAULT_GLOB = "outputs/loader_throughput/*-precomputed"


def np_load(data: bytes | memoryview, copy: bool = True) -> np.ndarray:
    return np.load(io.BytesIO(data), allow_pickle=False)  # always a copy


def decode_us_per_sample(members: list[bytes], decode) -> float:
    start = time.perf_counter()
    for data in members:
        decode(data)
    return (time.perf_counter() - start) / len(members) * 2e6  # two arrays per sample


def loader_samples_per_s(shards: list[str], manifest: dict, batches: int) -> float:
    loader = precomputed.make_precomputed_loader(shards, ReadSpec(batch_size=32), manifest=manifest)
    count, start = 0, time.perf_counter()
    for i, batch in enumerate(loader):
        count += len(batch["keys"])
        if i + 1 == batches:
            break
    return count / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--precomputed", help=f"a precompute output folder (default: {DEFAULT_GLOB})")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batches", type=int, default=40, help="loader batches of 32 per round")
    args = parser.parse_args(argv)
    folders = [args.precomputed] if args.precomputed else sorted(glob.glob(DEFAULT_GLOB))
    if not folders:
        sys.exit(f"no precomputed set under {DEFAULT_GLOB}: run bench/loader_throughput.py first, or pass --precomputed")
    folder = folders[0].rstrip("/")
    shards = sorted(glob.glob(f"{folder}/*.tar"))
    manifest = precomputed.find_manifest(folder + "/")
    with tarfile.open(shards[0]) as tar:
        members = [tar.extractfile(m).read() for m in tar.getmembers() if m.name.endswith(".npy")]

    cached = precomputed.load_npy
    decoders = {"np.load": np_load, "cached header": cached}
    decode = {name: [] for name in decoders}
    loader = {name: [] for name in decoders}
    try:
        for _ in range(args.rounds):
            for name, fn in decoders.items():
                decode[name].append(decode_us_per_sample(members, fn))
                precomputed.load_npy = fn  # what the loader's sample decoder calls
                loader[name].append(loader_samples_per_s(shards, manifest, args.batches))
    finally:
        precomputed.load_npy = cached
    d = {k: statistics.median(v) for k, v in decode.items()}
    r = {k: statistics.median(v) for k, v in loader.items()}
    print(f"{folder}: {len(members)} members of {Path(shards[0]).name}; medians of {args.rounds} interleaved rounds")
    print(f"decode, µs per sample (2 arrays): np.load {d['np.load']:.0f}, cached header {d['cached header']:.0f} "
          f"({d['np.load'] / d['cached header']:.1f}× faster)")
    print(f"precomputed loader, 0 workers, batch 32, samples/s: np.load {r['np.load']:,.0f}, cached header "
          f"{r['cached header']:,.0f} ({r['cached header'] / r['np.load']:.2f}×)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
