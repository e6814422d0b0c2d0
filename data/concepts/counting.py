"""Counting concepts over a caption set: per concept and per pair of concepts, in one process or several.

`count` = number of captions that mention the concept (each concept counts at most once per caption);
`ConceptStats.ranked()` orders them for ranks: 1 for the most frequent concept, ties broken alphabetically.
"""

from __future__ import annotations

import itertools
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Sequence

from ..remote import ShardCache
from ..urls import expand_urls
from .captions import iter_caption_file, iter_shard_captions
from .vocab import Extractor, default_extractor, extract_batch

__all__ = ["ConceptStats", "count_concepts", "collect_stats"]


@dataclass
class ConceptStats:
    """Concept counts over a caption set; `pair_counts[(a, b)]` (a < b) = captions mentioning both a and b."""

    num_captions: int = 0
    num_with_concepts: int = 0
    counts: Counter = field(default_factory=Counter)
    pair_counts: Counter = field(default_factory=Counter)
    skipped: Counter = field(default_factory=Counter)
    sources: list[str] = field(default_factory=list)
    kinds: dict[str, str] = field(default_factory=dict)

    def add(self, concepts: Sequence[str]) -> None:
        """Count one caption's concepts (duplicates are counted once)."""
        self.num_captions += 1
        unique = sorted(set(concepts))
        if unique:
            self.num_with_concepts += 1
            self.counts.update(unique)
            self.pair_counts.update(itertools.combinations(unique, 2))

    def merge(self, other: ConceptStats) -> None:
        self.num_captions += other.num_captions
        self.num_with_concepts += other.num_with_concepts
        self.counts.update(other.counts)
        self.pair_counts.update(other.pair_counts)
        self.skipped.update(other.skipped)
        self.sources.extend(other.sources)
        self.kinds.update(other.kinds)

    @property
    def num_occurrences(self) -> int:
        return sum(self.counts.values())

    def ranked(self) -> list[tuple[str, int]]:
        """(concept, count), most frequent first, ties alphabetical: index + 1 is the rank."""
        return sorted(self.counts.items(), key=lambda kv: (-kv[1], kv[0]))


def _count_into(stats: ConceptStats, captions: Iterable[str], extractor: Extractor, bar=None, chunk: int = 512) -> None:
    kind = getattr(extractor, "kind", None)
    buffer: list[str] = []

    def drain() -> None:
        for concepts in extract_batch(extractor, buffer):
            stats.add(concepts)
            if kind is not None:
                for concept in concepts:
                    if concept not in stats.kinds:
                        stats.kinds[concept] = kind(concept)
        if bar is not None:
            bar.update(len(buffer))
        buffer.clear()

    for caption in captions:
        buffer.append(caption)
        if len(buffer) >= chunk:
            drain()
    if buffer:
        drain()


def count_concepts(captions: Iterable[str], extractor: Extractor | None = None) -> ConceptStats:
    """Concept statistics of an iterable of caption strings (empty strings count as captions without concepts)."""
    stats = ConceptStats()
    _count_into(stats, captions, extractor or default_extractor())
    return stats


def _source_captions(source: tuple[str, str], caption_field: str, skipped: Counter,
                     cache: ShardCache | None = None) -> Iterator[str]:
    kind, path = source
    if kind == "shard":
        return iter_shard_captions(path, caption_field, skipped, cache=cache)
    return iter_caption_file(path, caption_field, skipped)


def _count_source(job: tuple[tuple[str, str], Extractor, str, ShardCache | None]) -> ConceptStats:
    """One shard or caption file -> its ConceptStats (runs in worker processes)."""
    source, extractor, caption_field, cache = job
    stats = ConceptStats(sources=[source[1]])
    _count_into(stats, _source_captions(source, caption_field, stats.skipped, cache), extractor)
    return stats


def collect_stats(
    shards: str | Sequence[str] | None = None,
    captions: str | Sequence[str] | None = None,
    extractor: Extractor | None = None,
    caption_field: str = "caption",
    workers: int = 1,
    progress: bool = False,
    cache: ShardCache | None = None,
) -> ConceptStats:
    """Concept statistics of tar shards (anything `expand_urls` accepts) and/or caption files. Shards on object
    storage are read from their copies in `cache` (default `ShardCache()`), as the training reader reads them.

    `workers > 1` counts shards/files in that many processes (one source per task; results are merged, so the
    totals equal a one-process run). Raises FileNotFoundError (one line) for missing inputs.
    """
    sources: list[tuple[str, str]] = []
    if shards:
        sources.extend(("shard", url) for url in expand_urls(shards))
    for path in [captions] if isinstance(captions, (str, os.PathLike)) else list(captions or []):
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"caption file {path!r} not found: give a .txt, .jsonl or .json file of captions")
        sources.append(("captions", path))
    if not sources:
        raise FileNotFoundError("no input: give --shards (tar shards) or --captions (a caption file)")
    extractor = extractor or default_extractor()
    total = ConceptStats()

    def make_bar():
        if not progress:
            return None
        from tqdm import tqdm

        return tqdm(desc="concepts", unit=" captions", unit_scale=True, mininterval=1.0, dynamic_ncols=True)

    if workers > 1 and len(sources) > 1:
        import multiprocessing as mp

        context = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
        jobs = [(source, extractor, caption_field, cache) for source in sources]
        with context.Pool(min(workers, len(sources))) as pool:  # workers start here, before tqdm's thread
            bar = make_bar()
            try:
                for done, part in enumerate(pool.imap(_count_source, jobs), 1):
                    total.merge(part)
                    if bar is not None:
                        bar.update(part.num_captions)
                        bar.set_postfix_str(f"source {done}/{len(sources)}", refresh=False)
            finally:
                if bar is not None:
                    bar.close()
            pool.close()  # let the workers exit on their own: the terminate() of `with` can deadlock on idle ones
            pool.join()
        return total
    bar = make_bar()
    try:
        for done, source in enumerate(sources, 1):
            if bar is not None:
                bar.set_postfix_str(f"source {done}/{len(sources)}", refresh=False)
            part = ConceptStats(sources=[source[1]])
            _count_into(part, _source_captions(source, caption_field, part.skipped, cache), extractor, bar)
            total.merge(part)
    finally:
        if bar is not None:
            bar.close()
    return total
