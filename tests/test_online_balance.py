"""Online balancing (data.balance=imba): the rule of data/online_balance.py against its statement (the temperature
prior, rarity groups, evidence beyond noise), its noise test, exact sums over ranks, the segmented stream of
data/weighted.py, and the training-loop balancer of imba/training/balancing.py."""

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from data.balance import NoBalance, TemperatureBalance, balance_factors, build_concept_table
from data.concepts import default_extractor
from data.online_balance import FACTOR_ONE, MIN_ROWS, SIGNIFICANCE, ImbaBalance, OnlineBalance, rarity_groups
from data.weighted import UNIT, SegmentedOrder, WeightedOrder, expected_draws_to_units, reweighted_units
from imba.training.balancing import OnlineBalancer, loader_lag

RARE = "a red cross and a blue ring"
HEAD = "a blue square and a red ring"


@pytest.fixture(scope="module")
def table():
    # samples 0-4 rare (rarest entry count 5: group 0), 5-94 head (90) and 95-99 without a caption (counted as the
    # head entry, 95): both group 3
    return build_concept_table([RARE] * 5 + [HEAD] * 90 + [""] * 5, default_extractor())


def feed(balance, rng, rare_distance=2.0, head_distance=1.0, batches=20, scale=1.0, noise=0.0):
    """Rows drawn uniformly from the 95 captioned samples; rows of rare samples at `rare_distance`."""
    for _ in range(batches):
        idx = rng.integers(0, 95, 16)
        level = rng.random(16)
        d = scale * (1 + level) * np.where(idx < 5, rare_distance, head_distance) * (1 + noise * rng.random(16))
        balance.observe(idx, d, level)


def primed(table, **settings):
    """One level bin whose mean is 1: ten rows of caption-less samples at distance 1, then the first refresh (which
    scores no row: before it rows only feed the level means)."""
    balance = OnlineBalance(table, bins=1, **settings)
    balance.observe(np.r_[95:100, 95:100], np.ones(10), np.zeros(10))
    balance.refresh()
    return balance


def rows_at(balance, samples, n):
    """Observe rows of `samples` whose n is `n` (a primed balance: level mean 1, so d = n)."""
    balance.observe(samples, n, np.zeros(len(samples)))


def test_the_prior_is_the_temperature_factor_and_the_groups_are_bands_of_rarity(table):
    balance = OnlineBalance(table, alpha=0.5)
    prior = balance_factors(table, TemperatureBalance(0.5))
    assert np.array_equal(balance.sample_factors(), np.rint(prior * FACTOR_ONE).astype(np.int64))
    assert balance.sample_factors()[0] == round(FACTOR_ONE * (5 / 95) ** -0.5)  # the rare caption's prior
    assert balance.sample_factors()[99] == FACTOR_ONE  # no entries: the head's factor
    assert balance.group_of.tolist() == [0] * 5 + [3] * 95
    assert balance.rarest.tolist() == [5] * 5 + [90] * 90 + [95] * 5
    # alpha 0: the natural stream is the prior
    assert (OnlineBalance(table, alpha=0.0).sample_factors() == FACTOR_ONE).all()
    # a natural rate counts the entries at it (a source drawn twice counts twice), as the offline prior does
    natural = np.r_[np.full(5, 2.0), np.ones(95)]
    assert np.allclose(OnlineBalance(table, natural=natural).prior / FACTOR_ONE,
                       balance_factors(table, TemperatureBalance(0.5), natural), rtol=1e-5)


