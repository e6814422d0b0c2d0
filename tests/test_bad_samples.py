"""Bad-sample policy (both readers): every kind of bad sample or shard is skipped, counted under its own reason,
logged (an unreadable shard by name) and never fatal, and every good sample is still delivered."""

from __future__ import annotations

import itertools
import logging
import os

import pytest
from PIL import Image

from data.read_spec import ReadSpec
import data.skips as skips_module
from data.decode import sample_caption, sample_image
from data.indexed import IndexedShards, make_indexed_loader
from data.skips import BadSample
from data.streaming import make_image_text_loader
from imba.training.config import ConfigError, load_config
from shard_helpers import HOSTILE_MIN_SIZE, encode, write_hostile_shards, write_tar

RES = 8


def make_unopenable(path: str, how: str) -> None:
    """Turn a shard into a path that cannot be opened (works as root too: no reliance on file permissions)."""
    os.remove(path)
    if how == "directory":
        os.mkdir(path)  # still listed by a folder spec, but open() fails with IsADirectoryError


def spec(hostile, how: str):
    # a vanished file makes a listed path fail at expansion time, so that case lists the shards before it vanishes;
    # a directory in its place is listed by the folder spec like any shard
    return os.path.dirname(hostile["shards"][0]) if how == "directory" else hostile["shards"]


def streaming_pass(source, **kw):
    loader = make_image_text_loader(source, ReadSpec(resolution=RES, batch_size=1, shuffle_buffer=0,
                                                     min_size=HOSTILE_MIN_SIZE, **kw), resampled=False)
    return loader


@pytest.mark.parametrize("how", ["vanished", "directory"])
def test_streaming_skips_each_bad_kind_with_exact_counts(tmp_path, caplog, how):
    hostile = write_hostile_shards(tmp_path / "shards")
    source = spec(hostile, how)
    if how == "directory":
        make_unopenable(hostile["unopenable"], how)
        loader = streaming_pass(source)
    else:
        loader = streaming_pass(source)  # shard list expanded now; the file vanishes before it is read
        make_unopenable(hostile["unopenable"], how)
    caplog.set_level(logging.WARNING)
    delivered = {}
    for batch in loader:  # one pass (resampled=False), then the stream ends
        delivered.update(zip(batch["keys"], batch["captions"]))
    assert delivered == hostile["good"]  # every good sample, with its own caption; no bad one
    stats = loader.dataset.stats
    assert stats.bad == hostile["bad"]
    assert stats.shards_bad == hostile["shards_bad"]
    assert stats.good == len(hostile["good"])
    assert stats.bad_total == 7 and stats.shard_errors == 3
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any(hostile["unopenable"] in m and "unreadable shard" in m for m in warnings)  # named in the log
    assert any(hostile["truncated"] in m and "truncated or corrupt tar" in m for m in warnings)
    summary = stats.summary()
    assert summary.startswith(f"{len(hostile['good'])} samples read; skipped 7 (bad image: 2, image too small: 1, ")
    assert "bad shards 3 (truncated or corrupt tar: 2, unreadable shard: 1)" in summary


@pytest.mark.parametrize("when", ["while reading", "when indexing"])
def test_indexed_skips_each_bad_kind_with_exact_counts(tmp_path, caplog, when):
    hostile = write_hostile_shards(tmp_path / "shards")
    caplog.set_level(logging.WARNING)
    if when == "while reading":  # indexed while readable, then the file vanishes
        loader = make_indexed_loader(hostile["shards"], ReadSpec(resolution=RES, batch_size=1,
                                                                 min_size=HOSTILE_MIN_SIZE))
        make_unopenable(hostile["unopenable"], "vanished")
        # the index still lists the 2 samples of the vanished shard: 15 (8 good, 7 bad) + 3 + 2 + 0 + 3
        assert len(loader.dataset) == 23
    else:  # a directory stands where the shard was when the index is built: indexed as unreadable, 0 samples
        make_unopenable(hostile["unopenable"], "directory")
        loader = make_indexed_loader(spec(hostile, "directory"), ReadSpec(resolution=RES, batch_size=1,
                                                                          min_size=HOSTILE_MIN_SIZE))
        assert len(loader.dataset) == 21
    # batch_size 1, one rank: one epoch visits every index once; bad ones are replaced by their next good one
    epoch = list(itertools.islice(loader, loader.batches_per_epoch))
    delivered = {k: c for b in epoch for k, c in zip(b["keys"], b["captions"])}
    assert delivered == hostile["good"]
    stats = loader.stats
    assert stats.bad == hostile["bad"]
    assert stats.shards_bad == hostile["shards_bad"]
    assert stats.good == len(loader.dataset)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any(hostile["unopenable"] in m and "unreadable shard" in m for m in warnings)
    assert any(hostile["truncated"] in m and "truncated or corrupt tar" in m for m in warnings)
    # a second epoch meets the same bad samples again: counted once per process, no new counts
    list(itertools.islice(loader, loader.batches_per_epoch))
    assert stats.bad == hostile["bad"] and stats.shards_bad == hostile["shards_bad"]


def test_unreadable_shard_larger_than_the_substitution_window_is_not_fatal(tmp_path):
    """An unreadable shard is passed over as a block: more samples than MAX_SUBSTITUTES in it is no error."""
    import data.indexed as indexed

    folder = tmp_path / "s"
    folder.mkdir()
    img = encode(Image.new("RGB", (12, 12), (5, 5, 5)), "PNG")
    big = write_tar(folder / "a.tar", [{"__key__": f"a{i:04d}", "png": img, "txt": b"a"} for i in range(150)])
    write_tar(folder / "b.tar", [{"__key__": f"b{i}", "png": img, "txt": b"b"} for i in range(3)])
    assert 150 > indexed.MAX_SUBSTITUTES
    ds = IndexedShards(str(folder), RES)
    os.remove(big)
    assert [ds[i]["key"] for i in (0, 149, 150, 152)] == ["b0", "b0", "b0", "b2"]
    assert ds.stats.shards_bad == {"unreadable shard": 1} and ds.stats.bad == {}


