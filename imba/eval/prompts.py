"""Prompt sets for composition evaluation → entries {"prompt", "concepts", optional "category", "relation", ...}.

`concepts` are the phrases a VQA model is asked about, one question each ("Is there a red car in the image?"), so
they carry their attributes ("red car") but no article. Accepted files (`load_prompts`):

- **Inert-concept benchmark** (`python -m data.prep.concepts build-benchmark`): a JSON list of
  {"prompt", "concepts": [a, b], "counts", "buckets", "bins", "template"}; kept as is (buckets drive the summary).
- **LC-Mis style** (a concept pair per prompt; JSON list or JSONL of objects). Fields:
    prompt (required)                       "a zebra playing a piano"
    the pair, first match wins:             "concepts": [a, b, ...] | "concept_a"/"concept_b" |
                                            "concept1"/"concept2" | "object1"/"object2" | "objects": [...]
    relation (optional)                     "playing": the VQA runner then also asks about the whole prompt
    category (optional)                     any label to group the summary by (e.g. "co-occurring", "color")
  any other field is kept. Without a pair, the concepts are parsed from the prompt (below).
- **T2I-CompBench attribute binding** (`color_val.txt`, `shape_val.txt`, `texture_val.txt`, ... one prompt per
  line): the category is given, or read from the file name (color/colour, shape, texture); prompts such as
  "a red car and a blue bench" are split into noun phrases at "and" and commas, and each phrase into
  (attribute, noun): the attribute is the longest run of leading words found in the category's word list
  (`ATTRIBUTE_WORDS`), else the first word ("red fire hydrant" → red, fire hydrant; a one-word phrase has no
  attribute). Entries get "pairs": [[attribute, noun], ...] and "concepts": ["red car", "blue bench"].
- Any other `.txt` file: one prompt per line, concepts parsed from the noun phrases, no attribute split.
- A list of plain strings in JSON: treated like a `.txt` file.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Iterable

from data.text import strip_article

ATTRIBUTE_CATEGORIES = ("color", "shape", "texture")
_CATEGORY_ALIASES = {"colour": "color", "colors": "color", "colours": "color", "shapes": "shape",
                     "textures": "texture"}
ATTRIBUTE_WORDS = {
    "color": {"red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white", "gray",
              "grey", "gold", "golden", "silver", "beige", "violet", "cyan", "magenta", "turquoise", "teal",
              "maroon", "navy", "tan", "crimson", "ivory", "khaki", "olive", "lavender", "indigo", "light", "dark",
              "bright", "pale"},
    "shape": {"round", "square", "rectangular", "triangular", "oval", "circular", "cylindrical", "spherical",
              "conical", "cubic", "cubical", "hexagonal", "pentagonal", "octagonal", "diamond", "heart-shaped",
              "star-shaped", "oblong", "curved", "flat", "pointed", "big", "small", "large", "tiny", "tall",
              "short", "long", "thin", "thick", "wide", "narrow"},
    "texture": {"wooden", "metallic", "metal", "plastic", "glass", "leather", "fluffy", "furry", "rubber",
                "fabric", "woolen", "wool", "silk", "silky", "velvet", "cotton", "denim", "ceramic", "stone",
                "marble", "paper", "cardboard", "rough", "smooth", "soft", "shiny", "glossy", "knitted", "feathered",
                "golden", "steel", "iron", "brick", "concrete", "crystal"},
}
_SPLIT = re.compile(r"\s*,\s*(?:and\s+)?|\s+and\s+", re.IGNORECASE)
_PAIR_KEYS = (("concept_a", "concept_b"), ("concept1", "concept2"), ("object1", "object2"))


class PromptFileError(ValueError):
    """A prompt file that cannot be read as one of the accepted formats (one line, names the fix)."""


def normalize_category(category: str | None) -> str | None:
    if not category:
        return None
    category = category.strip().lower()
    return _CATEGORY_ALIASES.get(category, category)


def category_from_filename(path: str | Path) -> str | None:
    """"color_val.txt" → "color", "texture_train.txt" → "texture"; None when the name has no known category."""
    stem = Path(path).stem.lower()
    head = re.split(r"[_\-.]", stem)[0]
    category = normalize_category(head)
    return category if category in ATTRIBUTE_CATEGORIES else None


def noun_phrases(prompt: str) -> list[str]:
    """Noun phrases of "a red car and a blue bench" / "a cat, a dog and a bird" without their articles."""
    parts = [strip_article(part) for part in _SPLIT.split(prompt.strip().rstrip("."))]
    return [part for part in parts if part]


def split_attribute(phrase: str, category: str | None = None) -> tuple[str, str]:
    """(attribute, noun) of a noun phrase without article: "red fire hydrant" → ("red", "fire hydrant")."""
    words = phrase.split()
    if len(words) < 2:
        return "", phrase
    known = ATTRIBUTE_WORDS.get(normalize_category(category) or "", set())
    n = 0
    while n < len(words) - 1 and words[n].lower() in known:
        n += 1
    n = n or 1
    return " ".join(words[:n]), " ".join(words[n:])


def parse_attribute_binding(prompt: str, category: str | None = None) -> list[tuple[str, str]]:
    """[(attribute, noun), ...] of a T2I-CompBench attribute-binding prompt."""
    return [split_attribute(phrase, category) for phrase in noun_phrases(prompt)]


def entry_from_prompt(prompt: str, category: str | None = None, **fields: Any) -> dict[str, Any]:
    """An entry for a bare prompt: concepts parsed from its noun phrases (attribute + noun for binding categories)."""
    category = normalize_category(category)
    entry: dict[str, Any] = {"prompt": prompt, **fields}
    if category in ATTRIBUTE_CATEGORIES:
        pairs = parse_attribute_binding(prompt, category)
        entry["pairs"] = [list(p) for p in pairs]
        entry["concepts"] = [f"{a} {n}".strip() for a, n in pairs]
    else:
        entry["concepts"] = noun_phrases(prompt)
    if category:
        entry["category"] = category
    return entry


def normalize_entry(item: Any, category: str | None = None, where: str = "") -> dict[str, Any]:
    """One prompt-file item (a string or an object) → an entry with "prompt" and "concepts"."""
    if isinstance(item, str):
        return entry_from_prompt(item, category)
    if not isinstance(item, dict) or not isinstance(item.get("prompt"), str) or not item["prompt"].strip():
        raise PromptFileError(f"{where}: expected a string or an object with a 'prompt' field, got {item!r:.80}")
    entry = dict(item)
    if category and not entry.get("category"):
        entry["category"] = normalize_category(category)
    concepts = entry.get("concepts")
    if concepts is None:
        for a, b in _PAIR_KEYS:
            if entry.get(a) and entry.get(b):
                concepts = [entry[a], entry[b]]
                break
        else:
            concepts = entry.get("objects")
    if concepts is None:
        parsed = entry_from_prompt(entry["prompt"], entry.get("category"))
        concepts = parsed["concepts"]
        if "pairs" in parsed:
            entry.setdefault("pairs", parsed["pairs"])
    if isinstance(concepts, str) or not all(isinstance(c, str) and c.strip() for c in concepts):
        raise PromptFileError(f"{where}: 'concepts' must be a list of non-empty strings, got {concepts!r:.80}")
    entry["concepts"] = [strip_article(c) or c.strip() for c in concepts]
    return entry


def read_prompt_items(path: Path) -> list[Any]:
    """The raw items of a .txt (one per line, # comments), .json (a list, or {"prompts": [...]}) or .jsonl prompt
    file: strings or objects; PromptFileError (one line) when it is not valid."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".txt":
        lines = (line.strip() for line in text.splitlines())
        return [line for line in lines if line and not line.startswith("#")]
    try:
        if path.suffix == ".jsonl":
            return [json.loads(line) for line in text.splitlines() if line.strip()]
        items = json.loads(text)
    except json.JSONDecodeError as err:
        raise PromptFileError(f"{path} is not valid JSON: {err}") from err
    if isinstance(items, dict) and isinstance(items.get("prompts"), list):
        items = items["prompts"]
    if not isinstance(items, list):
        raise PromptFileError(f"{path} must hold a list of prompts (strings or objects with a 'prompt' field)")
    return items


def load_prompts(path: str | Path, category: str | None = None) -> list[dict[str, Any]]:
    """Entries of a prompt file (format by extension: .txt, .json, .jsonl; see the module docstring)."""
    path = Path(path)
    if not path.is_file():
        raise PromptFileError(f"prompt file {path} not found")
    if path.suffix not in (".txt", ".json", ".jsonl"):
        raise PromptFileError(f"unknown prompt file type {path.suffix!r} ({path}): use .txt, .json or .jsonl")
    category = normalize_category(category) or (category_from_filename(path) if path.suffix == ".txt" else None)
    entries = [normalize_entry(item, category, f"{path}, entry {i}") for i, item in enumerate(read_prompt_items(path))]
    if not entries:
        raise PromptFileError(f"{path} holds no prompts")
    return entries


def attach_entries(rows: Iterable[dict[str, Any]], entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Join prompt entries onto sampler manifest rows: by prompt_index when that entry has the same prompt, else
    by prompt text. Manifest fields win over entry fields of the same name (except empty ones)."""
    by_text: dict[str, dict[str, Any]] = {}
    for entry in entries:
        by_text.setdefault(entry["prompt"], entry)
    joined = []
    for row in rows:
        index = row.get("prompt_index")
        entry = entries[index] if isinstance(index, int) and 0 <= index < len(entries) else None
        if entry is None or entry["prompt"] != row["prompt"]:
            entry = by_text.get(row["prompt"])
        if entry is None:
            raise PromptFileError(f"prompt {row['prompt']!r} of {row.get('image')} is not in the prompt file")
        joined.append({**entry, **{k: v for k, v in row.items() if v not in (None, "", [])}})
    return joined
