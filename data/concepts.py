"""Concept statistics of a caption set: frequencies, head/torso/tail buckets, co-occurrence, inert-concept prompts.

    python -m data.concepts --shards 'shards/part-{000000..000009}.tar' --out stats/
    python -m data.concepts --captions captions.jsonl --out stats/
    python -m data.concepts build-benchmark --stats stats/concepts.json --out prompts.json

Concepts. A caption's concepts are the vocabulary entries it mentions (default extractor, `VocabExtractor`): the
caption is lower-cased, possessives ("dog's") and punctuation are dropped, each word is folded to a singular that
the vocabulary knows (cats -> cat, boxes -> box, berries -> berry, leaves -> leaf, mice -> mouse, children ->
child: a small irregulars table plus suffix rules, tried in order and kept only if the result is a vocabulary
word, so "bus" and "glass" stay themselves), and vocabulary phrases are matched greedily, longest first, left to
right ("a teddy bear and a hot dog" -> teddy bear, hot dog; no bear, no dog). Each concept counts at most once
per caption. The bundled vocabulary (`data/concept_vocab.txt`, ~1,000 visual nouns plus colour attributes,
including the synthetic set's SHAPES and COLOURS) needs no download; `--vocab FILE` replaces it (same format,
see the file's header). `--extractor spacy` uses lemmatised noun-chunk heads (with their compound modifiers)
instead, when spaCy and an English model are installed; the default path never imports spaCy.

Counts. `count` = number of captions that mention the concept; `fraction` = count / number of non-empty captions
read; `rank` = 1 for the most frequent concept, ties broken alphabetically (ordinal ranks, as plotted).

Buckets (head / torso / tail). Default, `method="share"`: order the concepts by count and accumulate their
share of all concept occurrences (the sum of all counts). A concept is
    head  if the concepts strictly more frequent than it hold less than `head_share` (0.5) of the occurrences,
    torso if they hold less than `head_share + torso_share` (0.5 + 0.3 = 0.8),
    tail  otherwise.
So head = the most frequent concepts that together make up the first 50 % of occurrences (the concept that
crosses the line is head), torso = the next 30 %, tail = the last 20 %; concepts with equal counts always share
a bucket, which makes the split independent of ordering and input order. The split is monotone in the count, so
it is equivalently given by two count thresholds, recorded in concepts.json: head if count >= head_min_count,
torso if count >= torso_min_count, else tail; `assign_buckets(counts, thresholds=...)` applies recorded ones.
Why shares and not quantiles of the concept list or absolute counts: a concept-list quantile moves when the
vocabulary gains or loses rare entries (and with a Zipf law nearly all concepts land in the tail), and absolute
counts depend on the data set size; a share of occurrences does neither, and it says what the training monitor
needs: head concepts are what half of the caption signal is about. `method="count"` (LVIS-like absolute
thresholds: head > 100 captions, torso 11..100, tail <= 10) is available for small sets where that reads better.
A caption's bucket is the bucket of its rarest concept (`caption_bucket`); `caption_buckets` lists every bucket it
touches, rarest first. Concepts absent from the table (never seen when the statistics were made) count as tail.

Co-occurrence. For the top-K concepts, p(a) = count_a / N, p(a, b) = count_ab / N (N = captions read) and
NPMI(a, b) = log(p(a,b) / (p(a) p(b))) / -log p(a,b), in [-1, 1]: 0 for independent concepts, 1 for concepts
that only occur together, and by convention -1 when they never co-occur (count_ab = 0) and 1 when p(a,b) = 1.
High-NPMI pairs among frequent concepts are the spurious correlations a model may learn (red <-> circle).

Benchmark (the IMBA paper's Inert-CompBench recipe). Concepts (objects only, count >= min_count) are split into
`num_bins` bins of equal width in log(count), bin 0 the rarest; `per_bin` concepts are drawn from each bin;
pairs of the drawn concepts are taken round-robin over the bin pairs (rarest bin pairs first: tail x tail,
tail x next, ..., head x head) until `num_pairs`; each pair gets `captions_per_pair` prompts from distinct
templates. Pairs that co-occur in any training caption (`pairs` of concepts.json) are left out, as in the paper,
whose inert pairs never appear together (`allow_cooccurring=True` / `--allow-cooccurring` keeps them). Every random
choice uses `random.Random(seed).random()` only, whose stream is stable across Python versions, so the same stats
and seed give the same prompts.

Outputs of `stats` (in --out): concepts.csv, concepts.json, long_tail.png, cooccurrence.csv.
"""

from __future__ import annotations

import argparse
import csv
import functools
import itertools
import json
import logging
import math
import os
import random
import re
import sys
import tarfile
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

from .shards import REMOTE_PREFIXES, expand_urls, sample_caption

__all__ = [
    "DEFAULT_VOCAB_PATH",
    "BUCKETS",
    "TEMPLATES",
    "ExtractorUnavailable",
    "Vocabulary",
    "VocabExtractor",
    "SpacyExtractor",
    "ConceptStats",
    "tokenize",
    "singularize",
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
    "plot_long_tail",
    "write_stats",
    "load_stats",
    "load_buckets",
    "extractor_from_stats",
    "log_frequency_bins",
    "build_benchmark",
    "main",
]

log = logging.getLogger(__name__)

DEFAULT_VOCAB_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "concept_vocab.txt")
BUCKETS: tuple[str, ...] = ("head", "torso", "tail")  # most frequent first
STATS_FORMAT = "imba-concept-stats/1"
PLOT_SIZE = (960, 640)


class ExtractorUnavailable(RuntimeError):
    """The requested concept extractor cannot run here (e.g. spaCy or its model is not installed)."""


# --------------------------------------------------------------------------------------------------------------
# Words: tokenising and plural folding
# --------------------------------------------------------------------------------------------------------------

_POSSESSIVE = re.compile(r"['\u2019]s\b")
_APOSTROPHE = re.compile(r"['\u2019`]")
_WORD = re.compile(r"[^\W_]+")


def tokenize(text: str) -> list[str]:
    """Lower-cased words of `text`: possessive 's and apostrophes dropped, any other punctuation separates words."""
    text = _APOSTROPHE.sub("", _POSSESSIVE.sub("", text.lower()))
    return _WORD.findall(text)


# Irregular plurals (and -us/-f plurals the suffix rules would get wrong).
_IRREGULAR: dict[str, str] = {
    "people": "person", "men": "man", "women": "woman", "children": "child", "mice": "mouse", "lice": "louse",
    "geese": "goose", "feet": "foot", "teeth": "tooth", "oxen": "ox", "cacti": "cactus",
    "fungi": "fungus", "octopi": "octopus", "knives": "knife", "wives": "wife", "lives": "life",
    "leaves": "leaf", "loaves": "loaf", "halves": "half", "wolves": "wolf", "shelves": "shelf",
    "calves": "calf", "scarves": "scarf", "hooves": "hoof", "thieves": "thief", "elves": "elf",
    "selves": "self", "sheaves": "sheaf", "buses": "bus", "gases": "gas", "octopuses": "octopus",
    "cactuses": "cactus", "walruses": "walrus", "platypuses": "platypus", "hippopotamuses": "hippopotamus",
    "rhinoceroses": "rhinoceros", "circuses": "circus", "viruses": "virus", "campuses": "campus",
    "potatoes": "potato", "tomatoes": "tomato", "heroes": "hero", "mangoes": "mango", "volcanoes": "volcano",
    "mosquitoes": "mosquito", "dominoes": "domino", "torpedoes": "torpedo", "echoes": "echo",
}
# Words that look plural but are not (used by the vocabulary-free rules only).
_INVARIANT = frozenset(
    "sheep deer fish moose bison salmon trout aircraft series species news means glasses jeans pants shorts "
    "scissors binoculars pajamas clothes sunglasses goggles leggings trousers headphones chopsticks stairs "
    "skis fireworks dice".split()
)
_MEN_EXCEPTIONS = frozenset({"specimen", "abdomen", "semen", "omen", "amen", "stamen", "hymen"})


