"""The composition benchmark's population: the family of drawn worlds (bench/composition_worlds.py), the named
worlds kept as they were, and the levers judged on it (caption, image-cluster and combined balancing)."""

import hashlib
import random
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import composition  # noqa: E402
import composition_variants  # noqa: E402
from composition_scenes import COLOURS, SHAPES, PairWorld, ScenePool, TilePool, realistic_caption  # noqa: E402
from composition_weighting import WeightedScenes  # noqa: E402
from composition_worlds import (DEVELOPMENT, KEPT_BACK, NAMED, POPULATION, POPULATION_SEEDS, WorldLaw,  # noqa: E402
                                draw_law, scale_to_marginals)


def test_the_named_worlds_their_pools_and_their_re_captioned_captions_are_those_every_study_recorded():
    digest = hashlib.sha256()
    for kind in NAMED:
        for seed in (None, 0, 3, 20):
            world = PairWorld(kind, seed)
            digest.update(world.probs.numpy().tobytes())
            digest.update(repr(sorted(world.buckets.items())).encode())
            digest.update(repr(world.held_out).encode())
    world = PairWorld("captioned", 2)
    digest.update("\n".join(ScenePool(TilePool(world, 2, tiles=600), 2).captions(world.caption_noise)).encode())
    assert digest.hexdigest() == "7fcb0a8eaff3135356096f7e8ced33dfd08097149db7d0b47e2fe0558b6aa3fe"
    assert [PairWorld(k).caption_noise for k in NAMED] == [None, None, 1.0] and PairWorld().law is None


def test_a_drawn_world_follows_from_its_number_alone_and_holds_its_pairs_out_as_the_named_ones_do():
    assert draw_law(3) == draw_law(3) and draw_law(3) != draw_law(4)
    for k in range(12):
        law = draw_law(k)
        colours = [rc for rc, _ in law.held_out]
        shapes = [rs for _, rs in law.held_out]
        assert len(law.held_out) == 6 and len(set(colours)) == 6 and max(shapes.count(s) for s in set(shapes)) <= 2
        assert all(sorted(row) == list(range(len(SHAPES))) for row in law.levels)  # one pair per level per colour
        world = PairWorld(f"drawn-{k}", 20)
        assert world.held_out == tuple(sorted(world.held_out, key=lambda p: world.colour_rank[p[0]]))
        assert all(world.prob(p) == 0 and world.buckets[p] == "held_out" for p in world.held_out)
        for c, s in world.held_out:  # every concept of a held-out pair is seen with other partners
            assert any(world.prob((c, other)) > 0 for other in range(len(SHAPES)))
            assert any(world.prob((other, s)) > 0 for other in range(len(COLOURS)))
        seen = sorted(world.prob(p) for p in world.seen)
        assert 50 < seen[-1] / seen[0] < 30000  # long-tailed: the named worlds' spans are 256 and 1600
        assert [b for b in ("head", "torso", "tail") if list(world.buckets.values()).count(b) not in (11, 12)] == []
    # the seed permutes which colour and shape take each rank, as in the named worlds
    assert PairWorld("drawn-2", 20).colour_rank != PairWorld("drawn-2", 21).colour_rank
    assert PairWorld("drawn-2", 20).law == PairWorld("drawn-2", 21).law
    assert PairWorld("drawn-2", 20).colour_rank != PairWorld("pair_tail", 20).colour_rank
    with pytest.raises(ValueError, match="unknown world 'drawn-x'"):
        PairWorld("drawn-x")


def test_a_drawn_worlds_table_keeps_its_zipf_marginals_but_for_the_held_out_share():
    law = WorldLaw(colour_zipf=1.0, shape_zipf=0.5, pair_decay=3.0,
                   levels=tuple(tuple((c + s) % 5 for s in range(5)) for c in range(8)), held_out=(), caption_noise=0)
    table = law.table(8, 5)
    rows = torch.tensor([1 / (r + 1) for r in range(8)], dtype=torch.float64)
    cols = torch.tensor([(r + 1) ** -0.5 for r in range(5)], dtype=torch.float64)
    assert torch.allclose(table.sum(1), rows / rows.sum()) and torch.allclose(table.sum(0), cols / cols.sum())
    assert table[0, 0] > table[0, 1]  # level 0 is the favoured pair of its colour
    # shape 0 then 4: levels 1 and 0 for colour 1, 0 and 4 for colour 0; the scaling multiplies rows and columns,
    # so this ratio of ratios is the pair law's alone
    decay = (table[1, 4] / table[1, 0]) / (table[0, 4] / table[0, 0])
    assert decay == pytest.approx(3.0 ** 5, rel=1e-9)
    held = WorldLaw(1.0, 0.5, 3.0, law.levels, ((0, 0), (3, 2)), 0).table(8, 5)
    assert held[0, 0] == held[3, 2] == 0 and float(held.sum()) == pytest.approx(1.0)
    even_rows, even_cols = torch.full((4,), 0.25, dtype=torch.float64), torch.full((3,), 1 / 3, dtype=torch.float64)
    uniform = scale_to_marginals(torch.rand(4, 3, generator=torch.Generator().manual_seed(0)), even_rows, even_cols)
    assert torch.allclose(uniform.sum(1), even_rows) and torch.allclose(uniform.sum(0), even_cols)


