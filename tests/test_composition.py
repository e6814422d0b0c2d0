"""The synthetic composition benchmark (bench/composition.py and its parts): its world, streams, judge, statistics
and a smoke run."""

import gzip
import json
import math
import shutil
import statistics
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import composition  # noqa: E402
import composition_report  # noqa: E402
import composition_run  # noqa: E402
import composition_variants  # noqa: E402
import composition_weighting  # noqa: E402
from composition_diagnostics import world_features  # noqa: E402
from composition_scenes import (COLOURS, HELD_OUT, HUES, MIN_TILES, NOTHING, SHAPES, WORLDS, Oracle,  # noqa: E402
                                PairWorld, ScenePool, TilePool, WordEncoder, caption,
                                colour_value, judge, oracle_accuracy, oracle_per_class, pair_name, probe_prompts,
                                render_tiles, rotate_hue, train_oracle)
from composition_worlds import balance_marginals  # noqa: E402
from imba.loss import IMBALoss  # noqa: E402


def test_world_holds_out_pairs_and_splits_the_seen_ones_in_thirds():
    world = PairWorld()
    assert len(world.pairs) == len(COLOURS) * len(SHAPES)
    assert math.isclose(float(world.probs.sum()), 1.0, rel_tol=1e-9)
    assert all(world.prob(p) == 0 and world.buckets[p] == "held_out" for p in HELD_OUT)
    counts = {b: sum(world.buckets[p] == b for p in world.seen) for b in ("head", "torso", "tail")}
    assert counts == {"head": 11, "torso": 12, "tail": 11}
    head_min = min(world.prob(p) for p in world.seen if world.buckets[p] == "head")
    tail_max = max(world.prob(p) for p in world.seen if world.buckets[p] == "tail")
    assert head_min > tail_max
    # every concept of a held-out pair is seen in training with another partner
    for c, s in HELD_OUT:
        assert any(world.prob((c, other)) > 0 for other in range(len(SHAPES)))
        assert any(world.prob((other, s)) > 0 for other in range(len(COLOURS)))


def test_pool_is_long_tailed_with_a_floor_for_every_seen_pair():
    world = PairWorld()
    counts = world.pool_counts(8192, 8)
    assert set(counts) == set(world.seen)
    assert min(counts.values()) == 8
    assert max(counts.values()) / min(counts.values()) > 300  # the head pair has hundreds of times the tail's tiles
    assert counts[(0, 0)] == round(8192 * world.prob((0, 0)))


def test_streams_draw_the_same_pool_long_tailed_or_pair_balanced():
    world = PairWorld()
    pool = TilePool(world, seed=0, tiles=600, floor=MIN_TILES)
    assert pool.images.shape == (len(pool), 3, 16, 16)
    g = torch.Generator().manual_seed(0)
    n = 20000
    tail = pool.draw(n, "long_tailed", generator=g)
    balanced = pool.draw(n, "pair_balanced", generator=g)
    assert int(tail.min()) >= 0 and int(tail.max()) < len(pool) and int(balanced.max()) < len(pool)

    def share(indices, pair):
        return sum(pool.pair_of_tile[i] == pair for i in indices.tolist()) / n

    head, rare = (0, 0), min(world.seen, key=world.prob)
    assert share(tail, head) == pytest.approx(pool.pair_of_tile.count(head) / len(pool), abs=0.015)
    assert share(tail, rare) < 0.03
    for pair in (head, rare):
        assert share(balanced, pair) == pytest.approx(1 / len(world.seen), abs=0.006)
    # no held-out pair is ever shown, in either stream
    assert not {pool.pair_of_tile[i] for i in torch.cat([tail, balanced]).tolist()} & set(HELD_OUT)
    scenes = pool.scenes(tail[:3], balanced[:3])
    assert scenes.shape == (3, 3, 16, 32)
    assert torch.equal(scenes[1, :, :, 16:], pool.images[balanced[1]])


def test_render_is_deterministic_in_range_and_can_draw_an_empty_tile():
    a = render_tiles([(0, 0), (4, 4), None], seed=1, tag="t")
    b = render_tiles([(0, 0), (4, 4), None], seed=1, tag="t")
    assert a.shape == (3, 3, 16, 16) and torch.equal(a, b)
    assert a.min() >= -1 and a.max() <= 1
    assert not torch.equal(a, render_tiles([(0, 0), (4, 4), None], seed=2, tag="t"))
    assert a[2].flatten(1).std(dim=1).max() == 0  # background only: one colour everywhere


def test_word_encoder_tells_words_and_their_positions_apart_and_has_a_one_token_null():
    text = WordEncoder(dim=8)
    embeds, mask = text.encode([(0, 0), (1, 0)], [(1, 0), (0, 0)])
    assert embeds.shape == (2, 8, 8) and mask.tolist() == [[1] * 8] * 2
    assert torch.equal(embeds[0, 2], embeds[1, 2])  # same shape word at the same place
    assert not torch.equal(embeds[0, 1], embeds[1, 1])  # different colour words
    # "a red circle and a blue circle" is not "a blue circle and a red circle": the bag of words is the same
    torch.testing.assert_close(embeds[0, 1] - text.positions[1], embeds[1, 5] - text.positions[5])
    assert not torch.allclose(embeds[0], embeds[1])
    null_embeds, null_mask = text.null(3)
    end = text.table[text.vocab["<end>"]]
    assert null_mask.tolist() == [[1] + [0] * 7] * 3
    torch.testing.assert_close(null_embeds[0, 0] - text.positions[0], embeds[0, 7] - text.positions[7])
    torch.testing.assert_close(null_embeds[0, 0], end + text.positions[0])
    assert caption((0, 0), (7, 4)) == "a red circle and a cyan ring"


def test_judge_counts_a_missing_object_and_a_colour_on_the_wrong_shape():
    left, right = [(0, 0)] * 5, [(1, 1)] * 5
    colours = torch.tensor([[0, 1], [0, 1], [1, 0], [1, 1], [2, 1]])
    shapes = torch.tensor([[0, 1], [NOTHING, 1], [0, 1], [0, 1], [0, 1]])
    ok, kinds = judge(colours, shapes, left, right)
    assert ok.tolist() == [True, False, False, False, False]
    # swapped colours and a colour leaking onto the other shape are binding failures; a third colour is not
    assert kinds == [None, "missing_object", "colour_on_wrong_shape", "colour_on_wrong_shape", "other"]
    # a right shape with the other object's colour is no binding failure when both objects share the colour
    ok, kinds = judge(torch.tensor([[0, 3]]), torch.tensor([[0, 1]]), [(0, 0)], [(0, 1)])
    assert kinds == ["other"]


def test_probe_prompts_put_each_pair_on_both_sides_next_to_head_pairs():
    world = PairWorld()
    prompts = probe_prompts(world, 4)
    assert len(prompts) == 4 * len(world.pairs)
    heads = {p for p in world.seen if world.buckets[p] == "head"}
    for probe, left, right in prompts:
        partner = right if left == probe else left
        assert probe in (left, right) and partner in heads and partner != probe
    first = prompts[:4]
    assert [p[1] == p[0] for p in first] == [True, False, True, False]


