"""`precompute_once` reuses a features folder only for the same source and settings: the same shard paths with new
content are encoded again (what a rewritten synthetic set looks like), and every precompute setting is taken from
the run's config, spelled out here rather than computed by the function under test."""

import os
import tarfile

from accelerate import Accelerator

from data.precompute_settings import PrecomputeSettings
from data.precomputed import PrecomputedShards, load_manifest
from data.synthetic import write_synthetic_shards
from imba.training.config import load_config
from imba.training.inputs import _source, precompute_once, precompute_settings

RUN = ["data.resolution=32", "model.vae=tiny", "model.text_encoder=tiny-words", "model.max_text_tokens=12",
       "data.precompute=true"]


def _captions(shards):
    ds = PrecomputedShards(shards)
    return sorted((ds[i]["key"], ds[i]["caption"]) for i in range(len(ds)))


def _image_captions(shards):
    out = []
    for shard in shards:
        with tarfile.open(shard) as tar:
            for member in tar.getmembers():
                if member.name.endswith(".txt"):
                    out.append((member.name[:-4], tar.extractfile(member).read().decode().strip()))
    return sorted(out)


def test_the_same_shard_paths_with_new_content_are_encoded_again(tmp_path):
    cfg, accelerator = load_config(RUN), Accelerator(cpu=True)
    images = write_synthetic_shards(tmp_path / "images", num_samples=4, samples_per_shard=2, resolution=32, seed=0)
    features = precompute_once(cfg, accelerator, tmp_path / "run", images, "train")
    first = _image_captions(images)
    assert _captions(features) == first
    rewritten = write_synthetic_shards(tmp_path / "images", num_samples=4, samples_per_shard=2, resolution=32,
                                       seed=1)
    assert rewritten == images and _image_captions(rewritten) != first
    again = precompute_once(cfg, accelerator, tmp_path / "run", rewritten, "train")
    assert again == features  # the same folder and shard names, holding the new shards' features
    assert _captions(again) == _image_captions(rewritten)


def test_every_precompute_setting_comes_from_its_config_key(tmp_path):
    cfg = load_config(["data.resolution=48", "model.vae=some/vae", "model.vae_subfolder=vae_dir",
                       "model.text_encoder=some/t5", "model.text_encoder_subfolder=t5_dir",
                       "model.tokenizer_subfolder=tok_dir", "model.encoder_dtype=bfloat16",
                       "model.max_text_tokens=33", "data.caption_field=alt_text", "data.min_size=17"])
    assert precompute_settings(cfg) == PrecomputeSettings(
        resolution=48, vae="some/vae", vae_subfolder="vae_dir", text_encoder="some/t5",
        text_encoder_subfolder="t5_dir", tokenizer_subfolder="tok_dir", encoder_dtype="bfloat16",
        max_text_tokens=33, caption_field="alt_text", min_size=17)


def test_a_changed_setting_alone_encodes_again_with_it(tmp_path):
    accelerator = Accelerator(cpu=True)
    images = write_synthetic_shards(tmp_path / "images", num_samples=2, samples_per_shard=2, resolution=32)
    precompute_once(load_config(RUN), accelerator, tmp_path / "run", images, "train")
    # every image is 32 px: a minimum of 8 keeps them all, yet the settings differ, so the features are redone
    redone = precompute_once(load_config([*RUN, "data.min_size=8"]), accelerator, tmp_path / "run", images, "train")
    manifest = load_manifest(redone)
    assert manifest["min_size"] == 8 and manifest["samples"] == 2


def test_the_source_is_each_local_shards_path_size_and_time_and_a_remote_url_itself(tmp_path, monkeypatch):
    shard = tmp_path / "a.tar"
    shard.write_bytes(b"x" * 100)
    os.utime(shard, ns=(1, 2_000_000_000))
    assert _source([str(shard)]) == [[str(shard), 100, 2_000_000_000]]
    shard.write_bytes(b"y" * 100)  # the same size, rewritten
    os.utime(shard, ns=(1, 3_000_000_000))
    assert _source([str(shard)]) == [[str(shard), 100, 3_000_000_000]]
    monkeypatch.chdir(tmp_path)
    assert _source(["a.tar"])[0][0] == str(shard)  # an absolute path: another working folder is the same source
    urls = ["https://host/s-000.tar", "https://host/s-001.tar"]
    assert _source(urls) == urls