def _rule_singular(word: str) -> str:
    """Best-effort singular without a vocabulary (see `singularize`)."""
    if word in _IRREGULAR:
        return _IRREGULAR[word]
    if len(word) <= 3 or word in _INVARIANT:
        return word
    if word.endswith("men") and len(word) >= 5 and word not in _MEN_EXCEPTIONS:
        return word[:-3] + "man"  # firemen, policemen, snowmen
    if not word.endswith("s") or word.endswith(("ss", "us", "is", "ous")):
        return word
    if word.endswith("ies") and len(word) > 4:
        return word[:-3] + "y"
    if word.endswith(("sses", "xes", "zzes", "ches", "shes")):
        return word[:-2]
    return word[:-1]


def _singular_candidates(word: str) -> Iterator[str]:
    """Possible singulars of `word`, most specific first (checked against a vocabulary by `singularize`)."""
    if word in _IRREGULAR:
        yield _IRREGULAR[word]
    if word.endswith("men") and len(word) >= 4:
        yield word[:-3] + "man"
    if word.endswith("ies") and len(word) > 4:
        yield word[:-3] + "y"
    if word.endswith("ves") and len(word) > 4:
        yield word[:-3] + "f"
        yield word[:-3] + "fe"
    if word.endswith("s") and len(word) > 2:
        yield word[:-1]
        if word.endswith("es") and len(word) > 3:
            yield word[:-2]
    if word.endswith("i") and len(word) > 3:
        yield word[:-1] + "us"  # cacti


def singularize(word: str, known: Iterable[str] | None = None) -> str:
    """The singular of a lower-case `word`.

    With `known` (a set of vocabulary words): `word` itself if known (so "bus", "glass" and plural-only entries
    like "jeans" stay as they are), else the first known candidate from the irregulars table and the suffix
    rules (-men -> -man, -ies -> -y, -ves -> -f/-fe, -s, -es, -i -> -us), else `word` unchanged. Without
    `known`: a best-effort rule-based singular (irregulars, invariant words, -ies, sibilant -es, -s).
    """
    if known is None:
        return _rule_singular(word)
    if word in known:
        return word
    for candidate in _singular_candidates(word):
        if candidate in known:
            return candidate
    return word


# --------------------------------------------------------------------------------------------------------------
# Extractors
# --------------------------------------------------------------------------------------------------------------


@dataclass
class Vocabulary:
    """Concept names, their kind ("object" | "attribute"), and the word tuples (name + aliases) that mean them."""

    names: list[str]
    kinds: dict[str, str]
    phrases: dict[tuple[str, ...], str]
    source: str = "default"

    @property
    def words(self) -> frozenset[str]:
        return frozenset(w for phrase in self.phrases for w in phrase)

    def __len__(self) -> int:
        return len(self.names)


def _parse_vocabulary(lines: Iterable[str], source: str) -> Vocabulary:
    names: list[str] = []
    kinds: dict[str, str] = {}
    phrases: dict[tuple[str, ...], str] = {}
    kind = "object"
    for lineno, raw in enumerate(lines, 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if line.startswith("[") and line.endswith("]"):
            kind = line[1:-1].strip().lower()
            if kind not in ("object", "attribute"):
                raise ValueError(f"{source}:{lineno}: unknown section [{kind}] (use [object] or [attribute])")
            continue
        head, _, rest = line.partition(":")
        name = " ".join(head.lower().split())
        words = tuple(tokenize(name))
        if not words:
            raise ValueError(f"{source}:{lineno}: concept {head!r} has no letters or digits")
        if name in kinds:
            log.warning("%s:%d: concept %r listed twice; the first entry is kept", source, lineno, name)
            continue
        names.append(name)
        kinds[name] = kind
        for alias in [name] + [a for a in rest.split(",") if a.strip()]:
            key = tuple(tokenize(alias))
            if not key:
                continue
            other = phrases.get(key)
            if other is not None and other != name:
                log.warning("%s:%d: %r already means %r; ignored for %r", source, lineno, alias.strip(), other, name)
                continue
            phrases[key] = name
    if not names:
        raise ValueError(f"vocabulary {source} has no concepts (one concept per line; see {DEFAULT_VOCAB_PATH})")
    return Vocabulary(names=names, kinds=kinds, phrases=phrases, source=source)


def load_vocabulary(path: str | os.PathLike | None = None) -> Vocabulary:
    """The concept vocabulary in `path` (default: the bundled `concept_vocab.txt`); format in that file's header."""
    if path is None:
        with open(DEFAULT_VOCAB_PATH, encoding="utf-8") as f:
            return _parse_vocabulary(f, "default")
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"vocabulary file {path!r} not found: give a text file, one concept per line")
    with open(path, encoding="utf-8") as f:
        return _parse_vocabulary(f, path)


class VocabExtractor:
    """caption -> the vocabulary concepts it mentions (each once, in order of first mention); see module docstring."""

    name = "vocab"

    def __init__(self, vocabulary: Vocabulary | str | os.PathLike | None = None) -> None:
        if not isinstance(vocabulary, Vocabulary):
            vocabulary = load_vocabulary(vocabulary)
        self.vocabulary = vocabulary
        self._phrases = vocabulary.phrases
        self._known = vocabulary.words
        self._first = frozenset(phrase[0] for phrase in self._phrases)
        self._max_len = max(len(phrase) for phrase in self._phrases)
        self._fold_cache: dict[str, str] = {}

    def __getstate__(self) -> dict:  # for worker processes: the cache is rebuilt there
        state = dict(self.__dict__)
        state["_fold_cache"] = {}
        return state

    def _fold(self, word: str) -> str:
        folded = self._fold_cache.get(word)
        if folded is None:
            if len(self._fold_cache) > 1_000_000:
                self._fold_cache.clear()
            folded = self._fold_cache[word] = singularize(word, self._known)
        return folded

    def __call__(self, caption: str) -> list[str]:
        words = [self._fold(w) for w in tokenize(caption)]
        found: list[str] = []
        i, n = 0, len(words)
        while i < n:
            step = 1
            if words[i] in self._first:
                for length in range(min(self._max_len, n - i), 0, -1):
                    concept = self._phrases.get(tuple(words[i : i + length]))
                    if concept is not None:
                        if concept not in found:
                            found.append(concept)
                        step = length
                        break
            i += step
        return found

    def batch(self, captions: Sequence[str]) -> list[list[str]]:
        return [self(c) for c in captions]

    def kind(self, concept: str) -> str:
        return self.vocabulary.kinds.get(concept, "object")

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "vocab": self.vocabulary.source, "vocab_size": len(self.vocabulary)}


# Noun-chunk heads that name the picture rather than something in it.
_SPACY_STOP = frozenset(
    "image photo picture photograph illustration view background foreground scene shot closeup close-up "
    "top bottom side front back left right middle center centre edge corner part lot number kind type style "
    "color colour shape group couple pair piece set area thing something it this that".split()
)


class SpacyExtractor:
    """caption -> lemmatised heads of its noun chunks, with their compound modifiers ("teddy bear").

    Open vocabulary: every noun the parser finds is a concept, except pronouns and a few words that describe the
    picture rather than its content. Needs `pip install spacy` and a model (`python -m spacy download
    en_core_web_sm`); raises ExtractorUnavailable, with that one-line fix, when either is missing.
    """

    name = "spacy"

    def __init__(self, model: str = "en_core_web_sm", batch_size: int = 256) -> None:
        try:
            import spacy  # noqa: PLC0415 - optional dependency, never imported on the default path
        except ImportError:
            raise ExtractorUnavailable(
                "--extractor spacy needs spaCy: pip install spacy && python -m spacy download "
                f"{model} (or use the default --extractor vocab)"
            ) from None
        try:
            self._nlp = spacy.load(model, disable=["ner"])
        except OSError:
            raise ExtractorUnavailable(
                f"spaCy model {model!r} is not installed: python -m spacy download {model} "
                "(or use the default --extractor vocab)"
            ) from None
        self.model = model
        self.batch_size = batch_size

    def __getstate__(self) -> dict:
        return {"model": self.model, "batch_size": self.batch_size}

    def __setstate__(self, state: dict) -> None:
        self.__init__(**state)

    @staticmethod
    def _doc_concepts(doc: Any) -> list[str]:
        found: list[str] = []
        for chunk in doc.noun_chunks:
            root = chunk.root
            if root.pos_ not in ("NOUN", "PROPN"):
                continue
            lemma = root.lemma_.lower().strip()
            if not lemma or lemma in _SPACY_STOP or not any(ch.isalpha() for ch in lemma):
                continue
            compounds = [t.lemma_.lower() for t in root.children if t.dep_ == "compound" and t.i < root.i]
            concept = " ".join(compounds + [lemma])
            if concept not in found:
                found.append(concept)
        return found

    def __call__(self, caption: str) -> list[str]:
        return self._doc_concepts(self._nlp(caption))

    def batch(self, captions: Sequence[str]) -> list[list[str]]:
        return [self._doc_concepts(doc) for doc in self._nlp.pipe(captions, batch_size=self.batch_size)]

    def kind(self, concept: str) -> str:
        return "object"

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "model": self.model}


