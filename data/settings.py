"""The `data` section of the training config: what a run reads and how (the readers, the synthetic set, the
sources and their balance), with its choices, ranges and checks (a config section, as `models/settings.py` says).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from .balance import BalanceRule, CapBalance, NoBalance, SpreadBalance, TemperatureBalance
from .online_balance import ImbaBalance
from .remote import ShardCache, StoreBudget, parse_size
from .sources import ShardsSource, SourceKind, SyntheticSource, check_source_configs

# data.balance's kinds: a rule is its settings' dataclass (data/balance.py's BalanceRule), registered here by its KIND
BALANCE_RULES: dict[str, type[BalanceRule]] = {
    rule.KIND: rule for rule in (NoBalance, TemperatureBalance, SpreadBalance, CapBalance, ImbaBalance)}
# data.sources' kinds: each entry is one of these dataclasses (data/sources.py's SourceKind), chosen by its `kind`;
# the first is the kind of an entry that names none
SOURCE_KINDS: dict[str, type[SourceKind]] = {kind.KIND: kind for kind in (ShardsSource, SyntheticSource)}


@dataclass
class DataConfig:
    # brace/glob pattern, folder or URL (s3://, gs://, http(s)://, pipe:) of img2dataset tar shards; None = synthetic
    shards: str | None = None
    # auto: indexed, except pipe: commands, which stream. indexed: exact resume, equal batches per rank (remote shards
    # through data.cache_dir). streaming: webdataset with resampled shards (pipe:, or sets too large to index)
    mode: str = "auto"
    # where shards on object storage are kept while a run reads them (whole shards, shared by the ranks of a node),
    # and the most they may take there ("200GB", "500MiB"; 0 = no limit; the least recently used go first).
    # Credentials and endpoint come from the storage client's own chain (AWS_*, ~/.aws, AWS_ENDPOINT_URL), never
    # from here. None = ~/.cache/imba-dit/shards
    cache_dir: str | None = None
    cache_limit: str = "0"
    # reading a shard on object storage: a store that answers nothing (refused, reset, timed out) for this many
    # seconds is dead, and the run ends with one line, after a checkpoint, with the requeue exit status; a request the
    # store answers with an error is tried store_attempts times, then the shard is skipped as unreadable
    store_timeout: float = 120.0
    store_attempts: int = 5
    # the run stops with one line when more than this share of its shards could not be read (1 = never)
    max_bad_shards: float = 0.5
    # > 0: the indexed order (plain, or weighted by data.sources and an offline data.balance) reads this many shards
    # at a time (shards shuffled, then the draws within each window of them), so a cache smaller than the set
    # downloads each shard about once an epoch; 0 = one shuffle over all samples
    # (bench/README.md#shards-on-object-storage measures the trade)
    shard_window: int = 0
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
    # true: encode the training and validation images once, frozen VAE and T5 (`python -m data.prep.precompute`'s
    # format, in <train.output_dir>/features/; reused on resume, redone when the shards or encoders change) and
    # train on the stored features, with no encoder pass per step: for sets read many times (the synthetic set,
    # small fine-tuning sets). auto: true for the synthetic set (unless bucketed or streamed), false for data.shards
    # (large sets: run data.prep.precompute once and point data.shards at its output). false: encode every batch
    precompute: str = "auto"
    synthetic_samples: int = 2000  # size of the synthetic shard set written when shards is None
    synthetic_dir: str | None = None  # where it is written; None = <train.output_dir>/synthetic_shards
    # validation set (train.val_every): shards of the same kind as `shards` (images, or precomputed features); None
    # = a held-out synthetic set (other seed) for synthetic training, no validation for data.shards
    val_shards: str | None = None
    val_samples: int = 64  # the first N samples of the validation shards' seeded order, split over the ranks
    # several shard sets read as one, instead of data.shards: a list of {kind, name, share | repeat | choose, and
    # the kind's settings}, a kind of SOURCE_KINDS (default shards: {shards: PATTERN}; synthetic: {samples, folder,
    # seed}) (data/sources.py, docs/data.md#mixing-sources-and-balancing-concepts); drawn by the weighted stream
    # (exact resume on any process count)
    sources: list[SourceKind] = field(default_factory=list)
    epoch_samples: int = 0  # draws per epoch with data.sources or data.balance; 0 = the samples of the sources
    # sampling weights from the captions' concepts, one rule of BALANCE_RULES with its settings: {kind: none} |
    # {kind: temperature, alpha} (weight = count of the sample's rarest concept or combination ^ -alpha) | {kind: cap,
    # cap} (MetaCLIP: entries above cap drawn less) | {kind: imba, ...} (online: the temperature prior, each rarity
    # group's draws moved by the model's IMBA distance where it separates the group from the average row beyond
    # noise, data/online_balance.py). `data.balance=temperature` sets the kind alone
    balance: BalanceRule = field(default_factory=NoBalance)
    # true: each rank writes the sample indices of every batch it trains on to <train.output_dir>/draws/rank_R.jsonl
    # ({"step": s, "indices": [...]} a micro-batch, in order; a resume keeps the rows up to its checkpoint): what
    # the model was trained on, to audit a mix, a balance or a resume. Indexed reading only (samples have an index)
    record_draws: bool = False

    CHOICES: ClassVar[dict] = {"mode": ("auto", "indexed", "streaming"), "precompute": ("auto", "true", "false")}
    KINDS: ClassVar[dict] = {"balance": BALANCE_RULES}  # settings whose `kind` picks their dataclass
    ITEM_KINDS: ClassVar[dict] = {"sources": SOURCE_KINDS}  # lists whose items' `kind` picks their dataclass
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
        "shard_window": ">= 0 (0 = one shuffle over all samples)",
        "store_timeout": "> 0",
        "store_attempts": ">= 1",
        "max_bad_shards": "in [0, 1]",
    }

    def synthetic(self) -> bool:
        """Whether the run trains on the synthetic set (neither data.shards nor data.sources)."""
        return not self.shards and not self.sources

    def source_kinds(self) -> list[SourceKind]:
        """What the run reads: data.sources, else data.shards or the synthetic set as the one source."""
        if self.sources:
            return list(self.sources)
        if self.shards:
            return [ShardsSource(name="shards", shards=self.shards)]
        return [SyntheticSource(name="synthetic", samples=self.synthetic_samples, folder=self.synthetic_dir)]

    def weighted(self) -> bool:
        """Whether the run reads the weighted stream (data.sources or data.balance) rather than the plain order."""
        return bool(self.sources) or not isinstance(self.balance, NoBalance)

    def cache(self) -> ShardCache:
        """The local cache remote shards are read through (data.cache_dir, data.cache_limit), within the store's
        budget (`store_budget`)."""
        return ShardCache(self.cache_dir, self.cache_limit, self.store_budget())

    def store_budget(self) -> StoreBudget:
        """Every read's retry budget: data.store_timeout, data.store_attempts; data.max_bad_shards, which the
        readers apply."""
        return StoreBudget(self.store_timeout, self.store_attempts, self.max_bad_shards)

    def decoding(self) -> dict:
        """What turns a shard's record into a training sample, as fields of `data.read_spec.ReadSpec` and
        `PrecomputeSettings`: the image size, where the caption is, which images are skipped as too small."""
        return dict(resolution=self.resolution, caption_field=self.caption_field, min_size=self.min_size)

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
        if self.balance.ONLINE and self.bucketing:
            raise ValueError(f"data.balance kind {self.balance.KIND} balances online and does not draw aspect-ratio "
                             "buckets yet: set data.bucketing=false, or balance offline (data.balance=temperature "
                             "or cap)")
        if self.weighted() and self.mode == "streaming":
            raise ValueError("data.sources and data.balance need indexed reading: the streaming reader cannot draw "
                             "by weight and resume exactly; set data.mode=auto or indexed")
        parse_size(self.cache_limit)
        unwindowed = [name for name, on in (("online balancing", self.balance.ONLINE),
                                            ("aspect-ratio bucketing", self.bucketing),
                                            ("the streaming reader", self.mode == "streaming")) if on]
        if self.shard_window and unwindowed:
            raise ValueError(f"data.shard_window orders the indexed stream, plain or weighted offline: "
                             f"{unwindowed[0]} draws from every shard; set data.shard_window=0")
