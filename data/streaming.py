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
from .read_spec import ReadSpec
from .seeds import derive_seed
from .skips import ReaderStats, shard_failure_reason
from .urls import expand_urls

__all__ = ["ReadShards", "make_image_text_pipeline", "make_image_text_loader"]


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


def make_image_text_pipeline(urls: str | Sequence[str], spec: ReadSpec, resampled: bool = True) -> wds.DataPipeline:
    """The batched webdataset pipeline behind `make_image_text_loader` (its `.stats` counts skips).

    `resampled=False`: one pass over this rank's shards (`urls[rank::world_size]`, split across DataLoader
    workers) in the given order, then the stream ends with a last, smaller batch (statistics, evaluation, tests).
    """
    seed, rank, batches_done = spec.seed, spec.rank, spec.batches_done
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
        shards = [wds.SimpleShardList(urls[rank::spec.world_size]), wds.split_by_worker]
    stages: list[Any] = [*shards, ReadShards(stats)]
    if spec.shuffle_buffer > 1:
        stages.append(_SeededShuffle(spec.shuffle_buffer, _StreamSeed(seed, rank, batches_done, "shuffle")))
    stages.append(DecodeSamples(spec.resolution, spec.caption_field, stats, spec.min_size))
    stages.append(wds.batched(spec.batch_size, collation_fn=collate, partial=not resampled))
    pipeline = wds.DataPipeline(*stages)
    pipeline.stats = stats
    return pipeline


def make_image_text_loader(urls: str | Sequence[str], spec: ReadSpec, resampled: bool = True
                           ) -> torch.utils.data.DataLoader:
    """Infinite DataLoader of {"pixels": (B, 3, R, R) float32 in [-1, 1], "captions": [str], "keys": [str]}.

    `urls` is anything `expand_urls` accepts; `spec` says what a sample is and which stream this process reads
    (its seed, rank, `batches_done` and `shuffle_buffer`; the index-only fields are not used). Shards are resampled
    with replacement, so every rank reads all shards and ranks, workers and resume steps differ through the seed.
    `resampled=False` reads this rank's shards once, in order, and ends (the last, smaller batch is kept).
    """
    pipeline = make_image_text_pipeline(urls, spec, resampled)
    return torch.utils.data.DataLoader(
        pipeline,
        batch_size=None,  # the pipeline batches
        num_workers=spec.num_workers,
        persistent_workers=spec.num_workers > 0,
        generator=torch.Generator().manual_seed(spec.seed),  # leave torch's global RNG alone (see data/indexed.py)
    )
