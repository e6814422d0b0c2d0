"""Aspect-ratio bucketing: the bin table (data/buckets.py), image sizes in the shard index, the bucketed sampler
(single-bucket batches, equal batches per rank, exact resume, seed purity) and the loader, on real tar shards; and
a DiT forward with resolution / aspect-ratio micro-conditioning on a non-square bucket."""

from __future__ import annotations

import itertools
import json
import os
import tarfile

import numpy as np
import pytest
import torch
from diffusers import PixArtTransformer2DModel
from PIL import Image

from data.buckets import assign_buckets, bucket_sizes, nearest_bucket, resize_to_bucket
from data.decode import sample_image
from data.images import image_to_tensor, resize_center_crop, to_rgb
from data.index import INDEX_VERSION, load_or_build_index
from data.indexed import make_indexed_loader
from data.order import BucketBatchSampler
from data.read_spec import ReadSpec
from imba.training.config import ConfigError, load_config
from models.dit import build_transformer, predict
from shard_helpers import encode, write_tar

RES = 64  # base resolution: buckets (h, w) = 32x128, 48x80, 64x64, 80x48, 128x32
BATCH = 3
TABLE = [(32, 128), (48, 80), (64, 64), (80, 48), (128, 32)]

# (width, height) of the images per bucket; counts 7, 8, 12, 5, 4: 10 full batches of 3, a remainder in every
# bucket but the square one
IMAGE_SIZES = {
    (32, 128): [(128, 32), (160, 40), (300, 70)] * 2 + [(140, 36)],
    (48, 80): [(100, 60), (80, 48), (90, 50), (120, 70)] * 2,
    (64, 64): [(64, 64), (50, 52), (70, 66), (90, 88), (40, 41)] * 2 + [(64, 64), (100, 98)],
    (80, 48): [(60, 100), (48, 80), (50, 90), (70, 120), (61, 99)],
    (128, 32): [(32, 128), (40, 170), (36, 140), (70, 300)],
}


def picture(width: int, height: int, seed: int) -> Image.Image:
    """A smooth gradient plus a seeded colour, so resizing and cropping change the pixels."""
    y, x = np.mgrid[0:height, 0:width]
    rgb = np.stack([255 * x / max(width - 1, 1), 255 * y / max(height - 1, 1), np.full_like(x, 37 * seed % 256)], -1)
    return Image.fromarray(rgb.astype(np.uint8))


def keys_of(loader, n: int) -> list[list[str]]:
    return [b["keys"] for b in itertools.islice(loader, n)]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """36 samples of 5 aspect ratios over 3 shards (PNG and JPEG); returns (folder, paths, {key: (w, h)},
    {key: bucket}, {key: {ext: image bytes}})."""
    out = tmp_path_factory.mktemp("bucket_shards")
    samples, sizes, bucket_of, images = [], {}, {}, {}
    n = 0
    for bucket, dims in IMAGE_SIZES.items():
        for w, h in dims:
            key = f"s{n:03d}"
            img = picture(w, h, n)
            fmt = "JPEG" if n % 3 == 0 else "PNG"
            data = encode(img, fmt)
            images[key] = {"jpg" if fmt == "JPEG" else "png": data}
            sample = {"__key__": key, "jpg" if fmt == "JPEG" else "png": data, "txt": f"caption {key}".encode()}
            if n == 3:  # two images, written in sorted order (.jpeg before .jpg): the reader decodes the jpg,
                sample["jpeg"] = encode(picture(10, 90, 0), "JPEG")  # so the index must record the jpg's size
            samples.append(sample)
            sizes[key], bucket_of[key] = (w, h), bucket
            n += 1
    order = np.random.default_rng(0).permutation(len(samples))  # buckets mixed inside the shards
    samples = [samples[i] for i in order]
    paths = [write_tar(out / f"part-{i:06d}.tar", samples[i * 12 : (i + 1) * 12]) for i in range(3)]
    return str(out), paths, sizes, bucket_of, images


