"""Indexed (random-access) reading of local img2dataset-layout tar shards, with exact resume.

Why a second reader: the streaming reader (`data.streaming`) draws shards with replacement and shuffles in a
buffer, so after a resume it cannot reproduce the batches an uninterrupted run would have drawn. Here every batch
is a pure function of (seed, epoch, position in the epoch) (`data.order`), so a loader built with
`batches_done = step * grad_accum` continues exactly where the checkpointed run stopped, without decoding (or even
reading) the skipped samples. Each shard is scanned once into a cached index of byte spans and image sizes
(`data.index`); reading sample i is one `pread` of its span. Aspect-ratio buckets (`bucketing=True`) take the
image sizes from the index (`data.order.BucketBatchSampler`, tables in `data.buckets`).

Bad samples (unreadable span, and the reasons of `data.skips`: bad image, missing image, zero-byte member, image
too small, missing or empty caption, non-UTF-8 text, bad json) never shift the order: when index i is bad, the sample
returned in its place is the first good one among i+1, i+2, ... (wrapping around), a function of i alone. Each
bad sample met is counted by reason and logged (rate-limited); the loader's `stats` sums the counts over all its
workers. A bad sample therefore makes its good successor appear twice in that epoch — a negligible bias next to
reshuffling everything after it, which would make resume depend on decoding.

Bad shards are counted once (`stats.shards_bad`) and named in a warning: a truncated or corrupt tar keeps the
samples before the damage (noted in the index, counted when a loader is built); a shard that cannot be opened, at
indexing or at reading time, contributes no samples (at reading time its indices are passed over as one block).
More than `data.max_bad_shards` of the shards unreadable stops the reader in one line (`TooManyBadShards`); a store
that answers nothing for `data.store_timeout` is not a bad shard but `data.remote.StoreUnreachable`, which the
reader lets through (from its loader's workers too) for the run to checkpoint and end.
"""

from __future__ import annotations

import collections
import errno
import hashlib
import json
import logging
import os
import time
from stat import S_ISREG
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from .buckets import assign_buckets, bucket_sizes
from .decode import DecodeSamples, collate as collate_samples
from .index import ShardIndex, load_or_build_index, parse_sample
from .order import BucketBatchSampler, IndexedBatchSampler
from .read_spec import ReadSpec
from .remote import DEFAULT_BUDGET, RemoteReadError, ShardCache, is_indexable_remote, raised_line
from .skips import CORRUPT_TAR, UNREADABLE_SHARD, NoUsableSamples, ReaderStats, counts_since, too_small_advice
from .weighted import StreamBatchSampler, WeightedBucketSampler

__all__ = ["IndexedShards", "TooManyBadShards", "BatchFetch", "IndexedLoader", "indexed_batch_sampler", "check_stream",
           "make_indexed_loader"]

log = logging.getLogger(__name__)

MAX_SUBSTITUTES = 100  # a bad sample is replaced by the next good one within this many indices, else one error
MAX_OPEN_SHARDS = 64  # per process; file descriptors are reused across samples of the same shard
REMOTE_RETRY_AFTER_S = 60.0  # a remote shard that could not be fetched is skipped this long, then asked for again


# --------------------------------------------------------------------------------------------------------------
# Random access to decoded samples
# --------------------------------------------------------------------------------------------------------------


class TooManyBadShards(NoUsableSamples):
    """More than data.max_bad_shards of the shards could not be read (at indexing or at reading time)."""

    def __init__(self, message: str = ""):
        super().__init__(raised_line(str(message), type(self)))