Extractor = Callable[[str], list[str]]


@functools.lru_cache(maxsize=1)
def default_extractor() -> VocabExtractor:
    """The bundled-vocabulary extractor (built once per process)."""
    return VocabExtractor()


def make_extractor(name: str = "vocab", vocab: str | os.PathLike | None = None, spacy_model: str = "en_core_web_sm"):
    """`VocabExtractor(vocab)` for "vocab", `SpacyExtractor(spacy_model)` for "spacy" (may raise
    ExtractorUnavailable)."""
    if name == "vocab":
        return default_extractor() if vocab is None else VocabExtractor(vocab)
    if name == "spacy":
        return SpacyExtractor(spacy_model)
    raise ValueError(f"unknown extractor {name!r}: use 'vocab' (default) or 'spacy'")


def _extract_batch(extractor: Extractor, captions: Sequence[str]) -> list[list[str]]:
    batch = getattr(extractor, "batch", None)
    return batch(captions) if batch is not None else [extractor(c) for c in captions]


# --------------------------------------------------------------------------------------------------------------
# Reading captions
# --------------------------------------------------------------------------------------------------------------

_CAPTION_MEMBERS = ("txt", "json")


def _split_member(name: str) -> tuple[str, str]:
    """'dir/000123.txt' -> ('dir/000123', 'txt'): the key ends at the first dot of the base name (webdataset rule)."""
    folder, _, base = name.rpartition("/")
    stem, dot, ext = base.partition(".")
    return (f"{folder}/{stem}" if folder else stem), ext.lower() if dot else ""


def _octal(field: bytes) -> int:
    if field[:1] and field[0] & 0x80:  # GNU base-256 for sizes >= 8 GiB
        return int.from_bytes(field[1:], "big")
    text = field.split(b"\0", 1)[0].strip()
    return int(text, 8) if text else 0


def _fast_tar_members(path: str, wanted: Callable[[str], bool]) -> Iterator[tuple[str, bytes | None]]:
    """(name, data or None) of the regular files of an uncompressed local tar, reading only `wanted` members.

    A lean header walk (ustar, GNU long names, pax path records), ~20x faster than `tarfile` on small members;
    raises tarfile.ReadError on a bad checksum or a truncated archive, like tarfile would.
    """
    with open(path, "rb") as f:
        size_of_file = os.fstat(f.fileno()).st_size
        long_name: str | None = None
        while True:
            header = f.read(512)
            if len(header) < 512:
                if not header:
                    return  # no end-of-archive blocks: accepted, as tarfile does
                raise tarfile.ReadError(f"truncated tar header at byte {f.tell() - len(header)}")
            if header.count(0) == 512:
                return
            if _octal(header[148:156]) != sum(header[:148]) + 256 + sum(header[156:]):
                raise tarfile.ReadError(f"bad tar header checksum at byte {f.tell() - 512}")
            size = _octal(header[124:136])
            padded = (size + 511) & ~511
            if f.tell() + padded > size_of_file:
                raise tarfile.ReadError(f"truncated tar member at byte {f.tell()}")
            kind = header[156:157]
            if kind in (b"L", b"x", b"g"):
                data = f.read(padded)[:size]
                if kind == b"L":
                    long_name = data.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
                elif kind == b"x":
                    for record in data.split(b"\n"):
                        _, _, kv = record.partition(b" ")
                        key, _, value = kv.partition(b"=")
                        if key == b"path":
                            long_name = value.decode("utf-8", "surrogateescape")
                continue
            name = long_name
            long_name = None
            if kind not in (b"0", b"\0", b"7"):
                f.seek(padded, 1)
                continue
            if name is None:
                name = header[:100].split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
                if header[257:262] == b"ustar":
                    prefix = header[345:500].split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
                    if prefix:
                        name = f"{prefix}/{name}"
            if wanted(name):
                data = f.read(size)
                f.seek(padded - size, 1)
                yield name, data
            else:
                f.seek(padded, 1)
                yield name, None


def _tar_members(url: str, wanted: Callable[[str], bool]) -> Iterator[tuple[str, bytes | None]]:
    """(name, data or None) of a shard's regular files, in archive order; only `wanted` members are read."""
    if not url.startswith(REMOTE_PREFIXES) and url.endswith(".tar"):
        yield from _fast_tar_members(url, wanted)
        return
    if url.startswith(REMOTE_PREFIXES):
        from webdataset.gopen import gopen  # streams pipe:, http(s), s3, gs through webdataset's openers

        tar = tarfile.open(fileobj=gopen(url, "rb"), mode="r|*")
    else:
        tar = tarfile.open(url, mode="r:*")  # compressed or oddly named local archives
    with tar:
        for member in tar:
            if not member.isfile():
                continue
            if wanted(member.name):
                handle = tar.extractfile(member)
                yield member.name, handle.read() if handle is not None else b""
            else:
                yield member.name, None


def _is_caption_member(name: str) -> bool:
    return _split_member(name)[1] in _CAPTION_MEMBERS


def iter_shard_captions(url: str, caption_field: str = "caption", skipped: Counter | None = None) -> Iterator[str]:
    """Captions of the samples in one img2dataset-layout tar shard, in order, without reading any image.

    A sample's caption is its `key.txt`, else `key.json[caption_field]` (`shards.sample_caption`). Samples without
    a caption, with an undecodable json, and shards that cannot be read (to the end) are counted in `skipped`
    ("no caption", "bad caption", "unreadable shard") and logged; what was read before an error is kept.
    """
    skipped = Counter() if skipped is None else skipped
    current_key: str | None = None
    sample: dict[str, Any] = {}

    def flush() -> Iterator[str]:
        if current_key is None:
            return
        try:
            caption = sample_caption(sample, caption_field)
        except (ValueError, UnicodeDecodeError, AttributeError):
            skipped["bad caption"] += 1
            return
        if caption:
            yield caption
        else:
            skipped["no caption"] += 1

    try:
        for name, data in _tar_members(url, _is_caption_member):
            key, ext = _split_member(name)
            if key != current_key:
                yield from flush()
                current_key, sample = key, {}
            if data is not None:
                sample[ext] = data
        yield from flush()
    except (OSError, tarfile.TarError, EOFError, ValueError) as exn:
        skipped["unreadable shard"] += 1
        log.warning("skipping the rest of unreadable shard %s: %r", url, exn)


_JSON_TEXT_FIELDS = ("caption", "text", "prompt")


def iter_caption_file(path: str, caption_field: str = "caption", skipped: Counter | None = None) -> Iterator[str]:
    """Captions in a file: `.jsonl`/`.ndjson` (one JSON string or object per line), `.json` (a list of strings or
    objects), anything else one caption per line. Objects give `caption_field`, else "caption", "text" or "prompt"
    (so a benchmark prompts.json reads too). Empty and undecodable entries are counted in `skipped`."""
    skipped = Counter() if skipped is None else skipped
    fields = (caption_field,) + tuple(f for f in _JSON_TEXT_FIELDS if f != caption_field)

    def text_of(item: Any) -> str | None:
        if isinstance(item, str):
            return item.strip()
        if isinstance(item, dict):
            for name in fields:
                value = item.get(name)
                if isinstance(value, str):
                    return value.strip()
        return None

    lower = path.lower()
    if lower.endswith(".json"):
        with open(path, encoding="utf-8") as f:
            try:
                items = json.load(f)
            except ValueError as exn:
                raise ValueError(f"{path}: not a JSON list of captions ({exn}); use .jsonl for one per line") from None
        if not isinstance(items, list):
            raise ValueError(f"{path}: expected a JSON list of captions or objects, got {type(items).__name__}")
        for item in items:
            text = text_of(item)
            if text:
                yield text
            else:
                skipped["no caption"] += 1
        return
    is_jsonl = lower.endswith((".jsonl", ".ndjson"))
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            if is_jsonl:
                try:
                    text = text_of(json.loads(line))
                except ValueError:
                    skipped["bad caption"] += 1
                    continue
                if not text:
                    skipped["no caption"] += 1
                    continue
                yield text
            else:
                yield line