def test_inverse_frequency_weights_have_mean_one_and_favour_rare_concepts():
    pairs = [(0, 0)] * 6 + [(0, 1)] * 3 + [(1, 0)] * 1
    weights = composition_weighting.inverse_frequency_weights(pairs)
    assert math.isclose(sum(weights[p] for p in pairs) / len(pairs), 1.0)
    # colour 0: 9 of 10, colour 1: 1; shape 0: 7, shape 1: 3 → raw weight = mean of 10/count
    raw = {(0, 0): (10 / 9 + 10 / 7) / 2, (0, 1): (10 / 9 + 10 / 3) / 2, (1, 0): (10 / 1 + 10 / 7) / 2}
    scale = sum(raw[p] for p in pairs) / len(pairs)
    assert all(math.isclose(weights[p], raw[p] / scale) for p in raw)
    assert weights[(1, 0)] > weights[(0, 1)] > weights[(0, 0)]


def test_importance_weights_turn_the_pool_into_the_balanced_stream_in_expectation():
    pairs = [(0, 0)] * 6 + [(0, 1)] * 3 + [(1, 0)] * 1
    weights = composition_weighting.importance_weights(pairs)
    assert math.isclose(sum(weights[p] for p in pairs) / len(pairs), 1.0)
    # each pair's total weight in the pool is the same: every pair counts equally, as in the balanced stream
    assert all(math.isclose(pairs.count(p) * w, len(pairs) / 3) for p, w in weights.items())


def test_a_variant_is_data_and_a_key_the_runner_does_not_know_is_an_error():
    with pytest.raises(TypeError, match="distanse"):
        composition_variants.variant(kind="imba", distanse="l1")
    for bad, message in [(dict(kind="imba", distance="l3"), "loss.distance must be one of mse, l1, l2"),
                         (dict(stream="balanced"), "variant stream must be one of long_tailed"),
                         (dict(stream="caption"), "alpha or keep .one of them. sets the exponent of a weighted"),
                         (dict(alpha=0.5), "alpha or keep .one of them. sets the exponent of a weighted"),
                         (dict(stream="imba_online", keep=0.5), "starts from a temperature prior: give it alpha"),
                         (dict(kind="plain", shuffle_weights=True), "the plain loss has none"),
                         (dict(reweight="inverse"), "variant reweight must be one of None, inverse_freq"),
                         (dict(objective="edm"), "variant objective must be one of")]:
        with pytest.raises(ValueError, match=message):
            composition_variants.variant(**bad)
    # every loss setting of a variant reaches the loss it trains with, as the trainer's loss section does
    spec = composition_variants.variant(kind="imba", distance="l1", gamma=0.5, lam=0.7, reference="cond")
    assert spec.loss.build(patch_size=1).imba == IMBALoss(gamma=0.5, lam=0.7, patch_size=1, distance="l1",
                                                          reference="cond")
    with pytest.raises(TypeError, match="reference"):  # a setting the plain loss does not read
        composition_variants.variant(kind="plain", reference="cond")
    with pytest.raises(ValueError, match="variant loss kind must be one of plain, imba, imba_sample"):
        composition_variants.variant(kind="imba_tokens")
    assert all(isinstance(v, composition_variants.Variant) for v in composition_variants.VARIANTS.values())


def test_controls_and_levers_train_on_to_the_equal_compute_lengths():
    assert composition_variants.train_lengths("plain", [1000]) == [1000, 2000]
    # the longest length times the largest cost: every other variant's compute lies inside and is read by
    # interpolation between these points
    assert composition_variants.train_lengths("plain_balanced_eps", [100, 200]) == [100, 200, 400]
    assert composition_variants.train_lengths("plain_concept_balanced", [1000, 1500], factors=(1.3,)) == [1000, 1500, 1950]
    assert composition_variants.train_lengths("importance", [1000]) == [1000]
    assert composition_variants.train_lengths("imba_target", [1000]) == [1000]
    assert composition_variants.train_lengths("inverse_freq", [1000]) == [1000]  # a loss-side baseline, not a reference
    assert composition_variants.train_lengths("plain_hues", [1000], factors=(1.3,)) == [1000, 1300]
    assert composition_variants.train_lengths("plain", [1000], factors=()) == [1000]
    assert composition_variants.relative_cost("imba_cond_tnorm_efficient") == 1.3
    assert composition_variants.relative_cost("imba_sample") == 2.0 and composition_variants.relative_cost("inverse_freq") == 1.0


def test_variants_of_another_cost_leave_the_default_controls_lengths_as_they_were():
    new = ["caption_balanced", "caption_balanced_a1", "imba_grouped"]
    for variants in (composition_variants.DEFAULT_VARIANTS, composition_variants.DEFAULT_VARIANTS + new):
        factors = tuple(sorted({composition_variants.relative_cost(v) for v in variants} - {1.0}))
        lengths = {v: composition_variants.train_lengths(v, composition_variants.DEFAULT_STEPS, True, factors) for v in variants}
        for control in ("plain", "plain_balanced", "plain_concept_balanced"):
            assert lengths[control] == [1000, 1500, 1950]  # the settings of the recorded default runs
        assert lengths["imba_target_tnorm_efficient"] == [1000, 1500]
        for variant in set(new) & set(variants):  # compared with the controls, not controls themselves
            assert lengths[variant] == [1000, 1500] and not composition_variants.is_stream_control(variant)
    assert composition_variants.relative_cost("caption_balanced") == composition_variants.relative_cost("caption_balanced_a1") == 1.0
    assert composition_variants.relative_cost("imba_grouped") == pytest.approx(1 + 4 / 96)  # + B/8 no-grad rows at B = 32
    assert composition_variants.relative_cost("imba_grouped", batch_size=4) == pytest.approx(1 + 1 / 12)  # at least a row


def test_reaching_the_controls_adds_their_last_point_at_equal_steps_and_equal_compute():
    factors = (1 + 4 / 96, 1.3)
    reach = {v: composition_variants.train_lengths(v, [1000, 1500], True, factors, reach=True)
             for v in ("plain", "imba_target_tnorm_efficient", "caption_balanced", "imba_grouped")}
    assert reach["plain"] == [1000, 1500, 1950]  # the controls as without it
    assert reach["imba_target_tnorm_efficient"] == [1000, 1500]  # the costliest reaches 1950's compute at 1500
    assert reach["caption_balanced"] == [1000, 1500, 1950]
    assert reach["imba_grouped"] == [1000, 1500, 1872, 1950]  # 1872 steps × 1.0417 = 1950 plain steps
    assert composition_variants.train_lengths("imba_grouped", [1000, 1500], True, factors) == [1000, 1500]  # opt-in
    assert composition_variants.train_lengths("imba_grouped", [1000, 1500], False, factors, reach=True) == [1000, 1500]


def _scene_pool(seed=0, tiles=600):
    world = PairWorld("concept_tail", seed)
    pool = TilePool(world, seed=seed, tiles=tiles)
    return world, pool, ScenePool(pool, seed=seed)


