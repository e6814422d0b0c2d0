"""Online balancing (data.balance=imba): the weight rule of data/online_balance.py against its statement, exact sums
over ranks, the segmented stream of data/weighted.py, and the training-loop balancer of imba/training/balancing.py."""

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from data.balance import build_concept_table
from data.concepts import default_extractor
from data.online_balance import FACTOR_ONE, PRIOR_ROWS, OnlineBalance
from data.weighted import UNIT, SegmentedOrder, WeightedOrder, expected_draws_to_units, reweighted_units
from imba.training.balancing import OnlineBalancer, loader_lag

RARE = "a red cross and a blue ring"
HEAD = "a blue square and a red ring"


@pytest.fixture(scope="module")
def table():
    # samples 0-4 rare, 5-94 head, 95-99 without a caption
    return build_concept_table([RARE] * 5 + [HEAD] * 90 + [""] * 5, default_extractor())


def weight(balance, entry):
    return int(balance.weights[balance.table.entries.index(entry)])


def feed(balance, rng, rare_distance=2.0, head_distance=1.0, batches=20, scale=1.0):
    """Rows drawn uniformly from the 95 captioned samples; rows of rare samples at `rare_distance`."""
    for _ in range(batches):
        idx = rng.integers(0, 95, 16)
        level = rng.random(16)
        d = scale * (1 + level) * np.where(idx < 5, rare_distance, head_distance)
        balance.observe(idx, d, level)


def test_rare_entries_predicted_worse_gain_weight_each_refresh_up_to_the_cap(table):
    balance, rng = OnlineBalance(table, max_factor=4.0), np.random.default_rng(0)
    feed(balance, rng)
    balance.refresh()  # the first window only gives the level means
    assert (balance.weights == FACTOR_ONE).all()
    history = []
    for _ in range(12):
        feed(balance, rng)
        balance.refresh()
        history.append(weight(balance, "red:cross"))
    assert all(b >= a for a, b in zip(history, history[1:])) and history[0] > FACTOR_ONE
    assert history[-1] == 4 * FACTOR_ONE  # capped at max_factor
    for entry in ("cross", "cross + ring"):  # every entry of the rare caption
        assert weight(balance, entry) == 4 * FACTOR_ONE
    for entry in ("square", "blue:square", "ring + square"):  # entries of head captions only
        assert weight(balance, entry) == FACTOR_ONE
    factors = balance.sample_factors()
    assert (factors[:5] == 4 * FACTOR_ONE).all()
    # head samples share "red" and "ring" with the rare caption: those came out below average, not boosted
    assert (factors[5:95] == FACTOR_ONE).all() and (factors[95:] == FACTOR_ONE).all()


@pytest.mark.parametrize("rate", [0.5, 1.0])
def test_a_weight_moves_by_its_shrunk_score_to_the_power_rate(table, rate):
    balance = OnlineBalance(table, max_factor=16.0, bins=1, rate=rate)
    balance.observe(np.arange(10), np.ones(10), np.zeros(10))
    balance.refresh()  # level mean 1
    balance.observe([0, 5, 6, 7], [3.0, 1.0, 1.0, 1.0], np.zeros(4))
    balance.refresh()
    # running (halved first window has no entry rows): rows n = 3, 1, 1, 1 -> n̄ = 1.5; "cross": one row at 3
    mean = 1.5
    score = (3 + PRIOR_ROWS * mean) / ((1 + PRIOR_ROWS) * mean)
    assert weight(balance, "cross") == round(FACTOR_ONE * score ** rate)
    assert balance.scores()[table.entries.index("cross")] == pytest.approx(score)


@pytest.mark.parametrize("settings", [dict(max_factor=0.5), dict(rate=0.0), dict(rate=float("nan")), dict(bins=0)])
def test_settings_out_of_range_are_refused(table, settings):
    with pytest.raises(ValueError, match="must be"):
        OnlineBalance(table, **settings)
    OnlineBalance(table, max_factor=1.0, bins=1, rate=1e-9)  # the bounds: 1 = natural, one bin


def test_each_row_lands_in_the_bin_of_its_noise_level(table):
    balance = OnlineBalance(table, bins=4)
    balance.observe([0, 1, 2, 3, 4, 5], [1.0] * 6, [0.0, 0.24, 0.25, 0.6, 0.99, 1.0])  # 1.0: the last bin
    assert balance.window["bin_rows"].tolist() == [2, 1, 1, 2]


