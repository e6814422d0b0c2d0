"""Indexed (random-access) reading of local img2dataset-layout tar shards, with exact resume.

Why a second reader: the streaming reader (`data.shards`) draws shards with replacement and shuffles in a buffer, so
after a resume it cannot reproduce the batches an uninterrupted run would have drawn. Here every batch is a pure
function of (seed, epoch, position in the epoch), computed arithmetically, so a loader built with
`start_batch = step * grad_accum` continues exactly where the checkpointed run stopped, without decoding (or even
reading) the skipped samples.

Index. Each shard is scanned once (tar headers, plus the header of each image, read by PIL without decoding; other
data blocks are seeked over): a sample is a run of consecutive regular members with the same key (`key.ext`, key =
the name up to the first dot of its basename, as webdataset groups them), and its byte span [first header, end of
last member's data) and image width and height (0, 0 when unreadable or absent: the image decoder, not a json
field, decides what the reader will see) are recorded. The table of all samples (int64, shape (N, 4): start, end,
width, height, in shard order) goes into `imba-index-<hash>-<state>.npy`, memory-mapped by every reader;
`imba-index-<hash>.json` lists the shards in the wids shard-list shape
`{"shardlist": [{"url", "nsamples", "filesize", "mtime_ns"}, ...]}`. Both live next to the shards (or in
`index_dir`; or under ~/.cache/imba-dit/indexed when the shard folder is read-only). On the next run a shard whose
size and mtime are unchanged is not rescanned; changed shards are rescanned and a new index is written (atomically:
ranks building the same index at the same time write identical files). Reading sample i is one `pread` of its span,
parsed as a small tar. Shards must be local, uncompressed tar files.

Order. Sample indices are visited in a permutation of range(N) that depends only on (seed, epoch): a keyed Feistel
network with cycle walking, a bijection computed position by position in O(1) memory, with no numpy/torch RNG
involved, so the order does not change with library versions. Optionally (`shard_window=k > 0`) the order is
shard-aware for locality: shards are permuted, grouped into windows of k consecutive shards, and samples are
permuted within each window, so at most ~k shards are read at a time (wids' ChunkedSampler does the same with
fixed chunks). Epoch e+1 uses a fresh permutation; the stream is infinite.

Ranks and batches. Epoch positions are cut into global batches of world_size * batch_size consecutive positions;
rank r takes the r-th slice of batch_size of each. Every rank therefore has exactly
`N // (world_size * batch_size)` batches per epoch (DDP never waits on a rank that ran out); the last
`N % (world_size * batch_size)` positions of each epoch are dropped, a different random set of samples each epoch.
Batches are index lists consumed by a map-style DataLoader, which returns them in sampler order whatever
`num_workers` is, and each batch is decoded by one worker: workers are disjoint and the order equals
`num_workers=0`.

Aspect-ratio buckets (`bucketing=True`, `BucketBatchSampler`, tables in `data.buckets`): each sample's bucket comes
from the image size in the index (nothing is decoded to assign it); every batch holds samples of one bucket, cut to
that bucket's (height, width). Per epoch each bucket's samples are permuted (keyed by seed, epoch, bucket) and cut
into full batches (each bucket's last `count % batch_size` samples of that permutation are dropped, a different
set each epoch); all buckets' batches are permuted together (keyed by seed, epoch), and consecutive groups of
world_size batches form the global steps, rank r taking the r-th: every rank has the same number of batches per
epoch, `(sum over buckets of count // batch_size) // world_size` (the last few batches of an epoch that do not fill
a step are dropped too), and ranks may be in different buckets at one step (DDP needs equal shapes only within a
rank). Batch t is computed from (seed, epoch, t) in O(batch_size), so `start_batch` resume is exact here too.

Bad samples (unreadable span, and the reasons of `data.shards`: bad image, zero-byte member, image too small,
missing or empty caption, non-UTF-8 text, bad json) never shift the order: when index i is bad, the sample
returned in its place is the first good one among i+1, i+2, ... (wrapping around), a function of i alone. Each
bad sample met is counted by reason and logged (rate-limited); the loader's `stats` sums the counts over all its
workers. A bad sample therefore makes its good successor appear twice in that epoch — a negligible bias next to
reshuffling everything after it, which would make resume depend on decoding.

Bad shards are counted once (`stats.shards_bad`) and named in a warning: a truncated or corrupt tar keeps the
samples before the damage (noted in the index, counted when a loader is built); a shard that cannot be opened, at
indexing or at reading time, contributes no samples (at reading time its indices are passed over as one block).
"""

from __future__ import annotations

import collections
import errno
import functools
import hashlib
import io
import json
import logging
import os
import re
import tarfile
import warnings
from stat import S_ISREG
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch
from PIL import Image

