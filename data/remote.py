"""Shards on object storage (`s3://`, `gs://`, `http(s)://`) read through a local cache, so that the indexed reader
treats them as local files: the same index, order, resume, mixing and balance.

The client is fsspec (s3fs for `s3://`, gcsfs for `gs://` where it is installed, aiohttp for `http(s)://`): one
interface over every store, each backend kept by its store's community, and credentials and endpoints read from the
client's standard chain (for S3: `AWS_ACCESS_KEY_ID`/`AWS_SECRET_ACCESS_KEY`, `AWS_PROFILE`, `~/.aws/config`, an
instance role; an S3-compatible store on premises by `AWS_ENDPOINT_URL`). This module never sees a credential, so
none can reach a log, a checkpoint or config.yaml.

A shard is identified by its URL and its *fingerprint*: its size and, where the store gives one, its ETag
(`stat`), and, once indexed, the checksum of its bytes (`checksum`: xxh3-128 of the whole file). The index
(`data.index`) keeps the fingerprint of every shard it scanned; a shard whose size or ETag changed is scanned again
when the index is loaded, and one that changes during a run is refused (`ShardChanged`, counted as an unreadable
shard), never read against a stale index.

`ShardCache` holds whole shards in a local folder (`data.cache_dir`) up to a size limit (`data.cache_limit`): a
shard is downloaded once, by one process of the node at a time (a file lock per shard), into a temporary name that
reserves its size first (the cache's bound counts downloads in flight, so parallel downloads never overrun it),
checked against its size, ETag and checksum, flushed and renamed, so a reader never opens a half-written or changed
shard, even after kill -9 (a killed download's partial file is deleted by the next download). A checksum that does
not match is downloaded once more, then refused. When the cached shards exceed the limit, the least recently used
ones are deleted; a reader that holds an evicted copy open closes it and fetches the shard again (`data.indexed`),
so the disk held stays within the limit and the shards being read. Give it a local disk: the locks and the recency
are those of one machine.

Every read has one retry budget (`StoreBudget`: `data.store_attempts`, `data.store_timeout`), with the client's own
retries switched off and its connect and read timeouts set below the deadline, so no retries stack inside ours.
A request the store answers with an error is tried `attempts` times (`RemoteReadError` after that: the reader skips
the shard); one the store does not answer at all (refused, reset, timed out) is retried until `timeout_s` has
passed, then `StoreUnreachable` ends the run with one line. Every retry is a WARNING.
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
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from .tars import INDEXABLE_PREFIXES

__all__ = ["INDEXABLE_PREFIXES", "is_indexable_remote", "ShardChanged", "RemoteReadError", "StoreUnreachable",
           "StoreBudget", "set_default_budget", "raised_line", "stat", "parse_size", "checksum", "ShardCache", "default_cache_dir", "read_json",
           "read_bytes", "glob", "filesystem"]

log = logging.getLogger(__name__)

BACKOFF_S = 0.2  # first wait between attempts; doubled after each
BACKOFF_MAX_S = 5.0
CHUNK = 1 << 20  # bytes hashed at a time
try:  # the shards' checksum: xxh3 hashes at memory speed (bench/remote_faults.md); BLAKE2b where xxhash is missing
    import xxhash  # noqa: F401

    CHECKSUM = "xxh3_128"
except ImportError:  # pragma: no cover - xxhash comes with imba-dit[remote]
    CHECKSUM = "blake2b"
RESERVATION_POLL_S = 0.05  # how often a download waits for others in flight to make room in a full cache
T = TypeVar("T")
_COUNTS = threading.Lock()  # the download counters of caches that index threads share
_DEAD: dict[str, float] = {}  # stores found unreachable in this process: until when they are asked only once
# client errors that mean no answer came (refused, reset, timed out), by class name: the clients' own types
# (botocore, aiohttp) are not imported here, and fsspec's HTTP client wraps them in a FileNotFoundError
_NO_ANSWER = {"EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError", "ConnectionClosedError",
              "HTTPClientError", "ClientConnectionError", "ClientConnectorError", "ServerDisconnectedError",
              "ServerTimeoutError", "ClientOSError", "TimeoutError", "ConnectionError"}


@dataclass(frozen=True)
class StoreBudget:
    """One read's retry budget: a request the store answers with an error is tried `attempts` times; a store that
    answers nothing for `timeout_s` seconds is dead. `request_timeout_s`, the clients' connect and read timeout
    (between two bytes, not a whole download), is a quarter of the deadline (1 to 30 s), so a hung connection is
    tried again within it."""

    timeout_s: float = 120.0
    attempts: int = 5
    max_bad_shards: float = 0.5  # the readers stop (one line) when more than this share of the shards failed

    def __post_init__(self):
        if self.timeout_s <= 0 or self.attempts < 1 or not 0 <= self.max_bad_shards <= 1:
            raise ValueError(f"need data.store_timeout > 0, data.store_attempts >= 1, data.max_bad_shards in [0, 1] "
                             f"(got {self.timeout_s}, {self.attempts}, {self.max_bad_shards})")

    @property
    def request_timeout_s(self) -> float:
        return max(1.0, min(30.0, self.timeout_s / 4))


DEFAULT_BUDGET = StoreBudget()


def set_default_budget(budget: StoreBudget) -> None:
    """The budget of the reads made before a run's cache exists (a glob's listing, the precompute manifest and null
    text, read while shard specs are expanded): a run sets its data settings' budget here once, at start, so a dead
    store ends those reads within data.store_timeout too."""
    global DEFAULT_BUDGET
    DEFAULT_BUDGET = budget


class RemoteReadError(OSError):
    """A request the store failed on every attempt of its budget: the shard is skipped."""


class ShardChanged(OSError):
    """A remote shard whose size, ETag or checksum is no longer what the index was built from."""


class ChecksumMismatch(ShardChanged):
    """A download whose bytes are not those indexed (downloaded once more before `ShardChanged`)."""


class ShortBody(OSError):
    """A download that ended before the size the store announced (a reset or a truncating network): retried."""


class StoreUnreachable(Exception):
    """A store that answered nothing for the budget's deadline. `str()` is one line, `<url>: store unreachable for
    N s (...)`, also after a DataLoader worker re-raised it in the main process with its traceback around it."""

    def __init__(self, message: str = ""):
        super().__init__(raised_line(str(message), type(self)))


def raised_line(message: str, kind: type) -> str:
    """The one line of an exception of `kind` that a DataLoader worker raised, out of the message the main process
    re-raises it with (the worker's traceback, ending in `module.Kind: line`); `message` itself otherwise."""
    prefix = f"{kind.__module__}.{kind.__qualname__}: "
    found = [line[len(prefix):] for line in message.splitlines() if line.startswith(prefix)]
    return found[-1] if found else message


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


def filesystem(url: str, budget: StoreBudget = DEFAULT_BUDGET):
    """(fsspec filesystem, path within it) for `url`, its client's own retries off and its timeouts those of
    `budget`; a one-line ImportError naming the package a scheme needs."""
    try:
        import fsspec
    except ImportError as err:  # pragma: no cover - fsspec comes with datasets/huggingface_hub
        raise ImportError("remote shards need fsspec: pip install 'imba-dit[remote]'") from err
    options: dict[str, Any] = {}
    scheme = url.split("://")[0]
    wait = budget.request_timeout_s
    if scheme == "s3":
        if os.environ.get("AWS_ENDPOINT_URL"):  # part of the client's key: one per endpoint
            options["endpoint_url"] = os.environ["AWS_ENDPOINT_URL"]
        options["config_kwargs"] = {"connect_timeout": wait, "read_timeout": wait,
                                    "retries": {"total_max_attempts": 1}}
    elif scheme in ("http", "https"):
        try:
            import aiohttp
        except ImportError as err:
            raise ImportError(f"{scheme}:// shards need the aiohttp package: pip install 'imba-dit[remote]'") from err
        options["client_kwargs"] = {"timeout": aiohttp.ClientTimeout(total=None, sock_connect=wait, sock_read=wait)}
    try:
        fs, path = fsspec.core.url_to_fs(url, **options)
    except ImportError as err:
        package = {"s3": "s3fs", "gs": "gcsfs"}.get(scheme, "aiohttp")
        install = "pip install gcsfs" if package == "gcsfs" else "pip install 'imba-dit[remote]'"
        raise ImportError(f"{scheme}:// shards need the {package} package: {install}") from err
    if scheme == "s3":
        fs.retries = 1  # s3fs's own retry loop around botocore's: ours is the only one
    return fs, path


def _no_answer(exn: BaseException) -> bool:
    """Whether `exn` (or what it wraps) says the store gave no answer at all, rather than an error answer."""
    seen = 0
    while exn is not None and seen < 8:
        if isinstance(exn, (ConnectionError, TimeoutError)) or any(
                c.__name__ in _NO_ANSWER for c in type(exn).__mro__):
            return True
        exn, seen = exn.__cause__ or exn.__context__, seen + 1
    return False


def _store(url: str) -> str:
    """What a store is known by for `_DEAD`: the endpoint and bucket, or the host."""
    scheme, _, rest = url.partition("://")
    endpoint = os.environ.get("AWS_ENDPOINT_URL", "") if scheme == "s3" else ""
    return f"{endpoint}|{scheme}://{rest.split('/', 1)[0]}"


def _retried(what: str, call: Callable[[], T], budget: StoreBudget = DEFAULT_BUDGET, url: str = "") -> T:
    """`call()` within `budget`, waits doubling from BACKOFF_S to BACKOFF_MAX_S, each retry a WARNING. An error
    answer counts against `budget.attempts` (RemoteReadError naming `what` when they are spent); no answer at all is
    retried until `budget.timeout_s` has passed since the first try (StoreUnreachable naming `url`), and for the next
    `timeout_s` that store is asked once per read, not waited for again (a start-up with the store down reaches
    the cached copies after one deadline, not one per file). A refused
    permission, a changed shard and a missing client are not retried (they will not change)."""
    store = _store(url)
    dead = _DEAD.get(store, 0.0) > time.monotonic()  # found dead lately: asked once, not waited for again
    deadline = time.monotonic() + (0.0 if dead else budget.timeout_s)
    wait, errors, attempt = BACKOFF_S, 0, 0
    while True:
        attempt += 1
        try:
            found = call()
            _DEAD.pop(store, None)
            return found
        except (PermissionError, ShardChanged, ImportError):
            raise
        except Exception as exn:  # the clients raise their own types (aiohttp, botocore) for network faults
            silent = _no_answer(exn)
            errors += not silent
            left = deadline - time.monotonic()
            cause = f"{type(exn).__name__}: {str(exn).splitlines()[0][:200] if str(exn) else ''}"
            if not silent and errors >= budget.attempts or left <= 0 and not silent:
                raise RemoteReadError(f"{what}: {cause} (after {attempt} attempts)") from exn
            if left <= 0:
                _DEAD[store] = time.monotonic() + budget.timeout_s
                raise StoreUnreachable(f"{url or what}: store unreachable for {budget.timeout_s:g} s ({what}: "
                                       f"{cause}; {attempt} attempts{'; found dead before' if dead else ''})"
                                       ) from exn
            log.warning("%s failed (%s), attempt %d (%s); retrying in %.1f s", what, cause[:120], attempt,
                        f"{errors} of {budget.attempts} error answers" if not silent else
                        f"no answer; {left:.0f} s left of data.store_timeout={budget.timeout_s:g}", min(wait, left))
            time.sleep(min(wait, left))
            wait = min(wait * 2, BACKOFF_MAX_S)


def glob(spec: str, budget: StoreBudget | None = None) -> list[str]:
    """The shards a remote glob names (`s3://bucket/shards/*.tar`), sorted, as the store lists them (an HTTP server
    lists a folder only where it serves a page of links to its files; [] otherwise). Each listing is kept
    in `<default_cache_dir()>/listings`: when the store does not answer, the last one is used, said in one line, so
    that a restart with the store down can read the cached shards. `budget`: default `DEFAULT_BUDGET`."""
    budget = budget or DEFAULT_BUDGET  # looked up when called: `set_default_budget` may have changed it
    fs, path = filesystem(spec, budget)
    scheme = spec.split("://")[0]
    kept = _kept("listings", spec)
    try:
        found = _retried(f"list {spec}", lambda: fs.glob(path), budget, spec)
    except (RemoteReadError, StoreUnreachable) as exn:
        last = read_json(kept)
        if not last or last.get("spec") != spec:
            raise
        log.warning("data: the store did not answer the listing of %s (%s); using its last listing (%d shards, %s)",
                    spec, str(exn)[:200], len(last["urls"]), kept)
        return list(last["urls"])
    urls = sorted(p if "://" in p else f"{scheme}://{p}" for p in found)
    if urls:
        _keep(kept, json.dumps({"spec": spec, "urls": urls}).encode())
    return urls


def _etag(info: dict[str, Any]) -> str:
    for key in ("ETag", "etag", "md5Hash", "generation", "Last-Modified"):  # s3fs, http headers, gcsfs
        if info.get(key):
            return str(info[key]).strip('"')
    return ""


def _info(url: str, budget: StoreBudget) -> dict[str, Any]:
    """One request for the size and ETag of `url`, fresh from the store (not retried: a caller's budget does)."""
    fs, path = filesystem(url, budget)
    fs.invalidate_cache(path)
    found = fs.info(path)
    return {"filesize": int(found["size"]), "etag": _etag(found)}


def stat(url: str, budget: StoreBudget = DEFAULT_BUDGET) -> dict[str, Any]:
    """{"filesize": bytes, "etag": str} of a remote shard, fresh from the store. An HTTP server without ETag headers
    gives its Last-Modified time instead (a shard replaced by one of the same size within the same second then goes
    unseen), one with neither "" (the size alone)."""
    return _retried(f"stat {url}", lambda: _info(url, budget), budget, url)


def _kept(kind: str, key: str) -> str:
    """Where the last answer of the store for `key` (a listing, a small file) is kept, for when it does not answer."""
    name = re.sub(r"[^A-Za-z0-9._-]", "_", key.rsplit("/", 1)[-1])[-40:]
    return os.path.join(default_cache_dir(), kind, f"{hashlib.sha256(key.encode()).hexdigest()[:20]}-{name}")


def _keep(path: str, data: bytes) -> None:
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        part = f"{path}.part-{os.getpid()}-{threading.get_ident()}"
        with open(part, "wb") as f:
            f.write(data)
        os.replace(part, path)
    except OSError as exn:  # a read-only home: no fallback copy, the run goes on
        log.info("cannot keep a copy in %s (%s)", path, exn)


def read_bytes(url: str, budget: StoreBudget | None = None) -> bytes:
    """The whole (small) file at `url`, a local path or a URL: a precompute manifest or null text beside shards. Its
    last copy is kept (`<default_cache_dir()>/files`) and read, said in one line, when the store does not answer."""
    if not is_indexable_remote(url):
        with open(url, "rb") as f:
            return f.read()
    budget = budget or DEFAULT_BUDGET
    fs, path = filesystem(url, budget)
    kept = _kept("files", url)
    try:
        fs.invalidate_cache(path)  # a listing cached by a glob would hide a file written since
        data = _retried(f"read {url}", lambda: fs.cat_file(path), budget, url)
    except (RemoteReadError, StoreUnreachable) as exn:
        if not os.path.isfile(kept) or not isinstance(exn, StoreUnreachable):  # not a missing file's error answer
            raise
        log.warning("data: the store did not answer for %s (%s); using its last copy, %s", url, str(exn)[:200], kept)
        with open(kept, "rb") as f:
            return f.read()
    _keep(kept, data)
    return data



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


def _hasher(algorithm: str):
    if algorithm == "xxh3_128":
        try:
            import xxhash
        except ImportError as err:
            raise ImportError("the shard index was made with xxh3_128 checksums: pip install xxhash (or delete the "
                              "index to re-index)") from err
        return xxhash.xxh3_128()
    if algorithm == "blake2b":
        return hashlib.blake2b(digest_size=16)
    raise ValueError(f"unknown shard checksum {algorithm!r}: delete the index to re-index")


def checksum(source: str | int, like: str | None = None) -> str:
    """"<algorithm>:<hex>" of the whole file `source` (a path, or an open descriptor read with pread: its offset
    stays), with the algorithm of the checksum `like` (to compare with it), else `CHECKSUM`."""
    algorithm = like.split(":", 1)[0] if like else CHECKSUM
    digest = _hasher(algorithm)
    fd = os.open(source, os.O_RDONLY) if isinstance(source, str) else source
    try:
        offset = 0
        while chunk := os.pread(fd, CHUNK, offset):
            digest.update(chunk)
            offset += len(chunk)
    finally:
        if isinstance(source, str):
            os.close(fd)
    return f"{algorithm}:{digest.hexdigest()}"


def _download(url: str, dest: str, expected: dict[str, Any], budget: StoreBudget) -> str:
    """One try at copying the shard at `url` into `dest`, checked against `expected` (its fingerprint: size, ETag
    and, once indexed, checksum) before and after; its checksum. The HEAD before the GET is part of this try, not
    retried on its own."""
    now = _info(url, budget)
    if any(now[k] != expected[k] for k in ("filesize", "etag")):
        raise ShardChanged(f"{url}: changed since indexed (size, ETag {expected['filesize']}, "
                           f"{expected['etag']!r} -> {now['filesize']}, {now['etag']!r}): restart to re-index")
    fs, path = filesystem(url, budget)
    fs.get_file(path, dest)
    with open(dest, "rb+") as out:
        os.fsync(out.fileno())
    if os.path.getsize(dest) != expected["filesize"]:
        # a short body is a fault of the transfer (retried); one of another size is another object: refused
        raise (ShortBody if os.path.getsize(dest) < expected["filesize"] else ShardChanged)(
            f"{url}: read {os.path.getsize(dest)} bytes, the index has {expected['filesize']}")
    found = checksum(dest, expected.get("checksum"))
    if expected.get("checksum") and found != expected["checksum"]:
        raise ChecksumMismatch(f"{url}: downloaded bytes with checksum {found}, the index has {expected['checksum']}")
    return found


class ShardCache:
    """Whole remote shards in `folder`, at most `limit` bytes together (0: no limit); `path(url, fingerprint)` is
    the local file of that version of the shard, downloaded first if needed, within `budget`. Picklable
    (DataLoader workers share the folder, not the object). `downloads` and `bytes_downloaded` count what this
    process downloaded."""

    def __init__(self, folder: str | os.PathLike | None = None, limit: int | str = 0,
                 budget: StoreBudget = DEFAULT_BUDGET):
        self.folder = os.fspath(folder) if folder else default_cache_dir()
        self.limit = parse_size(limit)
        self.budget = budget
        self.downloads = 0
        self.bytes_downloaded = 0
        self._checksums: dict[str, str] = {}  # copies this process downloaded: their checksum, computed on the way

    def __repr__(self) -> str:
        return f"ShardCache({self.folder!r}, limit={self.limit})"

    @property
    def index_dir(self) -> str:
        """Where the indexes of remote shard sets are kept."""
        return os.path.join(self.folder, "index")

    def stat(self, url: str) -> dict[str, Any]:
        """`stat(url)` within this cache's budget."""
        return stat(url, self.budget)

    def _name(self, url: str, fingerprint: dict[str, Any]) -> str:
        key = hashlib.sha256(f"{url}\n{fingerprint['filesize']}\n{fingerprint.get('etag', '')}".encode()).hexdigest()
        base = re.sub(r"[^A-Za-z0-9._-]", "_", url.rsplit("/", 1)[-1])[-60:]
        return os.path.join(self.folder, f"{key[:20]}-{base}")

    def cached(self, url: str, fingerprint: dict[str, Any]) -> bool:
        return os.path.isfile(self._name(url, fingerprint))

    def checksum(self, url: str, fingerprint: dict[str, Any], fd: int) -> str:
        """The checksum of the cached copy of `url` open as `fd`: remembered from its download in this process, else
        read from the copy."""
        return self._checksums.get(self._name(url, fingerprint)) or checksum(fd, fingerprint.get("checksum"))

    def path(self, url: str, fingerprint: dict[str, Any]) -> str:
        """The local copy of `url` as of `fingerprint` ({"filesize", "etag"} and, once indexed, "checksum"),
        downloaded once per node. A download whose checksum is not the index's is done once more, then refused
        (`ShardChanged`): the bytes read are the bytes indexed."""
        final = self._name(url, fingerprint)
        if os.path.isfile(final):
            os.utime(final)  # the recency eviction goes by
            return final
        os.makedirs(self.folder, exist_ok=True)
        with open(final + ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one download per node; the others wait for it and reuse it
            try:
                if not os.path.isfile(final):
                    self._fetch(url, fingerprint, final)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
        return final

    def _fetch(self, url: str, fingerprint: dict[str, Any], final: str) -> None:
        size = int(fingerprint["filesize"])
        part = self._reserve(final, size)
        try:
            for attempt in (1, 2):
                try:
                    found = _retried(f"download {url}", lambda: _download(url, part, fingerprint, self.budget),
                                     self.budget, url)
                    break
                except ChecksumMismatch as exn:
                    if attempt == 2:
                        raise ShardChanged(f"{url}: changed since indexed (its bytes are not the ones indexed, "
                                           f"twice): restart to re-index") from exn
                    log.warning("%s; downloading it again", exn)
            os.replace(part, final)
        finally:
            if os.path.exists(part):
                os.remove(part)
        self._checksums[final] = found
        with _COUNTS:
            self.downloads += 1
            self.bytes_downloaded += size
        if self.limit and size > self.limit:
            log.warning("data.cache_limit=%d bytes holds less than one shard (%s, %d bytes): raise it", self.limit,
                        final, size)

    def open(self, url: str, fingerprint: dict[str, Any]) -> int:
        """A read-only file descriptor of `path(url, fingerprint)`; fetched again if another process evicted it
        between its download and this open."""
        tries = 5
        for _ in range(tries):
            try:
                return os.open(self.path(url, fingerprint), os.O_RDONLY)
            except FileNotFoundError:
                continue
        raise RemoteReadError(f"{url}: evicted from {self.folder} {tries} times before it could be opened: raise "
                              f"data.cache_limit")

    def _reserve(self, final: str, size: int) -> str:
        """A new partial file for `final` that reserves `size` bytes of the limit (its name holds the size, so every
        process of the node counts it): made once the cached shards and the other reservations leave room for it,
        the least recently used shards deleted to make it, waiting for downloads in flight where they fill it."""
        part = f"{final}.part-{size}-{os.getpid()}"
        with open(os.path.join(self.folder, ".cache.lock"), "a") as lock:
            while True:
                fcntl.flock(lock, fcntl.LOCK_EX)  # evictions and reservations of the node, one at a time
                try:
                    if self._make_room(size) or not self.held()[1]:
                        open(part, "wb").close()
                        return part
                finally:
                    fcntl.flock(lock, fcntl.LOCK_UN)
                time.sleep(RESERVATION_POLL_S)

    def held(self) -> tuple[list[tuple[float, str, int]], int]:
        """([(mtime, path, size)] of the complete shards, bytes reserved by downloads in flight); leftover partial
        downloads of dead processes are deleted."""
        shards, reserved = [], 0
        for entry in os.scandir(self.folder):
            if not entry.is_file() or entry.name.endswith(".lock"):
                continue
            if ".part-" in entry.name:
                fields = entry.name.rsplit(".part-", 1)[1].split("-")
                if not fields[-1].isdigit():
                    continue
                if not _alive(int(fields[-1])):
                    _remove(entry.path)
                    continue
                try:
                    size = entry.stat().st_size
                except FileNotFoundError:  # renamed into place or removed meanwhile
                    continue
                reserved += max(size, int(fields[0]) if len(fields) == 2 and fields[0].isdigit() else 0)
                continue
            try:
                st = entry.stat()
            except FileNotFoundError:
                continue
            shards.append((st.st_mtime, entry.path, st.st_size))
        return shards, reserved

    def _make_room(self, size: int) -> bool:
        """Delete the least recently used shards until `size` more bytes fit the limit; whether they do."""
        shards, reserved = self.held()
        if not self.limit:
            return True
        total = sum(s for _, _, s in shards) + reserved
        for _, path, held in sorted(shards):
            if total + size <= self.limit:
                break
            _remove(path)
            total -= held  # or another process removed it: gone either way
        return total + size <= self.limit

    def evict(self) -> None:
        """Delete the least recently used shards until the rest fit the limit. Leftover partial downloads of killed
        processes go too, limit or not."""
        if not os.path.isdir(self.folder):
            return
        with open(os.path.join(self.folder, ".cache.lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                self._make_room(0)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)


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
