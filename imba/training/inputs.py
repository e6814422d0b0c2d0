"""What a run reads: its sources (data.sources, data.shards, or a synthetic set written once; with data.precompute,
their features encoded once), their loader (with data.sources or data.balance, a weighted stream drawn by the
run's draw plan; with data.balance=imba, re-weighted online by `imba.training.balancing`), and the concept buckets
the IMBA monitor labels captions with."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from pathlib import Path

from accelerate import Accelerator

from data.concepts import CaptionBucketer, collect_stats, extractor_from_stats, write_stats
from data.draw_plan import DrawPlan, entry_table, load_entry_table
from data.files import read_json_object, write_json
from data.index import ShardIndex
from data.precompute import PrecomputeSettings, precompute_shards
from data.precomputed import MANIFEST_NAME, find_manifest
from data.remote import is_indexable_remote, set_default_budget
from data.skips import NoUsableSamples, too_small_advice
from data.sources import Source, SourceMix, SourcePlace, check_same_kind, resolve_sources, safe_name
from data.stream import (PLAN_POLL_S, all_shards, caption_workers, draw_plan as stream_plan, make_stream,
                         reader_fingerprint, reader_size)
from data.urls import expand_urls, is_remote
from imba.training.balancing import OnlineBalancer, loader_lag
from imba.training.config import Config, ConfigError
from imba.training.resume import StreamPosition
from imba.training.run_folder import RunFolder

SOURCE_NAME = "source.json"  # which input shards (and their sizes and times) a features folder was encoded from


def training_sources(cfg: Config, accelerator: Accelerator, out: Path) -> list[Source]:
    """What the run reads (`DataConfig.source_kinds`: data.sources, else data.shards or the synthetic set as one
    source) resolved to their shards; a kind that writes its shards (the synthetic set) writes them once, on the
    main process, into the run folder (`RunFolder.synthetic_train` for the one source, `RunFolder.sources` for
    data.sources)."""
    d, run = cfg.data, RunFolder(out)
    set_default_budget(d.store_budget())  # a glob's listing and a precompute manifest are read within it too
    place = SourcePlace(run.sources if d.sources else run.synthetic_train, resolution=d.resolution,
                        seed=cfg.train.seed, is_main=accelerator.is_main_process, wait=accelerator.wait_for_everyone)
    if not d.sources:
        (kind,) = d.source_kinds()
        sources = [Source(kind.name, kind.resolve(place), kind=kind)]
    else:
        try:
            sources = resolve_sources(d.sources, place)
            check_same_kind(sources)
        except ValueError as err:
            raise ConfigError(str(err)) from err
    for source in sources:
        accelerator.print(f"data: {source.name}: {source.kind.describe()}{source.kind.weight()}, "
                          f"{len(source.urls)} shards")
    if d.mode != "streaming" and any(is_indexable_remote(url) for url in all_shards(sources)):
        cache = d.cache()
        accelerator.print(f"data: shards on object storage are downloaded once into {cache.folder} ("
                          + (f"data.cache_limit={d.cache_limit}: the least recently used are deleted beyond it)"
                             if cache.limit else "no data.cache_limit: kept)"))
    return sources


def precomputes(cfg: Config) -> bool:
    """Whether the run trains on features it encodes once (data.precompute; auto: the synthetic set, unless it is
    bucketed (images of many sizes) or read as a stream (data.mode=streaming asks for the streaming reader))."""
    d = cfg.data
    auto = d.synthetic() and not d.bucketing and d.mode != "streaming"
    return d.precompute == "true" or (d.precompute == "auto" and auto)


def precompute_settings(cfg: Config) -> PrecomputeSettings:
    """The precompute settings that give exactly the features this run's encoders would compute."""
    return PrecomputeSettings(**cfg.model.encoders(), encoder_dtype=cfg.model.encoder_dtype, **cfg.data.decoding())


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
    folder = RunFolder(out).features(name)
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
                          rank=accelerator.process_index, world_size=accelerator.num_processes,
                          progress=accelerator.is_main_process)
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


def precompute_sources(cfg: Config, accelerator: Accelerator, out: Path, sources: list[Source]) -> list[Source]:
    """Each source's shards encoded once (`precompute_once`): features/train/ for one source, features/train-I-NAME/
    for source I of several."""
    def folder(i: int, name: str) -> str:
        return f"train-{i}-{safe_name(name)}" if len(sources) > 1 else "train"

    return [dataclasses.replace(s, urls=precompute_once(cfg, accelerator, out, s.urls, folder(i, s.name)))
            for i, s in enumerate(sources)]


def draw_plan(cfg: Config, accelerator: Accelerator, sources: list[Source]
              ) -> tuple[DrawPlan, ShardIndex, SourceMix]:
    """The run's draw plan, index and mix of sources (`data.stream.draw_plan`), computed into
    <train.output_dir>/data/."""
    try:
        return stream_plan(cfg.data, accelerator, sources, RunFolder(cfg.train.output_dir).plan, _extractor(cfg))
    except ValueError as err:
        raise ConfigError(str(err)) from err


