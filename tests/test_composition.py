"""The synthetic composition benchmark (bench/composition.py): its world, weights, statistics and a smoke run."""

import json
import math
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import composition  # noqa: E402
from composition_scenes import (COLOURS, HELD_OUT, SHAPES, PairWorld, WordEncoder, caption, draw_pairs,  # noqa: E402
                                render, train_oracle)


def test_world_holds_out_pairs_and_splits_the_seen_ones_in_thirds():
    world = PairWorld()
    assert len(world.pairs) == len(COLOURS) * len(SHAPES)
    assert math.isclose(float(world.probs.sum()), 1.0, rel_tol=1e-9)
    assert all(world.prob(p) == 0 and world.buckets[p] == "held_out" for p in HELD_OUT)
    seen = [p for p in world.pairs if p not in HELD_OUT]
    counts = {b: sum(world.buckets[p] == b for p in seen) for b in ("head", "torso", "tail")}
    assert counts == {"head": 7, "torso": 7, "tail": 7}
    head_min = min(world.prob(p) for p in seen if world.buckets[p] == "head")
    tail_max = max(world.prob(p) for p in seen if world.buckets[p] == "tail")
    assert head_min > tail_max
    # the most frequent pair is ~50× the rarest seen one: a long tail
    probs = [world.prob(p) for p in seen]
    assert max(probs) / min(probs) > 40
    # every concept of a held-out pair is seen in training with another partner
    for c, s in HELD_OUT:
        assert any(world.prob((c, other)) > 0 for other in range(len(SHAPES)))
        assert any(world.prob((other, s)) > 0 for other in range(len(COLOURS)))


def test_draws_follow_the_world_and_never_show_held_out_pairs():
    world = PairWorld()
    pairs = draw_pairs(world, 4000, torch.Generator().manual_seed(0))
    assert not set(pairs) & set(HELD_OUT)
    share = pairs.count((0, 0)) / len(pairs)
    assert abs(share - world.prob((0, 0))) < 0.03


def test_render_is_deterministic_and_in_range():
    a = render([(0, 0), (4, 4)], seed=1, tag="t")
    b = render([(0, 0), (4, 4)], seed=1, tag="t")
    assert a.shape == (2, 3, 16, 16) and torch.equal(a, b)
    assert a.min() >= -1 and a.max() <= 1
    assert not torch.equal(a, render([(0, 0), (4, 4)], seed=2, tag="t"))


def test_word_encoder_gives_each_word_its_own_vector_and_a_one_token_null():
    text = WordEncoder(dim=8)
    embeds, mask = text.encode_pairs([(0, 0), (1, 0)])
    assert embeds.shape == (2, 4, 8) and mask.tolist() == [[1, 1, 1, 1]] * 2
    assert torch.equal(embeds[0, 2], embeds[1, 2])  # same shape word
    assert not torch.equal(embeds[0, 1], embeds[1, 1])  # different colour words
    null_embeds, null_mask = text.null(3)
    assert null_mask.tolist() == [[1, 0, 0, 0]] * 3 and torch.equal(null_embeds[0, 0], embeds[0, 3])


def test_inverse_frequency_weights_have_mean_one_and_favour_rare_concepts():
    pairs = [(0, 0)] * 6 + [(0, 1)] * 3 + [(1, 0)] * 1
    weights = composition.inverse_frequency_weights(pairs)
    assert math.isclose(sum(weights[p] for p in pairs) / len(pairs), 1.0)
    # colour 0: 9 of 10, colour 1: 1; shape 0: 7, shape 1: 3 → raw weight = mean of 10/count
    raw = {(0, 0): (10 / 9 + 10 / 7) / 2, (0, 1): (10 / 9 + 10 / 3) / 2, (1, 0): (10 / 1 + 10 / 7) / 2}
    scale = sum(raw[p] for p in pairs) / len(pairs)
    assert all(math.isclose(weights[p], raw[p] / scale) for p in raw)
    assert weights[(1, 0)] > weights[(0, 1)] > weights[(0, 0)]