def test_caption_balanced_factors_come_from_the_scene_captions_and_favour_a_rare_pairs_scenes():
    world, pool, scenes = _scene_pool()
    captions = scenes.captions()
    left, right = pool.pair_of_tile[int(scenes.left[3])], pool.pair_of_tile[int(scenes.right[3])]
    assert captions[3] == caption(left, right)
    stream = composition_weighting.WeightedScenes("caption", captions, alpha=0.5)
    assert stream.table.sample_entries(0)[:2] == captions[0].split()[1:3]  # the first object's colour and shape
    entries = set(stream.table.entries)
    assert {"red", "cross", "red:cross", "cross + ring"} <= entries  # concepts, bindings and object pairs
    assert not any("circle" in e and "hue" in e for e in entries)

    def pairs_of(i):
        return {pool.pair_of_tile[int(scenes.left[i])], pool.pair_of_tile[int(scenes.right[i])]}

    rare = min(world.seen, key=world.prob)
    heads = {p for p in world.seen if world.buckets[p] == "head"}
    with_rare = [i for i in range(len(scenes)) if rare in pairs_of(i)]
    head_only = [i for i in range(len(scenes)) if pairs_of(i) <= heads]
    assert with_rare and head_only
    for alpha in (0.5, 1.0):
        factors = composition_weighting.WeightedScenes("caption", captions, alpha=alpha).factors
        assert float(factors[with_rare].min()) > float(factors[head_only].mean())
    full = composition_weighting.WeightedScenes("caption", captions, alpha=1.0)
    # a larger exponent spreads the factors further
    assert float(full.factors.max() / full.factors.min()) > float(stream.factors.max() / stream.factors.min())
    g = torch.Generator().manual_seed(0)
    drawn = stream.draw(40000, g)
    rate = torch.bincount(drawn, minlength=len(scenes)).double() / len(drawn)
    expected = stream.factors / stream.factors.sum()
    assert float(rate[with_rare].sum()) == pytest.approx(float(expected[with_rare].sum()), rel=0.1)
    # 1.5 times their natural (uniform) rate in this small pool, where the rarest pair's 8 tiles are not so rare
    assert float(rate[with_rare].sum()) > 1.3 * len(with_rare) / len(scenes)
    log = stream.log()
    assert log["max_factor"] == pytest.approx(float(stream.factors.max()))
    assert log["max_rate_over_uniform"] > 1 and "refreshes" not in log


def test_the_online_stream_starts_at_the_temperature_prior_and_draws_by_the_online_balance_factors():
    from data.online_balance import FACTOR_ONE

    _, pool, scenes = _scene_pool(seed=1)
    captions = scenes.captions()
    stream = composition_weighting.WeightedScenes("imba_online", captions, alpha=0.5)
    prior = composition_weighting.WeightedScenes("caption", captions, alpha=0.5).factors
    assert torch.allclose(stream.factors / FACTOR_ONE, prior, rtol=1e-4)  # before any refresh: the prior itself
    rng = torch.Generator().manual_seed(3)
    rarest = torch.from_numpy(stream.online.group_of == 0)
    for _ in range(6):  # rows of the rarest group predicted three times worse without their caption, at every level
        rows = torch.randint(len(scenes), (400,), generator=rng)
        level = torch.rand(400, generator=rng)
        stream.observe(rows, (1 + level) * torch.where(rarest[rows], 3.0, 1.0), level)
        stream.refresh()
    factors = stream.online.sample_factors()
    assert torch.equal(stream.factors, torch.from_numpy(factors.astype("float64")))
    assert stream.online.weights[0] > FACTOR_ONE  # the rarest group's multiplier of its prior went up
    n = 40000
    drawn = stream.draw(n, torch.Generator().manual_seed(0))
    assert float(rarest[drawn].double().mean()) == pytest.approx(
        float(stream.factors[rarest].sum() / stream.factors.sum()), abs=0.01)
    log = stream.log()
    assert log["refreshes"] == 6 and log["max_factor"] == float(factors.max()) / FACTOR_ONE
    assert log["multipliers"][0] == stream.online.weights[0] / FACTOR_ONE and log["ratios"][0] > 1.3
    with pytest.raises(ValueError, match="unknown weighted stream"):
        composition_weighting.WeightedScenes("pair_balanced", captions)


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before `optimizer.step\\(\\)`")  # skipped
def test_the_benchmark_trains_through_the_trainers_step(monkeypatch):
    """Every step of a benchmark run is `imba.training.step.TrainStep`'s (loss, hooks, backward, clip, guard,
    optimizer), so a change to the trainer's step is what the benchmark measures: here, a guard that skips every
    step leaves the weights as initialised and the run's losses change."""
    from imba.training import guard, step

    calls, rates = [], []
    original = step.TrainStep.__call__

    def counted(self, n, batch, *args, **kwargs):
        calls.append((n, sorted(kwargs)))
        rates.append(self.optimizer.param_groups[0]["lr"])
        return original(self, n, batch, *args, **kwargs)

    monkeypatch.setattr(step.TrainStep, "__call__", counted)
    job = dict(world="concept_tail", scenes="fixed", fixed_ranks=False, protocol=composition.PROTOCOL, steps=[3],
               per_pair=1, sampling_steps=2, batch_size=4, pool=300, oracle=str(composition.ORACLE), oracle_b=None,
               grid_dir=None, models_dir=None, seed=0, variant="inverse_freq")
    trained = composition_run.run_one(job)["results"][3]
    assert calls == [(n, ["generator", "left", "right"]) for n in (1, 2, 3)]  # the re-weighted loss's own inputs
    # the trainer's builder with the protocol's warm-up, which its recorded studies ran: step n at n / 100 of 2e-3
    assert rates == [2e-3 * (n / 100) for n in (1, 2, 3)]
    monkeypatch.setattr(guard.DivergenceGuard, "step_is_bad", lambda self, grad_norm=None: True)
    skipped = composition_run.run_one(job)["results"][3]
    assert skipped["final_loss"] != trained["final_loss"] and skipped["compute"] == trained["compute"] == 3


@pytest.mark.slow
def test_the_balanced_streams_train_on_weighted_scenes_and_log_their_factors(tmp_path):
    """run_one of the caption- and IMBA-balanced variants: scenes drawn from the weighted stream, the no-grad
    unconditional rows counted in the compute, and the factors logged per evaluation."""
    job = dict(world="concept_tail", scenes="fixed", fixed_ranks=False, protocol=composition.PROTOCOL,
               steps=[composition_variants.BALANCE_EVERY * 2], per_pair=1, sampling_steps=2, batch_size=8, pool=300,
               oracle=str(composition.ORACLE), oracle_b=None, grid_dir=None, models_dir=None, seed=0)
    runs = {v: composition_run.run_one({**job, "variant": v}) for v in ("plain", "caption_balanced", "imba_grouped")}
    steps = composition_variants.BALANCE_EVERY * 2
    results = {v: run["results"][steps] for v, run in runs.items()}
    assert results["caption_balanced"]["compute"] == steps
    assert results["imba_grouped"]["compute"] == pytest.approx(steps * composition_variants.relative_cost("imba_grouped", 8))
    assert "stream_factors" not in results["plain"]
    online = results["imba_grouped"]["stream_factors"]
    assert online["refreshes"] == 2 and online["max_factor"] >= 1 and len(online["multipliers"]) == 4
    assert results["caption_balanced"]["stream_factors"]["max_rate_over_uniform"] > 1
    for variant in ("caption_balanced", "imba_grouped"):
        assert sum(results[variant]["exposure"].values()) == 2 * 8 * steps
        assert results[variant]["distinct_scenes"] <= len(TilePool(PairWorld("concept_tail", 0), 0, tiles=300))
    with pytest.raises(ValueError, match="--scenes fixed"):
        composition_run.run_one({**job, "variant": "imba_grouped", "scenes": "online"})


