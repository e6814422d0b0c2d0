"""The synthetic world of the composition benchmark: two-object scenes built from a long-tailed pool of object
tiles, the long-tailed and the pair-balanced training streams, a word-level text encoder, the oracle that reads
generated scenes, the probe prompts the benchmark evaluates on and the success per bucket.

A *pair* is one (colour, shape) object. A tile is a 16 × 16 RGB render of one pair (`data.synthetic.render_objects`);
a scene is two tiles side by side (16 × 32), captioned "a <colour> <shape> and a <colour> <shape>", left object
first. Two worlds (`PairWorld`): in "concept_tail" colours and shapes are Zipf-distributed independently with a steep
exponent (a rare pair is a pair of rare words); in "pair_tail" every colour and shape is about equally frequent and
their combinations are long-tailed (a rare pair of common words). Either way the pool holds hundreds to thousands of
tiles of the head pairs and 8 of the rarest; a few pairs are *held out*: each of their concepts is seen with other
partners, never together. Which colour and shape take which frequency rank is permuted per seed.

Three streams draw objects from the *same* tile pool:
- long-tailed: each tile uniformly from the pool, so a pair appears as often as it is in the pool;
- pair-balanced (the control a balancing method is measured against): a seen pair uniformly, then one of its tiles;
- concept-balanced: a seen pair from the pool's table with uniform colour and shape marginals, then one of its tiles.
Scenes are composed at batch time from two drawn tiles ("online"), or once per seed into a fixed pool of scenes
(`ScenePool`, "fixed"), from which a stream draws per object and trains on the whole scene that holds it.

Data levers (the systematic-generalisation work on data distributional properties), each on the long-tailed stream:
- colour diversity: extra pool tiles in one of `HUES` hues around the colour wheel, each hue a caption word of its
  own ("hue17"), shapes drawn from the world's shape distribution, so the shapes are seen with many more colours;
- burstiness: the second object of a scene takes the first one's colour with some probability, so within a scene
  the colour does not tell the shapes apart;
- latent intervention: each training tile's hue is rotated by a random angle (colour jitter), the caption kept.

Reading a scene: the oracle classifies each half into a colour and a shape or "nothing". A prompt succeeds when both
halves show the prompted colour on the prompted shape; failures are split into a missing object, a colour on the
wrong shape (a colour that belongs to the other object of the prompt) and anything else.
"""

from __future__ import annotations

import colorsys
import random
import statistics
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from composition_worlds import DRAWN_PREFIX, WorldLaw, balance_marginals, draw_law, is_drawn

from data.images import image_to_tensor
from data.synthetic import render_objects

COLOURS = ("red", "blue", "green", "yellow", "purple", "orange", "black", "cyan")
SHAPES = ("circle", "square", "triangle", "cross", "ring")  # distinct at 16 px (star/hexagon blur into circles)
NOTHING = len(SHAPES)  # the oracle's extra shape class: an empty half
TILE = 16
SIZE_RANGE = (0.55, 0.8)  # object side as a fraction of the tile: large enough to read its shape at 16 px
ZIPF = 2.0
POOL_TILES = 8192
MIN_TILES = 8  # every seen pair has at least this many tiles in the pool (the balanced stream draws from them)
# (colour rank, shape rank), rank 0 the most frequent: never shown in training; each concept is seen with other
# partners. In the identity world (seed None) ranks are the listed order, so these are blue cross, yellow square, ...
HELD_OUT = ((1, 3), (3, 1), (4, 2), (5, 0), (6, 4), (7, 1))
# the second world: a pair's frequency falls by PAIR_DECAY per level (colour rank + shape rank) mod 5, so every
# colour has one pair at each level; the held-out pairs are six of the rarest level, one per colour rank 1-7 but 2
HELD_OUT_PAIR_TAIL = ((1, 3), (3, 1), (4, 0), (5, 4), (6, 3), (7, 2))
PAIR_DECAY = 4.0
# "captioned": pair_tail's images (the same tiles, scenes and labels per seed) with captions as a re-captioner writes
# them (`realistic_caption`); only what reads the captions (the balancing of WEIGHTED_STREAMS) sees a difference
WORLDS = ("concept_tail", "pair_tail", "captioned")
IMAGES_OF = {"concept_tail": "concept_tail", "pair_tail": "pair_tail", "captioned": "pair_tail"}
HUES = 64  # the colour-diversity lever's extra colours: colour index len(COLOURS) + k is hue k of HUES
BUCKETS = ("head", "torso", "tail", "held_out")
FAILURES = ("missing_object", "colour_on_wrong_shape", "other")
STREAMS = ("long_tailed", "pair_balanced", "concept_balanced")