def test_mean_ci_uses_the_t_interval_over_seeds():
    mean, half = composition.mean_ci([0.5, 0.7, 0.9])
    assert math.isclose(mean, 0.7) and math.isclose(half, 4.303 * 0.2 / math.sqrt(3), rel_tol=1e-6)
    assert composition.mean_ci([0.4]) == (0.4, 0.0)


def test_summary_averages_pairs_within_buckets_then_seeds():
    world = PairWorld()
    runs = []
    for seed, value in ((0, 0.2), (1, 0.4)):
        per_pair = {caption(p): (value if world.buckets[p] == "tail" else 1.0) for p in world.pairs}
        runs.append({"variant": "plain", "seed": seed, "results": {100: {"per_pair": per_pair}}})
    summary = composition.summarise(runs, world)
    mean, half = summary[100]["plain"]["tail"]
    assert math.isclose(mean, 0.3) and math.isclose(half, 12.706 * math.sqrt(0.02) / math.sqrt(2))
    assert summary[100]["plain"]["head"] == (1.0, 0.0)
    table = composition.markdown_table(summary, ["plain"], seeds=2)
    assert "| plain | 100.0 ± 0.0 | 100.0 ± 0.0 | 30.0 ± " in table


def test_bar_plot_draws_one_panel_per_length_and_rejects_an_empty_summary(tmp_path):
    from PIL import Image

    cells = {b: (0.5, 0.1) for b in composition.BUCKETS}
    summary = {100: {"plain": cells, "imba_cond": cells}, 200: {"plain": cells}}
    composition.bar_plot(summary, ["plain", "imba_cond"], tmp_path / "composition.png")
    with Image.open(tmp_path / "composition.png") as img:
        assert img.format == "PNG" and img.size == (2 * 620 + 220, 520)
    with pytest.raises(ValueError, match="nothing to draw"):
        composition.bar_plot({}, ["plain"], tmp_path / "none.png")


@pytest.mark.slow
def test_oracle_reads_fresh_renders_at_least_98_percent():
    _, report = train_oracle()
    assert report["pair_accuracy"] >= 0.98 and report["test_images"] == 2000


@pytest.mark.slow
def test_benchmark_smoke_run_writes_results_table_plot_and_grids(tmp_path, capsys):
    oracle, report = train_oracle(steps=20, pool_size=200, test_size=50)
    torch.save(oracle.state_dict(), tmp_path / "oracle.pt")
    (tmp_path / "oracle.json").write_text(json.dumps(report))
    argv = ["--variants", "plain", "imba_cond", "inverse_freq", "--seeds", "0", "--steps", "2", "4",
            "--per-pair", "2", "--pool", "64", "--batch-size", "4", "--workers", "1", "--out", str(tmp_path)]
    assert composition.main(argv) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["lengths"] == [2, 4] and results["oracle"] == report
    assert {r["variant"] for r in results["runs"]} == {"plain", "imba_cond", "inverse_freq"}
    for run in results["runs"]:
        assert set(run["results"]) == {"2", "4"}
        rates = run["results"]["4"]["per_pair"]
        assert len(rates) == 25 and all(r in (0.0, 0.5, 1.0) for r in rates.values())
        distance = run["results"]["4"]["distance_per_bucket"]
        # only IMBA computes the distance; the held-out pairs are never trained on
        assert (distance["head"] is not None) == (run["variant"] == "imba_cond") and distance["held_out"] is None
    assert set(results["summary"]) == {"2", "4"}
    assert "| imba_cond |" in (tmp_path / "results.md").read_text()
    assert (tmp_path / "composition.png").stat().st_size > 1000
    assert (tmp_path / "samples_plain_4.png").is_file()
    # a rerun reuses the saved runs (an interrupted benchmark only redoes what is missing) and reports the same
    first = results["summary"]
    capsys.readouterr()
    assert composition.main(argv) == 0
    assert "reusing 3 finished runs" in capsys.readouterr().out
    assert json.loads((tmp_path / "results.json").read_text())["summary"] == first
