"""Object storage as it fails in the field, through the fault proxy (tests/fault_proxy.py) in front of moto's S3
server: a dead or hung store ends a read within its deadline with one line, a flipped byte or another object's bytes
are never read, a restart with the store down reads the complete cached copies, the cache bound holds while the
index is built, too many unreadable shards stop the reader."""

import itertools
from collections import Counter
import logging
import os
import threading
import time

import pytest
import torch

from data import remote
from data.index import load_or_build_index
from data.indexed import IndexedShards, TooManyBadShards, make_indexed_loader
from data.read_spec import ReadSpec
from data.remote import ShardCache, ShardChanged, StoreBudget, StoreUnreachable
from data.skips import UNREADABLE_SHARD, NoUsableSamples
from data.synthetic import write_synthetic_shards
from data.urls import expand_urls
from fault_proxy import FaultProxy
from remote_servers import S3Server

RES = 32
FAST = StoreBudget(timeout_s=1.0, attempts=2)  # a dead store is found in a second


@pytest.fixture(autouse=True)
def own_cache_home(tmp_path, monkeypatch):
    """The listings and small files kept for a store that does not answer go under the test's folder."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    folder = tmp_path_factory.mktemp("faults_local")
    return write_synthetic_shards(folder, num_samples=24, samples_per_shard=6, resolution=RES, seed=5)


@pytest.fixture
def store(monkeypatch, tmp_path):
    """(S3 server, the proxy the client goes through)."""
    server = S3Server()
    proxy = FaultProxy(server.endpoint)
    for key, value in server.env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # where the listings of globs are kept
    monkeypatch.setattr(remote, "DEFAULT_BUDGET", FAST)  # what a glob is listed within
    monkeypatch.setattr(remote, "BACKOFF_S", 0.01)
    yield server, proxy
    proxy.close()
    server.close()


def keys_and_pixels(urls, cache=None, n=8, **kw):
    loader = make_indexed_loader(urls, ReadSpec(resolution=RES, batch_size=3, seed=11, **kw), cache=cache)
    return loader, [(b["keys"], b["pixels"]) for b in itertools.islice(loader, n)]


def same(a, b):
    return [k for k, _ in a] == [k for k, _ in b] and all(torch.equal(p, q) for (_, p), (_, q) in zip(a, b))


def copies(cache: ShardCache) -> list[str]:
    return sorted(e.name for e in os.scandir(cache.folder) if e.is_file() and not e.name.endswith(".lock"))


def test_a_flipped_byte_is_downloaded_again_and_bytes_never_indexed_are_never_read(local, store, tmp_path, caplog):
    server, proxy = store
    urls = server.upload("shards", "flip", local)
    cache = ShardCache(tmp_path / "cache", limit=1, budget=FAST)  # nothing stays: every read downloads
    index = load_or_build_index(urls, cache=cache)
    assert [e["checksum"] for e in index.shardlist] == [remote.checksum(p) for p in local]  # the first pass's
    name = os.path.basename(local[1])
    proxy.set("flip", path=name, times=1)  # one spoiled answer: the second download is the indexed bytes
    caplog.set_level(logging.WARNING, logger="data.remote")
    _, got = keys_and_pixels(urls, cache)
    assert same(got, keys_and_pixels(local)[1]) and proxy.spoiled == 1
    assert f"downloaded bytes with checksum" in caplog.text and "downloading it again" in caplog.text
    for mode in ("flip", "swap"):  # every answer spoiled, size and ETag unchanged: refused in one line
        proxy.set(mode, path=name, other=f"/shards/flip/{os.path.basename(local[2])}")
        with pytest.raises(ShardChanged) as refused:
            index.open(1)
        assert str(refused.value) == (f"{urls[1]}: changed since indexed (its bytes are not the ones indexed, "
                                      f"twice): restart to re-index")
        assert not any(name in copy for copy in copies(cache))  # never renamed into the cache
    loader, got = keys_and_pixels(index, n=8)
    assert loader.stats.shards_bad == {UNREADABLE_SHARD: 1}  # a counted skip, its samples substituted
    assert not [k for ks, _ in got for k in ks if k.startswith(name[:-4])]


def test_the_reader_fingerprint_holds_each_remote_shards_size_etag_and_checksum(local, store, tmp_path):
    server, _ = store
    urls = server.upload("shards", "print", local[:2])
    index = load_or_build_index(urls, cache=ShardCache(tmp_path / "cache", budget=FAST))
    reader = IndexedShards(index, RES)
    before = reader.fingerprint()
    for key, other in (("checksum", "blake2b:00"), ("etag", "another"), ("filesize", 1)):
        entry = index.shardlist[0]
        kept = entry[key]
        entry[key] = other
        assert reader.fingerprint() != before, f"the reader's fingerprint misses a remote shard's {key}"
        entry[key] = kept
    assert reader.fingerprint() == before


@pytest.mark.parametrize("extra", [-10, 10])
def test_a_download_of_another_size_is_never_renamed_into_the_cache(local, store, tmp_path, monkeypatch, extra):
    server, _ = store
    url = server.upload("shards", "size", local[:1])[0]
    fingerprint = remote.stat(url, FAST)
    real = remote.filesystem

    class OtherSize:  # a store that sends a body of another length than the one it announced
        def __init__(self, fs):
            self.fs = fs

        def __getattr__(self, name):
            return getattr(self.fs, name)

        def get_file(self, path, dest):
            data = self.fs.cat_file(path)
            with open(dest, "wb") as f:
                f.write(data[:extra] if extra < 0 else data + b"\0" * extra)

    monkeypatch.setattr(remote, "filesystem", lambda u, budget=FAST: (OtherSize(real(u, budget)[0]),
                                                                        real(u, budget)[1]))
    cache = ShardCache(tmp_path / "cache", budget=FAST)
    # a short body is a transfer's fault, retried within the budget; a longer one is another object: refused at once
    with pytest.raises(remote.RemoteReadError if extra < 0 else ShardChanged, match=f"read {20480 + extra} bytes, "
                                                                                    f"the index has 20480"):
        cache.path(url, fingerprint)
    assert copies(cache) == [] and not cache.cached(url, fingerprint)


def test_a_restart_with_the_store_down_reads_the_complete_cached_copies(local, store, tmp_path, caplog):
    server, proxy = store
    urls = server.upload("shards", "down", local)
    cache = ShardCache(tmp_path / "cache", budget=FAST)
    assert expand_urls("s3://shards/down/*.tar") == urls  # listed by the store, the listing kept
    (tmp_path / "precompute.json").write_text('{"kind": "manifest"}')
    server.upload("shards", "down", [str(tmp_path / "precompute.json")])
    assert remote.read_json("s3://shards/down/precompute.json") == {"kind": "manifest"}  # its copy kept
    load_or_build_index(urls, cache=cache)  # every shard downloaded once, while the index is built
    want = keys_and_pixels(local)[1]
    proxy.set("refuse")
    caplog.set_level(logging.WARNING)
    assert expand_urls("s3://shards/down/*.tar") == urls  # the last listing, said in one line
    assert "data: the store did not answer the listing of s3://shards/down/*.tar" in caplog.text
    # the store found dead once: the next reads ask once, without waiting for the deadline again
    assert remote.read_json("s3://shards/down/precompute.json") == {"kind": "manifest"}
    assert "using its last copy" in caplog.text
    assert "read s3://shards/down/precompute.json failed" not in caplog.text  # no retry waited for
    index = load_or_build_index(urls, cache=cache)
    assert index.rescanned == [] and index.nsamples == [6] * 4
    assert same(keys_and_pixels(index)[1], want)
    assert (f"data: the store did not answer for 4 of 4 shards ({urls[0]}: store unreachable for 1 s" in caplog.text
            and "4 of them read from their complete copies in" in caplog.text)
    # a copy missing, or whose bytes are not the indexed ones: only those shards are skipped
    paths = sorted(os.path.join(cache.folder, c) for c in copies(cache))
    os.remove(next(p for p in paths if p.endswith(os.path.basename(local[0]))))
    spoiled = next(p for p in paths if p.endswith(os.path.basename(local[3])))
    data = bytearray(open(spoiled, "rb").read())
    data[100] ^= 1
    open(spoiled, "wb").write(bytes(data))
    index = load_or_build_index(urls, cache=cache)
    assert index.nsamples == [0, 6, 6, 0] and "2 of them read from their complete copies" in caplog.text
    for path in paths:
        if os.path.exists(path):
            os.remove(path)
    with pytest.raises(StoreUnreachable, match=r"^s3://shards/down/synthetic-00000\d.tar: store unreachable for 1 s "
                                               r"\(stat .*EndpointConnectionError"):
        load_or_build_index(urls, cache=cache)  # nothing cached: the store's line, not the shard format's


def test_a_dead_store_ends_a_read_within_its_deadline_with_one_line(local, store, tmp_path):
    server, proxy = store
    urls = server.upload("shards", "dead", local)
    cache = ShardCache(tmp_path / "cache", limit=1, budget=FAST)
    index = load_or_build_index(urls, cache=cache)
    proxy.set("refuse")
    with pytest.raises(StoreUnreachable) as dead:
        keys_and_pixels(index)
    assert str(dead.value).startswith("s3://shards/dead/synthetic-") and ": store unreachable for 1 s (download " \
        in str(dead.value) and "\n" not in str(dead.value)


# the default share and another: the reader applies the share of the run's cache, not the default
@pytest.mark.parametrize("share, failed", [(0.5, 3), (0.25, 2)])
def test_more_unreadable_shards_than_data_max_bad_shards_stop_the_reader_in_one_line(local, store, tmp_path, share,
                                                                                     failed):
    server, proxy = store
    urls = server.upload("shards", "share", local)
    cache = ShardCache(tmp_path / "cache", limit=1, budget=StoreBudget(timeout_s=5, attempts=2, max_bad_shards=share))
    index = load_or_build_index(urls, cache=cache)
    proxy.set("error", path="synthetic-00000")  # the store answers 503 to every request for a shard
    with pytest.raises(TooManyBadShards, match=rf"^{failed} of the 4 shards of 4 shards \(s3://shards/share/"
                                               r"synthetic-000000.tar, \.\.\.\) could not be read \(more than "
                                               rf"data.max_bad_shards={share:g}\), the last s3://.*; check the store"):
        keys_and_pixels(index)


def test_shards_the_store_fails_while_the_index_is_built_count_against_data_max_bad_shards(local, store, tmp_path):
    server, proxy = store
    urls = server.upload("shards", "build", local)
    proxy.set("error", path="synthetic-000001")  # 503 to every request for one shard of 4, from the first index on
    strict = ShardCache(tmp_path / "strict", budget=StoreBudget(timeout_s=1, attempts=2, max_bad_shards=0.2))
    index = load_or_build_index(urls, cache=strict)
    assert index.nsamples == [6, 0, 6, 6] and index.shardlist[1]["error"].startswith(UNREADABLE_SHARD)
    with pytest.raises(TooManyBadShards, match=r"^1 of the 4 shards of .* could not be read \(more than "
                                               r"data.max_bad_shards=0.2\), the last s3://shards/build/synthetic-"
                                               r"000001.tar: unreadable shard: .*; check the store and the shards$"):
        IndexedShards(index, RES, cache=strict)  # refused before the first read, not after
    lenient = ShardCache(tmp_path / "lenient", budget=FAST)  # 0.5: the shard is left out, counted once
    reader = IndexedShards(load_or_build_index(urls, cache=lenient), RES, cache=lenient)
    assert reader.stats.shard_errors == 1
    proxy.set("error", path="synthetic-00000")  # every shard: the store's answer, not the shard format, is blamed
    with pytest.raises(NoUsableSamples, match=r"^none of the 4 shard\(s\) could be read, the first s3://shards/build/"
                                              r"synthetic-000000.tar: unreadable shard: RemoteReadError: .*Service Unavailable"):
        load_or_build_index(urls, cache=ShardCache(tmp_path / "all", budget=FAST))


def test_downloads_reserve_their_size_before_they_start(tmp_path):
    cache = ShardCache(tmp_path, limit=3000)
    old, recent = tmp_path / "a-old.tar", tmp_path / "b-recent.tar"
    for path, when in ((old, 1), (recent, 2)):
        path.write_bytes(b"x" * 1000)
        os.utime(path, (when, when))
    other = tmp_path / f"c.tar.part-1000-{os.getpid()}"  # another download in flight, nothing written yet
    other.write_bytes(b"")
    assert cache.held() == ([(1, str(old), 1000), (2, str(recent), 1000)], 1000)
    part = cache._reserve(str(tmp_path / "d.tar"), 1000)  # 2000 held + 1000 in flight + 1000: the oldest goes
    assert part == str(tmp_path / f"d.tar.part-1000-{os.getpid()}") and os.path.exists(part)
    assert not old.exists() and recent.exists()
    # the limit full of downloads in flight: a new one waits for one of them to end
    done = threading.Event()

    def finish_other():
        time.sleep(0.2)
        done.set()
        other.unlink()

    threading.Thread(target=finish_other).start()
    cache._reserve(str(tmp_path / "e.tar"), 2000)  # 2000 in flight + 2000 > 3000, with every shard evicted
    assert done.is_set() and not recent.exists()  # made once the other ended
    assert sum(size for _, _, size in cache.held()[0]) + cache.held()[1] <= 3000
    # a dead process's partial file is no reservation: deleted
    dead = tmp_path / "f.tar.part-1000-999999999"
    dead.write_bytes(b"")
    cache.held()
    assert not dead.exists()


@pytest.mark.slow
def test_a_hung_store_ends_a_loader_with_workers_within_its_deadline_with_one_line(local, store, tmp_path):
    server, proxy = store
    urls = server.upload("shards", "hang", local)
    budget = StoreBudget(timeout_s=3.0, attempts=2)
    cache = ShardCache(tmp_path / "cache", limit=1, budget=budget)
    index = load_or_build_index(urls, cache=cache)
    proxy.set("hang")
    loader = make_indexed_loader(index, ReadSpec(resolution=RES, batch_size=3, seed=11, num_workers=2))
    start = time.monotonic()
    with pytest.raises(StoreUnreachable) as dead:
        next(iter(loader))
    assert time.monotonic() - start < 60, "timed out: the hung store was waited on past its deadline"
    assert str(dead.value).startswith("s3://shards/hang/synthetic-") and "\n" not in str(dead.value)
    assert ": store unreachable for 3 s (download " in str(dead.value) and "ReadTimeoutError" in str(dead.value)


@pytest.mark.slow
def test_the_cache_bound_holds_at_every_poll_while_the_index_is_built(tmp_path, monkeypatch):
    shards = write_synthetic_shards(tmp_path / "set", num_samples=48, samples_per_shard=4, resolution=64, seed=3)
    server = S3Server()
    try:
        for key, value in server.env.items():
            monkeypatch.setenv(key, value)
        urls = server.upload("shards", "bound", shards)
        server.faults.trickle_s = 0.02  # downloads that last, so that the 8 index threads overlap
        size = os.path.getsize(shards[0])
        limit = int(2.5 * size)
        cache = ShardCache(tmp_path / "cache", limit=limit)
        seen, stop = [], threading.Event()

        def poll():
            while not stop.is_set():
                total = 0
                for entry in os.scandir(cache.folder) if os.path.isdir(cache.folder) else ():
                    try:
                        if entry.is_file() and not entry.name.endswith(".lock"):
                            total += entry.stat().st_size
                    except FileNotFoundError:
                        pass
                seen.append(total)
                time.sleep(0.002)

        poller = threading.Thread(target=poll)
        poller.start()
        try:
            index = load_or_build_index(urls, cache=cache)
        finally:
            stop.set()
            poller.join()
        assert index.nsamples == [4] * 12 and len(seen) > 50 and max(seen) > 0
        assert max(seen) <= limit, f"the cache held {max(seen)} bytes, its limit is {limit}"
    finally:
        server.close()


def test_the_caption_check_reads_remote_shards_through_the_cache(local, store, tmp_path):
    from imba.training.text_check import sample_captions

    server, proxy = store
    urls = server.upload("shards", "captions", local)
    cache = ShardCache(tmp_path / "cache", budget=FAST)
    want = sample_captions([local], "caption", per_source=9)
    assert len(want) == 9 and sample_captions([urls], "caption", per_source=9, cache=cache) == want
    assert len(copies(cache)) == 2  # the shards the captions came from, kept for the reader
    proxy.set("error", path="synthetic-000000")  # a shard the store does not give: its captions skipped
    fresh = ShardCache(tmp_path / "fresh", budget=FAST)
    assert sample_captions([urls], "caption", per_source=3, cache=fresh) == want[6:9]
    proxy.set("refuse")  # a dead store: the check reads nothing and leaves the verdict to the reader
    assert sample_captions([urls], "caption", per_source=3, cache=ShardCache(tmp_path / "dead", budget=FAST)) == []


@pytest.mark.parametrize("workers", [1, 2])
def test_the_concept_statistics_of_remote_shards_are_those_of_their_local_copies(local, store, tmp_path, workers):
    from data.concepts import collect_stats

    server, proxy = store
    urls = server.upload("shards", "concepts", local)
    budget = StoreBudget(timeout_s=20, attempts=2)  # time for a fresh connection where a pooled one went stale
    cache = ShardCache(tmp_path / "cache", budget=budget)
    want = collect_stats(local)
    got = collect_stats("s3://shards/concepts/*.tar", cache=cache, workers=workers)
    assert got.num_captions == want.num_captions == 24 and got.counts == want.counts and got.skipped == Counter()
    assert got.pair_counts == want.pair_counts and got.sources == urls
    assert len(copies(cache)) == 4  # read as the training reader reads them: downloaded once, kept
    proxy.set("error", path="synthetic-000002")  # a shard the store does not give: counted, the others read
    partial = collect_stats(urls, cache=ShardCache(tmp_path / "fresh", budget=budget))
    assert partial.num_captions == 18 and partial.skipped == Counter({"unreadable shard": 1})


@pytest.mark.parametrize("mode", ["hang", "refuse"])
def test_an_http_store_that_hangs_or_refuses_is_found_dead_within_its_deadline(local, tmp_path, monkeypatch, mode):
    from remote_servers import HTTPServer

    monkeypatch.setattr(remote, "BACKOFF_S", 0.01)
    server = HTTPServer(os.path.dirname(local[0]))
    proxy = FaultProxy(server.url)
    url = f"{proxy.url}/{os.path.basename(local[0])}"
    found = []
    try:
        assert remote.stat(url, FAST)["filesize"] == os.path.getsize(local[0])
        proxy.set(mode)

        def ask():
            try:
                remote.stat(url, FAST)
            except StoreUnreachable as exn:
                found.append(str(exn))

        asking = threading.Thread(target=ask, daemon=True)
        asking.start()
        asking.join(timeout=60)
        assert not asking.is_alive(), "timed out: the HTTP client waited past the store's deadline"
    finally:
        proxy.close()
        server.close()
    assert len(found) == 1 and found[0].startswith(f"{url}: store unreachable for 1 s (stat {url}: ")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["error", "reset", "truncate", "delay"])
def test_a_flaky_store_gives_the_local_batches(local, store, tmp_path, mode):
    server, proxy = store
    urls = server.upload("shards", f"flaky-{mode}", local)
    # nothing stays in the cache: every shard read is a download through the faults; 30 % of the answers spoiled,
    # so a read fails for good only after 20 spoiled answers in a row (odds 0.3^20)
    cache = ShardCache(tmp_path / "cache", limit=1, budget=StoreBudget(timeout_s=10, attempts=20))
    proxy.set(mode, share=0.3, delay_s=0.2)
    loader, got = keys_and_pixels(urls, cache)
    assert same(got, keys_and_pixels(local)[1])
    assert loader.stats.shard_errors == 0 and (proxy.spoiled > 0 or mode == "delay")