def _extractor(cfg: Config):
    """The concept extractor of train.concept_stats's vocabulary, or None for the default one."""
    stats = cfg.train.concept_stats
    return extractor_from_stats(stats) if stats not in ("auto", "none") else None


def online_balancer(cfg: Config, accelerator: Accelerator, sources: list[Source], patch_size: int,
                    num_train_timesteps: int) -> OnlineBalancer | None:
    """An online data.balance rule's balancer (kind imba) over the run's natural draw plan and its samples' entries
    (read once from the captions by the main process into <train.output_dir>/data/entries.npz); None for an offline
    rule."""
    d, rule = cfg.data, cfg.data.balance
    if not rule.ONLINE:
        return None
    plan, index, mix = draw_plan(cfg, accelerator, sources)
    folder, fingerprint = RunFolder(cfg.train.output_dir).plan, plan.report["fingerprint"]
    if accelerator.is_main_process:
        table = entry_table(index, folder, fingerprint, _extractor(cfg), d.caption_field,
                            workers=caption_workers(index), progress=True)
    else:  # polled, as the plan is
        while (table := load_entry_table(folder, fingerprint)) is None:
            time.sleep(PLAN_POLL_S)
    accelerator.wait_for_everyone()
    lag = loader_lag(d.num_workers, d.loader_threads, cfg.train.grad_accum)
    accelerator.print(f"data: {rule.describe()} over {len(table.entries):,} concepts and combinations (weights in "
                      f"effect {lag} steps after each refresh)")
    return OnlineBalancer(rule.build(table, natural=mix.rate), plan.units, mix.starts, plan.samples_per_epoch,
                          cfg.train.seed, every=rule.every, fraction=rule.fraction, lag=lag,
                          patch_size=patch_size, num_train_timesteps=num_train_timesteps,
                          rank=accelerator.process_index)


def make_loader(cfg: Config, accelerator: Accelerator, sources: list[Source], position: StreamPosition,
                manifest: dict | None, bucket_divisor: int, balancer: OnlineBalancer | None = None):
    """The loader of `cfg.data` (`data.stream.make_stream`), continuing at `position` (what the run consumed of the
    global stream): exactly, on any process count, for the weighted stream (data.sources, data.balance;
    data.balance=imba: `balancer`'s stream); in indexed mode at the global batch the position falls in; in streaming
    mode reseeded from it."""
    if balancer is not None:  # its stream: the natural plan, re-weighted as the run goes
        balancer.begin(position.step, position.samples, cfg.global_batch(accelerator.num_processes))
    try:
        stream = make_stream(cfg.data, accelerator, sources, seed=cfg.train.seed, samples_done=position.samples,
                             manifest=manifest, bucket_divisor=bucket_divisor,
                             plan_folder=RunFolder(cfg.train.output_dir).plan, extractor=_extractor(cfg),
                             order=balancer.order if balancer is not None else None, log=accelerator.print)
    except ValueError as err:  # settings the data cannot serve (e.g. buckets of precomputed latents)
        raise ConfigError(str(err)) from err
    if (samples := reader_size(stream.loader)) is not None:
        accelerator.print(f"data: {samples:,} samples in {len(all_shards(sources))} shards")
    if position.step and stream.epoch is not None:
        accelerator.print(f"data: the stream continues after {position.describe()}, epoch {stream.epoch:.2f}")
    elif position.step:
        accelerator.print(f"data: each rank continues after {stream.batches_done} batches of {cfg.data.batch_size}, "
                          f"at {position.describe()}")
    return stream.loader


def check_data(accelerator: Accelerator, loader, recorded: str | None) -> str | None:
    """The fingerprint of the samples `loader` reads (`data.stream.reader_fingerprint`; None for the streaming
    reader), with a line when a resumed run's differs from the one its checkpoint recorded (`recorded`): the
    position then counts in other data."""
    now = reader_fingerprint(loader)
    if recorded is not None and now is not None and now != recorded:
        accelerator.print("data: the shards or how their samples are decoded changed since the checkpoint (other "
                          "files, sizes, times or decoding settings): the stream continues at the same position, "
                          "which now holds other samples than the ones the checkpoint's run would have read next")
    return now


def concept_bucketer(cfg: Config, accelerator: Accelerator, shards: list[str], out: Path) -> CaptionBucketer | None:
    """Caption → head/torso/tail labeller for the IMBA monitor (train.concept_stats), or None when it is off."""
    path = cfg.train.concept_stats
    if path == "none" or (path == "auto" and not cfg.data.synthetic()):
        return None
    if path == "auto":  # synthetic data: count its concepts (a second or two) once, and again when it is rewritten
        path = RunFolder(out).concept_stats
        stale = not path.is_file() or path.stat().st_mtime < max(Path(s).stat().st_mtime for s in shards)
        if accelerator.is_main_process and stale:
            write_stats(collect_stats(shards), path.parent)
        accelerator.wait_for_everyone()
    return CaptionBucketer.from_stats(path)