def images_of(kind: str) -> str:
    """The world whose images, labels and draws `kind` shares (a drawn world its own)."""
    return IMAGES_OF.get(kind, kind)


def check_world(kind: str) -> None:
    if kind not in WORLDS and not is_drawn(kind):
        raise ValueError(f"unknown world {kind!r}; choose one of {', '.join(WORLDS)} or {DRAWN_PREFIX}K "
                         f"(composition_worlds.py)")


def permutation(n: int, generator: torch.Generator) -> tuple[int, ...]:
    return tuple(torch.randperm(n, generator=generator).tolist())


@dataclass(frozen=True)
class PairWorld:
    """Pair probabilities of the training distribution and the benchmark's buckets (head / torso / tail by the
    training frequency of the pair, in thirds of the seen pairs; held-out pairs on their own).

    kind "concept_tail": colours and shapes each Zipf(`zipf`)-distributed and independent, so a rare pair is a pair of
    rare words. kind "pair_tail": every colour and every shape about equally frequent (the table's marginals are made
    uniform), their combinations long-tailed (a factor PAIR_DECAY per level), so a rare pair is a pair of common words.
    `seed`: None keeps the listed order of COLOURS and SHAPES as their frequency ranks; an integer permutes which
    colour and which shape takes each rank (and so which named pairs are held out) from the seed, so a concept's
    difficulty to draw is not tied to its frequency. kind "drawn-K": the world K of the family of
    `composition_worlds` (its law in `law`), whose ranks the seed permutes the same way.
    `caption_noise`: None where the captions are the template's, else the scale of the re-captioner's error rates
    (`realistic_caption`): 1 for "captioned", the law's for a drawn world."""

    kind: str = "concept_tail"
    seed: int | None = None
    zipf: float = ZIPF
    colour_rank: tuple[int, ...] = field(init=False)  # colour index → its frequency rank
    shape_rank: tuple[int, ...] = field(init=False)
    held_out: tuple[tuple[int, int], ...] = field(init=False)
    pairs: list[tuple[int, int]] = field(init=False)
    probs: torch.Tensor = field(init=False)
    buckets: dict[tuple[int, int], str] = field(init=False)
    law: WorldLaw | None = field(init=False)
    caption_noise: float | None = field(init=False)

    def __post_init__(self) -> None:
        check_world(self.kind)
        images = images_of(self.kind)
        law = draw_law(int(self.kind[len(DRAWN_PREFIX):])) if is_drawn(self.kind) else None
        if self.seed is None:
            colour_at, shape_at = tuple(range(len(COLOURS))), tuple(range(len(SHAPES)))
        else:
            # a drawn world's offset lies past the named ones': its permutation is none of theirs
            offset = 100 + int(self.kind[len(DRAWN_PREFIX):]) if law else WORLDS.index(images)
            g = torch.Generator().manual_seed(10007 * self.seed + offset)
            colour_at, shape_at = permutation(len(COLOURS), g), permutation(len(SHAPES), g)
        colour_rank = tuple(colour_at.index(c) for c in range(len(COLOURS)))
        shape_rank = tuple(shape_at.index(s) for s in range(len(SHAPES)))
        ranks = law.held_out if law else HELD_OUT if images == "concept_tail" else HELD_OUT_PAIR_TAIL
        held_out = tuple((colour_at[rc], shape_at[rs]) for rc, rs in ranks)
        pairs = [(c, s) for c in range(len(COLOURS)) for s in range(len(SHAPES))]
        table = torch.zeros(len(COLOURS), len(SHAPES), dtype=torch.float64)
        by_rank = law.table(len(COLOURS), len(SHAPES)) if law else None
        for c, s in pairs:
            if (c, s) in held_out:
                continue
            rc, rs = colour_rank[c], shape_rank[s]
            table[c, s] = (by_rank[rc, rs] if law else 1.0 / ((rc + 1) * (rs + 1)) ** self.zipf
                           if images == "concept_tail" else PAIR_DECAY ** -((rc + rs) % len(SHAPES)))
        if images == "pair_tail":
            table = balance_marginals(table)
        probs = torch.tensor([float(table[p]) for p in pairs], dtype=torch.float64)
        probs = probs / probs.sum()
        # ties (the second world has many) are broken by rank, then name: deterministic
        seen = sorted((p for p in pairs if p not in held_out),
                      key=lambda p: (-round(float(probs[pairs.index(p)]), 12), colour_rank[p[0]], shape_rank[p[1]]))
        third = len(seen) // 3
        buckets = {p: "held_out" for p in held_out}
        for rank, p in enumerate(seen):
            buckets[p] = "head" if rank < third else ("tail" if rank >= len(seen) - third else "torso")
        noise = law.caption_noise if law else 1.0 if self.kind == "captioned" else None
        for name, value in (("colour_rank", colour_rank), ("shape_rank", shape_rank), ("held_out", held_out),
                            ("pairs", pairs), ("probs", probs), ("buckets", buckets), ("law", law),
                            ("caption_noise", noise)):
            object.__setattr__(self, name, value)

    @property
    def seen(self) -> list[tuple[int, int]]:
        return [p for p in self.pairs if self.buckets[p] != "held_out"]

    @property
    def bucket_of_name(self) -> dict[str, str]:
        return {pair_name(p): b for p, b in self.buckets.items()}

    def prob(self, pair: tuple[int, int]) -> float:
        return float(self.probs[self.pairs.index(pair)])

    def pool_counts(self, tiles: int = POOL_TILES, floor: int = MIN_TILES) -> dict[tuple[int, int], int]:
        """Tiles per seen pair in the pool: its share of `tiles`, at least `floor` (deterministic)."""
        return {p: max(floor, round(tiles * self.prob(p))) for p in self.seen}