class IndexedShards(torch.utils.data.Dataset):
    """`ds[i]` -> {"pixels": (3, R, R) float32 in [-1, 1], "caption": str, "key": str} for 0 <= i < len(ds);
    `ds.get(i, (h, w))`: the same with pixels (3, h, w) (cover-resize + centre crop, for aspect-ratio buckets).

    A bad sample i is replaced by the first good one among i+1, i+2, ... (mod len), counted in `stats.bad` by
    reason; `raw(i)` gives the undecoded members. `stats` belongs to this process (each DataLoader worker has
    its own copy). `decode` turns raw samples into square ones (`data.decode.DecodeSamples`); a subclass reading
    other members replaces it.
    """

    def __init__(
        self,
        urls: str | Sequence[str] | ShardIndex,
        resolution: int,
        caption_field: str = "caption",
        index_dir: str | os.PathLike | None = None,
        min_size: int = 0,
        cache: ShardCache | None = None,
    ):
        if resolution < 1 or min_size < 0:
            raise ValueError(f"need resolution >= 1 and min_size >= 0 (got {resolution}, {min_size})")
        self.index = urls if isinstance(urls, ShardIndex) else load_or_build_index(urls, index_dir, cache)
        self.resolution = resolution
        self.caption_field = caption_field
        self.min_size = min_size
        urls = self.index.urls
        where = urls[0] if len(urls) == 1 else f"{len(urls)} shards ({urls[0]}, ...)"
        self.stats = ReaderStats(where=where)
        for entry in self.index.shardlist:  # problems found when indexing: counted once per loader
            note = entry.get("error")
            if note is not None:
                reason = UNREADABLE_SHARD if note.startswith(UNREADABLE_SHARD) else CORRUPT_TAR
                self.stats.count(reason, f"shard {entry['url']}: {reason}, {entry['nsamples']} samples used "
                                         f"({note[:200]})", shard=True)
        self.decode = DecodeSamples(resolution, caption_field, self.stats, min_size)
        self._sized_decoders: dict[tuple[int, int], DecodeSamples] = {}  # (h, w) -> decoder, sharing self.stats
        self._known_bad: set[int] = set()
        self._bad_shards: set[int] = set()  # could not be opened in this process: all their samples are skipped
        self._retry_at: dict[int, float] = {}  # remote shards that could not be fetched: when to ask again
        # shards that could not be read, at indexing or here: more than max_bad_shards of them stops the reader
        self._failed = {i for i, e in enumerate(self.index.shardlist) if str(e.get("error", "")).startswith(
            UNREADABLE_SHARD)}
        budget = (cache if cache is not None else self.index.cache or DEFAULT_BUDGET)
        self.max_bad_shards = getattr(budget, "budget", budget).max_bad_shards
        if self._failed:
            last = self.index.shardlist[max(self._failed)]
            self._check_failed_share(last["url"], last["error"])
        self._fds: collections.OrderedDict[int, int] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self.index)

    def _check_failed_share(self, url: str, why: str) -> None:
        """`TooManyBadShards` once more than data.max_bad_shards of the shards failed, at indexing or here."""
        shards = len(self.index.urls)
        if len(self._failed) > self.max_bad_shards * shards:
            raise TooManyBadShards(f"{len(self._failed)} of the {shards} shards of {self.stats.where} could not be "
                                   f"read (more than data.max_bad_shards={self.max_bad_shards:g}), the last {url}: "
                                   f"{why[:200]}; check the store and the shards")

    def fingerprint(self) -> str:
        """What decides `self[i]`, hashed: the shards (`ShardIndex.identity`) and how a sample is decoded from them
        (`decoding`). Equal fingerprints: the same sample at every index."""
        what = {"reader": type(self).__name__, "shards": self.index.identity(), "decoding": self.decoding()}
        return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:16]

    def decoding(self) -> dict[str, Any]:
        """The settings that turn a shard's record into sample i."""
        return {"resolution": self.resolution, "caption_field": self.caption_field, "min_size": self.min_size}

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_fds"] = collections.OrderedDict()
        return state

    def __del__(self) -> None:
        for fd in getattr(self, "_fds", {}).values():
            try:
                os.close(fd)
            except Exception:  # interpreter shutdown
                pass

    def _fd(self, shard: int) -> int:
        fd = self._fds.get(shard)
        if fd is None or (is_indexable_remote(self.index.urls[shard]) and os.fstat(fd).st_nlink == 0):
            # a shard to open, or a remote shard's copy the cache evicted (fetched again: its disk space stays taken
            # while it is open). Copies of other shards that the cache evicted are closed now, so that this process
            # holds no more disk than the cache's limit and the shard it reads
            for other, held in list(self._fds.items()):
                if other == shard or (is_indexable_remote(self.index.urls[other]) and os.fstat(held).st_nlink == 0):
                    os.close(self._fds.pop(other))
            if len(self._fds) >= MAX_OPEN_SHARDS:
                os.close(self._fds.popitem(last=False)[1])
            fd = self.index.open(shard)
            if not S_ISREG(os.fstat(fd).st_mode):  # e.g. a directory now stands where the shard was
                os.close(fd)
                raise IsADirectoryError(errno.EISDIR, "not a regular file", self.index.urls[shard])
            self._fds[shard] = fd
        else:
            self._fds.move_to_end(shard)
        return fd

    def raw(self, i: int) -> dict[str, Any]:
        """The undecoded members of sample i: {ext: bytes, "__key__", "__url__", "__index__"}; raises if unreadable."""
        shard, start, end = self.index.locate(i)
        blob = os.pread(self._fd(shard), end - start, start)
        if len(blob) != end - start:
            raise OSError(f"short read ({len(blob)} of {end - start} bytes): the shard changed, rebuild the index")
        sample = parse_sample(blob)
        sample["__url__"] = self.index.urls[shard]
        sample["__index__"] = i
        return sample

    def _decoder(self, size: tuple[int, int] | None) -> DecodeSamples:
        if size is None:
            return self.decode
        size = (int(size[0]), int(size[1]))
        if size not in self._sized_decoders:
            self._sized_decoders[size] = DecodeSamples(
                self.resolution, self.caption_field, self.stats, self.min_size, size=size
            )
        return self._sized_decoders[size]

    def _try(self, i: int, size: tuple[int, int] | None = None) -> dict[str, Any] | None:
        shard = self.index.locate(i)[0]
        url = self.index.urls[shard]
        try:
            self._fd(shard)
        except OSError as exn:  # vanished, permissions, I/O error: the whole shard is skipped
            self._bad_shards.add(shard)
            if isinstance(exn, RemoteReadError):  # the store may answer again: asked again after a pause
                self._retry_at[shard] = time.monotonic() + REMOTE_RETRY_AFTER_S
            self.stats.count(UNREADABLE_SHARD, f"skipping shard {url}: {UNREADABLE_SHARD} ({exn})", shard=True)
            self.stats.failed(f"{UNREADABLE_SHARD} {url}")
            self._failed.add(shard)
            self._check_failed_share(url, str(exn))
            return None
        try:
            raw = self.raw(i)
        except Exception as exn:  # I/O error, corrupt or changed tar
            reason = "unreadable sample"
            self.stats.count(reason, f"skipping bad sample {url}#{i}: {reason} {exn!r}")
            self.stats.failed(f"{reason} at {url}#{i}")
            return None
        decoded = list(self._decoder(size)([raw]))  # counts and logs the bad ones with the streaming reader's reasons
        return decoded[0] if decoded else None

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.get(i)

    def get_batch(self, indices: Sequence[int], size: tuple[int, int] | None = None) -> dict[str, Any]:
        """The collated batch of samples `indices` (each substituted like `get`), pixels of `size`; "indices" names
        the samples read."""
        samples = [self.get(i, size) for i in indices]
        return {**collate_samples(samples), "indices": [s["index"] for s in samples]}

    def get(self, i: int, size: tuple[int, int] | None = None) -> dict[str, Any]:
        """Sample i (or its substitute) with pixels of `size` = (height, width), default the square resolution."""
        n = len(self)
        i = int(i)
        if not 0 <= i < n:
            raise IndexError(f"sample index {i} out of range for {n} samples")
        k, visited, tried = i, 0, 0
        while visited < n and tried <= MAX_SUBSTITUTES:
            shard = int(np.searchsorted(self.index.starts, k, side="right")) - 1
            if shard in self._retry_at and time.monotonic() >= self._retry_at[shard]:
                self._bad_shards.discard(shard)
                del self._retry_at[shard]
            if shard in self._bad_shards:  # pass over the rest of an unreadable shard as one block
                end = int(self.index.starts[shard + 1])
                visited += end - k
                k = end % n
                continue
            visited += 1
            if k not in self._known_bad:  # counted and logged when first met: reported once per process
                tried += 1
                sample = self._try(k, size)
                if sample is not None:
                    sample["index"] = k  # the sample read, which a substitute is not: online balancing scores it
                    return sample
                if shard not in self._bad_shards:
                    self._known_bad.add(k)
            k = (k + 1) % n
        advice = too_small_advice(self.stats.bad) or "check the shards, the image format and data.caption_field"
        raise NoUsableSamples(f"sample {i} and the {visited - 1} after it are all unusable ({self.stats.bad}; bad "
                              f"shards: {self.stats.shards_bad}) in {self.stats.where}; {advice}")