def test_streaming_resampled_stream_survives_the_hostile_set(tmp_path):
    """The default (infinite, resampled) stream over the same set: only good samples, all reasons counted."""
    hostile = write_hostile_shards(tmp_path / "shards")
    loader = make_image_text_loader(hostile["shards"], ReadSpec(resolution=RES, batch_size=4, shuffle_buffer=10,
                                                                min_size=HOSTILE_MIN_SIZE))
    make_unopenable(hostile["unopenable"], "vanished")
    seen = set()
    for batch in itertools.islice(loader, 40):
        assert set(batch["keys"]) <= set(hostile["good"])
        seen.update(batch["keys"])
    assert seen == set(hostile["good"])
    stats = loader.dataset.stats
    assert set(stats.bad) == set(hostile["bad"]) and set(stats.shards_bad) == set(hostile["shards_bad"])


def test_min_size_is_off_by_default_and_checked_on_the_original_size():
    small = {"png": encode(Image.new("RGB", (8, 6), (1, 1, 1)), "PNG")}
    assert sample_image(small).size == (8, 6)  # min_size 0: any size
    assert sample_image(small, min_size=6).size == (8, 6)  # the shorter side may equal min_size
    with pytest.raises(BadSample) as info:
        sample_image(small, min_size=7)
    assert info.value.reason == "image too small" and "8x6" in str(info.value)
    # a JPEG is checked before its DCT draft shrinks it towards the training resolution
    jpeg = {"jpg": encode(Image.new("RGB", (64, 48), (9, 9, 9)), "JPEG")}
    assert sample_image(jpeg, resolution=8, min_size=48).size[1] >= 8
    with pytest.raises(BadSample, match="image too small"):
        sample_image(jpeg, resolution=8, min_size=49)


def test_caption_reasons():
    assert sample_caption({"txt": "\ufeffcaf\u00e9".encode("utf-8")}) == "caf\u00e9"  # UTF-8 with a BOM is fine
    for sample, reason in [
        ({"txt": b"caf\xe9"}, "non-UTF-8 text"),
        ({"json": b'{"caption": "caf\xe9"}'}, "non-UTF-8 text"),
        ({"json": b"{not json"}, "bad json"),
    ]:
        with pytest.raises(BadSample) as info:
            sample_caption(sample)
        assert info.value.reason == reason
    assert sample_caption({"txt": b"", "json": b'{"caption": "from json"}'}) == "from json"  # zero-byte txt: fallback
    with pytest.raises(BadSample, match="zero-byte member"):
        sample_image({"webp": b"", "txt": b"x"})


def test_periodic_summary_is_logged(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(skips_module, "SUMMARY_EVERY_S", 0.0)
    hostile = write_hostile_shards(tmp_path / "shards")
    caplog.set_level(logging.WARNING)
    loader = streaming_pass(hostile["shards"][:1])
    assert sum(len(b["keys"]) for b in loader) == 8
    summaries = [r.getMessage() for r in caplog.records if "data reader" in r.getMessage()]
    assert summaries and "skipped 7" in summaries[-1]


def test_config_min_size(tmp_path):
    assert load_config([]).data.min_size == 0
    assert load_config(["data.min_size=256"]).data.min_size == 256
    with pytest.raises(ConfigError, match="data.min_size.*>= 0"):
        load_config(["data.min_size=-1"])
    with pytest.raises(ConfigError, match="data.min_size"):
        load_config(["data.min_size=big"])
    with pytest.raises(ValueError, match="min_size >= 0"):
        make_image_text_loader(str(tmp_path), ReadSpec(resolution=RES, batch_size=1, min_size=-1))


def test_caption_without_image_is_counted_as_missing_image_by_both_readers(tmp_path, caplog):
    """A sample whose image member was never written (key.txt only) has its own reason, in both readers."""
    img = encode(Image.new("RGB", (12, 12), (5, 5, 5)), "PNG")
    shard = write_tar(tmp_path / "s.tar", [
        {"__key__": "g0", "png": img, "txt": b"good 0"},
        {"__key__": "caption-only", "txt": b"a caption whose image is missing"},
        {"__key__": "g1", "png": img, "txt": b"good 1"},
    ])
    caplog.set_level(logging.WARNING)
    stream = streaming_pass(shard)
    assert [k for b in stream for k in b["keys"]] == ["g0", "g1"]
    assert stream.dataset.stats.bad == {"missing image": 1}
    indexed = make_indexed_loader(shard, ReadSpec(resolution=RES, batch_size=1))
    epoch = list(itertools.islice(indexed, indexed.batches_per_epoch))
    assert sorted(k for b in epoch for k in b["keys"]) == ["g0", "g1", "g1"]  # caption-only replaced by g1
    assert indexed.stats.bad == {"missing image": 1}
    warnings = [r.getMessage() for r in caplog.records if "caption-only" in r.getMessage()]
    assert warnings and all("missing image" in m and "['txt']" in m for m in warnings)
    with pytest.raises(BadSample) as info:
        sample_image({"gif": img, "txt": b"x", "__key__": "k"})
    assert info.value.reason == "missing image" and "['gif', 'txt']" in str(info.value)