def colour_word(colour: int) -> str:
    """The caption word of a colour index: a named colour, or "hue<k>" for the colour-diversity lever's hues."""
    return COLOURS[colour] if colour < len(COLOURS) else f"hue{colour - len(COLOURS)}"


def colour_value(colour: int) -> str | tuple[int, int, int]:
    """What `data.synthetic.render_objects` draws a colour index with: its name, or the hue's RGB."""
    if colour < len(COLOURS):
        return COLOURS[colour]
    r, g, b = colorsys.hsv_to_rgb((colour - len(COLOURS)) / HUES, 0.85, 0.85)
    return round(255 * r), round(255 * g), round(255 * b)


def caption(left: tuple[int, int], right: tuple[int, int]) -> str:
    return f"a {pair_name(left)} and a {pair_name(right)}"


def pair_name(pair: tuple[int, int]) -> str:
    return f"{colour_word(pair[0])} {SHAPES[pair[1]]}"


# The caption model of the "captioned" world (docs/method.md states it), set before any run. Per object: its colour
# omitted with OMIT, else a wrong colour with WRONG; each word a synonym with SYNONYM (violet is an alias the
# vocabulary knows; the others it does not, or reads as something else: lime, lemon, box, donut are objects, golden
# is gold). Per scene: one of RELATIONS; with ATTRIBUTE_AFTER the first object's colour follows its shape; two
# objects of one shape are a plural with PLURAL; a DISTRACTOR clause names something not shown. A world's
# `caption_noise` scales every rate but PLURAL's (phrasing, not error).
OMIT, WRONG, SYNONYM, ATTRIBUTE_AFTER, PLURAL, DISTRACTOR = 0.15, 0.05, 0.1, 0.1, 0.5, 0.2
SYNONYMS = {"red": ("crimson", "scarlet"), "blue": ("navy", "azure"), "green": ("lime", "emerald"),
            "yellow": ("golden", "lemon"), "purple": ("violet", "lilac"), "orange": ("amber", "tangerine"),
            "black": ("ebony", "dark"), "cyan": ("teal", "aqua"), "circle": ("disc", "dot"), "square": ("box", "tile"),
            "triangle": ("wedge", "pyramid"), "cross": ("plus sign", "x"), "ring": ("hoop", "donut")}
RELATIONS = ("{a} and {b}", "{a} next to {b}", "{a} to the left of {b}", "{b} to the right of {a}",
             "{a} beside {b}", "a picture of {a} and {b}", "{a}, {b}")
DISTRACTORS = (" on a white background", " with a small star in the corner", " on a wooden table",
               " in a black frame", " under a blue sky")