# ---------------------------------------------------------------------------------------------------------------
# the table, the nearest bucket, the resize
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("resolution,divisor", [(64, 16), (256, 16), (512, 16), (1024, 16), (1024, 64)])
def test_bucket_table_properties(resolution, divisor):
    table = bucket_sizes(resolution, divisor)
    ratios = [h / w for h, w in table]
    assert (resolution, resolution) in table and len(set(table)) == len(table)
    assert ratios == sorted(ratios) and len(set(ratios)) == len(ratios)
    assert set(table) == {(w, h) for h, w in table}  # portrait and landscape both
    for h, w in table:
        assert h % divisor == 0 and w % divisor == 0
        assert abs(h * w / resolution**2 - 1) <= 0.10, (h, w)
        assert 1 / 4 - 1e-9 <= h / w <= 4 + 1e-9
    assert min(ratios) == pytest.approx(1 / 4, rel=0.05) and max(ratios) == pytest.approx(4, rel=0.05)
    if resolution >= 256:
        assert 9 <= len(table) <= 41
    assert bucket_sizes(RES) == TABLE


def test_bucket_table_rejects_bad_arguments():
    with pytest.raises(ValueError, match="multiple of the bucket divisor 16"):
        bucket_sizes(72)
    with pytest.raises(ValueError, match="max_ratio"):
        bucket_sizes(64, max_ratio=0.5)
    assert bucket_sizes(256, max_ratio=1.0) == [(256, 256)]
    assert max(h / w for h, w in bucket_sizes(256, max_ratio=2.0)) <= 2.0


def test_nearest_bucket_by_log_aspect_ratio():
    assert nearest_bucket(200, 50, TABLE) == (32, 128)
    assert nearest_bucket(100, 60, TABLE) == (48, 80)
    assert nearest_bucket(60, 100, TABLE) == (80, 48)
    assert nearest_bucket(33, 31, TABLE) == (64, 64)
    assert nearest_bucket(5000, 10, TABLE) == (32, 128) and nearest_bucket(10, 5000, TABLE) == (128, 32)
    assert nearest_bucket(0, 0, TABLE) == (64, 64)  # unknown size: square
    # 4:3 sits between 1:1 and 5:3 in log space: log(4/3) = 0.288 vs log(5/3) - log(4/3) = 0.223
    assert nearest_bucket(400, 300, TABLE) == (48, 80)
    # agrees with the brute-force argmin of |log ratio difference| over many sizes, any table order
    rng = np.random.default_rng(1)
    w, h = rng.integers(1, 3000, 5000), rng.integers(1, 3000, 5000)
    for table in (bucket_sizes(256), bucket_sizes(256)[::-1]):
        logs = np.log([bh / bw for bh, bw in table])
        brute = np.abs(np.log(h / w)[:, None] - logs[None, :]).argmin(axis=1)
        assert np.array_equal(assign_buckets(w, h, table), brute)


def test_resize_to_bucket_covers_and_crops_the_centre():
    img = Image.new("RGB", (200, 50), (0, 0, 255))
    img.paste((255, 0, 0), (0, 0, 50, 50))  # red outer quarters
    img.paste((255, 0, 0), (150, 0, 200, 50))
    out = resize_to_bucket(img, (48, 80))
    assert out.size == (80, 48)  # PIL: (width, height)
    arr = np.asarray(out).astype(int)
    assert (arr[..., 0] < 10).all() and (arr[..., 2] > 245).all()  # scaled to 192x48: the centre 80 are blue
    tall = resize_to_bucket(picture(30, 200, 1), (128, 32))
    assert tall.size == (32, 128)
    src = picture(90, 50, 2)
    assert np.array_equal(np.asarray(resize_to_bucket(src, (64, 64))), np.asarray(resize_center_crop(src, 64)))


# ---------------------------------------------------------------------------------------------------------------
# the index records image sizes
# ---------------------------------------------------------------------------------------------------------------


