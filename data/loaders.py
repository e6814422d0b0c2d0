"""The training loader for a run's shards: which reader reads them (indexed, streaming or precomputed), and the
checks on the combination of data settings that no single reader can make."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager

from .index import load_or_build_index
from .indexed import make_indexed_loader
from .precomputed import make_precomputed_loader
from .remote import ShardCache
from .streaming import make_image_text_loader
from .urls import is_pipe
from .weighted import StreamBatchSampler

__all__ = ["choose_mode", "build_loader"]


def choose_mode(mode: str, shards: list[str], manifest: dict | None = None) -> str:
    """The reader for data.mode `mode` (auto | indexed | streaming): "indexed" or "streaming".

    Precomputed shards (a manifest) are always read indexed; "auto" reads local shards and s3://, gs://, http(s)://
    URLs indexed (exact resume; remote shards through the local cache) and streams pipe: commands."""
    if manifest:
        return "indexed"
    if mode == "auto":
        return "streaming" if any(map(is_pipe, shards)) else "indexed"
    return mode


def build_loader(
    shards: list[str],
    mode: str,
    *,
    resolution: int,
    batch_size: int,
    num_workers: int,
    seed: int,
    rank: int,
    world_size: int,
    caption_field: str,
    min_size: int,
    shuffle_buffer: int,
    bucketing: bool,
    bucket_divisor: int,
    batches_done: int,
    manifest: dict | None = None,
    loader_threads: int = 0,
    main_process_first: Callable[[], ContextManager[Any]] = contextlib.nullcontext,
    sampler: StreamBatchSampler | None = None,
    cache: ShardCache | None = None,
    shard_window: int = 0,
):
    """This rank's infinite training loader over `shards` (expanded shard URLs), resuming after `batches_done`.

    Indexed mode (local image shards, or precomputed ones when `manifest` is given) starts at the batch an
    uninterrupted run would draw next; streaming mode reseeds its stream from `batches_done`. Aspect-ratio buckets
    (`bucketing`, sides divisible by `bucket_divisor`) need local image shards: ValueError otherwise.
    `main_process_first` (a context-manager factory, e.g. `accelerator.main_process_first`) lets the main process
    scan the tars into the cached index before the other ranks open it. `loader_threads` > 0 (precomputed features
    with `num_workers=0` only) makes the batches in threads of this process. `sampler` (a weighted stream over
    these shards, `data.weighted`) replaces the uniform order; it needs indexed reading. `cache`: where remote
    shards are kept (`data.remote.ShardCache`; default its default folder, no limit). `shard_window` > 0: the
    uniform indexed order reads that many shards at a time (`data.order.IndexedBatchSampler`).
    """
    mode = choose_mode(mode, shards, manifest)
    if sampler is not None and mode != "indexed":
        raise ValueError("a weighted stream (data.sources, data.balance) needs indexed reading: the streaming reader "
                         "cannot draw by weight and resume exactly")
    if loader_threads and (not manifest or num_workers):
        raise ValueError(f"data.loader_threads={loader_threads} needs precomputed features and data.num_workers=0"
                         + ("" if manifest else " (these shards are images)"))
    if bucketing and (manifest or mode == "streaming"):
        raise ValueError("data.bucketing=true needs image shards read in indexed mode: "
                         + ("precomputed latents have one fixed size" if manifest else "streamed shards have no index"))
    common = dict(resolution=resolution, batch_size=batch_size, num_workers=num_workers, seed=seed, rank=rank,
                  world_size=world_size, caption_field=caption_field, min_size=min_size)
    if mode == "indexed":
        with main_process_first():
            load_or_build_index(shards, cache=cache)  # scanned once, by the main process; the others read it
        if manifest:
            return make_precomputed_loader(shards, batch_size, num_workers, seed, rank, world_size, batches_done,
                                           manifest=manifest, num_threads=loader_threads, sampler=sampler, cache=cache,
                                           shard_window=shard_window)
        return make_indexed_loader(shards, batches_done=batches_done, bucketing=bucketing,
                                   bucket_divisor=bucket_divisor, sampler=sampler, cache=cache,
                                   shard_window=shard_window, **common)
    return make_image_text_loader(shards, batches_done=batches_done, shuffle_buffer=shuffle_buffer, **common)