def test_a_boosted_entry_gives_its_draws_back_once_its_distance_falls_but_never_below_natural(table):
    balance, rng = OnlineBalance(table, max_factor=8.0), np.random.default_rng(1)
    for _ in range(6):
        feed(balance, rng)
        balance.refresh()
    peak = weight(balance, "red:cross")
    assert peak > 2 * FACTOR_ONE
    trace = []
    for _ in range(10):
        feed(balance, rng, rare_distance=0.5)
        balance.refresh()
        trace.append(weight(balance, "red:cross"))
    # the first refresh still averages the old windows in (each window weighs as much as all before it)
    assert trace[2] < peak and trace[-1] == FACTOR_ONE and min(trace) == FACTOR_ONE
    assert all(b <= a for a, b in zip(trace[1:], trace[2:]))


def test_a_loss_falling_for_every_sample_does_not_hide_the_rare_ones(table):
    # the level means come from earlier, higher-loss windows: every row's n is below 1, the rare rows still 2x
    balance, rng = OnlineBalance(table), np.random.default_rng(2)
    for k in range(5):
        feed(balance, rng, scale=0.5 ** k)
        balance.refresh()
    assert weight(balance, "red:cross") > FACTOR_ONE
    assert weight(balance, "blue:square") == FACTOR_ONE


def test_entries_never_scored_keep_the_natural_weight(table):
    balance, rng = OnlineBalance(table), np.random.default_rng(3)
    for _ in range(4):  # only head samples are scored
        idx = rng.integers(5, 95, 16)
        balance.observe(idx, rng.random(16) + 0.5, rng.random(16))
        balance.refresh()
    for entry in ("red:cross", "cross", "cross + ring", "blue:ring"):
        assert weight(balance, entry) == FACTOR_ONE
        assert balance.scores()[table.entries.index(entry)] == 1.0


def test_non_finite_distances_are_left_out(table):
    balance = OnlineBalance(table)
    balance.observe([0, 1, 2], [np.nan, 1.0, np.inf], [0.5, 0.5, 0.5])
    assert balance.window["bin_rows"].sum() == 1
    with pytest.raises(ValueError, match="one each per row"):
        balance.observe([0, 1], [1.0], [0.5])
    with pytest.raises(IndexError):
        balance.observe([100], [1.0], [0.5])


# The rule clause by clause, on hand-computed cases. Entries of RARE only: cross, red:cross, blue:ring, cross + ring;
# of HEAD only: square, blue:square, red:ring, ring + square; of both: red, blue, ring. Samples 95-99 have none.
RARE_ONLY, HEAD_ONLY, SHARED = ("cross", "red:cross", "blue:ring", "cross + ring"), \
    ("square", "blue:square", "red:ring", "ring + square"), ("red", "blue", "ring")


def primed(table, **settings):
    """One level bin whose mean is 1: ten rows of caption-less samples at distance 1, then the first refresh (which
    credits no entry: before it rows only feed the level means)."""
    balance = OnlineBalance(table, bins=1, **settings)
    balance.observe(np.r_[95:100, 95:100], np.ones(10), np.zeros(10))
    balance.refresh()
    return balance


def score(balance, entry):
    return balance.scores()[balance.table.entries.index(entry)]


def test_a_score_is_the_entrys_mean_n_relative_to_the_average_rows(table):
    balance = primed(table)
    balance.observe([0, 95], [3.0, 1.0], [0.0, 0.0])  # n = 3 (the rare sample), 1 (a caption-less one)
    balance.refresh()
    # n̄ over all rows, caption-less ones too: (3 + 1) / 2 = 2; a rare entry: one row at 3 -> (3 + 8·2) / ((1 + 8)·2)
    for entry in RARE_ONLY + SHARED:
        assert score(balance, entry) == pytest.approx(19 / 18)
        assert weight(balance, entry) == round(FACTOR_ONE * math.sqrt(19 / 18))
    for entry in HEAD_ONLY:  # no row of theirs: never scored
        assert score(balance, entry) == 1.0 and weight(balance, entry) == FACTOR_ONE


