"""What a run reads: its shards (configured, or a synthetic set written once), their loader, and the concept
buckets the IMBA monitor labels captions with."""

from __future__ import annotations

from pathlib import Path

from accelerate import Accelerator

from data.concepts import CaptionBucketer, collect_stats, write_stats
from data.loaders import build_loader
from data.urls import expand_urls
from data.synthetic import write_synthetic_shards
from imba.training.config import Config, ConfigError


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