from .buckets import assign_buckets, bucket_sizes
from .shards import (
    CORRUPT_TAR,
    IMAGE_EXTENSIONS,
    REMOTE_PREFIXES,
    UNREADABLE_SHARD,
    ReaderStats,
    check_loader_args,
    _collate,
    _DecodeSamples,
    derive_seed,
    expand_urls,
)

__all__ = [
    "INDEX_VERSION",
    "BucketBatch",
    "BucketBatchSampler",
    "ShardIndex",
    "load_or_build_index",
    "IndexedShards",
    "IndexedBatchSampler",
    "IndexedLoader",
    "batches_per_epoch",
    "feistel_permute",
    "make_indexed_loader",
]

log = logging.getLogger(__name__)

INDEX_VERSION = 2  # 2: image width and height per sample (aspect-ratio buckets); 1: byte spans only
INDEX_KIND = "imba-dit indexed tar shards"
MAX_SUBSTITUTES = 100  # a bad sample is replaced by the next good one within this many indices, else one error
MAX_OPEN_SHARDS = 64  # per process; file descriptors are reused across samples of the same shard
FEISTEL_ROUNDS = 8

_KEY_EXT = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")  # webdataset's base_plus_ext: key up to the first dot
_META = re.compile(r"__[^/]*__($|/)")  # webdataset skips members like __index__
_COMPRESSED_MAGIC = {b"\x1f\x8b": "gzip", b"BZh": "bzip2", b"\xfd7zXZ\x00": "xz", b"\x28\xb5\x2f\xfd": "zstd"}


# --------------------------------------------------------------------------------------------------------------
# Tar parsing
# --------------------------------------------------------------------------------------------------------------


def _member_key_ext(info: tarfile.TarInfo) -> tuple[str, str] | None:
    """(key, lower-case extension) of a sample member, or None for members a sample does not contain."""
    if not info.isreg() or _META.match(info.name):
        return None
    match = _KEY_EXT.match(info.name)
    if match is None:
        return None
    return match.group(1), match.group(2).lower()


def _compression(path: str) -> str | None:
    with open(path, "rb") as f:
        head = f.read(6)
    for magic, name in _COMPRESSED_MAGIC.items():
        if head.startswith(magic):
            return name
    return None


def _image_size(tf: tarfile.TarFile, info: tarfile.TarInfo) -> tuple[int, int]:
    """(width, height) from an image member's header (PIL reads the header only); (0, 0) if it cannot be read."""
    if info.size == 0:
        return 0, 0
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. DecompressionBombWarning: the reader decides, not the index
            with Image.open(tf.extractfile(info)) as img:
                width, height = img.size
        return int(width), int(height)
    except Exception:  # undecodable: the reader will skip (and count) it
        return 0, 0


def _scan_tar(path: str) -> tuple[np.ndarray, str | None]:
    """Table (n, 4) of the samples of one tar shard — byte start, byte end, image width, image height — and an
    error note if it could not be read to the end.

    The size is that of the image member the reader decodes (the first of IMAGE_EXTENSIONS the sample has);
    (0, 0) when it has none or its header cannot be read. A truncated or corrupt shard keeps the samples read
    before the damage (their spans lie inside the file).
    """
    compression = _compression(path)
    if compression is not None:
        raise ValueError(
            f"indexed mode needs uncompressed .tar shards, {path} is {compression}-compressed: "
            f"decompress it or use data.mode=streaming"
        )
    size = os.path.getsize(path)
    spans: list[list[int]] = []
    error = None
    current = None
    image_rank = len(IMAGE_EXTENSIONS)  # of the image member whose size the current sample holds
    try:
        with open(path, "rb") as f, tarfile.open(fileobj=f, mode="r:") as tf:
            while True:
                info = tf.next()
                if info is None:
                    break
                key_ext = _member_key_ext(info)
                if key_ext is None:
                    continue
                end = info.offset_data + info.size  # padding excluded (a file may end without it)
                if key_ext[0] != current:
                    spans.append([info.offset, end, 0, 0])
                    current = key_ext[0]
                    image_rank = len(IMAGE_EXTENSIONS)
                else:
                    spans[-1][1] = end
                if key_ext[1] in IMAGE_EXTENSIONS and IMAGE_EXTENSIONS.index(key_ext[1]) < image_rank:
                    image_rank = IMAGE_EXTENSIONS.index(key_ext[1])
                    spans[-1][2:] = _image_size(tf, info)
                tf.members.clear()  # headers only; keep memory flat for big shards
    except (tarfile.TarError, EOFError, OSError) as exn:
        error = f"{type(exn).__name__}: {exn}"
    kept = [s for s in spans if s[1] <= size]
    if len(kept) < len(spans) and error is None:
        error = "truncated"
    return np.asarray(kept, dtype=np.int64).reshape(-1, 4), error