def test_a_row_credits_every_entry_of_its_sample_and_no_other(table):
    balance = primed(table)
    balance.observe([0, 5], [3.0, 1.0], [0.0, 0.0])  # n = 3 (rare), 1 (head); n̄ = 2
    balance.refresh()
    for entry in RARE_ONLY:  # one row at 3: (3 + 16) / (9·2)
        assert weight(balance, entry) == round(FACTOR_ONE * math.sqrt(19 / 18))
    for entry in SHARED:  # both rows: (3 + 1 + 16) / ((2 + 8)·2) = 1
        assert score(balance, entry) == pytest.approx(1.0) and weight(balance, entry) == FACTOR_ONE
    for entry in HEAD_ONLY:  # one row at 1: (1 + 16) / 18 below 1, and a weight is never below natural
        assert score(balance, entry) == pytest.approx(17 / 18) and weight(balance, entry) == FACTOR_ONE


def test_a_weight_moves_from_where_it_is_and_is_clipped_at_natural_only_entries_of_the_window_move(table):
    balance = primed(table)
    at = {e: table.entries.index(e) for e in ("cross", "red:cross", "square")}
    balance.weights[at["cross"]] = 2 * FACTOR_ONE
    balance.weights[at["red:cross"]] = round(1.02 * FACTOR_ONE)
    balance.weights[at["square"]] = 3 * FACTOR_ONE
    balance.observe([0, 95], [1.0, 3.0], [0.0, 0.0])  # n̄ = 2; a rare entry: (1 + 16) / 18 = 17/18
    balance.refresh()
    assert weight(balance, "cross") == round(2 * FACTOR_ONE * math.sqrt(17 / 18))  # 2 · 0.972: gives draws back
    assert weight(balance, "red:cross") == FACTOR_ONE  # 1.02 · 0.972 < 1: clipped at natural
    assert weight(balance, "square") == 3 * FACTOR_ONE  # no row in the window: kept, whatever its score


def test_a_weight_is_clipped_at_max_factor(table):
    balance = primed(table, max_factor=1.05, rate=1.0)
    balance.observe([0, 5], [3.0, 1.0], [0.0, 0.0])  # as above: rare entries 19/18 = 1.0556, shared ones 1
    balance.refresh()
    for entry in RARE_ONLY:
        assert weight(balance, entry) == round(1.05 * FACTOR_ONE)
    for entry in SHARED:
        assert weight(balance, entry) == FACTOR_ONE


@pytest.mark.parametrize("rate", [0.25, 2.0])
def test_the_rate_is_the_power_of_the_score(table, rate):
    balance = primed(table, rate=rate)
    balance.observe([0, 95], [3.0, 1.0], [0.0, 0.0])  # a rare entry's score 19/18, as above
    balance.refresh()
    assert weight(balance, "cross") == round(FACTOR_ONE * (19 / 18) ** rate)


def test_a_row_is_read_against_the_mean_of_its_level_bin(table):
    balance = OnlineBalance(table, bins=4)  # bins [0, .25), [.25, .5), [.5, .75), [.75, 1)
    balance.observe([95, 96, 97, 98], [1.0, 2.0, 4.0, 8.0], [0.1, 0.3, 0.6, 0.9])  # bin means 1, 2, 4, 8
    balance.refresh()
    balance.observe([0, 5], [2.0, 2.0], [0.49, 0.5])  # the same distance: n = 2/2 = 1 (rare), 2/4 = 0.5 (head)
    balance.refresh()
    # n̄ = 0.75; rare: (1 + 8·0.75) / (9·0.75) = 28/27; head: (0.5 + 6) / 6.75 = 26/27; shared: (1.5 + 6) / 7.5 = 1
    assert weight(balance, "cross") == round(FACTOR_ONE * math.sqrt(28 / 27))
    assert score(balance, "square") == pytest.approx(26 / 27) and score(balance, "red") == pytest.approx(1.0)


def test_training_reads_the_noise_level_in_tenths(table):
    balance = OnlineBalance(table)  # as the trainer makes it: max_factor and rate given, the bins left to the default
    balance.observe([95, 96, 97], [1.0, 2.0, 4.0], [0.05, 0.15, 0.95])
    assert balance.bins == 10 and np.flatnonzero(balance.window["bin_rows"]).tolist() == [0, 1, 9]