def test_hue_words_leave_the_named_words_and_positions_as_they_were():
    text = WordEncoder(dim=8, seed=3)
    base = len(("<end>", "a", "and") + COLOURS + SHAPES)
    g = torch.Generator().manual_seed(3)
    assert torch.equal(text.table[:base], torch.randn(base, 8, generator=g))
    assert torch.equal(text.positions, 0.5 * torch.randn(8, 8, generator=g))
    hue = (len(COLOURS) + 17, 2)
    assert pair_name(hue) == "hue17 triangle" and caption(hue, (0, 0)) == "a hue17 triangle and a red circle"
    embeds, _ = text.encode([hue], [(0, 0)])
    assert torch.equal(embeds[0, 1], text.table[text.vocab["hue17"]] + text.positions[1])


def test_the_colour_diversity_lever_adds_hue_tiles_with_the_worlds_shape_distribution():
    world = PairWorld()
    plain, hues = TilePool(world, seed=0, tiles=600), TilePool(world, seed=0, tiles=600, hue_tiles=2000)
    assert len(hues) == len(plain) + 2000 and torch.equal(hues.images[:len(plain)], plain.images)
    extra = hues.pair_of_tile[len(plain):]
    assert all(len(COLOURS) <= c < len(COLOURS) + HUES for c, _ in extra)
    assert len({c for c, _ in extra}) > HUES * 0.9
    shape_share = [sum(s == k for _, s in extra) / len(extra) for k in range(len(SHAPES))]
    pool_share = [sum(s == k for _, s in plain.pair_of_tile) / len(plain) for k in range(len(SHAPES))]
    assert shape_share == pytest.approx(pool_share, abs=0.04)
    # a hue tile is drawn in its hue: the object's pixels are far from the background and near the hue's RGB
    index = next(i for i in range(len(plain), len(hues)) if hues.pair_of_tile[i][1] in (0, 1))  # circle, square
    rgb = torch.tensor(colour_value(hues.pair_of_tile[index][0]), dtype=torch.float32) / 127.5 - 1
    centre = hues.images[index][:, 7:9, 7:9].mean(dim=(1, 2))
    assert torch.allclose(centre, rgb, atol=0.1)
    assert len({colour_value(len(COLOURS) + k) for k in range(HUES)}) == HUES


def test_the_burstiness_lever_gives_the_second_object_the_first_ones_colour():
    pool = TilePool(PairWorld(), seed=0, tiles=600)
    g = torch.Generator().manual_seed(0)
    left, others = pool.draw(400, "long_tailed", g), pool.draw(400, "long_tailed", g)
    always = pool.same_colour(left, 1.0, others, g)
    assert torch.equal(pool.colour_of_tile[always], pool.colour_of_tile[left])
    assert torch.equal(pool.same_colour(left, 0.0, others, g), others)
    half = pool.same_colour(left, 0.5, others, g)
    changed = (half != others).float().mean().item()
    assert 0.35 < changed < 0.55  # ≈ half, minus the draws that already had that colour or tile


def test_the_jitter_lever_rotates_hue_about_the_grey_axis():
    pool = TilePool(PairWorld(), seed=0, tiles=300)
    images = pool.images[:6]
    assert torch.allclose(rotate_hue(images, torch.zeros(6)), images, atol=1e-5)
    assert torch.allclose(rotate_hue(images, torch.ones(6)), images, atol=1e-5)  # a full turn
    turned = rotate_hue(images, torch.full((6,), 0.1))
    assert torch.allclose(rotate_hue(turned, torch.full((6,), -0.1)), images, atol=1e-4)
    assert (turned - images).abs().max() > 0.2
    grey = torch.full((1, 3, 2, 2), 0.3)
    assert torch.allclose(rotate_hue(grey, torch.tensor([0.25])), grey, atol=1e-5)


def test_world_features_read_the_probed_object_on_its_half_of_the_scene():
    world, text = PairWorld(), WordEncoder(seed=0)
    torch.manual_seed(0)
    from models.dit import build_transformer

    model = build_transformer("micro", 16, text.dim, in_channels=3, patch_size=4).eval()
    blocks, caption_rows, labels, groups, seen = world_features(model, text, world, patch=4)
    rows = len(world.pairs) * 4 * 2  # 4 prompts per pair, 2 noise draws each
    assert len(blocks) == 4 and all(b.shape == (rows, 96) for b in blocks) and caption_rows.shape == (rows, 32)
    assert groups.count("held_out") == len(HELD_OUT) * 8 and int(seen.sum()) == rows - len(HELD_OUT) * 8
    # the caption features are the probed object's own words: colour word + shape word (+ their positions), so a
    # linear probe reads colour and shape exactly, even for pairs never seen together
    from imba.eval.representations import probe_gap

    for name in ("colour", "shape"):
        assert probe_gap(caption_rows, labels[name], seen)["ood_accuracy"] == 1.0



def test_half_distances_split_the_token_grid_into_left_and_right():
    per_token = torch.arange(8.0).repeat(2, 1)  # 2 rows × 4 columns of tokens: left columns 0-1
    left, right = composition_run.half_distances(per_token, 2, 4)
    assert left.tolist() == [(0 + 1 + 4 + 5) / 4] * 2 and right.tolist() == [(2 + 3 + 6 + 7) / 4] * 2


def _runs(world, values, cost=None):
    """Fake finished runs: {(variant, length): {seed: success on tail pairs}}, 1.0 everywhere else; the probed
    half reads right whenever the prompt does, and on tail pairs 0.1 more. Compute = length × the variant's cost."""
    runs = {}
    for (variant, length), seeds in values.items():
        for seed, tail in seeds.items():
            per_pair = {pair_name(p): (tail if world.buckets[p] == "tail" else 1.0) for p in world.pairs}
            failures = {pair_name(p): {"missing_object": 1, "colour_on_wrong_shape": 0, "other": 0}
                        for p in world.pairs}
            run = runs.setdefault((variant, seed), {"variant": variant, "seed": seed, "results": {},
                                                    "settings": {"per_pair": 4}, "world": world.kind,
                                                    "buckets": world.bucket_of_name})
            c = (cost or {}).get(variant, composition_variants.relative_cost(variant))
            run["results"][length] = {"per_pair": per_pair, "failures": failures, "compute": c * length,
                                      "train_seconds": 0.01 * c * length,
                                      "per_pair_half": {k: min(1.0, v + 0.1) if v < 1 else v
                                                        for k, v in per_pair.items()}}
    return list(runs.values())


def test_levers_are_compared_with_each_imba_form_at_its_compute():
    world = PairWorld()
    runs = _runs(world, {("plain_hues", 100): {0: 0.2, 1: 0.3}, ("plain_hues", 130): {0: 0.5, 1: 0.7},
                         ("plain_hues", 200): {0: 0.9, 1: 0.9},
                         ("imba_target_tnorm_efficient", 100): {0: 0.4, 1: 0.4},
                         ("imba_target", 100): {0: 0.6, 1: 0.8}, ("plain", 100): {0: 0.1, 1: 0.1}})
    table = composition_report.levers_against_imba(runs, [100])[100]
    assert set(table) == {"plain_hues vs imba_target_tnorm_efficient", "plain_hues vs imba_target"}
    efficient = table["plain_hues vs imba_target_tnorm_efficient"]
    assert efficient["lever_steps"] == 130 and efficient["seeds"] == [0, 1]
    mean, half = efficient["buckets"]["tail"]
    assert mean == pytest.approx(0.2) and half == pytest.approx(12.7062047 * 0.1, rel=1e-7)  # diffs 0.1 and 0.3
    assert table["plain_hues vs imba_target"]["lever_steps"] == 200
    assert table["plain_hues vs imba_target"]["buckets"]["tail"][0] == pytest.approx(0.2)
    assert efficient["buckets"]["head"] == (0.0, 0.0)


