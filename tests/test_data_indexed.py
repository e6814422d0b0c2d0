"""data/index.py, data/order.py, data/indexed.py: the shard index and its cache, random access, the (seed,
epoch)-pure order, rank splitting, exact resume, worker-independent order and bad-sample substitution, on real tar
files."""

from __future__ import annotations

import gzip
import io
import itertools
import json
import os
import re
import shutil
import tarfile

import numpy as np
import pytest
import torch
from PIL import Image

import data.index as index_module
from shard_helpers import encode, write_tar
from data.images import image_to_tensor, resize_center_crop
from data.index import load_or_build_index
from data.indexed import IndexedShards, make_indexed_loader
from data.order import IndexedBatchSampler, batches_per_epoch, feistel_permute
from data.read_spec import ReadSpec
from data.synthetic import write_synthetic_shards

RES = 16
PIPES_STREAM = "a pipe: command can only be streamed: use data.mode=streaming"


# ---------------------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------------------


def tar_keys(path) -> list[str]:
    with tarfile.open(path) as tf:
        return list(dict.fromkeys(m.name.split(".", 1)[0] for m in tf.getmembers()))


def png(rgb, size=(20, 12)) -> bytes:
    return encode(Image.new("RGB", size, rgb), "PNG")


def keys_of(loader, n: int) -> list[list[str]]:
    return [b["keys"] for b in itertools.islice(loader, n)]


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    """37 samples in shards of 10, 10, 10, 7."""
    out = tmp_path_factory.mktemp("indexed_synth")
    paths = write_synthetic_shards(str(out), num_samples=37, samples_per_shard=10, resolution=RES, seed=0)
    return str(out), paths


@pytest.fixture(scope="module")
def bad_shard(tmp_path_factory):
    """8 samples k0..k7: k1 undecodable image, k3 blank caption, k7 no image (its substitute wraps to k0)."""
    out = tmp_path_factory.mktemp("indexed_bad")
    samples = []
    for i in range(8):
        s = {"__key__": f"k{i}", "png": png((30 * i, 100, 200)), "txt": f"sample {i}".encode()}
        if i == 1:
            s = {"__key__": "k1", "jpg": b"\xff\xd8 not a jpeg at all", "txt": b"broken image"}
        if i == 3:
            s["txt"] = b"   "
        if i == 7:
            s = {"__key__": "k7", "txt": b"no image here"}
        samples.append(s)
    return write_tar(out / "bad-000000.tar", samples)


# ---------------------------------------------------------------------------------------------------------------
# index
# ---------------------------------------------------------------------------------------------------------------


def test_index_matches_the_tars_and_random_access_decodes(synth):
    folder, paths = synth
    index = load_or_build_index(folder)
    assert index.urls == [os.path.abspath(p) for p in paths] and index.nsamples == [10, 10, 10, 7]
    ds = IndexedShards(folder, RES)
    assert len(ds) == 37
    expected_keys = [k for p in paths for k in tar_keys(p)]
    assert [ds[i]["key"] for i in range(37)] == expected_keys  # global index runs through the shards in order
    members = {}
    for p in paths:
        with tarfile.open(p) as tf:
            members.update({m.name: tf.extractfile(m).read() for m in tf.getmembers()})
    for i in (0, 9, 10, 36):
        s = ds[i]
        key = s["key"]
        assert s["caption"] == members[f"{key}.txt"].decode()
        want = image_to_tensor(resize_center_crop(Image.open(io.BytesIO(members[f"{key}.png"])), RES))
        assert s["pixels"].shape == (3, RES, RES) and s["pixels"].dtype == torch.float32
        assert torch.equal(s["pixels"], want)
        assert set(ds.raw(i)) >= {"png", "txt", "json", "__key__", "__url__"}
    assert ds.stats.bad == {}
    with pytest.raises(IndexError):
        ds[37]


