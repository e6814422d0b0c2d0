"""Sources: several shard sets read as one, each with its share of the draws (data.sources).

    data:
      sources:
        - {name: web, shards: "/data/web/{000000..000999}.tar", share: 0.7}
        - {name: curated, shards: "/data/curated/*.tar", share: 0.3}
        - {kind: synthetic, name: shapes, samples: 500, share: 0.1}

A source is one kind of `SourceKind` (`kind`, default `shards`: a shard spec, anything `data.urls.expand_urls`
takes, of image shards or of precompute outputs; `synthetic`: the project's shapes, written once) with a `share` of
the draws, a `repeat` factor, or a number of draws to `choose`:
- share: the source gives that fraction of every epoch's draws (shares are normalised to sum to 1). An epoch is
  data.epoch_samples draws, by default as many as the sources hold samples together.
- repeat: each of the source's samples is drawn that many times per epoch on average (0.5: half of them; 3: three
  times). choose: the source gives that many draws per epoch. The epoch is the sum of the sources' draws (a source
  with neither gives each sample once), or data.epoch_samples when set (all draws are then scaled to fill it).
Shares are relative, repeats and choices absolute: all sources give a share, or none does. The loader reads the
sources' shards as one index, source after source; `SourceMix` says which index range is which source and each
sample's natural draws.
"""

from __future__ import annotations

import abc
import dataclasses
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, Sequence

import numpy as np

from .remote import is_indexable_remote
from .urls import expand_urls, is_pipe

__all__ = ["SourcePlace", "SourceKind", "ShardsSource", "SyntheticSource", "Source", "SourceMix",
           "check_source_configs", "resolve_sources", "safe_name", "check_same_kind"]


@dataclass
class SourcePlace:
    """What a source kind may need to find or write its shards: where a run keeps what it writes for the source
    (a folder of its own), the run's resolution and seed, and whether this process writes (the main process; the
    others `wait` for it)."""

    folder: Path
    resolution: int = 128
    seed: int = 0
    is_main: bool = True
    wait: Callable[[], None] = lambda: None


@dataclass
class SourceKind(abc.ABC):
    """One entry of data.sources: a kind of source (`KIND`, registered in `data.settings.SOURCE_KINDS`) with its own
    settings, and the weights every kind has. A kind says which shards it is (`resolve`) and how the start-up log and
    the model card name it (`describe`); the readers (indexed, precomputed, streaming) then read those shards."""

    KIND: ClassVar[str]
    CHOICES: ClassVar[dict] = {}
    RANGES: ClassVar[dict] = {}

    name: str = ""  # how the source is named in the logs; default source0, source1, ...
    share: float = 0.0  # fraction of the draws (normalised over the sources); 0 = not given
    repeat: float = 0.0  # draws per sample per epoch; 0 = not given
    choose: int = 0  # draws per epoch from this source; 0 = not given

    @abc.abstractmethod
    def resolve(self, place: SourcePlace) -> list[str]:
        """The source's shard URLs (expanded), written first where the kind makes them."""

    @abc.abstractmethod
    def describe(self) -> str:
        """The source in a few words of Markdown, for the start-up log and the model card."""

    def check(self) -> None:
        """A one-line ValueError for settings of the kind that cannot go together."""

    def weight(self) -> str:
        """The source's weight in words (" (share 0.7)", " (repeat 3)", " (60 draws per epoch)"), or ""."""
        return ((f" (share {self.share:g})" if self.share else "") + (f" (repeat {self.repeat:g})" if self.repeat else "")
                + (f" ({self.choose} draws per epoch)" if self.choose else ""))


@dataclass
class ShardsSource(SourceKind):
    """Tar shards (img2dataset layout, or a precompute output): a brace pattern, glob, folder or URL."""

    KIND: ClassVar[str] = "shards"
    shards: str = ""

    def resolve(self, place: SourcePlace) -> list[str]:
        return expand_urls(self.shards)

    def describe(self) -> str:
        return f"`{self.shards}` (img2dataset-layout tar shards)"

    def check(self) -> None:
        if not self.shards:
            raise ValueError(f"data.sources: {self.name or 'a source'} has no shards; give shards: PATTERN")


