"""data/: synthetic shards, shard specs, image helpers and the streaming image-text loader, on real tar files."""

from __future__ import annotations

import collections
import io
import itertools
import json
import os
import pathlib
import tarfile

import numpy as np
import pytest
import torch
from PIL import Image

from shard_helpers import encode, write_tar
from data.decode import sample_caption
from data.images import image_to_tensor, resize_center_crop
from data.read_spec import ReadSpec
from data.streaming import make_image_text_loader
from data.urls import expand_urls
from data.synthetic import (COLOUR_RGB, COLOURS, P_TWO_OBJECTS, SAMPLE_PROMPTS, SHAPES, caption_for,
                            write_synthetic_shards)


# ---------------------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------------------


def tar_members(path) -> dict[str, bytes]:
    with tarfile.open(path) as tf:
        return {m.name: tf.extractfile(m).read() for m in tf.getmembers()}


def read_samples(paths) -> dict[str, dict]:
    """key -> {"png": bytes, "txt": str, "json": dict} over all shards."""
    out: dict[str, dict] = collections.defaultdict(dict)
    for path in paths:
        for name, data in tar_members(path).items():
            key, ext = name.split(".", 1)
            out[key][ext] = json.loads(data) if ext == "json" else data.decode() if ext == "txt" else data
    return dict(out)


def parse_caption(caption: str) -> list[tuple[str, str]]:
    """"a red circle and an orange star" -> [("red", "circle"), ("orange", "star")]."""
    pairs = []
    for part in caption.split(" and "):
        article, colour, shape = part.split(" ")
        assert article == ("an" if colour[0] in "aeiou" else "a"), caption
        pairs.append((colour, shape))
    return pairs


def first_keys(loader, n_batches: int) -> list[list[str]]:
    return [b["keys"] for b in itertools.islice(loader, n_batches)]


def colour_img(size, rgb, mode="RGB") -> Image.Image:
    return Image.new("RGB", size, rgb).convert(mode)


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    out = tmp_path_factory.mktemp("synth")
    paths = write_synthetic_shards(str(out), num_samples=120, samples_per_shard=40, resolution=32, seed=0)
    return out, paths


# ---------------------------------------------------------------------------------------------------------------
# synthetic shards
# ---------------------------------------------------------------------------------------------------------------


def test_synthetic_layout_and_determinism(tmp_path, synth):
    _, paths = synth
    assert [os.path.basename(p) for p in paths] == [f"synthetic-{i:06d}.tar" for i in range(3)]
    again = write_synthetic_shards(tmp_path / "again", num_samples=120, samples_per_shard=40, resolution=32, seed=0)
    for a, b in zip(paths, again):
        ma, mb = tar_members(a), tar_members(b)
        assert list(ma) == list(mb)
        assert all(ma[name] == mb[name] for name in ma)
        assert pathlib.Path(a).read_bytes() == pathlib.Path(b).read_bytes()  # fixed mtime: whole tar identical
    names = list(tar_members(paths[0]))
    assert names[:3] == ["000000000.json", "000000000.png", "000000000.txt"]
    assert len(names) == 3 * 40
    assert len(read_samples(paths)) == 120

    other = write_synthetic_shards(tmp_path / "seed1", num_samples=120, samples_per_shard=40, resolution=32, seed=1)
    captions0 = [s["txt"] for s in read_samples(paths).values()]
    captions1 = [s["txt"] for s in read_samples(other).values()]
    assert captions0 != captions1


def test_synthetic_is_long_tailed(tmp_path):
    paths = write_synthetic_shards(str(tmp_path), num_samples=600, samples_per_shard=300, resolution=8, seed=3)
    shapes, colours = collections.Counter(), collections.Counter()
    counts = collections.Counter()
    for s in read_samples(paths).values():
        counts[len(s["json"]["objects"])] += 1
        for o in s["json"]["objects"]:
            shapes[o["shape"]] += 1
            colours[o["colour"]] += 1
    assert set(counts) == {1, 2} and abs(counts[2] / 600 - P_TWO_OBJECTS) < 0.06  # one- and two-object images
    assert set(shapes) == set(SHAPES) and set(colours) == set(COLOURS)  # every concept occurs ...
    assert shapes.most_common(1)[0][0] == SHAPES[0] and colours.most_common(1)[0][0] == COLOURS[0]
    assert max(shapes.values()) > 5 * min(shapes.values())  # ... but with a long tail
    assert max(colours.values()) > 5 * min(colours.values())