def test_summary_and_gap_closed_pair_the_seeds_and_interpolate_the_controls_at_equal_compute():
    world = PairWorld()
    runs = _runs(world, {
        ("plain", 100): {0: 0.2, 1: 0.4}, ("plain", 200): {0: 0.3, 1: 0.5},
        ("plain_balanced", 100): {0: 0.6, 1: 0.8}, ("plain_balanced", 200): {0: 0.8, 1: 1.0},
        ("imba_target", 100): {0: 0.4, 1: 0.6}, ("imba_target_efficient", 100): {0: 0.4, 1: 0.6},
    })
    summary = composition_report.summarise(runs)
    mean, half = summary[100]["plain"]["tail"]
    assert math.isclose(mean, 0.3) and half == pytest.approx(12.7062047 * math.sqrt(0.02) / math.sqrt(2), rel=1e-7)
    assert summary[100]["plain"]["head"] == (1.0, 0.0)
    assert composition_report.summarise(runs, "per_pair_half")[100]["plain"]["tail"][0] == pytest.approx(0.4)
    steps = composition_report.gap_closed(runs, [100], compute=False)[100]["imba_target"]
    assert steps["reference"] == 100 and steps["seeds"] == [0, 1]
    assert steps["buckets"]["tail"]["gain"] == pytest.approx((0.2, 0.0))
    assert steps["buckets"]["tail"]["gap"] == pytest.approx((0.4, 0.0))
    assert steps["buckets"]["tail"]["fraction"] == pytest.approx(0.5)
    # every pair and seed closes half of its gap: so does every bootstrap draw
    assert steps["buckets"]["tail"]["fraction_ci"] == pytest.approx((0.5, 0.5))
    assert steps["buckets"]["head"]["fraction"] is None  # no gap on the head: no fraction
    uncertain = composition_report.gap_closed(_runs(world, {
        ("plain", 100): {0: 0.2, 1: 0.4}, ("plain_balanced", 100): {0: 0.9, 1: 0.45},
        ("imba_target", 100): {0: 0.4, 1: 0.6}}), [100], compute=False)[100]["imba_target"]
    assert uncertain["buckets"]["tail"]["fraction"] is None  # a gap whose interval reaches 0
    compute = composition_report.gap_closed(runs, [100], compute=True)[100]
    # literal IMBA costs 2 plain steps: compared with the controls at 200 steps (gap 0.5, gain 0.1)
    assert compute["imba_target"]["reference"] == 200
    assert compute["imba_target"]["buckets"]["tail"]["fraction"] == pytest.approx(0.1 / 0.5)
    # the efficient one 1.3: the controls read 30 % of the way from their 100 to their 200 steps evaluation
    efficient = compute["imba_target_efficient"]["buckets"]["tail"]
    assert compute["imba_target_efficient"]["reference"] == pytest.approx(130)
    assert efficient["gain"][0] == pytest.approx(0.5 - 0.33) and efficient["gap"][0] == pytest.approx(0.76 - 0.33)
    failures = composition_report.failure_table(runs, 100)
    assert failures["plain"]["tail"] == {"missing_object": 0.25, "colour_on_wrong_shape": 0.0, "other": 0.0}
    gaps = {("equal compute", "per_pair"): {100: compute}}
    report = composition_report.world_report("concept_tail", {m: composition_report.summarise(runs, m) for m in composition_report.METRICS},
                                      gaps, failures, {}, composition_report.run_facts(runs, 100),
                                      ["plain", "plain_balanced", "imba_target"], [100], seeds=2)
    assert "| plain @ 100 | 100.0 ± 0.0 | 100.0 ± 0.0 | 30.0 ± " in report
    assert "| plain_balanced @ 200 |" in report and "| imba_target @ 200 |" not in report
    assert "| imba_target | 200 | 0.0 ± 0.0 | 50.0 ± 0.0 | 10.0 ± 0.0 | 20 % [20, 20] |" in report
    assert "| imba_target | 2.000 |" in report  # counted compute per step


def test_at_compute_interpolates_between_evaluations_and_refuses_to_extrapolate():
    run = {"results": {100: {"compute": 100.0, "m": {"a": 0.2}}, 200: {"compute": 200.0, "m": {"a": 0.6}}}}
    assert composition_report.at_compute(run, 150.0, "m")["a"] == pytest.approx(0.4)
    assert composition_report.at_compute(run, 201.0, "m") == {"a": 0.6}  # within 2 %: the evaluation itself
    assert composition_report.at_compute(run, 260.0, "m") is None and composition_report.at_compute(run, 50.0, "m") is None



def test_generation_keeps_no_graph():
    # a graph kept through every sampling step of a 256-prompt batch took 13 GB per run
    from imba.objectives import build_objective
    from models.dit import build_transformer

    text = WordEncoder(seed=0)
    model = build_transformer("micro", 16, text.dim, in_channels=3, patch_size=4)
    images = composition_run.generate(model, build_objective("flow"), text, [(0, 0)] * 2, [(1, 1)] * 2,
                                      seed=0, steps=2)
    assert images.shape == (2, 3, 16, 32) and not images.requires_grad


def test_shuffled_weights_stay_within_their_noise_level_and_keep_its_distribution():
    def weights(pred_cond, pred_uncond, target, valid=None, timesteps=None):
        return torch.arange(12.0)[:, None].expand(12, 3), torch.ones(12, 3)  # row i: weight i on every token

    timesteps = torch.tensor([50, 60, 70, 80, 450, 460, 470, 480, 490, 950, 960, 970])  # bins 0, 4 and 9
    from imba.loss import TimestepMean

    shuffled = composition_weighting.weights_shuffled_within_levels(weights, TimestepMean(10).bin_of,
                                                                    torch.Generator().manual_seed(0))
    moved = []
    for _ in range(20):
        weight, d = shuffled(None, None, None, None, timesteps)
        rows = weight[:, 0].long()
        assert torch.equal(weight, rows[:, None].float().expand(12, 3)) and torch.equal(d, torch.ones(12, 3))
        for members in ([0, 1, 2, 3], [4, 5, 6, 7, 8], [9, 10, 11]):
            assert sorted(rows[members].tolist()) == members  # the level's weights, each once
        moved.append(rows.tolist())
    assert len({tuple(m) for m in moved}) > 10  # a fresh permutation each call


def test_half_weighted_loss_weighs_each_half_by_its_own_object():
    pred, target = torch.zeros(2, 3, 16, 32), torch.zeros(2, 3, 16, 32)
    pred[..., :16] = 1.0  # error 1 on every left pixel, 0 on the right
    pred[..., 16:] = 2.0  # error 4 on every right pixel
    left, right = torch.tensor([2.0, 0.0]), torch.tensor([0.5, 1.0])
    loss = composition_weighting.half_weighted_loss(pred, target, left, right)
    # scene 0: (2·1 + 0.5·4) / 2, scene 1: (0·1 + 1·4) / 2; mean over scenes
    assert loss.item() == pytest.approx(((2 + 2) / 2 + 4 / 2) / 2)
    unweighted = composition_weighting.half_weighted_loss(pred, target, torch.ones(2), torch.ones(2))
    assert unweighted.item() == pytest.approx(2.5)


