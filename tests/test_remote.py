"""Shards on object storage (data/remote.py), read from real servers on 127.0.0.1 (moto's S3 server, Python's HTTP
file server): the same batches as the local shards, each shard downloaded once while it fits the cache, a bounded
cache, retried and failing requests, a shard replaced in place, a download killed half way, no credential on disk."""

import itertools
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import s3fs
import torch

from data import remote
from data.index import load_or_build_index
from data.indexed import make_indexed_loader
from data.read_spec import ReadSpec
from data.remote import ShardCache, ShardChanged, StoreBudget, parse_size
from data.skips import UNREADABLE_SHARD
from data.synthetic import write_synthetic_shards
from data.urls import expand_urls
from remote_servers import CREDENTIALS, HTTPServer, S3Server

REPO = Path(__file__).resolve().parents[1]
RES = 32
SHARDS = 4


@pytest.fixture(autouse=True)
def own_cache_home(tmp_path, monkeypatch):
    """The listings and small files kept for a store that does not answer go under the test's folder."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    folder = tmp_path_factory.mktemp("remote_local")
    return write_synthetic_shards(folder, num_samples=24, samples_per_shard=6, resolution=RES, seed=5)


@pytest.fixture
def s3(monkeypatch, tmp_path):
    server = S3Server()
    for key, value in server.env.items():
        monkeypatch.setenv(key, value)
    # botocore's and s3fs's own retries, with their own waits, kept short: ours are what these tests test
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)
    monkeypatch.setattr(remote, "BACKOFF_S", 0.001)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # where the listings of globs are kept
    yield server
    server.close()


def batches(urls, cache=None, n=8, **kw):
    loader = make_indexed_loader(urls, ReadSpec(resolution=RES, batch_size=3, seed=11, **kw), cache=cache)
    return loader, [(b["keys"], b["pixels"]) for b in itertools.islice(loader, n)]


def same(a, b):
    return [k for k, _ in a] == [k for k, _ in b] and all(torch.equal(p, q) for (_, p), (_, q) in zip(a, b))


def test_s3_shards_give_the_local_batches_and_are_downloaded_once(local, s3, tmp_path):
    urls = s3.upload("shards", "set", local)
    assert expand_urls("s3://shards/set/*.tar") == urls  # a glob is listed by the store
    with pytest.raises(FileNotFoundError, match="no shards found for 's3://shards/nothing/\\*.tar' on the store"):
        expand_urls("s3://shards/nothing/*.tar")
    cache = ShardCache(tmp_path / "cache")
    _, want = batches(local, n=12)  # 36 samples: every shard read, some twice
    loader, got = batches(urls, cache, n=12)
    assert same(got, want)
    for path in local:  # the index scan downloaded each shard; the reader used that copy
        assert s3.faults.gets(os.path.basename(path)) == 1
    index = load_or_build_index(urls, cache=cache)
    assert index.rescanned == [] and index.urls == urls
    assert {e["etag"] for e in index.shardlist} != {""}  # S3 gives ETags: the fingerprint holds them
    _, again = batches(urls, cache, n=12, num_workers=2)  # worker processes read the same cache
    assert same(again, want)
    assert sum(s3.faults.gets(os.path.basename(p)) for p in local) == SHARDS


def test_an_http_server_without_etags_is_fingerprinted_by_size_and_time(local, tmp_path):
    folder = tmp_path / "www"
    folder.mkdir()
    for path in local:
        shutil.copy(path, folder)
    server = HTTPServer(str(folder))
    try:
        urls = [f"{server.url}/{os.path.basename(p)}" for p in local]
        assert expand_urls(f"{server.url}/*.tar") == urls  # Python's server lists a folder as a page of links
        cache = ShardCache(tmp_path / "cache")
        _, got = batches(urls, cache)
        assert same(got, batches(local)[1])
        index = load_or_build_index(urls, cache=cache)
        assert all(e["etag"] for e in index.shardlist)  # Last-Modified stands in for the ETag
        assert server.faults.gets(".tar") == SHARDS
    finally:
        server.close()


def test_a_cache_smaller_than_the_set_evicts_the_least_recent_and_still_reads_the_same(local, s3, tmp_path):
    urls = s3.upload("shards", "small-cache", local)
    limit = 2 * os.path.getsize(local[0]) + 100
    cache = ShardCache(tmp_path / "cache", limit=limit)
    loader, got = batches(urls, cache, n=12)
    assert same(got, batches(local, n=12)[1])
    held = [e for e in os.scandir(cache.folder) if e.is_file() and e.name.endswith(".tar")]
    assert 1 <= len(held) <= 2 and sum(e.stat().st_size for e in held) <= limit
    # nor does the reader hold evicted copies open (their disk space would stay taken): at most the one it reads
    links = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            links.append(os.readlink(f"/proc/self/fd/{fd}"))
        except FileNotFoundError:  # the descriptor listdir itself used
            pass
    assert len([link for link in links if link.startswith(cache.folder) and link.endswith("(deleted)")]) <= 1
    assert loader.dataset._fds
    assert sum(s3.faults.gets(os.path.basename(p)) for p in local) > SHARDS  # evicted shards came back


@pytest.mark.parametrize("store", ["s3", "http"])
def test_dropped_requests_are_retried_without_changing_a_batch(local, s3, tmp_path, caplog, monkeypatch, store):
    # the first 12 requests to each shard fail: more than the clients' own retries would absorb, fewer than ours;
    # then a share of 0.3 fails. S3 answers 503 (an error answer: 40 attempts fail a read for good with odds below
    # 0.3^25), the HTTP server closes the connection unanswered (retried until the deadline)
    budget = remote.StoreBudget(timeout_s=120, attempts=40)
    caplog.set_level(logging.WARNING, logger="data.remote")
    if store == "s3":
        urls, faults, server = s3.upload("shards", "flaky", local), s3.faults, None
    else:
        server = HTTPServer(os.path.dirname(local[0]))
        urls, faults = [f"{server.url}/{os.path.basename(p)}" for p in local], server.faults
    faults.drop, faults.first = 0.3, 12
    try:
        loader, got = batches(urls, ShardCache(tmp_path / "cache", budget=budget))
    finally:
        if server is not None:
            server.close()
    assert same(got, batches(local)[1])
    assert faults.dropped > 0 and loader.stats.bad_total == 0 and loader.stats.shard_errors == 0
    retried = "(1 of 40 error answers)" if store == "s3" else "(no answer; "
    assert f"attempt 1 {retried}" in caplog.text and "retrying in" in caplog.text


def test_a_shard_the_store_never_gives_is_a_counted_skip_then_asked_again(local, s3, tmp_path, monkeypatch):
    urls = s3.upload("shards", "broken", local)
    cache = ShardCache(tmp_path / "cache", limit=1)  # nothing stays: every read asks the store
    # the index of the healthy store, read from: loaded again, a failing stat would fall back on a copy the cache
    # may or may not have evicted yet, so the set itself would depend on timing
    index = load_or_build_index(urls, cache=cache)
    s3.faults.broken = (os.path.basename(local[1]),)
    loader, got = batches(index, n=8)
    keys = [k for ks, _ in got for k in ks]
    assert len(keys) == 24 and not any(k.startswith(os.path.basename(local[1])[:-4]) for k in keys)
    assert loader.stats.shards_bad == {UNREADABLE_SHARD: 1}  # one line and a count; its samples substituted
    # the same skips in the same places on a rerun: substitution is a function of the index, not of timing
    assert [k for k, _ in batches(index, n=8)[1]] == [k for k, _ in got]
    # after the pause the shard is asked for again, and read once the store gives it
    monkeypatch.setattr("data.indexed.REMOTE_RETRY_AFTER_S", 0.0)
    s3.faults.broken = ()
    assert same(batches(urls, cache, n=8)[1], batches(local, n=8)[1])


def test_a_shard_replaced_in_place_is_refused_then_reindexed(local, s3, tmp_path):
    urls = s3.upload("shards", "replaced", local)
    cache = ShardCache(tmp_path / "cache", limit=1)
    first = load_or_build_index(urls, cache=cache)
    s3.upload("shards", "replaced", [local[2]])  # same content: same ETag, nothing to do
    assert load_or_build_index(urls, cache=cache).rescanned == []
    other = write_synthetic_shards(tmp_path / "other", num_samples=4, samples_per_shard=4, resolution=RES, seed=9)
    os.rename(other[0], tmp_path / os.path.basename(local[2]))
    s3.upload("shards", "replaced", [str(tmp_path / os.path.basename(local[2]))])
    for entry in os.scandir(cache.folder):  # a copy of the old version still in the cache would be read: it is
        if entry.is_file():                 # what the old index describes; without it the store is asked
            os.remove(entry.path)
    with pytest.raises(ShardChanged, match="changed since indexed.*restart to re-index"):
        first.open(2)  # the old index never reads the new bytes
    loader, got = batches(first, n=8)
    assert loader.stats.shards_bad == {UNREADABLE_SHARD: 1}
    again = load_or_build_index(urls, cache=cache)
    assert again.rescanned == [urls[2]] and again.nsamples[2] == 4


def test_credentials_stay_in_the_environment(local, s3, tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    urls = s3.upload("shards", "secret", local)
    s3.faults.drop = 0.2
    batches(urls, ShardCache(tmp_path / "cache"))
    secret = CREDENTIALS["AWS_SECRET_ACCESS_KEY"].encode()
    for root, _, files in os.walk(tmp_path):
        for name in files:
            assert secret not in open(os.path.join(root, name), "rb").read(), name
    assert CREDENTIALS["AWS_SECRET_ACCESS_KEY"] not in caplog.text


def test_sizes_and_missing_clients_read_in_one_line(monkeypatch):
    assert [parse_size(s) for s in ("0", "7", "3k", "20GB", "500 MiB", "1.5kb", 7)] == [
        0, 7, 3000, 20 * 10**9, 500 * 2**20, 1500, 7]
    with pytest.raises(ValueError, match="data.cache_limit: 'lots' is not a size"):
        parse_size("lots")
    with pytest.raises(ImportError, match="gs:// shards need the gcsfs package: pip install gcsfs"):
        monkeypatch.setitem(__import__("sys").modules, "gcsfs", None)
        remote.stat("gs://bucket/a.tar")


def test_the_cache_and_window_settings_are_read_and_checked_at_load(tmp_path):
    from imba.training.config import ConfigError, load_config

    cfg = load_config([f"data.cache_dir={tmp_path}", "data.cache_limit=2GiB", "data.shard_window=4",
                       "data.shards=s3://bucket/{0..3}.tar"])
    cache = cfg.data.cache()
    assert (cache.folder, cache.limit, cache.index_dir) == (str(tmp_path), 2 * 2**30, str(tmp_path / "index"))
    assert ShardCache().folder == os.path.join(os.environ["XDG_CACHE_HOME"], "imba-dit", "shards")
    with pytest.raises(ConfigError, match="data.cache_limit: 'much' is not a size"):
        load_config(["data.cache_limit=much"])
    assert load_config(["data.shard_window=2", "data.balance=temperature"]).data.shard_window == 2
    with pytest.raises(ConfigError, match="data.shard_window orders the indexed stream, plain or weighted offline: "
                                          "online balancing draws from every shard"):
        load_config(["data.shard_window=2", "data.balance=imba"])
    with pytest.raises(ConfigError, match="aspect-ratio bucketing draws"):
        load_config(["data.shard_window=2", "data.bucketing=true"])


def test_the_store_settings_reach_the_cache_every_remote_read_goes_through():
    from imba.training.config import load_config

    cfg = load_config(["data.store_timeout=7", "data.store_attempts=3", "data.max_bad_shards=0.25"])
    assert cfg.data.cache().budget == StoreBudget(timeout_s=7, attempts=3, max_bad_shards=0.25)
    assert load_config([]).data.cache().budget == StoreBudget()  # the defaults are the budget's own


def test_a_run_lists_globs_and_reads_manifests_within_its_own_store_budget(tmp_path, monkeypatch):
    # a glob's listing and a precompute manifest are read while shard specs are expanded, before any cache exists:
    # the run's data settings must be their budget too, or a dead store is waited for the default 120 s there
    from accelerate import Accelerator

    from data import remote
    from data.synthetic import write_synthetic_shards
    from imba.training.config import load_config
    from imba.training.inputs import training_sources

    monkeypatch.setattr(remote, "DEFAULT_BUDGET", remote.DEFAULT_BUDGET)  # restored after the test
    shards = write_synthetic_shards(tmp_path / "a", num_samples=4, samples_per_shard=4, resolution=32, seed=3)
    cfg = load_config([f"data.shards={shards[0]}", "data.store_timeout=7", "data.store_attempts=3",
                       f"train.output_dir={tmp_path / 'out'}"])
    training_sources(cfg, Accelerator(cpu=True), tmp_path / "out")
    assert remote.DEFAULT_BUDGET == StoreBudget(timeout_s=7, attempts=3)


def test_a_process_killed_during_a_download_leaves_nothing_a_reader_would_open(local, s3, tmp_path):
    s3.faults.trickle_s = 0.05  # 64 kB every 50 ms: the 800 kB below take 0.65 s, long enough to be killed in
    big = tmp_path / "big.tar"
    big.write_bytes(open(local[0], "rb").read() * 40)
    url = s3.upload("shards", "kill9", [str(big)])[0]
    folder = tmp_path / "cache"
    script = ("import sys; from data.remote import ShardCache, stat; "
              f"ShardCache({str(folder)!r}).path({url!r}, stat({url!r}))")
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, env=os.environ.copy())
    deadline = time.monotonic() + 30
    while not any(".part-" in name for name in (os.listdir(folder) if folder.is_dir() else [])):
        assert proc.poll() is None and time.monotonic() < deadline, "the download never started"
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    cache = ShardCache(folder)  # no limit: the partial file goes all the same
    fingerprint = remote.stat(url)
    assert not cache.cached(url, fingerprint)  # the partial file is not the shard
    s3.faults.trickle_s = 0
    assert open(cache.path(url, fingerprint), "rb").read() == big.read_bytes()
    assert not [name for name in os.listdir(folder) if ".part-" in name]  # the dead process's partial file went


def test_precomputed_features_on_the_store_read_like_the_local_ones(local, s3, tmp_path):
    from data.precompute import PrecomputeSettings, precompute_shards
    from data.precomputed import find_manifest, load_null_text, make_precomputed_loader

    out = tmp_path / "features"
    precompute_shards(local[:2], out, PrecomputeSettings(resolution=RES, max_text_tokens=24, vae="tiny"),
                      batch_size=6)
    s3.upload("features", "set", sorted(str(p) for p in out.iterdir() if p.is_file()))
    manifest = find_manifest("s3://features/set/*.tar")
    here = find_manifest(str(out))
    assert manifest["__path__"] == "s3://features/set/precompute.json"
    assert {k: v for k, v in manifest.items() if k != "__path__"} == {k: v for k, v in here.items() if k != "__path__"}
    for a, b in zip(load_null_text(manifest), load_null_text(here)):
        assert torch.equal(a, b)
    urls = expand_urls("s3://features/set/*.tar")
    remote_batches = make_precomputed_loader(urls, ReadSpec(batch_size=4), manifest=manifest,
                                             cache=ShardCache(tmp_path / "cache"))
    local_batches = make_precomputed_loader(str(out), ReadSpec(batch_size=4), manifest=here)
    for got, want in itertools.islice(zip(remote_batches, local_batches), 5):
        assert got["keys"] == want["keys"] and torch.equal(got["latent_moments"], want["latent_moments"])
    # a small file that is missing, or holds no JSON object, reads as no manifest
    s3.upload("features", "odd", [str(tmp_path / "features" / "precompute.json")])
    assert remote.read_json("s3://features/odd/missing.json") is None
    (tmp_path / "list.json").write_text("[1, 2]")
    s3.upload("features", "odd", [str(tmp_path / "list.json")])
    assert remote.read_json("s3://features/odd/list.json") is None
    assert remote.read_json("s3://features/odd/precompute.json")["__kind__"] == here["__kind__"]


class Clock:
    """time.monotonic and time.sleep of a clock that moves only when slept on, or by `call_s` per request."""

    def __init__(self, call_s: float = 0.0):
        self.now, self.waits, self.call_s = 1000.0, [], call_s

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.waits.append(round(seconds, 6))
        self.now += seconds


def failing(clock, errors, then="ok"):
    """A request that raises `errors` in turn (each after clock.call_s), then returns `then`; its calls counted."""
    calls = []

    def call():
        calls.append(1)
        clock.now += clock.call_s
        if len(calls) <= len(errors):
            raise errors[len(calls) - 1]
        return then
    return call, calls


def test_a_read_tries_error_answers_by_attempts_and_silence_until_the_deadline(monkeypatch, caplog):
    monkeypatch.setattr(remote, "_DEAD", {})
    clock = Clock()
    monkeypatch.setattr(remote.time, "monotonic", clock.monotonic)
    monkeypatch.setattr(remote.time, "sleep", clock.sleep)
    monkeypatch.setattr(remote, "BACKOFF_S", 0.2)
    monkeypatch.setattr(remote, "BACKOFF_MAX_S", 1.0)
    budget = remote.StoreBudget(timeout_s=3.0, attempts=4)
    caplog.set_level(logging.WARNING, logger="data.remote")
    # error answers (503) count against the attempts: the 4th fails the read, the shard is skipped
    call, calls = failing(clock, [OSError("503 SlowDown")] * 9)
    with pytest.raises(remote.RemoteReadError) as failed:
        remote._retried("download s3://b/x.tar", call, budget, "s3://b/x.tar")
    assert len(calls) == 4 and clock.waits == [0.2, 0.4, 0.8]
    assert str(failed.value) == "download s3://b/x.tar: OSError: 503 SlowDown (after 4 attempts)"
    assert "download s3://b/x.tar failed (OSError: 503 SlowDown), attempt 3 (3 of 4 error answers); retrying in " \
           "0.8 s" in caplog.text and all(r.levelno == logging.WARNING for r in caplog.records)
    # no answer (refused): tried past the attempts until the deadline, waits doubled up to BACKOFF_MAX_S and cut
    # to the deadline, then one line naming the store
    clock.waits.clear()
    start = clock.now
    call, calls = failing(clock, [ConnectionRefusedError("refused")] * 99)
    with pytest.raises(remote.StoreUnreachable) as dead:
        remote._retried("stat s3://b/x.tar", call, budget, "s3://b/x.tar")
    assert clock.waits == [0.2, 0.4, 0.8, 1.0, 0.6] and clock.now - start == pytest.approx(3.0) and len(calls) == 6
    assert str(dead.value) == ("s3://b/x.tar: store unreachable for 3 s (stat s3://b/x.tar: ConnectionRefusedError: "
                               "refused; 6 attempts)")
    assert "(no answer; 1 s left of data.store_timeout=3); retrying in 0.6 s" in caplog.text
    # found dead: for the next timeout_s the store is asked once per read, then once waited for again
    call, calls = failing(clock, [ConnectionRefusedError("refused")] * 99)
    with pytest.raises(remote.StoreUnreachable, match="1 attempts; found dead before"):
        remote._retried("read s3://b/y.tar", call, budget, "s3://b/y.tar")
    clock.now += 3.0
    with pytest.raises(remote.StoreUnreachable, match=r"\(read s3://b/y.tar: ConnectionRefusedError: refused; 6 "
                                                      r"attempts\)$"):
        remote._retried("read s3://b/y.tar", call, budget, "s3://b/y.tar")
    monkeypatch.setattr(remote, "_DEAD", {})
    # a hung connection: each try lasts the client's read timeout; the read ends within the deadline plus one
    hang = Clock(call_s=budget.request_timeout_s)
    monkeypatch.setattr(remote.time, "monotonic", hang.monotonic)
    monkeypatch.setattr(remote.time, "sleep", hang.sleep)
    call, calls = failing(hang, [TimeoutError()] * 99)
    with pytest.raises(remote.StoreUnreachable, match=r"^s3://b/x.tar: store unreachable for 3 s \(read"):
        remote._retried("read s3://b/x.tar", call, budget, "s3://b/x.tar")
    assert 3.0 <= hang.now - 1000.0 <= budget.timeout_s + budget.request_timeout_s and budget.request_timeout_s == 1
    # the clients' own types, as fsspec's HTTP client wraps them (a FileNotFoundError from a dropped connection)
    import aiohttp
    from botocore.exceptions import EndpointConnectionError

    wrapped = FileNotFoundError("http://h/a.tar")
    wrapped.__cause__ = aiohttp.ServerDisconnectedError()
    assert remote._no_answer(wrapped) and remote._no_answer(EndpointConnectionError(endpoint_url="http://h"))
    assert not remote._no_answer(FileNotFoundError("404")) and not remote._no_answer(PermissionError("403"))
    # a read that recovers returns; a refusal, a changed shard, a missing client are asked once
    call, calls = failing(hang, [ConnectionResetError("reset"), OSError("500")])
    assert remote._retried("stat", call, budget) == "ok" and len(calls) == 3
    for error in (PermissionError("denied"), remote.ShardChanged("changed"), ImportError("no s3fs")):
        call, calls = failing(hang, [error])
        with pytest.raises(type(error)):
            remote._retried("stat", call, budget)
        assert len(calls) == 1
    with pytest.raises(ValueError, match="need data.store_timeout > 0"):
        remote.StoreBudget(timeout_s=0)


def test_a_dead_store_raised_in_a_loader_worker_reads_as_its_one_line_in_the_main_process():
    from torch._utils import ExceptionWrapper

    from data.indexed import TooManyBadShards

    for kind, line in ((remote.StoreUnreachable, "s3://b/x.tar: store unreachable for 3 s (stat: refused; 6 "
                                                 "attempts)"),
                       (TooManyBadShards, "3 of the 4 shards of 4 shards could not be read")):
        try:
            raise kind(line)
        except kind:
            wrapper = ExceptionWrapper(where="in DataLoader worker process 0")
        with pytest.raises(kind) as raised:
            wrapper.reraise()  # what the DataLoader's main process does with a worker's exception
        assert str(raised.value) == line


def test_fingerprints_cache_places_and_client_errors_say_what_they_are(monkeypatch, tmp_path):
    assert remote._etag({"ETag": '"abc"', "size": 3}) == "abc"
    assert [remote._etag({key: value}) for key, value in (("etag", '"e"'), ("md5Hash", "m=="), ("generation", 17),
                                                          ("Last-Modified", "Sun, 06 Dec 2026"))] == [
        "e", "m==", "17", "Sun, 06 Dec 2026"]
    assert remote._etag({"size": 3}) == ""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert remote.default_cache_dir() == str(tmp_path / "xdg" / "imba-dit" / "shards")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert remote.default_cache_dir() == str(tmp_path / "home" / ".cache" / "imba-dit" / "shards")
    for module, scheme, message in (("s3fs", "s3", "s3:// shards need the s3fs package: pip install "
                                                   "'imba-dit[remote]'"),
                                    ("fsspec.implementations.http", "https", "https:// shards need the aiohttp "
                                                                             "package: pip install 'imba-dit[remote]'")):
        monkeypatch.setitem(sys.modules, module, None)  # as if not installed: fsspec imports it anew
        monkeypatch.delitem(sys.modules["fsspec.registry"]._registry, scheme, raising=False)
        with pytest.raises(ImportError) as missing:
            remote.filesystem(f"{scheme}://host-{module}/a.tar")
        assert str(missing.value) == message
    monkeypatch.setitem(sys.modules, "fsspec", None)
    with pytest.raises(ImportError, match=r"^remote shards need fsspec: pip install 'imba-dit\[remote\]'$"):
        remote.filesystem("s3://bucket/a.tar")


def test_the_cache_evicts_the_least_recently_used_counts_its_downloads_and_keeps_live_partial_files(
        local, s3, tmp_path, caplog):
    urls = s3.upload("shards", "lru", local[:3])
    size = os.path.getsize(local[0])
    cache = ShardCache(tmp_path / "cache", limit=2 * size + 10)
    prints = [remote.stat(u) for u in urls]
    live = os.path.join(cache.folder, f"x.part-{os.getpid()}")  # a download in progress in a live process
    a = cache.path(urls[0], prints[0])
    open(live, "wb").close()
    b = cache.path(urls[1], prints[1])
    os.utime(a, (1, 1))  # a is older than b ...
    os.utime(b, (2, 2))
    assert cache.path(urls[0], prints[0]) == a  # ... until it is read again: then b is the least recent
    c = cache.path(urls[2], prints[2])
    assert sorted(os.listdir(cache.folder)) == sorted(
        [os.path.basename(p) for p in (a, c, live)] + [os.path.basename(p) + ".lock" for p in (a, b, c)]
        + [".cache.lock"])  # the node's lock around reservations and evictions
    assert (cache.downloads, cache.bytes_downloaded) == (3, sum(p["filesize"] for p in prints))
    assert cache.cached(urls[0], prints[0]) and not cache.cached(urls[1], prints[1])
    ShardCache(cache.folder).evict()  # no limit: nothing goes
    assert cache.cached(urls[0], prints[0]) and cache.cached(urls[2], prints[2])
    caplog.set_level(logging.WARNING, logger="data.remote")
    tiny = ShardCache(tmp_path / "tiny", limit=size // 2)
    tiny.path(urls[0], prints[0])
    assert f"data.cache_limit={size // 2} bytes holds less than one shard" in caplog.text


def test_a_cached_copy_is_named_by_its_url_and_version(tmp_path):
    cache = ShardCache(tmp_path)
    one = cache._name("s3://b/set/shard-000001.tar", {"filesize": 10, "etag": "aa"})
    assert os.path.dirname(one) == str(tmp_path) and one.endswith("-shard-000001.tar")  # readable in a listing
    assert one != cache._name("s3://b/set/shard-000001.tar", {"filesize": 10, "etag": "bb"})  # another version
    assert one != cache._name("s3://b/set/shard-000001.tar", {"filesize": 11, "etag": "aa"})
    assert one != cache._name("s3://b/other/shard-000001.tar", {"filesize": 10, "etag": "aa"})
    assert cache._name("http://h/a b?.tar", {"filesize": 1, "etag": ""}).endswith("-a_b_.tar")


def test_a_copy_evicted_between_its_download_and_its_open_is_fetched_again(local, s3, tmp_path, monkeypatch):
    url = s3.upload("shards", "race", local[:1])[0]
    cache = ShardCache(tmp_path / "cache")
    fingerprint = remote.stat(url)
    real_open, opened = os.open, []

    def evicted_once(path, flags, *args):
        if path.startswith(cache.folder) and ".part-" not in path and not opened:  # another process evicts it
            # right after the download
            opened.append(path)
            os.remove(path)
        return real_open(path, flags, *args)

    monkeypatch.setattr(remote.os, "open", evicted_once)
    fd = cache.open(url, fingerprint)
    monkeypatch.undo()
    assert os.read(fd, 10) == open(local[0], "rb").read(10) and cache.downloads == 2
    os.close(fd)