def test_a_row_at_a_level_without_a_mean_is_read_against_the_mean_over_all_levels(table):
    balance = OnlineBalance(table, bins=2)
    balance.observe([95, 96], [2.0, 4.0], [0.1, 0.2])  # only the lower bin has rows: mean 3, over all levels 3
    balance.refresh()
    balance.observe([0, 5], [6.0, 3.0], [0.75, 0.25])  # n = 6/3 = 2 (upper bin, no mean), 3/3 = 1
    balance.refresh()
    # n̄ = 1.5; rare: (2 + 12) / (9·1.5) = 28/27; head: (1 + 12) / 13.5 = 26/27
    assert weight(balance, "cross") == round(FACTOR_ONE * math.sqrt(28 / 27))
    assert score(balance, "square") == pytest.approx(26 / 27)


def test_before_the_first_refresh_rows_only_feed_the_level_means(table):
    balance = OnlineBalance(table, bins=1)
    balance.observe([0, 5, 95], [3.0, 1.0, 1.0], [0.0, 0.0, 0.0])
    balance.refresh()
    assert (balance.weights == FACTOR_ONE).all() and (balance.scores() == 1.0).all()
    balance.observe([0, 95], [5.0, 5 / 3], [0.0, 0.0])  # level mean (3 + 1 + 1) / 3 = 5/3: n = 3, 1; n̄ = 2
    balance.refresh()
    # had the first rows been scored (against any mean), "cross" would hold two rows here, not one
    assert weight(balance, "cross") == round(FACTOR_ONE * math.sqrt(19 / 18))


def test_each_refresh_halves_the_running_statistics_before_adding_its_window(table):
    balance = primed(table)  # level bin: 10 rows summing to 10
    balance.observe([0, 95], [3.0, 1.0], [0.0, 0.0])  # n = 3, 1
    balance.refresh()
    shared = round(FACTOR_ONE * math.sqrt(19 / 18))  # n̄ = 2, a rare or shared entry: (3 + 16) / 18
    assert weight(balance, "red") == shared
    # level bin now: 10/2 + 4 = 9 over 10/2 + 2 = 7 rows, mean 9/7; a head row at d = 18/7 has n = 2
    balance.observe([5], [18 / 7], [0.0])
    balance.refresh()
    # rows: (3 + 1)/2 + 2 = 4 over 2/2 + 1 = 2, n̄ = 2
    # shared: S = 3/2 + 2 = 3.5 over C = 1/2 + 1 = 1.5 rows: (3.5 + 16) / (9.5·2) = 39/38
    assert weight(balance, "red") == round(shared * math.sqrt(39 / 38))
    # head only: (2 + 16) / (9·2) = 1
    assert weight(balance, "square") == FACTOR_ONE
    # rare only: S = 1.5 over C = 0.5, score (1.5 + 16) / (8.5·2) = 35/34, yet no row in this window: not moved
    assert score(balance, "cross") == pytest.approx(35 / 34) and weight(balance, "cross") == shared


def test_observations_are_fixed_point_integers_and_their_sums_do_not_depend_on_how_rows_are_split(table):
    balance = primed(table)
    balance.observe([0], [2 / 3], [0.0])  # n = 2/3 at level mean 1
    # fixed point, FACTOR_ONE = 1.0: a row counts FACTOR_ONE, its n round(2/3 · FACTOR_ONE) to each of its entries
    for entry in RARE_ONLY + SHARED:
        assert balance.window["entry_sum"][table.entries.index(entry)] == round(2 / 3 * FACTOR_ONE)
        assert balance.window["entry_rows"][table.entries.index(entry)] == FACTOR_ONE
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
    assert np.array_equal(one.weights, parts[0].weights) and (one.weights > FACTOR_ONE).any()


def test_a_samples_factor_is_the_largest_weight_among_its_entries(table):
    balance = OnlineBalance(table)
    weights = np.full(len(table.entries), FACTOR_ONE, np.int64)
    weights[table.entries.index("cross")] = 3 * FACTOR_ONE  # rare caption only
    weights[table.entries.index("red")] = 2 * FACTOR_ONE  # both captions
    weights[table.entries.index("square")] = 3 * FACTOR_ONE // 2  # head caption only
    factors = balance.sample_factors(weights)
    assert (factors[:5] == 3 * FACTOR_ONE).all()  # max(3, 2, 1, ...)
    assert (factors[5:95] == 2 * FACTOR_ONE).all()  # max(2, 1.5, 1, ...)
    assert (factors[95:] == FACTOR_ONE).all()  # no entries: natural
    balance.weights = weights
    assert np.array_equal(balance.sample_factors(), factors)  # by default the current weights


