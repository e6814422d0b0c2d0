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
from imba.training.build import load_encoders, pipeline_kind
from imba.training.config import SYNTHETIC_PROMPTS, Config
from imba.training.ema import ema_weights_copy
from imba.training.run_folder import RunFolder
from imba.training.text_check import sample_captions
from models.encoders import FrozenEncoders
from models.pipeline import save_grid

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


class GridSampler:
    """Samples grids on the main process; `encoders` are the run's frozen encoders, or None when it trains on
    precomputed features (they are then loaded on first use, by the main process only)."""

    def __init__(self, cfg: Config, objective, device, is_main: bool, encoders: FrozenEncoders | None,
                 accelerator=None) -> None:
        self.cfg, self.objective, self.device, self.is_main, self.encoders = cfg, objective, device, is_main, encoders
        self.accelerator = accelerator  # its trackers get each grid
        self.pipeline = pipeline_kind(cfg)  # the export's pipeline class: the grids show what its users will get

    def pipeline_parts(self) -> dict:
        """What `build_pipeline` needs besides the transformer: the sampling scheduler, the frozen parts and the
        pipeline kind."""
        self.encoders = self.encoders or load_encoders(self.cfg, self.device)
        return dict(scheduler=self.objective.sampling_scheduler(), pipeline=self.pipeline,
                    **self.encoders.pipeline_parts())

    def between_steps(self, step: int, model: torch.nn.Module, ema) -> None:
        """A hook (`imba.training.hooks`): a grid every train.sample_every steps (0: none; the run's last grid is
        saved at its end)."""
        every = self.cfg.train.sample_every
        if every and step % every == 0:
            self.save(model, ema, step)

    def save(self, model: torch.nn.Module, ema, step: int) -> torch.nn.Module | None:
        """The grid of `step` from the EMA of `model`'s weights; returns the EMA copy on the main process (None
        elsewhere). Every rank must call it: under ZeRO-3 the EMA is gathered from all ranks."""
        ema_model = ema_weights_copy(model, ema, build=self.is_main)
        if self.is_main:
            s, path = self.cfg.sample, RunFolder(self.cfg.train.output_dir).sample_grid(step)
            save_grid(ema_model, self.pipeline_parts(), path, s.prompts, self.cfg.data.resolution, s.guidance_scale,
                      s.steps, s.seed, self.cfg.model.max_text_tokens)
            if self.accelerator is not None:
                log_grid(self.accelerator.trackers, path, step)
        return ema_model


def log_grid(trackers, path: Path, step: int) -> None:
    """The grid image at `path` as the `samples` image of `step` in each tracker that shows images."""
    image = Image.open(path).convert("RGB")
    for tracker in trackers:
        if tracker.name == "tensorboard":
            tracker.log_images({"samples": np.asarray(image)[None]}, step=step, dataformats="NHWC")
        elif tracker.name == "wandb":
            tracker.log_images({"samples": [image]}, step=step)