@dataclass
class SyntheticSource(SourceKind):
    """The project's synthetic shapes (`data.synthetic`): written once into `folder` (default: the run's folder for
    the source), from `seed` (default: train.seed) at the run's resolution."""

    KIND: ClassVar[str] = "synthetic"
    RANGES: ClassVar[dict] = {"samples": ">= 1"}
    samples: int = 2000
    folder: str | None = None
    seed: int | None = None

    def resolve(self, place: SourcePlace) -> list[str]:
        write = dict(num_samples=self.samples, resolution=place.resolution,
                     seed=place.seed if self.seed is None else self.seed)
        folder = self.folder or place.folder
        from .synthetic import write_synthetic_shards  # webdataset brings torch: not needed to read the settings
        if place.is_main:
            write_synthetic_shards(folder, progress=True, **write)
        place.wait()
        return write_synthetic_shards(folder, **write)  # already complete: returns the paths without writing

    def describe(self) -> str:
        return f"the project's synthetic shapes ({self.samples} images)"


@dataclass
class Source:
    """A source resolved to its shard files; `kind`: the entry it was resolved from."""

    name: str
    urls: list[str]
    share: float | None = None
    repeat: float | None = None
    choose: int | None = None
    kind: SourceKind | None = None


WEIGHT_KEYS = ("share", "repeat", "choose")


def _name(cfg: SourceKind, i: int) -> str:
    return cfg.name or f"source{i}"


def check_source_configs(configs: Sequence[SourceKind]) -> None:
    """ValueError (one line) for sources that cannot be mixed: a kind's own check (no shards), a weight that is
    negative or not finite, two weights on one source, shares on some sources only, a name used twice."""
    names = [_name(c, i) for i, c in enumerate(configs)]
    for cfg, name in zip(configs, names):
        dataclasses.replace(cfg, name=name).check()
        for key in WEIGHT_KEYS:
            value = getattr(cfg, key)
            if not np.isfinite(value) or value < 0:
                raise ValueError(f"data.sources: {name} has {key}={value}; a {key} must be > 0 (or left out)")
        given = [key for key in WEIGHT_KEYS if getattr(cfg, key)]
        if len(given) > 1:
            raise ValueError(f"data.sources: {name} gives {' and '.join(given)}; give one")
    if len(set(names)) < len(names):
        raise ValueError(f"data.sources: the names {names} repeat; give each source its own name")
    shares = [bool(c.share) for c in configs]
    if any(shares) and any(c.repeat or c.choose for c in configs):
        raise ValueError("data.sources: shares are relative, repeat and choose absolute: give every source a share, "
                         "or none, not both kinds")
    if any(shares) and not all(shares):
        missing = [n for n, g in zip(names, shares) if not g]
        raise ValueError(f"data.sources: every source needs a share > 0 when one has one ({', '.join(missing)} "
                         f"has none); a source drawn never is a source left out")


def resolve_sources(configs: Sequence[SourceKind], place: SourcePlace | None = None) -> list[Source]:
    """The sources with their shard files (source i of several writes what it writes under `place.folder`/i-NAME);
    FileNotFoundError (one line) for a source that matches no shard, a ValueError for a shard in two sources or a
    source of pipe: commands (sources are read indexed: local files and s3://, gs://, http(s):// URLs)."""
    check_source_configs(configs)
    place = place or SourcePlace(Path("."))
    sources, owner = [], {}
    for i, cfg in enumerate(configs):
        name = _name(cfg, i)
        try:
            urls = cfg.resolve(dataclasses.replace(place, folder=place.folder / f"{i}-{safe_name(name)}"))
        except (FileNotFoundError, ValueError) as err:
            raise FileNotFoundError(f"data.sources: {name}: {err}") from None
        if not urls:
            raise FileNotFoundError(f"data.sources: {name} matches no shard ({cfg.describe()})")
        for url in urls:
            if is_pipe(url):
                raise ValueError(f"data.sources: {name} is a pipe: command ({url[:80]}); sources are read indexed: "
                                 f"give local shards or s3://, gs://, http(s):// URLs (a pipe streams alone, as "
                                 f"data.shards)")
            key = url if is_indexable_remote(url) else os.path.abspath(url)
            if key in owner:
                raise ValueError(f"data.sources: shard {url} is in both {owner[key]} and {name}; a sample belongs "
                                 f"to one source")
            owner[key] = name
        sources.append(Source(name, urls, cfg.share or None, cfg.repeat or None, cfg.choose or None, kind=cfg))
    return sources