def test_index_records_image_sizes_and_old_indexes_are_rebuilt(shards, tmp_path):
    folder, paths, sizes, _, _ = shards
    index = load_or_build_index(paths, index_dir=tmp_path)
    keys = [m.name.split(".")[0] for p in paths for m in tarfile.open(p).getmembers() if m.name.endswith(".txt")]
    assert index.sizes.shape == (36, 2) and index.spans.shape == (36, 2)
    assert [tuple(s) for s in index.sizes.tolist()] == [sizes[k] for k in keys]  # the jpg's size for s003
    meta = json.loads(open(index.path).read())
    assert meta["version"] == INDEX_VERSION == 2
    meta["version"] = 1  # an index written before sizes were recorded: rescanned, not trusted
    open(index.path, "w").write(json.dumps(meta))
    again = load_or_build_index(paths, index_dir=tmp_path)
    assert again.rescanned == [os.path.abspath(p) for p in paths]
    assert np.array_equal(again.sizes, index.sizes)


# ---------------------------------------------------------------------------------------------------------------
# sampler and loader
# ---------------------------------------------------------------------------------------------------------------


def test_batches_are_single_bucket_with_the_bucket_shape(shards):
    folder, _, _, bucket_of, images = shards
    loader = make_indexed_loader(folder, ReadSpec(resolution=RES, batch_size=BATCH, seed=3, bucketing=True))
    assert loader.buckets == TABLE
    counts = {b: sum(1 for k in bucket_of if bucket_of[k] == b) for b in TABLE}
    assert loader.batches_per_epoch == sum(c // BATCH for c in counts.values()) == 10
    batches = list(itertools.islice(loader, 20))  # two epochs
    for t, batch in enumerate(batches):
        size = loader.sampler.batch_indices(t).size
        assert batch["pixels"].shape == (BATCH, 3, *size) and batch["pixels"].dtype == torch.float32
        assert {bucket_of[k] for k in batch["keys"]} == {size}
        assert batch["captions"] == [f"caption {k}" for k in batch["keys"]]
    epoch_keys = [[k for b in batches[e * 10 : (e + 1) * 10] for k in b["keys"]] for e in range(2)]
    for keys in epoch_keys:
        assert len(keys) == len(set(keys)) == 30
        for bucket, count in counts.items():  # each bucket drops exactly its remainder
            assert sum(bucket_of[k] == bucket for k in keys) == count - count % BATCH
    assert epoch_keys[0] != epoch_keys[1] and {bucket_of[k] for k in epoch_keys[0]} == set(TABLE)
    # the pixels are the stored image (JPEGs drafted to cover the bucket), cover-resized and centre-cropped to it
    for batch in batches[:4]:
        for key, pixels in zip(batch["keys"], batch["pixels"]):
            h, w = bucket_of[key]
            want = image_to_tensor(resize_to_bucket(to_rgb(sample_image(images[key], (w, h))), (h, w)))
            assert torch.equal(pixels, want)
    assert loader.stats.good == 60 and loader.stats.bad == {}


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_ranks_get_equal_disjoint_single_bucket_batches(world):
    rng = np.random.default_rng(world)
    ids = rng.choice(5, size=203, p=[0.05, 0.2, 0.5, 0.2, 0.05])  # uneven buckets
    samplers = [BucketBatchSampler(ids, TABLE, 4, seed=9, rank=r, world_size=world) for r in range(world)]
    full = sum(int((ids == b).sum()) // 4 for b in range(5))
    bpe = full // world
    assert all(s.batches_per_epoch == bpe for s in samplers)
    for epoch in range(3):
        per_rank = [[s.batch_indices(epoch * bpe + k) for k in range(bpe)] for s in samplers]
        flat = [i for batches in per_rank for b in batches for i in b]
        assert len(flat) == len(set(flat)) == bpe * world * 4  # disjoint across ranks and steps
        for batches in per_rank:
            for b in batches:
                assert len(b) == 4 and len(set(ids[b])) == 1 and TABLE[ids[b[0]]] == b.size
    # the global batch order does not depend on how it is split: rank r at step k = batch k * world + r of world 1
    one = BucketBatchSampler(ids, TABLE, 4, seed=9)
    for k in range(bpe):
        for r in range(world):
            assert samplers[r].batch_indices(k) == one.batch_indices(k * world + r)
    with pytest.raises(ValueError, match="fewer than one per rank"):
        BucketBatchSampler(ids[:9], TABLE, 4, world_size=4)


def test_order_is_a_pure_function_of_the_seed():
    ids = np.random.default_rng(0).choice(5, size=120)

    def stream(seed, start=0, n=40):
        s = BucketBatchSampler(ids, TABLE, 4, seed=seed, start_batch=start)
        return [(b.size, list(b)) for b in itertools.islice(s, n)]

    assert stream(0) == stream(0)
    assert stream(0) != stream(1)
    bpe = BucketBatchSampler(ids, TABLE, 4).batches_per_epoch
    first, second = stream(0, 0, bpe), stream(0, bpe, bpe)
    assert first != second and sorted(map(str, first)) != sorted(map(str, second))  # a new cut every epoch


def test_exact_resume_across_epochs_and_ranks(shards):
    folder, *_ = shards
    args = dict(resolution=RES, batch_size=BATCH, seed=5, world_size=2, bucketing=True)
    for rank in range(2):
        loader = make_indexed_loader(folder, ReadSpec(rank=rank, **args))
        bpe = loader.batches_per_epoch
        assert bpe == 5  # 10 full batches over 2 ranks
        full = list(itertools.islice(loader, 3 * bpe + 3))  # epochs 0, 1, 2 and the start of 3
        for start in (1, bpe - 1, bpe, bpe + 1, 2 * bpe + 3):
            resumed = list(itertools.islice(make_indexed_loader(folder, ReadSpec(rank=rank, batches_done=start,
                                                                                 **args)), 3))
            assert [b["keys"] for b in resumed] == [b["keys"] for b in full[start : start + 3]], (rank, start)
            assert all(torch.equal(a["pixels"], b["pixels"]) for a, b in zip(resumed, full[start:]))


def test_workers_give_the_same_batches(shards):
    folder, *_ = shards
    args = dict(resolution=RES, batch_size=BATCH, seed=2, bucketing=True, batches_done=8)
    single = list(itertools.islice(make_indexed_loader(folder, ReadSpec(num_workers=0, **args)), 5))  # a new epoch
    two = list(itertools.islice(make_indexed_loader(folder, ReadSpec(num_workers=2, **args)), 5))
    assert [b["keys"] for b in two] == [b["keys"] for b in single]
    assert all(torch.equal(a["pixels"], b["pixels"]) for a, b in zip(single, two))


def test_unreadable_image_goes_to_the_square_bucket_and_is_substituted(tmp_path):
    good = [{"__key__": f"k{i}", "png": encode(picture(100, 60, i), "PNG"), "txt": b"wide"} for i in range(5)]
    bad = {"__key__": "k5", "jpg": b"\xff\xd8 not a jpeg", "txt": b"broken"}
    squares = [{"__key__": f"k{i}", "png": encode(picture(40, 40, i), "PNG"), "txt": b"square"} for i in (6, 7)]
    path = write_tar(tmp_path / "bad.tar", good + [bad] + squares)
    loader = make_indexed_loader(path, ReadSpec(resolution=RES, batch_size=3, bucketing=True))
    assert loader.dataset.index.sizes[5].tolist() == [0, 0]
    assert loader.sampler.counts.tolist() == [0, 5, 3, 0, 0] and loader.batches_per_epoch == 2
    for batch in itertools.islice(loader, 6):
        size = (64, 64) if "k6" in batch["keys"] or "k7" in batch["keys"] else (48, 80)
        assert batch["pixels"].shape == (3, 3, *size)
        if size == (64, 64):  # k5 is replaced by its successor k6, cut to the square
            assert sorted(batch["keys"]) == ["k6", "k6", "k7"]
    assert loader.stats.bad == {"bad image": 1}  # counted once per process


def test_bucketing_refusals(shards):
    folder, *_ = shards
    with pytest.raises(ValueError, match="set shard_window=0"):
        make_indexed_loader(folder, ReadSpec(resolution=RES, batch_size=BATCH, bucketing=True, shard_window=2))
    with pytest.raises(ValueError, match="multiple of the bucket divisor"):
        make_indexed_loader(folder, ReadSpec(resolution=72, batch_size=BATCH, bucketing=True))
    with pytest.raises(ConfigError, match="data.bucketing=true needs data.mode=indexed"):
        load_config(["data.bucketing=true", "data.mode=streaming"])
    assert load_config(["data.bucketing=true"]).data.bucketing is True


# ---------------------------------------------------------------------------------------------------------------
# the DiT gets resolution and aspect ratio for a non-square bucket
# ---------------------------------------------------------------------------------------------------------------


def test_predict_on_a_non_square_bucket_with_size_conditioning():
    torch.manual_seed(0)  # size conditioning splits the width in 3 (timestep + 2 sizes + ratio): 48 = 3 x 16
    dit = PixArtTransformer2DModel(
        num_attention_heads=3, attention_head_dim=16, in_channels=4, out_channels=4, num_layers=2,
        cross_attention_dim=48, caption_channels=24, sample_size=8, patch_size=2, use_additional_conditions=True,
    ).eval()
    b, (h, w) = 2, (48, 80)  # a 48x80 bucket: 6x10 latents with the 8x VAE
    noisy = torch.randn(b, 4, h // 8, w // 8)
    t = torch.tensor([10, 500])
    text, mask = torch.randn(b, 5, 24), torch.ones(b, 5)
    with torch.no_grad():
        out = predict(dit, noisy, t, text, mask, vae_scale_factor=8)
        assert out.shape == noisy.shape and torch.isfinite(out).all()

        def direct(resolution, aspect):
            added = {"resolution": torch.tensor([resolution] * b, dtype=torch.float32),
                     "aspect_ratio": torch.tensor([[aspect]] * b, dtype=torch.float32)}
            return dit(noisy, encoder_hidden_states=text, encoder_attention_mask=mask, timestep=t,
                       added_cond_kwargs=added, return_dict=False)[0]

        assert torch.allclose(out, direct([h, w], h / w), atol=1e-6)  # height, width in pixels; ratio h / w
        assert not torch.allclose(out, direct([w, h], w / h), atol=1e-4)  # and the conditioning matters
        # the project's presets (no size conditioning) also take non-square latents
        plain = build_transformer("tiny", sample_size=8, caption_channels=24).eval()
        assert predict(plain, noisy, t, text, mask).shape == noisy.shape


def test_a_weighted_stream_composes_with_buckets_on_any_process_count(shards, tmp_path):
    from accelerate import Accelerator

    from imba.training.inputs import make_loader, training_sources
    from imba.training.resume import StreamPosition

    folder, _, _, bucket_of, _ = shards
    cfg = load_config([f"data.resolution={RES}", f"data.batch_size={BATCH}", "data.bucketing=true",
                       "data.precompute=false", f"train.output_dir={tmp_path}", "data.epoch_samples=45",
                       f"data.sources=[{{shards: {folder}, repeat: 1}}]"])
    sources = training_sources(cfg, Accelerator(cpu=True), tmp_path)

    def batches(step, saved, rank, world, n):
        accelerator = Accelerator(cpu=True)
        accelerator.state.process_index, accelerator.state.num_processes = rank, world
        try:
            position = StreamPosition(step, step * saved * BATCH)  # `step` steps of `saved` processes
            loader = make_loader(cfg, accelerator, sources, position, None, bucket_divisor=16)
            return [(b["keys"], tuple(b["pixels"].shape[2:])) for b in itertools.islice(loader, n)]
        finally:
            accelerator.state.process_index, accelerator.state.num_processes = 0, 1

    one = batches(0, 1, 0, 1, 30)  # two epochs of 45 draws: single-bucket batches of the bucket's shape
    assert all({bucket_of[k] for k in keys} == {size} for keys, size in one)
    assert {size for _, size in one} == set(TABLE)
    two = [batches(0, 2, r, 2, 5) for r in range(2)]
    assert [two[r][t] for t in range(5) for r in range(2)] == one[:10]
    assert batches(3, 2, 0, 1, 4) == one[6:10]  # 3 steps of 2 processes, continued by one
