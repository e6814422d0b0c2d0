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
from data.draw_plan import (DrawPlan, describe_plan, entry_table, load_entry_table, load_plan, plan_draws,
                             plan_fingerprint, plot_plan)
from data.files import read_json_object, write_json
from data.buckets import assign_buckets, bucket_sizes
from data.index import ShardIndex, load_or_build_index
from data.loaders import build_loader
from data.precompute import PrecomputeSettings, precompute_shards
from data.precomputed import MANIFEST_NAME, find_manifest
from data.skips import NoUsableSamples, too_small_advice
from data.urls import expand_urls, is_remote
from data.sources import Source, SourceMix, SourcePlace, check_same_kind, resolve_sources, safe_name
from data.weighted import StreamBatchSampler, WeightedBucketSampler, WeightedOrder
from imba.training.balancing import OnlineBalancer, loader_lag
from imba.training.config import Config, ConfigError
from imba.training.resume import StreamPosition
from imba.training.run_folder import RunFolder

SOURCE_NAME = "source.json"  # which input shards (and their sizes and times) a features folder was encoded from
PLAN_POLL_S = 1.0  # how often the other ranks look for the plan the main process is computing


def training_sources(cfg: Config, accelerator: Accelerator, out: Path) -> list[Source]:
    """What the run reads (`DataConfig.source_kinds`: data.sources, else data.shards or the synthetic set as one
    source) resolved to their shards; a kind that writes its shards (the synthetic set) writes them once, on the
    main process, into the run folder (`RunFolder.synthetic_train` for the one source, `RunFolder.sources` for
    data.sources)."""
    d, run = cfg.data, RunFolder(out)
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
        accelerator.print(f"data: {source.name}: {source.describe()}{source.kind.weight()}, {len(source.urls)} shards")
    return sources


def all_shards(sources: list[Source]) -> list[str]:
    """The sources' shards, source after source: the order of the index the loader reads."""
    return [url for source in sources for url in source.urls]


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


def precompute_sources(cfg: Config, accelerator: Accelerator, out: Path, sources: list[Source]) -> list[Source]:
    """Each source's shards encoded once (`precompute_once`): features/train/ for one source, features/train-I-NAME/
    for source I of several."""
    def folder(i: int, name: str) -> str:
        return f"train-{i}-{safe_name(name)}" if len(sources) > 1 else "train"

    return [dataclasses.replace(s, urls=precompute_once(cfg, accelerator, out, s.urls, folder(i, s.name)))
            for i, s in enumerate(sources)]


def draw_plan(cfg: Config, accelerator: Accelerator, sources: list[Source]
              ) -> tuple[DrawPlan, ShardIndex, SourceMix]:
    """The run's draw plan (data.sources shares, data.balance weights), the index and the mix of sources it is made
    for: computed by the main process into <train.output_dir>/data/ (reused while its fingerprint holds), described
    and plotted there, read by the others."""
    d, folder = cfg.data, RunFolder(cfg.train.output_dir).plan
    shards = all_shards(sources)
    with accelerator.main_process_first():
        index = load_or_build_index(shards, cache=d.cache())
    try:
        mix = SourceMix(sources, index.nsamples, d.epoch_samples)
    except ValueError as err:
        raise ConfigError(str(err)) from err
    extractor = _extractor(cfg)
    balance = d.balance.plan_rule()  # an online rule: the natural plan, which its balancer re-weights
    if accelerator.is_main_process:
        plan = plan_draws(index, mix, balance, folder, extractor=extractor, caption_field=d.caption_field,
                          progress=True, workers=_caption_workers(index))
        for line in describe_plan(plan):
            print(line)
        drawn = plot_plan(plan, folder)
        print(f"data: the draw plan is in {folder}/" + (f" (concepts drawn vs natural: {drawn})" if drawn else ""))
    else:  # polled, not a collective: reading a large set's captions may outlast a process-group timeout
        fingerprint = plan_fingerprint(index, mix, balance, extractor)
        while (plan := load_plan(folder, fingerprint)) is None:
            time.sleep(PLAN_POLL_S)
    accelerator.wait_for_everyone()
    return plan, index, mix


def _extractor(cfg: Config):
    """The concept extractor of train.concept_stats's vocabulary, or None for the default one."""
    stats = cfg.train.concept_stats
    return extractor_from_stats(stats) if stats not in ("auto", "none") else None


def _caption_workers(index: ShardIndex) -> int:
    return min(8, os.cpu_count() or 1) if len(index) > 200_000 else 1


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
                            workers=_caption_workers(index), progress=True)
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
    """The loader of `cfg.data`, continuing at `position` (what the run consumed of the global stream): exactly, on
    any process count, for the weighted stream (data.sources, data.balance; data.balance=imba: `balancer`'s stream);
    in indexed mode at the global batch the position falls in; in streaming mode reseeded from it."""
    d, world = cfg.data, accelerator.num_processes
    per_step = cfg.global_batch(world)
    step, samples = position.step, position.samples
    sampler = None
    if d.weighted():
        where = dict(rank=accelerator.process_index, world_size=world, samples_done=samples)
        if balancer is not None:  # its stream: the natural plan, re-weighted as the run goes
            balancer.begin(step, samples, per_step)
            plan = balancer.order
            sampler = StreamBatchSampler(balancer.order, d.batch_size, **where)
        elif d.bucketing:  # the bucket of each image from the sizes in the index; the plan's draws within each bucket
            plan, index, _ = draw_plan(cfg, accelerator, sources)
            buckets = bucket_sizes(d.resolution, bucket_divisor)
            # the stream of bucket batches is cut in batches of data.batch_size: after a change of it (other bucket
            # batches anyway) a position inside one starts at the next
            where["samples_done"] = -(-samples // d.batch_size) * d.batch_size
            sampler = WeightedBucketSampler(plan.units, plan.samples_per_epoch,
                                            assign_buckets(index.sizes[:, 0], index.sizes[:, 1], buckets), buckets,
                                            d.batch_size, seed=cfg.train.seed, **where)
            accelerator.print(f"data: aspect-ratio buckets, draws per epoch: {sampler.describe()}")
        else:
            plan, index, _ = draw_plan(cfg, accelerator, sources)
            order = WeightedOrder(plan.units, plan.samples_per_epoch, seed=cfg.train.seed, shard_sizes=index.nsamples,
                                  window=d.shard_window)
            sampler = StreamBatchSampler(order, d.batch_size, **where)
        if step:
            accelerator.print(f"data: the stream continues after {position.describe()}, epoch "
                              f"{where['samples_done'] / plan.samples_per_epoch:.2f}")
    # the uniform order and the stream reader count batches per rank: the global batch the position falls in
    consumed = samples // (world * d.batch_size)
    if step and not d.weighted():
        accelerator.print(f"data: each rank continues after {consumed} batches of {d.batch_size}, at "
                          f"{position.describe()}")
    shards = all_shards(sources)
    try:
        return build_loader(shards, d.mode, **d.decoding(), batch_size=d.batch_size, num_workers=d.num_workers,
                            seed=cfg.train.seed, rank=accelerator.process_index, world_size=accelerator.num_processes,
                            shuffle_buffer=d.shuffle_buffer, bucketing=d.bucketing, bucket_divisor=bucket_divisor,
                            batches_done=consumed, manifest=manifest, loader_threads=d.loader_threads,
                            main_process_first=accelerator.main_process_first, sampler=sampler, cache=d.cache(),
                            shard_window=d.shard_window)
    except ValueError as err:  # settings the data cannot serve (e.g. buckets of precomputed latents)
        raise ConfigError(str(err)) from err


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