def realistic_caption(left: tuple[int, int], right: tuple[int, int], rng: random.Random, noise: float = 1.0) -> str:
    """A caption of the scene `left` | `right` under the caption model above, its error rates times `noise`,
    drawn from `rng`."""
    from data.text import with_article

    def word(name: str) -> str:
        return rng.choice(SYNONYMS[name]) if name in SYNONYMS and rng.random() < SYNONYM * noise else name

    def colour(c: int) -> str | None:
        if rng.random() < OMIT * noise:
            return None
        if c < len(COLOURS) and rng.random() < WRONG * noise:
            c = rng.choice([k for k in range(len(COLOURS)) if k != c])
        return word(colour_word(c))

    (c1, s1), (c2, s2) = left, right
    w1, w2 = colour(c1), colour(c2)
    if s1 == s2 and rng.random() < PLURAL:
        named = [w for w in dict.fromkeys((w1, w2)) if w]  # "two red rings", not "one red and one red"
        shape = word(SHAPES[s1])
        shapes = f"{shape}{'es' if shape.endswith(('s', 'x')) else 's'}"
        if w1 is not None and w1 == w2:
            shapes, named = f"{w1} {shapes}", []
        which = (f", one {named[0]} and one {named[1]}" if len(named) == 2
                 else f", one of them {named[0]}" if named else "")
        text = f"two {shapes}{which}"
    else:
        after = w1 is not None and rng.random() < ATTRIBUTE_AFTER * noise
        a = f"{word(SHAPES[s1])} in {w1}" if after else " ".join(w for w in (w1, word(SHAPES[s1])) if w)
        b = " ".join(w for w in (w2, word(SHAPES[s2])) if w)
        text = rng.choice(RELATIONS).format(a=with_article(a), b=with_article(b))
    if rng.random() < DISTRACTOR * noise:
        text += rng.choice(DISTRACTORS)
    return text[0].upper() + text[1:]