def test_a_lowered_max_factor_holds_for_a_loaded_state(table):
    high = primed(table, max_factor=4.0)
    high.weights[table.entries.index("cross")] = 3 * FACTOR_ONE
    low = OnlineBalance(table, max_factor=2.0, bins=1)
    low.load_state_dict(high.state_dict())
    assert weight(low, "cross") == 2 * FACTOR_ONE and weight(low, "red") == FACTOR_ONE


def test_windows_summed_over_ranks_give_exactly_the_single_process_weights(table):
    rng = np.random.default_rng(4)
    rows = [(rng.integers(0, 95, 16), None, rng.random(16)) for _ in range(60)]
    rows = [(i, (1 + t) * np.where(i < 5, 2.0, 1.0) * rng.uniform(0.7, 1.3, 16), t) for i, _, t in rows]
    single, ranks = OnlineBalance(table), [OnlineBalance(table), OnlineBalance(table)]
    for window in range(6):
        batch = rows[10 * window:10 * window + 10]
        for k, (i, d, t) in enumerate(batch):
            single.observe(i, d, t)
            ranks[k % 2].observe(i, d, t)  # each rank sees its half, in its own order

        def reduce(_, ranks=ranks):
            return [a + b for a, b in zip(ranks[0].window_arrays(), ranks[1].window_arrays())]

        single.refresh()
        totals = reduce(None)
        for r in ranks:
            r.refresh(lambda _: totals)
        assert np.array_equal(single.weights, ranks[0].weights) and np.array_equal(single.weights, ranks[1].weights)
    assert (single.weights > FACTOR_ONE).any()


def test_the_state_round_trips_and_continues_identically(table):
    rng = np.random.default_rng(5)
    a = OnlineBalance(table)
    for _ in range(3):
        feed(a, rng)
        a.refresh()
    feed(a, rng, batches=5)  # a window in progress: it must travel with the state
    b = OnlineBalance(table)
    b.load_state_dict(a.state_dict())
    for k in range(4):  # the same further rows into both, and a refresh after each window
        feed(a, np.random.default_rng(10 + k), rare_distance=0.5 if k >= 2 else 2.0)
        feed(b, np.random.default_rng(10 + k), rare_distance=0.5 if k >= 2 else 2.0)
        a.refresh()
        b.refresh()
        assert np.array_equal(a.weights, b.weights) and np.array_equal(a.scores(), b.scores())
        assert a.refreshes == b.refreshes == 4 + k
    assert weight(a, "red:cross") > FACTOR_ONE  # the comparison ran on moved weights, not on the initial ones


def test_a_state_is_refused_by_a_table_of_other_entries(table):
    balance = OnlineBalance(table)
    balance.observe(np.arange(10), np.ones(10), np.zeros(10))
    balance.refresh()
    state = balance.state_dict()
    small = OnlineBalance(build_concept_table(["a green star"], default_extractor()))
    with pytest.raises(ValueError, match="entries"):
        small.load_state_dict(state)
    # the same 11 entries, numbered in another order (head caption first): every weight would land on another entry
    reordered = build_concept_table([HEAD, RARE], default_extractor())
    assert sorted(reordered.entries) == sorted(table.entries) and reordered.entries != table.entries
    with pytest.raises(ValueError, match="entries"):
        OnlineBalance(reordered).load_state_dict(state)
    with pytest.raises(ValueError, match="level bins"):
        OnlineBalance(table, bins=4).load_state_dict(state)


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
    null = (torch.zeros(4, 3, 5), torch.ones(4, 3))

    def predict(noisy, timesteps, embeds, mask):
        return torch.zeros_like(noisy)

    def run(balancer, steps, rng):
        for step in steps:
            idx = rng.integers(0, 95, 4)
            noised = noised_batch(4, gen)
            noised.target[torch.from_numpy(idx < 5)] *= 3  # rare samples far from the unconditional prediction
            balancer.observe(idx.tolist(), {}, predict, noised, null)
            balancer.step_done(step, FakeAccelerator())

    a = balancer_for(table, fraction=1.0)
    a.begin(0, 0, 4)
    assert a.order.known_until == 4 * (2 + 2)  # up to the first refresh + lag
    run(a, range(1, 21), np.random.default_rng(0))
    assert a.order.known_until == 4 * (20 + 2 + 2)
    assert (a.balance.weights > FACTOR_ONE).any()
    assert [s for s, _ in a.segments] == [4 * 20, 4 * 22]  # the one in force at step 20 and the one ahead
    b = balancer_for(table, fraction=1.0)
    b.load_state_dict(a.state_dict())
    b.begin(20, 80, 4)
    positions = np.arange(80, 88)
    assert np.array_equal(a.order.samples(positions), b.order.samples(positions))
    assert not np.array_equal(a.order.samples(positions), balancer_for(table).order.samples(positions))


