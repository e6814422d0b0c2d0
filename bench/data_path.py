"""How much of the code a reader passes through from the trainer's `make_loader` to its first batch: the project's
modules whose functions run (in the process that makes the loader, `data.num_workers=0`), and the longest chain
of calls that crosses from one module into another (hops), and how often the shard index is loaded, for the plain indexed stream and the weighted one
(data.balance), on a few synthetic shards.

    python bench/data_path.py

Counts read the code as it runs (`sys.setprofile`), so they do not depend on how imports are written; modules
only imported (constants, type names) are not counted.
"""

from __future__ import annotations

import itertools
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
PACKAGES = ("data", "imba", "models")


def module_of(filename: str) -> str | None:
    """The project module a code object belongs to ("data.indexed"), None outside the project."""
    path = Path(filename)
    try:
        rel = path.resolve().relative_to(ROOT)
    except ValueError:
        return None
    if rel.parts[0] not in PACKAGES:
        return None
    return ".".join(rel.with_suffix("").parts)


def trace(fn):
    """(modules whose functions ran, longest chain of cross-module calls, times the shard index was loaded) while
    `fn()` runs."""
    modules: set[str] = set()
    longest = loads = 0
    chain: list[str | None] = []  # the project module of each frame on the stack (None: outside the project)
    hops: list[int] = []  # cross-module calls on the path to each frame

    def profile(frame, event, arg):
        nonlocal longest, loads
        if event == "call":
            module = module_of(frame.f_code.co_filename)
            loads += module == "data.index" and frame.f_code.co_name == "load_or_build_index"
            caller = next((m for m in reversed(chain) if m is not None), None)
            depth = hops[-1] if hops else 0
            if module is not None:
                modules.add(module)
                if caller is not None and module != caller:
                    depth += 1
            chain.append(module)
            hops.append(depth)
            longest = max(longest, depth)
        elif event == "return" and chain:
            chain.pop()
            hops.pop()

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return sorted(modules), longest, loads


def main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from accelerate import Accelerator

    from data.synthetic import write_synthetic_shards
    from imba.training.config import load_config
    from imba.training.inputs import make_loader, training_sources
    from imba.training.resume import StreamPosition

    with tempfile.TemporaryDirectory() as tmp:
        shards = Path(tmp) / "shards"
        write_synthetic_shards(str(shards), num_samples=48, samples_per_shard=8, resolution=32, seed=0)
        for name, extra in (("plain indexed stream", []), ("weighted stream (data.balance=temperature)",
                                                           ["data.balance=temperature"])):
            out = Path(tmp) / name.split()[0]
            cfg = load_config([f"data.shards={shards}", "data.resolution=32", "data.batch_size=4",
                               "data.precompute=false", "data.num_workers=0", f"train.output_dir={out}", *extra])
            accelerator = Accelerator(cpu=True)
            sources = training_sources(cfg, accelerator, out)

            def first_batch():
                loader = make_loader(cfg, accelerator, sources, StreamPosition(0, 0), None, bucket_divisor=16)
                next(itertools.islice(iter(loader), 1))

            first_batch()  # the index and plan are built once; the count is of a run that finds them
            modules, hops, loads = trace(first_batch)
            data_modules = [m for m in modules if m.startswith("data.")]
            print(f"{name}: {len(modules)} modules ({len(data_modules)} in data/), longest chain {hops} hops, "
                  f"the index loaded {loads}x")
            print("  " + ", ".join(modules))


if __name__ == "__main__":
    main()