def safe_name(name: str) -> str:
    """`name` as a file name: characters other than letters, digits, `.`, `_` and `-` become `_`."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)


class SourceMix:
    """The sources as index ranges of the shards read one after the other, and their natural draws per epoch.

    `sizes[s]` = samples of source s (from the index); `samples_per_epoch` = S (see the module doc);
    `draws[s]` = source s's draws per epoch (float, sums to S); `rate[i]` = sample i's natural draws per epoch.
    """

    def __init__(self, sources: Sequence[Source], shard_sizes: Sequence[int], epoch_samples: int = 0):
        counts = [len(s.urls) for s in sources]
        if sum(counts) != len(shard_sizes):
            raise ValueError(f"{len(shard_sizes)} shard sizes for {sum(counts)} shards of the sources")
        bounds = np.concatenate([[0], np.cumsum(counts)])
        self.sources = list(sources)
        self.sizes = np.asarray([int(np.sum(shard_sizes[a:b])) for a, b in zip(bounds[:-1], bounds[1:])], np.int64)
        for source, size in zip(self.sources, self.sizes):
            if size == 0:
                raise ValueError(f"data.sources: {source.name} has no readable samples ({source.urls[0]}, ...)")
        self.starts = np.concatenate([[0], np.cumsum(self.sizes)])
        if all(s.share for s in self.sources):
            shares = np.asarray([s.share for s in self.sources], np.float64)
            total = int(epoch_samples or self.starts[-1])
            self.draws = total * shares / shares.sum()
        else:
            natural = np.asarray([s.choose or (s.repeat or 1.0) * n for s, n in zip(self.sources, self.sizes)],
                                 np.float64)
            total = int(epoch_samples or max(1, round(natural.sum())))
            self.draws = natural * (total / natural.sum())
        self.samples_per_epoch = total
        self.repeats = self.draws / self.sizes

    @property
    def num_samples(self) -> int:
        return int(self.starts[-1])

    def source_of(self, indices: np.ndarray | Sequence[int]) -> np.ndarray:
        """The source number of each sample index."""
        return np.searchsorted(self.starts, np.asarray(indices), side="right") - 1

    @property
    def rate(self) -> np.ndarray:
        """Each sample's natural draws per epoch: its source's repeat factor."""
        return np.repeat(self.repeats, self.sizes)

    def settings(self) -> list[dict[str, Any] | None]:
        """Per source: its kind and every setting of it, as data (None for a source made without a kind)."""
        return [None if s.kind is None else {"kind": s.kind.KIND, **dataclasses.asdict(s.kind)} for s in self.sources]

    def describe(self) -> list[dict[str, Any]]:
        """Per source: name, samples, draws per epoch, share of the draws, repeat factor."""
        return [{"name": s.name, "samples": int(n), "draws": float(d), "share": float(d / self.samples_per_epoch),
                 "repeat": float(r)} for s, n, d, r in zip(self.sources, self.sizes, self.draws, self.repeats)]


# what decides how a precomputed sample reads; caption_field and min_size only chose which samples were encoded
FEATURE_KEYS = ("resolution", "vae", "vae_subfolder", "text_encoder", "text_encoder_subfolder", "tokenizer_subfolder",
                "encoder_dtype", "max_text_tokens", "text_dtype", "latent_shape", "vae_scaling_factor",
                "text_hidden_size")


def check_same_kind(sources: Sequence[Source]) -> dict[str, Any] | None:
    """The precompute manifest the sources share (None when they are all image shards); ValueError (one line) when
    image shards are mixed with precomputed ones, or precomputed sources differ in how their features were made."""
    from .precomputed import find_manifest

    manifests = [find_manifest(s.urls) for s in sources]
    precomputed = [s.name for s, m in zip(sources, manifests) if m is not None]
    images = [s.name for s, m in zip(sources, manifests) if m is None]
    if precomputed and images:
        raise ValueError(f"data.sources: {', '.join(precomputed)} hold precomputed features, {', '.join(images)} "
                         f"image shards; mix sources of one kind (python -m data.prep.precompute the image shards)")
    if not precomputed:
        return None
    first = manifests[0]
    for source, manifest in zip(sources[1:], manifests[1:]):
        diff = [f"{k}={manifest.get(k)!r} vs {first.get(k)!r}" for k in FEATURE_KEYS if manifest.get(k) != first.get(k)]
        if diff:
            raise ValueError(f"data.sources: {source.name}'s features were made with other settings than "
                             f"{sources[0].name}'s ({'; '.join(diff)}); precompute them with the same settings")
    return first