def test_selection_noise_dropout_and_lever_draws_come_from_generators_of_their_own():
    roles = ("select", "noise", "drop", "lever")
    firsts = {torch.rand(4, generator=composition_run.generator_for(s, r)).sum().item()
              for s in range(5) for r in roles}
    assert len(firsts) == 20  # no two (seed, role) share a sequence
    a, b = composition_run.generator_for(3, "noise"), composition_run.generator_for(3, "noise")
    assert torch.equal(torch.rand(5, generator=a), torch.rand(5, generator=b))


def test_the_captioned_world_is_pair_tails_images_under_captions_a_re_captioner_writes():
    from data.balance import caption_entries
    from data.concepts import default_extractor

    captioned, pair_tail = PairWorld("captioned", 2), PairWorld("pair_tail", 2)
    assert captioned.held_out == pair_tail.held_out and torch.equal(captioned.probs, pair_tail.probs)
    assert captioned.buckets == pair_tail.buckets
    pool = TilePool(captioned, seed=2, tiles=2000)
    assert torch.equal(pool.images, TilePool(pair_tail, seed=2, tiles=2000).images)
    scenes = ScenePool(pool, seed=2)
    template, realistic = scenes.captions(), scenes.captions(noise=1.0)
    assert realistic == ScenePool(pool, seed=2).captions(noise=1.0)  # drawn from the seed
    assert realistic != ScenePool(TilePool(captioned, seed=3, tiles=2000), seed=3).captions(noise=1.0)
    assert len(set(realistic)) > 1.5 * len(set(template))  # many phrasings of one scene
    extractor = default_extractor()

    def bindings(text):
        return {e for e in caption_entries(extractor.mentions(text), extractor.kind) if ":" in e}

    true = [bindings(t) for t in template]
    read = [bindings(r) for r in realistic]
    kept = sum(len(t & r) for t, r in zip(true, read)) / sum(len(t) for t in true)
    wrong = sum(len(r - t) for t, r in zip(true, read)) / sum(len(t) for t in true)
    # omissions, synonyms the vocabulary does not know and attributes after their object lose bindings; wrong
    # colours and distractor clauses add false ones (the caption model's rates give about 58 % and 12 %)
    assert 0.45 < kept < 0.75 and 0.05 < wrong < 0.2
    assert any("violet" in r for r in realistic) and any(r.startswith("Two ") for r in realistic)


def test_a_variant_that_reads_no_captions_is_computed_once_for_pair_tail_and_the_captioned_world():
    job = dict(world="captioned", variant="plain", seed=1, steps=[4])
    assert composition.computed_as(job) == {**job, "world": "pair_tail"}
    for variant in ("caption_balanced", "imba_grouped"):
        assert composition.computed_as({**job, "variant": variant}) == {**job, "variant": variant}
    assert composition.computed_as({**job, "world": "concept_tail"})["world"] == "concept_tail"
    run = {"world": "pair_tail", "variant": "plain", "seed": 1, "settings": {"world": "pair_tail", "steps": [4]}}
    moved = composition.in_world(run, "captioned")
    assert moved["world"] == moved["settings"]["world"] == "captioned" and run["world"] == "pair_tail"


def test_worlds_draw_ranks_and_held_out_pairs_from_the_seed():
    for kind in WORLDS:
        worlds = [PairWorld(kind, seed) for seed in range(5)]
        assert PairWorld(kind, 3).held_out == worlds[3].held_out  # from the seed alone
        assert len({w.held_out for w in worlds}) == 5 and len({w.colour_rank for w in worlds}) == 5
        reference = sorted(PairWorld(kind).probs.tolist())
        for w in worlds:
            # the same frequency structure, other names at each rank
            assert sorted(w.probs.tolist()) == pytest.approx(reference)
            counts = {b: sum(w.buckets[p] == b for p in w.seen) for b in ("head", "torso", "tail")}
            assert counts == {"head": 11, "torso": 12, "tail": 11} and len(w.held_out) == 6
            for c, s in w.held_out:
                assert w.prob((c, s)) == 0
                assert any(w.prob((c, o)) > 0 for o in range(len(SHAPES)))
                assert any(w.prob((o, s)) > 0 for o in range(len(COLOURS)))
    assert PairWorld().held_out == HELD_OUT  # no seed: the listed order, the first recordings' world


def test_the_pair_tail_world_has_equal_concepts_and_long_tailed_pairs():
    world = PairWorld("pair_tail", 0)
    table = torch.zeros(len(COLOURS), len(SHAPES), dtype=torch.float64)
    for p in world.pairs:
        table[p] = world.prob(p)
    assert table.sum(1).tolist() == pytest.approx([1 / len(COLOURS)] * len(COLOURS), rel=1e-6)
    assert table.sum(0).tolist() == pytest.approx([1 / len(SHAPES)] * len(SHAPES), rel=1e-6)
    seen = [world.prob(p) for p in world.seen]
    assert max(seen) / min(seen) > 100  # the pairs are long-tailed all the same
    # the held-out pairs are of the rarest kind: every other pair of theirs is seen, each word is common
    counts = world.pool_counts()
    assert max(counts.values()) > 50 * min(counts.values()) and min(counts.values()) == MIN_TILES
    concept = PairWorld("concept_tail", 0)
    marginal = [sum(concept.prob((c, s)) for s in range(len(SHAPES))) for c in range(len(COLOURS))]
    assert max(marginal) / min(marginal) > 20  # the first world: rare words