def test_index_is_cached_and_rebuilt_when_a_shard_changes(tmp_path, monkeypatch):
    shards = tmp_path / "shards"
    paths = write_synthetic_shards(str(shards), num_samples=25, samples_per_shard=10, resolution=RES, seed=1)
    cache = tmp_path / "cache"
    first = load_or_build_index(str(shards), index_dir=cache)
    assert first.rescanned == [os.path.abspath(p) for p in paths]
    meta = json.loads(open(first.path).read())
    listed = [(s["url"], s["nsamples"]) for s in meta["shardlist"]]
    assert listed == [(os.path.abspath(p), n) for p, n in zip(paths, [10, 10, 5])]
    assert os.path.dirname(first.path) == str(cache) and not list(shards.glob("imba-index-*"))

    real_scan = index_module._scan_tar
    scanned = []
    monkeypatch.setattr(index_module, "_scan_tar", lambda path: scanned.append(path) or real_scan(path))
    again = load_or_build_index(str(shards), index_dir=cache)
    assert scanned == [] and again.rescanned == [] and again.nsamples == [10, 10, 5]

    # rewrite the middle shard with 3 different samples: only it is rescanned, the index follows
    write_tar(paths[1], [{"__key__": f"new{i}", "png": png((i, 0, 0)), "txt": b"new"} for i in range(3)])
    changed = load_or_build_index(str(shards), index_dir=cache)
    assert scanned == [os.path.abspath(paths[1])] and changed.nsamples == [10, 3, 5]
    assert len(list(cache.glob("imba-index-*.npy"))) == 1  # the stale spans file is removed
    ds = IndexedShards(str(shards), RES, index_dir=cache)
    assert [ds[i]["key"] for i in range(9, 14)] == ["000000009", "new0", "new1", "new2", "000000020"]
    assert scanned == [os.path.abspath(paths[1])]

    # default place: next to the shards
    near = load_or_build_index(str(shards))
    assert os.path.dirname(near.path) == str(shards)


def test_an_index_build_with_shards_to_scan_shows_its_progress(tmp_path, capsys):
    shards = tmp_path / "shards"
    write_synthetic_shards(str(shards), num_samples=40, samples_per_shard=8, resolution=RES, seed=1)
    load_or_build_index(str(shards), index_dir=tmp_path / "a")
    assert re.search(r"indexing 5 shards: .*5/5", capsys.readouterr().err)
    load_or_build_index(str(shards), index_dir=tmp_path / "a")  # nothing to scan: nothing shown
    assert "indexing" not in capsys.readouterr().err


def test_truncated_shard_keeps_its_complete_samples(synth, tmp_path):
    _, paths = synth
    blob = open(paths[0], "rb").read()
    cut = tmp_path / "cut.tar"
    cut.write_bytes(blob[: len(blob) // 2 + 700])
    ds = IndexedShards(str(cut), RES)
    assert 3 <= len(ds) < 10
    assert [ds[i]["key"] for i in range(len(ds))] == tar_keys(paths[0])[: len(ds)]


def test_pipes_and_compressed_shards_fail_with_one_line(synth, tmp_path):
    for url in ("pipe:curl -s http://host/shard-{000..003}.tar", [synth[1][0], "pipe:cat a.tar"]):
        with pytest.raises(ValueError, match=PIPES_STREAM):
            make_indexed_loader(url, ReadSpec(resolution=RES, batch_size=2))
    _, paths = synth
    gz = tmp_path / "shard.tar.gz"
    gz.write_bytes(gzip.compress(open(paths[0], "rb").read()))
    with pytest.raises(ValueError, match="needs uncompressed .tar shards.*gzip"):
        make_indexed_loader(str(gz), ReadSpec(resolution=RES, batch_size=2))
    with pytest.raises(ValueError, match="fewer than one global batch"):
        make_indexed_loader(paths[3], ReadSpec(resolution=RES, batch_size=4, world_size=2))  # 7 samples < 2 x 4


# ---------------------------------------------------------------------------------------------------------------
# order
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 37, 64, 65, 1000])
def test_feistel_is_a_permutation_and_keyed(n):
    perm = feistel_permute(np.arange(n), n, "k", 0)
    assert sorted(perm.tolist()) == list(range(n))
    assert np.array_equal(feistel_permute(np.arange(n), n, "k", 0), perm)
    assert np.array_equal(feistel_permute(np.arange(n)[::-1], n, "k", 0), perm[::-1])  # position by position
    if n >= 37:
        assert not np.array_equal(feistel_permute(np.arange(n), n, "k", 1), perm)
        assert (perm != np.arange(n)).mean() > 0.9