def test_synthetic_captions_name_exactly_the_json_objects(synth):
    _, paths = synth
    for key, s in read_samples(paths).items():
        meta, caption = s["json"], s["txt"]
        assert meta["caption"] == caption and meta["key"] == key
        objects = meta["objects"]
        assert 1 <= len(objects) <= 2
        assert parse_caption(caption) == [(o["colour"], o["shape"]) for o in objects]
        assert caption == caption_for(objects)
        img = np.asarray(Image.open(io.BytesIO(s["png"])).convert("RGB")).astype(int)
        assert img.shape == (32, 32, 3)
        boxes = [o["bbox"] for o in objects]
        if len(boxes) == 2:  # non-overlapping
            a, b = boxes
            assert a[2] <= b[0] or b[2] <= a[0] or a[3] <= b[1] or b[3] <= a[1], (key, boxes)
        for o in objects:  # the named colour is drawn inside the object's box
            x0, y0, x1, y1 = o["bbox"]
            patch = img[y0:y1, x0:x1]
            close = np.abs(patch - np.array(COLOUR_RGB[o["colour"]])).max(axis=-1) <= 40
            assert close.sum() >= 3, (key, o)


def test_synthetic_reuse_rewrite_and_stale_shards(tmp_path):
    out = tmp_path / "s"
    paths = write_synthetic_shards(str(out), num_samples=30, samples_per_shard=10, resolution=16, seed=0)
    mtimes = [os.stat(p).st_mtime_ns for p in paths]
    manifest = json.loads((out / "synthetic.json").read_text())
    assert manifest["num_samples"] == 30 and len(manifest["shards"]) == 3

    assert write_synthetic_shards(out, num_samples=30, samples_per_shard=10, resolution=16, seed=0) == paths  # Path ok
    assert [os.stat(p).st_mtime_ns for p in paths] == mtimes  # complete folder: nothing rewritten

    (out / "synthetic.json").unlink()  # incomplete folder (no manifest): rewritten
    assert write_synthetic_shards(str(out), num_samples=30, samples_per_shard=10, resolution=16, seed=0) == paths
    assert (out / "synthetic.json").exists()

    fewer = write_synthetic_shards(str(out), num_samples=15, samples_per_shard=10, resolution=16, seed=0)
    assert [os.path.basename(p) for p in fewer] == ["synthetic-000000.tar", "synthetic-000001.tar"]
    assert expand_urls(str(out)) == fewer  # the stale third shard is gone
    assert sorted(os.listdir(out)) == ["synthetic-000000.tar", "synthetic-000001.tar", "synthetic.json"]


def test_sample_prompts_use_the_vocabulary():
    assert len(SAMPLE_PROMPTS) >= 6
    pairs = [p for prompt in SAMPLE_PROMPTS for p in parse_caption(prompt)]
    assert all(c in COLOURS and s in SHAPES for c, s in pairs)
    assert (COLOURS[-1], SHAPES[-1]) in pairs  # the rarest pair is among them
    assert any(" and " in p for p in SAMPLE_PROMPTS)


# ---------------------------------------------------------------------------------------------------------------
# shard specs
# ---------------------------------------------------------------------------------------------------------------