def test_balance_marginals_makes_rows_and_columns_uniform_and_keeps_zeros():
    weights = torch.tensor([[8.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    table = balance_marginals(weights)
    assert table.sum(1).tolist() == pytest.approx([0.5, 0.5]) and table.sum(0).tolist() == pytest.approx([1 / 3] * 3)
    assert table[0, 2] == 0


def test_concept_balanced_stream_draws_uniform_colours_and_shapes():
    world = PairWorld("concept_tail", 1)
    pool = TilePool(world, seed=1, tiles=600)
    n = 20000
    drawn = pool.draw(n, "concept_balanced", torch.Generator().manual_seed(0))
    colours = torch.bincount(pool.colour_of_tile[drawn], minlength=len(COLOURS)).double() / n
    shapes = torch.bincount(pool.shape_of_tile[drawn], minlength=len(SHAPES)).double() / n
    assert colours.tolist() == pytest.approx([1 / len(COLOURS)] * len(COLOURS), abs=0.012)
    assert shapes.tolist() == pytest.approx([1 / len(SHAPES)] * len(SHAPES), abs=0.012)
    assert not {pool.pair_of_tile[i] for i in drawn.tolist()} & set(world.held_out)


def test_fixed_scenes_hold_every_tile_once_per_side_and_balanced_draws_choose_among_them():
    world = PairWorld("concept_tail", 2)
    pool = TilePool(world, seed=2, tiles=600)
    scenes = ScenePool(pool, seed=2)
    assert len(scenes) == len(pool)
    assert sorted(scenes.left.tolist()) == list(range(len(pool))) == sorted(scenes.right.tolist())
    assert torch.equal(ScenePool(pool, seed=2).left, scenes.left)  # composed from the seed alone
    n = 20000
    g = torch.Generator().manual_seed(0)
    rare = min(world.seen, key=world.prob)

    def share_with(chosen, pair):
        return sum(pool.pair_of_tile[int(scenes.left[i])] == pair or pool.pair_of_tile[int(scenes.right[i])] == pair
                   for i in chosen.tolist()) / n

    uniform, balanced = scenes.draw(n, "long_tailed", g), scenes.draw(n, "pair_balanced", g)
    assert int(balanced.max()) < len(scenes)
    # the drawn half is the rare pair 1 / 34 of the time (8 of 742 tiles: 2 % of uniform scenes hold it), from
    # only the 2 × 8 scenes that hold its tiles
    balanced_share = share_with(balanced, rare)
    assert balanced_share >= 1 / len(world.seen) - 0.005 and balanced_share > 1.5 * share_with(uniform, rare)
    holding = {i for i in range(len(scenes)) if rare in (pool.pair_of_tile[int(scenes.left[i])],
                                                         pool.pair_of_tile[int(scenes.right[i])])}
    assert len(holding) <= 2 * MIN_TILES


def test_exposure_tables_bin_pairs_and_read_concepts_by_rank_and_name():
    world = PairWorld("concept_tail", 0)
    names = [pair_name(p) for p in world.pairs]
    run = {"variant": "plain", "seed": 0, "buckets": world.bucket_of_name,
           "held_out": [pair_name(p) for p in world.held_out],
           "ranks": {"colour": {COLOURS[c]: r for c, r in enumerate(world.colour_rank)},
                     "shape": {SHAPES[s]: r for s, r in enumerate(world.shape_rank)}},
           "results": {10: {"exposure": {n: (0 if world.buckets[p] == "held_out" else 50 if world.buckets[p] == "tail"
                                             else 5000) for n, p in zip(names, world.pairs)},
                            "per_pair_half": {n: (0.2 if world.buckets[p] == "tail" else 0.9)
                                              for n, p in zip(names, world.pairs)}}}}
    table = composition_report.exposure_tables([run], 10)["plain"]
    assert table["bins"]["0-100"] == (pytest.approx(0.2), 11) and table["bins"]["3000-10000"][1] == 23
    top_colour = COLOURS[world.colour_rank.index(0)]
    assert table["colour_rank"]["0"] == table["colour"][top_colour]
    assert len(table["held_out"]) == 6


def test_the_shipped_oracles_are_read_per_class():
    for path in (composition.ORACLE, composition.ORACLE_B):
        oracle = Oracle()
        oracle.load_state_dict(torch.load(path, weights_only=True))
        report = oracle_per_class(oracle, per_class=3)
        assert set(report["clean"]["colour"]) == set(COLOURS) and set(report["clean"]["shape"]) == set(SHAPES)
        assert len(report["clean"]["pair"]) == 40 and min(report["clean"]["colour"].values()) >= 0.9


@pytest.mark.slow
def test_oracle_reads_fresh_tiles_and_empty_halves():
    _, report = train_oracle()
    assert report["pair_accuracy"] >= 0.98 and report["empty_accuracy"] >= 0.99 and report["test_tiles"] == 3000


def test_the_shipped_oracle_reads_fresh_tiles_it_never_saw():
    oracle = Oracle()
    oracle.load_state_dict(torch.load(composition.ORACLE, weights_only=True))
    report = oracle_accuracy(oracle, torch.Generator().manual_seed(7), seed=7, test_size=1000)
    assert report["pair_accuracy"] >= 0.99 and report["empty_accuracy"] >= 0.99
    assert report["pair_accuracy_degraded"] >= 0.98
    recorded = json.loads(composition.ORACLE.with_suffix(".json").read_text())
    assert recorded["pair_accuracy"] >= 0.99 and recorded["test_tiles"] == 3000


def recorded(folder) -> dict:
    """A study's record as written (gzip-compressed JSON)."""
    return json.loads(gzip.decompress((folder / composition_report.RESULTS).read_bytes()))


def test_a_recorded_study_reports_its_committed_tables_again(tmp_path):
    # every table of bench/composition_heldout/results.md comes from its compressed record alone
    study = REPO / "bench" / "composition_heldout"
    assert composition.main(["--report", str(study), "--out", str(tmp_path)]) == 0
    assert (tmp_path / "results.md").read_text() == (study / "results.md").read_text()
    assert {"composition.png", "exposure.png", composition_report.RESULTS} <= {p.name for p in tmp_path.iterdir()}
    again = composition_report.load_results(tmp_path)
    assert again["runs"] == composition_report.load_results(study)["runs"]
    assert set(again["runs"][0]["results"]) == {1000, 1500, 1950}  # lengths read back as ints
    with pytest.raises(SystemExit, match="holds no study of this benchmark's protocol"):
        composition.main(["--report", str(REPO / "bench" / "composition_eps"), "--out", str(tmp_path / "p1")])


@pytest.mark.slow
@pytest.mark.parametrize("study", ["composition_results_v2", "composition_balance", "composition_heldout_14",
                                   "composition_population"])
def test_every_recorded_study_reports_its_committed_tables_again(tmp_path, study):
    folder = REPO / "bench" / study
    assert composition.main(["--report", str(folder), "--out", str(tmp_path)]) == 0
    assert (tmp_path / "results.md").read_text() == (folder / "results.md").read_text()


def test_a_missing_oracle_is_a_one_line_error(tmp_path):
    with pytest.raises(SystemExit, match="no oracle at .*pass --train-oracle"):
        composition.main(["--oracle", str(tmp_path / "none.pt"), "--out", str(tmp_path)])


@pytest.mark.slow
def test_benchmark_smoke_run_writes_results_table_plots_and_grids(tmp_path, capsys):
    oracle, report = train_oracle(steps=20, pool_size=200, test_size=50)
    torch.save(oracle.state_dict(), tmp_path / "judge.pt")
    (tmp_path / "judge.json").write_text(json.dumps(report))
    argv = ["--variants", "plain", "plain_balanced", "plain_concept_balanced", "imba_cond_tnorm", "importance",
            "--seeds", "0", "--steps", "4", "--per-pair", "2", "--pool", "300", "--batch-size", "4", "--workers", "1",
            "--out", str(tmp_path), "--oracle", str(tmp_path / "judge.pt"), "--sampling-steps", "2"]
    assert composition.main(argv) == 0
    results = recorded(tmp_path)
    assert results["lengths"] == [4] and results["oracle"] == report and results["sampling_steps"] == 2
    assert results["worlds"] == list(composition_variants.DEFAULT_WORLDS) and results["scenes"] == "fixed"
    assert set(results["judges"]) == {"oracle", "second oracle"}  # the shipped second oracle reads beside
    variants = {"plain", "plain_balanced", "plain_concept_balanced", "imba_cond_tnorm", "importance"}
    assert ({(r["world"], r["variant"]) for r in results["runs"]}
            == {(w, v) for w in composition_variants.DEFAULT_WORLDS for v in variants})
    for run in results["runs"]:
        want = {"4", "8"} if run["variant"].startswith("plain") else {"4"}  # 8: imba_cond_tnorm's compute
        assert set(run["results"]) == want
        result = run["results"]["4"]
        assert result["compute"] == pytest.approx(4 * composition_variants.relative_cost(run["variant"]))  # counted
        assert 0 <= result["attribute_nmi"] < 1 and len(result["diagnostics"]["blocks"]) == 4
        rates, halves = result["per_pair"], result["per_pair_half"]
        assert len(rates) == 40 and all(r in (0.0, 0.5, 1.0) for r in rates.values())
        assert all(halves[p] >= rates[p] for p in rates)  # a prompt read right has its probed half right
        assert set(result["per_pair_b"]) == set(rates)
        assert all(sum(kinds.values()) == 2 * (1 - rates[p]) for p, kinds in result["failures"].items())
        assert sum(result["exposure"].values()) == 2 * 4 * 4  # two objects a scene, 4 scenes, 4 steps
        assert all(result["exposure"][n] == 0 for n in run["held_out"])
        assert result["distinct_scenes"] <= 16 and result["max_tile_repeat"] >= 1
        assert sorted(run["buckets"].values()).count("held_out") == 6
    worlds = results["worlds_results"]
    assert set(worlds["pair_tail"]["summary"]["per_pair_half"]) == {"4", "8"}
    assert "imba_cond_tnorm" in worlds["concept_tail"]["gap_closed"]["equal compute, per_pair"]["4"]
    assert "plain_concept_balanced" in worlds["concept_tail"]["gap_closed"]["equal steps, per_pair_half"]["4"]
    assert (tmp_path / "models" / "pair_tail-plain-seed0-8" / "config.json").is_file()
    text = (tmp_path / "results.md").read_text()
    assert "## World `pair_tail`" in text and "| imba_cond_tnorm |" in text and "Failure kinds" in text
    assert "probed half alone" in text and "Per shape name" in text and "## The judges" in text
    for name in ("composition.png", "exposure.png"):
        assert (tmp_path / name).stat().st_size > 1000
    assert (tmp_path / "samples_concept_tail_plain_8.png").is_file()
    # a rerun reuses the saved runs (an interrupted benchmark only redoes what is missing) and reports the same
    first = worlds["concept_tail"]["summary"]
    capsys.readouterr()
    assert composition.main(argv) == 0
    assert "reusing 10 finished runs" in capsys.readouterr().out
    assert recorded(tmp_path)["worlds_results"]["concept_tail"]["summary"] == first
    # a fresh checkout has the study's record but no runs/ folder: its recorded runs are reused as well
    shutil.rmtree(tmp_path / "runs")
    assert composition.main(argv) == 0
    assert "reusing 10 finished runs" in capsys.readouterr().out
    # the report again from the record alone: the same tables and record, the figures too
    assert composition.main(["--report", str(tmp_path), "--out", str(tmp_path / "again")]) == 0
    assert (tmp_path / "again" / "results.md").read_text() == (tmp_path / "results.md").read_text()
    assert recorded(tmp_path / "again") == recorded(tmp_path)
    assert (tmp_path / "again" / "composition.png").stat().st_size > 1000


@pytest.mark.slow
def test_levers_smoke_run_reports_the_levers_and_diagnoses_a_saved_model(tmp_path, capsys):
    oracle, report = train_oracle(steps=20, pool_size=200, test_size=50)
    torch.save(oracle.state_dict(), tmp_path / "judge.pt")
    (tmp_path / "judge.json").write_text(json.dumps(report))
    argv = ["--levers", "--seeds", "0", "--steps", "4", "--per-pair", "2", "--pool", "300", "--batch-size", "4",
            "--workers", "1", "--out", str(tmp_path), "--oracle", str(tmp_path / "judge.pt"), "--sampling-steps", "2"]
    assert composition.main(argv) == 0
    results = recorded(tmp_path)
    assert results["worlds"] == ["concept_tail"] and results["scenes"] == "online"
    assert sorted(r["variant"] for r in results["runs"]) == sorted(composition_variants.LEVER_VARIANTS)
    lengths = {r["variant"]: set(r["results"]) for r in results["runs"]}
    assert lengths["plain_jitter"] == {"4", "5"} and lengths["imba_target_tnorm_efficient"] == {"4"}
    nmi = {r["variant"]: r["results"]["4"]["attribute_nmi"] for r in results["runs"]}
    assert nmi["plain_hues"] != nmi["plain"]  # more colours, each seen with the world's shapes
    levers = results["worlds_results"]["concept_tail"]["levers"]
    assert set(levers["summary"]["4"]) == set(composition_variants.LEVER_VARIANTS)
    assert set(levers["relations"]["4"]) == {"attribute_nmi", "shape_probe_gap", "colour_probe_gap",
                                             "shape_probe_held_out", "cka_held_out"}
    text = (tmp_path / "results.md").read_text()
    assert "| plain_bursty @ 5 |" in text and "Does held-out composition track them?" in text
    against = levers["against_imba"]["4"]["plain_jitter vs imba_target_tnorm_efficient"]
    assert against["lever_steps"] == 5 and against["seeds"] == [0]
    assert "| plain_jitter vs imba_target_tnorm_efficient | 5 |" in text
    for name in ("levers.png", "blocks.png"):
        assert (tmp_path / name).stat().st_size > 5000
    # the command on a model the benchmark saved
    assert composition.main(["--diagnose", str(tmp_path / "models" / "concept_tail-plain_hues-seed0-5"),
                             "--out", str(tmp_path / "diag")]) == 0
    diag = json.loads((tmp_path / "diag" / "diagnostics.json").read_text())
    assert diag["groups"] == {"head": 44, "torso": 48, "tail": 44, "held_out": 24} and diag["rows"] == 320
    assert (tmp_path / "diag" / "diagnostics.png").stat().st_size > 5000
    with pytest.raises(SystemExit, match="no saved model"):
        composition.main(["--diagnose", str(tmp_path), "--out", str(tmp_path / "x")])
    with pytest.raises(SystemExit, match="--scenes online"):
        composition.main([*argv, "--variants", "plain_bursty", "--scenes", "fixed", "--workers", "1",
                          "--out", str(tmp_path / "fixed")])


def test_the_quick_modes_run_the_documented_plans():
    """`--quick` and `--levers --quick` resolve to what their help and bench/README.md promise; the smoke runs
    above train the same code paths at 4 steps (the quick runs themselves are benchmarks: minutes each)."""
    def plan(*argv):
        return composition.run_plan(composition.build_parser().parse_args(list(argv)))

    variants, worlds, scenes, seeds, lengths, per_pair = plan("--quick")
    assert variants == composition_variants.QUICK_VARIANTS and worlds == ["concept_tail", "pair_tail"] and scenes == "fixed"
    assert {"plain", "plain_balanced", "plain_concept_balanced", "imba_target_tnorm_efficient",
            "caption_balanced"} == set(variants)
    assert seeds == [0] and lengths == composition_variants.QUICK_STEPS == [400] and per_pair == 8
    variants, worlds, scenes, seeds, lengths, per_pair = plan("--levers", "--quick")
    assert variants == composition_variants.LEVER_VARIANTS and worlds == ["concept_tail"] and scenes == "online"
    assert seeds == [0] and lengths == [400] and per_pair == 4
    variants, _, _, seeds, lengths, per_pair = plan("--levers")
    assert seeds == [0, 1, 2] and lengths == [1000] and per_pair == 16
    variants, worlds, scenes, seeds, lengths, per_pair = plan()
    assert variants == composition_variants.DEFAULT_VARIANTS and seeds == composition_variants.DEFAULT_SEEDS
    assert lengths == sorted(composition_variants.DEFAULT_STEPS) and per_pair == composition_variants.DEFAULT_PER_PAIR
    assert plan("--quick", "--steps", "7", "3", "--seeds", "5")[3:5] == ([5], [3, 7])  # given values win
    assert set(plan("--variants", "all")[0]) == set(composition_variants.VARIANTS)
