"""Train a PixArt-style diffusion transformer: the plain diffusion loss by default, the IMBA loss with loss.kind=imba.

    python train.py                                   # tiny CPU default: synthetic shards, random tiny T5/VAE
    python train.py --config configs/tiny.yaml loss.kind=plain train.max_steps=50
    accelerate launch --config_file launch/accelerate/zero2.yaml train.py --config configs/1b_256.yaml
    python train.py --export outputs/tiny/checkpoints/step_0000400 [EXPORT_DIR]   # any checkpoint → diffusers

Reads top to bottom: config → accelerator → shards, frozen encoders, DiT, loss, optimizer → resume → loader →
loop (noise, loss, step, EMA, validation, log, checkpoint, sample grid, pre-emption) → last grid, a diffusers
pipeline export and its model card.
The parts are built in `imba/training/`; this file is the order in which they meet.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from imba.training.config import ConfigError, dump_config, flat_dict, load_config, save_config
from imba.training.config_help import help_text

if __name__ == "__main__":  # --help and a config that does not load are answered before torch and diffusers load
    if {"-h", "--help"} & set(sys.argv[1:]):
        print(help_text())
        sys.exit(0)
    try:
        if sys.argv[1:2] != ["--export"]:
            load_config(sys.argv[1:])  # loaded again by main(): a few milliseconds
    except (ConfigError, FileNotFoundError) as err:
        sys.exit(f"error: {err}")
    # idle OpenMP threads sleep instead of spinning, which takes the cores of any other busy process on the machine
    # (bench/step_time_results.md); read once, when torch loads
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402 (from here on: what a run needs beyond its config)
from accelerate.utils import set_seed

from data.remote import StoreUnreachable
from data.skips import NoUsableSamples, reader_stats
from data.stream import all_shards
from imba.training.build import (apply_optim_settings, build_dit, build_optimizer, build_training_loss,
                                 fine_tune_source, load_features)
from imba.training.checkpoints import TrainState, newest_intact, register_state, save_checkpoint
from imba.training.clock import LoopClock
from imba.training.distributed import (check_zero3_settings, compile_prepared, configure_deepspeed, describe_world,
                                      make_accelerator, parameter_digest, run_predict, set_cpu_threads)
from imba.training.ema import make_ema
from imba.training.export import export_checkpoint, export_run
from imba.training.guard import DIVERGED_EXIT_CODE, DivergenceGuard, diverged_message
from imba.training.hooks import Hooks
from imba.training.inputs import (check_data, concept_bucketer, make_loader, online_balancer, precompute_once,
                                  precompute_sources, precomputes, training_sources)
from imba.training.metrics import ConceptBuckets, DrawLog, MetricWindow, StepLog, reduce_over_ranks
from imba.training.preemption import REQUEUE_EXIT_CODE, PreemptionHandler
from imba.training.resume import continue_stream, plan_resume, restore
from imba.training.run_folder import RunFolder
from imba.training.sampling import GridSampler, prompts_from_data
from imba.training.setting_changes import check_resumed_settings
from imba.training.step import TrainStep
from imba.training.step_batches import StepBatches
from imba.training.text_check import check_captions_readable
from imba.training.vae_check import check_vae
from imba.training.validation import Validator, validation_shards
from models.dit import apply_speed_settings
from models.lora import describe


def main(argv: list[str]) -> int:
    # ---- config and accelerator -------------------------------------------------------------------------------
    cfg = load_config(argv)
    run = RunFolder(cfg.train.output_dir)
    out = run.root
    accelerator = make_accelerator(cfg, out)
    device, is_main = accelerator.device, accelerator.is_main_process
    accelerator.print(f"world size {accelerator.num_processes} ({describe_world(accelerator)}), device {device}"
                      f"{set_cpu_threads(accelerator)}, output {out}")
    if zero3 := configure_deepspeed(accelerator, cfg.data.batch_size):
        check_zero3_settings(cfg)  # LoRA and compile: refused in one line
    set_seed(cfg.train.seed)  # identical initial weights on every rank
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = cfg.speed.tf32
    # which checkpoint, and whether this run's settings may continue it: known before any long work
    checkpoint_root = run.checkpoints
    resume = plan_resume(cfg.train.resume, checkpoint_root, accelerator)
    if resume.checkpoint is not None and (changes := check_resumed_settings(cfg, resume.checkpoint)):
        accelerator.print(changes)

    # ---- shards (written, or encoded once), frozen encoders (or precomputed features), DiT, loss, optimizer ------
    sources = training_sources(cfg, accelerator, out)  # data.sources, or data.shards / the synthetic set as one
    check_captions_readable(cfg, accelerator, sources)  # a text encoder that cannot read them learns nothing
    if not cfg.sample.prompts:  # auto on your own data: the grids show some of its captions
        cfg.sample.prompts, where = prompts_from_data(cfg, sources)
        accelerator.print(f"sample.prompts: {where}: {cfg.sample.prompts}")
    if cfg.model.pretrained and resume.checkpoint is None:
        accelerator.print(fine_tune_source(cfg))  # refused if its tokenizer is not the run's
    val_shards = validation_shards(cfg, accelerator, out)  # None: no validation
    bucketer = concept_bucketer(cfg, accelerator, all_shards(sources), out)  # on the captions of the image shards
    if precomputes(cfg):  # VAE latents and T5 states computed once, not at every step
        sources = precompute_sources(cfg, accelerator, out, sources)
        val_shards = val_shards and precompute_once(cfg, accelerator, out, val_shards, "val")
    features, manifest = load_features(cfg, all_shards(sources), device)
    dit = build_dit(cfg, features)
    accelerator.print(f"DiT: {describe(dit)}; loss: {cfg.loss.describe()}")
    objective = cfg.objective.build()
    # under ZeRO-3 every forward pass is a collective: every rank must run the same passes
    loss_fn = build_training_loss(cfg, dit.config.patch_size, same_passes_on_every_rank=zero3,
                                  num_processes=accelerator.num_processes)
    optimizer, lr_scheduler = build_optimizer(cfg, dit.parameters(), accelerator.num_processes, device)
    apply_speed_settings(dit, cfg.speed.attention, cfg.speed.gradient_checkpointing)

    # ---- checkpoint state and resume ------------------------------------------------------------------------
    wrapped, optimizer, lr_scheduler = accelerator.prepare(dit, optimizer, lr_scheduler)
    dit = accelerator.unwrap_model(wrapped)  # the bare DiT (config, EMA, no-grad passes); ZeRO-3: partitioned
    if cfg.speed.compile:  # after prepare: the graphs of the model as it trains (DDP's or DeepSpeed's hooks in place)
        compile_prepared(accelerator, wrapped, dit)
    ema = make_ema(dit.parameters(), decay=cfg.optim.ema_decay)  # ZeRO-3: each rank averages its own slice
    state = TrainState(world_size=accelerator.num_processes)
    # an online data.balance rule: sampling weights that follow the IMBA distance; its statistics resume with the run
    balancer = online_balancer(cfg, accelerator, sources, dit.config.patch_size, objective.num_train_timesteps)
    hooks = Hooks(accelerator, [balancer])  # called beside the step; those with state are checkpointed
    register_state(accelerator, ema, state, loss_fn, hooks.checkpointed())
    if resume.checkpoint is not None:
        restore(resume, accelerator, state, ema, lr_scheduler, dit)
        apply_optim_settings(cfg, lr_scheduler, ema)  # this run's optim.*, not the values the checkpoint carries
    clock = LoopClock(cfg, accelerator.num_processes, state)  # micro-batches → steps, stream position, log/save/stop
    accelerator.print(f"batch: {clock.global_batch} samples a step ({cfg.data.batch_size} per process × "
                      f"{cfg.train.grad_accum} accumulation steps × {accelerator.num_processes} processes); text "
                      f"encoder {cfg.model.text_encoder} ({cfg.model.max_text_tokens} tokens), VAE {cfg.model.vae}")
    # the samples of the global stream consumed so far: counted step by step, whatever the earlier process counts
    position = continue_stream(resume, accelerator, state, clock.global_batch)

    # ---- data ------------------------------------------------------------------------------------------------
    # the loader continues at that position (weighted stream: the same draws on any process count)
    loader = make_loader(cfg, accelerator, sources, position, manifest,
                         bucket_divisor=features.vae_scale * dit.config.patch_size, balancer=balancer)
    # each optimizer step's micro-batches, read before the step: a store that died is agreed on between steps
    batches = StepBatches(iter(loader), accelerator.gradient_accumulation_steps)
    data_stats = reader_stats(loader)  # bad samples are skipped and counted, never fatal
    state.data = check_data(accelerator, loader, state.data)  # said in a line when a resume's data changed

    # ---- loop ------------------------------------------------------------------------------------------------
    grids = GridSampler(cfg, objective, device, is_main, encoders=None if manifest else features,
                        accelerator=accelerator)
    if is_main:  # only once the run starts: a start that fails leaves no config behind
        out.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run.config)
    accelerator.init_trackers("imba-dit", config=flat_dict(cfg), init_kwargs={"wandb": {"dir": str(out)}})
    log = StepLog(accelerator, run.metrics, state.step, cfg.train.max_steps, clock.global_batch, data_stats)
    if cfg.data.record_draws:  # the sample indices each rank trains on
        hooks.add(DrawLog(run.draw_log(accelerator.process_index), state.step))
    hooks.add(ConceptBuckets(bucketer))  # the IMBA monitor per concept bucket
    hooks.add(Validator(cfg, accelerator, val_shards, features, manifest, objective, bucketer) if val_shards else None)
    hooks.add(grids)  # a sample grid every train.sample_every steps
    window = MetricWindow()
    preemption = PreemptionHandler()  # SIGUSR1/SIGTERM: finish the step, checkpoint, exit for a requeue

    def finish(exit_code: int) -> int:
        preemption.restore()  # leave the caller's signal handlers as they were (train.main may run in-process)
        accelerator.end_training()
        return exit_code

    # a non-finite loss or gradient norm skips the step on every rank; fp16: the GradScaler judges the gradients
    guard = DivergenceGuard(accelerator, cfg.train.max_bad_steps, check_grad_norm=accelerator.scaler is None)
    config_text = dump_config(cfg)  # stored in every checkpoint
    predict_fn = run_predict(wrapped, dit, features.vae_scale)  # no-grad passes bypass the DDP wrapper
    train_step = TrainStep(accelerator, wrapped, optimizer, lr_scheduler, loss_fn, predict_fn, hooks, guard,
                           cfg.optim.grad_clip)

    batches.fetch()
    check_vae(accelerator, cfg.model, features, batches.pending)  # one that cannot represent the images is said
    # before the first step: only unreadable data stops the run here (a signal is heeded after a step)
    if preemption.should_stop(accelerator, cannot_read=batches.failure is not None, heed_signal=False):
        return finish(preemption.requeue(accelerator, batches.failure, state.step, saved=False))
    while clock.running:
        for batch in batches:  # this optimizer step's micro-batches (gradient accumulation)
            latents, cond = features.encode_batch(batch, device)
            noised = objective.noise(latents)
            # loss, hooks, backward; at an accumulation's end: clip, the guard's decision, optimizer and schedule
            stats, skip = train_step(clock.next_step, batch, noised, cond, features.null_like(latents.shape[0]))
            window.add(stats)
            end = clock.micro_batch_done(accelerator.sync_gradients, skip)  # None until the optimizer stepped

        log.advance()
        step, last = end.step, end.last
        for line in hooks.step_end(step):  # e.g. the online balance's new weights, in effect a few steps on
            accelerator.print(line)
        if skip:
            accelerator.print(f"warning: step {step} skipped: non-finite loss or gradient norm "
                              f"({guard.consecutive} in a row, the run stops at {guard.max_bad_steps})")
        else:
            ema.step(dit.parameters())
        with log.paused():
            val = hooks.evaluate(step, dit, ema)  # e.g. the EMA on the fixed held-out set, every train.val_every
        if end.log or val:
            log.write(step, reduce_over_ranks(accelerator, window.means() | hooks.means()) | val | {
                "lr": lr_scheduler.get_last_lr()[0], "ema_decay": ema.cur_decay_value, "nonfinite_steps": guard.skipped})
        if not last:
            batches.fetch()  # the next step's micro-batches, so a rank that cannot read them says so now
        preempted = preemption.should_stop(accelerator, cannot_read=batches.failure is not None) and not last
        saving = end.saving(preempted)
        if diverged := guard.divergence(saving, dit, ema):  # nothing of it is saved
            accelerator.print(f"error: {diverged_message(diverged, step, newest_intact(checkpoint_root))}")
            return finish(DIVERGED_EXIT_CODE)
        with log.paused():
            if saving:
                hooks.before_save()  # e.g. every rank's observations since the last refresh, in the checkpoint
                save_checkpoint(accelerator, checkpoint_root, step, cfg.train.keep_checkpoints, config_text)
            if not last and not preempted:
                hooks.between_steps(step, dit, ema)  # e.g. a sample grid
        if preempted:
            return finish(preemption.requeue(accelerator, batches.failure, step, saved=True))
    log.close()

    print(f"rank {accelerator.process_index}/{accelerator.num_processes}: parameters {parameter_digest(dit)}"
          + (f"; data: {data_stats.summary()}" if data_stats is not None else ""))

    # ---- last grid, export: EMA weights + frozen parts as a stock diffusers pipeline folder, its model card ------
    ema_model = grids.save(dit, ema, state.step)  # a clean instance: no compile/checkpointing state
    if is_main:  # the pipeline folder, its model card, and the line that says where everything is
        export_run(run, cfg, ema_model, grids.pipeline_parts(), dit, ema, state.step, accelerator.num_processes)
    accelerator.wait_for_everyone()
    return finish(0)


if __name__ == "__main__":
    try:
        if sys.argv[1:2] == ["--export"]:  # python train.py --export CHECKPOINT [EXPORT_DIR]
            if len(sys.argv) not in (3, 4):
                raise ConfigError("usage: python train.py --export CHECKPOINT_FOLDER [EXPORT_DIR]")
            exported = export_checkpoint(Path(sys.argv[2]), sys.argv[3] if len(sys.argv) == 4 else None)
            print(f"exported the EMA weights of {sys.argv[2]} to {exported}")
            sys.exit(0)
        sys.exit(main(sys.argv[1:]))
    except (ConfigError, FileNotFoundError, NoUsableSamples) as err:
        sys.exit(f"error: {err}")
    except StoreUnreachable as err:  # the store is down at start-up, with nothing cached to read: try again later
        print(f"error: {err}", file=sys.stderr)
        sys.exit(REQUEUE_EXIT_CODE)
