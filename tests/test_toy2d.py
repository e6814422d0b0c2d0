"""Short version of the 2-D IMBA experiment (bench/toy2d.py, docs/method.md): the facts that hold with margin over
seeds.

"Early" here is 100 training steps: in this implementation the plain 100:1 model has mostly recovered the tail by
step 200 (bench/toy2d_results.md), so the early-training effects are asserted at 100. Each model is trained once
per module; the whole file takes ~20 s on 2 CPU cores.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from toy2d import (  # noqa: E402
    ToyConfig,
    draw_scatter,
    format_results,
    head_tail_distance,
    run_experiment,
    tail_drift,
    tail_mean_error,
    train_variant,
)

EARLY = 100  # steps
LATER = 300  # steps, for the bias of reference="target"
SEEDS = tuple(range(8))
BIAS_SEEDS = tuple(range(4))
CONFIG = ToyConfig()


@pytest.fixture(scope="module")
def models():
    """models[variant][seed][steps] for what the tests below need."""
    wanted = {
        "plain_balanced": {seed: (EARLY,) for seed in SEEDS},
        "plain_imbalanced": {seed: (EARLY, LATER) if seed in BIAS_SEEDS else (EARLY,) for seed in SEEDS},
        "imba_cond": {seed: (EARLY,) for seed in SEEDS},
        "imba_target": {seed: (LATER,) for seed in BIAS_SEEDS},
    }
    return {
        variant: {seed: train_variant(variant, steps, seed, CONFIG) for seed, steps in per_seed.items()}
        for variant, per_seed in wanted.items()
    }


def early_drifts(models, variant: str) -> list[float]:
    return [tail_drift(models[variant][seed][EARLY], seed, CONFIG) for seed in SEEDS]


def test_imbalance_pulls_the_tail_early(models):
    balanced = statistics.fmean(early_drifts(models, "plain_balanced"))
    imbalanced = statistics.fmean(early_drifts(models, "plain_imbalanced"))
    # measured on seeds 0-7: 0.074 vs 0.805 (10.8x); on seeds 8-15 0.058 vs 0.953
    assert imbalanced > 0.3
    assert imbalanced > 3 * balanced, (balanced, imbalanced)


def test_imba_distance_is_larger_on_the_tail_only_under_imbalance(models):
    for seed in SEEDS:
        imbalanced = head_tail_distance(models["plain_imbalanced"][seed][EARLY], seed, CONFIG)
        balanced = head_tail_distance(models["plain_balanced"][seed][EARLY], seed, CONFIG)
        # measured per seed: tail/head 7.0-8.6 under 100:1, 0.99-1.26 when balanced
        assert imbalanced["tail_d"] > 3 * imbalanced["head_d"], (seed, imbalanced)
        assert 0.5 < balanced["tail_d"] / balanced["head_d"] < 2.0, (seed, balanced)
        # the weight D = d ** gamma keeps the ordering
        assert imbalanced["tail_D"] > 2 * imbalanced["head_D"], (seed, imbalanced)


def test_imba_cond_cuts_the_early_drift(models):
    """Measured at 100 steps: median ratio 0.28 on seeds 0-7, 0.21-0.36 on every group of 4 seeds in 0-15; mean
    ratio 0.28 on seeds 0-7 but 0.67 on seeds 8-15 (0.49 over 0-15). The mean is fragile because the cond form
    starts cold: D = (p_c − p_u)² ** γ is ~0.1 on tail samples until the conditional model tells the tail from the
    null class, so in some seeds (11, 12) the tail is learnt no faster than with the plain loss. Hence the median
    carries the "at least in half" claim and the mean gets a looser bound."""
    plain = early_drifts(models, "plain_imbalanced")
    cond = early_drifts(models, "imba_cond")
    assert statistics.median(cond) < 0.5 * statistics.median(plain), (plain, cond)
    assert statistics.fmean(cond) < 0.8 * statistics.fmean(plain), (plain, cond)


def test_imba_target_pushes_the_tail_away_from_the_head(models):
    """reference="target" weights each sample by its own target's distance from p_uncond, which leans to the head, so
    tail targets pointing away from the head count more and the learnt tail overshoots (docs/method.md). Measured at 300
    steps: x offset +0.16..+0.72 in each of seeds 0-15, groups of 4 seeds +0.34..+0.43; plain 100:1 -0.07..+0.05."""
    target = [float(tail_mean_error(models["imba_target"][s][LATER], s, CONFIG)[0]) for s in BIAS_SEEDS]
    plain = [float(tail_mean_error(models["plain_imbalanced"][s][LATER], s, CONFIG)[0]) for s in BIAS_SEEDS]
    assert all(x > 0 for x in target), target
    assert statistics.fmean(target) > 0.15, target
    assert statistics.fmean(target) - statistics.fmean(plain) > 0.2, (target, plain)


def test_training_is_a_function_of_the_seed_only():
    rng_before = torch.get_rng_state()
    first = train_variant("imba_cond", 5, seed=3)[5].state_dict()
    again = train_variant("imba_cond", 5, seed=3)[5].state_dict()
    other = train_variant("imba_cond", 5, seed=4)[5].state_dict()
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not all(torch.equal(first[k], other[k]) for k in first)
    assert torch.equal(rng_before, torch.get_rng_state()), "training must not consume the global RNG"


def test_snapshots_equal_shorter_runs():
    # constant learning rate: the 3-step snapshot of a 6-step run is the 3-step run, so one run gives all lengths
    long_run = train_variant("plain_imbalanced", (3, 6), seed=0)
    short_run = train_variant("plain_imbalanced", 3, seed=0)
    a, b = long_run[3].state_dict(), short_run[3].state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert sorted(long_run) == [3, 6]


def test_run_experiment_and_report_shapes():
    config = ToyConfig(num_samples=200, distance_batch=256)
    results = run_experiment(steps=(4, 2), seeds=(0, 1), variants=("plain_balanced", "imba_target"), config=config)
    assert results.steps == (2, 4)
    assert len(results.drift["imba_target"][4]) == 2
    assert set(results.distance["plain_balanced"]) == {"head_d", "tail_d", "head_D", "tail_D"}
    report = format_results(results)
    assert "| steps | plain_balanced | imba_target |" in report
    assert report.count("\n| 2 |") == 2 and report.count("\n| 4 |") == 2  # drift table and signed-offset table


def test_unknown_variant_fails_with_a_clear_message():
    with pytest.raises(ValueError, match="unknown variant 'imba'"):
        train_variant("imba", 10, seed=0)


def test_scatter_picture_has_the_requested_size_and_needs_samples(tmp_path):
    from PIL import Image

    config = ToyConfig(num_samples=50, distance_batch=64)
    results = run_experiment(steps=(2,), seeds=(0,), variants=("plain_balanced", "imba_cond"), config=config,
                             plot_samples=20)
    draw_scatter(results, tmp_path / "toy2d.png", size=(900, 500))
    with Image.open(tmp_path / "toy2d.png") as img:
        assert img.format == "PNG" and img.size == (900, 500)
    with pytest.raises(ValueError, match="no samples to draw; run run_experiment"):
        draw_scatter(dataclasses.replace(results, samples={}), tmp_path / "none.png")