def test_order_is_a_pure_function_of_seed_and_epoch():
    def order(seed, epoch, **kw):
        return IndexedBatchSampler(37, 4, seed=seed, **kw).epoch_order(epoch)

    o = order(0, 0)
    assert sorted(o.tolist()) == list(range(37))
    assert np.array_equal(o, order(0, 0))
    assert np.array_equal(o, order(0, 0, world_size=3, rank=2, start_batch=11))  # independent of the split
    assert not np.array_equal(o, order(1, 0))
    assert not np.array_equal(o, order(0, 1))
    assert sorted(order(0, 1).tolist()) == list(range(37))


def test_shard_window_order_reads_few_shards_at_a_time():
    sizes = [10, 10, 10, 7, 0, 5]
    shard_of = np.repeat(np.arange(len(sizes)), sizes)
    for window in (1, 2):
        sampler = IndexedBatchSampler(42, 4, seed=3, shard_sizes=sizes, shard_window=window)
        orders = [sampler.epoch_order(e) for e in range(3)]
        for o in orders:
            assert sorted(o.tolist()) == list(range(42))
            seq = shard_of[o]
            if window == 1:  # one shard after the other, each shuffled inside
                assert sum(seq[i] != seq[i + 1] for i in range(41)) == 4  # 5 non-empty shards, 4 changes
            for shard in set(seq.tolist()):  # a shard is read within a stretch of at most `window` shards
                where = np.flatnonzero(seq == shard)
                assert where[-1] - where[0] < sum(sorted(sizes)[-window:])
        assert not np.array_equal(orders[0], orders[1])
        assert not np.array_equal(shard_of[orders[0]], shard_of[orders[1]])  # shard order changes per epoch


@pytest.mark.parametrize("n,world,batch", [(37, 3, 4), (36, 3, 4), (12, 3, 4), (100, 7, 3), (37, 1, 5)])
def test_ranks_get_equal_disjoint_batches(n, world, batch):
    samplers = [IndexedBatchSampler(n, batch, seed=5, rank=r, world_size=world) for r in range(world)]
    bpe = batches_per_epoch(n, batch, world)
    assert bpe == n // (world * batch) and all(s.batches_per_epoch == bpe for s in samplers)
    for epoch in range(2):
        per_rank = [[s.batch_indices(epoch * bpe + k) for k in range(bpe)] for s in samplers]
        flat = [i for batches in per_rank for b in batches for i in b]
        assert all(len(b) == batch for batches in per_rank for b in batches)
        assert len(flat) == len(set(flat)) == bpe * world * batch  # disjoint
        # together: the epoch's order minus its last n % (world * batch) positions
        assert sorted(flat) == sorted(samplers[0].epoch_order(epoch)[: bpe * world * batch].tolist())
    with pytest.raises(ValueError, match="rank 3 is outside world_size 3"):
        IndexedBatchSampler(37, 4, rank=3, world_size=3)


# ---------------------------------------------------------------------------------------------------------------
# loader: batches, resume, workers
# ---------------------------------------------------------------------------------------------------------------


