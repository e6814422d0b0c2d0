"""data.precompute=true: a run encodes its shards once, exactly as `python -m data.prep.precompute` does, and reuses
them."""

import os

import pytest
from accelerate import Accelerator

from data.precomputed import load_manifest
from data.synthetic import write_synthetic_shards
from imba.training.config import ConfigError, load_config
from imba.training.inputs import precompute_once, precompute_settings, precomputes

RUN = ["data.resolution=64", "model.vae=tiny", "model.text_encoder=tiny-words", "model.max_text_tokens=12",
       "data.precompute=true"]


def _contents(shards):
    return [open(s, "rb").read() for s in shards]


def test_a_run_encodes_its_shards_once_as_the_precompute_command_would(tmp_path):
    from data.precompute import precompute_shards

    images = write_synthetic_shards(tmp_path / "images", num_samples=12, samples_per_shard=5, resolution=64)
    cfg, accelerator = load_config(RUN), Accelerator(cpu=True)
    features = precompute_once(cfg, accelerator, tmp_path / "run", images, "train")
    assert [f.rsplit("/", 1)[1] for f in features] == [i.rsplit("/", 1)[1] for i in images]
    manifest = load_manifest(features)
    assert manifest["samples"] == 12 and manifest["text_encoder"] == "tiny-words" and manifest["max_text_tokens"] == 12
    # the same bytes as the command writes with the run's settings
    precompute_shards(images, tmp_path / "by_command", precompute_settings(cfg))
    assert _contents(features) == _contents(sorted((tmp_path / "by_command").glob("*.tar")))

    # a second start (a resume) reuses the folder as it is
    stamps = [os.stat(f).st_mtime_ns for f in features]
    again = precompute_once(cfg, accelerator, tmp_path / "run", images, "train")
    assert again == features and [os.stat(f).st_mtime_ns for f in again] == stamps

    # rewritten input shards, or other encoder settings, are encoded again
    images = write_synthetic_shards(tmp_path / "images", num_samples=7, samples_per_shard=5, resolution=64, seed=3)
    assert load_manifest(precompute_once(cfg, accelerator, tmp_path / "run", images, "train"))["samples"] == 7
    longer = load_config([*RUN, "model.max_text_tokens=20"])
    redone = precompute_once(longer, accelerator, tmp_path / "run", images, "train")
    assert load_manifest(redone)["max_text_tokens"] == 20


def test_auto_precomputes_the_synthetic_set_only():
    assert precomputes(load_config([])) and not precomputes(load_config(["data.precompute=false"]))
    assert not precomputes(load_config(["data.shards=some/shards"]))
    assert precomputes(load_config(["data.shards=some/shards", "data.precompute=true"]))
    assert not precomputes(load_config(["data.bucketing=true"]))  # the synthetic set at many sizes
    assert not precomputes(load_config(["data.mode=streaming"]))


def test_precompute_refuses_what_it_cannot_serve(tmp_path):
    with pytest.raises(ConfigError, match="data.bucketing"):
        load_config([*RUN, "data.bucketing=true"])
    images = write_synthetic_shards(tmp_path / "images", num_samples=4, resolution=64)
    cfg, accelerator = load_config(RUN), Accelerator(cpu=True)
    features = precompute_once(cfg, accelerator, tmp_path / "run", images, "train")
    with pytest.raises(ConfigError, match="already holds precomputed features"):
        precompute_once(cfg, accelerator, tmp_path / "again", features, "train")


def test_each_source_is_encoded_into_a_folder_of_its_own_and_one_source_into_train(tmp_path):
    from data.sources import Source
    from imba.training.inputs import precompute_sources

    a = write_synthetic_shards(tmp_path / "a", num_samples=4, samples_per_shard=4, resolution=64, seed=1)
    b = write_synthetic_shards(tmp_path / "b", num_samples=3, samples_per_shard=4, resolution=64, seed=2)
    cfg, accelerator = load_config(RUN), Accelerator(cpu=True)
    two = precompute_sources(cfg, accelerator, tmp_path / "run", [Source("web/x", a, share=0.5), Source("b", b)])
    assert [s.name for s in two] == ["web/x", "b"] and two[0].share == 0.5
    assert [os.path.dirname(s.urls[0]) for s in two] == [str(tmp_path / "run" / "features" / "train-0-web_x"),
                                                        str(tmp_path / "run" / "features" / "train-1-b")]
    assert load_manifest(two[1].urls)["samples"] == 3
    (one,) = precompute_sources(cfg, accelerator, tmp_path / "run", [Source("a", a)])
    assert os.path.dirname(one.urls[0]) == str(tmp_path / "run" / "features" / "train")