def _parse_sample(blob: bytes) -> dict[str, Any]:
    """{ext: bytes, "__key__": key} from the bytes of one sample's members (a tar fragment)."""
    sample: dict[str, Any] = {}
    blob += bytes(-len(blob) % 512)  # the last member's padding: tarfile checks that it is there
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r:") as tf:
        for info in tf:
            key_ext = _member_key_ext(info)
            if key_ext is None:
                continue
            key, ext = key_ext
            if sample.setdefault("__key__", key) != key:
                raise ValueError(f"span holds two keys ({sample['__key__']}, {key}): the shard changed, rebuild")
            if ext in sample:
                raise ValueError(f"duplicate member {info.name}")
            sample[ext] = tf.extractfile(info).read()
    if "__key__" not in sample:
        raise ValueError("no sample members at the indexed offset: the shard changed, rebuild the index")
    return sample


# --------------------------------------------------------------------------------------------------------------
# The index and its cache
# --------------------------------------------------------------------------------------------------------------


def _check_local(urls: Sequence[str]) -> None:
    for url in urls:
        if str(url).startswith(REMOTE_PREFIXES):
            raise ValueError(
                f"indexed mode needs local shards; use data.mode=streaming for pipe:/http/s3 (got {str(url)[:120]!r})"
            )


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def _stat(path: str) -> dict[str, int]:
    st = os.stat(path)
    return {"filesize": st.st_size, "mtime_ns": st.st_mtime_ns}


def _default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "imba-dit", "indexed")


def _atomic_write(path: str, write) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            write(f)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


class ShardIndex:
    """Sample spans and image sizes of a list of local tar shards; global index i runs through the shards in order.

    `spans_path` / `spans` hold the (N, 4) table (start, end, width, height); the `spans` property is its first
    two columns, `sizes` its last two. Picklable; the table is memory-mapped lazily in each process when the index
    lives in a file.
    """

    def __init__(
        self,
        shardlist: list[dict[str, Any]],
        spans_path: str | None = None,
        spans: np.ndarray | None = None,
        path: str | None = None,
        rescanned: Sequence[str] = (),
    ):
        self.shardlist = shardlist
        self.urls = [s["url"] for s in shardlist]
        self.nsamples = [int(s["nsamples"]) for s in shardlist]
        self.starts = np.concatenate([[0], np.cumsum(self.nsamples, dtype=np.int64)])
        self.spans_path = spans_path
        self.path = path  # the JSON file, None when kept in memory only
        self.rescanned = list(rescanned)  # urls scanned when this index was loaded (empty: fully from cache)
        self._spans = spans

    def __len__(self) -> int:
        return int(self.starts[-1])

    @property
    def table(self) -> np.ndarray:
        """(N, 4) int64: byte start, byte end, image width, image height (0, 0: unknown) of every sample."""
        if self._spans is None:
            self._spans = np.load(self.spans_path, mmap_mode="r")
        return self._spans

    @property
    def spans(self) -> np.ndarray:
        """(N, 2) byte spans [start, end) of the samples in their shards."""
        return self.table[:, :2]

    @property
    def sizes(self) -> np.ndarray:
        """(N, 2) image (width, height) of the samples, from the image headers; (0, 0) where unknown."""
        return self.table[:, 2:4]

    def locate(self, i: int) -> tuple[int, int, int]:
        """(shard number, byte start, byte end) of sample i."""
        shard = int(np.searchsorted(self.starts, i, side="right")) - 1
        start, end = self.table[i, :2]
        return shard, int(start), int(end)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        if self.spans_path is not None:
            state["_spans"] = None  # reopen the memory map in the worker
        return state


def _read_cached(json_path: str) -> tuple[dict[str, dict], str | None, np.ndarray | None]:
    """url -> shard entry (with its spans) from a cached index; ({}, None, None) if absent or unreadable."""
    try:
        with open(json_path) as f:
            meta = json.load(f)
        if meta.get("__kind__") != INDEX_KIND or meta.get("version") != INDEX_VERSION:
            return {}, None, None
        spans_path = os.path.join(os.path.dirname(json_path), meta["spans"])
        spans = np.load(spans_path, mmap_mode="r")
        shardlist = meta["shardlist"]
        if spans.ndim != 2 or spans.shape != (sum(s["nsamples"] for s in shardlist), 4):
            return {}, None, None
    except (OSError, ValueError, KeyError, TypeError):
        return {}, None, None
    out, start = {}, 0
    for entry in shardlist:
        out[entry["url"]] = dict(entry, spans=spans[start : start + entry["nsamples"]])
        start += entry["nsamples"]
    return out, spans_path, spans


