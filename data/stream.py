"""The data stream a run trains on, built from its data settings by one call, `make_stream`: the sources' shards read
as one index by the reader they need (`Reader`: image shards decoded, or precomputed features; `pipe:` commands
streamed), in the order the settings ask for (the seeded uniform order, in shard windows where set; the weighted
stream of the run's draw plan for data.sources and data.balance, in aspect-ratio buckets where set; or an order the
caller gives, e.g. the online balance's), continued at a position of the global stream.

What it needs of the run's processes is `Processes` (accelerate's `Accelerator` has all of it): the main process
scans the shards and computes the draw plan into a folder, the others read what it wrote.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ContextManager, Protocol, Sequence, runtime_checkable

from .buckets import assign_buckets, bucket_sizes
from .draw_plan import DrawPlan, describe_plan, load_plan, plan_draws, plan_fingerprint, plot_plan
from .index import ShardIndex, load_or_build_index
from .indexed import make_indexed_loader
from .image_clusters import latent_features
from .precomputed import find_manifest, make_precomputed_loader
from .read_spec import ReadSpec
from .remote import ShardCache
from .settings import DataConfig
from .sources import Source, SourceMix
from .streaming import make_image_text_loader
from .urls import is_pipe
from .weighted import StreamBatchSampler, WeightedBucketSampler, WeightedOrder

__all__ = ["Reader", "Processes", "DataStream", "all_shards", "draw_plan", "caption_workers", "choose_mode",
           "open_loader", "make_stream", "reader_size", "reader_fingerprint"]

PLAN_POLL_S = 1.0  # how often the other ranks look for the plan the main process is computing


@runtime_checkable
class Reader(Protocol):
    """What a loader reads samples from: `len(reader)` samples, `reader[i]` the i-th, and `fingerprint()`, which
    differs whenever sample i may differ (other shards, other bytes in them, another decoding)."""

    def __len__(self) -> int: ...

    def __getitem__(self, i: int) -> dict[str, Any]: ...

    def fingerprint(self) -> str: ...


class Processes(Protocol):
    """The run's processes as the data stream sees them."""

    process_index: int
    num_processes: int
    is_main_process: bool

    def main_process_first(self) -> ContextManager[Any]: ...

    def wait_for_everyone(self) -> None: ...


@dataclass
class DataStream:
    """A rank's loader and where it starts: `batches_done`, its batches of the uniform order (or the streaming
    reader's) already consumed; `epoch`, the weighted stream's position in epochs (None for the uniform order)."""

    loader: Any
    batches_done: int
    epoch: float | None = None


def all_shards(sources: Sequence[Source]) -> list[str]:
    """The sources' shards, source after source: the order of the index the loader reads."""
    return [url for source in sources for url in source.urls]


def caption_workers(index: ShardIndex) -> int:
    """Processes that read a large set's captions (for a plan's or an online balance's entries)."""
    return min(8, os.cpu_count() or 1) if len(index) > 200_000 else 1


def choose_mode(mode: str, shards: Sequence[str], manifest: dict | None = None) -> str:
    """The reader for data.mode `mode` (auto | indexed | streaming): "indexed" or "streaming".

    Precomputed shards (a manifest) are always read indexed; "auto" reads local shards and s3://, gs://, http(s)://
    URLs indexed (exact resume; remote shards through the local cache) and streams pipe: commands."""
    if manifest:
        return "indexed"
    if mode == "auto":
        return "streaming" if any(map(is_pipe, shards)) else "indexed"
    return mode


def _load_index(shards: Sequence[str], cache: ShardCache | None, processes: Processes | None) -> ShardIndex:
    """The shards' index: scanned once, by the main process; the others read what it cached."""
    with processes.main_process_first() if processes is not None else contextlib.nullcontext():
        return load_or_build_index(shards, cache=cache)


def draw_plan(d: DataConfig, processes: Processes, sources: Sequence[Source], folder: Path, extractor=None,
              index: ShardIndex | None = None) -> tuple[DrawPlan, ShardIndex, SourceMix]:
    """The draw plan of `d` (data.sources shares, data.balance weights; an online rule: its natural plan, which its
    balancer re-weights), the index (`index`, else loaded) and the mix of sources it is made for: computed by the
    main process into `folder` (reused while its fingerprint holds), described and plotted there, read by the
    others. ValueError (one line) for sources that cannot be mixed."""
    if index is None:
        index = _load_index(all_shards(sources), d.cache(), processes)
    mix = SourceMix(sources, index.nsamples, d.epoch_samples)
    balance = d.balance.plan_rule()
    if processes.is_main_process:
        manifest = find_manifest(all_shards(sources)) if getattr(balance, "reads_images", False) else None
        features = None if manifest is None else (
            lambda: latent_features(index, manifest, d.cache(), progress=True))
        plan = plan_draws(index, mix, balance, folder, extractor=extractor, caption_field=d.caption_field,
                          progress=True, workers=caption_workers(index), features=features)
        for line in describe_plan(plan):
            print(line)
        drawn = plot_plan(plan, folder)
        print(f"data: the draw plan is in {folder}/" + (f" (concepts drawn vs natural: {drawn})" if drawn else ""))
    else:  # polled, not a collective: reading a large set's captions may outlast a process-group timeout
        fingerprint = plan_fingerprint(index, mix, balance, extractor)
        while (plan := load_plan(folder, fingerprint)) is None:
            time.sleep(PLAN_POLL_S)
    processes.wait_for_everyone()
    return plan, index, mix