def test_a_level_bin_of_one_row_has_that_rows_distance_as_its_mean(table):
    balance = OnlineBalance(table, bins=2)
    balance.observe([95, 96, 97], [2.0, 4.0, 4.0], [0.1, 0.6, 0.7])  # lower bin: one row, mean 2; upper: mean 4
    balance.refresh()
    balance.observe([0, 5], [2.0, 4.0], [0.2, 0.8])  # each at its bin's mean: n = 1 and 1
    balance.refresh()
    assert score(balance, "cross") == pytest.approx(1.0) and score(balance, "square") == pytest.approx(1.0)


def test_a_row_whose_sample_has_a_single_entry_credits_it():
    dogs = OnlineBalance(build_concept_table(["a dog", ""], default_extractor()), bins=1)
    assert dogs.table.entries == ["dog"]
    dogs.observe([1], [1.0], [0.0])
    dogs.refresh()
    dogs.observe([0, 1], [3.0, 1.0], [0.0, 0.0])  # n = 3 and 1, n̄ = 2: dog (3 + 8·2) / (9·2)
    dogs.refresh()
    assert dogs.running["entry_rows"][0] == FACTOR_ONE and dogs.scores()[0] == pytest.approx(19 / 18)
    factors = dogs.sample_factors()
    assert factors.dtype == np.int64 and list(factors) == [dogs.weights[0], FACTOR_ONE]


def test_a_sample_index_out_of_range_is_refused(table):
    with pytest.raises(IndexError, match="out of range for 100 samples"):
        OnlineBalance(table).observe([100], [1.0], [0.5])


def test_the_log_line_counts_the_boosted_entries_and_names_the_five_most_boosted(table):
    balance = OnlineBalance(table)
    assert balance.describe() == f"online balance: 0 refreshes, 0 of {len(table.entries)} entries boosted"
    boosts = [1.25, 3.0, 1.5, 2.0, 1.75, 1.125]  # of entries 0 to 5
    balance.weights[:6] = [round(b * FACTOR_ONE) for b in boosts]
    balance.refreshes = 2
    e = table.entries
    assert balance.describe() == (f"online balance: 2 refreshes, 6 of {len(e)} entries boosted (most: {e[1]} 3.00x, "
                                  f"{e[3]} 2.00x, {e[4]} 1.75x, {e[2]} 1.50x, {e[0]} 1.25x)")
    # equal boosts are named in the table's order, however many tie (a log line that reorders equal entries from
    # one refresh to the next reads as a change)
    many = OnlineBalance(build_concept_table([f"w{k}" for k in range(40)], lambda caption: [caption]))
    many.weights[:] = np.tile([2, 3], 20) * FACTOR_ONE
    assert many.describe().split("(most: ")[1] == "w1 3.00x, w3 3.00x, w5 3.00x, w7 3.00x, w9 3.00x)"


def test_a_state_saved_without_the_entries_digest_loads(table):
    balance = OnlineBalance(table)
    balance.observe(np.arange(10), np.ones(10), np.zeros(10))
    balance.refresh()
    state = balance.state_dict()
    del state["entries_digest"]  # a state saved before the digest was: its count of entries is checked
    loaded = OnlineBalance(table)
    loaded.load_state_dict(state)
    assert np.array_equal(loaded.weights, balance.weights) and loaded.refreshes == 1
