"""Concept statistics of a caption set: frequencies, head/torso/tail buckets, co-occurrence, the statistics files.

A run reads them (the per-bucket monitoring, the text check); the command that writes them, and the inert-concept
benchmark built from them, are `data.prep`'s:

    python -m data.prep.concepts --shards 'shards/part-{000000..000009}.tar' --out stats/
    python -m data.prep.concepts --captions captions.jsonl --out stats/
    python -m data.prep.concepts build-benchmark --stats stats/concepts.json --out prompts.json

One module per step, each documenting its definitions; the words themselves (tokenising, plural folding, English
articles: "an apple", "some water") are `data.text`'s, which the evaluation (`imba.eval`) shares:
  vocab         the concept vocabulary (bundled `concept_vocab.txt`, or `--vocab FILE`) and the extractors that
                find a caption's concepts (`VocabExtractor`, the default; `SpacyExtractor`, optional)
  captions      captions read from tar shards (without reading images) and from caption files
  counting      per-concept and per-pair counts (`ConceptStats`), in one process or several
  buckets       head / torso / tail by cumulative share of occurrences; a caption's bucket is its rarest concept's
  cooccurrence  NPMI of the pairs of frequent concepts: the spurious correlations a model may learn
  stats         the statistics files (concepts.csv, concepts.json, long_tail.png, cooccurrence.csv) and reading
                them back (`load_stats`, `load_buckets`, `CaptionBucketer`)
  plot          long_tail.png, and the bucket colours, style and figure that `imba.plots` draws with too
                (matplotlib; not imported here)

Outputs of `python -m data.prep.concepts stats` (in --out): concepts.csv, concepts.json, long_tail.png,
cooccurrence.csv.
"""

from ..text import noun_phrase, singularize, tokenize, with_article

from .buckets import BUCKETS, assign_buckets, bucket_summary, caption_bucket, caption_buckets
from .captions import iter_caption_file, iter_shard_captions
from .cooccurrence import cooccurrence_table, npmi
from .counting import ConceptStats, collect_stats, count_concepts
from .stats import PLOT_SIZE, STATS_FORMAT, CaptionBucketer, extractor_from_stats, load_buckets, load_stats, write_stats
from .vocab import (
    DEFAULT_VOCAB_PATH,
    ExtractorUnavailable,
    SpacyExtractor,
    VocabExtractor,
    Vocabulary,
    default_extractor,
    load_vocabulary,
    make_extractor,
)

__all__ = [
    "DEFAULT_VOCAB_PATH",
    "BUCKETS",
    "PLOT_SIZE",
    "STATS_FORMAT",
    "ExtractorUnavailable",
    "Vocabulary",
    "VocabExtractor",
    "SpacyExtractor",
    "ConceptStats",
    "tokenize",
    "singularize",
    "with_article",
    "noun_phrase",
    "load_vocabulary",
    "default_extractor",
    "make_extractor",
    "iter_shard_captions",
    "iter_caption_file",
    "count_concepts",
    "collect_stats",
    "assign_buckets",
    "bucket_summary",
    "caption_buckets",
    "caption_bucket",
    "CaptionBucketer",
    "npmi",
    "cooccurrence_table",
    "write_stats",
    "load_stats",
    "load_buckets",
    "extractor_from_stats",
]