# --------------------------------------------------------------------------------------------------------------
# Counting
# --------------------------------------------------------------------------------------------------------------


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
        for concepts in _extract_batch(extractor, buffer):
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


def _source_captions(source: tuple[str, str], caption_field: str, skipped: Counter) -> Iterator[str]:
    kind, path = source
    if kind == "shard":
        return iter_shard_captions(path, caption_field, skipped)
    return iter_caption_file(path, caption_field, skipped)


def _count_source(job: tuple[tuple[str, str], Extractor, str]) -> ConceptStats:
    """One shard or caption file -> its ConceptStats (runs in worker processes)."""
    source, extractor, caption_field = job
    stats = ConceptStats(sources=[source[1]])
    _count_into(stats, _source_captions(source, caption_field, stats.skipped), extractor)
    return stats


def collect_stats(
    shards: str | Sequence[str] | None = None,
    captions: str | Sequence[str] | None = None,
    extractor: Extractor | None = None,
    caption_field: str = "caption",
    workers: int = 1,
    progress: bool = False,
) -> ConceptStats:
    """Concept statistics of tar shards (anything `expand_urls` accepts) and/or caption files.

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
        jobs = [(source, extractor, caption_field) for source in sources]
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
        return total
    bar = make_bar()
    try:
        for done, source in enumerate(sources, 1):
            if bar is not None:
                bar.set_postfix_str(f"source {done}/{len(sources)}", refresh=False)
            part = ConceptStats(sources=[source[1]])
            _count_into(part, _source_captions(source, caption_field, part.skipped), extractor, bar)
            total.merge(part)
    finally:
        if bar is not None:
            bar.close()
    return total


# --------------------------------------------------------------------------------------------------------------
# Buckets
# --------------------------------------------------------------------------------------------------------------


def assign_buckets(
    counts: Mapping[str, int],
    method: str = "share",
    head_share: float = 0.5,
    torso_share: float = 0.3,
    head_min_count: int = 101,
    torso_min_count: int = 11,
    thresholds: Mapping[str, int] | None = None,
) -> dict[str, str]:
    """concept -> "head" | "torso" | "tail" (definitions in the module docstring).

    method="share" (default): by cumulative share of occurrences (`head_share`, `torso_share`); "count": head if
    count >= head_min_count, torso if count >= torso_min_count. `thresholds` ({"head_min_count", "torso_min_count"},
    as recorded in concepts.json) overrides both and applies a recorded split to new counts.
    """
    if thresholds is not None:
        method, head_min_count, torso_min_count = "count", thresholds["head_min_count"], thresholds["torso_min_count"]
    if method == "count":
        if torso_min_count > head_min_count:
            raise ValueError(f"need torso_min_count <= head_min_count (got {torso_min_count} > {head_min_count})")
        return {
            c: "head" if n >= head_min_count else "torso" if n >= torso_min_count else "tail" for c, n in counts.items()
        }
    if method != "share":
        raise ValueError(f"unknown bucket method {method!r}: use 'share' or 'count'")
    if not (0 < head_share <= 1 and 0 <= torso_share and head_share + torso_share <= 1):
        raise ValueError(f"need 0 < head_share, 0 <= torso_share, head_share + torso_share <= 1 "
                         f"(got {head_share}, {torso_share})")
    total = sum(counts.values())
    if total <= 0:
        return {c: "tail" for c in counts}
    by_count: dict[int, int] = Counter()
    for n in counts.values():
        by_count[n] += n
    bucket_of_count: dict[int, str] = {}
    before = 0
    for n in sorted(by_count, reverse=True):
        share = before / total
        bucket_of_count[n] = "head" if share < head_share else "torso" if share < head_share + torso_share else "tail"
        before += by_count[n]
    return {c: bucket_of_count[n] if n > 0 else "tail" for c, n in counts.items()}


def bucket_summary(counts: Mapping[str, int], buckets: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    """Per bucket: number of concepts, count range, rank range (1-based) and share of all occurrences."""
    total = sum(counts.values()) or 1
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    out: dict[str, dict[str, Any]] = {}
    for name in BUCKETS:
        rows = [(rank, c, n) for rank, (c, n) in enumerate(ranked, 1) if buckets.get(c) == name]
        out[name] = {
            "num_concepts": len(rows),
            "min_count": min((n for _, _, n in rows), default=None),
            "max_count": max((n for _, _, n in rows), default=None),
            "first_rank": rows[0][0] if rows else None,
            "last_rank": rows[-1][0] if rows else None,
            "occurrence_share": sum(n for _, _, n in rows) / total,
        }
    return out


_BUCKET_ORDER = {"tail": 0, "torso": 1, "head": 2}


def caption_buckets(
    caption: str, buckets: Mapping[str, str], extractor: Extractor | None = None, unseen: str | None = "tail"
) -> tuple[str, ...]:
    """The buckets a caption's concepts fall in, rarest first (e.g. ("tail", "head")); () if it names none.

    The first entry is the caption's bucket (that of its rarest concept, `caption_bucket`). Concepts not in
    `buckets` count as `unseen` ("tail" by default: never seen when the statistics were made), or are ignored
    when `unseen` is None. `extractor` defaults to the bundled-vocabulary extractor.
    """
    found = set()
    for concept in (extractor or default_extractor())(caption):
        bucket = buckets.get(concept, unseen)
        if bucket is not None:
            found.add(bucket)
    return tuple(sorted(found, key=_BUCKET_ORDER.__getitem__))


def caption_bucket(
    caption: str, buckets: Mapping[str, str], extractor: Extractor | None = None, unseen: str | None = "tail"
) -> str | None:
    """The bucket of the caption's rarest concept, or None if it names no known concept."""
    touched = caption_buckets(caption, buckets, extractor, unseen)
    return touched[0] if touched else None


class CaptionBucketer:
    """Caption → the bucket of its rarest concept ("head" / "torso" / "tail", None if it names no known concept),
    as recorded in a concepts.json: the labels of the training monitor (imba.monitor.BucketMonitor)."""

    def __init__(self, buckets: Mapping[str, str], extractor: Extractor | None = None):
        self.buckets = dict(buckets)
        self.extractor = extractor or default_extractor()

    @classmethod
    def from_stats(cls, path: str | os.PathLike) -> "CaptionBucketer":
        stats = load_stats(path)
        return cls({row["concept"]: row["bucket"] for row in stats["concepts"]}, extractor_from_stats(stats))

    def __call__(self, captions: Sequence[str]) -> list[str | None]:
        return [caption_bucket(c, self.buckets, self.extractor) for c in captions]


# --------------------------------------------------------------------------------------------------------------
# Co-occurrence
# --------------------------------------------------------------------------------------------------------------


def npmi(count_a: int, count_b: int, count_ab: int, n: int) -> float:
    """Normalised PMI of two concepts over n captions: -1 if they never co-occur, 1 if p(a,b) = 1."""
    if n <= 0 or count_a <= 0 or count_b <= 0:
        raise ValueError(f"npmi needs n > 0 and positive counts (got n={n}, count_a={count_a}, count_b={count_b})")
    if count_ab <= 0:
        return -1.0
    p_ab = count_ab / n
    if p_ab >= 1.0:
        return 1.0
    pmi = math.log(p_ab / ((count_a / n) * (count_b / n)))
    return pmi / -math.log(p_ab)