def test_loader_batches(synth):
    folder, _ = synth
    loader = make_indexed_loader(folder, ReadSpec(resolution=RES, batch_size=4, seed=2))
    assert loader.batches_per_epoch == 9
    batches = list(itertools.islice(loader, 18))  # two epochs
    for b in batches:
        assert set(b) == {"pixels", "captions", "keys", "indices"}
        assert b["pixels"].shape == (4, 3, RES, RES) and b["pixels"].dtype == torch.float32
        assert -1.0 <= b["pixels"].min() and b["pixels"].max() <= 1.0
        assert len(b["captions"]) == len(b["keys"]) == 4 and all(b["captions"])
    ds = loader.dataset
    assert [b["keys"] for b in batches] == [[ds[i]["key"] for i in loader.sampler.batch_indices(t)] for t in range(18)]
    assert [b["indices"] for b in batches] == [list(loader.sampler.batch_indices(t)) for t in range(18)]
    epoch0 = [k for b in batches[:9] for k in b["keys"]]
    epoch1 = [k for b in batches[9:] for k in b["keys"]]
    assert len(set(epoch0)) == len(set(epoch1)) == 36  # each epoch: 36 distinct samples, 1 dropped
    assert epoch0 != epoch1  # a fresh permutation every epoch
    assert loader.stats.good == 72 and loader.stats.bad == {}


@pytest.mark.parametrize("shard_window", [0, 2])
def test_exact_resume_across_epochs_and_ranks(synth, shard_window):
    folder, _ = synth
    args = dict(resolution=RES, batch_size=4, seed=7, world_size=3, shard_window=shard_window)
    for rank in range(3):
        full = keys_of(make_indexed_loader(folder, ReadSpec(rank=rank, **args)), 8)  # 3 per epoch: epochs 0, 1, 2
        for k in (1, 2, 3, 5):
            resumed = make_indexed_loader(folder, ReadSpec(rank=rank, batches_done=k, **args))
            assert keys_of(resumed, 8 - k) == full[k:], (rank, k)
    # resume at step s with grad_accum g: batches_done = s * g
    step, grad_accum = 2, 2
    full = list(itertools.islice(make_indexed_loader(folder, ReadSpec(rank=1, **args)), 7))
    spec = ReadSpec(rank=1, batches_done=step * grad_accum, **args)
    resumed = list(itertools.islice(make_indexed_loader(folder, spec), 3))
    for a, b in zip(full[4:], resumed):
        assert a["keys"] == b["keys"] and a["captions"] == b["captions"] and torch.equal(a["pixels"], b["pixels"])


def test_resume_does_not_decode_skipped_samples(synth, monkeypatch):
    folder, _ = synth
    decoded = []
    real = IndexedShards.raw
    monkeypatch.setattr(IndexedShards, "raw", lambda self, i: decoded.append(i) or real(self, i))
    loader = make_indexed_loader(folder, ReadSpec(resolution=RES, batch_size=4, batches_done=1000))
    batch = next(iter(loader))
    assert len(decoded) == 4 and batch["keys"] == [loader.dataset[i]["key"] for i in loader.sampler.batch_indices(1000)]


def test_workers_give_the_same_order_as_in_process(synth):
    folder, _ = synth
    args = dict(resolution=RES, batch_size=4, seed=11, world_size=2, rank=1, batches_done=2)
    single = list(itertools.islice(make_indexed_loader(folder, ReadSpec(num_workers=0, **args)), 7))  # a new epoch
    two = list(itertools.islice(make_indexed_loader(folder, ReadSpec(num_workers=2, **args)), 7))
    assert [b["keys"] for b in two] == [b["keys"] for b in single]
    assert all(torch.equal(a["pixels"], b["pixels"]) for a, b in zip(single, two))


# ---------------------------------------------------------------------------------------------------------------
# bad samples
# ---------------------------------------------------------------------------------------------------------------


