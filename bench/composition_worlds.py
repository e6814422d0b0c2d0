"""The family of worlds the composition benchmark draws: each world a law of pair frequencies over 8 colours × 5
shapes, some pairs held out, and how noisy its captions are, so a lever is judged over a population of worlds rather
than the three named ones (`composition_scenes.PairWorld` builds a world of any of them).

A drawn world ("drawn-K", `draw_law(K)`) is long-tailed, its tail made in its own way: a span S (between its most
and least frequent pair before the scaling below), log-uniform in SPAN, is split in three random shares
(Dirichlet(1, 1, 1)): S^a between the most and least frequent colour (colours Zipf-distributed, exponent a·ln S / ln
8), S^b between shapes (Zipf, exponent b·ln S / ln 5) and S^c by the pairs' own law: each colour rank gives its five
shapes the levels 0..4 in an order drawn per colour, and a pair's weight falls by `pair_decay` = S^(c/4) per level
(1: pairs independent, as in concept_tail). The table is then scaled (Sinkhorn) so the colours and the shapes keep
their Zipf marginals (but for the held-out pairs' share): how often a pair appears is its concepts' frequency times
how much the world favours that combination. One world's tail is rare words, the next one's rare combinations of
common words (like pair_tail), most a mixture. Six pairs are held out, at distinct colour ranks, at most two per
shape rank, so every concept of a held-out pair is seen with other partners. Its captions are written as a re-
captioner writes them (`composition_scenes.realistic_caption`) with the captioned world's error rates scaled by
`caption_noise` in [0, NOISE_MAX] (0: right words, varied phrasing). Everything a drawn world is follows from K
alone; which colour and shape take which rank follows from the training seed, as in the named worlds.

The population a lever is judged on (`POPULATION`) is fixed here before any of its runs: the three named worlds,
on which the benchmark's settings were chosen (`DEVELOPMENT`), and the drawn worlds no setting was chosen on
(`KEPT_BACK`).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch

SPAN = (300.0, 30000.0)  # realised spans (after the scaling) about 100-3000; the named: 256 and 1600
NOISE_MAX = 1.5
HELD_OUT_PAIRS = 6
NAMED = ("concept_tail", "pair_tail", "captioned")
DRAWN_PREFIX = "drawn-"
DEVELOPMENT = NAMED
KEPT_BACK = tuple(f"{DRAWN_PREFIX}{k}" for k in range(5))
POPULATION = DEVELOPMENT + KEPT_BACK
POPULATION_SEEDS = (20, 21, 22)  # no study before this one used them
POPULATION_STEPS = 1950  # where the named worlds' balance gap is widest at equal steps (bench/README.md)


@dataclass(frozen=True)
class WorldLaw:
    """A drawn world's parameters (see the module doc); ranks are frequency ranks, 0 the most frequent."""

    colour_zipf: float
    shape_zipf: float
    pair_decay: float
    levels: tuple[tuple[int, ...], ...]  # levels[colour rank][shape rank]: the pair's level, 0 the favoured
    held_out: tuple[tuple[int, int], ...]  # (colour rank, shape rank)
    caption_noise: float

    def table(self, colours: int, shapes: int) -> torch.Tensor:
        """Pair weights by (colour rank, shape rank), sums to 1: scaled so the colour and shape marginals are the
        Zipf ones, then the held-out pairs set to 0 (before the scaling, the scaling could starve a concept whose
        large share must come from few pairs)."""
        row = torch.tensor([(r + 1) ** -self.colour_zipf for r in range(colours)], dtype=torch.float64)
        col = torch.tensor([(r + 1) ** -self.shape_zipf for r in range(shapes)], dtype=torch.float64)
        level = torch.tensor(self.levels, dtype=torch.float64)
        table = scale_to_marginals(row[:, None] * col[None, :] * self.pair_decay ** -level, row / row.sum(),
                                   col / col.sum())
        for rc, rs in self.held_out:
            table[rc, rs] = 0.0
        return table / table.sum()

    def describe(self) -> dict:
        return {"colour_zipf": round(self.colour_zipf, 3), "shape_zipf": round(self.shape_zipf, 3),
                "pair_decay": round(self.pair_decay, 3), "caption_noise": round(self.caption_noise, 3),
                "held_out_ranks": [list(p) for p in self.held_out]}


def balance_marginals(weights: torch.Tensor, iterations: int = 500) -> torch.Tensor:
    """The table closest to `weights` (colours × shapes, zeros kept) whose row and column sums are uniform
    (Sinkhorn scaling: a_c · b_s · weights), normalised to sum 1."""
    table = weights.to(torch.float64).clone()
    rows, cols = table.shape
    for _ in range(iterations):
        table = table / table.sum(1, keepdim=True) / rows
        table = table / table.sum(0, keepdim=True) / cols
    return table / table.sum()


def scale_to_marginals(weights: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor,
                       iterations: int = 500) -> torch.Tensor:
    """The table closest to `weights` (zeros kept) whose row sums are `rows` and column sums `cols` (each summing
    to 1): Sinkhorn scaling a_c · b_s · weights."""
    table = weights.to(torch.float64).clone()
    for _ in range(iterations):
        table = table * (rows / table.sum(1))[:, None]
        table = table * (cols / table.sum(0))[None, :]
    return table / table.sum()


def is_drawn(name: str) -> bool:
    return name.startswith(DRAWN_PREFIX) and name[len(DRAWN_PREFIX):].isdigit()


def draw_law(index: int, colours: int = 8, shapes: int = 5) -> WorldLaw:
    """The law of world "drawn-<index>" (see the module doc), a function of `index` alone."""
    rng = random.Random(f"composition-world/{index}")
    log_span = rng.uniform(math.log(SPAN[0]), math.log(SPAN[1]))
    shares = [rng.gammavariate(1.0, 1.0) for _ in range(3)]
    a, b, c = (share / sum(shares) * log_span for share in shares)
    colour_zipf, shape_zipf, pair_decay = a / math.log(colours), b / math.log(shapes), math.exp(c / (shapes - 1))
    levels = tuple(tuple(rng.sample(range(shapes), shapes)) for _ in range(colours))
    held_out: list[tuple[int, int]] = []
    per_shape = [0] * shapes
    for rc in sorted(rng.sample(range(colours), HELD_OUT_PAIRS)):
        rs = rng.choice([s for s in range(shapes) if per_shape[s] < 2])
        per_shape[rs] += 1
        held_out.append((rc, rs))
    return WorldLaw(colour_zipf, shape_zipf, pair_decay, levels, tuple(held_out), rng.uniform(0, NOISE_MAX))
