"""Shards on object storage (`s3://`, `gs://`, `http(s)://`) read through a local cache, so that the indexed reader
treats them as local files: the same index, order, resume, mixing and balance.

The client is fsspec (s3fs for `s3://`, gcsfs for `gs://` where it is installed, aiohttp for `http(s)://`): one
interface over every store, each backend kept by its store's community, and credentials and endpoints read from the
client's standard chain (for S3: `AWS_ACCESS_KEY_ID`/`AWS_SECRET_ACCESS_KEY`, `AWS_PROFILE`, `~/.aws/config`, an
instance role; an S3-compatible store on premises by `AWS_ENDPOINT_URL`). This module never sees a credential, so
none can reach a log, a checkpoint or config.yaml.

A shard is identified by its URL and its *fingerprint*: its size and, where the store gives one, its ETag
(`stat`). The index (`data.index`) keeps the fingerprint of every shard it scanned; a shard whose fingerprint
changed is scanned again when the index is loaded, and one that changes during a run is refused
(`ShardChanged`, counted as an unreadable shard), never read against a stale index.

`ShardCache` holds whole shards in a local folder (`data.cache_dir`) up to a size limit (`data.cache_limit`): a
shard is downloaded once, by one process of the node at a time (a file lock per shard), into a temporary name,
checked against its fingerprint, flushed and renamed, so a reader never opens a half-written shard, even after
kill -9 (a killed download's partial file is deleted by the next download). When the cached shards exceed the
limit, the least recently used ones are deleted; a reader that holds an evicted copy open closes it and fetches the
shard again (`data.indexed`), so the disk held stays within the limit and the shards being read. Give it a local
disk: the locks and the recency are those of one machine. Every request is retried with exponential backoff
(`RETRIES`); one that keeps failing raises `RemoteReadError`, which the reader counts as a skip.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import threading
import time
from typing import Any, Callable, TypeVar

from .tars import INDEXABLE_PREFIXES

__all__ = ["INDEXABLE_PREFIXES", "is_indexable_remote", "ShardChanged", "RemoteReadError", "stat", "parse_size",
           "ShardCache", "default_cache_dir", "read_json", "read_bytes", "glob", "filesystem"]

log = logging.getLogger(__name__)

RETRIES = 5  # attempts of one request before it counts as failed
BACKOFF_S = 0.2  # first wait between attempts; doubled after each
BACKOFF_MAX_S = 5.0
T = TypeVar("T")
_COUNTS = threading.Lock()  # the download counters of caches that index threads share


class RemoteReadError(OSError):
    """A request to the store that failed on every attempt."""


class ShardChanged(OSError):
    """A remote shard whose size or ETag is no longer what the index was built from."""


def is_indexable_remote(url: str) -> bool:
    """Whether `url` names a shard on a store the indexed reader reads through the cache."""
    return str(url).startswith(INDEXABLE_PREFIXES)


def default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "imba-dit", "shards")


def parse_size(text: str | int) -> int:
    """Bytes from `"20GB"`, `"500 MiB"`, `"0"` (0 = no limit) or an int."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9.]+)\s*([kmgtp]?)(i?)b?\s*", str(text).lower())
    if not match:
        raise ValueError(f"data.cache_limit: {text!r} is not a size; give e.g. 200GB, 500MiB or 0 (no limit)")
    number, prefix, binary = match.groups()
    power = "kmgtp".index(prefix) + 1 if prefix else 0
    return int(float(number) * (1024 if binary else 1000) ** power)


def filesystem(url: str):
    """(fsspec filesystem, path within it) for `url`; a one-line ImportError naming the package a scheme needs."""
    try:
        import fsspec
    except ImportError as err:  # pragma: no cover - fsspec comes with datasets/huggingface_hub
        raise ImportError("remote shards need fsspec: pip install 'imba-dit[remote]'") from err
    options = {}
    if url.startswith("s3://") and os.environ.get("AWS_ENDPOINT_URL"):  # part of the client's key: one per endpoint
        options["endpoint_url"] = os.environ["AWS_ENDPOINT_URL"]
    try:
        return fsspec.core.url_to_fs(url, **options)
    except ImportError as err:
        scheme = url.split("://")[0]
        package = {"s3": "s3fs", "gs": "gcsfs"}.get(scheme, "aiohttp")
        install = "pip install gcsfs" if package == "gcsfs" else "pip install 'imba-dit[remote]'"
        raise ImportError(f"{scheme}:// shards need the {package} package: {install}") from err


