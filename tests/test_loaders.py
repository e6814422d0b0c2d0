"""data/loaders.py: the reader a run's data settings choose, the combinations refused before any reading, and the
index built by the main process first."""

from __future__ import annotations

import contextlib
import itertools

import pytest
import torch

import data.loaders as loaders
from data.indexed import IndexedLoader, make_indexed_loader
from data.loaders import build_loader, choose_mode
from data.streaming import make_image_text_loader
from data.synthetic import write_synthetic_shards

RES = 16
LOCAL = ["/data/shards/000000.tar", "/data/shards/000001.tar"]
REMOTE = ["/data/shards/000000.tar", "pipe:curl -s https://example.com/000001.tar"]
MANIFEST = {"resolution": RES}  # any manifest: the shards hold precomputed features
ARGS = dict(resolution=RES, batch_size=2, num_workers=0, seed=3, rank=0, world_size=1, caption_field="caption",
            min_size=0, shuffle_buffer=10, bucketing=False, bucket_divisor=16, batches_done=0)


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
        build_loader(shard_list, mode, **{**ARGS, "bucketing": True}, manifest=manifest)
    assert str(info.value) == message


def test_indexed_mode_builds_the_index_inside_main_process_first(shards, monkeypatch):
    events = []
    real_index = loaders.load_or_build_index
    monkeypatch.setattr(loaders, "load_or_build_index",
                        lambda urls, cache: events.append(("index", urls)) or real_index(urls, cache=cache))

    @contextlib.contextmanager
    def main_process_first():
        events.append("enter")
        yield
        events.append("exit")

    loader = build_loader(shards, "auto", **{**ARGS, "batches_done": 5}, main_process_first=main_process_first)
    assert events == ["enter", ("index", shards), "exit"]
    assert isinstance(loader, IndexedLoader) and loader.start_batch == 5 and loader.buckets is None
    want = make_indexed_loader(shards, RES, 2, seed=3, batches_done=5)
    assert keys(loader, 4) == keys(want, 4)

    bucketed = build_loader(shards, "indexed", **{**ARGS, "bucketing": True})
    assert bucketed.buckets is not None
    assert keys(bucketed, 3) == keys(make_indexed_loader(shards, RES, 2, seed=3, bucketing=True), 3)


def test_streaming_mode_resumes_its_stream_from_the_batches_done(shards):
    loader = build_loader(shards, "streaming", **{**ARGS, "batches_done": 4})
    assert isinstance(loader, torch.utils.data.DataLoader)
    want = make_image_text_loader(shards, RES, 2, seed=3, batches_done=4, shuffle_buffer=10)
    assert keys(loader, 3) == keys(want, 3)
    other = make_image_text_loader(shards, RES, 2, seed=3, batches_done=0, shuffle_buffer=10)
    assert keys(loader, 6) != keys(other, 6)


def test_a_manifest_reads_precomputed_shards_from_the_batches_done(monkeypatch):
    calls = []
    monkeypatch.setattr(loaders, "load_or_build_index", lambda urls, cache: calls.append(("index", urls)))
    monkeypatch.setattr(loaders, "make_precomputed_loader", lambda *a, **k: calls.append((a, k)) or "loader")
    args = {**ARGS, "rank": 1, "world_size": 2, "batches_done": 7}
    assert build_loader(LOCAL, "streaming", **args, manifest=MANIFEST) == "loader"
    kept = {"manifest": MANIFEST, "num_threads": 0, "sampler": None, "cache": None, "shard_window": 0}
    assert calls == [("index", LOCAL), ((LOCAL, 2, 0, 3, 1, 2, 7), kept)]
    calls.clear()
    assert build_loader(LOCAL, "auto", **args, manifest=MANIFEST, loader_threads=2) == "loader"
    assert calls[1] == ((LOCAL, 2, 0, 3, 1, 2, 7), {**kept, "num_threads": 2})
    with pytest.raises(ValueError, match="needs precomputed features and data.num_workers=0 .these shards are images"):
        build_loader(LOCAL, "auto", **args, loader_threads=2)
