"""English words and phrases: tokenising, folding plurals to singulars, and putting articles in front of nouns.

Used by the concept statistics (`data.concepts`), the synthetic captions (`data.synthetic`) and the evaluation
(`imba.eval`), which imports nothing else of data/; this module imports nothing of the project.

Articles. `indefinite_article(word)` is "an" before a vowel sound ("an apple", "an hour", "an SUV") and "a"
otherwise ("a unicorn", "a European car"). On top of it, `with_article` writes a free phrase ("red car" -> "a red
car", phrases that already start with a determiner or a number are kept) and `noun_phrase` a concept name as a
countable thing ("an apple", but "some water" for mass nouns and "a pair of jeans" for plural-only pairs).
`strip_article` is the inverse of `with_article` for the leading articles.
"""

from __future__ import annotations

import re
from typing import Iterable, Iterator

__all__ = [
    "tokenize",
    "singularize",
    "indefinite_article",
    "with_article",
    "strip_article",
    "noun_phrase",
]

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
# Articles
# --------------------------------------------------------------------------------------------------------------

# Vowel letter, consonant sound: "a unicorn", "a European", "a one-way street", "a UFO".
_A_BEFORE_VOWEL = ("uni", "use", "usu", "uten", "ure", "eu", "one", "once", "ubiq", "uk", "ufo")
_AN_BEFORE_H = ("hour", "honest", "honor", "honour", "heir")  # silent h: "an hourglass"
_AN_INITIALISMS = frozenset({"suv"})  # spelled out letter by letter: "an SUV"
_ARTICLES = frozenset({"a", "an", "the", "one", "some"})
# A phrase starting with one of these (or with a digit) already says how many: `with_article` keeps it.
_DETERMINERS = _ARTICLES | {"two", "three", "four", "five", "several", "many", "pair"}

# Concepts named without "a": mass nouns take "some" ...
_MASS_NOUNS = frozenset(
    "grass water sand snow ice rain fog smoke fire mud dirt hay wheat rice bread toast pasta spaghetti soup salad "
    "meat bacon ham cheese butter yogurt chocolate candy popcorn cereal honey jam ketchup coffee espresso tea "
    "juice milk wine beer soda lemonade champagne money confetti wood metal brick marble concrete plastic leather "
    "fabric wool paper moss bamboo lettuce spinach broccoli cauliflower celery asparagus garlic corn jewelry "
    "lightning sushi".split()
) | {"ice cream", "stained glass"}
# ... and plural-only ones "a pair of" for things that come in pairs, "some" for the rest.
_PAIR_NOUNS = frozenset(
    "jeans pants shorts scissors binoculars pajamas sunglasses goggles leggings headphones earphones chopsticks "
    "skis glasses".split()
) | {"high heels"}
_SOME_NOUNS = frozenset({"clothes", "fireworks", "french fries", "dice", "stairs"})


def indefinite_article(word: str) -> str:
    """ "an" if `word` starts with a vowel sound ("apple", "hour", "suv"), else "a" ("unicorn", "euro", "cat")."""
    word = word.lower()
    if word in _AN_INITIALISMS:
        return "an"
    vowel_sound = (word[:1] in ("a", "e", "i", "o", "u") and not word.startswith(_A_BEFORE_VOWEL)) or \
        word.startswith(_AN_BEFORE_H)
    return "an" if vowel_sound else "a"


def with_article(phrase: str) -> str:
    """"red car" → "a red car", "apple" → "an apple"; phrases that already start with a determiner are kept."""
    phrase = phrase.strip()
    first = phrase.split()[0].lower() if phrase else ""
    if not phrase or first in _DETERMINERS or first.isdigit():
        return phrase
    return f"{indefinite_article(first)} {phrase}"


def strip_article(phrase: str) -> str:
    """"a red car." → "red car": leading articles (a, an, the, one, some) and a final full stop removed."""
    words = phrase.strip().rstrip(".").split()
    while words and words[0].lower() in _ARTICLES:
        words = words[1:]
    return " ".join(words)


def noun_phrase(concept: str) -> str:
    """A concept name with its article: "an apple", "a unicorn", "some water", "a pair of jeans"."""
    if concept in _PAIR_NOUNS:
        return f"a pair of {concept}"
    if concept in _MASS_NOUNS or concept in _SOME_NOUNS:
        return f"some {concept}"
    return f"{indefinite_article(concept.split()[0])} {concept}"