def _retried(what: str, call: Callable[[], T]) -> T:
    """`call()`, tried RETRIES times with exponential backoff; RemoteReadError naming `what` if every try fails.
    A refused permission is not retried (it will not change); a missing object is, because fsspec's HTTP client
    reports a server that does not answer as a missing file."""
    wait = BACKOFF_S
    for attempt in range(1, RETRIES + 1):
        try:
            return call()
        except (PermissionError, ShardChanged):
            raise
        except Exception as exn:  # the clients raise their own types (aiohttp, botocore) for network faults
            if attempt == RETRIES:
                raise RemoteReadError(f"{what}: {type(exn).__name__}: {str(exn)[:200]} (after {RETRIES} "
                                      f"attempts)") from exn
            log.info("%s failed (%s), attempt %d of %d; retrying in %.1f s", what, type(exn).__name__, attempt,
                     RETRIES, wait)
            time.sleep(wait)
            wait = min(wait * 2, BACKOFF_MAX_S)
    raise AssertionError("unreachable")


def glob(spec: str) -> list[str]:
    """The shards a remote glob names (`s3://bucket/shards/*.tar`), sorted, as the store lists them (an HTTP server
    lists a folder only where it serves a page of links to its files; [] otherwise)."""
    fs, path = filesystem(spec)
    scheme = spec.split("://")[0]
    found = _retried(f"list {spec}", lambda: fs.glob(path))
    return sorted(p if "://" in p else f"{scheme}://{p}" for p in found)


def _etag(info: dict[str, Any]) -> str:
    for key in ("ETag", "etag", "md5Hash", "generation", "Last-Modified"):  # s3fs, http headers, gcsfs
        if info.get(key):
            return str(info[key]).strip('"')
    return ""


def stat(url: str) -> dict[str, Any]:
    """{"filesize": bytes, "etag": str} of a remote shard, fresh from the store. An HTTP server without ETag headers
    gives its Last-Modified time instead (a shard replaced by one of the same size within the same second then goes
    unseen), one with neither "" (the size alone)."""
    fs, path = filesystem(url)

    def info() -> dict[str, Any]:
        fs.invalidate_cache(path)
        return fs.info(path)

    found = _retried(f"stat {url}", info)
    return {"filesize": int(found["size"]), "etag": _etag(found)}


def read_bytes(url: str) -> bytes:
    """The whole (small) file at `url`, a local path or a URL: a precompute manifest or null text beside shards."""
    if not is_indexable_remote(url):
        with open(url, "rb") as f:
            return f.read()
    fs, path = filesystem(url)
    return _retried(f"read {url}", lambda: fs.cat_file(path))


def read_json(url: str) -> dict | None:
    """The JSON object at `url` (e.g. a precompute manifest beside the shards), or None when it cannot be read or
    is not an object."""
    try:
        data = read_bytes(url)
    except OSError:
        return None
    try:
        found = json.loads(data)
    except ValueError:
        return None
    return found if isinstance(found, dict) else None


def _download(url: str, dest: str, expected: dict[str, Any]) -> None:
    """The shard at `url` copied into the open path `dest`, checked against `expected` (its fingerprint)."""
    fs, path = filesystem(url)
    now = stat(url)
    if now != expected:
        raise ShardChanged(f"{url} changed since it was indexed ({expected} -> {now}): restart the run to re-index it")
    fs.get_file(path, dest)
    with open(dest, "rb+") as out:
        os.fsync(out.fileno())
    if os.path.getsize(dest) != expected["filesize"]:
        raise ShardChanged(f"{url}: read {os.path.getsize(dest)} bytes, the index has {expected['filesize']}: the "
                           f"shard changed while it was read; restart the run to re-index it")