def probe_prompts(world: PairWorld, per_pair: int) -> list[tuple[tuple[int, int], tuple[int, int], tuple[int, int]]]:
    """(probed pair, left, right) per evaluation sample: each pair `per_pair` times, alternately on the left and
    on the right, next to a head pair (cycled, never the probed pair itself)."""
    heads = [p for p in world.seen if world.buckets[p] == "head"]
    out = []
    for i, pair in enumerate(world.pairs):
        partners = [h for h in heads if h != pair]
        for k in range(per_pair):
            partner = partners[(i + k // 2) % len(partners)]
            out.append((pair, pair, partner) if k % 2 == 0 else (pair, partner, pair))
    return out


def bucket_success(per_pair: dict, buckets: dict[str, str]) -> dict:
    """Mean success over the pairs of each bucket, and over all seen pairs; `buckets`: pair name → its bucket
    (`PairWorld.bucket_of_name`)."""
    out = {}
    for bucket in BUCKETS:
        out[bucket] = statistics.fmean(per_pair[name] for name, b in buckets.items() if b == bucket)
    out["all_seen"] = statistics.fmean(per_pair[name] for name, b in buckets.items() if b != "held_out")
    return out


def render_tiles(pairs: list[tuple[int, int] | None], seed: int, tag: str) -> torch.Tensor:
    """One 16 × 16 tile per entry, (N, 3, 16, 16) in [-1, 1]; None renders an empty tile. Tile i depends only on
    (tag, seed, i, its pair)."""
    out = torch.empty(len(pairs), 3, TILE, TILE)
    for i, pair in enumerate(pairs):
        rng = random.Random(f"composition/{tag}/{seed}/{i}")
        objects = [] if pair is None else [(SHAPES[pair[1]], colour_value(pair[0]))]
        image, _ = render_objects(rng, objects, TILE, SIZE_RANGE)
        out[i] = image_to_tensor(image)
    return out


class TilePool:
    """The training images of one seed: `pool_counts` tiles of every seen pair, rendered once; with `hue_tiles`,
    that many more tiles of the colour-diversity lever (a uniform hue, a shape from the world's distribution)."""

    def __init__(self, world: PairWorld, seed: int, tiles: int = POOL_TILES, floor: int = MIN_TILES,
                 hue_tiles: int = 0):
        counts = world.pool_counts(tiles, floor)
        self.pair_of_tile = [p for p in world.seen for _ in range(counts[p])]
        self.images = render_tiles(self.pair_of_tile, seed, "train")
        if hue_tiles:
            g = torch.Generator().manual_seed(seed)
            shape_p = torch.zeros(len(SHAPES), dtype=torch.float64)
            for (c, s), n in counts.items():
                shape_p[s] += n
            hues = torch.randint(HUES, (hue_tiles,), generator=g).tolist()
            shapes = torch.multinomial(shape_p, hue_tiles, replacement=True, generator=g).tolist()
            extra = [(len(COLOURS) + h, s) for h, s in zip(hues, shapes)]
            self.pair_of_tile += extra
            self.images = torch.cat([self.images, render_tiles(extra, seed, "train-hues")])
        self.seen = world.seen
        self.tiles_of_pair = [torch.tensor([i for i, q in enumerate(self.pair_of_tile) if q == p]) for p in self.seen]
        colours = torch.tensor([p[0] for p in self.pair_of_tile])
        self.colour_of_tile, self.shape_of_tile = colours, torch.tensor([p[1] for p in self.pair_of_tile])
        self.tiles_of_colour = {c: torch.nonzero(colours == c).flatten() for c in colours.unique().tolist()}

    def __len__(self) -> int:
        return len(self.pair_of_tile)

    def pair_probs(self, stream: str) -> torch.Tensor:
        """Probability of each seen pair (in `self.seen` order) per drawn object: "long_tailed" its share of the
        pool's tiles, "pair_balanced" uniform, "concept_balanced" the pool's table with its colour and shape
        marginals made uniform (`balance_marginals`)."""
        counts = torch.tensor([float(len(t)) for t in self.tiles_of_pair], dtype=torch.float64)
        if stream == "long_tailed":
            return counts / counts.sum()
        if stream == "pair_balanced":
            return torch.full_like(counts, 1.0 / len(counts))
        if stream == "concept_balanced":
            table = torch.zeros(len(COLOURS), len(SHAPES), dtype=torch.float64)
            for (c, s), n in zip(self.seen, counts.tolist()):
                table[c, s] = n
            table = balance_marginals(table)
            return torch.tensor([float(table[p]) for p in self.seen], dtype=torch.float64)
        raise ValueError(f"unknown stream {stream!r}; choose one of {', '.join(STREAMS)}")

    def draw(self, n: int, stream: str, generator: torch.Generator) -> torch.Tensor:
        """n tile indices, one per object: uniformly from the pool (long-tailed), or a seen pair from `pair_probs`
        then a uniform tile of it."""
        if stream == "long_tailed":
            return torch.randint(len(self), (n,), generator=generator)
        which = torch.multinomial(self.pair_probs(stream), n, replacement=True, generator=generator).tolist()
        picks = torch.rand(n, generator=generator)
        return torch.stack([self.tiles_of_pair[k][int(u * len(self.tiles_of_pair[k]))]
                            for k, u in zip(which, picks.tolist())])

    def same_colour(self, left: torch.Tensor, share: float, others: torch.Tensor,
                    generator: torch.Generator) -> torch.Tensor:
        """The burstiness lever: for each scene, with probability `share` a uniform tile of the colour of tile
        `left[i]` as its partner, else `others[i]` (the stream's own draw)."""
        bursty = (torch.rand(len(left), generator=generator) < share).tolist()
        picks = torch.rand(len(left), generator=generator).tolist()
        out = others.clone()
        for i, (tile, flag, u) in enumerate(zip(left.tolist(), bursty, picks)):
            if flag:
                same = self.tiles_of_colour[int(self.colour_of_tile[tile])]
                out[i] = same[int(u * len(same))]
        return out

    def scenes(self, left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
        """(B, 3, 16, 32): tile `left[i]` beside tile `right[i]`."""
        return torch.cat([self.images[left], self.images[right]], dim=3)


class ScenePool:
    """Fixed-scene mode: the scenes of one seed composed once from its tile pool, so a stream can only choose among
    them (as a sampler of a real data set chooses among its images). Two seeded permutations of the tiles give the
    left and the right halves: every tile is in exactly two scenes, once on each side.

    A long-tailed stream draws a scene uniformly. A balanced stream draws per object: a pair from the tile pool's
    `pair_probs`, then uniformly one of the (scene, side) slots showing it, and trains on that scene whole, so the
    drawn half follows the stream and its partner is whatever the scene holds."""

    def __init__(self, tiles: TilePool, seed: int):
        g = torch.Generator().manual_seed(7919 * seed + 17)
        self.tiles, self.seed = tiles, seed
        self.left, self.right = torch.randperm(len(tiles), generator=g), torch.randperm(len(tiles), generator=g)
        pair_index = {p: k for k, p in enumerate(tiles.seen)}
        slots: list[list[int]] = [[] for _ in tiles.seen]  # scene index, + len(self) for the right side
        for side, halves in enumerate((self.left, self.right)):
            for scene, tile in enumerate(halves.tolist()):
                k = pair_index.get(tiles.pair_of_tile[tile])
                if k is not None:  # hue tiles belong to no seen pair
                    slots[k].append(scene + side * len(self))
        self.slots = [torch.tensor(s) for s in slots]

    def __len__(self) -> int:
        return len(self.left)

    def captions(self, noise: float | None = None) -> list[str]:
        """Each scene's caption in scene order: "a <colour> <shape> and a <colour> <shape>", or, given a world's
        `caption_noise`, one of `realistic_caption` at that noise (drawn from the pool's seed)."""
        pairs = self.tiles.pair_of_tile
        scenes = [(pairs[a], pairs[b]) for a, b in zip(self.left.tolist(), self.right.tolist())]
        if noise is None:
            return [caption(a, b) for a, b in scenes]
        rng = random.Random(7919 * self.seed + 29)
        return [realistic_caption(a, b, rng, noise) for a, b in scenes]

    def draw(self, n: int, stream: str, generator: torch.Generator) -> torch.Tensor:
        """n scene indices."""
        if stream == "long_tailed":
            return torch.randint(len(self), (n,), generator=generator)
        which = torch.multinomial(self.tiles.pair_probs(stream), n, replacement=True, generator=generator).tolist()
        picks = torch.rand(n, generator=generator).tolist()
        return torch.tensor([int(self.slots[k][int(u * len(self.slots[k]))]) % len(self)
                             for k, u in zip(which, picks)])


def rotate_hue(images: torch.Tensor, turns: torch.Tensor) -> torch.Tensor:
    """The latent-intervention lever: rotate the hue of each image (B, 3, H, W) in [-1, 1] by `turns` (B,) of a
    full turn, about the grey axis of the YIQ colour space (greys, black and the light background stay put)."""
    to_yiq = images.new_tensor([[0.299, 0.587, 0.114], [0.596, -0.274, -0.322], [0.211, -0.523, 0.312]])
    angle = 2 * torch.pi * turns.to(images.dtype)
    cos, sin = angle.cos(), angle.sin()
    rotation = torch.zeros(len(images), 3, 3, dtype=images.dtype)
    rotation[:, 0, 0] = 1
    rotation[:, 1, 1], rotation[:, 1, 2], rotation[:, 2, 1], rotation[:, 2, 2] = cos, -sin, sin, cos
    matrix = torch.linalg.inv(to_yiq) @ rotation @ to_yiq  # (B, 3, 3) in RGB
    rgb = (images + 1) / 2
    out = torch.einsum("bij,bjhw->bihw", matrix, rgb)
    return (2 * out - 1).clamp(-1, 1)


class WordEncoder:
    """Caption → (embeds, mask) from fixed random word vectors plus a fixed random vector per position: word
    features are disentangled by construction, and the position tells the DiT which colour goes with which shape, so
    the benchmark measures how the DiT binds them, not how a random T5 mixes words.
    Captions are [a, c1, s1, and, a, c2, s2, <end>]; the null caption is [<end>] alone (like T5's empty string)."""

    LENGTH = 8

    def __init__(self, dim: int = 32, seed: int = 0):
        words = ("<end>", "a", "and") + COLOURS + SHAPES
        g = torch.Generator().manual_seed(seed)
        table = torch.randn(len(words), dim, generator=g)
        self.positions = 0.5 * torch.randn(self.LENGTH, dim, generator=g)
        # the hue words come from a generator of their own: the other words' vectors do not depend on them
        hues = torch.randn(HUES, dim, generator=torch.Generator().manual_seed(seed + 7919))
        self.vocab = {w: i for i, w in enumerate(words + tuple(colour_word(len(COLOURS) + k) for k in range(HUES)))}
        self.table = torch.cat([table, hues])
        self.dim, self.length = dim, self.LENGTH

    def encode(self, left: list[tuple[int, int]], right: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        v = self.vocab
        ids = torch.tensor([[v["a"], v[colour_word(a[0])], v[SHAPES[a[1]]], v["and"],
                             v["a"], v[colour_word(b[0])], v[SHAPES[b[1]]], v["<end>"]] for a, b in zip(left, right)])
        return self.table[ids] + self.positions, torch.ones(len(left), self.length)

    def null(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        embeds = torch.zeros(n, self.length, self.dim)
        embeds[:, 0] = self.table[self.vocab["<end>"]] + self.positions[0]
        mask = torch.zeros(n, self.length)
        mask[:, 0] = 1
        return embeds, mask


class Oracle(nn.Module):
    """A small CNN that reads one 16 × 16 tile: logits over colours and over shapes + "nothing"."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1, stride=2), nn.ReLU(),
            nn.Conv2d(32, 32, 3, padding=1, stride=2), nn.ReLU(),
            nn.Flatten(), nn.Linear(32 * 4 * 4, 128), nn.ReLU(),
        )
        self.colour = nn.Linear(128, len(COLOURS))
        self.shape = nn.Linear(128, len(SHAPES) + 1)

    def forward(self, tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.features(tiles)
        return self.colour(h), self.shape(h)

    @torch.no_grad()
    def read_tiles(self, tiles: torch.Tensor, batch_size: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
        """(colour index, shape index or NOTHING) per tile."""
        self.eval()
        colours, shapes = [], []
        for chunk in tiles.split(batch_size):
            c, s = self(chunk.clamp(-1, 1))
            colours.append(c.argmax(1))
            shapes.append(s.argmax(1))
        return torch.cat(colours), torch.cat(shapes)

    def read_scenes(self, scenes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(colour, shape) per half of each (B, 3, 16, 32) scene, each (B, 2): column 0 left, column 1 right."""
        left, right = scenes[..., :TILE], scenes[..., TILE:]
        colours, shapes = self.read_tiles(torch.cat([left, right]))
        b = scenes.shape[0]
        return torch.stack([colours[:b], colours[b:]], 1), torch.stack([shapes[:b], shapes[b:]], 1)


def judge(colours: torch.Tensor, shapes: torch.Tensor, left: list[tuple[int, int]],
          right: list[tuple[int, int]]) -> tuple[torch.Tensor, list[str | None]]:
    """Per scene: success (both halves right) and the failure kind (None where it succeeded).

    missing_object: a half reads as nothing. colour_on_wrong_shape: both objects there with the prompted shapes, but
    a half carries the other object's (different) colour. other: every other mistake."""
    want_c = torch.tensor([[a[0], b[0]] for a, b in zip(left, right)])
    want_s = torch.tensor([[a[1], b[1]] for a, b in zip(left, right)])
    ok = ((colours == want_c) & (shapes == want_s)).all(1)
    kinds: list[str | None] = []
    for i in range(len(left)):
        if ok[i]:
            kinds.append(None)
        elif (shapes[i] == NOTHING).any():
            kinds.append("missing_object")
        elif bool((shapes[i] == want_s[i]).all()) and any(
                int(colours[i, h]) != int(want_c[i, h]) and int(colours[i, h]) == int(want_c[i, 1 - h])
                for h in (0, 1)):
            kinds.append("colour_on_wrong_shape")
        else:
            kinds.append("other")
    return ok, kinds


def _degrade(images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Train the oracle on what a half-trained generator produces: noisy, slightly blurred, contrast-shifted."""
    b = images.shape[0]
    blur = torch.rand(b, 1, 1, 1, generator=generator) < 0.5
    kernel = torch.tensor([[1.0, 2.0, 1.0], [2.0, 4.0, 2.0], [1.0, 2.0, 1.0]]) / 16
    blurred = F.conv2d(F.pad(images, (1, 1, 1, 1), mode="replicate"), kernel.expand(3, 1, 3, 3), groups=3)
    images = torch.where(blur, blurred, images)
    scale = 0.8 + 0.4 * torch.rand(b, 1, 1, 1, generator=generator)
    noise = 0.15 * torch.rand(b, 1, 1, 1, generator=generator) * torch.randn(images.shape, generator=generator)
    return (images * scale + noise).clamp(-1, 1)


def _uniform_tiles(n: int, generator: torch.Generator, empty_share: float) -> list[tuple[int, int] | None]:
    """Every pair equally often (held-out ones included: the oracle must read them), plus empty tiles."""
    out: list[tuple[int, int] | None] = []
    for u, c, s in zip(torch.rand(n, generator=generator).tolist(),
                       torch.randint(len(COLOURS), (n,), generator=generator).tolist(),
                       torch.randint(len(SHAPES), (n,), generator=generator).tolist()):
        out.append(None if u < empty_share else (c, s))
    return out


def _labels(tiles: list[tuple[int, int] | None]) -> tuple[torch.Tensor, torch.Tensor]:
    colours = torch.tensor([-100 if p is None else p[0] for p in tiles])  # an empty tile has no colour to learn
    shapes = torch.tensor([NOTHING if p is None else p[1] for p in tiles])
    return colours, shapes


def train_oracle(steps: int = 1200, batch_size: int = 128, seed: int = 0, pool_size: int = 9000,
                 test_size: int = 3000, empty_share: float = 0.1) -> tuple[Oracle, dict]:
    """Train the oracle on uniformly drawn tiles and measure its accuracy on fresh, clean renders it never saw."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    tiles = _uniform_tiles(pool_size, g, empty_share)
    images = render_tiles(tiles, seed, "oracle-train")
    colours, shapes = _labels(tiles)
    oracle = Oracle()
    opt = torch.optim.Adam(oracle.parameters(), lr=2e-3)
    for _ in range(steps):
        idx = torch.randint(pool_size, (batch_size,), generator=g)
        logits_c, logits_s = oracle(_degrade(images[idx], g))
        loss = F.cross_entropy(logits_c, colours[idx], ignore_index=-100) + F.cross_entropy(logits_s, shapes[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return oracle, oracle_accuracy(oracle, g, seed, test_size, empty_share)


def oracle_accuracy(oracle: Oracle, generator: torch.Generator, seed: int, test_size: int = 3000,
                    empty_share: float = 0.1) -> dict:
    """Share of fresh uniformly drawn tiles the oracle reads right (all tiles, object tiles, empty ones), clean
    and degraded; the tiles are drawn from `generator` and rendered from `seed`."""
    test_tiles = _uniform_tiles(test_size, generator, empty_share)
    test = render_tiles(test_tiles, seed, "oracle-test")
    want_c, want_s = _labels(test_tiles)
    obj = want_s != NOTHING
    report = {"test_tiles": test_size}
    for name, images in (("", test), ("_degraded", _degrade(test, generator))):
        got_c, got_s = oracle.read_tiles(images)
        right = (got_s == want_s) & ((got_c == want_c) | ~obj)
        report[f"tile_accuracy{name}"] = right.float().mean().item()
        report[f"pair_accuracy{name}"] = right[obj].float().mean().item()
        report[f"empty_accuracy{name}"] = right[~obj].float().mean().item()
    return report


def oracle_per_class(oracle: Oracle, seed: int = 11, per_class: int = 200) -> dict:
    """The judge's accuracy per colour, shape and pair on fresh tiles (about `per_class` tiles of every pair,
    colour and shape drawn uniformly, held-out pairs included), clean and degraded: where it reads one class worse,
    success on pairs with that class is read low."""
    g = torch.Generator().manual_seed(seed)
    tiles = [(c, s) for c, s in zip(torch.randint(len(COLOURS), (per_class * len(COLOURS) * len(SHAPES),),
                                                  generator=g).tolist(),
                                    torch.randint(len(SHAPES), (per_class * len(COLOURS) * len(SHAPES),),
                                                  generator=g).tolist())]
    images = render_tiles(tiles, seed, "oracle-per-class")
    want_c, want_s = _labels(tiles)
    report: dict = {"tiles": len(tiles)}
    for name, batch in (("clean", images), ("degraded", _degrade(images, g))):
        got_c, got_s = oracle.read_tiles(batch)
        right = (got_c == want_c) & (got_s == want_s)
        report[name] = {
            "colour": {COLOURS[c]: right[want_c == c].float().mean().item() for c in range(len(COLOURS))},
            "shape": {SHAPES[s]: right[want_s == s].float().mean().item() for s in range(len(SHAPES))},
            "pair": {pair_name((c, s)): right[(want_c == c) & (want_s == s)].float().mean().item()
                     for c in range(len(COLOURS)) for s in range(len(SHAPES))}}
    return report
