"""The synthetic world of the composition benchmark: one-object scenes, their long-tailed pair distribution, a
word-level text encoder, and the oracle classifier that reads generated images.

Scenes are 16 × 16 RGB images with one object, a (colour, shape) pair drawn by `data.synthetic.render_objects`.
Colours and shapes are Zipf-distributed independently (listed head first), so pair frequencies span ~50×; a few
pairs are *held out*: both of their concepts are common enough in training, never together. Composition success
for the prompt "a <colour> <shape>" = the oracle reads exactly that colour and that shape.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from data.images import image_to_tensor
from data.synthetic import render_objects

COLOURS = ("red", "blue", "green", "yellow", "purple")
SHAPES = ("circle", "square", "triangle", "cross", "ring")  # distinct at 16 px (star/hexagon blur into circles)
RESOLUTION = 16
SIZE_RANGE = (0.55, 0.8)  # object side as a fraction of the image: large enough to read its shape at 16 px
ZIPF = 1.2
# (colour index, shape index): never shown in training; each concept alone is seen in thousands of images
HELD_OUT = ((1, 3), (3, 1), (2, 4), (4, 2))


@dataclass(frozen=True)
class PairWorld:
    """Pair probabilities of the training distribution and the benchmark's buckets (head / torso / tail by the
    training frequency of the pair, in thirds of the seen pairs; held-out pairs on their own)."""

    zipf: float = ZIPF
    held_out: tuple[tuple[int, int], ...] = HELD_OUT
    pairs: list[tuple[int, int]] = field(init=False)
    probs: torch.Tensor = field(init=False)
    buckets: dict[tuple[int, int], str] = field(init=False)

    def __post_init__(self) -> None:
        zipf = torch.tensor([1.0 / (k + 1) ** self.zipf for k in range(len(COLOURS))], dtype=torch.float64)
        zipf = zipf / zipf.sum()
        pairs = [(c, s) for c in range(len(COLOURS)) for s in range(len(SHAPES))]
        probs = torch.tensor([0.0 if p in self.held_out else float(zipf[p[0]] * zipf[p[1]]) for p in pairs])
        probs = probs / probs.sum()
        seen = sorted((p for p in pairs if p not in self.held_out), key=lambda p: -float(probs[pairs.index(p)]))
        third = len(seen) // 3
        buckets = {p: "held_out" for p in self.held_out}
        for rank, p in enumerate(seen):
            buckets[p] = "head" if rank < third else ("tail" if rank >= len(seen) - third else "torso")
        object.__setattr__(self, "pairs", pairs)
        object.__setattr__(self, "probs", probs)
        object.__setattr__(self, "buckets", buckets)

    def prob(self, pair: tuple[int, int]) -> float:
        return float(self.probs[self.pairs.index(pair)])


def caption(pair: tuple[int, int]) -> str:
    return f"a {COLOURS[pair[0]]} {SHAPES[pair[1]]}"


def render(pairs: list[tuple[int, int]], seed: int, tag: str) -> torch.Tensor:
    """One image per pair, (N, 3, 16, 16) in [-1, 1]; image i depends only on (tag, seed, i, its pair)."""
    out = torch.empty(len(pairs), 3, RESOLUTION, RESOLUTION)
    for i, (c, s) in enumerate(pairs):
        rng = random.Random(f"composition/{tag}/{seed}/{i}")
        image, _ = render_objects(rng, [(SHAPES[s], COLOURS[c])], RESOLUTION, SIZE_RANGE)
        out[i] = image_to_tensor(image)
    return out


def draw_pairs(world: PairWorld, n: int, generator: torch.Generator) -> list[tuple[int, int]]:
    index = torch.multinomial(world.probs, n, replacement=True, generator=generator)
    return [world.pairs[i] for i in index.tolist()]


class WordEncoder:
    """Caption → (embeds, mask) from fixed random word vectors: a text encoder whose word features are disentangled
    by construction, so the benchmark measures how the DiT binds colour to shape, not how a random T5 mixes words.
    Captions are [a, colour, shape, <end>]; the null caption is [<end>] alone (like T5's empty string)."""

    def __init__(self, dim: int = 32, seed: int = 0):
        self.vocab = {w: i for i, w in enumerate(("<end>", "a") + COLOURS + SHAPES)}
        self.table = torch.randn(len(self.vocab), dim, generator=torch.Generator().manual_seed(seed))
        self.dim, self.length = dim, 4

    def encode_pairs(self, pairs: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.tensor([[self.vocab["a"], self.vocab[COLOURS[c]], self.vocab[SHAPES[s]], self.vocab["<end>"]]
                            for c, s in pairs])
        return self.table[ids], torch.ones(len(pairs), self.length)

    def null(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        embeds = torch.zeros(n, self.length, self.dim)
        embeds[:, 0] = self.table[self.vocab["<end>"]]
        mask = torch.zeros(n, self.length)
        mask[:, 0] = 1
        return embeds, mask


class Oracle(nn.Module):
    """A small CNN that reads a 16 × 16 scene: logits over colours and over shapes."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1, stride=2), nn.ReLU(),
            nn.Conv2d(32, 32, 3, padding=1, stride=2), nn.ReLU(),
            nn.Flatten(), nn.Linear(32 * 4 * 4, 128), nn.ReLU(),
        )
        self.colour = nn.Linear(128, len(COLOURS))
        self.shape = nn.Linear(128, len(SHAPES))

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.features(images)
        return self.colour(h), self.shape(h)

    @torch.no_grad()
    def read(self, images: torch.Tensor, batch_size: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
        """(colour index, shape index) per image."""
        self.eval()
        colours, shapes = [], []
        for chunk in images.split(batch_size):
            c, s = self(chunk.clamp(-1, 1))
            colours.append(c.argmax(1))
            shapes.append(s.argmax(1))
        return torch.cat(colours), torch.cat(shapes)


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


def train_oracle(steps: int = 800, batch_size: int = 128, seed: int = 0, pool_size: int = 6000,
                 test_size: int = 2000) -> tuple[Oracle, dict]:
    """Train the oracle on uniformly drawn pairs (every pair, held-out ones included: the oracle must read them)
    and measure its accuracy on fresh, clean renders it never saw."""
    torch.manual_seed(seed)
    uniform = PairWorld(zipf=0.0, held_out=())
    g = torch.Generator().manual_seed(seed)
    pairs = draw_pairs(uniform, pool_size, g)
    images = render(pairs, seed, "oracle-train")
    colours = torch.tensor([c for c, _ in pairs])
    shapes = torch.tensor([s for _, s in pairs])
    oracle = Oracle()
    opt = torch.optim.Adam(oracle.parameters(), lr=2e-3)
    for step in range(steps):
        idx = torch.randint(pool_size, (batch_size,), generator=g)
        logits_c, logits_s = oracle(_degrade(images[idx], g))
        loss = F.cross_entropy(logits_c, colours[idx]) + F.cross_entropy(logits_s, shapes[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    test_pairs = draw_pairs(uniform, test_size, g)
    test = render(test_pairs, seed, "oracle-test")
    got_c, got_s = oracle.read(test)
    want_c = torch.tensor([c for c, _ in test_pairs])
    want_s = torch.tensor([s for _, s in test_pairs])
    got_cn, got_sn = oracle.read(_degrade(test, g))
    report = {
        "test_images": test_size,
        "colour_accuracy": (got_c == want_c).float().mean().item(),
        "shape_accuracy": (got_s == want_s).float().mean().item(),
        "pair_accuracy": ((got_c == want_c) & (got_s == want_s)).float().mean().item(),
        "pair_accuracy_degraded": ((got_cn == want_c) & (got_sn == want_s)).float().mean().item(),
    }
    return oracle, report