def test_bad_samples_are_replaced_deterministically_and_counted(bad_shard):
    ds = IndexedShards(bad_shard, RES)
    assert len(ds) == 8
    got = [ds[i]["key"] for i in range(8)]
    assert got == ["k0", "k2", "k2", "k4", "k4", "k5", "k6", "k0"]  # the next good index, wrapping around
    assert ds.stats.bad == {"bad image": 1, "missing image": 1, "missing or empty caption": 1}
    # each bad sample is counted once per process: a second pass gives the same keys and adds no counts
    assert [ds[i]["key"] for i in range(8)] == got and ds.stats.bad == {"bad image": 1, "missing image": 1, "missing or empty caption": 1}
    # a substitute names the sample it is (online balancing scores that one): k1 read as k2 says index 2
    assert [ds[i]["index"] for i in range(8)] == [0, 2, 2, 4, 4, 5, 6, 0]

    substitute = dict(zip(range(8), [0, 2, 2, 4, 4, 5, 6, 0]))
    runs = []
    for workers in (0, 2):
        loader = make_indexed_loader(bad_shard, ReadSpec(resolution=RES, batch_size=2, num_workers=workers, seed=4))
        assert loader.batches_per_epoch == 4
        batches = keys_of(loader, 8)  # two epochs
        runs.append(batches)
        assert batches == [[f"k{substitute[i]}" for i in loader.sampler.batch_indices(t)] for t in range(8)]
        assert loader.stats.good == 16
        counts = loader.stats.bad
        if workers == 0:  # every bad sample met in both epochs, counted once
            assert counts == {"bad image": 1, "missing image": 1, "missing or empty caption": 1}
        else:  # once per worker process that met it
            assert 1 <= counts["bad image"] <= workers and 1 <= counts["missing image"] <= workers
            assert 1 <= counts["missing or empty caption"] <= workers
    assert runs[0] == runs[1]  # workers change nothing in the batches


def test_all_bad_fails_with_one_line(tmp_path):
    path = write_tar(tmp_path / "junk.tar", [{"__key__": f"j{i}", "txt": b"caption"} for i in range(5)])
    ds = IndexedShards(path, RES)
    with pytest.raises(RuntimeError, match="all unusable"):
        ds[0]


def test_index_cache_falls_back_when_the_shard_folder_is_not_writable(synth, tmp_path, monkeypatch):
    folder = tmp_path / "ro"
    shutil.copytree(synth[0], folder, ignore=shutil.ignore_patterns("imba-index-*"))
    real_write = index_module._write_index
    refused = {str(folder)}

    def write(where, *args):
        if where in refused:
            raise PermissionError(13, "Permission denied", where)
        return real_write(where, *args)

    monkeypatch.setattr(index_module, "_write_index", write)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    index = load_or_build_index(str(folder))
    assert index.path.startswith(str(tmp_path / "xdg")) and len(index) == 37
    assert load_or_build_index(str(folder)).rescanned == []  # found again in the fallback place
    assert not list(folder.glob("imba-index-*"))

    refused.add(os.path.join(str(tmp_path / "xdg"), "imba-dit", "indexed"))
    shutil.rmtree(tmp_path / "xdg")
    in_memory = load_or_build_index(str(folder))  # nowhere writable: kept in memory, still usable
    assert in_memory.path is None and len(in_memory.rescanned) == 4
    ds = IndexedShards(in_memory, RES)
    assert [ds[i]["key"] for i in (0, 36)] == ["000000000", "000000036"]


def test_creating_and_iterating_a_loader_leaves_the_global_rng_alone(tmp_path):
    """Training resumes by restoring torch's RNG and then building the loader: the loader must not draw from it."""
    from data.indexed import make_indexed_loader
    from data.synthetic import write_synthetic_shards

    shards = write_synthetic_shards(tmp_path / "s", num_samples=8, samples_per_shard=8, resolution=32)
    before = torch.get_rng_state()
    index = load_or_build_index(shards, index_dir=tmp_path / "idx")
    loader = make_indexed_loader(index, ReadSpec(batch_size=2, resolution=32))
    next(iter(loader))
    assert torch.equal(before, torch.get_rng_state())
