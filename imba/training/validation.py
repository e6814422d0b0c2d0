"""Validation loss: the diffusion loss of the EMA weights on a fixed held-out set, every `train.val_every` steps.

The set is the first `data.val_samples` samples of `data.val_shards` in the indexed reader's seeded order (for
synthetic training without val shards: a held-out synthetic set drawn with another seed). Each sample gets its own
noise and timestep, seeded by its index, drawn once: the same set, noise and timesteps in every run with that seed,
on any number of processes, before and after a resume, so curves compare directly. Building the set draws nothing
from the training's random streams.

The loss is the conditional prediction's MSE against the objective's target, whatever `loss.kind` trains (so
plain and IMBA runs compare on one scale), reported overall (`val/loss`), per quarter of the noise level
(`val/loss_t1` least noise … `val/loss_t4` most) and per concept bucket of the captions (`val/loss_head`, …) when
the IMBA monitor has concept statistics. Each rank evaluates its share of the samples with a local copy of the EMA
weights (no collective in the forward passes, so shares may differ in size); one reduction sums them.
"""

from __future__ import annotations

import contextlib
import itertools
from pathlib import Path

import torch

from data.read_spec import ReadSpec
from data.seeds import derive_seed
from data.stream import open_loader
from data.synthetic import write_synthetic_shards
from data.urls import expand_urls
from imba.training.build import precomputed_manifest
from imba.training.config import Config, ConfigError
from imba.training.ema import ema_weights_copy
from imba.training.run_folder import RunFolder
from models.dit import predict

QUARTERS = 4
BUCKETS = ("head", "torso", "tail")


def validation_shards(cfg: Config, accelerator, out: Path) -> list[str] | None:
    """The validation shards of the run, or None when it has no validation (or no validation step)."""
    every = cfg.train.val_every
    if every == 0 or every > cfg.train.max_steps or not (cfg.data.val_shards or cfg.data.synthetic()):
        return None
    if cfg.data.val_shards:
        return expand_urls(cfg.data.val_shards)
    folder = RunFolder(out).synthetic_val
    write = dict(num_samples=cfg.data.val_samples, resolution=cfg.data.resolution,
                 seed=derive_seed("validation", cfg.train.seed) % 2**31)
    if accelerator.is_main_process:
        write_synthetic_shards(folder, **write)
    accelerator.wait_for_everyone()
    return write_synthetic_shards(folder, **write)


@contextlib.contextmanager
def _fixed_rng(device: torch.device, seed: int):
    """A block whose random draws come from `seed` and leave the caller's streams as they were."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        yield


class Validator:
    """This rank's share of the validation set, encoded and noised once; `run` gives the metrics of the EMA."""

    def __init__(self, cfg: Config, accelerator, shards: list[str], features, manifest: dict | None, objective,
                 bucketer=None) -> None:
        self.accelerator, self.batch_size, self.vae_scale = accelerator, cfg.data.batch_size, features.vae_scale
        self.every = cfg.train.val_every
        self.num_timesteps = objective.num_train_timesteps
        d = cfg.data
        val_manifest = precomputed_manifest(cfg, shards, key="data.val_shards")
        if (val_manifest is None) != (manifest is None):
            kinds = ("precomputed features", "image shards")
            raise ConfigError(f"data.val_shards must be {kinds[manifest is None]} like data.shards, not "
                              f"{kinds[val_manifest is None]}")
        try:
            loader = open_loader(shards, ReadSpec(**d.decoding(), batch_size=1, seed=cfg.train.seed), mode="indexed",
                                 manifest=val_manifest, cache=d.cache(), processes=accelerator)
        except ValueError as err:  # settings these shards cannot serve (data.min_size above every image)
            raise ConfigError(f"data.val_shards: {err}") from err
        total = min(d.val_samples, len(loader.dataset))
        rank, world, device = accelerator.process_index, accelerator.num_processes, accelerator.device
        parts, captions = [], []
        for index, batch in enumerate(itertools.islice(loader, total)):
            if index % world != rank:
                continue
            # precomputed latents are sampled from their stored distribution: seeded per sample too
            with _fixed_rng(device, derive_seed("validation/sample", cfg.train.seed, index) % 2**63):
                latents, (embeds, mask) = features.encode_batch(batch, device)
                noised = objective.noise(latents.cpu(), generator=torch.Generator().manual_seed(
                    derive_seed("validation/noise", cfg.train.seed, index) % 2**63))
            parts.append((noised, embeds, mask))
            captions.extend(batch["captions"])
        self.total = total
        self.size = len(parts)
        if parts:
            self.noisy = torch.cat([p[0].noisy for p in parts]).to(device)
            self.timesteps = torch.cat([p[0].timesteps for p in parts]).to(device)
            self.target = torch.cat([p[0].target for p in parts]).to(device)
            self.embeds = torch.cat([p[1] for p in parts])
            self.mask = torch.cat([p[2] for p in parts])
        labels = bucketer(captions) if bucketer is not None else [None] * len(captions)
        self.buckets = torch.tensor([BUCKETS.index(b) if b in BUCKETS else -1 for b in labels], dtype=torch.long)
        self.has_buckets = bucketer is not None

    def evaluate(self, step: int, dit, ema) -> dict[str, float]:
        """A hook (`imba.training.hooks`): `run`'s metrics every train.val_every steps, else {}."""
        return self.run(dit, ema) if step % self.every == 0 else {}

    @torch.no_grad()
    def run(self, dit, ema) -> dict[str, float]:
        """Validation metrics of the EMA weights; every rank must call it (one reduction, and under ZeRO-3 the EMA
        is gathered)."""
        device = self.accelerator.device
        slots = 1 + QUARTERS + len(BUCKETS)
        sums, counts = torch.zeros(slots, device=device), torch.zeros(slots, device=device)
        model = ema_weights_copy(dit, ema, build=True)
        for start in range(0, self.size, self.batch_size):
            rows = slice(start, start + self.batch_size)
            pred = predict(model, self.noisy[rows], self.timesteps[rows], self.embeds[rows], self.mask[rows],
                           self.vae_scale)
            mse = (pred.float() - self.target[rows].float()).square().mean(dim=(1, 2, 3))
            quarter = (self.timesteps[rows].float() * QUARTERS / self.num_timesteps).long().clamp(0, QUARTERS - 1)
            bucket = self.buckets[rows].to(device)
            slot_lists = [torch.zeros_like(quarter), 1 + quarter]
            if self.has_buckets:
                slot_lists.append(torch.where(bucket >= 0, 1 + QUARTERS + bucket, -1))
            for slot in slot_lists:
                keep = slot >= 0
                sums.index_add_(0, slot[keep], mse[keep])
                counts.index_add_(0, slot[keep], torch.ones_like(mse[keep]))
        del model
        totals = self.accelerator.reduce(torch.stack([sums, counts]), reduction="sum")
        means = (totals[0] / totals[1]).tolist()
        names = ["val/loss", *(f"val/loss_t{q + 1}" for q in range(QUARTERS))]
        if self.has_buckets:
            names += [f"val/loss_{b}" for b in BUCKETS]
        # a noise quarter or bucket without samples has no mean: left out, not logged as null
        return {name: mean for name, mean, count in zip(names, means, totals[1].tolist()) if count > 0}