class ShardCache:
    """Whole remote shards in `folder`, at most `limit` bytes together (0: no limit); `path(url, fingerprint)` is
    the local file of that version of the shard, downloaded first if needed. Picklable (DataLoader workers share
    the folder, not the object). `downloads` and `bytes_downloaded` count what this process downloaded."""

    def __init__(self, folder: str | os.PathLike | None = None, limit: int | str = 0):
        self.folder = os.fspath(folder) if folder else default_cache_dir()
        self.limit = parse_size(limit)
        self.downloads = 0
        self.bytes_downloaded = 0

    def __repr__(self) -> str:
        return f"ShardCache({self.folder!r}, limit={self.limit})"

    @property
    def index_dir(self) -> str:
        """Where the indexes of remote shard sets are kept."""
        return os.path.join(self.folder, "index")

    def _name(self, url: str, fingerprint: dict[str, Any]) -> str:
        key = hashlib.sha256(f"{url}\n{fingerprint['filesize']}\n{fingerprint.get('etag', '')}".encode()).hexdigest()
        base = re.sub(r"[^A-Za-z0-9._-]", "_", url.rsplit("/", 1)[-1])[-60:]
        return os.path.join(self.folder, f"{key[:20]}-{base}")

    def cached(self, url: str, fingerprint: dict[str, Any]) -> bool:
        return os.path.isfile(self._name(url, fingerprint))

    def path(self, url: str, fingerprint: dict[str, Any]) -> str:
        """The local copy of `url` as of `fingerprint` ({"filesize", "etag"}), downloaded once per node."""
        final = self._name(url, fingerprint)
        if os.path.isfile(final):
            os.utime(final)  # the recency eviction goes by
            return final
        os.makedirs(self.folder, exist_ok=True)
        with open(final + ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one download per node; the others wait for it and reuse it
            try:
                if not os.path.isfile(final):
                    part = f"{final}.part-{os.getpid()}"
                    try:
                        _retried(f"download {url}", lambda: _download(url, part, fingerprint))
                        os.replace(part, final)
                    finally:
                        if os.path.exists(part):
                            os.remove(part)
                    with _COUNTS:
                        self.downloads += 1
                        self.bytes_downloaded += int(fingerprint["filesize"])
                    self.evict(keep=final)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
        return final

    def open(self, url: str, fingerprint: dict[str, Any]) -> int:
        """A read-only file descriptor of `path(url, fingerprint)`; fetched again if another process evicted it
        between its download and this open."""
        for _ in range(RETRIES):
            try:
                return os.open(self.path(url, fingerprint), os.O_RDONLY)
            except FileNotFoundError:
                continue
        raise RemoteReadError(f"{url}: evicted from {self.folder} {RETRIES} times before it could be opened: raise "
                              f"data.cache_limit")

    def evict(self, keep: str = "") -> None:
        """Delete the least recently used shards until the rest fit the limit (never `keep`). Leftover partial
        downloads of killed processes go too, limit or not."""
        shards = []
        for entry in os.scandir(self.folder):
            if not entry.is_file() or entry.name.endswith(".lock"):
                continue
            if ".part-" in entry.name:
                pid = entry.name.rsplit("-", 1)[-1]
                if pid.isdigit() and not _alive(int(pid)):
                    _remove(entry.path)
                continue
            st = entry.stat()
            shards.append((st.st_mtime, entry.path, st.st_size))
        if not self.limit:
            return
        total = sum(size for _, _, size in shards)
        for _, path, size in sorted(shards):
            if total <= self.limit:
                break
            if path != keep:
                _remove(path)
                total -= size  # or another process removed it: gone either way
        if keep and os.path.getsize(keep) > self.limit:
            log.warning("data.cache_limit=%d bytes holds less than one shard (%s, %d bytes): raise it", self.limit,
                        keep, os.path.getsize(keep))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:  # another process of the node removed it first
        pass