def _write_index(
    folder: str, name: str, shardlist: list[dict], spans: np.ndarray, old_spans: str | None
) -> tuple[str, str]:
    """Write `<name>.json` and its spans file into `folder`; return both paths."""
    os.makedirs(folder, exist_ok=True)
    state = _digest(json.dumps(shardlist, sort_keys=True))
    spans_name = f"{name}-{state}.npy"
    json_path = os.path.join(folder, f"{name}.json")
    meta = {
        "__kind__": INDEX_KIND,
        "version": INDEX_VERSION,
        "wids_version": 1,
        "spans": spans_name,
        "shardlist": shardlist,
    }
    _atomic_write(os.path.join(folder, spans_name), lambda f: np.save(f, spans))
    _atomic_write(json_path, lambda f: f.write((json.dumps(meta, indent=1) + "\n").encode("utf-8")))
    if old_spans and os.path.abspath(old_spans) != os.path.abspath(os.path.join(folder, spans_name)):
        try:  # open memory maps of other processes stay valid on POSIX
            os.remove(old_spans)
        except OSError:
            pass
    return json_path, os.path.join(folder, spans_name)


def load_or_build_index(
    urls: str | os.PathLike | Sequence[str | os.PathLike], index_dir: str | os.PathLike | None = None
) -> ShardIndex:
    """The index of local tar shards `urls` (any spec `expand_urls` takes), from its cache when still valid.

    The cache is `imba-index-<hash of the shard paths>.json` (+ `.npy` spans) in `index_dir`, else in the first
    shard's folder, falling back to ~/.cache/imba-dit/indexed when that folder is not writable. Shards whose size
    or mtime changed are rescanned (`index.rescanned` lists them). Safe to call on every rank at once (identical
    atomic writes); to scan only once, call it on rank 0 before a barrier.
    """
    _check_local([os.fspath(u) for u in ([urls] if isinstance(urls, (str, os.PathLike)) else urls)])
    paths = [os.path.abspath(u) for u in expand_urls(urls)]
    _check_local(paths)
    name = f"imba-index-{_digest(chr(10).join(paths))}"
    folders = [os.fspath(index_dir)] if index_dir is not None else [os.path.dirname(paths[0]), _default_cache_dir()]

    cached: dict[str, dict] = {}
    old_spans, old_map = None, None
    for folder in folders:
        cached, old_spans, old_map = _read_cached(os.path.join(folder, f"{name}.json"))
        if cached:
            break

    shardlist: list[dict[str, Any]] = []
    parts: list[np.ndarray] = []
    rescanned: list[str] = []
    for path in paths:
        try:
            stat = _stat(path)
            entry = cached.get(path)
            if entry is not None and all(entry.get(k) == v for k, v in stat.items()):
                spans = np.asarray(entry["spans"])
                note = entry.get("error")
            else:
                rescanned.append(path)
                spans, note = _scan_tar(path)
                if note is not None:
                    log.warning("shard %s: %s (%s); using the %d samples before the damage", path, CORRUPT_TAR,
                                note[:200], len(spans))
        except OSError as exn:  # cannot stat or open: no samples now, rescanned next time (size/mtime never match)
            stat = {"filesize": -1, "mtime_ns": -1}
            spans, note = np.zeros((0, 4), np.int64), f"{UNREADABLE_SHARD}: {type(exn).__name__}: {exn}"
            if path not in rescanned:
                rescanned.append(path)
            log.warning("skipping shard %s: %s", path, note[:300])
        item = {"url": path, "nsamples": int(len(spans)), **stat}
        if note is not None:
            item["error"] = note
        shardlist.append(item)
        parts.append(spans)

    total = sum(s["nsamples"] for s in shardlist)
    if total == 0:
        raise ValueError(
            f"no samples found in {len(paths)} shard(s) ({paths[0]}, ...): indexed mode needs uncompressed "
            f"img2dataset-style tar files (key.jpg + key.txt)"
        )
    if not rescanned and old_spans is not None and [s["url"] for s in shardlist] == list(cached):
        json_path = os.path.join(os.path.dirname(old_spans), f"{name}.json")
        return ShardIndex(shardlist, spans_path=old_spans, spans=old_map, path=json_path)

    spans = np.concatenate(parts).astype(np.int64).reshape(-1, 4)
    for folder in folders:
        try:
            json_path, spans_path = _write_index(folder, name, shardlist, spans, old_spans)
        except OSError as exn:
            log.info("cannot write the shard index to %s (%s); trying the next place", folder, exn)
            continue
        log.info("indexed %d samples in %d shards (%d scanned) -> %s", total, len(paths), len(rescanned), json_path)
        return ShardIndex(shardlist, spans_path=spans_path, path=json_path, rescanned=rescanned)
    log.warning("could not write the shard index anywhere (%s); keeping it in memory", ", ".join(folders))
    return ShardIndex(shardlist, spans=spans, rescanned=rescanned)


# --------------------------------------------------------------------------------------------------------------
# Random access to decoded samples
# --------------------------------------------------------------------------------------------------------------