# --------------------------------------------------------------------------------------------------------------
# Loader
# --------------------------------------------------------------------------------------------------------------


class BatchFetch(torch.utils.data.Dataset):
    """dataset[list of indices] -> one collated batch, with the bad-sample counts met while making it."""

    def __init__(self, dataset: IndexedShards):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, indices: list[int]) -> dict[str, Any]:
        stats = self.dataset.stats
        before, before_shards = dict(stats.bad), dict(stats.shards_bad)
        size = getattr(indices, "size", None)  # a BucketBatch: decode to its bucket's (height, width)
        batch = self.dataset.get_batch(indices, size)
        batch["_bad"] = counts_since(stats.bad, before)
        batch["_shards_bad"] = counts_since(stats.shards_bad, before_shards)
        return batch


def _identity(batch: Any) -> Any:
    return batch


class IndexedLoader:
    """Iterable of {"pixels": (B, 3, R, R), "captions": [str], "keys": [str], "indices": [int]}; each `iter()`
    starts at `start_batch`.

    With a `BucketBatchSampler`, pixels are (B, 3, h, w) for the batch's bucket (h, w). `stats` (main process)
    sums good and bad samples over all workers; `batches_per_epoch` is per rank; `sampler.batch_indices(t)` tells
    which samples batch t holds.
    """

    def __init__(
        self, dataset: IndexedShards, sampler: IndexedBatchSampler | BucketBatchSampler | StreamBatchSampler,
        num_workers: int = 0,
    ):
        self.dataset = dataset
        self.sampler = sampler
        self.batches_per_epoch = sampler.batches_per_epoch
        self.start_batch = sampler.start_batch
        self.buckets = getattr(sampler, "buckets", None)  # the (height, width) table when bucketing, else None
        # problems found when indexing (counted by the dataset at construction) + what the workers report
        self.stats = ReaderStats(where=dataset.stats.where, shards_bad=dict(dataset.stats.shards_bad))
        self._loader = torch.utils.data.DataLoader(
            BatchFetch(dataset),
            sampler=sampler,
            batch_size=None,  # the sampler yields whole batches; a map-style loader keeps their order
            collate_fn=_identity,
            num_workers=num_workers,
            persistent_workers=num_workers > 0,
            # A private generator: otherwise each iter() draws a worker base seed from torch's global RNG, so
            # creating the iterator after a checkpoint's RNG restore would shift every later random draw.
            generator=torch.Generator().manual_seed(sampler.seed),
        )

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for batch in self._loader:
            for reason, n in batch.pop("_bad").items():
                self.stats.bad[reason] = self.stats.bad.get(reason, 0) + n
            for reason, n in batch.pop("_shards_bad").items():
                self.stats.shards_bad[reason] = self.stats.shards_bad.get(reason, 0) + n
            self.stats.good += len(batch["keys"])
            yield batch