def test_the_defaults_are_the_ones_stated_before_the_benchmark_ran(table):
    from data.settings import DataConfig

    balance = OnlineBalance(table)
    assert (balance.alpha, balance.groups, balance.max_factor, balance.rate, balance.bins) == (0.5, 4, 4.0, 4.0, 10)
    rule = ImbaBalance()
    assert (rule.alpha, rule.groups, rule.max_factor, rule.rate, rule.every, rule.fraction) == (0.5, 4, 4.0, 4.0, 100,
                                                                                               0.125)
    built = rule.build(table)
    assert (built.alpha, built.groups, built.max_factor, built.rate) == (0.5, 4, 4.0, 4.0)
    odd = ImbaBalance(alpha=0.25, groups=3, max_factor=2.0, rate=1.5).build(table)  # each setting reaches the rule
    assert (odd.alpha, odd.groups, odd.max_factor, odd.rate) == (0.25, 3, 2.0, 1.5)
    assert isinstance(DataConfig().balance, NoBalance)
    assert (SIGNIFICANCE, MIN_ROWS) == (4.0, 16)


def test_the_groups_follow_the_counts_at_the_natural_rate(table):
    # a source that draws the rare caption 20 times as often makes it about as frequent as the head: one band
    natural = np.r_[np.full(5, 20.0), np.ones(95)]
    balance = OnlineBalance(table, natural=natural)
    assert balance.rarest[:5].tolist() == [100.0] * 5 and balance.rarest[50] == 90.0
    assert balance.group_of[0] == balance.group_of[50] and OnlineBalance(table).group_of[0] != 3


def test_rarity_groups_split_log_counts_into_equal_bands():
    assert rarity_groups(np.array([1, 20, 200, 2000, 10000]), 4).tolist() == [0, 1, 2, 3, 3]  # decades
    assert rarity_groups(np.array([1, 9, 11, 1000]), 3).tolist() == [0, 0, 1, 2]  # edges at 10 and 100
    assert rarity_groups(np.array([7, 7, 7]), 4).tolist() == [0, 0, 0]  # one band when every count is the same
    assert rarity_groups(np.array([5, 50]), 1).tolist() == [0, 0]
    assert rarity_groups(np.zeros(0), 4).size == 0
    # counts below 1 (a source drawn less than once per epoch): bands of their own logs
    groups = rarity_groups(np.array([0.01, 0.1, 1.0, 10.0]), 3)
    assert groups.tolist() == [0, 1, 2, 2] and groups.dtype == np.int64
    assert rarity_groups(np.array([7, 7]), 4).dtype == np.int64  # indices into the multipliers


@pytest.mark.parametrize("settings", [dict(max_factor=0.5), dict(rate=0.0), dict(rate=float("nan")), dict(bins=0),
                                      dict(groups=0), dict(alpha=-1.0)])
def test_settings_out_of_range_are_refused(table, settings):
    with pytest.raises(ValueError, match="must be"):
        OnlineBalance(table, **settings)
    OnlineBalance(table, max_factor=1.0, bins=1, groups=1, rate=1e-9)  # the bounds: 1 = the prior, one bin


def test_a_group_clearly_further_than_the_average_row_targets_its_ratio_to_the_power_rate(table):
    balance = primed(table)
    rows_at(balance, [0] * 64, np.full(64, 2.0))  # group 0: 64 rows at n = 2
    rows_at(balance, [5] * 64, np.ones(64))  # group 3: 64 rows at n = 1; n-bar = 1.5, pooled sd 0.5
    balance.refresh()
    ratio, se, evidence = balance.evidence()
    assert ratio[[0, 3]] == pytest.approx([4 / 3, 2 / 3]) and se[[0, 3]] == pytest.approx([0.5 / 8 / 1.5] * 2)
    # the part of |r - 1| = 1/3 beyond 4 standard errors (1/6)
    assert SIGNIFICANCE == 4 and evidence[[0, 3]] == pytest.approx([1 / 6, -1 / 6])
    # targets (7/6)^4 and (5/6)^4, half way there in log from 1: (7/6)^2 and (5/6)^2
    assert balance.weights[0] == pytest.approx(FACTOR_ONE * 49 / 36, abs=1)
    assert balance.weights[3] == pytest.approx(FACTOR_ONE * 25 / 36, abs=1)
    assert balance.weights[1] == balance.weights[2] == FACTOR_ONE  # no rows: no evidence
    assert ratio[1] == 1.0 and evidence[1] == 0.0
    factors = balance.sample_factors()
    assert factors[0] == (balance.prior[0] * balance.weights[0]) >> 16  # its prior times its multiplier
    assert factors[50] == (balance.prior[50] * balance.weights[3]) >> 16
    capped = primed(table, max_factor=1.2)  # targets clipped to [1/1.2, 1.2] before the half-way move
    rows_at(capped, [0] * 64, np.full(64, 2.0))
    rows_at(capped, [5] * 64, np.ones(64))
    capped.refresh()
    assert capped.weights[0] == round(FACTOR_ONE * math.sqrt(1.2))
    assert capped.weights[3] == round(FACTOR_ONE * math.sqrt(1 / 1.2))


