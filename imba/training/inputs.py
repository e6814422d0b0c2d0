"""What a run reads: its shards (configured, or a synthetic set written once; with data.precompute, their features
encoded once), their loader, and the concept buckets the IMBA monitor labels captions with."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from accelerate import Accelerator

from data.concepts import CaptionBucketer, collect_stats, write_stats
from data.files import read_json_object, write_json
from data.loaders import build_loader
from data.precompute import PrecomputeSettings, precompute_shards
from data.precomputed import MANIFEST_NAME, find_manifest
from data.skips import NoUsableSamples, too_small_advice
from data.urls import expand_urls, is_remote
from data.synthetic import write_synthetic_shards
from imba.training.config import Config, ConfigError

FEATURES_DIR = "features"  # <train.output_dir>/features/{train,val}: data.precompute=true's encoded shards
SOURCE_NAME = "source.json"  # which input shards (and their sizes and times) a features folder was encoded from


def training_shards(cfg: Config, accelerator: Accelerator, out: Path) -> list[str]:
    """The configured shards, or a synthetic shard set written once by the main process."""
    if cfg.data.shards:
        return expand_urls(cfg.data.shards)
    folder = Path(cfg.data.synthetic_dir or out / "synthetic_shards")
    write = dict(num_samples=cfg.data.synthetic_samples, resolution=cfg.data.resolution, seed=cfg.train.seed)
    if accelerator.is_main_process:
        write_synthetic_shards(folder, progress=True, **write)
    accelerator.wait_for_everyone()
    return write_synthetic_shards(folder, **write)  # already complete: returns the paths without writing


def precomputes(cfg: Config) -> bool:
    """Whether the run trains on features it encodes once (data.precompute; auto: the synthetic set, unless it is
    bucketed (images of many sizes) or read as a stream (data.mode=streaming asks for the streaming reader))."""
    d = cfg.data
    auto = not d.shards and not d.bucketing and d.mode != "streaming"
    return d.precompute == "true" or (d.precompute == "auto" and auto)


def precompute_settings(cfg: Config) -> PrecomputeSettings:
    """The precompute settings that give exactly the features this run's encoders would compute."""
    m, d = cfg.model, cfg.data
    return PrecomputeSettings(resolution=d.resolution, vae=m.vae, vae_subfolder=m.vae_subfolder,
                              text_encoder=m.text_encoder, text_encoder_subfolder=m.text_encoder_subfolder,
                              tokenizer_subfolder=m.tokenizer_subfolder, encoder_dtype=m.encoder_dtype,
                              max_text_tokens=m.max_text_tokens, caption_field=d.caption_field, min_size=d.min_size)


def _source(shards: list[str]) -> list:
    """What identifies the input shards: each local file's path, size and modification time (a rewritten synthetic
    set, or a replaced shard, then reads as another source); a remote URL by itself."""
    if is_remote(shards[0]):
        return list(shards)
    return [[os.path.abspath(s), os.stat(s).st_size, os.stat(s).st_mtime_ns] for s in shards]


def precompute_once(cfg: Config, accelerator: Accelerator, out: Path, shards: list[str], name: str) -> list[str]:
    """`shards` encoded by the run's frozen VAE and T5 into <out>/features/<name>/ (data.precompute, `precomputes`),
    each rank taking its share of the shards; the feature shards. A folder complete for the same source and
    settings is reused as it is (a resume); one encoded from other shards or with other encoders is encoded again."""
    if find_manifest(shards) is not None:
        raise ConfigError("data.precompute=true: data.shards already holds precomputed features; set "
                          "data.precompute=false")
    folder = out / FEATURES_DIR / name
    settings = precompute_settings(cfg)
    source = {"shards": _source(shards), "settings": settings.as_dict()}
    if accelerator.is_main_process and read_json_object(folder / SOURCE_NAME) != json.loads(json.dumps(source)):
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        write_json(folder / SOURCE_NAME, source)
    accelerator.wait_for_everyone()
    if read_json_object(folder / MANIFEST_NAME) is None:
        accelerator.print(f"data.precompute: encoding {len(shards)} shards once with the frozen VAE and T5 -> {folder}")
    try:
        precompute_shards(shards, folder, settings, batch_size=32, device=accelerator.device,
                          rank=accelerator.process_index, world_size=accelerator.num_processes)
    except (OSError, ValueError, NoUsableSamples) as err:
        # encoders that cannot load, a resolution the VAE cannot encode, shards with nothing usable in them
        raise ConfigError(f"data.precompute: {str(err).splitlines()[0]}") from err
    accelerator.wait_for_everyone()  # the last rank to finish has written the manifest
    manifest = read_json_object(folder / MANIFEST_NAME) or {}
    if manifest.get("samples") == 0:  # fewer bad samples than the readers' give-up count, but not one good
        skipped = manifest.get("skipped") or {}
        advice = too_small_advice(skipped) or "check the shards, the image format and data.caption_field"
        raise ConfigError(f"data.precompute: no usable sample in {len(shards)} shards (skipped: {skipped}); {advice}")
    return expand_urls(str(folder))


def make_loader(cfg: Config, accelerator: Accelerator, shards: list[str], batches_done: int, manifest: dict | None,
                bucket_divisor: int):
    """The loader of `cfg.data`, continuing after `batches_done` batches of this rank (exact in indexed mode)."""
    d = cfg.data
    try:
        return build_loader(shards, d.mode, resolution=d.resolution, batch_size=d.batch_size,
                            num_workers=d.num_workers, seed=cfg.train.seed, rank=accelerator.process_index,
                            world_size=accelerator.num_processes, caption_field=d.caption_field, min_size=d.min_size,
                            shuffle_buffer=d.shuffle_buffer, bucketing=d.bucketing, bucket_divisor=bucket_divisor,
                            batches_done=batches_done, manifest=manifest, loader_threads=d.loader_threads,
                            main_process_first=accelerator.main_process_first)
    except ValueError as err:  # settings the data cannot serve (e.g. buckets of precomputed latents)
        raise ConfigError(str(err)) from err


def concept_bucketer(cfg: Config, accelerator: Accelerator, shards: list[str], out: Path) -> CaptionBucketer | None:
    """Caption → head/torso/tail labeller for the IMBA monitor (train.concept_stats), or None when it is off."""
    path = cfg.train.concept_stats
    if path == "none" or (path == "auto" and cfg.data.shards):
        return None
    if path == "auto":  # synthetic data: count its concepts (a second or two) once, and again when it is rewritten
        path = out / "concepts" / "concepts.json"
        stale = not path.is_file() or path.stat().st_mtime < max(Path(s).stat().st_mtime for s in shards)
        if accelerator.is_main_process and stale:
            write_stats(collect_stats(shards), path.parent)
        accelerator.wait_for_everyone()
    return CaptionBucketer.from_stats(path)
