"""Which settings may change when a run resumes, judged against the config stored in the checkpoint.

A resumed run continues the checkpoint's weights, optimizer, loss state and position in the data stream. Every
setting has one of three verdicts in `VERDICTS` (tests/test_setting_changes.py pins each setting's verdict, so a
new setting must be judged here, and until then it counts as refused):

- refused: the change gives what the checkpoint holds another meaning (the DiT's shape, what it reads, the latent
  space, the objective, the stream the position counts in), or the checkpoint's state would silently override it
  (the optimizer's hyperparameters and the EMA's decay are restored with their state). Named in one line with both
  values.
- allowed: the resumed run trains exactly what the uninterrupted one would; only how long, how often, where or how
  fast it goes on, or what it logs, samples or validates, changes.
- allowed with a note: the run continues where it stopped, but from this step on trains otherwise than the
  uninterrupted run would; the note says how.

Allowed changes of either kind are printed in one line with what they do.
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from pathlib import Path

from imba.training.checkpoints import CONFIG_FILE
from imba.training.config import KIND_SETTINGS, Config, ConfigError, flat_settings, load_config, written

REFUSED, ALLOWED, NOTED = "refused", "allowed", "allowed with a note"
_STREAM = "the data stream the position counts in"
_FROM_NOW = "AdamW's from this step on (its moments so far are kept)"

# setting (or a kind setting's family) -> (verdict, what the change does, or what it would break)
VERDICTS: dict[str, tuple[str, str]] = {
    # the DiT and what it reads
    "model.preset": (REFUSED, "the DiT's shape"),
    "model.pretrained": (REFUSED, "the DiT's shape and base weights, and a LoRA run's adapters' base"),
    "model.pretrained_subfolder": (REFUSED, "the DiT's shape and base weights, and a LoRA run's adapters' base"),
    "model.pipeline": (REFUSED, "the DiT's shape"),
    "model.text_encoder": (REFUSED, "what the DiT learned to read"),
    "model.text_encoder_subfolder": (REFUSED, "what the DiT learned to read"),
    "model.tokenizer_subfolder": (REFUSED, "what the DiT learned to read"),
    "model.max_text_tokens": (REFUSED, "what the DiT learned to read"),
    "model.vae": (REFUSED, "the latent space the DiT learned"),
    "model.vae_subfolder": (REFUSED, "the latent space the DiT learned"),
    "model.encoder_dtype": (NOTED, "the frozen encoders' precision: their outputs change slightly from here on"),
    "model.lora_rank": (REFUSED, "which weights train, and the adapters' shape and scale"),
    "model.lora_alpha": (REFUSED, "which weights train, and the adapters' shape and scale"),
    "model.lora_targets": (REFUSED, "which weights train, and the adapters' shape and scale"),
    # the data stream
    "data.shards": (REFUSED, _STREAM),
    "data.mode": (REFUSED, f"{_STREAM} (its reader)"),
    "data.cache_dir": (ALLOWED, "where remote shards are kept, not which"),
    "data.cache_limit": (ALLOWED, "how much of the remote shards is kept, not which"),
    "data.store_timeout": (ALLOWED, "how long a silent store is waited for"),
    "data.store_attempts": (ALLOWED, "how often a failed request to the store is tried"),
    "data.max_bad_shards": (ALLOWED, "when a run with unreadable shards stops"),
    "data.shard_window": (REFUSED, f"{_STREAM} (its order: the shards read together)"),
    "data.resolution": (REFUSED, "the latent size the DiT learned"),
    "data.batch_size": (NOTED, "the stream continues at the samples consumed; the global batch changes"),
    "data.num_workers": (NOTED, "how the data is read: the same batches, but for the streaming reader's and when "
                                "an online balance's refresh takes effect"),
    "data.loader_threads": (NOTED, "how the data is read: the same batches, but for when an online balance's "
                                   "refresh takes effect"),
    "data.shuffle_buffer": (REFUSED, _STREAM),
    "data.caption_field": (REFUSED, _STREAM),
    "data.min_size": (REFUSED, _STREAM),
    "data.bucketing": (REFUSED, _STREAM),
    "data.precompute": (REFUSED, _STREAM),
    "data.synthetic_samples": (REFUSED, _STREAM),
    "data.synthetic_dir": (REFUSED, _STREAM),
    "data.val_shards": (ALLOWED, "validation only"),
    "data.val_samples": (ALLOWED, "validation only"),
    "data.sources": (REFUSED, _STREAM),
    "data.epoch_samples": (REFUSED, _STREAM),
    "data.balance.*": (REFUSED, _STREAM),
    "data.record_draws": (ALLOWED, "what it logs"),
    # the objective
    "loss.*": (REFUSED, "the objective and the loss's state"),
    "objective.*": (REFUSED, "the objective"),
    # the optimizer: this run's values replace those its restored state carries (build.apply_optim_settings)
    "optim.lr": (NOTED, "the learning rate from this step on, at the schedule's step"),
    "optim.weight_decay": (NOTED, _FROM_NOW),
    "optim.adam_beta1": (NOTED, _FROM_NOW),
    "optim.adam_beta2": (NOTED, _FROM_NOW),
    "optim.adam_eps": (NOTED, _FROM_NOW),
    "optim.warmup_steps": (NOTED, "the warm-up from this step on (the schedule counts the steps taken)"),
    "optim.grad_clip": (NOTED, "the gradient clip from this step on"),
    "optim.ema_decay": (NOTED, "the EMA's decay from this step on (its average so far is kept)"),
    "speed.attention": (ALLOWED, "how fast, not what is computed"),
    "speed.gradient_checkpointing": (ALLOWED, "how fast, not what is computed"),
    "speed.compile": (ALLOWED, "how fast, not what is computed"),
    "speed.tf32": (ALLOWED, "how fast, not what is computed"),
    "sample.prompts": (ALLOWED, "the grids only"),
    "sample.guidance_scale": (ALLOWED, "the grids only"),
    "sample.steps": (ALLOWED, "the grids only"),
    "sample.seed": (ALLOWED, "the grids only"),
    "train.output_dir": (ALLOWED, "where it writes"),
    "train.max_steps": (ALLOWED, "how long the run goes on"),
    "train.grad_accum": (NOTED, "the stream continues at the samples consumed; the global batch changes"),
    "train.mixed_precision": (NOTED, "the precision of the passes (to or from fp16: refused)"),
    "train.seed": (REFUSED, f"{_STREAM} (its order and noise)"),
    "train.log_every": (ALLOWED, "how often it logs, saves, samples and validates"),
    "train.save_every": (ALLOWED, "how often it logs, saves, samples and validates"),
    "train.keep_checkpoints": (ALLOWED, "how many checkpoints it keeps"),
    "train.sample_every": (ALLOWED, "how often it logs, saves, samples and validates"),
    "train.val_every": (ALLOWED, "how often it logs, saves, samples and validates"),
    "train.resume": (ALLOWED, "which checkpoint it starts from"),
    "train.max_bad_steps": (ALLOWED, "when a diverging run stops"),
    "train.trackers": (ALLOWED, "where it logs"),
    "train.concept_stats": (ALLOWED, "what it logs (refused where data.balance counts by its vocabulary)"),
}


def judge(key: str, saved: Config, now: Config) -> tuple[str, str]:
    """(verdict, what the change does) of a change of setting `key` from `saved` to `now`: its entry in VERDICTS,
    where the value decides, the verdict for these values; a setting VERDICTS does not know is refused."""
    if key == "train.mixed_precision" and "fp16" in (saved.train.mixed_precision, now.train.mixed_precision):
        return REFUSED, "the fp16 loss scaler's state"
    if key == "train.concept_stats" and now.data.balance.READS_CAPTIONS:
        # the balance's entries are counted by this vocabulary: another one draws another stream
        return REFUSED, f"{_STREAM} (data.balance counts the captions' entries by its vocabulary)"
    for pattern, verdict in VERDICTS.items():
        if fnmatchcase(key, pattern):
            return verdict
    return REFUSED, "not known to be safe"


def compare_settings(saved: Config, now: Config) -> tuple[list[str], list[str]]:
    """(the refused changes, the allowed ones), each 'key old -> new (why)', in the config's order."""
    before, after = flat_settings(saved), flat_settings(now)
    # a kind setting whose kind changed is named by its kind alone: its other settings belong to the other kind
    switched = [f"{key}." for key in KIND_SETTINGS if before.get(f"{key}.kind") != after.get(f"{key}.kind")]
    refused, allowed = [], []
    for key, new in after.items():
        old = before.get(key)
        if old == new or any(key.startswith(owner) and not key.endswith(".kind") for owner in switched):
            continue
        verdict, why = judge(key, saved, now)
        (refused if verdict == REFUSED else allowed).append(f"{key} {written(old)} -> {written(new)} ({why})")
    return refused, allowed


def check_resumed_settings(cfg: Config, checkpoint: Path) -> str | None:
    """Refuse (`ConfigError`, one line) a resume whose settings break what `checkpoint` holds; else the line that
    names the allowed changes, or None when nothing changed. sample.prompts left to auto takes the checkpoint's."""
    saved = load_config(["--config", str(checkpoint / CONFIG_FILE)])
    if not cfg.sample.prompts:  # left to auto: the grids go on with the checkpoint's prompts
        cfg.sample.prompts = list(saved.sample.prompts)
    refused, allowed = compare_settings(saved, cfg)
    if refused:
        raise ConfigError(f"cannot resume {checkpoint} with changed settings: {'; '.join(refused)}. Set them back, "
                          "or start a new train.output_dir (fine-tune: model.pretrained=an export of this run)")
    return f"resuming with changed settings: {'; '.join(allowed)}" if allowed else None