def test_a_deviation_within_significance_standard_errors_moves_nothing(table):
    balance = primed(table)
    rows_at(balance, [0] * 64, np.tile([0.0, 4.0], 32))  # group 0: mean 2, as above, but spread
    rows_at(balance, [5] * 64, np.ones(64))  # n-bar 1.5; pooled sd 1.5: se = 1.5 / 8 / 1.5
    balance.refresh()
    ratio, se, evidence = balance.evidence()
    assert se[0] == pytest.approx(0.125) and ratio[0] == pytest.approx(4 / 3)
    assert ratio[0] - 1 < SIGNIFICANCE * se[0] and evidence[0] == 0.0
    assert (balance.weights == FACTOR_ONE).all()


def test_a_group_with_fewer_than_min_rows_is_not_moved(table):
    balance = primed(table)
    rows_at(balance, [0] * (MIN_ROWS - 1), np.full(MIN_ROWS - 1, 3.0))
    rows_at(balance, [5] * 64, np.ones(64))
    balance.refresh()
    ratio, _, evidence = balance.evidence()
    assert ratio[0] > 2 and evidence[0] == 0.0 and balance.weights[0] == FACTOR_ONE
    one = primed(table)  # a single row: its ratio is read (and reported), its evidence not
    rows_at(one, [0], np.array([3.0]))
    rows_at(one, [5] * 3, np.ones(3))
    one.refresh()
    assert one.evidence()[0][0] == pytest.approx(3 / 1.5) and one.evidence()[2][0] == 0.0
    enough = primed(table)  # one row more: read
    rows_at(enough, [0] * MIN_ROWS, np.full(MIN_ROWS, 3.0))
    rows_at(enough, [5] * 64, np.ones(64))
    enough.refresh()
    assert enough.evidence()[2][0] > 0 and enough.weights[0] > FACTOR_ONE