def test_expand_urls(tmp_path):
    d = tmp_path / "shards"
    d.mkdir()
    files = [str(d / f"part-{i:06d}.tar") for i in range(4)]
    for f in reversed(files):
        write_tar(f, [{"__key__": "k", "txt": b"x"}])
    (d / "notes.txt").write_text("not a shard")

    assert expand_urls(str(d / "part-{000000..000003}.tar")) == files
    assert expand_urls(str(d / "part-{000001..000002}.tar")) == files[1:3]
    assert expand_urls(str(d / "*.tar")) == files
    assert expand_urls(str(d)) == files
    assert expand_urls(d) == files  # PathLike
    assert expand_urls([files[2], str(d / "part-00000[01].tar")]) == [files[2]] + files[:2]
    remote = ["pipe:curl -s https://x/y-000.tar", "https://host/a.tar", "s3://b/c.tar", "gs://b/d.tar"]
    assert expand_urls(remote) == remote
    assert expand_urls("https://host/p-{0..2}.tar") == [f"https://host/p-{i}.tar" for i in range(3)]

    for spec in [str(tmp_path / "nope-*.tar"), str(tmp_path / "missing.tar"), str(tmp_path / "p-{0..3}.tar")]:
        with pytest.raises(FileNotFoundError) as info:
            expand_urls(spec)
        assert spec in str(info.value) and "\n" not in str(info.value)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="empty"):
        expand_urls(str(empty))
    with pytest.raises(FileNotFoundError, match="missing"):  # part of a range missing: fail early, not mid-run
        expand_urls(str(d / "part-{000000..000009}.tar"))


# ---------------------------------------------------------------------------------------------------------------
# image helpers
# ---------------------------------------------------------------------------------------------------------------


