"""Representation diagnostics of a composition-benchmark DiT (`imba.eval.representations.diagnose`), and the
per-variant summary the data-levers experiment reports.

For every pair of the world, `PROMPTS_PER_PAIR` of the benchmark's two-object probe prompts (the pair next to a head
pair, alternately left and right), each over `DRAWS` fixed noise scenes at timestep `TIMESTEP`:
- the DiT's features: each block's output averaged over the tokens of the probed object's half of the scene;
- the caption features: the mean of the probed object's two word vectors (colour and shape, with their positions);
- probes for the probed object's colour and for its shape, fitted on seen pairs, scored on held-out ones too.
Grouped by the probed pair's bucket (head / torso / tail / held-out).
"""

from __future__ import annotations

import statistics

import torch

from composition_scenes import TILE, PairWorld, WordEncoder, bucket_success, probe_prompts
from seed_stats import pearson

PROMPTS_PER_PAIR = 4
DRAWS = 2
TIMESTEP = 900.0  # in [0, 1000): the input is (nearly) noise, as at the start of sampling
K = 10


def world_features(model, text: WordEncoder, world: PairWorld, patch: int, seed: int = 0):
    """What `diagnose` takes, over the world's probe prompts (see the module docstring): (per-block features,
    caption features, {"colour", "shape"} labels, bucket per row, seen per row)."""
    from models.dit_features import prompt_features

    prompts = probe_prompts(world, PROMPTS_PER_PAIR)
    left, right = [p[1] for p in prompts], [p[2] for p in prompts]
    embeds, mask = text.encode(left, right)
    rows, cols = TILE // patch, 2 * TILE // patch
    on_left = torch.tensor([pair == l for pair, l, _ in prompts])  # the probed pair's side
    token_mask = torch.zeros(len(prompts), rows, cols)
    token_mask[on_left, :, : cols // 2] = 1
    token_mask[~on_left, :, cols // 2:] = 1
    caption_mask = torch.zeros_like(mask)
    caption_mask[on_left, 1:3] = 1  # [a, c1, s1, and, a, c2, s2, <end>]
    caption_mask[~on_left, 5:7] = 1
    blocks, caption = prompt_features(model, embeds, mask, (3, TILE, 2 * TILE), TIMESTEP, DRAWS, seed,
                                      vae_scale_factor=1, token_mask=token_mask.flatten(1),
                                      caption_mask=caption_mask)

    def per_row(values):
        return [v for v in values for _ in range(DRAWS)]

    pairs = [p[0] for p in prompts]
    labels = {"colour": torch.tensor(per_row([p[0] for p in pairs])),
              "shape": torch.tensor(per_row([p[1] for p in pairs]))}
    groups = per_row([world.buckets[p] for p in pairs])
    return blocks, caption, labels, groups, torch.tensor([g != "held_out" for g in groups])


def world_diagnostics(model, text: WordEncoder, world: PairWorld, patch: int, seed: int = 0) -> dict:
    """`diagnose` of `model` over the world's probe prompts."""
    from imba.eval.representations import diagnose

    result = diagnose(*world_features(model, text, world, patch, seed), k=K, seed=seed, draws=DRAWS)
    result["settings"] = {"prompts_per_pair": PROMPTS_PER_PAIR, "draws": DRAWS, "timestep": TIMESTEP, "k": K,
                          "seed": seed}
    return result


def diagnostic_numbers(result: dict) -> dict[str, float]:
    """The few numbers the experiment tracks, from one `world_diagnostics` result: for the last block, the
    colour and shape probes' accuracy on held-out pairs and their ID − OOD gap, and linear CKA with the caption on
    tail and held-out pairs; the mean over blocks of the same CKA."""
    last = result["blocks"][-1]
    out = {}
    for probe in ("colour", "shape"):
        p = last["probe"][probe]
        out[f"{probe}_probe_held_out"] = p["by_group"]["held_out"]
        out[f"{probe}_probe_gap"] = p["gap"]
    for bucket in ("tail", "held_out"):
        out[f"cka_{bucket}"] = last["cka"][bucket]
        values = [b["cka"][bucket] for b in result["blocks"] if b["cka"][bucket] is not None]
        out[f"cka_{bucket}_mean_over_blocks"] = statistics.fmean(values) if values else None
    return out


def stream_objects(joint: torch.Tensor, colours: torch.Tensor, shapes: torch.Tensor) -> None:
    """Add the objects of one training batch to `joint`, a (colours incl. hues, shapes) count table."""
    joint.view(-1).index_add_(0, colours * joint.shape[1] + shapes, torch.ones(len(colours), dtype=joint.dtype))


def run_numbers(run: dict, length: int) -> dict | None:
    """Composition success per bucket, the stream's colour–shape NMI and `diagnostic_numbers` of one run at one
    length (None where the run was not evaluated there, or has no diagnostics)."""
    result = run["results"].get(length)
    if not result or "diagnostics" not in result:
        return None
    return {**bucket_success(result["per_pair"], run["buckets"]), "attribute_nmi": result["attribute_nmi"],
            **diagnostic_numbers(result["diagnostics"])}


RELATIONS = ("attribute_nmi", "shape_probe_gap", "colour_probe_gap", "shape_probe_held_out", "cka_held_out")


def relations(points: list[dict], outcome: str = "held_out") -> dict:
    """Across runs (each a `run_numbers` dict): Pearson r of `outcome` with each of RELATIONS."""
    out = {}
    for name in RELATIONS:
        pairs = [(p[name], p[outcome]) for p in points if p.get(name) is not None]
        out[name] = pearson([a for a, _ in pairs], [b for _, b in pairs]) if pairs else None
    return out