def test_a_multiplier_moves_half_way_in_log_towards_its_target_and_stays_within_max_factor(table):
    balance = primed(table, max_factor=4.0)
    balance.weights[:] = [4 * FACTOR_ONE, FACTOR_ONE // 4, 2 * FACTOR_ONE, FACTOR_ONE]
    balance.observe([96], [1.0], [0.0])  # one row: no group has evidence
    balance.refresh()
    assert balance.weights.tolist() == [2 * FACTOR_ONE, FACTOR_ONE // 2, round(math.sqrt(2) * FACTOR_ONE),
                                        FACTOR_ONE]
    strong = primed(table, max_factor=2.0)
    for _ in range(12):  # target 2 (clipped): the multiplier approaches it and never passes it
        rows_at(strong, [0] * 32, np.full(32, 5.0))
        rows_at(strong, [5] * 32, np.ones(32))
        strong.refresh()
        assert strong.weights[0] <= 2 * FACTOR_ONE and strong.weights[3] >= FACTOR_ONE // 2
    assert strong.weights[0] > 1.99 * FACTOR_ONE and strong.weights[3] < 0.51 * FACTOR_ONE


def test_noise_leaves_the_stream_at_its_prior(table):
    """Distances that carry no signal about the samples: the rare rows' distances given to random rows of the same
    level. Every group's multiplier stays at 1, and the factors are the temperature prior, refresh after refresh;
    the same distances unshuffled move the rare group."""
    rng = np.random.default_rng(11)
    signal, shuffled = OnlineBalance(table), OnlineBalance(table)
    for refresh in range(60):
        idx = rng.integers(0, 100, 200)
        level = rng.random(200)
        d = (1 + 3 * level) * np.where(idx < 5, 2.0, 1.0) * rng.gamma(4, 0.25, 200)
        signal.observe(idx, d, level)
        shuffled.observe(rng.permutation(idx), d, level)  # the same rows, each distance on another sample
        signal.refresh()
        shuffled.refresh()
        assert (shuffled.weights == FACTOR_ONE).all(), f"refresh {refresh}: {shuffled.describe()}"
    assert np.array_equal(shuffled.sample_factors(), shuffled.prior)
    assert signal.weights[0] > 1.5 * FACTOR_ONE


def test_pure_noise_over_a_many_caption_table_moves_no_group(table):
    captions = [f"a {c} {s}" for c in ("red", "blue", "green", "yellow", "purple", "orange", "black", "cyan")
                for s in ("circle", "square", "triangle", "cross", "ring")]
    rng = np.random.default_rng(5)
    many = build_concept_table([captions[min(int(rng.zipf(1.6)) - 1, 39)] for _ in range(3000)],
                               default_extractor())
    balance = OnlineBalance(many)
    assert len(set(balance.group_of.tolist())) == 4
    moved = 0
    for _ in range(100):
        idx = rng.integers(0, len(many), 256)
        level = rng.random(256)
        balance.observe(idx, (1 + level) * rng.exponential(1.0, 256), level)
        balance.refresh()
        moved += int((balance.weights != FACTOR_ONE).any())
    assert moved == 0


def test_a_loss_falling_for_every_sample_does_not_hide_the_rare_ones(table):
    # the level means come from earlier, higher-loss windows: every row's n is below 1, the rare rows still 2x
    balance, rng = OnlineBalance(table), np.random.default_rng(2)
    for k in range(8):
        feed(balance, rng, scale=0.7 ** k, batches=40)
        balance.refresh()
    assert balance.weights[0] > FACTOR_ONE and balance.weights[3] <= FACTOR_ONE


def test_a_boosted_group_gives_its_draws_back_once_its_distance_comes_down(table):
    balance, rng = OnlineBalance(table), np.random.default_rng(1)
    for _ in range(8):
        feed(balance, rng, batches=40)
        balance.refresh()
    peak = int(balance.weights[0])
    assert peak > 2 * FACTOR_ONE
    for _ in range(24):  # half way back in log at every refresh, and exactly there in fixed point
        feed(balance, rng, rare_distance=1.0, batches=40)
        balance.refresh()
    assert balance.weights[0] == FACTOR_ONE  # back to its prior, not below: its distance is now the average's


def test_each_row_lands_in_the_bin_of_its_noise_level(table):
    balance = OnlineBalance(table, bins=4)
    balance.observe([0, 1, 2, 3, 4, 5, 6], [1.0] * 7, [0.0, 0.24, 0.25, 0.6, 0.99, 1.0, -0.3])  # the ends clipped
    assert balance.window["bin_rows"].tolist() == [3, 1, 1, 2]


def test_training_reads_the_noise_level_in_tenths(table):
    balance = OnlineBalance(table)  # the bins left to the default, as the trainer makes it
    balance.observe([95, 96, 97], [1.0, 2.0, 4.0], [0.05, 0.15, 0.95])
    assert balance.bins == 10 and np.flatnonzero(balance.window["bin_rows"]).tolist() == [0, 1, 9]


def test_a_row_is_read_against_the_mean_of_its_level_bin(table):
    balance = OnlineBalance(table, bins=4)  # bins [0, .25), [.25, .5), [.5, .75), [.75, 1)
    balance.observe([95, 96, 97, 98], [1.0, 2.0, 4.0, 8.0], [0.1, 0.3, 0.6, 0.9])  # bin means 1, 2, 4, 8
    balance.refresh()
    balance.observe([0, 5], [2.0, 2.0], [0.49, 0.5])  # the same distance: n = 2/2 = 1 (rare), 2/4 = 0.5 (head)
    assert balance.window["group_sum"].tolist() == [FACTOR_ONE, 0, 0, FACTOR_ONE // 2]
    assert balance.window["row_sq"].tolist() == [FACTOR_ONE + FACTOR_ONE // 4]


def test_a_row_at_a_level_without_a_mean_is_read_against_the_mean_over_all_levels(table):
    balance = OnlineBalance(table, bins=2)
    balance.observe([95, 96], [2.0, 4.0], [0.1, 0.2])  # only the lower bin has rows: mean 3, over all levels 3
    balance.refresh()
    balance.observe([0, 5], [6.0, 3.0], [0.75, 0.25])  # n = 6/3 = 2 (upper bin, no mean), 3/3 = 1
    assert balance.window["group_sum"].tolist() == [2 * FACTOR_ONE, 0, 0, FACTOR_ONE]


def test_a_level_bin_of_one_row_has_that_rows_distance_as_its_mean(table):
    balance = OnlineBalance(table, bins=2)
    balance.observe([95, 96, 97], [2.0, 4.0, 4.0], [0.1, 0.6, 0.7])  # lower bin: one row, mean 2; upper: mean 4
    balance.refresh()
    balance.observe([0, 5], [2.0, 4.0], [0.2, 0.8])  # each at its bin's mean: n = 1 and 1
    assert balance.window["group_sum"].tolist() == [FACTOR_ONE, 0, 0, FACTOR_ONE]


def test_before_the_first_refresh_rows_only_feed_the_level_means(table):
    balance = OnlineBalance(table, bins=1)
    balance.observe([0, 5, 95], [3.0, 1.0, 1.0], [0.0, 0.0, 0.0])
    assert balance.window["bin_rows"].tolist() == [3] and not balance.window["group_rows"].any()
    assert balance.window["row_count"][0] == 0
    balance.refresh()
    assert (balance.weights == FACTOR_ONE).all()


def test_each_refresh_halves_the_running_statistics_before_adding_its_window(table):
    balance = primed(table)  # level bin: 10 rows summing to 10
    rows_at(balance, [0, 0, 5], np.array([3.0, 1.0, 1.0]))
    balance.refresh()
    assert balance.running["group_rows"].tolist() == [2 * FACTOR_ONE, 0, 0, FACTOR_ONE]
    assert balance.running["bin_rows"].tolist() == [5 + 3]
    balance.observe([5], [1.0], [0.0])
    balance.refresh()
    assert balance.running["group_rows"].tolist() == [FACTOR_ONE, 0, 0, FACTOR_ONE // 2 + FACTOR_ONE]
    assert balance.running["group_sum"][0] == 2 * FACTOR_ONE  # (3 + 1) / 2
    assert balance.running["row_count"][0] == 3 * FACTOR_ONE // 2 + FACTOR_ONE  # 3 rows halved, one added


def test_non_finite_distances_are_left_out(table):
    balance = OnlineBalance(table)
    balance.observe([0, 1, 2], [np.nan, 1.0, np.inf], [0.5, 0.5, 0.5])
    assert balance.window["bin_rows"].sum() == 1
    with pytest.raises(ValueError, match="one each per row"):
        balance.observe([0, 1], [1.0], [0.5])


def test_a_sample_index_out_of_range_is_refused(table):
    with pytest.raises(IndexError, match="out of range for 100 samples"):
        OnlineBalance(table).observe([100], [1.0], [0.5])


def test_observations_are_fixed_point_integers_and_their_sums_do_not_depend_on_how_rows_are_split(table):
    balance = primed(table)
    rows_at(balance, [0], np.array([2 / 3]))  # n = 2/3 at level mean 1
    # fixed point, FACTOR_ONE = 1.0: a row counts FACTOR_ONE in its group, its n and n^2 rounded
    assert balance.window["group_sum"][0] == round(2 / 3 * FACTOR_ONE)
    assert balance.window["row_sq"][0] == (round(2 / 3 * FACTOR_ONE) ** 2) >> 16
    assert balance.window["group_rows"][0] == FACTOR_ONE and not balance.window["group_rows"][1:].any()
    assert balance.window["row_sum"][0] == round(2 / 3 * FACTOR_ONE) and balance.window["row_count"][0] == FACTOR_ONE
    rng = np.random.default_rng(6)
    idx, d = rng.integers(0, 100, 300), rng.uniform(0, 3, 300) ** 3  # spread magnitudes: float sums would drift
    one, parts = primed(table), [primed(table) for _ in range(3)]
    one.observe(idx, d, np.zeros(300))
    for k, part in enumerate(parts):  # every third row, in reverse order
        part.observe(idx[k::3][::-1], d[k::3][::-1], np.zeros(idx[k::3].size))
    summed = [sum(arrays) for arrays in zip(*(p.window_arrays() for p in parts))]
    assert all(np.array_equal(a, b) for a, b in zip(one.window_arrays(), summed))
    one.refresh()
    parts[0].refresh(lambda _: summed)
    assert np.array_equal(one.weights, parts[0].weights)


def test_windows_summed_over_ranks_give_exactly_the_single_process_weights(table):
    rng = np.random.default_rng(4)
    rows = [(rng.integers(0, 95, 16), None, rng.random(16)) for _ in range(240)]
    rows = [(i, (1 + t) * np.where(i < 5, 2.0, 1.0) * rng.uniform(0.7, 1.3, 16), t) for i, _, t in rows]
    single, ranks = OnlineBalance(table), [OnlineBalance(table), OnlineBalance(table)]
    for window in range(6):
        batch = rows[40 * window:40 * window + 40]
        for k, (i, d, t) in enumerate(batch):
            single.observe(i, d, t)
            ranks[k % 2].observe(i, d, t)  # each rank sees its half, in its own order

        single.refresh()
        totals = [a + b for a, b in zip(ranks[0].window_arrays(), ranks[1].window_arrays())]
        for r in ranks:
            r.refresh(lambda _: totals)
        assert np.array_equal(single.weights, ranks[0].weights) and np.array_equal(single.weights, ranks[1].weights)
    assert single.weights[0] > FACTOR_ONE


def test_the_state_round_trips_and_continues_identically(table):
    rng = np.random.default_rng(5)
    a = OnlineBalance(table)
    for _ in range(3):
        feed(a, rng, batches=40)
        a.refresh()
    feed(a, rng, batches=5)  # a window in progress: it must travel with the state
    b = OnlineBalance(table)
    b.load_state_dict(a.state_dict())
    for k in range(4):  # the same further rows into both, and a refresh after each window
        feed(a, np.random.default_rng(10 + k), rare_distance=1.0 if k >= 2 else 2.0, batches=40)
        feed(b, np.random.default_rng(10 + k), rare_distance=1.0 if k >= 2 else 2.0, batches=40)
        a.refresh()
        b.refresh()
        assert np.array_equal(a.weights, b.weights)
        assert all(np.array_equal(x, y) for x, y in zip(a.evidence(), b.evidence()))
        assert a.refreshes == b.refreshes == 4 + k
    assert a.weights[0] > FACTOR_ONE  # the comparison ran on moved multipliers, not on the initial ones


def test_a_lowered_max_factor_holds_for_a_loaded_state(table):
    high = primed(table, max_factor=4.0)
    high.weights[:] = [3 * FACTOR_ONE, FACTOR_ONE, FACTOR_ONE, FACTOR_ONE // 3]
    low = OnlineBalance(table, max_factor=2.0, bins=1)
    low.load_state_dict(high.state_dict())
    assert low.weights.tolist() == [2 * FACTOR_ONE, FACTOR_ONE, FACTOR_ONE, FACTOR_ONE // 2]


def test_a_state_is_refused_by_a_table_of_other_entries_other_groups_or_another_rule(table):
    balance = OnlineBalance(table)
    balance.observe(np.arange(10), np.ones(10), np.zeros(10))
    balance.refresh()
    state = balance.state_dict()
    small = OnlineBalance(build_concept_table(["a green star"], default_extractor()))
    with pytest.raises(ValueError, match="entries"):
        small.load_state_dict(state)
    # the same 11 entries, numbered in another order (head caption first)
    reordered = build_concept_table([HEAD, RARE], default_extractor())
    assert sorted(reordered.entries) == sorted(table.entries) and reordered.entries != table.entries
    with pytest.raises(ValueError, match="entries"):
        OnlineBalance(reordered).load_state_dict(state)
    with pytest.raises(ValueError, match="level bins"):
        OnlineBalance(table, bins=4).load_state_dict(state)
    with pytest.raises(ValueError, match="rarity groups"):
        OnlineBalance(table, groups=2).load_state_dict(state)
    old = {k: v for k, v in state.items() if k not in ("rule", "groups")}  # the per-entry rule's state
    with pytest.raises(ValueError, match="per-entry rule of an earlier version"):
        OnlineBalance(table).load_state_dict(old)


def test_the_log_line_gives_each_groups_multiplier_and_its_counts(table):
    balance = OnlineBalance(table)
    assert balance.describe() == ("online balance: 0 refreshes; draws x prior by rarest-entry count "
                                  "5-5: 1.00x, 90-95: 1.00x")
    balance.weights[:] = [round(2.5 * FACTOR_ONE), FACTOR_ONE, FACTOR_ONE, FACTOR_ONE // 2]
    balance.refreshes = 3
    assert balance.describe() == ("online balance: 3 refreshes; draws x prior by rarest-entry count "
                                  "5-5: 2.50x, 90-95: 0.50x")


def test_reweighted_units_keep_each_groups_total_and_follow_the_factors():
    units = expected_draws_to_units(np.r_[np.full(6, 1.0), np.full(4, 2.0)], 14)
    factors = np.array([1, 1, 1, 1, 1, 3, 2, 2, 2, 2]) * FACTOR_ONE
    out = reweighted_units(units, factors, [0, 6, 10])
    assert out[:6].sum() == units[:6].sum() and out[6:].sum() == units[6:].sum()
    assert out.sum() == 14 * UNIT
    # within the first group sample 5 gets 3 parts of 8
    assert abs(out[5] - units[:6].sum() * 3 / 8) <= 1 and abs(out[0] - units[:6].sum() / 8) <= 1
    assert np.array_equal(out[6:], units[6:]) or np.abs(out[6:] - units[6:]).max() <= 1
    with pytest.raises(ValueError, match="factor"):
        reweighted_units(units, np.zeros(10, np.int64), [0, 10])


def test_a_segmented_stream_changes_its_draws_from_the_segment_start_only():
    base = expected_draws_to_units(np.ones(10), 10)
    order = SegmentedOrder(base, 10, seed=3)
    plain = WeightedOrder(base, 10, seed=3)
    before = order.samples(np.arange(0, 25))
    assert np.array_equal(before, plain.samples(np.arange(0, 25)))
    only_seven = np.zeros(10, np.int64)
    only_seven[7] = 10 * UNIT
    order.add(25, only_seven)
    assert np.array_equal(order.samples(np.arange(20, 25)), plain.samples(np.arange(20, 25)))
    assert set(order.samples(np.arange(25, 60)).tolist()) == {7}
    order.add(40, base)  # a segment back to the natural weights: positions from 40 on draw all samples again
    assert set(order.samples(np.arange(40, 80)).tolist()) == set(range(10))
    order.known_until = 80
    with pytest.raises(RuntimeError, match="past 80"):
        order.samples([79, 80])


def test_a_segment_added_before_a_later_one_replaces_it():
    base = expected_draws_to_units(np.ones(4), 4)
    order = SegmentedOrder(base, 4)
    order.add(50, base)
    order.add(30, base)
    assert [s for s, _ in order.segments] == [0, 30]


def test_the_loader_lag_covers_what_the_loader_reads_ahead():
    assert loader_lag(0, 0, 1) == 2  # in-process: the next batch only
    assert loader_lag(4, 0, 1) == 10  # 2 batches per worker
    assert loader_lag(0, 3, 2) == 5
    assert loader_lag(2, 0, 8) == 2


class FakeAccelerator:
    num_processes, device = 1, torch.device("cpu")


def balancer_for(table, fraction=0.25, every=2):
    base = expected_draws_to_units(np.ones(len(table)), len(table))
    return OnlineBalancer(OnlineBalance(table, max_factor=8.0), base, np.array([0, len(table)]), len(table), 0,
                          every=every, fraction=fraction, lag=2, patch_size=2, num_train_timesteps=1000)


def noised_batch(rows, gen):
    return SimpleNamespace(noisy=torch.randn(rows, 4, 8, 8, generator=gen), target=torch.randn(rows, 4, 8, 8, generator=gen),
                           timesteps=torch.randint(0, 1000, (rows,), generator=gen))


def test_the_plain_loss_scores_a_fraction_of_the_rows_with_one_unconditional_pass(table):
    balancer, gen = balancer_for(table, fraction=0.25), torch.Generator().manual_seed(0)
    calls = []

    def predict(noisy, timesteps, embeds, mask):
        calls.append((noisy.shape[0], torch.is_grad_enabled(), embeds.sum().item()))
        return torch.zeros_like(noisy)

    null = (torch.zeros(8, 3, 5), torch.ones(8, 3))
    balancer.observe(list(range(8)), {}, predict, noised_batch(8, gen), null)
    assert calls == [(2, False, 0.0)]  # ceil(0.25 * 8) rows, no gradient, the null caption
    assert balancer.balance.window["bin_rows"].sum() == 0  # still on the device: no host sync per step
    balancer.flush()
    assert balancer.balance.window["bin_rows"].sum() == 2
    # the IMBA loss's own distances: every row, no extra pass; the NaN rows (dropped captions) left out
    per_token = torch.ones(8, 16)
    per_token[3] = float("nan")
    balancer.observe(list(range(8)), {"distance_per_token": per_token}, predict, noised_batch(8, gen), null)
    balancer.flush()
    assert len(calls) == 1 and balancer.balance.window["bin_rows"].sum() == 2 + 7


def test_the_balancer_decides_the_stream_ahead_and_resumes_it_from_its_state(table):
    gen = torch.Generator().manual_seed(1)
    rows = 16
    null = (torch.zeros(rows, 3, 5), torch.ones(rows, 3))

    def predict(noisy, timesteps, embeds, mask):
        return torch.zeros_like(noisy)

    def run(balancer, steps, rng):
        for step in steps:
            idx = np.r_[rng.integers(0, 5, rows // 2), rng.integers(5, 95, rows // 2)]
            noised = noised_batch(rows, gen)
            noised.target[torch.from_numpy(idx < 5)] *= 3  # rare samples far from the unconditional prediction
            balancer.observe(idx.tolist(), {}, predict, noised, null)
            balancer.step_end(step, FakeAccelerator())

    a = balancer_for(table, fraction=1.0)
    a.begin(0, 0, rows)
    assert a.order.known_until == rows * (2 + 2)  # up to the first refresh + lag
    run(a, range(1, 21), np.random.default_rng(0))
    assert a.order.known_until == rows * (20 + 2 + 2)
    assert a.balance.weights[0] > FACTOR_ONE  # the rare group's multiplier moved
    assert [s for s, _ in a.segments] == [rows * 20, rows * 22]  # the one in force at step 20 and the one ahead
    b = balancer_for(table, fraction=1.0)
    b.load_state_dict(a.state_dict())
    b.begin(20, 20 * rows, rows)
    positions = np.arange(20 * rows, 22 * rows)
    assert np.array_equal(a.order.samples(positions), b.order.samples(positions))
    assert not np.array_equal(a.order.samples(positions), balancer_for(table).order.samples(positions))