def stripes(w: int, h: int, horizontal: bool) -> Image.Image:
    """Three equal stripes red | green | blue along the long side."""
    arr = np.zeros((h, w, 3), np.uint8)
    n = w if horizontal else h
    for i, c in enumerate([(255, 0, 0), (0, 255, 0), (0, 0, 255)]):
        sl = slice(i * n // 3, (i + 1) * n // 3)
        if horizontal:
            arr[:, sl] = c
        else:
            arr[sl, :] = c
    return Image.fromarray(arr)


@pytest.mark.parametrize("w,h,size", [(300, 100, 64), (100, 300, 64), (30, 10, 64), (64, 64, 64), (257, 129, 32)])
def test_resize_center_crop_sizes_and_keeps_the_centre(w, h, size):
    img = stripes(w, h, horizontal=w >= h)
    out = resize_center_crop(img, size)
    assert out.size == (size, size) and out.mode == "RGB"
    arr = np.asarray(out).astype(int)
    if max(w, h) >= 3 * min(w, h) - 1:  # the crop sits inside the middle (green) stripe
        inner = arr[4:-4, 4:-4]
        assert (np.abs(inner - [0, 255, 0]).max(axis=-1) < 30).all()


def test_image_to_tensor_modes_and_range():
    t = image_to_tensor(colour_img((5, 3), (255, 255, 255)))
    assert t.shape == (3, 3, 5) and t.dtype == torch.float32
    assert torch.equal(t, torch.ones_like(t))
    assert torch.equal(image_to_tensor(colour_img((4, 4), (0, 0, 0))), -torch.ones(3, 4, 4))
    red = image_to_tensor(colour_img((4, 4), (255, 0, 0)))
    assert torch.equal(red[0], torch.ones(4, 4)) and torch.equal(red[1:], -torch.ones(2, 4, 4))
    grey = image_to_tensor(Image.new("L", (4, 2), 128))
    assert grey.shape == (3, 2, 4) and torch.allclose(grey, torch.full_like(grey, 128 / 127.5 - 1), atol=1e-6)
    transparent = image_to_tensor(Image.new("RGBA", (4, 4), (255, 0, 0, 0)))  # over white
    assert torch.equal(transparent, torch.ones(3, 4, 4))
    opaque = image_to_tensor(Image.new("RGBA", (4, 4), (255, 0, 0, 255)))
    assert torch.equal(opaque, red)
    pal = image_to_tensor(colour_img((4, 4), (255, 0, 0)).convert("P"))
    assert torch.equal(pal, red)
    rnd = image_to_tensor(Image.fromarray(np.random.default_rng(0).integers(0, 256, (16, 16, 3), dtype=np.uint8)))
    assert rnd.min() >= -1 and rnd.max() <= 1


# ---------------------------------------------------------------------------------------------------------------
# loader
# ---------------------------------------------------------------------------------------------------------------


def test_loader_batches_match_the_shards(synth):
    out, paths = synth
    samples = read_samples(paths)
    loader = make_image_text_loader(str(out), ReadSpec(resolution=16, batch_size=6, seed=0, shuffle_buffer=50))
    for batch in itertools.islice(loader, 5):
        assert set(batch) == {"pixels", "captions", "keys"}
        px = batch["pixels"]
        assert px.shape == (6, 3, 16, 16) and px.dtype == torch.float32
        assert px.min() >= -1 and px.max() <= 1 and px.max() > 0.5  # light background
        assert len(batch["captions"]) == len(batch["keys"]) == 6
        for i, (key, caption) in enumerate(zip(batch["keys"], batch["captions"])):
            assert caption == samples[key]["txt"]
            expected = image_to_tensor(resize_center_crop(Image.open(io.BytesIO(samples[key]["png"])), 16))
            assert torch.equal(px[i], expected)  # pixels, caption and key belong to the same sample


def test_loader_captions_from_txt_or_json_and_image_formats(tmp_path):
    big = stripes(90, 30, horizontal=True)  # centre crop = green
    green = np.array([0, 255, 0])
    samples = [
        {"__key__": "a-jpg", "jpg": encode(big, "JPEG"), "txt": b"from txt jpg"},
        {"__key__": "b-png", "png": encode(big, "PNG"), "json": json.dumps({"caption": "from json png"}).encode()},
        {"__key__": "c-webp", "webp": encode(big, "WEBP"), "txt": b"  ", "json": b'{"caption": "json when txt empty"}'},
        {"__key__": "d-jpeg", "jpeg": encode(big.rotate(90, expand=True), "JPEG"), "txt": "non-ascii café".encode()},
        {"__key__": "e-rgba", "png": encode(big.convert("RGBA"), "PNG"), "txt": b"rgba"},
        {"__key__": "f-grey", "png": encode(Image.new("L", (40, 20), 0), "PNG"), "txt": b"grey"},
        {"__key__": "g-pal", "png": encode(big.convert("P"), "PNG"), "txt": b"palette"},
    ]
    shard = write_tar(tmp_path / "mixed.tar", samples)
    loader = make_image_text_loader(shard, ReadSpec(resolution=16, batch_size=4, seed=1, shuffle_buffer=10))
    seen: dict[str, tuple[str, torch.Tensor]] = {}
    for batch in itertools.islice(loader, 20):
        for key, caption, px in zip(batch["keys"], batch["captions"], batch["pixels"]):
            seen[key] = (caption, px)
    assert {k: c for k, (c, _) in seen.items()} == {
        "a-jpg": "from txt jpg",
        "b-png": "from json png",
        "c-webp": "json when txt empty",
        "d-jpeg": "non-ascii café",
        "e-rgba": "rgba",
        "f-grey": "grey",
        "g-pal": "palette",
    }
    for key in ["a-jpg", "b-png", "c-webp", "d-jpeg", "e-rgba", "g-pal"]:
        rgb = (seen[key][1].permute(1, 2, 0)[4:-4, 4:-4] + 1) * 127.5
        assert (np.abs(rgb.numpy() - green).max(axis=-1) < 40).all(), key
    assert torch.equal(seen["f-grey"][1], -torch.ones(3, 16, 16))


def test_sample_caption_field_is_configurable():
    s = {"json": b'{"caption": "", "re_caption": "long caption"}'}
    assert sample_caption(s) == ""
    assert sample_caption(s, caption_field="re_caption") == "long caption"
    assert sample_caption({"txt": b" t ", "json": b'{"caption": "j"}'}) == "t"


def test_loader_caption_field(tmp_path):
    img = encode(Image.new("RGB", (8, 8), (1, 2, 3)), "PNG")
    metas = [json.dumps({"caption": "", "alt": f"alt {i}"}).encode() for i in range(3)]
    shard = write_tar(tmp_path / "cf.tar", [{"__key__": f"k{i}", "png": img, "json": m} for i, m in enumerate(metas)])
    loader = make_image_text_loader(shard, ReadSpec(resolution=8, batch_size=3, caption_field="alt", shuffle_buffer=0))
    batch = next(iter(loader))
    assert all(c == "alt " + k[1:] for k, c in zip(batch["keys"], batch["captions"]))


def test_loader_seeding(synth):
    out, _ = synth

    def keys(n=4, **kw):
        args = dict(resolution=8, batch_size=5, seed=0, rank=0, world_size=2, batches_done=0, shuffle_buffer=30)
        args.update(kw)
        return first_keys(make_image_text_loader(str(out), ReadSpec(**args)), n)

    base = keys()
    assert keys() == base  # same arguments, fresh loader: same stream
    assert keys(rank=1) != base
    assert keys(batches_done=1000) != base
    assert keys(seed=1) != base
    assert keys(rank=1) == keys(rank=1)
    with pytest.raises(ValueError, match="rank 2"):
        keys(rank=2)


def test_loader_workers_get_distinct_reproducible_streams(synth):
    out, _ = synth
    args = dict(resolution=8, batch_size=4, seed=5, shuffle_buffer=30)
    single = first_keys(make_image_text_loader(str(out), ReadSpec(num_workers=0, **args)), 3)
    two = first_keys(make_image_text_loader(str(out), ReadSpec(num_workers=2, **args)), 6)
    assert two == first_keys(make_image_text_loader(str(out), ReadSpec(num_workers=2, **args)), 6)
    # the DataLoader alternates workers; worker 0 is seeded exactly like the in-process reader (worker id 0)
    assert two[0::2] == single
    assert two[1::2] != two[0::2]


def test_loader_skips_bad_samples_and_shards(tmp_path):
    good_img = encode(Image.new("RGB", (12, 10), (200, 10, 10)), "JPEG")
    png = encode(Image.new("RGB", (12, 10), (10, 200, 10)), "PNG")
    bad = {
        "bad-bytes": {"jpg": b"definitely not a jpeg", "txt": b"corrupt image"},
        "bad-truncated": {"png": png[: len(png) // 2], "txt": b"truncated png"},
        "bad-empty": {"jpg": good_img, "txt": b"   "},
        "bad-nocaption": {"jpg": good_img},
        "bad-jsonempty": {"jpg": good_img, "json": b'{"caption": ""}'},
        "bad-badjson": {"jpg": good_img, "json": b"{not json"},
        "bad-noimage": {"txt": b"caption but no image", "json": b'{"caption": "x"}'},
        "bad-otherext": {"gif": good_img, "txt": b"unsupported extension"},
    }
    samples = []
    for i, key in enumerate(bad):  # good and bad samples interleaved in one shard
        samples.append({"__key__": f"good-{i}", "jpg": good_img, "txt": f"good {i}".encode()})
        samples.append({"__key__": key, **bad[key]})
    shard = write_tar(tmp_path / "dirty.tar", samples)
    clean = write_tar(tmp_path / "clean.tar", [{"__key__": "clean-0", "png": png, "txt": b"clean"}])
    full = (tmp_path / "clean.tar").read_bytes()
    truncated = tmp_path / "truncated.tar"
    truncated.write_bytes(full[: len(full) - 700])  # cut inside the archive
    garbage = tmp_path / "garbage.tar"
    garbage.write_bytes(b"\x00not a tar at all" * 50)

    shards = [shard, clean, str(truncated), str(garbage)]
    loader = make_image_text_loader(shards, ReadSpec(resolution=8, batch_size=4, shuffle_buffer=20))
    seen = collections.Counter()
    for batch in itertools.islice(loader, 40):
        seen.update(batch["keys"])
        assert all(c.strip() for c in batch["captions"])
    assert not set(seen) & set(bad)
    assert {f"good-{i}" for i in range(len(bad))} | {"clean-0"} <= set(seen)
    stats = loader.dataset.stats  # in-process reader (num_workers=0): its counters are visible here
    assert stats.good >= sum(seen.values())
    assert stats.bad.get("bad image", 0) > 0 and stats.bad.get("missing or empty caption", 0) > 0
    assert stats.shard_errors > 0


def test_loader_with_nothing_usable_fails_with_one_line(tmp_path):
    shard = write_tar(tmp_path / "allbad.tar", [{"__key__": f"k{i}", "jpg": b"junk", "txt": b"c"} for i in range(20)])
    loader = make_image_text_loader(shard, ReadSpec(resolution=8, batch_size=2, shuffle_buffer=0))
    with pytest.raises(RuntimeError, match="no usable sample") as info:
        next(iter(loader))
    assert "allbad.tar" in str(info.value) and "\n" not in str(info.value)
