"""Which settings may change when a run resumes, judged against the config stored in the checkpoint.

A resumed run continues the checkpoint's weights, optimizer, loss state and position in the data stream. A change
that gives those another meaning (the DiT's shape, what it reads, the latent space, the objective, the stream the
position counts in) is refused in one line naming each such setting with both values; a change that only decides
how long, how fast, how often or with which step size the run goes on is allowed, and printed with what it does.
Every setting is in exactly one of the two tables below (tests/test_setting_changes.py holds them to the config):
a new setting must be judged here, and until then it counts as unsafe.
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from pathlib import Path

from imba.training.checkpoints import CONFIG_FILE
from imba.training.config import KIND_SETTINGS, Config, ConfigError, flat_settings, load_config, written

# pattern -> what a change does to the resumed run
SAFE: dict[str, str] = {
    "train.max_steps": "how long the run goes on",
    "train.*_every": "how often it logs, saves, samples and validates",
    "train.keep_checkpoints": "how many checkpoints it keeps",
    "train.max_bad_steps": "when a diverging run stops",
    "train.trackers": "where it logs",
    "train.concept_stats": "what it logs",
    "train.resume": "which checkpoint it starts from",
    "train.output_dir": "where it writes",
    "data.batch_size": "the stream continues at the samples consumed",
    "train.grad_accum": "the stream continues at the samples consumed",
    "data.num_workers": "how the data is read, not what",
    "data.loader_threads": "how the data is read, not what",
    "data.record_draws": "what it logs",
    "data.val_*": "validation only",
    "optim.*": "applies from this step on; the optimizer's state keeps its shape",
    "speed.*": "how fast, not what is computed",
    "sample.*": "the grids only",
    "model.pretrained*": "unused: the weights come from the checkpoint",
    "model.encoder_dtype": "the frozen encoders' precision",
    "train.mixed_precision": "the precision of the passes (to or from fp16: refused)",
}
# pattern -> what the checkpoint holds that the change would break
BREAKING: dict[str, str] = {
    "model.preset": "the DiT's shape",
    "model.pipeline": "the DiT's shape",
    "model.text_encoder*": "what the DiT learned to read",
    "model.tokenizer_subfolder": "what the DiT learned to read",
    "model.max_text_tokens": "what the DiT learned to read",
    "model.vae*": "the latent space the DiT learned",
    "model.lora_*": "which weights train, and the adapters' shape and scale",
    "data.resolution": "the latent size the DiT learned",
    "loss.*": "the objective and the loss's state",
    "objective.*": "the objective",
    "train.seed": "the data stream the position counts in (its order and noise)",
    "data.*": "the data stream the position counts in",
}


def _judge(key: str, old, new) -> tuple[bool, str]:
    """(safe, what the change does) for one changed setting; the first matching pattern of SAFE, then BREAKING."""
    if key == "train.mixed_precision" and "fp16" in (old, new):
        return False, "the fp16 loss scaler's state"
    for table, safe in ((SAFE, True), (BREAKING, False)):
        for pattern, why in table.items():
            if fnmatchcase(key, pattern):
                return safe, why
    return False, "not known to be safe"


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
        safe, why = _judge(key, old, new)
        (allowed if safe else refused).append(f"{key} {written(old)} -> {written(new)} ({why})")
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
