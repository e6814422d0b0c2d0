"""Training checkpoint → a stock diffusers pipeline folder holding its EMA weights.

    python train.py --export outputs/tiny/checkpoints/step_0000400 [EXPORT_DIR]

Works for checkpoints of every mode (single process, DDP, ZeRO-1/2/3: the EMA is saved whole in all of them). The
folder opens with `PixArtAlphaPipeline.from_pretrained(folder)` (`PixArtSigmaPipeline` for a PixArt-Σ run, see
`build.pipeline_kind`) and no code from this project. The checkpoint is
verified against its manifest first (`checkpoints.require_intact`): a damaged one is a one-line error, never an
export of corrupted weights. Checkpoints of every format are read (`checkpoints.checkpoint_format`), and config keys
that a later version renamed or dropped migrate in one line (`imba.training.migrate`). A LoRA run's export holds the
adapters merged into the pipeline's transformer, and the adapters alone in `lora/` (`export_adapter`).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from imba.training.build import build_dit, load_encoders, pipeline_kind
from imba.training.checkpoints import CONFIG_FILE, checkpoint_format, load_ema_state, require_intact
from imba.training.config import Config, ConfigError, load_config
from imba.training.ema import ema_weights_copy, make_ema
from imba.training.model_card import write_model_card
from imba.training.run_folder import RunFolder
from models.lora import has_lora, save_adapter
from models.pipeline import PIPELINES, build_pipeline, export_pipeline, is_pipeline_folder

LORA_FOLDER = "lora"  # a LoRA run's adapters in the export, beside the merged pipeline


def default_export_dir(checkpoint: Path) -> Path:
    """`<run>/export_<step>` for `<run>/checkpoints/<step>`."""
    return checkpoint.parent.parent / f"export_{checkpoint.name}"


def export_checkpoint(checkpoint: Path, export_dir: Path | None = None, checksums: bool = True) -> Path:
    """The EMA weights of `checkpoint` with the frozen parts of its run, written as a pipeline folder.
    `checksums=False` verifies the checkpoint's file names and sizes only."""
    checkpoint = require_intact(Path(checkpoint), checksums)
    checkpoint_format(checkpoint)  # a layout newer than this code: said before its config's keys are
    cfg = load_config(["--config", str(checkpoint / CONFIG_FILE)])
    encoders = load_encoders(cfg, "cpu")
    transformer = build_dit(cfg, encoders)
    ema = make_ema(transformer.parameters())
    ema.load_state_dict(load_ema_state(checkpoint))
    if any(s.shape != p.shape for s, p in zip(ema.shadow_params, transformer.parameters())):
        raise ConfigError(f"the EMA in {checkpoint} does not match the model its {CONFIG_FILE} describes")
    export_dir = Path(export_dir or default_export_dir(checkpoint))
    scheduler = cfg.objective.build().sampling_scheduler()
    export_pipeline(build_pipeline(ema_weights_copy(transformer, ema), scheduler=scheduler,
                                   pipeline=pipeline_kind(cfg), **encoders.pipeline_parts()), export_dir)
    export_adapter(export_dir, transformer, ema, cfg)
    step = load_ema_state(checkpoint)["optimization_step"]
    write_model_card(export_dir, cfg, step, grid=RunFolder(checkpoint.parent.parent).sample_grid(step))
    return export_dir


def resolved_base(pretrained: str) -> str:
    """model.pretrained as an adapter names its base: a local folder as an absolute path (a relative one means
    nothing from another working directory), a hub id as it is."""
    path = Path(pretrained).expanduser()
    return str(path.resolve()) if path.exists() else pretrained


def export_adapter(export_dir: Path, model, ema, cfg: Config) -> Path | None:
    """A LoRA run's adapters, with the EMA's weights, as a peft adapter folder `export_dir/lora` for the base model
    (model.pretrained, resolved), with the digest of the base weights the run trained on (the EMA's frozen ones:
    the checkpoint's, whatever the base folder holds now): `models.lora.load_adapter(base_transformer, folder)`
    loads it onto that base only. None without LoRA."""
    if not has_lora(model):
        return None
    m = cfg.model
    return save_adapter(model, Path(export_dir) / LORA_FOLDER, m.lora_rank, m.lora_alpha, m.lora_target_list(),
                        weights=ema.shadow_params, base=resolved_base(m.pretrained) if m.pretrained else "",
                        base_subfolder=m.pretrained_subfolder)


def export_run(run: RunFolder, cfg: Config, ema_model, pipeline_parts: dict, dit, ema, step: int,
               processes: int) -> None:
    """The end of a run, on the main process: the EMA weights with the frozen parts as a stock diffusers pipeline
    folder in the run's export/, the LoRA adapters alone (model.lora_rank), and its model card."""
    export_pipeline(build_pipeline(transformer=ema_model, **pipeline_parts), run.export)
    export_adapter(run.export, dit, ema, cfg)  # model.lora_rank: the adapters alone, in lora/
    write_model_card(run.export, cfg, step, processes, grid=run.sample_grid(step))  # the Hub's model page
    print(f"done: step {step}. outputs in {run.root}/: checkpoints/ (resume with --resume latest), samples/ (grids), "
          f"metrics.jsonl, config.yaml, export/ ({PIPELINES[pipeline_parts['pipeline']].__name__}.from_pretrained("
          f"'{run.export}'))")


def export_checkpoint_once(checkpoint: Path) -> Path:
    """`default_export_dir(checkpoint)`, exported unless a complete export is already there.

    The export goes to a temporary folder that is renamed when complete, so an existing folder with
    `model_index.json` is always a whole export (an interrupted one is redone).
    """
    checkpoint = Path(checkpoint)
    export_dir = default_export_dir(checkpoint)
    if is_pipeline_folder(export_dir):
        print(f"using the existing export {export_dir} of {checkpoint}")
        return export_dir
    tmp = export_dir.with_name(f".tmp_{export_dir.name}_{os.getpid()}")
    print(f"exporting {checkpoint} to {export_dir} ...")
    export_checkpoint(checkpoint, tmp)
    if is_pipeline_folder(export_dir):  # another process finished the same export meanwhile
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        if export_dir.exists():  # an incomplete folder of unknown origin: keep it out of the way, do not delete it
            export_dir.rename(export_dir.with_name(f"{export_dir.name}.incomplete_{os.getpid()}"))
        tmp.rename(export_dir)
    return export_dir