def test_caption_noise_scales_the_re_captioners_errors_and_zero_names_every_colour_right():
    pairs = [(c, s) for c in range(len(COLOURS)) for s in range(len(SHAPES))]
    rng = random.Random(0)
    scenes = [(rng.choice(pairs), rng.choice(pairs)) for _ in range(400)]

    def wrong_or_missing(noise):
        rng = random.Random(1)
        texts = [realistic_caption(a, b, rng, noise) for a, b in scenes]
        return sum(COLOURS[a[0]] not in t.lower() or COLOURS[b[0]] not in t.lower() for (a, b), t in zip(scenes, texts))

    assert wrong_or_missing(0.0) == 0
    assert 0 < wrong_or_missing(0.5) < wrong_or_missing(1.5)


def test_the_population_is_fixed_before_its_runs_and_the_population_mode_runs_it():
    assert POPULATION == DEVELOPMENT + KEPT_BACK and DEVELOPMENT == NAMED and len(POPULATION) >= 8
    assert len(POPULATION_SEEDS) >= 3
    variants, worlds, scenes, seeds, lengths, per_pair = composition.run_plan(
        composition.build_parser().parse_args(["--population"]))
    assert variants == composition_variants.POPULATION_VARIANTS and worlds == list(POPULATION)
    assert seeds == list(POPULATION_SEEDS) and lengths == [1950] and scenes == "fixed"
    assert composition.run_plan(composition.build_parser().parse_args(
        ["--worlds", "pair_tail", "population", "--seeds", "1"]))[1] == list(dict.fromkeys(["pair_tail", *POPULATION]))
    with pytest.raises(SystemExit):
        composition.build_parser().parse_args(["--worlds", "nowhere"])


def test_image_clusters_read_no_caption_and_the_captioned_world_shares_pair_tails_image_run():
    world = PairWorld("drawn-1", 0)
    scenes_pool = ScenePool(TilePool(world, 0, tiles=400), 0)
    scenes = scenes_pool.tiles.scenes(scenes_pool.left, scenes_pool.right)
    captions = scenes_pool.captions()
    image = WeightedScenes("image", captions, keep=0.6, scenes=scenes, seed=0)
    assert torch.equal(image.factors, WeightedScenes("image", ["nothing"] * len(captions), keep=0.6, scenes=scenes,
                                                     seed=0).factors)
    assert all(e.startswith("image:") for e in image.table.entries)
    assert len(image.table.entries) == round(len(scenes) ** 0.5)
    both = WeightedScenes("caption_image", captions, keep=0.6, scenes=scenes, seed=0)
    caption = WeightedScenes("caption", captions, keep=0.6, scenes=scenes, seed=0)
    assert both.table.entries == caption.table.entries + image.table.entries
    assert both.table.sample_entries(5) == caption.table.sample_entries(5) + image.table.sample_entries(5)
    assert 0 < caption.rule.alpha <= 1 and image.log()["alpha"] == image.rule.alpha
    job = dict(world="captioned", variant="image_spread", seed=1, steps=[4])
    assert composition.computed_as(job)["world"] == "pair_tail"
    for variant in ("caption_spread", "caption_image_spread", "imba_caption_spread"):
        assert composition.computed_as({**job, "variant": variant})["world"] == "captioned"