class IndexedShards(torch.utils.data.Dataset):
    """`ds[i]` -> {"pixels": (3, R, R) float32 in [-1, 1], "caption": str, "key": str} for 0 <= i < len(ds);
    `ds.get(i, (h, w))`: the same with pixels (3, h, w) (cover-resize + centre crop, for aspect-ratio buckets).

    A bad sample i is replaced by the first good one among i+1, i+2, ... (mod len), counted in `stats.bad` by
    reason; `raw(i)` gives the undecoded members. `stats` belongs to this process (each DataLoader worker has
    its own copy).
    """

    def __init__(
        self,
        urls: str | Sequence[str] | ShardIndex,
        resolution: int,
        caption_field: str = "caption",
        index_dir: str | os.PathLike | None = None,
        min_size: int = 0,
    ):
        if resolution < 1 or min_size < 0:
            raise ValueError(f"need resolution >= 1 and min_size >= 0 (got {resolution}, {min_size})")
        self.index = urls if isinstance(urls, ShardIndex) else load_or_build_index(urls, index_dir)
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
        self._decode = _DecodeSamples(resolution, caption_field, self.stats, min_size)
        self._sized_decoders: dict[tuple[int, int], _DecodeSamples] = {}  # (h, w) -> decoder, sharing self.stats
        self._known_bad: set[int] = set()
        self._bad_shards: set[int] = set()  # could not be opened in this process: all their samples are skipped
        self._fds: collections.OrderedDict[int, int] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self.index)

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
        if fd is None:
            if len(self._fds) >= MAX_OPEN_SHARDS:
                os.close(self._fds.popitem(last=False)[1])
            fd = os.open(self.index.urls[shard], os.O_RDONLY)
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
        sample = _parse_sample(blob)
        sample["__url__"] = self.index.urls[shard]
        sample["__index__"] = i
        return sample

    def _decoder(self, size: tuple[int, int] | None) -> _DecodeSamples:
        if size is None:
            return self._decode
        size = (int(size[0]), int(size[1]))
        if size not in self._sized_decoders:
            self._sized_decoders[size] = _DecodeSamples(
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
            self.stats.count(UNREADABLE_SHARD, f"skipping shard {url}: {UNREADABLE_SHARD} ({exn})", shard=True)
            self.stats.failed(f"{UNREADABLE_SHARD} {url}")
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

    def get(self, i: int, size: tuple[int, int] | None = None) -> dict[str, Any]:
        """Sample i (or its substitute) with pixels of `size` = (height, width), default the square resolution."""
        n = len(self)
        i = int(i)
        if not 0 <= i < n:
            raise IndexError(f"sample index {i} out of range for {n} samples")
        k, visited, tried = i, 0, 0
        while visited < n and tried <= MAX_SUBSTITUTES:
            shard = int(np.searchsorted(self.index.starts, k, side="right")) - 1
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
                    return sample
                if shard not in self._bad_shards:
                    self._known_bad.add(k)
            k = (k + 1) % n
        raise RuntimeError(
            f"sample {i} and the {visited - 1} after it are all unusable ({self.stats.bad}; bad shards: "
            f"{self.stats.shards_bad}) in {self.stats.where}; check the shards, the image format and "
            f"data.caption_field"
        )


# --------------------------------------------------------------------------------------------------------------
# Order: a pure function of (seed, epoch, position)
# --------------------------------------------------------------------------------------------------------------

_U64 = np.uint64


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser on uint64 arrays (wrapping arithmetic)."""
    x = (x ^ (x >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> _U64(27))) * _U64(0x94D049BB133111EB)
    return x ^ (x >> _U64(31))


@functools.lru_cache(maxsize=4096)
def _round_keys(*key: Any) -> tuple[int, ...]:
    return tuple(derive_seed("imba-indexed/feistel", *key, r) for r in range(FEISTEL_ROUNDS))


def feistel_permute(positions: np.ndarray | Sequence[int], n: int, *key: Any) -> np.ndarray:
    """perm(positions) for a pseudo-random permutation `perm` of range(n) chosen by `key` (any printable parts).

    A balanced Feistel network on the smallest even number of bits covering n, with cycle walking to stay inside
    range(n): a bijection, evaluated per position, identical on every machine and library version.
    """
    pos = np.asarray(positions, dtype=np.int64)
    if n < 1 or (pos.size and (pos.min() < 0 or pos.max() >= n)):
        raise ValueError(f"positions must lie in range({n})")
    bits = max(2, (n - 1).bit_length())
    half = (bits + 1) // 2
    mask = _U64((1 << half) - 1)
    keys = [_U64(k) for k in _round_keys(*key)]

    def rounds(x: np.ndarray) -> np.ndarray:
        left, right = x >> _U64(half), x & mask
        for k in keys:
            left, right = right, left ^ (_mix64(right ^ k) & mask)
        return (left << _U64(half)) | right

    out = pos.astype(np.uint64)
    todo = np.arange(out.size)
    while todo.size:
        out[todo] = rounds(out[todo])
        todo = todo[out[todo] >= _U64(n)]
    return out.astype(np.int64)


def batches_per_epoch(num_samples: int, batch_size: int, world_size: int = 1) -> int:
    """Batches each rank draws per epoch: num_samples // (world_size * batch_size) (the remainder is dropped)."""
    return num_samples // (world_size * batch_size)


class IndexedBatchSampler:
    """Infinite stream of this rank's batches (lists of sample indices), starting at batch `start_batch`.

    Batch t of rank r is positions [(k * world_size + r) * B, ... + B) of epoch e = t // batches_per_epoch,
    k = t % batches_per_epoch, mapped to sample indices by the epoch's permutation (`epoch_indices`).
    `shard_sizes` + `shard_window=k > 0` select the shard-aware order (see the module doc); 0 = uniform.
    """

    def __init__(
        self,
        num_samples: int,
        batch_size: int,
        *,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        start_batch: int = 0,
        shard_sizes: Sequence[int] | None = None,
        shard_window: int = 0,
    ):
        if batch_size < 1 or world_size < 1 or start_batch < 0 or shard_window < 0:
            raise ValueError(
                f"need batch_size >= 1, world_size >= 1, start_batch >= 0, shard_window >= 0 "
                f"(got {batch_size}, {world_size}, {start_batch}, {shard_window})"
            )
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        if num_samples < world_size * batch_size:
            raise ValueError(
                f"{num_samples} samples are fewer than one global batch (world_size {world_size} x batch_size "
                f"{batch_size}); use more data or a smaller batch"
            )
        if shard_window and (shard_sizes is None or sum(shard_sizes) != num_samples):
            raise ValueError("shard_window needs shard_sizes that sum to num_samples")
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.start_batch = start_batch
        self.shard_window = shard_window
        self.shard_sizes = np.asarray(shard_sizes if shard_sizes is not None else [num_samples], dtype=np.int64)
        self.shard_starts = np.concatenate([[0], np.cumsum(self.shard_sizes)])
        self.batches_per_epoch = batches_per_epoch(num_samples, batch_size, world_size)
        self._windows: tuple[int, list[np.ndarray], np.ndarray] | None = None

    def _epoch_windows(self, epoch: int) -> tuple[list[np.ndarray], np.ndarray]:
        """Shard numbers of each window (in permuted order) and the windows' first positions, for one epoch."""
        if self._windows is None or self._windows[0] != epoch:
            m = len(self.shard_sizes)
            order = feistel_permute(np.arange(m), m, "shards", self.seed, epoch)
            groups = [order[i : i + self.shard_window] for i in range(0, m, self.shard_window)]
            starts = np.concatenate([[0], np.cumsum([self.shard_sizes[g].sum() for g in groups])])
            self._windows = (epoch, groups, starts)
        return self._windows[1], self._windows[2]

    def epoch_indices(self, epoch: int, positions: np.ndarray | Sequence[int]) -> np.ndarray:
        """Sample indices at `positions` of epoch `epoch`'s order (a permutation of range(num_samples))."""
        pos = np.asarray(positions, dtype=np.int64)
        if not self.shard_window:
            return feistel_permute(pos, self.num_samples, "samples", self.seed, epoch)
        groups, starts = self._epoch_windows(epoch)
        out = np.empty_like(pos)
        window = np.searchsorted(starts, pos, side="right") - 1
        for w in np.unique(window):
            sel = window == w
            shards = groups[w]
            sizes = self.shard_sizes[shards]
            local = feistel_permute(pos[sel] - starts[w], int(sizes.sum()), "window", self.seed, epoch, int(w))
            inner = np.concatenate([[0], np.cumsum(sizes)])
            which = np.searchsorted(inner, local, side="right") - 1
            out[sel] = self.shard_starts[shards[which]] + local - inner[which]
        return out

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The whole order of one epoch (all positions, including the dropped remainder)."""
        return self.epoch_indices(epoch, np.arange(self.num_samples))

    def batch_indices(self, t: int) -> list[int]:
        """Sample indices of this rank's batch t (counted from the start of training)."""
        epoch, k = divmod(t, self.batches_per_epoch)
        first = (k * self.world_size + self.rank) * self.batch_size
        return self.epoch_indices(epoch, np.arange(first, first + self.batch_size)).tolist()

    def __iter__(self) -> Iterator[list[int]]:
        t = self.start_batch
        while True:
            yield self.batch_indices(t)
            t += 1


class BucketBatch(list):
    """A batch of sample indices from one aspect-ratio bucket; `size` = the bucket's (height, width) in pixels."""

    def __init__(self, indices: Sequence[int], size: tuple[int, int]):
        super().__init__(indices)
        self.size = (int(size[0]), int(size[1]))

    def __reduce__(self):
        return BucketBatch, (list(self), self.size)

    def __repr__(self) -> str:
        return f"BucketBatch({list(self)!r}, size={self.size})"


class BucketBatchSampler:
    """Infinite stream of this rank's single-bucket batches (`BucketBatch`), starting at batch `start_batch`.

    `bucket_ids[i]` is sample i's bucket, an index into `buckets` ((height, width) pairs). Epoch e: bucket b's
    samples (ascending sample index) are permuted by a Feistel permutation keyed (seed, e, b) and cut into
    `count_b // batch_size` full batches (the rest of that permutation is dropped for the epoch); all buckets'
    batches, numbered bucket after bucket, are permuted keyed (seed, e); global step k of the epoch is batches
    [k * world_size, (k + 1) * world_size) of that order and rank r takes the r-th. Every rank has
    `batches_per_epoch = (sum_b count_b // batch_size) // world_size` batches per epoch. Batch t is a pure function
    of (seed, t, rank, world_size, bucket_ids), computed in O(batch_size).
    """

    def __init__(
        self,
        bucket_ids: np.ndarray | Sequence[int],
        buckets: Sequence[tuple[int, int]],
        batch_size: int,
        *,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        start_batch: int = 0,
    ):
        if batch_size < 1 or world_size < 1 or start_batch < 0:
            raise ValueError(
                f"need batch_size >= 1, world_size >= 1, start_batch >= 0 (got {batch_size}, {world_size}, "
                f"{start_batch})"
            )
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        ids = np.asarray(bucket_ids, dtype=np.int64).reshape(-1)
        self.buckets = [(int(h), int(w)) for h, w in buckets]
        if ids.size and (ids.min() < 0 or ids.max() >= len(self.buckets)):
            raise ValueError(f"bucket ids must lie in range({len(self.buckets)})")
        self.num_samples = int(ids.size)
        self.batch_size = batch_size
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.start_batch = start_batch
        index_dtype = np.int32 if self.num_samples < 2**31 else np.int64
        self.members = np.argsort(ids, kind="stable").astype(index_dtype)  # sample indices grouped by bucket
        self.counts = np.bincount(ids, minlength=len(self.buckets)).astype(np.int64)  # samples per bucket
        self.member_starts = np.concatenate([[0], np.cumsum(self.counts)])
        self.bucket_batches = self.counts // batch_size  # full batches per bucket and epoch
        self.batch_starts = np.concatenate([[0], np.cumsum(self.bucket_batches)])
        self.total_batches = int(self.batch_starts[-1])  # all ranks together, per epoch
        self.batches_per_epoch = self.total_batches // world_size
        if self.batches_per_epoch == 0:
            raise ValueError(
                f"aspect-ratio buckets give {self.total_batches} full batches of {batch_size} from {self.num_samples} "
                f"samples (per bucket: {self.describe()}), fewer than one per rank (world_size {world_size}); use "
                f"more data or a smaller batch"
            )

    @property
    def samples_per_epoch(self) -> int:
        """Samples all ranks together draw per epoch (the rest are dropped: per-bucket and per-step remainders)."""
        return self.batches_per_epoch * self.world_size * self.batch_size

    def describe(self) -> str:
        """The non-empty buckets as `HxW: count`."""
        return ", ".join(f"{h}x{w}: {int(c)}" for (h, w), c in zip(self.buckets, self.counts) if c) or "none"

    def batch_indices(self, t: int) -> BucketBatch:
        """Sample indices (and bucket size) of this rank's batch t (counted from the start of training)."""
        epoch, k = divmod(int(t), self.batches_per_epoch)
        slot = int(feistel_permute([k * self.world_size + self.rank], self.total_batches, "bucket-batches",
                                   self.seed, epoch)[0])
        b = int(np.searchsorted(self.batch_starts, slot, side="right")) - 1
        j = slot - int(self.batch_starts[b])
        pos = np.arange(j * self.batch_size, (j + 1) * self.batch_size)
        pos = feistel_permute(pos, int(self.counts[b]), "bucket-samples", self.seed, epoch, b)
        return BucketBatch(self.members[self.member_starts[b] + pos].tolist(), self.buckets[b])

    def __iter__(self) -> Iterator[BucketBatch]:
        t = self.start_batch
        while True:
            yield self.batch_indices(t)
            t += 1


# --------------------------------------------------------------------------------------------------------------
# Loader
# --------------------------------------------------------------------------------------------------------------


class _BatchFetch(torch.utils.data.Dataset):
    """dataset[list of indices] -> one collated batch, with the bad-sample counts met while making it."""

    def __init__(self, dataset: IndexedShards, collate: Callable[[list[dict[str, Any]]], dict[str, Any]] = _collate):
        self.dataset = dataset
        self.collate = collate

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, indices: list[int]) -> dict[str, Any]:
        stats = self.dataset.stats
        before, before_shards = dict(stats.bad), dict(stats.shards_bad)
        size = getattr(indices, "size", None)  # a BucketBatch: decode to its bucket's (height, width)
        batch = self.collate([self.dataset.get(i, size) for i in indices])
        batch["_bad"] = {r: n - before.get(r, 0) for r, n in stats.bad.items() if n != before.get(r, 0)}
        batch["_shards_bad"] = {
            r: n - before_shards.get(r, 0) for r, n in stats.shards_bad.items() if n != before_shards.get(r, 0)
        }
        return batch


