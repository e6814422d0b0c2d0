"""Train a PixArt-style diffusion transformer with the IMBA loss.

    python train.py                                   # tiny CPU default: synthetic shards, random tiny T5/VAE
    python train.py --config configs/tiny.yaml loss.kind=plain train.max_steps=50
    accelerate launch --config_file launch/accelerate/zero2.yaml train.py --config configs/1b_256.yaml
    python train.py --export outputs/tiny/checkpoints/step_0000200 [EXPORT_DIR]   # any checkpoint → diffusers

Reads top to bottom: config → accelerator → frozen encoders, DiT, EMA → data → loop (noise, loss, step, EMA,
log, checkpoint, sample grid, pre-emption) → export of a diffusers pipeline folder.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs, ProjectConfiguration, set_seed
from diffusers.optimization import get_scheduler
from tqdm.auto import tqdm
from transformers.integrations import unset_hf_deepspeed_config

from data.concepts import CaptionBucketer, collect_stats, write_stats
from data.indexed import load_or_build_index, make_indexed_loader
from data.precompute import PrecomputedFeatures, find_manifest, make_precomputed_loader
from data.shards import expand_urls, is_remote, make_image_text_loader, reader_stats
from data.synthetic import write_synthetic_shards
from imba.checkpoints import (EMA_STATE_FILE, TrainState, list_checkpoints, parameter_digest,
                              prepare_world_size_change, rescale_schedule, resolve_resume, save_checkpoint,
                              saved_world_size)
from imba.config import Config, ConfigError, dump_config, flat_dict, load_config, save_config
from imba.ema import ema_weights_copy, make_ema
from imba.monitor import BucketMonitor, JsonlLogger, MetricWindow
from imba.objectives import build_objective
from imba.preemption import REQUEUE_EXIT_CODE, PreemptionHandler
from imba.step import TrainingLoss
from models.dit import apply_speed_settings, build_transformer, load_pretrained_transformer, predict
from models.pipeline import build_pipeline, export_pipeline, save_grid
from models.encoders import FrozenEncoders

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def make_accelerator(cfg: Config, out: Path) -> Accelerator:
    trackers = [] if cfg.train.trackers == "none" else [t.strip() for t in cfg.train.trackers.split(",")]
    if "tensorboard" in trackers and importlib.util.find_spec("tensorboard") is None:
        trackers.remove("tensorboard")  # accelerate's tracker needs it; skip quietly when absent
    # CPU multi-process runs (tests, debugging) need gloo, else DeepSpeed asks for oneCCL; naming a backend in a
    # single process would make accelerate expect a process group, so only when launched distributed
    distributed_cpu = not torch.cuda.is_available() and int(os.environ.get("WORLD_SIZE", "1")) > 1
    return Accelerator(
        gradient_accumulation_steps=cfg.train.grad_accum,
        mixed_precision=cfg.train.mixed_precision,
        log_with=trackers or None,
        project_config=ProjectConfiguration(project_dir=str(out), logging_dir=str(out / "logs")),
        kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")] if distributed_cpu else [],
    )


def training_shards(cfg: Config, accelerator: Accelerator, out: Path) -> list[str]:
    """The configured shards, or a synthetic shard set written once by the main process."""
    if cfg.data.shards:
        return expand_urls(cfg.data.shards)
    folder = Path(cfg.data.synthetic_dir or out / "synthetic_shards")
    if accelerator.is_main_process:
        write_synthetic_shards(folder, num_samples=cfg.data.synthetic_samples, resolution=cfg.data.resolution,
                               seed=cfg.train.seed, progress=True)
    accelerator.wait_for_everyone()
    return write_synthetic_shards(folder, num_samples=cfg.data.synthetic_samples, resolution=cfg.data.resolution,
                                  seed=cfg.train.seed)  # already complete: returns the paths without writing


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


def make_loader(cfg: Config, accelerator: Accelerator, shards: list[str], batches_done: int, manifest,
                bucket_divisor: int):
    """Indexed (exact resume: starts at the batch an uninterrupted run would draw next), over images or
    precomputed features, or streaming reader. Aspect-ratio buckets have sides divisible by `bucket_divisor`."""
    mode = "indexed" if manifest else cfg.data.mode
    if mode == "auto":
        mode = "streaming" if any(is_remote(url) for url in shards) else "indexed"
    if cfg.data.bucketing and (manifest or mode == "streaming"):
        raise ConfigError("data.bucketing=true needs local image shards (read in indexed mode): "
                          + ("precomputed latents have one fixed size" if manifest else "remote shards are streamed"))
    common = dict(resolution=cfg.data.resolution, batch_size=cfg.data.batch_size, num_workers=cfg.data.num_workers,
                  seed=cfg.train.seed, rank=accelerator.process_index, world_size=accelerator.num_processes,
                  caption_field=cfg.data.caption_field, min_size=cfg.data.min_size)
    if mode == "indexed":
        if accelerator.is_main_process:
            load_or_build_index(shards)  # scan the tars once, before every rank opens the cached index
        accelerator.wait_for_everyone()
        if manifest:
            return make_precomputed_loader(shards, cfg.data.batch_size, cfg.data.num_workers, cfg.train.seed,
                                           accelerator.process_index, accelerator.num_processes, batches_done,
                                           manifest=manifest)
        return make_indexed_loader(shards, start_batch=batches_done, bucketing=cfg.data.bucketing,
                                   bucket_divisor=bucket_divisor, **common)
    return make_image_text_loader(shards, resume_step=batches_done, shuffle_buffer=cfg.data.shuffle_buffer, **common)


def load_encoders(cfg: Config, device) -> FrozenEncoders:
    """Frozen tokenizer + T5 and VAE; weights a user names but that cannot load: one line naming the key to fix."""
    m = cfg.model
    try:
        return FrozenEncoders.load(m.text_encoder, m.vae, m.max_text_tokens, device, DTYPES[m.encoder_dtype],
                                   m.text_encoder_subfolder, m.tokenizer_subfolder, m.vae_subfolder)
    except OSError as err:
        raise ConfigError(str(err)) from err


def build_dit(cfg: Config, features) -> torch.nn.Module:
    """The DiT (a random preset, or pretrained weights) sized for the latents and text states `features` give."""
    latent_size, rest = divmod(cfg.data.resolution, features.vae_scale)
    if rest:
        raise ConfigError(f"data.resolution={cfg.data.resolution} must be a multiple of the VAE's "
                          f"downsampling factor {features.vae_scale}")
    sizes = (latent_size, features.caption_channels, features.latent_channels)
    if not cfg.model.pretrained:
        return build_transformer(cfg.model.preset, *sizes)
    try:
        return load_pretrained_transformer(cfg.model.pretrained, *sizes, cfg.model.pretrained_subfolder)
    except (OSError, ValueError) as err:
        raise ConfigError(str(err)) from err


def export_checkpoint(checkpoint: Path, export_dir: Path | None = None) -> Path:
    """The EMA weights of a checkpoint (any: single process, DDP, ZeRO-1/2/3) → a diffusers pipeline folder."""
    checkpoint = Path(checkpoint)
    if not (checkpoint / "config.yaml").is_file() or not (checkpoint / EMA_STATE_FILE).is_file():
        raise FileNotFoundError(f"{checkpoint} is not a training checkpoint (no config.yaml or EMA state)")
    cfg = load_config(["--config", str(checkpoint / "config.yaml")])
    encoders = load_encoders(cfg, "cpu")
    transformer = build_dit(cfg, encoders)
    ema = make_ema(transformer.parameters())  # saved whole in every mode (ZeRO-3's slices are gathered to save)
    ema.load_state_dict(torch.load(checkpoint / EMA_STATE_FILE, weights_only=False, map_location="cpu"))
    if any(s.shape != p.shape for s, p in zip(ema.shadow_params, transformer.parameters())):
        raise ConfigError(f"the EMA in {checkpoint} does not match the model its config.yaml describes")
    ema.copy_to(transformer.parameters())
    export_dir = Path(export_dir or checkpoint.parent.parent / f"export_{checkpoint.name}")
    scheduler = build_objective(cfg.objective.kind, **cfg.objective.kwargs()).sampling_scheduler()
    export_pipeline(build_pipeline(transformer, scheduler=scheduler, **encoders.pipeline_parts()), export_dir)
    print(f"exported the EMA weights of {checkpoint} to {export_dir}")
    return export_dir


def main(argv: list[str]) -> int:
    # ---- config and accelerator -------------------------------------------------------------------------------
    cfg = load_config(argv)
    out = Path(cfg.train.output_dir)
    accelerator = make_accelerator(cfg, out)
    device, is_main = accelerator.device, accelerator.is_main_process
    accelerator.print(f"world size {accelerator.num_processes} ({accelerator.distributed_type.value}), "
                      f"device {device}, output {out}")
    deepspeed = accelerator.state.deepspeed_plugin
    zero3 = deepspeed is not None and deepspeed.zero_stage == 3
    if zero3:  # the engine partitions the DiT in prepare; without this transformers' from_pretrained would
        unset_hf_deepspeed_config()  # partition the frozen T5 too (zero.Init), and every rank needs it whole
    set_seed(cfg.train.seed)  # identical initial weights on every rank
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = cfg.speed.tf32
    if is_main:
        out.mkdir(parents=True, exist_ok=True)
        save_config(cfg, out / "config.yaml")

    # ---- frozen encoders, the DiT, EMA -------------------------------------------------------------------------
    m = cfg.model  # precomputed shards (python -m data.precompute): neither the VAE nor T5 is loaded to train
    try:
        manifest = find_manifest(cfg.data.shards, resolution=cfg.data.resolution, max_text_tokens=m.max_text_tokens,
                                 vae=m.vae, vae_subfolder=m.vae_subfolder, text_encoder=m.text_encoder,
                                 text_encoder_subfolder=m.text_encoder_subfolder,
                                 tokenizer_subfolder=m.tokenizer_subfolder)
    except ValueError as err:  # precomputed with other encoders, resolution or text length
        raise ConfigError(str(err)) from err
    features = PrecomputedFeatures(manifest, device) if manifest else load_encoders(cfg, device)
    transformer = build_dit(cfg, features)
    objective = build_objective(cfg.objective.kind, **cfg.objective.kwargs())
    loss_fn = TrainingLoss(cfg.loss.kind, gamma=cfg.loss.gamma, lam=cfg.loss.lam,
                           patch_size=transformer.config.patch_size, distance=cfg.loss.distance,
                           reference=cfg.loss.reference, normalize=cfg.loss.normalize,
                           estimator=cfg.loss.estimator, uniform_passes=zero3)

    # ---- optimizer, schedule, checkpoint state -----------------------------------------------------------------
    optimizer = torch.optim.AdamW(transformer.parameters(), lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay,
                                  betas=(cfg.optim.adam_beta1, cfg.optim.adam_beta2), eps=cfg.optim.adam_eps)
    # accelerate steps a prepared scheduler once per process per optimizer step, hence the × num_processes.
    lr_scheduler = get_scheduler("constant_with_warmup", optimizer,
                                 num_warmup_steps=cfg.optim.warmup_steps * accelerator.num_processes)
    apply_speed_settings(transformer, cfg.speed.attention, cfg.speed.gradient_checkpointing, cfg.speed.compile)
    if deepspeed is not None:
        deepspeed.deepspeed_config["train_micro_batch_size_per_gpu"] = cfg.data.batch_size  # we batch ourselves
    checkpoint_root = out / "checkpoints"
    resume_from = load_from = resolve_resume(cfg.train.resume, checkpoint_root)
    saved_world = accelerator.num_processes
    if resume_from is not None:
        saved_world = saved_world_size(resume_from) or saved_world
        if saved_world != accelerator.num_processes:  # DDP: as is; ZeRO-1/2: its universal form; else refused
            load_from = prepare_world_size_change(resume_from, saved_world, accelerator)
    elif list_checkpoints(checkpoint_root):  # resume=none would overwrite a run's checkpoints
        raise ConfigError(f"{checkpoint_root} already holds checkpoints: resume (train.resume=latest, the default) "
                          "or pick another train.output_dir")
    transformer, optimizer, lr_scheduler = accelerator.prepare(transformer, optimizer, lr_scheduler)
    model = accelerator.unwrap_model(transformer)  # the bare DiT (config, EMA, no-grad passes); ZeRO-3: partitioned
    ema = make_ema(model.parameters(), decay=cfg.optim.ema_decay)  # ZeRO-3: each rank averages its own slice
    state = TrainState(world_size=accelerator.num_processes)
    accelerator.register_for_checkpointing(ema, state)
    if resume_from is not None:
        accelerator.load_state(str(load_from))
        ema.to(device)  # accelerate loads registered objects onto the CPU
        rescale_schedule(lr_scheduler, saved_world, accelerator.num_processes)
        digest = parameter_digest(model)  # equal to the one a run ending at that step prints: loaded intact
        accelerator.print(f"resumed from {resume_from} at step {state.step}, parameters {digest}")
    # batches each rank has consumed, rescaled when the checkpoint came from another process count: the data
    # then continues after the same number of samples (in a different order than the original run)
    batches_done = state.step * cfg.train.grad_accum * saved_world // accelerator.num_processes
    state.world_size = accelerator.num_processes

    # ---- data ------------------------------------------------------------------------------------------------
    shards = training_shards(cfg, accelerator, out)
    loader = make_loader(cfg, accelerator, shards, batches_done, manifest,
                         bucket_divisor=features.vae_scale * model.config.patch_size)
    batches = iter(loader)
    data_stats = reader_stats(loader)  # bad samples are skipped and counted, never fatal

    # ---- loop ------------------------------------------------------------------------------------------------
    encoders = None if manifest else features  # with precomputed data: loaded by the main process to sample

    def pipe_parts() -> dict:
        nonlocal encoders
        encoders = encoders or load_encoders(cfg, device)
        return dict(scheduler=objective.sampling_scheduler(), **encoders.pipeline_parts())

    def save_ema_grid(ema_model, step: int) -> None:  # a grid of the fixed prompts from the EMA weights
        save_grid(ema_model, pipe_parts(), out / "samples" / f"step_{step:07d}.png", cfg.sample.prompts,
                  cfg.data.resolution, cfg.sample.guidance_scale, cfg.sample.steps, cfg.sample.seed,
                  cfg.model.max_text_tokens)
    accelerator.init_trackers("imba-dit", config=flat_dict(cfg))
    metrics_log = JsonlLogger(out / "metrics.jsonl") if is_main else None
    window = MetricWindow()
    monitor, bucketer = BucketMonitor(), concept_bucketer(cfg, accelerator, shards, out)
    progress = tqdm(total=cfg.train.max_steps, initial=state.step, disable=not is_main, desc="train")
    images_per_step = cfg.data.batch_size * cfg.train.grad_accum * accelerator.num_processes
    window_start, window_start_step = time.perf_counter(), state.step

    preemption = PreemptionHandler()  # SIGUSR1/SIGTERM: finish the step, checkpoint, exit for a requeue
    config_text = dump_config(cfg)  # stored in every checkpoint

    def predict_fn(noisy, timesteps, embeds, mask):
        # No-grad passes (the efficient estimator's weights) bypass the DDP wrapper: its forward broadcasts buffers,
        # a collective, and ranks may differ in whether they run that pass at all.
        return predict(transformer if torch.is_grad_enabled() else model, noisy, timesteps, embeds, mask,
                       features.vae_scale)

    while state.step < cfg.train.max_steps:
        batch = next(batches)
        with accelerator.accumulate(transformer):
            latents, cond = features.features(batch, device)
            noised = objective.noise(latents)
            with accelerator.autocast():
                loss, stats = loss_fn(predict_fn, noised, cond, features.null_like(latents.shape[0]))
            accelerator.backward(loss)
            if accelerator.sync_gradients and cfg.optim.grad_clip > 0:
                stats["grad_norm"] = accelerator.clip_grad_norm_(transformer.parameters(), cfg.optim.grad_clip)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad(set_to_none=True)
        window.add(stats)
        if bucketer is not None:
            monitor.add(bucketer(batch["captions"]), stats)
        if not accelerator.sync_gradients:
            continue  # a micro-step of gradient accumulation; the optimizer has not stepped yet

        ema.step(model.parameters())
        state.step += 1
        progress.update(1)
        step = state.step
        if step % cfg.train.log_every == 0 or step == cfg.train.max_steps:
            means = window.means() | monitor.means()  # same keys, same order on every rank: one gather, NaN-aware mean over ranks
            values = accelerator.gather(torch.tensor([list(means.values())], device=device)).nanmean(dim=0)
            metrics = dict(zip(means, values.tolist()))
            elapsed = time.perf_counter() - window_start
            metrics.update(lr=lr_scheduler.get_last_lr()[0], ema_decay=ema.cur_decay_value,
                           images_per_s=images_per_step * (step - window_start_step) / elapsed)
            if data_stats is not None:
                metrics["data_skipped"] = data_stats.bad_total
            window_start, window_start_step = time.perf_counter(), step
            accelerator.log(metrics, step=step)
            if is_main:
                metrics_log.log(step, metrics)
                progress.set_postfix(loss=f"{metrics['loss']:.4f}")
        last = step == cfg.train.max_steps
        if preemption.should_stop(accelerator) and not last:
            save_checkpoint(accelerator, checkpoint_root, step, cfg.train.keep_checkpoints, config_text)
            accelerator.print(f"pre-empted: checkpoint at step {step} saved; exiting with {REQUEUE_EXIT_CODE} "
                              "so the job is requeued (it resumes from the latest checkpoint)")
            accelerator.end_training()
            return REQUEUE_EXIT_CODE
        if last or (cfg.train.save_every and step % cfg.train.save_every == 0):
            save_checkpoint(accelerator, checkpoint_root, step, cfg.train.keep_checkpoints, config_text)
            window_start, window_start_step = time.perf_counter(), step  # keep I/O out of images_per_s
        if not last and cfg.train.sample_every and step % cfg.train.sample_every == 0:
            ema_model = ema_weights_copy(model, ema, build=is_main)  # ZeRO-3: gathered from every rank
            if is_main:
                save_ema_grid(ema_model, step)
            del ema_model
            window_start, window_start_step = time.perf_counter(), step
    progress.close()

    print(f"rank {accelerator.process_index}/{accelerator.num_processes}: parameters {parameter_digest(model)}"
          + (f"; data: {data_stats.summary()}" if data_stats is not None else ""))

    # ---- last grid, export: EMA weights + frozen parts as a stock diffusers pipeline folder ------------------
    export_dir = out / "export"
    ema_model = ema_weights_copy(model, ema, build=is_main)  # a clean instance: no compile/checkpointing state
    if is_main:
        save_ema_grid(ema_model, state.step)
        export_pipeline(build_pipeline(transformer=ema_model, **pipe_parts()), export_dir)
        print(f"done: step {state.step}. outputs in {out}/: checkpoints/ (resume with --resume latest), "
              f"samples/ (grids), metrics.jsonl, config.yaml, export/ "
              f"(PixArtAlphaPipeline.from_pretrained('{export_dir}'))")
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return 0


if __name__ == "__main__":
    try:
        if sys.argv[1:2] == ["--export"]:  # python train.py --export CHECKPOINT [EXPORT_DIR]
            if len(sys.argv) not in (3, 4):
                raise ConfigError("usage: python train.py --export CHECKPOINT_FOLDER [EXPORT_DIR]")
            export_checkpoint(Path(sys.argv[2]), sys.argv[3] if len(sys.argv) == 4 else None)
            sys.exit(0)
        sys.exit(main(sys.argv[1:]))
    except (ConfigError, FileNotFoundError) as err:
        sys.exit(f"error: {err}")
