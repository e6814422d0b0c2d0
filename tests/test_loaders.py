"""data.stream.open_loader and data.read_spec.ReadSpec: the reader a run's data settings choose, the combinations
refused before any reading, and the index built by the main process first, once."""

from __future__ import annotations

import contextlib
import itertools

import pytest
import torch

import data.stream as stream
from data.indexed import IndexedLoader, make_indexed_loader
from data.read_spec import ReadSpec
from data.stream import choose_mode, open_loader
from data.streaming import make_image_text_loader
from data.synthetic import write_synthetic_shards

RES = 16
LOCAL = ["/data/shards/000000.tar", "/data/shards/000001.tar"]
REMOTE = ["/data/shards/000000.tar", "pipe:curl -s https://example.com/000001.tar"]
MANIFEST = {"resolution": RES}  # any manifest: the shards hold precomputed features
SPEC = ReadSpec(resolution=RES, batch_size=2, seed=3, shuffle_buffer=10)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return write_synthetic_shards(str(tmp_path_factory.mktemp("loaders")), num_samples=12, samples_per_shard=6,
                                  resolution=RES, seed=0)


def keys(loader, n: int) -> list[list[str]]:
    return [b["keys"] for b in itertools.islice(loader, n)]


def test_mode_choice():
    assert choose_mode("auto", LOCAL) == "indexed"
    assert choose_mode("auto", REMOTE) == "streaming"  # one pipe: command is enough to stream
    stores = ["s3://bucket/a.tar", "gs://bucket/b.tar", "http://host/c.tar", "https://host/d.tar"]
    assert choose_mode("auto", LOCAL + stores) == "indexed"  # object stores are read indexed, through the cache
    assert choose_mode("indexed", LOCAL) == "indexed"
    assert choose_mode("streaming", LOCAL) == "streaming"
    for mode in ("auto", "indexed", "streaming"):  # precomputed features are always read indexed
        assert choose_mode(mode, LOCAL, MANIFEST) == "indexed"
        assert choose_mode(mode, REMOTE, MANIFEST) == "indexed"


@pytest.mark.parametrize("shard_list, mode, manifest, why", [
    (LOCAL, "auto", MANIFEST, "precomputed latents have one fixed size"),
    (LOCAL, "streaming", None, "streamed shards have no index"),
    (REMOTE, "auto", None, "streamed shards have no index"),
])
def test_bucketing_is_refused_without_indexed_image_shards(shard_list, mode, manifest, why):
    message = f"data.bucketing=true needs image shards read in indexed mode: {why}"
    with pytest.raises(ValueError) as info:
        open_loader(shard_list, SPEC.replace(bucketing=True), mode=mode, manifest=manifest)
    assert str(info.value) == message


class Processes:
    """The run's processes as `open_loader` sees them, recording when the main process goes first."""

    def __init__(self, events):
        self.events = events

    @contextlib.contextmanager
    def main_process_first(self):
        self.events.append("enter")
        yield
        self.events.append("exit")


def test_indexed_mode_builds_the_index_inside_main_process_first(shards, monkeypatch):
    events = []
    real_index = stream.load_or_build_index
    monkeypatch.setattr(stream, "load_or_build_index",
                        lambda urls, cache: events.append(("index", urls)) or real_index(urls, cache=cache))
    loader = open_loader(shards, SPEC.replace(batches_done=5), processes=Processes(events))
    assert events == ["enter", ("index", shards), "exit"]
    assert isinstance(loader, IndexedLoader) and loader.start_batch == 5 and loader.buckets is None
    want = make_indexed_loader(shards, ReadSpec(resolution=RES, batch_size=2, seed=3, batches_done=5))
    assert keys(loader, 4) == keys(want, 4)

    events.clear()  # an index the caller loaded is used as it is
    bucketed = open_loader(shards, SPEC.replace(bucketing=True), mode="indexed", index=real_index(shards, cache=None))
    assert events == [] and bucketed.buckets is not None
    assert keys(bucketed, 3) == keys(make_indexed_loader(shards, SPEC.replace(bucketing=True)), 3)


def test_streaming_mode_resumes_its_stream_from_the_batches_done(shards):
    loader = open_loader(shards, SPEC.replace(batches_done=4), mode="streaming")
    assert isinstance(loader, torch.utils.data.DataLoader)
    assert keys(loader, 3) == keys(make_image_text_loader(shards, SPEC.replace(batches_done=4)), 3)
    assert keys(loader, 6) != keys(make_image_text_loader(shards, SPEC), 6)


def test_a_manifest_reads_precomputed_shards_from_the_batches_done(monkeypatch):
    calls = []
    monkeypatch.setattr(stream, "load_or_build_index", lambda urls, cache: calls.append(("index", urls)) or "index")
    monkeypatch.setattr(stream, "make_precomputed_loader", lambda *a, **k: calls.append((a, k)) or "loader")
    spec = SPEC.replace(rank=1, world_size=2, batches_done=7)
    assert open_loader(LOCAL, spec, mode="streaming", manifest=MANIFEST) == "loader"
    assert calls == [("index", LOCAL), (("index", spec), {"manifest": MANIFEST, "sampler": None, "cache": None})]
    threads = spec.replace(loader_threads=2)
    assert open_loader(LOCAL, threads, manifest=MANIFEST) == "loader" and calls[-1][0] == ("index", threads)
    with pytest.raises(ValueError, match="needs precomputed features and data.num_workers=0 .these shards are images"):
        open_loader(LOCAL, threads)  # image shards: refused before any is read


@pytest.mark.parametrize("changes, message", [
    (dict(batch_size=0), "need batch_size >= 1 (got batch_size=0)"),
    (dict(resolution=0, min_size=-1), "need resolution >= 1, min_size >= 0 (got resolution=0, min_size=-1)"),
    (dict(num_workers=-1), "need num_workers >= 0 (got num_workers=-1)"),
    (dict(rank=2, world_size=2), "rank 2 is outside world_size 2"),
    (dict(loader_threads=1, num_workers=1), "data.loader_threads=1 needs precomputed features and data.num_workers=0"),
    (dict(bucketing=True, shard_window=2), "aspect-ratio bucketing reads samples in a uniform order"),
])
def test_a_read_spec_refuses_what_no_reader_can_read(changes, message):
    with pytest.raises(ValueError) as info:
        SPEC.replace(**changes)
    assert str(info.value).startswith(message)