def open_loader(shards: Sequence[str], spec: ReadSpec, *, mode: str = "auto", manifest: dict | None = None,
                sampler: StreamBatchSampler | WeightedBucketSampler | None = None, cache: ShardCache | None = None,
                index: ShardIndex | None = None, processes: Processes | None = None):
    """The loader of `shards` read as `spec` says, by the reader `mode` chooses (`choose_mode`): image shards
    indexed or streamed, or precomputed features (`manifest`, their precompute.json). `sampler`: a weighted stream
    over these shards in place of the uniform order; `cache`: where remote shards are kept; `index`: the shards'
    index when the caller has loaded it (else loaded here, the main process of `processes` first). ValueError (one
    line) for a combination no reader serves."""
    mode = choose_mode(mode, shards, manifest)
    if sampler is not None and mode != "indexed":
        raise ValueError("a weighted stream (data.sources, data.balance) needs indexed reading: the streaming reader "
                         "cannot draw by weight and resume exactly")
    if spec.bucketing and (manifest or mode == "streaming"):
        raise ValueError("data.bucketing=true needs image shards read in indexed mode: "
                         + ("precomputed latents have one fixed size" if manifest else "streamed shards have no index"))
    if spec.loader_threads and not manifest:
        raise ValueError(f"data.loader_threads={spec.loader_threads} needs precomputed features and "
                         "data.num_workers=0 (these shards are images)")
    if mode == "streaming":
        return make_image_text_loader(shards, spec)
    index = index if index is not None else _load_index(shards, cache, processes)
    if manifest:
        return make_precomputed_loader(index, spec, manifest=manifest, sampler=sampler, cache=cache)
    return make_indexed_loader(index, spec, sampler=sampler, cache=cache)


def make_stream(d: DataConfig, processes: Processes, sources: Sequence[Source], *, seed: int, samples_done: int,
                manifest: dict | None, bucket_divisor: int, plan_folder: Path, extractor=None, order=None,
                log: Callable[[str], None] = print) -> DataStream:
    """This rank's stream of `d` over `sources`, after `samples_done` samples of the global stream: exactly there,
    on any process count, for the weighted stream (data.sources, data.balance; `order`, e.g. the online balance's,
    replaces the plan's); at the global batch the position falls in for the uniform order; reseeded from it for the
    streaming reader. `manifest`: the sources' precompute manifest (None: image shards); `bucket_divisor`: what
    aspect-ratio buckets' sides are divisible by; `log`: the main process's lines. ValueError (one line) for
    settings the data cannot serve."""
    world, rank = processes.num_processes, processes.process_index
    shards, cache = all_shards(sources), d.cache()
    index = _load_index(shards, cache, processes) if choose_mode(d.mode, shards, manifest) == "indexed" else None
    sampler, epoch = None, None
    if d.weighted():
        where = dict(rank=rank, world_size=world, samples_done=samples_done)
        if order is not None:  # the caller's stream, e.g. the natural plan re-weighted as the run goes
            sampler, size = StreamBatchSampler(order, d.batch_size, **where), order.samples_per_epoch
        else:
            plan, index, _ = draw_plan(d, processes, sources, plan_folder, extractor, index=index)
            size = plan.samples_per_epoch
            if d.bucketing:  # each image's bucket from the sizes in the index; the plan's draws within each bucket
                buckets = bucket_sizes(d.resolution, bucket_divisor)
                # the stream of bucket batches is cut in batches of data.batch_size: after a change of it (other
                # bucket batches anyway) a position inside one starts at the next
                where["samples_done"] = -(-samples_done // d.batch_size) * d.batch_size
                of_sample = assign_buckets(index.sizes[:, 0], index.sizes[:, 1], buckets)
                sampler = WeightedBucketSampler(plan.units, size, of_sample, buckets, d.batch_size, seed=seed, **where)
                log(f"data: aspect-ratio buckets, draws per epoch: {sampler.describe()}")
            else:
                order = WeightedOrder(plan.units, size, seed=seed, shard_sizes=index.nsamples, window=d.shard_window)
                sampler = StreamBatchSampler(order, d.batch_size, **where)
        epoch = where["samples_done"] / size
    # the uniform order and the stream reader count batches per rank: the global batch the position falls in
    consumed = samples_done // (world * d.batch_size)
    spec = ReadSpec(**d.decoding(), batch_size=d.batch_size, seed=seed, rank=rank, world_size=world,
                    batches_done=consumed, shard_window=d.shard_window, bucketing=d.bucketing,
                    bucket_divisor=bucket_divisor, num_workers=d.num_workers, loader_threads=d.loader_threads,
                    shuffle_buffer=d.shuffle_buffer)
    loader = open_loader(shards, spec, mode=d.mode, manifest=manifest, sampler=sampler, cache=cache, index=index)
    return DataStream(loader, consumed, epoch)


def reader_size(loader) -> int | None:
    """How many samples the `Reader` behind `loader` indexes; None for a loader without one (the streaming reader)."""
    reader = getattr(loader, "dataset", None)
    return len(reader) if isinstance(reader, Reader) else None


def reader_fingerprint(loader) -> str | None:
    """The fingerprint of the `Reader` behind `loader`; None for a loader without one (the streaming reader)."""
    reader = getattr(loader, "dataset", None)
    return reader.fingerprint() if isinstance(reader, Reader) else None