def cooccurrence_table(stats: ConceptStats, top_k: int = 50) -> list[dict[str, Any]]:
    """All pairs of the `top_k` most frequent concepts (a more frequent than b), sorted by NPMI, highest first."""
    top = [c for c, _ in stats.ranked()[:top_k]]
    rank = {c: i for i, c in enumerate(top)}
    rows = []
    for a, b in itertools.combinations(top, 2):
        ca, cb = stats.counts[a], stats.counts[b]
        cab = stats.pair_counts.get((a, b) if a < b else (b, a), 0)
        rows.append({"a": a, "b": b, "count_a": ca, "count_b": cb, "count_ab": cab,
                     "npmi": npmi(ca, cb, cab, stats.num_captions)})
    rows.sort(key=lambda r: (-r["npmi"], -r["count_ab"], rank[r["a"]], rank[r["b"]]))
    return rows


# --------------------------------------------------------------------------------------------------------------
# Long-tail plot (PIL only)
# --------------------------------------------------------------------------------------------------------------

BUCKET_COLOURS = {"head": (31, 119, 180), "torso": (255, 127, 14), "tail": (44, 160, 44)}


def _font(size: int):
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=size)  # Pillow >= 10.1 with FreeType: a scalable bundled font
    except (TypeError, AttributeError, OSError):
        pass
    try:
        return ImageFont.truetype("DejaVuSans.ttf", size)
    except OSError:
        return ImageFont.load_default()


def _text_size(draw, text: str, font) -> tuple[int, int]:
    left, top, right, bottom = draw.textbbox((0, 0), text, font=font)
    return right - left, bottom - top


def _fmt_int(n: float) -> str:
    return f"{int(n):,}"


