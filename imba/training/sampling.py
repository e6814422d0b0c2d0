"""The sample grids of a run: its fixed prompts (`sample.*`, by default some of the data's own captions) drawn from
the EMA weights, each labelled with its prompt, as `samples/step_*.png`, and as images in the run's TensorBoard and
W&B trackers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image

from data.sources import Source
from data.urls import expand_urls
from imba.training.build import load_encoders, load_text_encoder_alone, load_vae_alone, pipeline_kind
from imba.training.config import SYNTHETIC_PROMPTS, Config
from imba.training.ema import ema_weights_copy
from imba.training.run_folder import RunFolder
from imba.training.text_check import BYTE_TOKENS, sample_captions
from models.encoders import FrozenEncoders
from models.pipeline import encode_prompts, save_grid
from models.text_encoder import read_captions

GRID_PROMPTS = 9  # prompts taken from the data's captions: a 3 × 3 grid


def prompts_from_data(cfg: Config, sources: list[Source]) -> tuple[list[str], str]:
    """(prompts, where they come from) for sample.prompts=[] on your own data: up to `GRID_PROMPTS` distinct captions
    spread evenly over the first captions of data.val_shards, else of the training sources (shards in order); the
    synthetic set's prompts where no shard holds a caption (features precomputed without them)."""
    pools = [("data.val_shards", [expand_urls(cfg.data.val_shards)])] if cfg.data.val_shards else []
    pools.append(("the training shards", sources))
    for where, shards in pools:
        read = sample_captions(shards, cfg.data.caption_field)
        captions = list(dict.fromkeys(c.strip() for c in read if c.strip()))
        if captions:
            n, k = len(captions), min(GRID_PROMPTS, len(captions))
            picked = [captions[round(i * (n - 1) / (k - 1))] if k > 1 else captions[0] for i in range(k)]
            return picked, f"{k} caption{'s' if k > 1 else ''} of {where}"
    return list(SYNTHETIC_PROMPTS), "no shard holds a caption: the synthetic set's prompts; set sample.prompts"


# the dtype the DiT trains in (train.mixed_precision), in which a grid's copy of the EMA weights is built
TRAINING_DTYPES = {"no": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def release_cached(device) -> None:
    """Hand what was just freed on a GPU back to the driver (a no-op elsewhere): the grid's peak then shows as a
    peak, not as memory the run keeps reserved."""
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


class GridSampler:
    """Samples grids on the main process; `encoders` are the run's frozen encoders, or None when it trains on
    precomputed features.

    What a grid adds to the main process's memory lasts for that grid alone: the prompts are encoded once, here
    (with the run's T5, or, on precomputed features, a T5 loaded for that and freed at once) and kept on the CPU;
    each grid builds the EMA copy in the training dtype (train.mixed_precision) and, on precomputed features, loads
    the VAE, and frees both when the grid is written."""

    def __init__(self, cfg: Config, objective, device, is_main: bool, encoders: FrozenEncoders | None,
                 accelerator=None) -> None:
        self.cfg, self.objective, self.device, self.is_main, self.encoders = cfg, objective, device, is_main, encoders
        self.accelerator = accelerator  # its trackers get each grid
        self.pipeline = pipeline_kind(cfg)  # the export's pipeline class: the grids show what its users will get
        self.dtype = TRAINING_DTYPES[cfg.train.mixed_precision]
        self.embeddings = self.encode_prompts() if is_main else None  # sample.prompts, as the pipeline takes them

    def encode_prompts(self) -> dict[str, torch.Tensor]:
        """sample.prompts and the empty negative prompt encoded as the grid's pipeline would, on the CPU."""
        prompts, tokens = self.cfg.sample.prompts, self.cfg.model.max_text_tokens
        tokenizer, t5 = ((self.encoders.tokenizer, self.encoders.t5) if self.encoders is not None
                         else load_text_encoder_alone(self.cfg, self.device))
        if cut := read_captions(tokenizer, prompts, tokens).truncated:
            print(f"sample.prompts: {cut} of {len(prompts)} prompts are longer than model.max_text_tokens={tokens} "
                  f"tokens{BYTE_TOKENS.get(self.cfg.model.text_encoder, '')}: the grids show them cut there")
        try:
            return encode_prompts(t5, tokenizer, prompts, tokens, self.pipeline)
        finally:
            if self.encoders is None:
                del t5
                release_cached(self.device)

    def pipeline_parts(self) -> dict:
        """What `build_pipeline` needs besides the transformer, for the export: the sampling scheduler, the frozen
        parts and the pipeline kind. On precomputed features the frozen parts are loaded on the CPU in float32 (the
        export's dtype) and not kept."""
        encoders = self.encoders or load_encoders(self.cfg, "cpu", torch.float32)
        return dict(scheduler=self.objective.sampling_scheduler(), pipeline=self.pipeline, **encoders.pipeline_parts())

    def between_steps(self, step: int, model: torch.nn.Module, ema) -> None:
        """A hook (`imba.training.hooks`): a grid every train.sample_every steps (0: none; the run's last grid is
        saved at its end)."""
        every = self.cfg.train.sample_every
        if every and step % every == 0:
            self.grid(model, ema, step)

    def grid(self, model: torch.nn.Module, ema, step: int) -> None:
        """The grid of `step` from the EMA of `model`'s weights, written to the run's samples/ and its trackers.
        Every rank must call it: under ZeRO-3 the EMA is gathered from all ranks."""
        copy = ema_weights_copy(model, ema, build=self.is_main, dtype=self.dtype)
        if self.is_main:
            s, path = self.cfg.sample, RunFolder(self.cfg.train.output_dir).sample_grid(step)
            vae = self.encoders.vae if self.encoders is not None else load_vae_alone(self.cfg, self.device)
            parts = dict(vae=vae, text_encoder=None, tokenizer=None, scheduler=self.objective.sampling_scheduler(),
                         pipeline=self.pipeline)
            save_grid(copy, parts, path, s.prompts, self.cfg.data.resolution, s.guidance_scale, s.steps, s.seed,
                      self.cfg.model.max_text_tokens, self.embeddings)
            del vae, parts
            if self.accelerator is not None:
                log_grid(self.accelerator.trackers, path, step)
        del copy
        release_cached(self.device)

    def save(self, model: torch.nn.Module, ema, step: int) -> torch.nn.Module | None:
        """The run's last grid (`grid`), then the EMA copy its export holds: float32, on the CPU, on the main
        process (None elsewhere). Every rank must call it."""
        self.grid(model, ema, step)
        return ema_weights_copy(model, ema, build=self.is_main, device="cpu")


def log_grid(trackers, path: Path, step: int) -> None:
    """The grid image at `path` as the `samples` image of `step` in each tracker that shows images."""
    image = Image.open(path).convert("RGB")
    for tracker in trackers:
        if tracker.name == "tensorboard":
            tracker.log_images({"samples": np.asarray(image)[None]}, step=step, dataformats="NHWC")
        elif tracker.name == "wandb":
            tracker.log_images({"samples": [image]}, step=step)