def test_the_population_levers_are_the_trainers_rules_and_the_imba_one_costs_what_its_loss_does():
    spread = composition_variants.VARIANTS["caption_spread"]
    assert spread.keep == 0.6 and spread.alpha is None and spread.stream == "caption"
    assert composition_variants.relative_cost("imba_caption_spread") == 1.3
    assert composition_variants.relative_cost("caption_image_spread") == 1.0
    with pytest.raises(ValueError, match="alpha or keep"):
        composition_variants.variant(stream="caption", alpha=0.5, keep=0.6)
    with pytest.raises(ValueError, match="alpha or keep"):
        composition_variants.variant(keep=0.6)


def _population_runs(values):
    """Fake finished runs: {(world, variant): (tail, held_out, head) success}, the same for seeds 0 and 1 but for
    a shift of 0.01 on seed 1 (every seed's differences equal), 1.0 on torso pairs; compute = 1950 × cost."""
    from composition_scenes import pair_name

    runs = []
    for (world_name, variant), (tail, held, head) in values.items():
        world = PairWorld(world_name, 0)
        for seed in (0, 1):
            level = {"tail": tail, "held_out": held, "head": head, "torso": 1.0}
            per_pair = {pair_name(p): level[world.buckets[p]] + 0.01 * seed for p in world.pairs}
            cost = composition_variants.relative_cost(variant)
            runs.append({"variant": variant, "seed": seed, "world": world_name, "buckets": world.bucket_of_name,
                         "results": {1950: {"per_pair": per_pair, "compute": 1950 * cost},
                                     **({2535: {"per_pair": per_pair, "compute": 2535}} if cost == 1 else {})}})
    return runs


def test_the_population_table_reads_each_lever_by_its_share_of_every_worlds_gap_and_its_worst_world():
    from composition_population_table import population_report, population_table

    runs = _population_runs({
        ("concept_tail", "plain"): (0.2, 0.3, 0.90), ("concept_tail", "plain_balanced"): (0.6, 0.7, 0.90),
        ("concept_tail", "caption_spread"): (0.5, 0.7, 0.88),
        ("drawn-0", "plain"): (0.4, 0.3, 0.80), ("drawn-0", "plain_balanced"): (0.6, 0.5, 0.80),
        ("drawn-0", "caption_spread"): (0.45, 0.5, 0.81)})
    table = population_table(runs, ["concept_tail", "drawn-0"], 1950)
    every = table["caption_spread"]["all"]
    assert every["worlds"] == 2 and set(table) == {"caption_spread"}
    assert every["tail"]["closed"] == pytest.approx((0.3 + 0.05) / (0.4 + 0.2))
    assert every["tail"]["worst"] == "drawn-0" and every["tail"]["worst_closed"] == pytest.approx(0.25)
    assert every["tail"]["worst_ci"] == pytest.approx((0.25, 0.25))  # both seeds close the same share
    assert every["tail"]["at_goal"] == 0 and every["held_out"]["at_goal"] == 2
    assert every["held_out"]["closed"] == pytest.approx(1.0)
    assert every["head"]["gain"][0] == pytest.approx(-0.5) and every["head"]["worst"] == "concept_tail"
    assert every["head"]["worst_gain"] == pytest.approx(-2.0)
    kept = table["caption_spread"]["kept back"]
    assert kept["worlds"] == 1 and kept["tail"]["closed"] == pytest.approx(0.25) and kept["tail"]["closed_ci"] is None
    report = population_report(table, 1950)
    # two worlds: too few for a bounded interval of their share
    assert "| caption_spread | all (2) | 58 % [—] | drawn-0: 25 % [25, 25] |" in report
    assert "| 0 / 2 of 2 | -0.5 ± " in report and "| concept_tail: -2.0 |" in report


def test_a_drawn_world_trains_through_the_benchmarks_run_with_each_population_lever():
    import composition_run

    job = dict(world="drawn-1", scenes="fixed", fixed_ranks=False, protocol=composition.PROTOCOL, steps=[2],
               per_pair=1, sampling_steps=2, batch_size=8, pool=300, oracle=str(composition.ORACLE), oracle_b=None,
               grid_dir=None, models_dir=None, seed=0)
    for variant in ("caption_spread", "caption_image_spread", "imba_caption_spread"):
        run = composition_run.run_one({**job, "variant": variant})
        factors = run["results"][2]["stream_factors"]
        assert 0 < factors["alpha"] <= 1 and factors["max_rate_over_uniform"] > 1
        assert run["held_out"] == [f"{COLOURS[c]} {SHAPES[s]}" for c, s in PairWorld("drawn-1", 0).held_out]
