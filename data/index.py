"""The index of img2dataset-layout tar shards: where every sample lies, and how big its image is.

Each shard is scanned once (tar headers, plus the header of each image, read by PIL without decoding; other
data blocks are seeked over): a sample is a run of consecutive regular members with the same key (`key.ext`, key =
the name up to the first dot of its basename, as webdataset groups them: `data.tars.split_key_ext`), and its byte
span [first header, end of last member's data) and image width and height (0, 0 when unreadable or absent: the
image decoder, not a json field, decides what the reader will see) are recorded. The table of all samples (int64,
shape (N, 4): start, end, width, height, in shard order) goes into `imba-index-<hash>-<state>.npy`, memory-mapped
by every reader; `imba-index-<hash>.json` lists the shards in the wids shard-list shape
`{"shardlist": [{"url", "nsamples", "filesize", "mtime_ns"}, ...]}`. Both live next to the shards (or in
`index_dir`; or under ~/.cache/imba-dit/indexed when the shard folder is read-only). On the next run a shard whose
size and mtime are unchanged is not rescanned; changed shards are rescanned and a new index is written (atomically:
ranks building the same index at the same time write identical files). Reading sample i is one `pread` of its span,
parsed as a small tar (`parse_sample`). Shards must be uncompressed tar files: local ones, or s3://, gs://, http(s)://
ones (`data.remote`), which are scanned from their download into the shard cache, fingerprinted by size, ETag and
the checksum of the bytes scanned instead of mtime (every later download is checked against it), indexed in the
cache's `index/` folder, and read from the cache. When the store does not answer at start, shards whose complete
copy in the cache has the indexed checksum are read from it; only those neither cached nor reachable are skipped.

A truncated or corrupt tar keeps the samples before the damage (noted in the index as the shard's "error", counted
when a loader is built); a shard that cannot be opened at indexing time contributes no samples (and is rescanned
on the next run).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tarfile
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

import numpy as np
from PIL import Image
from tqdm.auto import tqdm

from .files import atomic_write, read_json_object, write_json
from .images import IMAGE_EXTENSIONS
from .skips import CORRUPT_TAR, UNREADABLE_SHARD, NoUsableSamples
from .remote import RemoteReadError, ShardCache, StoreUnreachable, checksum as remote_checksum, is_indexable_remote
from .tars import split_key_ext, walk_tar_buffer
from .urls import expand_urls, is_pipe

__all__ = ["INDEX_VERSION", "ShardIndex", "load_or_build_index", "parse_sample"]

log = logging.getLogger(__name__)

INDEX_VERSION = 2  # 2: image width and height per sample (aspect-ratio buckets); 1: byte spans only
INDEX_KIND = "imba-dit indexed tar shards"
REMOTE_SCANS = 8  # remote shards downloaded and scanned at once while an index is built
PROGRESS_FROM = 4  # shards to scan from which the index build shows a progress bar
_COMPRESSED_MAGIC = {b"\x1f\x8b": "gzip", b"BZh": "bzip2", b"\xfd7zXZ\x00": "xz", b"\x28\xb5\x2f\xfd": "zstd"}


# --------------------------------------------------------------------------------------------------------------
# Tar parsing
# --------------------------------------------------------------------------------------------------------------


def _member_key_ext(info: tarfile.TarInfo) -> tuple[str, str] | None:
    """(key, lower-case extension) of a sample member, or None for members a sample does not contain."""
    return split_key_ext(info.name) if info.isreg() else None


def _compression(f) -> str | None:
    head = f.read(6)
    f.seek(0)
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


def _scan_tar(path: str | int, name: str = "") -> tuple[np.ndarray, str | None]:
    """Table (n, 4) of the samples of one tar shard — byte start, byte end, image width, image height — and an
    error note if it could not be read to the end.

    The size is that of the image member the reader decodes (the first of IMAGE_EXTENSIONS the sample has);
    (0, 0) when it has none or its header cannot be read. A truncated or corrupt shard keeps the samples read
    before the damage (their spans lie inside the file). `path` may be an open file descriptor (closed here), named
    `name` in messages.
    """
    with open(path, "rb") as f:
        return _scan_file(f, name or str(path))


def _scan_file(f, path: str) -> tuple[np.ndarray, str | None]:
    compression = _compression(f)
    if compression is not None:
        raise ValueError(
            f"indexed mode needs uncompressed .tar shards, {path} is {compression}-compressed: "
            f"decompress it or use data.mode=streaming"
        )
    size = os.fstat(f.fileno()).st_size
    spans: list[list[int]] = []
    error = None
    current = None
    image_rank = len(IMAGE_EXTENSIONS)  # of the image member whose size the current sample holds
    try:
        with tarfile.open(fileobj=f, mode="r:") as tf:
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


def parse_sample(blob: bytes | bytearray | memoryview, copy: bool = True) -> dict[str, Any]:
    """{ext: data, "__key__": key} from the bytes of one sample's members (a tar fragment). The data are bytes,
    or with `copy=False` memoryviews into `blob` (valid while `blob` is not reused)."""
    sample: dict[str, Any] = {}
    for name, data in walk_tar_buffer(memoryview(blob)):
        key_ext = split_key_ext(name)
        if key_ext is None:
            continue
        key, ext = key_ext
        if sample.setdefault("__key__", key) != key:
            raise ValueError(f"span holds two keys ({sample['__key__']}, {key}): the shard changed, rebuild")
        if ext in sample:
            raise ValueError(f"duplicate member {name}")
        sample[ext] = bytes(data) if copy else data
    if "__key__" not in sample:
        raise ValueError("no sample members at the indexed offset: the shard changed, rebuild the index")
    return sample


# --------------------------------------------------------------------------------------------------------------
# The index and its cache
# --------------------------------------------------------------------------------------------------------------


def _check_indexable(urls: Sequence[str]) -> None:
    for url in urls:
        if is_pipe(str(url)):
            raise ValueError(f"indexed mode reads local files and s3://, gs://, http(s):// URLs; a pipe: command can "
                             f"only be streamed: use data.mode=streaming (got {str(url)[:120]!r})")


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def _stat(path: str, cache: ShardCache | None) -> dict[str, Any]:
    """What identifies this version of a shard: size and mtime of a local file; size and ETag of a remote one."""
    if is_indexable_remote(path):
        return cache.stat(path)
    st = os.stat(path)
    return {"filesize": st.st_size, "mtime_ns": st.st_mtime_ns}


def _unchanged(entry: dict[str, Any] | None, stat: dict[str, Any]) -> bool:
    """Whether a cached index entry was made from this version of its shard (a remote one: with its checksum)."""
    return (entry is not None and all(entry.get(k) == v for k, v in stat.items())
            and ("etag" not in stat or bool(entry.get("checksum"))))


def _stats(paths: list[str], cache: ShardCache | None) -> dict[str, dict[str, Any] | OSError | StoreUnreachable]:
    """`_stat` of every shard (remote ones asked in parallel: one request each); the error where it failed. Once
    one request found the store unreachable, the shards not asked yet are not asked (the same error)."""
    dead: list[StoreUnreachable] = []

    def one(path: str) -> dict[str, Any] | OSError | StoreUnreachable:
        if dead and is_indexable_remote(path):
            return dead[0]
        try:
            return _stat(path, cache)
        except StoreUnreachable as exn:
            dead.append(exn)
            return exn
        except OSError as exn:
            return exn

    remote = [p for p in paths if is_indexable_remote(p)]
    with ThreadPoolExecutor(16) as pool:
        found = dict(zip(remote, pool.map(one, remote)))
    return {p: found[p] if p in found else one(p) for p in paths}


def _cached_copies(paths: list[str], stats: dict[str, Any], cached: dict[str, dict],
                   cache: ShardCache | None) -> dict[str, dict[str, Any]]:
    """url -> fingerprint of the remote shards the store did not answer for whose complete copy in the cache has the
    checksum of the stored index: they are read from there (said in one line)."""
    down = [p for p in paths if isinstance(stats[p], (StoreUnreachable, RemoteReadError))]
    found = {}
    for path in down:
        entry = cached.get(path)
        if not entry or not entry.get("checksum") or entry.get("error"):
            continue
        fingerprint = {k: entry[k] for k in ("filesize", "etag", "checksum")}
        if cache.cached(path, fingerprint) and remote_checksum(cache._name(path, fingerprint), entry["checksum"]) == entry["checksum"]:
            found[path] = {k: entry[k] for k in ("filesize", "etag")}
    if down:
        log.warning("data: the store did not answer for %d of %d shards (%s); %d of them read from their complete "
                    "copies in %s, whose checksums match the index%s", len(down), len(paths), str(stats[down[0]])[:200],
                    len(found), cache.folder, "" if len(found) == len(down) else "; the others are skipped")
    return found


def _default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "imba-dit", "indexed")


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
        cache: ShardCache | None = None,
    ):
        self.shardlist = shardlist
        self.cache = cache  # where remote shards are read from (None: all shards are local files)
        self.urls = [s["url"] for s in shardlist]
        self.nsamples = [int(s["nsamples"]) for s in shardlist]
        self.starts = np.concatenate([[0], np.cumsum(self.nsamples, dtype=np.int64)])
        self.spans_path = spans_path
        self.path = path  # the JSON file, None when kept in memory only
        self.rescanned = list(rescanned)  # urls scanned when this index was loaded (empty: fully from cache)
        self._spans = spans

    def __len__(self) -> int:
        return int(self.starts[-1])

    def identity(self) -> list[list]:
        """What the index was made from, shard by shard: URL, samples, size and modification time (a local file) or
        ETag and checksum (a remote one). Another list means other samples may sit at the same index."""
        return [[s["url"], s["nsamples"], s.get("filesize"), s.get("mtime_ns")]
                + ([s["etag"], s.get("checksum", "")] if "etag" in s else []) for s in self.shardlist]

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

    def open(self, shard: int) -> int:
        """A read-only file descriptor of shard `shard`: the shard itself, or a remote shard's copy in the cache
        (downloaded first if needed; `data.remote.ShardChanged` if it is no longer the version indexed,
        `RemoteReadError` if it cannot be fetched)."""
        entry = self.shardlist[shard]
        if not is_indexable_remote(entry["url"]):
            return os.open(entry["url"], os.O_RDONLY)
        return self.cache.open(entry["url"], {k: entry[k] for k in ("filesize", "etag", "checksum")})

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        if self.spans_path is not None:
            state["_spans"] = None  # reopen the memory map in the worker
        return state


def _read_cached(json_path: str) -> tuple[dict[str, dict], str | None, np.ndarray | None]:
    """url -> shard entry (with its spans) from a cached index; ({}, None, None) if absent or unreadable."""
    meta = read_json_object(json_path)
    if meta is None:
        return {}, None, None
    try:
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
    atomic_write(os.path.join(folder, spans_name), lambda f: np.save(f, spans))
    write_json(json_path, meta)
    if old_spans and os.path.abspath(old_spans) != os.path.abspath(os.path.join(folder, spans_name)):
        try:  # open memory maps of other processes stay valid on POSIX
            os.remove(old_spans)
        except OSError:
            pass
    return json_path, os.path.join(folder, spans_name)


def load_or_build_index(
    urls: str | os.PathLike | Sequence[str | os.PathLike], index_dir: str | os.PathLike | None = None,
    cache: ShardCache | None = None,
) -> ShardIndex:
    """The index of tar shards `urls` (any spec `expand_urls` takes: local files, or s3://, gs://, http(s):// URLs
    read through `cache`, default `ShardCache()`), from its cached copy when still valid.

    The cached copy is `imba-index-<hash of the shard paths>.json` (+ `.npy` spans) in `index_dir`, else in the first
    shard's folder, falling back to ~/.cache/imba-dit/indexed when that folder is not writable (remote shards: the
    shard cache's index folder). Shards whose size or mtime (remote: size or ETag) changed are rescanned
    (`index.rescanned` lists them); a remote shard is scanned from its download into the cache. Safe to call on
    every rank at once (identical atomic writes); to scan only once, call it on rank 0 before a barrier.
    """
    _check_indexable([os.fspath(u) for u in ([urls] if isinstance(urls, (str, os.PathLike)) else urls)])
    paths = [u if is_indexable_remote(u) else os.path.abspath(u) for u in expand_urls(urls)]
    _check_indexable(paths)
    remote = any(is_indexable_remote(p) for p in paths)
    cache = cache if cache is not None or not remote else ShardCache()
    name = f"imba-index-{_digest(chr(10).join(paths))}"
    if index_dir is not None:
        folders = [os.fspath(index_dir)]
    elif is_indexable_remote(paths[0]):
        folders = [cache.index_dir]
    else:
        folders = [os.path.dirname(paths[0]), _default_cache_dir()]

    cached: dict[str, dict] = {}
    old_spans, old_map = None, None
    for folder in folders:
        cached, old_spans, old_map = _read_cached(os.path.join(folder, f"{name}.json"))
        if cached:
            break

    stats = _stats(paths, cache)
    from_cache = _cached_copies(paths, stats, cached, cache)
    # remote shards to scan: downloaded and scanned in parallel (a store serves several requests at once)
    remote_todo = [p for p in paths if is_indexable_remote(p) and isinstance(stats[p], dict)
                   and not _unchanged(cached.get(p), stats[p])]

    def scan_remote(path: str) -> tuple[np.ndarray, str | None, str] | OSError:
        try:
            fd = cache.open(path, stats[path])
            try:
                return (*_scan_tar(os.dup(fd), name=path), cache.checksum(path, stats[path], fd))
            finally:
                os.close(fd)
        except OSError as exn:
            return exn

    local_todo = [p for p in paths if not is_indexable_remote(p) and isinstance(stats[p], dict)
                  and not _unchanged(cached.get(p), stats[p])]
    # minutes for a large set or a remote one (each shard downloaded once): never silent
    bar = tqdm(total=len(remote_todo) + len(local_todo), unit=" shard", dynamic_ncols=True,
               disable=len(remote_todo) + len(local_todo) < PROGRESS_FROM,
               desc=f"indexing {len(paths)} shards" + (f", downloading {len(remote_todo)} into {cache.folder}"
                                                       if remote_todo else ""))
    with ThreadPoolExecutor(REMOTE_SCANS) as pool:
        remote_scans = {}
        for path, scanned in zip(remote_todo, pool.map(scan_remote, remote_todo)):
            remote_scans[path] = scanned
            bar.update()
    shardlist: list[dict[str, Any]] = []
    parts: list[np.ndarray] = []
    rescanned: list[str] = []
    for path in paths:
        try:
            stat = from_cache.get(path, stats[path])
            if isinstance(stat, (OSError, StoreUnreachable)):
                raise RemoteReadError(str(stat)) if isinstance(stat, StoreUnreachable) else stat
            entry = cached.get(path)
            if _unchanged(entry, stat):
                spans = np.asarray(entry["spans"])
                note = entry.get("error")
                stat = {**stat, **({"checksum": entry["checksum"]} if entry.get("checksum") else {})}
            else:
                rescanned.append(path)
                scanned = remote_scans[path] if path in remote_scans else _scan_tar(path)
                if path not in remote_scans:
                    bar.update()
                if isinstance(scanned, OSError):
                    raise scanned
                spans, note = scanned[:2]
                if len(scanned) == 3:
                    stat = {**stat, "checksum": scanned[2]}
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
    bar.close()

    dead = [s for s in stats.values() if isinstance(s, StoreUnreachable)]
    if dead and not any(s["nsamples"] for s in shardlist):
        raise dead[0]  # the store is down and nothing is in the cache: its one line, not the shard format's
    total = sum(s["nsamples"] for s in shardlist)
    unreadable = [s for s in shardlist if str(s.get("error", "")).startswith(UNREADABLE_SHARD)]
    if total == 0 and len(unreadable) == len(shardlist):  # the store's or the file system's error, not the format's
        raise NoUsableSamples(f"none of the {len(paths)} shard(s) could be read, the first {unreadable[0]['url']}: "
                              f"{' '.join(unreadable[0]['error'].split())[:300]}")
    if total == 0:
        raise ValueError(
            f"no samples found in {len(paths)} shard(s) ({paths[0]}, ...): indexed mode needs uncompressed "
            f"img2dataset-style tar files (key.jpg + key.txt)"
        )
    if not rescanned and old_spans is not None and [s["url"] for s in shardlist] == list(cached):
        json_path = os.path.join(os.path.dirname(old_spans), f"{name}.json")
        return ShardIndex(shardlist, spans_path=old_spans, spans=old_map, path=json_path, cache=cache)

    spans = np.concatenate(parts).astype(np.int64).reshape(-1, 4)
    for folder in folders:
        try:
            json_path, spans_path = _write_index(folder, name, shardlist, spans, old_spans)
        except OSError as exn:
            log.info("cannot write the shard index to %s (%s); trying the next place", folder, exn)
            continue
        log.info("indexed %d samples in %d shards (%d scanned) -> %s", total, len(paths), len(rescanned), json_path)
        return ShardIndex(shardlist, spans_path=spans_path, path=json_path, rescanned=rescanned, cache=cache)
    log.warning("could not write the shard index anywhere (%s); keeping it in memory", ", ".join(folders))
    return ShardIndex(shardlist, spans=spans, rescanned=rescanned, cache=cache)
