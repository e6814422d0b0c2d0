"""Concept vocabularies and the extractors that find a caption's concepts.

The default extractor, `VocabExtractor`, matches the bundled vocabulary (`data/concepts/concept_vocab.txt`, ~1,000
visual nouns plus colour attributes, including the synthetic set's SHAPES and COLOURS; `--vocab FILE` replaces
it, same format, see the file's header; no download needed): the caption is lower-cased, possessives ("dog's")
and punctuation are dropped, each word is folded to a singular that the vocabulary knows (cats -> cat, boxes ->
box, berries -> berry, leaves -> leaf, mice -> mouse, children -> child: `data.text.singularize`, a small irregulars
table plus suffix rules, tried in order and kept only if the result is a vocabulary word, so "bus" and "glass"
stay themselves), and vocabulary phrases are matched greedily, longest first, left to right ("a teddy bear and a
hot dog" -> teddy bear, hot dog; no bear, no dog). Each concept counts at most once per caption: calling an
extractor gives its concepts once each, in order of first mention. Its `mentions` gives every mention in caption
order, repeats kept ("a red circle and a red square" -> red, circle, red, square), which is what attribute:object
bindings are read from (`data.balance`): from the list without repeats that caption would lose red:square.
`SpacyExtractor` (`--extractor spacy`) uses lemmatised noun-chunk heads (with their compound modifiers) instead,
when spaCy and an English model are installed; the default path never imports spaCy.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

from ..text import singularize, tokenize

__all__ = [
    "DEFAULT_VOCAB_PATH",
    "Extractor",
    "ExtractorUnavailable",
    "Vocabulary",
    "VocabExtractor",
    "SpacyExtractor",
    "load_vocabulary",
    "default_extractor",
    "make_extractor",
    "extract_batch",
]

log = logging.getLogger(__package__)  # the package's name, as the warnings of `python -m data.prep.concepts` print it

DEFAULT_VOCAB_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "concept_vocab.txt")

Extractor = Callable[[str], list[str]]


class ExtractorUnavailable(RuntimeError):
    """The requested concept extractor cannot run here (e.g. spaCy or its model is not installed)."""


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
    # What a caption's entries are read from; part of `describe()`, so a draw plan or entry table computed under
    # another rule (bindings from the list without repeats) is not reused.
    rule = "mentions-in-order"

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

    def mentions(self, caption: str) -> list[str]:
        """Every vocabulary concept the caption mentions, in caption order, repeats kept."""
        words = [self._fold(w) for w in tokenize(caption)]
        found: list[str] = []
        i, n = 0, len(words)
        while i < n:
            step = 1
            if words[i] in self._first:
                for length in range(min(self._max_len, n - i), 0, -1):
                    concept = self._phrases.get(tuple(words[i : i + length]))
                    if concept is not None:
                        found.append(concept)
                        step = length
                        break
            i += step
        return found

    def __call__(self, caption: str) -> list[str]:
        return list(dict.fromkeys(self.mentions(caption)))

    def batch(self, captions: Sequence[str]) -> list[list[str]]:
        return [self(c) for c in captions]

    def kind(self, concept: str) -> str:
        return self.vocabulary.kinds.get(concept, "object")

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "rule": self.rule, "vocab": self.vocabulary.source,
                "vocab_size": len(self.vocabulary)}


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
    def _doc_mentions(doc: Any) -> list[str]:
        found: list[str] = []
        for chunk in doc.noun_chunks:
            root = chunk.root
            if root.pos_ not in ("NOUN", "PROPN"):
                continue
            lemma = root.lemma_.lower().strip()
            if not lemma or lemma in _SPACY_STOP or not any(ch.isalpha() for ch in lemma):
                continue
            compounds = [t.lemma_.lower() for t in root.children if t.dep_ == "compound" and t.i < root.i]
            found.append(" ".join(compounds + [lemma]))
        return found

    def mentions(self, caption: str) -> list[str]:
        """Every noun-chunk concept of the caption, in caption order, repeats kept."""
        return self._doc_mentions(self._nlp(caption))

    def __call__(self, caption: str) -> list[str]:
        return list(dict.fromkeys(self.mentions(caption)))

    def batch(self, captions: Sequence[str]) -> list[list[str]]:
        docs = self._nlp.pipe(captions, batch_size=self.batch_size)
        return [list(dict.fromkeys(self._doc_mentions(doc))) for doc in docs]

    def kind(self, concept: str) -> str:
        return "object"

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "model": self.model}


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


def extract_batch(extractor: Extractor, captions: Sequence[str]) -> list[list[str]]:
    """Each caption's concepts, through the extractor's own `batch` when it has one (spaCy's pipe)."""
    batch = getattr(extractor, "batch", None)
    return batch(captions) if batch is not None else [extractor(c) for c in captions]
