"""The model card of an export folder: the `README.md` the Hugging Face Hub shows as the model page.

Its YAML header holds what the Hub and diffusers read (`library_name`, `pipeline_tag`, `tags`, `base_model` when the
run fine-tuned a Hub model); the body says how to load the folder and how it was trained (data, resolution, steps,
loss and objective settings, optimiser) and shows the run's last sample grid, copied into the folder. So
`huggingface-cli upload <repo> <export folder>` publishes a usable page as it is.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import yaml

from imba.training.config import Config
from models.pipeline import PIPELINES, pipeline_kind_of

CARD_FILE = "README.md"
GRID_FILE = "samples.png"
DEFAULT_PIPELINE = "PixArtAlphaPipeline"


def _hub_id(spec: str | None) -> str | None:
    """`spec` if it names a Hub repository ("owner/name", not a folder on this machine), else None."""
    if not spec or Path(spec).exists() or spec.count("/") != 1 or spec.startswith((".", "/", "~")):
        return None
    return spec


_STAND_INS = {  # the code's own encoders for tests and the CPU default, described instead of named
    "tiny": "random tiny stand-in (`tiny`: for tests)",
    "tiny-words": "random tiny T5 over the synthetic shapes' words (`tiny-words`: the CPU default)",
    "shapes": "small VAE trained on the synthetic shapes (`shapes`: the CPU default)",
}


def _part(spec: str) -> str:
    return _STAND_INS.get(spec, f"`{spec}`")


def _data_line(cfg: Config) -> str:
    d = cfg.data
    text = "; ".join(kind.describe() + kind.weight() for kind in d.source_kinds())
    balance = d.balance.describe()
    return f"{text}, {balance}" if balance else text


def model_card(cfg: Config, step: int, processes: int | None = None, has_grid: bool = False,
               pipeline: str = DEFAULT_PIPELINE) -> str:
    """The card's text for a model trained with `cfg` for `step` optimizer steps on `processes` processes, loaded
    with the diffusers class `pipeline`."""
    base = _hub_id(cfg.model.pretrained)
    header = {
        "library_name": "diffusers",
        "pipeline_tag": "text-to-image",
        "tags": ["text-to-image", "diffusers", "pixart", "imba-dit", f"loss-{cfg.loss.KIND.replace('_', '-')}"],
    }
    if base:
        header["base_model"] = base
    batch = f"{cfg.data.batch_size} per process × {cfg.train.grad_accum} accumulation steps"
    if processes:
        batch += f" × {processes} processes = {cfg.global_batch(processes)}"
    started = f"fine-tuned from `{cfg.model.pretrained}`" if cfg.model.pretrained else (
        f"trained from scratch (preset `{cfg.model.preset}`)")
    m = cfg.model
    if m.lora_rank:
        started += (f" with LoRA (rank {m.lora_rank}, alpha {m.lora_alpha or m.lora_rank:g}, on "
                    f"{', '.join(m.lora_target_list())}), merged into these weights; the adapters alone are in "
                    "`lora/` (`peft.PeftModel.from_pretrained(base_transformer, 'lora')`; `lora/base_model.json` "
                    "holds the SHA-256 of the base weights they were trained on, which this project's "
                    "`models.lora.load_adapter` checks)")
    rows = [
        ("model", f"PixArt-style DiT, {started}"),
        ("data", _data_line(cfg)),
        ("resolution", f"{cfg.data.resolution} px" + (" (aspect-ratio buckets)" if cfg.data.bucketing else "")),
        ("steps", str(step)),
        ("batch", batch),
        ("loss", cfg.loss.describe()),
        ("objective", cfg.objective.describe()),
        ("optimiser", f"AdamW, lr {cfg.optim.lr:g}, {cfg.optim.warmup_steps} warm-up steps, weight decay "
                      f"{cfg.optim.weight_decay:g}; these weights are the EMA (decay {cfg.optim.ema_decay:g})"),
        ("text encoder", f"{_part(cfg.model.text_encoder)}, {cfg.model.max_text_tokens} tokens"),
        ("VAE", _part(cfg.model.vae)),
    ]
    lines = ["---", yaml.safe_dump(header, sort_keys=False, allow_unicode=True).strip(), "---", "",
             "# PixArt-style text-to-image DiT (IMBA-DiT)", "",
             "A stock diffusers pipeline folder: it loads without any code from the training project.", "",
             "```python", f"from diffusers import {pipeline}", "",
             f'pipe = {pipeline}.from_pretrained("<this folder or its Hub id>")',
             f'image = pipe("{(cfg.sample.prompts or ["a photo"])[0]}", height={cfg.data.resolution}, width={cfg.data.resolution}, '
             f"max_sequence_length={cfg.model.max_text_tokens}, use_resolution_binning=False).images[0]", "```", "",
             "## Training", "",
             "| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows), ""]
    if has_grid:
        lines += ["## Samples", "", f"The run's last grid (EMA weights, guidance {cfg.sample.guidance_scale:g}, "
                  f"{cfg.sample.steps} sampling steps), each image labelled with its prompt"
                  + (": " + "; ".join(f"“{p}”" for p in cfg.sample.prompts) if cfg.sample.prompts else "") + ".",
                  "", f"![samples]({GRID_FILE})", ""]
    return "\n".join(lines)


def write_model_card(folder: Path, cfg: Config, step: int, processes: int | None = None,
                     grid: Path | None = None) -> Path:
    """Write `folder/README.md` (and copy `grid`, the last sample grid, beside it when given)."""
    folder = Path(folder)
    has_grid = grid is not None and Path(grid).is_file()
    if has_grid:
        shutil.copyfile(grid, folder / GRID_FILE)
    path = folder / CARD_FILE
    # the class the export folder's model_index.json names (α for a card written apart from its export)
    pipeline = PIPELINES[pipeline_kind_of(str(folder)) or "alpha"].__name__
    path.write_text(model_card(cfg, step, processes, has_grid, pipeline), encoding="utf-8")
    return path