def indexed_batch_sampler(dataset: IndexedShards, spec: ReadSpec) -> IndexedBatchSampler:
    """The uniform `IndexedBatchSampler` of `spec` over all samples of `dataset` (its shard sizes give
    `spec.shard_window` its shards)."""
    return IndexedBatchSampler(len(dataset), spec.batch_size, seed=spec.seed, rank=spec.rank,
                               world_size=spec.world_size, start_batch=spec.batches_done,
                               shard_sizes=dataset.index.nsamples, shard_window=spec.shard_window)


def make_indexed_loader(
    shards: str | Sequence[str] | ShardIndex, spec: ReadSpec, *,
    sampler: StreamBatchSampler | WeightedBucketSampler | None = None, cache: ShardCache | None = None,
) -> IndexedLoader:
    """Infinite, exactly resumable loader over tar shards (a shard spec such as a folder or a brace pattern, a list
    of URLs, or their loaded `ShardIndex`; local, or remote read through `cache`, a `data.remote.ShardCache`) read as
    `spec` says; the same batches as `make_image_text_loader`.

    `spec.batches_done` = batches this rank already consumed (step * grad_accum after a resume): the first batch is
    the one an uninterrupted run would draw next. Every rank gets `loader.batches_per_epoch` batches per epoch.
    `spec.min_size` > 0 skips (substitutes) images whose shorter side is below it, in pixels.

    `spec.bucketing`: aspect-ratio buckets around `resolution`² pixels (`data.buckets.bucket_sizes(resolution,
    bucket_divisor)`); each batch comes from one bucket, pixels (B, 3, h, w) cover-resized and centre-cropped to it
    (`BucketBatchSampler` for the order; `loader.buckets` is the table).

    `sampler`: draw the batches from this weighted stream (`data.weighted`, made for these shards; with
    bucketing, a `WeightedBucketSampler` over `loader.buckets`' table) instead of the uniform order; the position,
    seed and shard window are then the sampler's business.
    """
    if sampler is not None and spec.bucketing != isinstance(sampler, WeightedBucketSampler):
        raise ValueError("a weighted stream with aspect-ratio buckets needs bucketing=True and a "
                         "WeightedBucketSampler, without them a StreamBatchSampler")
    buckets = bucket_sizes(spec.resolution, spec.bucket_divisor) if spec.bucketing else None  # checks first
    dataset = IndexedShards(shards, spec.resolution, caption_field=spec.caption_field, min_size=spec.min_size,
                            cache=cache)
    if spec.min_size:  # the index holds every image's size: a minimum that none meets is reported before any batch
        shorter = dataset.index.sizes.min(axis=1)
        largest = int(shorter.max()) if len(shorter) else 0  # 0: no readable image header, bad samples anyway
        if 0 < largest < spec.min_size:
            raise ValueError(f"data.min_size={spec.min_size}: no image in {dataset.stats.where} is that large (the "
                             f"largest shorter side is {largest} px); lower data.min_size")
    if buckets is not None and sampler is None:
        sizes = dataset.index.sizes
        sampler = BucketBatchSampler(assign_buckets(sizes[:, 0], sizes[:, 1], buckets), buckets, spec.batch_size,
                                     seed=spec.seed, rank=spec.rank, world_size=spec.world_size,
                                     start_batch=spec.batches_done)
        unknown = int(np.count_nonzero((sizes <= 0).any(axis=1)))
        log.info(
            "aspect-ratio buckets around %dx%d: %s; %d of %d samples per epoch used (per-bucket remainders "
            "dropped)%s", spec.resolution, spec.resolution, sampler.describe(), sampler.samples_per_epoch,
            len(dataset), f"; {unknown} samples of unknown size put in the square bucket" if unknown else "",
        )
        return IndexedLoader(dataset, sampler, num_workers=spec.num_workers)
    if sampler is None:
        sampler = indexed_batch_sampler(dataset, spec)
    else:
        check_stream(sampler, len(dataset), spec.batch_size)
        if buckets is not None and sampler.buckets != buckets:
            raise ValueError("the weighted bucket sampler was made for another bucket table than the loader's")
    return IndexedLoader(dataset, sampler, num_workers=spec.num_workers)


def check_stream(sampler: StreamBatchSampler | WeightedBucketSampler, num_samples: int, batch_size: int) -> None:
    """ValueError unless the weighted stream was made for `num_samples` samples and batches of `batch_size`."""
    made_for = sampler.num_samples
    if made_for != num_samples or sampler.batch_size != batch_size:
        raise ValueError(f"the weighted stream draws batches of {sampler.batch_size} from {made_for} samples, the "
                         f"loader reads batches of {batch_size} from {num_samples}")