def plot_long_tail(
    ranked: Sequence[tuple[str, int]],
    buckets: Mapping[str, str],
    path: str | os.PathLike,
    size: tuple[int, int] = PLOT_SIZE,
    title: str | None = None,
    summary: Mapping[str, Mapping[str, Any]] | None = None,
) -> None:
    """Write a log-log rank-frequency plot of `ranked` [(concept, count), most frequent first] as a PNG.

    Points are coloured by bucket; dashed vertical lines mark the head|torso and torso|tail boundaries; axes have
    decade ticks labelled as powers of ten. Drawn at 2x and downsampled, so lines are smooth; `size` is exact.
    """
    from PIL import Image, ImageDraw

    ss = 2
    width, height = size[0] * ss, size[1] * ss
    img = Image.new("RGB", (width, height), (255, 255, 255))
    draw = ImageDraw.Draw(img)
    f_title, f_label, f_tick, f_sup = _font(17 * ss), _font(14 * ss), _font(13 * ss), _font(9 * ss)
    left, right, top, bottom = 96 * ss, 24 * ss, 48 * ss, 70 * ss
    x0, x1, y0, y1 = left, width - right, top, height - bottom  # plot area; y0 is the top edge

    points = [(rank, n) for rank, (_, n) in enumerate(ranked, 1) if n > 0]
    title = title or "Concept frequency (rank vs captions containing the concept)"
    tw, _ = _text_size(draw, title, f_title)
    draw.text(((width - tw) // 2, 14 * ss), title, fill=(20, 20, 20), font=f_title)
    if not points:
        msg = "no concepts found"
        mw, mh = _text_size(draw, msg, f_label)
        draw.text(((width - mw) // 2, (height - mh) // 2), msg, fill=(90, 90, 90), font=f_label)
        img.resize(size, Image.Resampling.LANCZOS).save(path)
        return

    max_rank, max_n, min_n = len(points), max(n for _, n in points), min(n for _, n in points)
    xl, xh = 0, max(1, math.floor(math.log10(max_rank) + 1e-9))  # decade ticks inside the data range
    yl, yh = math.floor(math.log10(min_n) + 1e-9), math.ceil(math.log10(max_n) - 1e-9)
    if yh <= yl:
        yh = yl + 1
    x_end = max(xh, math.log10(max_rank))
    pad_x, pad_y = 0.03 * x_end, 0.03 * (yh - yl)
    lx0, lx1, ly0, ly1 = -pad_x, x_end + pad_x, yl - pad_y, yh + pad_y

    def px(rank: float) -> float:
        return x0 + (math.log10(rank) - lx0) / (lx1 - lx0) * (x1 - x0)

    def py(n: float) -> float:
        return y1 - (math.log10(n) - ly0) / (ly1 - ly0) * (y1 - y0)

    grid, axis, ink = (232, 232, 232), (60, 60, 60), (30, 30, 30)
    # grid and ticks
    for k in range(xl, xh + 1):
        x = px(10**k)
        draw.line([(x, y0), (x, y1)], fill=grid, width=ss)
        draw.line([(x, y1), (x, y1 + 6 * ss)], fill=axis, width=ss)
        _power_label(draw, x, y1 + 9 * ss, k, f_tick, f_sup, anchor="top")
        if k < xh:
            for m in range(2, 10):
                xm = px(m * 10**k)
                draw.line([(xm, y1), (xm, y1 + 3 * ss)], fill=axis, width=ss)
    for k in range(yl, yh + 1):
        y = py(10**k)
        draw.line([(x0, y), (x1, y)], fill=grid, width=ss)
        draw.line([(x0 - 6 * ss, y), (x0, y)], fill=axis, width=ss)
        _power_label(draw, x0 - 9 * ss, y, k, f_tick, f_sup, anchor="right")
        if k < yh:
            for m in range(2, 10):
                ym = py(m * 10**k)
                draw.line([(x0 - 3 * ss, ym), (x0, ym)], fill=axis, width=ss)
    draw.rectangle([x0, y0, x1, y1], outline=axis, width=ss)

    # bucket boundaries: between the last rank of one bucket and the first of the next
    by_rank = [buckets.get(c, "tail") for c, n in ranked if n > 0]
    boundaries = []
    for i in range(1, len(by_rank)):
        if by_rank[i] != by_rank[i - 1]:
            boundaries.append((math.sqrt(i * (i + 1)), f"{by_rank[i - 1]} | {by_rank[i]}"))
    for rank, label in boundaries:
        x = px(rank)
        y = y0
        while y < y1:
            draw.line([(x, y), (x, min(y + 7 * ss, y1))], fill=(110, 110, 110), width=ss)
            y += 12 * ss
        lw, lh = _text_size(draw, label, f_tick)
        draw.rectangle([x + 4 * ss, y0 + 6 * ss, x + 8 * ss + lw, y0 + 10 * ss + lh], fill=(255, 255, 255))
        draw.text((x + 6 * ss, y0 + 6 * ss), label, fill=(80, 80, 80), font=f_tick)

    # data: a line per bucket stretch, dots when few enough to see
    coords = [(px(r), py(n)) for r, n in points]
    for i in range(1, len(coords)):
        draw.line([coords[i - 1], coords[i]], fill=BUCKET_COLOURS[by_rank[i]], width=2 * ss)
    radius = (3 if len(coords) <= 200 else 2 if len(coords) <= 1000 else 0) * ss
    if radius:
        for (x, y), bucket in zip(coords, by_rank):
            draw.ellipse([x - radius, y - radius, x + radius, y + radius], fill=BUCKET_COLOURS[bucket])

    # axis labels
    xlabel = "concept rank (1 = most frequent)"
    lw, _ = _text_size(draw, xlabel, f_label)
    draw.text(((x0 + x1 - lw) // 2, y1 + 34 * ss), xlabel, fill=ink, font=f_label)
    ylabel = "captions containing the concept"
    lw, lh = _text_size(draw, ylabel, f_label)
    label_img = Image.new("RGBA", (lw + 4 * ss, lh + 8 * ss), (255, 255, 255, 0))
    ImageDraw.Draw(label_img).text((2 * ss, 0), ylabel, fill=ink + (255,), font=f_label)
    label_img = label_img.rotate(90, expand=True)
    img.paste(label_img, (14 * ss, int((y0 + y1 - label_img.height) / 2)), label_img)

    # legend (top right)
    entries = []
    for name in BUCKETS:
        info = (summary or {}).get(name)
        if info is None:
            info = {"num_concepts": sum(1 for b in by_rank if b == name)}
        if not info.get("num_concepts"):
            continue
        text = f"{name}: {_fmt_int(info['num_concepts'])} concepts"
        if "occurrence_share" in info:
            text += f", {100 * info['occurrence_share']:.0f}% of mentions"
        if info.get("min_count") is not None:
            text += f", count >= {_fmt_int(info['min_count'])}"
        entries.append((BUCKET_COLOURS[name], text, False))
    if boundaries:
        entries.append(((110, 110, 110), "bucket boundary", True))
    line_h = 20 * ss
    legend_w = max(_text_size(draw, t, f_tick)[0] for _, t, _ in entries) + 46 * ss
    lx, ly = x1 - legend_w - 10 * ss, y0 + 34 * ss
    draw.rectangle([lx, ly, lx + legend_w, ly + line_h * len(entries) + 10 * ss], fill=(255, 255, 255),
                   outline=(180, 180, 180), width=ss)
    for i, (colour, text, dashed) in enumerate(entries):
        cy = ly + 5 * ss + line_h * i + line_h // 2
        if dashed:
            for sx in range(0, 26 * ss, 9 * ss):
                end = lx + 8 * ss + min(sx + 5 * ss, 26 * ss)
                draw.line([(lx + 8 * ss + sx, cy), (end, cy)], fill=colour, width=ss)
        else:
            draw.line([(lx + 8 * ss, cy), (lx + 34 * ss, cy)], fill=colour, width=2 * ss)
            draw.ellipse([lx + 21 * ss - 3 * ss, cy - 3 * ss, lx + 21 * ss + 3 * ss, cy + 3 * ss], fill=colour)
        _, th = _text_size(draw, text, f_tick)
        draw.text((lx + 40 * ss, cy - th // 2 - 2 * ss), text, fill=ink, font=f_tick)

    img.resize(size, Image.Resampling.LANCZOS).save(path, format="PNG")


def _power_label(draw, x: float, y: float, exponent: int, font, font_sup, anchor: str) -> None:
    """Draw "10" with a superscript exponent, centred below (x, y) ("top") or ending left of it ("right")."""
    base, sup = "10", str(exponent)
    bw, bh = _text_size(draw, base, font)
    sw, sh = _text_size(draw, sup, font_sup)
    total_w = bw + sw + 1
    if anchor == "top":
        bx, by = x - total_w / 2, y + sh * 0.45
    else:
        bx, by = x - total_w, y - bh / 2 - 2
    draw.text((bx, by), base, fill=(40, 40, 40), font=font)
    draw.text((bx + bw + 1, by - sh * 0.45), sup, fill=(40, 40, 40), font=font_sup)


# --------------------------------------------------------------------------------------------------------------
# Writing and reading the statistics
# --------------------------------------------------------------------------------------------------------------


def _bucket_settings(method: str, head_share: float, torso_share: float, head_min_count: int, torso_min_count: int):
    if method == "share":
        return {"method": "share", "head_share": head_share, "torso_share": torso_share,
                "definition": f"head: concepts before which less than {head_share:g} of all concept occurrences "
                              f"lie (most frequent first); torso: less than {head_share + torso_share:g}; tail: rest"}
    return {"method": "count", "head_min_count": head_min_count, "torso_min_count": torso_min_count,
            "definition": f"head: count >= {head_min_count}; torso: count >= {torso_min_count}; tail: rest"}


def write_stats(
    stats: ConceptStats,
    out_dir: str | os.PathLike,
    top_k: int = 50,
    method: str = "share",
    head_share: float = 0.5,
    torso_share: float = 0.3,
    head_min_count: int = 101,
    torso_min_count: int = 11,
    extractor: Any = None,
    plot_size: tuple[int, int] = PLOT_SIZE,
) -> dict[str, str]:
    """Write concepts.csv, concepts.json, long_tail.png and cooccurrence.csv into `out_dir`; return their paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {name: os.path.join(out_dir, name)
             for name in ("concepts.csv", "concepts.json", "long_tail.png", "cooccurrence.csv")}
    ranked = stats.ranked()
    counts = dict(ranked)
    buckets = assign_buckets(counts, method, head_share, torso_share, head_min_count, torso_min_count)
    summary = bucket_summary(counts, buckets)
    n = max(stats.num_captions, 1)
    rows = [{"concept": c, "count": k, "fraction": k / n, "rank": r, "bucket": buckets[c],
             "kind": stats.kinds.get(c, "object")} for r, (c, k) in enumerate(ranked, 1)]

    with open(paths["concepts.csv"], "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["concept", "count", "fraction", "rank", "bucket"])
        for row in rows:
            writer.writerow([row["concept"], row["count"], f"{row['fraction']:.6g}", row["rank"], row["bucket"]])

    head_min = summary["head"]["min_count"]
    torso_min = summary["torso"]["min_count"]
    thresholds = {  # count thresholds equivalent to this split (see assign_buckets(thresholds=...))
        "head_min_count": head_min if head_min is not None else (ranked[0][1] + 1 if ranked else 1),
        "torso_min_count": torso_min if torso_min is not None else (head_min if head_min is not None else 1),
    }
    if method == "count":
        thresholds = {"head_min_count": head_min_count, "torso_min_count": torso_min_count}
    describe = getattr(extractor or default_extractor(), "describe", None)
    payload = {
        "format": STATS_FORMAT,
        "num_captions": stats.num_captions,
        "num_captions_with_concepts": stats.num_with_concepts,
        "num_occurrences": stats.num_occurrences,
        "num_concepts": len(ranked),
        "extractor": describe() if describe is not None else {"name": type(extractor).__name__},
        "buckets": dict(_bucket_settings(method, head_share, torso_share, head_min_count, torso_min_count),
                        **{name: summary[name] for name in BUCKETS}),
        "thresholds": thresholds,
        "skipped": dict(sorted(stats.skipped.items())),
        "sources": {"count": len(stats.sources), "first": stats.sources[:3]},
        "concepts": rows,
        # every pair seen together: [a, b, captions mentioning both] (a < b), most frequent first; the benchmark
        # builder leaves these out (at most V(V-1)/2 rows for a V-concept vocabulary)
        "pairs": [[a, b, k] for (a, b), k in sorted(stats.pair_counts.items(), key=lambda kv: (-kv[1], kv[0]))
                  if k > 0],
    }
    with open(paths["concepts.json"], "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=1)
        f.write("\n")

    title = (f"Concept frequency: {_fmt_int(len(ranked))} concepts in {_fmt_int(stats.num_captions)} captions")
    plot_long_tail(ranked, buckets, paths["long_tail.png"], size=plot_size, title=title, summary=summary)

    with open(paths["cooccurrence.csv"], "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["a", "b", "count_a", "count_b", "count_ab", "npmi"])
        for row in cooccurrence_table(stats, top_k):
            writer.writerow([row["a"], row["b"], row["count_a"], row["count_b"], row["count_ab"], f"{row['npmi']:.6f}"])
    return paths


def load_stats(path: str | os.PathLike) -> dict[str, Any]:
    """The parsed concepts.json (a folder holding one is accepted); one-line errors for wrong files."""
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "concepts.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"concept statistics {path!r} not found: run `python -m data.concepts --out DIR` first")
    with open(path, encoding="utf-8") as f:
        try:
            payload = json.load(f)
        except ValueError as exn:
            raise ValueError(f"{path} is not valid JSON ({exn}); rerun `python -m data.concepts`") from None
    if not isinstance(payload, dict) or payload.get("format") != STATS_FORMAT:
        raise ValueError(f"{path} is not a concepts.json written by data.concepts (format {STATS_FORMAT})")
    return payload


def load_buckets(path: str | os.PathLike) -> dict[str, str]:
    """concept -> bucket as recorded in concepts.json (for `caption_buckets` in a training monitor)."""
    return {row["concept"]: row["bucket"] for row in load_stats(path)["concepts"]}


def extractor_from_stats(stats: Mapping[str, Any] | str | os.PathLike):
    """The extractor that made a concepts.json (same vocabulary file or spaCy model), for `caption_buckets`."""
    if isinstance(stats, (str, os.PathLike)):
        stats = load_stats(stats)
    info = stats.get("extractor", {})
    if info.get("name") == "spacy":
        return make_extractor("spacy", spacy_model=info.get("model", "en_core_web_sm"))
    vocab = info.get("vocab", "default")
    return make_extractor("vocab", None if vocab == "default" else vocab)


# --------------------------------------------------------------------------------------------------------------
# Inert-concept benchmark
# --------------------------------------------------------------------------------------------------------------

# `{a}` and `{b}` are filled with the concepts including their article ("an apple").
TEMPLATES: tuple[str, ...] = (
    "a photo of {a} and {b}",
    "{a} next to {b}",
    "{a} on top of {b}",
    "{a} and {b} side by side",
    "{a} in front of {b}",
    "{a} behind {b}",
    "{a} to the left of {b}",
    "{a} beneath {b}",
    "a close-up photo of {a} beside {b}",
    "a painting of {a} with {b}",
)

_MASS_NOUNS = frozenset(
    "grass water sand snow ice rain fog smoke fire mud dirt hay wheat rice bread toast pasta spaghetti soup salad "
    "meat bacon ham cheese butter yogurt chocolate candy popcorn cereal honey jam ketchup coffee espresso tea "
    "juice milk wine beer soda lemonade champagne money confetti wood metal brick marble concrete plastic leather "
    "fabric wool paper moss bamboo lettuce spinach broccoli cauliflower celery asparagus garlic corn jewelry "
    "lightning sushi".split()
) | {"ice cream", "stained glass"}
# Plural-only concepts: "a pair of" for things that come in pairs, "some" for the rest.
_PAIR_NOUNS = frozenset(
    "jeans pants shorts scissors binoculars pajamas sunglasses goggles leggings headphones earphones chopsticks "
    "skis glasses".split()
) | {"high heels"}
_SOME_NOUNS = frozenset({"clothes", "fireworks", "french fries", "dice", "stairs"})
_AN_EXCEPTIONS = ("uni", "use", "usu", "uk", "eu", "one", "ufo")  # vowel letter, consonant sound: "a unicorn"


def _noun_phrase(concept: str) -> str:
    """The concept with an article: "an apple", "a unicorn", "some water", "a pair of jeans"."""
    if concept in _PAIR_NOUNS:
        return f"a pair of {concept}"
    if concept in _MASS_NOUNS or concept in _SOME_NOUNS:
        return f"some {concept}"
    first = concept.split()[0]
    vowel = (first[0] in "aeiou" and not first.startswith(_AN_EXCEPTIONS)) or first in ("hour", "honest", "suv")
    return f"{'an' if vowel else 'a'} {concept}"


def _rand_index(rng, n: int) -> int:
    return min(n - 1, int(rng.random() * n))


def _shuffled(rng, items: Sequence) -> list:
    out = list(items)
    for i in range(len(out) - 1, 0, -1):  # Fisher-Yates with random() only (stable across Python versions)
        j = _rand_index(rng, i + 1)
        out[i], out[j] = out[j], out[i]
    return out


def log_frequency_bins(counts: Mapping[str, int], num_bins: int) -> tuple[list[list[str]], list[float]]:
    """Split concepts into `num_bins` bins of equal width in log(count), bin 0 the rarest.

    Returns (bins, edges): bins[i] = concepts (most frequent first, ties alphabetical), edges = num_bins + 1
    count values bounding them (bin i holds lo_i <= count < hi_i, the last bin includes its upper edge).
    """
    if num_bins < 1:
        raise ValueError(f"num_bins must be >= 1 (got {num_bins})")
    items = sorted(((c, n) for c, n in counts.items() if n > 0), key=lambda kv: (-kv[1], kv[0]))
    if not items:
        return [[] for _ in range(num_bins)], [1.0] * (num_bins + 1)
    lo, hi = math.log(items[-1][1]), math.log(items[0][1])
    width = (hi - lo) / num_bins
    bins: list[list[str]] = [[] for _ in range(num_bins)]
    for concept, n in items:
        index = 0 if width == 0 else min(num_bins - 1, int((math.log(n) - lo) / width))
        bins[index].append(concept)
    edges = [math.exp(lo + i * width) for i in range(num_bins + 1)]
    return bins, edges


def build_benchmark(
    stats: Mapping[str, Any] | str | os.PathLike,
    per_bin: int = 5,
    num_pairs: int = 50,
    captions_per_pair: int = 4,
    seed: int = 0,
    num_bins: int = 6,
    min_count: int = 1,
    include_attributes: bool = False,
    templates: Sequence[str] = TEMPLATES,
    allow_cooccurring: bool = False,
) -> list[dict[str, Any]]:
    """Inert-concept composition prompts from concept statistics (a concepts.json path or its parsed dict).

    Returns a list of {"prompt", "concepts": [a, b], "counts", "buckets", "bins", "template"}, deterministic in
    (stats, arguments). See the module docstring for the sampling recipe. Pairs seen together in a training
    caption are left out (so fewer than `num_pairs` may come out) unless `allow_cooccurring`.
    """
    if isinstance(stats, (str, os.PathLike)):
        stats = load_stats(stats)
    together: set[frozenset] = set()
    if not allow_cooccurring:
        if "pairs" not in stats:
            raise ValueError("these concept statistics hold no pair counts (written by an older data.concepts): "
                             "rerun `python -m data.concepts stats`, or allow co-occurring pairs "
                             "(--allow-cooccurring)")
        together = {frozenset((a, b)) for a, b, k in stats["pairs"] if k > 0}
    if per_bin < 1 or num_pairs < 1 or captions_per_pair < 1:
        raise ValueError("per_bin, num_pairs and captions_per_pair must be >= 1")
    if not templates or any("{a}" not in t or "{b}" not in t for t in templates):
        raise ValueError("every template needs both {a} and {b}")
    rows = {r["concept"]: r for r in stats["concepts"]}
    counts = {c: r["count"] for c, r in rows.items()
              if r["count"] >= min_count and (include_attributes or r.get("kind", "object") == "object")}
    if len(counts) < 2:
        raise ValueError(f"need at least 2 concepts with count >= {min_count} to pair (have {len(counts)})")
    bins, _ = log_frequency_bins(counts, num_bins)
    bin_of: dict[str, int] = {}
    rng = random.Random(seed)
    for index, members in enumerate(bins):
        for concept in _shuffled(rng, members)[:per_bin]:
            bin_of[concept] = index
    chosen = sorted(bin_of, key=lambda c: (bin_of[c], -counts[c], c))

    groups: dict[tuple[int, int], list[tuple[str, str]]] = {}
    for a, b in itertools.combinations(chosen, 2):
        if frozenset((a, b)) in together:
            continue
        key = tuple(sorted((bin_of[a], bin_of[b])))
        groups.setdefault(key, []).append((a, b))
    order = sorted(groups, key=lambda k: (k[0] + k[1], k[0]))
    queues = {k: _shuffled(rng, groups[k]) for k in order}
    pairs: list[tuple[str, str]] = []
    while len(pairs) < num_pairs and any(queues.values()):
        for key in order:
            if queues[key] and len(pairs) < num_pairs:
                pairs.append(queues[key].pop())

    prompts = []
    for a, b in pairs:
        picks: list[int] = []
        while len(picks) < captions_per_pair:
            picks.extend(_shuffled(rng, range(len(templates)))[: captions_per_pair - len(picks)])
        for t in picks:
            first, second = (a, b) if rng.random() < 0.5 else (b, a)
            template = templates[t]
            prompts.append({
                "prompt": template.format(a=_noun_phrase(first), b=_noun_phrase(second)),
                "concepts": [first, second],
                "counts": [counts[first], counts[second]],
                "buckets": [rows[first].get("bucket"), rows[second].get("bucket")],
                "bins": [bin_of[first], bin_of[second]],
                "template": template,
            })
    return prompts


# --------------------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------------------

_DESCRIPTION = """\
Concept statistics of a caption set and an inert-concept benchmark built from them.

  stats (default)   python -m data.concepts --shards 'shards/{000000..000009}.tar' --out stats/
                    python -m data.concepts --captions captions.jsonl --out stats/
  build-benchmark   python -m data.concepts build-benchmark --stats stats/concepts.json --out prompts.json

`stats` writes into --out:
  concepts.csv      concept, count (captions mentioning it), fraction of captions, rank, bucket
  concepts.json     the same rows plus totals, the bucket definition, per-bucket ranges and the equivalent
                    count thresholds (read it with data.concepts.load_buckets for per-bucket monitoring),
                    and every pair of concepts seen together with its count (build-benchmark leaves them out)
  long_tail.png     log-log rank vs count, coloured by head/torso/tail, bucket boundaries dashed
  cooccurrence.csv  pairs of the top-K concepts: a, b, count_a, count_b, count_ab, npmi (highest first)
and prints the most correlated pairs (spurious-correlation candidates) and frequent pairs never seen together.
Buckets (default): head = most frequent concepts covering the first 50% of concept mentions, torso = next 30%,
tail = the rest. Run `python -m data.concepts stats --help` for all options."""


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m data.concepts", description=_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", metavar="{stats,build-benchmark}")

    st = sub.add_parser("stats", help="count concepts, write concepts.csv/.json, long_tail.png, cooccurrence.csv",
                        description=_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    st.add_argument("--shards", nargs="+", metavar="SPEC",
                    help="tar shards: file, folder, glob or brace pattern ('dir/{000000..000009}.tar'), several OK")
    st.add_argument("--captions", nargs="+", metavar="FILE",
                    help="caption files instead of (or besides) shards: .txt (one per line), .jsonl, .json list")
    st.add_argument("--out", required=True, metavar="DIR", help="output folder (created)")
    st.add_argument("--caption-field", default="caption", help="json field holding the caption (default: caption)")
    st.add_argument("--extractor", choices=("vocab", "spacy"), default="vocab",
                    help="vocab: bundled-vocabulary noun matcher (default); spacy: noun-chunk heads (needs spaCy)")
    st.add_argument("--vocab", metavar="FILE", help=f"concept vocabulary replacing the bundled {DEFAULT_VOCAB_PATH}")
    st.add_argument("--spacy-model", default="en_core_web_sm", help="spaCy model for --extractor spacy")
    st.add_argument("--top-k", type=int, default=50, help="concepts in the co-occurrence table (default 50)")
    st.add_argument("--bucket-method", choices=("share", "count"), default="share",
                    help="share: by cumulative share of mentions (default); count: absolute count thresholds")
    st.add_argument("--head-share", type=float, default=0.5, help="share of mentions covered by head (0.5)")
    st.add_argument("--torso-share", type=float, default=0.3, help="share of mentions covered by torso (0.3)")
    st.add_argument("--head-min-count", type=int, default=101, help="--bucket-method count: head if count >= this")
    st.add_argument("--torso-min-count", type=int, default=11, help="--bucket-method count: torso if count >= this")
    st.add_argument("--min-pair-count", type=int, default=5,
                    help="printed correlated pairs must co-occur in at least this many captions (default 5)")
    st.add_argument("--show", type=int, default=10, help="pairs to print (default 10)")
    st.add_argument("--workers", type=int, default=1, help="processes, one shard at a time each (default 1)")
    st.add_argument("--no-progress", action="store_true", help="no progress bar")

    bb = sub.add_parser("build-benchmark", help="inert-concept composition prompts from concepts.json",
                        description="Sample concepts from log-frequency bins, pair them (tail x tail first, up to "
                                    "head x head) and write prompts from templates into a JSON list of "
                                    "{prompt, concepts, counts, buckets, bins, template}. Deterministic in --seed.")
    bb.add_argument("--stats", required=True, metavar="JSON", help="concepts.json written by `stats` (or its folder)")
    bb.add_argument("--out", required=True, metavar="JSON", help="prompt file to write")
    bb.add_argument("--per-bin", type=int, default=5, help="concepts drawn from each frequency bin (default 5)")
    bb.add_argument("--pairs", type=int, default=50, help="concept pairs (default 50)")
    bb.add_argument("--captions-per-pair", type=int, default=4, help="prompts per pair, distinct templates (default 4)")
    bb.add_argument("--bins", type=int, default=6, help="log-frequency bins (default 6, as in the IMBA paper)")
    bb.add_argument("--min-count", type=int, default=1, help="ignore concepts seen in fewer captions (default 1)")
    bb.add_argument("--include-attributes", action="store_true", help="also pair attribute concepts (colours)")
    bb.add_argument("--allow-cooccurring", action="store_true",
                    help="keep pairs seen together in a training caption (left out by default: inert pairs)")
    bb.add_argument("--seed", type=int, default=0)
    return parser


def _print_pairs(stats: ConceptStats, top_k: int, min_pair_count: int, show: int) -> None:
    table = cooccurrence_table(stats, top_k)
    positive = [r for r in table if r["count_ab"] >= min_pair_count and r["npmi"] > 0][:show]
    print(f"most correlated pairs among the top-{top_k} concepts (NPMI, together in >= {min_pair_count} captions); "
          "candidates for spurious correlations:")
    for r in positive:
        print(f"  {r['npmi']:+.3f}  {r['a']} + {r['b']}  (together {r['count_ab']:,}; {r['a']} {r['count_a']:,}, "
              f"{r['b']} {r['count_b']:,})")
    if not positive:
        print("  (none)")
    n = max(stats.num_captions, 1)
    never = [r for r in table if r["count_ab"] == 0 and r["count_a"] * r["count_b"] / n >= min_pair_count]
    never.sort(key=lambda r: -r["count_a"] * r["count_b"])
    if never:
        print("frequent pairs never seen together (expected together >= "
              f"{min_pair_count} if independent): compositions the model never saw:")
        for r in never[:show]:
            print(f"  {r['a']} + {r['b']}  (expected {r['count_a'] * r['count_b'] / n:,.1f})")


def _run_stats(args: argparse.Namespace) -> int:
    if not args.shards and not args.captions:
        raise FileNotFoundError("no input: give --shards (tar shards) or --captions (a caption file)")
    extractor = make_extractor(args.extractor, args.vocab, args.spacy_model)
    stats = collect_stats(args.shards, args.captions, extractor, args.caption_field, args.workers,
                          progress=not args.no_progress)
    if stats.num_captions == 0:
        skipped = ", ".join(f"{v} {k}" for k, v in stats.skipped.items()) or "nothing readable"
        raise ValueError(f"no captions read ({skipped}); check --caption-field and the input paths")
    paths = write_stats(stats, args.out, args.top_k, args.bucket_method, args.head_share, args.torso_share,
                        args.head_min_count, args.torso_min_count, extractor)
    summary = load_stats(paths["concepts.json"])
    skipped = "; skipped: " + ", ".join(f"{v:,} {k}" for k, v in sorted(stats.skipped.items())) if stats.skipped else ""
    print(f"read {stats.num_captions:,} captions from {len(stats.sources):,} source(s){skipped}")
    print(f"{summary['num_concepts']:,} concepts, {summary['num_occurrences']:,} mentions; "
          f"{stats.num_captions - stats.num_with_concepts:,} captions name no concept")
    for name in BUCKETS:
        b = summary["buckets"][name]
        if b["num_concepts"]:
            print(f"  {name:5s}: {b['num_concepts']:,} concepts, ranks {b['first_rank']}-{b['last_rank']}, "
                  f"counts {b['min_count']:,}-{b['max_count']:,}, {100 * b['occurrence_share']:.1f}% of mentions")
    _print_pairs(stats, args.top_k, args.min_pair_count, args.show)
    print("wrote " + ", ".join(paths.values()))
    return 0


def _run_benchmark(args: argparse.Namespace) -> int:
    prompts = build_benchmark(args.stats, args.per_bin, args.pairs, args.captions_per_pair, args.seed, args.bins,
                              args.min_count, args.include_attributes, allow_cooccurring=args.allow_cooccurring)
    folder = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(folder, exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(prompts, f, indent=1)
        f.write("\n")
    pairs = {tuple(p["concepts"]) if p["concepts"][0] < p["concepts"][1] else tuple(p["concepts"][::-1])
             for p in prompts}
    kinds = Counter(" x ".join(sorted(p["buckets"], key=_BUCKET_ORDER.__getitem__)) for p in prompts)
    print(f"wrote {len(prompts)} prompts for {len(pairs)} concept pairs to {args.out} "
          f"({', '.join(f'{k}: {v}' for k, v in sorted(kinds.items()))})")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("stats", "build-benchmark", "-h", "--help"):
        argv.insert(0, "stats")
    args = _build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return _run_benchmark(args) if args.command == "build-benchmark" else _run_stats(args)
    except (FileNotFoundError, ValueError, ExtractorUnavailable) as exn:
        print(f"error: {exn}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    from data.concepts import main as _main  # the package's copy, so worker processes pickle data.concepts.*

    sys.exit(_main())