def _identity(batch: Any) -> Any:
    return batch


class IndexedLoader:
    """Iterable of {"pixels": (B, 3, R, R), "captions": [str], "keys": [str]}; each `iter()` starts at `start_batch`.

    With a `BucketBatchSampler`, pixels are (B, 3, h, w) for the batch's bucket (h, w). `stats` (main process)
    sums good and bad samples over all workers; `batches_per_epoch` is per rank; `sampler.batch_indices(t)` tells
    which samples batch t holds.
    """

    def __init__(
        self, dataset: IndexedShards, sampler: IndexedBatchSampler | BucketBatchSampler, num_workers: int = 0,
        collate: Callable[[list[dict[str, Any]]], dict[str, Any]] = _collate,
    ):
        self.dataset = dataset
        self.sampler = sampler
        self.batches_per_epoch = sampler.batches_per_epoch
        self.start_batch = sampler.start_batch
        self.buckets = getattr(sampler, "buckets", None)  # the (height, width) table when bucketing, else None
        # problems found when indexing (counted by the dataset at construction) + what the workers report
        self.stats = ReaderStats(where=dataset.stats.where, shards_bad=dict(dataset.stats.shards_bad))
        self._loader = torch.utils.data.DataLoader(
            _BatchFetch(dataset, collate),
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


def make_indexed_loader(
    urls: str | Sequence[str],
    resolution: int,
    batch_size: int,
    num_workers: int = 0,
    seed: int = 0,
    rank: int = 0,
    world_size: int = 1,
    start_batch: int = 0,
    caption_field: str = "caption",
    index_dir: str | os.PathLike | None = None,
    shard_window: int = 0,
    min_size: int = 0,
    bucketing: bool = False,
    bucket_divisor: int = 16,
    max_aspect_ratio: float = 4.0,
) -> IndexedLoader:
    """Infinite, exactly resumable loader over local tar shards; same batches as `make_image_text_loader`.

    `start_batch` = batches this rank already consumed (step * grad_accum after a resume): the first batch is
    the one an uninterrupted run would draw next. Every rank gets `loader.batches_per_epoch` batches per epoch.
    `shard_window` > 0 reads shards in windows of that many for locality (0: uniform order over all samples).
    `min_size` > 0 skips (substitutes) images whose shorter side is below it, in pixels.

    `bucketing=True`: aspect-ratio buckets around `resolution`² pixels (`data.buckets.bucket_sizes(resolution,
    bucket_divisor, max_aspect_ratio)`; the divisor is VAE downsampling x DiT patch size); each batch comes from
    one bucket, pixels (B, 3, h, w) cover-resized and centre-cropped to it (`BucketBatchSampler` for the order;
    `loader.buckets` is the table). Not combined with `shard_window`.
    """
    check_loader_args(resolution, batch_size, num_workers, min_size)
    if bucketing and shard_window:
        raise ValueError("aspect-ratio bucketing reads samples in a uniform order: set shard_window=0")
    buckets = bucket_sizes(resolution, bucket_divisor, max_aspect_ratio) if bucketing else None  # checks first
    dataset = IndexedShards(urls, resolution, caption_field=caption_field, index_dir=index_dir, min_size=min_size)
    if buckets is not None:
        sizes = dataset.index.sizes
        sampler = BucketBatchSampler(
            assign_buckets(sizes[:, 0], sizes[:, 1], buckets),
            buckets,
            batch_size,
            seed=seed,
            rank=rank,
            world_size=world_size,
            start_batch=start_batch,
        )
        unknown = int(np.count_nonzero((sizes <= 0).any(axis=1)))
        log.info(
            "aspect-ratio buckets around %dx%d: %s; %d of %d samples per epoch used (per-bucket remainders "
            "dropped)%s", resolution, resolution, sampler.describe(), sampler.samples_per_epoch, len(dataset),
            f"; {unknown} samples of unknown size put in the square bucket" if unknown else "",
        )
        return IndexedLoader(dataset, sampler, num_workers=num_workers)
    sampler = IndexedBatchSampler(
        len(dataset),
        batch_size,
        seed=seed,
        rank=rank,
        world_size=world_size,
        start_batch=start_batch,
        shard_sizes=dataset.index.nsamples,
        shard_window=shard_window,
    )
    return IndexedLoader(dataset, sampler, num_workers=num_workers)
