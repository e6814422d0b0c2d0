"""Streaming reader: img2dataset-layout tar shards (`key.jpg|jpeg|png|webp`, `key.txt`, `key.json`) into training
batches, local or remote.

The stream is infinite and step-based: shards are drawn with replacement (webdataset `ResampledShards`), samples
pass through a shuffle buffer, and every random choice is seeded explicitly from (seed, rank, worker id,
batches_done) — never from pid or time — so the same arguments reproduce the same stream, and different ranks,
workers or resume steps get different streams. Exact resume (skip what was consumed) is the job of the indexed
reader (`data.indexed`), not of this one.

Bad samples and shards are skipped and counted as `data.skips` describes; a shard that fails is counted once per
read, the samples read before its failure kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Sequence

import torch
import webdataset as wds

from .decode import DecodeSamples, collate
from .seeds import derive_seed
from .skips import ReaderStats, shard_failure_reason
from .urls import expand_urls

__all__ = ["ReadShards", "check_loader_args", "make_image_text_pipeline", "make_image_text_loader"]


def _worker_id() -> int:
    info = torch.utils.data.get_worker_info()
    return 0 if info is None else info.id


@dataclass
class _StreamSeed:
    """Called at iteration time (inside the DataLoader worker): seed for one purpose of this worker's stream."""

    seed: int
    rank: int
    batches_done: int
    purpose: str

    def __call__(self) -> int:
        return derive_seed("imba-data", self.purpose, self.seed, self.rank, _worker_id(), self.batches_done)


@dataclass
class ReadShards:
    """{"url"} dicts -> raw samples, one shard at a time through webdataset's tar reader.

    A shard that fails (cannot be opened, truncated, corrupt) keeps the samples read before the failure and is
    counted once per read, under the reason of its first error, and named in a warning (webdataset may report
    one truncation twice: at the member and at the next header; its own warn_and_continue also sleeps 0.5 s).
    """

    stats: ReaderStats

    def __call__(self, src: Iterable[dict]) -> Iterator[dict]:
        for shard in src:
            url = shard["url"]
            errors: list[BaseException] = []

            def handler(exn: BaseException) -> bool:
                errors.append(exn)
                return True

            source = dict(shard)  # webdataset's opener adds the open "stream" to it
            try:
                yield from wds.tarfile_samples([source], handler=handler)
            finally:
                stream = source.get("stream")
                if stream is not None:  # closed now, not whenever the garbage collector gets to it
                    stream.close()
            if errors:
                exn = errors[0]
                reason = shard_failure_reason(exn)
                self.stats.count(reason, f"skipping shard {url}: {reason} ({type(exn).__name__}: {exn})", shard=True)
                self.stats.failed(f"{reason} {url}")


@dataclass
class _SeededShuffle:
    bufsize: int
    seed: _StreamSeed

    def __call__(self, src: Iterable[dict]) -> Iterator[dict]:
        initial = min(self.bufsize, 100)
        return wds.shuffle(self.bufsize, initial=initial, seed=self.seed())(src)


def make_image_text_pipeline(
    urls: str | Sequence[str], resolution: int, batch_size: int, seed: int = 0, rank: int = 0, batches_done: int = 0,
    shuffle_buffer: int = 1000, caption_field: str = "caption", min_size: int = 0, resampled: bool = True,
    world_size: int = 1, partial: bool = False,
) -> wds.DataPipeline:
    """The batched webdataset pipeline behind `make_image_text_loader` (its `.stats` counts skips).

    `resampled=False`: one pass over this rank's shards (`urls[rank::world_size]`, split across DataLoader
    workers) in the given order, then the stream ends (statistics, evaluation, tests); `partial` keeps a last,
    smaller batch.
    """
    urls = expand_urls(urls)
    stats = ReaderStats(where=urls[0] if len(urls) == 1 else f"{len(urls)} shards ({urls[0]}, ...)")
    if resampled:
        shards: list[Any] = [
            wds.ResampledShards(
                urls,
                seed=0,
                worker_seed=_StreamSeed(seed, rank, batches_done, "shards"),
                deterministic=True,  # otherwise webdataset mixes pid, time_ns and urandom into the seed
            )
        ]
    else:
        shards = [wds.SimpleShardList(urls[rank::world_size]), wds.split_by_worker]
    stages: list[Any] = [*shards, ReadShards(stats)]
    if shuffle_buffer > 1:
        stages.append(_SeededShuffle(shuffle_buffer, _StreamSeed(seed, rank, batches_done, "shuffle")))
    stages.append(DecodeSamples(resolution, caption_field, stats, min_size))
    stages.append(wds.batched(batch_size, collation_fn=collate, partial=partial))
    pipeline = wds.DataPipeline(*stages)
    pipeline.stats = stats
    return pipeline


def check_loader_args(resolution: int, batch_size: int, num_workers: int, min_size: int = 0) -> None:
    """Raise ValueError unless resolution >= 1, batch_size >= 1, num_workers >= 0 and min_size >= 0."""
    if resolution < 1 or batch_size < 1 or num_workers < 0 or min_size < 0:
        raise ValueError(
            f"need resolution >= 1, batch_size >= 1, num_workers >= 0, min_size >= 0 "
            f"(got {resolution}, {batch_size}, {num_workers}, {min_size})"
        )


def make_image_text_loader(
    urls: str | Sequence[str], resolution: int, batch_size: int, num_workers: int = 0, seed: int = 0, rank: int = 0,
    world_size: int = 1, batches_done: int = 0, shuffle_buffer: int = 1000, caption_field: str = "caption",
    min_size: int = 0, resampled: bool = True,
) -> torch.utils.data.DataLoader:
    """Infinite DataLoader of {"pixels": (B, 3, R, R) float32 in [-1, 1], "captions": [str], "keys": [str]}.

    `urls` is anything `expand_urls` accepts. Shards are resampled with replacement, so every rank reads all
    shards and `world_size` is only checked; ranks, workers and resume steps differ through the seed.
    `min_size` > 0 skips images whose shorter side is below it (pixels). `resampled=False` reads this rank's
    shards once, in order, and ends (the last, smaller batch is kept).
    """
    check_loader_args(resolution, batch_size, num_workers, min_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world_size {world_size}")
    pipeline = make_image_text_pipeline(
        urls, resolution, batch_size, seed=seed, rank=rank, batches_done=batches_done, shuffle_buffer=shuffle_buffer,
        caption_field=caption_field, min_size=min_size, resampled=resampled, world_size=world_size,
        partial=not resampled,
    )
    return torch.utils.data.DataLoader(
        pipeline,
        batch_size=None,  # the pipeline batches
        num_workers=num_workers,
        persistent_workers=num_workers > 0,
        generator=torch.Generator().manual_seed(seed),  # leave torch's global RNG alone (see data/indexed.py)
    )
