"""The `data` section of the training config: what a run reads and how (the readers, the synthetic set, the
sources and their balance), with its choices, ranges and checks (a config section, as `models/settings.py` says).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from .balance import BALANCE_METHODS, BalanceSettings
from .sources import SourceConfig, check_source_configs


@dataclass
class DataConfig:
    shards: str | None = None  # brace/glob pattern, folder or URL of img2dataset tar shards; None = synthetic
    # auto: indexed for local shards, streaming for remote URLs. indexed: exact resume, equal batches per rank.
    # streaming: webdataset with resampled shards (pipe:/http/s3, or sets too large to index)
    mode: str = "auto"
    resolution: int = 128  # images are resized and centre-cropped to this square size
    batch_size: int = 32  # per process, per micro-step
    num_workers: int = 0
    # precomputed features only, with num_workers=0: threads of the training process that make the batches ahead
    # of the step, in memory recycled from batch to batch (bench/README.md#at-the-real-models-sizes)
    loader_threads: int = 0
    shuffle_buffer: int = 1000
    caption_field: str = "caption"  # field of key.json used when a sample has no key.txt
    min_size: int = 0  # skip images whose shorter side is below this (pixels; "image too small"); 0 = off
    # aspect-ratio buckets around resolution² pixels (1:4 .. 4:1, sides multiples of 16; data/buckets.py): each batch
    # is one bucket's (h, w). Image shards in indexed mode only (not streaming, not precomputed features)
    bucketing: bool = False
    # true: encode the training and validation images once with the frozen VAE and T5 (`python -m data.precompute`'s
    # format, in <train.output_dir>/features/; reused on resume, redone when the shards or encoders change) and
    # train on the stored features, with no encoder pass per step: for sets read many times (the synthetic set,
    # small fine-tuning sets). auto: true for the synthetic set (unless bucketed or streamed), false for data.shards
    # (large sets: run data.precompute once and point data.shards at its output). false: encode every batch
    precompute: str = "auto"
    synthetic_samples: int = 2000  # size of the synthetic shard set written when shards is None
    synthetic_dir: str | None = None  # where it is written; None = <train.output_dir>/synthetic_shards
    # validation set (train.val_every): shards of the same kind as `shards` (images, or precomputed features); None
    # = a held-out synthetic set (other seed) for synthetic training, no validation for data.shards
    val_shards: str | None = None
    val_samples: int = 64  # the first N samples of the validation shards' seeded order, split over the ranks
    # several shard sets read as one, instead of data.shards: a list of {shards, name, share | repeat | choose}
    # (data/sources.py, docs/data.md#mixing-sources-and-balancing-concepts); drawn by the weighted stream (exact
    # resume on any process count)
    sources: list[SourceConfig] = field(default_factory=list)
    epoch_samples: int = 0  # draws per epoch with data.sources or data.balance; 0 = the samples of the sources
    # sampling weights from the captions' concepts (data/balance.py): none | temperature (weight = count of the
    # sample's rarest concept or combination ^ -balance_alpha) | cap (MetaCLIP: entries above balance_cap drawn less)
    # | imba (online: the temperature prior, each rarity group's draws moved by the model's IMBA distance where it
    # separates the group from the average row beyond noise, data/online_balance.py)
    balance: str = "none"
    # temperature, and imba's prior: 0 = natural, 1 = every rarest entry drawn about equally often
    balance_alpha: float = 0.5
    balance_cap: int = 0  # cap: the threshold count t (MetaCLIP: 20000 for 400M captions)
    balance_every: int = 100  # imba: steps between refreshes of the groups' multipliers
    # imba with the plain loss: share of each batch's rows scored by a no-grad unconditional pass (the IMBA loss
    # scores every row itself, at no extra cost)
    balance_fraction: float = 0.125
    balance_groups: int = 4  # imba: bands of equal width in log(count of the rarest entry), each moved as one
    balance_max: float = 4.0  # imba: a group is drawn between 1/balance_max and balance_max times its prior
    # imba: a group whose distance ratio exceeds the average row's by e beyond noise targets (1 + e) ** balance_rate
    # times its prior
    balance_rate: float = 4.0
    # true: each rank writes the sample indices of every batch it trains on to <train.output_dir>/draws/rank_R.jsonl
    # ({"step": s, "indices": [...]} a micro-batch, in order; a resume keeps the rows up to its checkpoint): what
    # the model was trained on, to audit a mix, a balance or a resume. Indexed reading only (samples have an index)
    record_draws: bool = False

    CHOICES: ClassVar[dict] = {"mode": ("auto", "indexed", "streaming"), "precompute": ("auto", "true", "false"),
                               "balance": (*BALANCE_METHODS, "imba")}
    RANGES: ClassVar[dict] = {
        "resolution": ">= 1",
        "batch_size": ">= 1",
        "num_workers": ">= 0 (0 = read in the training process)",
        "loader_threads": ">= 0 (0 = no reader threads)",
        "shuffle_buffer": ">= 0 (0 = no shuffle buffer)",
        "min_size": ">= 0 (0 = no minimum)",
        "synthetic_samples": ">= 1",
        "val_samples": ">= 1",
        "epoch_samples": ">= 0 (0 = the samples of the sources)",
        "balance_alpha": ">= 0",
        "balance_cap": ">= 0 (0 = not set)",
        "balance_every": ">= 1",
        "balance_groups": ">= 1",
        "balance_fraction": "in (0, 1]",
        "balance_max": ">= 1 (1 = the prior)",
        "balance_rate": "> 0",
    }

    def synthetic(self) -> bool:
        """Whether the run trains on the synthetic set (neither data.shards nor data.sources)."""
        return not self.shards and not self.sources

    def weighted(self) -> bool:
        """Whether the run reads the weighted stream (data.sources or data.balance) rather than the plain order."""
        return bool(self.sources) or self.balance != "none"

    def decoding(self) -> dict:
        """What turns a shard's record into a training sample, as keywords of `data.loaders.build_loader` and
        `PrecomputeSettings`: the image size, where the caption is, which images are skipped as too small."""
        return dict(resolution=self.resolution, caption_field=self.caption_field, min_size=self.min_size)

    def describe_balance(self) -> str:
        """How the draws are balanced, as the model card states it ("" for none). A rule without a line here is a
        KeyError, never another rule's line."""
        return {
            "none": "",
            "temperature": f"balanced by concepts (temperature, alpha {self.balance_alpha:g})",
            "cap": f"balanced by concepts (cap {self.balance_cap})",
            "imba": (f"balanced online by the IMBA distance (the temperature prior, alpha {self.balance_alpha:g}, "
                     f"{self.balance_groups} rarity groups each moved within {self.balance_max:g}x of it, every "
                     f"{self.balance_every} steps)"),
        }[self.balance]

    def balance_settings(self) -> BalanceSettings:
        """The offline balance rule the draw plan applies (data.balance=imba's plan is the natural one: its
        balance moves online)."""
        if self.balance == "imba":
            return BalanceSettings()
        return BalanceSettings(self.balance, self.balance_alpha, self.balance_cap)

    def check(self) -> None:
        """A one-line ValueError for settings that cannot go together."""
        if self.precompute == "true" and self.bucketing:
            raise ValueError("data.precompute=true stores one resolution: it cannot serve data.bucketing=true; set "
                             "one of them to false")
        if self.record_draws and self.mode == "streaming":
            raise ValueError("data.record_draws=true needs indexed reading: the streaming reader's samples have no "
                             "index; set data.mode=indexed (local shards) or data.record_draws=false")
        if self.bucketing and self.mode == "streaming":
            raise ValueError("data.bucketing=true needs data.mode=indexed (or auto with local shards): the streaming "
                             "reader has no image sizes to bucket by; set data.bucketing=false or use local shards")
        if self.shards and self.sources:
            raise ValueError("give data.shards or data.sources, not both (a single shard set is one source)")
        check_source_configs(self.sources)
        self.balance_settings().check()
        if self.balance == "imba" and self.bucketing:
            raise ValueError("data.balance=imba does not draw aspect-ratio buckets yet: set data.bucketing=false, or "
                             "balance offline (data.balance=temperature or cap)")
        if self.weighted() and self.mode == "streaming":
            raise ValueError("data.sources and data.balance need indexed reading (local shards): the streaming "
                             "reader cannot draw by weight and resume exactly; set data.mode=auto or indexed")
