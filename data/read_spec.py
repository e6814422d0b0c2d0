"""`ReadSpec`: how one process reads shards into training batches, the one object every reader takes.

A run makes it from its data settings in one place (`data.stream.make_stream`); the readers (`data.indexed`,
`data.precomputed`, `data.streaming`) read the fields they need and ignore the rest (`data.stream.open_loader`
refuses a spec whose fields the chosen reader would ignore: buckets of precomputed or streamed shards, threads for
image shards). Torch-free, so settings and tools can make one without loading the readers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

__all__ = ["ReadSpec"]


@dataclass(frozen=True)
class ReadSpec:
    """What a sample is, which batches this process reads, and how they are made.

    A sample: images cover-resized and centre-cropped to `resolution`, the caption from `caption_field` (`key.txt`
    first), images whose shorter side is below `min_size` pixels skipped (precomputed features keep what their
    manifest says they were encoded with).

    The batches: `batch_size` samples each, this process's share (`rank` of `world_size`) of the order seeded by
    `seed`, after the `batches_done` batches it already consumed (the streaming reader reseeds from it instead);
    `shard_window` > 0 reads the uniform indexed order that many shards at a time; `bucketing` draws each batch
    from one aspect-ratio bucket around `resolution`², sides divisible by `bucket_divisor` (VAE downsampling × the
    DiT's patch size).

    How they are made: `num_workers` loader processes; `loader_threads` > 0 makes precomputed batches in threads of
    this process instead (with `num_workers=0`); `shuffle_buffer` samples shuffled by the streaming reader.
    """

    batch_size: int
    resolution: int = 128
    caption_field: str = "caption"
    min_size: int = 0
    seed: int = 0
    rank: int = 0
    world_size: int = 1
    batches_done: int = 0
    shard_window: int = 0
    bucketing: bool = False
    bucket_divisor: int = 16
    num_workers: int = 0
    loader_threads: int = 0
    shuffle_buffer: int = 1000

    def __post_init__(self) -> None:
        low = {name: getattr(self, name) for name, least in _LEAST.items() if getattr(self, name) < least}
        if low:
            raise ValueError("need " + ", ".join(f"{name} >= {_LEAST[name]}" for name in low) + " (got "
                             + ", ".join(f"{name}={value}" for name, value in low.items()) + ")")
        if self.rank >= self.world_size:
            raise ValueError(f"rank {self.rank} is outside world_size {self.world_size}")
        if self.loader_threads and self.num_workers:
            raise ValueError(f"data.loader_threads={self.loader_threads} needs precomputed features and "
                             f"data.num_workers=0 (got {self.num_workers}): its threads make the batches")
        if self.bucketing and self.shard_window:
            raise ValueError("aspect-ratio bucketing reads samples in a uniform order: set shard_window=0")

    def replace(self, **changes) -> ReadSpec:
        """This spec with `changes` (checked again)."""
        return dataclasses.replace(self, **changes)


_LEAST = {"resolution": 1, "batch_size": 1, "min_size": 0, "rank": 0, "world_size": 1, "batches_done": 0,
          "shard_window": 0, "bucket_divisor": 1, "num_workers": 0, "loader_threads": 0, "shuffle_buffer": 0}
