"""The weighted stream (data.weighted): exact per-epoch draws, the target distribution, one global order for any
process count, and exact continuation from a sample count."""

import numpy as np
import pytest

from data.weighted import UNIT, StreamBatchSampler, WeightedBucketSampler, WeightedOrder, expected_draws_to_units


def order_for(expected, samples_per_epoch, seed=0):
    return WeightedOrder(expected_draws_to_units(expected, samples_per_epoch), samples_per_epoch, seed=seed)


def test_units_sum_exactly_and_follow_the_expected_draws():
    expected = np.array([0.0, 0.3, 1.0, 2.5, 7.2])
    units = expected_draws_to_units(expected, 11)
    assert units.dtype == np.int64 and units.sum() == 11 * UNIT
    assert units[0] == 0  # a weight of 0 is never drawn
    assert np.abs(units / UNIT - expected).max() <= 1 / UNIT  # 11 = the expected sum: no rescaling
    # rescaled to another epoch size, the proportions stay
    assert np.allclose(expected_draws_to_units(expected, 22) / UNIT, 2 * expected, atol=1 / UNIT)
    for bad in ([], [-1.0, 2.0], [0.0, 0.0], [np.nan, 1.0]):
        with pytest.raises(ValueError):
            expected_draws_to_units(bad, 5)


def test_each_epoch_draws_every_sample_the_floor_or_ceiling_of_its_expected_draws():
    rng = np.random.default_rng(0)
    expected = rng.pareto(1.2, 300) + 0.05  # long-tailed: from < 0.1 to dozens of draws
    order = order_for(expected, 600)
    e = order.expected_draws()
    for epoch in range(5):
        counts = order.epoch_counts(epoch)
        assert counts.sum() == 600
        assert np.all((counts == np.floor(e)) | (counts == np.ceil(e)))
        # the epoch's positions visit exactly those draws
        drawn = order.samples(np.arange(epoch * 600, (epoch + 1) * 600))
        assert np.array_equal(np.bincount(drawn, minlength=300), counts)


def test_draws_average_the_target_within_the_bound_of_the_epoch_count():
    """Per epoch a sample of expected draws e is drawn ceil(e) times with probability frac(e): over K epochs its
    mean draws lie within a few standard deviations sqrt(f(1 - f) / K) of e."""
    expected = np.linspace(0.05, 3.0, 40)
    order = order_for(expected, int(round(expected.sum())))
    e = order.expected_draws()
    epochs = 400
    mean = sum(order.epoch_counts(k) for k in range(epochs)) / epochs
    frac = e - np.floor(e)
    bound = 5 * np.sqrt(frac * (1 - frac) / epochs) + 2 / UNIT
    assert np.all(np.abs(mean - e) <= bound), np.max(np.abs(mean - e) / bound)


def test_which_samples_round_up_is_chosen_afresh_every_epoch():
    """40 samples of expected draws 0.5 in epochs of 20: each epoch draws 20 of them once, those at every other place
    of π_e's order (which ones: u_e). π_e reorders the samples every epoch, so which 20 is a fresh choice each epoch,
    and two given samples are drawn together in a share (20 / 40) * (19 / 39) of the epochs. Were the order kept and
    only u_e changed, each pair would be drawn together in about half the epochs (same parity) or never."""
    order = order_for(np.full(40, 0.5), 20, seed=5)
    epochs = 300
    drawn = np.stack([order.epoch_counts(k) for k in range(epochs)]).astype(float)  # (epochs, 40) of 0 or 1
    assert np.all(drawn.sum(axis=1) == 20)
    together = drawn.T @ drawn / epochs
    pairs = together[~np.eye(40, dtype=bool)]
    p = 20 / 40 * 19 / 39
    # a binomial share over 300 epochs: 5 standard deviations (0.12) for each of the 780 pairs, while a kept order is
    # off by 0.24 or more on every pair
    assert np.abs(pairs - p).max() <= 5 * np.sqrt(p * (1 - p) / epochs)


def test_the_stream_is_a_pure_function_of_seed_and_position():
    expected = np.arange(1, 51, dtype=float)
    a, b = order_for(expected, 500, seed=3), order_for(expected, 500, seed=3)
    positions = np.array([0, 499, 500, 1234, 7])
    assert np.array_equal(a.samples(positions), b.samples(positions))
    assert not np.array_equal(a.samples(np.arange(500)), order_for(expected, 500, seed=4).samples(np.arange(500)))
    # two epochs differ in order, not only in which samples round up
    assert not np.array_equal(a.samples(np.arange(500)), a.samples(np.arange(500, 1000)))


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_together_draw_the_single_process_stream(world):
    order = order_for(np.linspace(0.2, 4.0, 37), 61)  # an epoch that no batch size divides
    batch = 4
    single = StreamBatchSampler(order, world * batch)
    ranks = [StreamBatchSampler(order, batch, rank=r, world_size=world) for r in range(world)]
    for t in range(40):  # across several epochs
        assert sum((s.batch_indices(t) for s in ranks), []) == single.batch_indices(t)


@pytest.mark.parametrize("saved,now", [(2, 1), (1, 2), (2, 2), (2, 3)])
def test_a_resumed_stream_continues_after_the_samples_consumed_on_any_process_count(saved, now):
    order = order_for(np.linspace(0.2, 4.0, 37), 61)
    batch, steps = 2, 5
    uninterrupted = order.samples(np.arange(0, 400)).tolist()
    done = steps * saved * batch  # `steps` optimizer steps of `saved` processes
    resumed = [StreamBatchSampler(order, batch, rank=r, world_size=now, samples_done=done) for r in range(now)]
    got = []
    for t in range(20):
        for sampler in resumed:
            got += sampler.batch_indices(t)
    assert got == uninterrupted[done:done + len(got)]
    assert next(iter(resumed[0])) == resumed[0].batch_indices(0)


def test_bad_orders_and_samplers_are_refused():
    units = expected_draws_to_units([1.0, 1.0], 2)
    with pytest.raises(ValueError, match="sum to samples_per_epoch"):
        WeightedOrder(units, 3)
    with pytest.raises(ValueError):
        WeightedOrder(-units, 2)
    order = WeightedOrder(units, 2)
    with pytest.raises(ValueError, match="outside world_size"):
        StreamBatchSampler(order, 1, rank=2, world_size=2)
    with pytest.raises(ValueError):
        StreamBatchSampler(order, 0)


def bucket_sampler(world=1, rank=0, done=0, batch=3, seed=0):
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 3, 90)  # three buckets of about 30 samples
    units = expected_draws_to_units(rng.pareto(1.5, 90) + 0.1, 120)
    return WeightedBucketSampler(units, 120, ids, [(8, 32), (16, 16), (32, 8)], batch, seed=seed, rank=rank,
                                 world_size=world, samples_done=done), ids, units


def test_weighted_buckets_draw_each_buckets_share_in_single_bucket_batches():
    sampler, ids, units = bucket_sampler()
    share = np.bincount(ids, weights=units, minlength=3) / units.sum() * 120
    assert np.all(np.abs(sampler.draws_per_bucket - share) < 1) and sampler.draws_per_bucket.sum() == 120
    per_epoch = sampler.total_batches
    assert per_epoch == sum(d // 3 for d in sampler.draws_per_bucket)
    seen = np.zeros(90)
    for t in range(per_epoch * 50):
        batch = sampler.batch_indices(t)
        assert len(batch) == 3 and len(set(ids[batch])) == 1  # one bucket
        assert batch.size == [(8, 32), (16, 16), (32, 8)][ids[batch[0]]]
        np.add.at(seen, batch, 1)
    # within a bucket, the draws follow the units (the remainder of each bucket's epoch is dropped)
    for b in range(3):
        members = ids == b
        draws = sampler.draws_per_bucket[b]
        e = units[members] / units[members].sum() * draws  # expected draws in the bucket's own order
        kept = (draws - draws % 3) / draws  # the share of the bucket's epoch that full batches keep
        expected = 50 * e * kept
        # Per epoch a sample is drawn c = floor or ceil of e times (variance f(1 - f), f = frac(e)); the epoch's
        # last draws % 3 positions are dropped, and the positions are a permutation of the draw slots, so the draws
        # of c it loses are hypergeometric: variance <= E[c] * r * draws / (draws - 1), r = 1 - kept. The epochs
        # are drawn independently: 5 standard deviations of the sum over 50 epochs (a bound on each of 90 samples).
        f = e - np.floor(e)
        var = f * (1 - f) + e * (1 - kept) * draws / (draws - 1)
        assert np.all(np.abs(seen[members] - expected) <= 5 * np.sqrt(50 * var) + 1e-3)


@pytest.mark.parametrize("saved,now", [(1, 2), (2, 1), (2, 3)])
def test_weighted_buckets_are_one_global_stream_on_any_process_count(saved, now):
    single, _, _ = bucket_sampler()
    stream = [single.batch_indices(g) for g in range(60)]
    done = 4 * saved * 3  # 4 steps of `saved` processes
    ranks = [bucket_sampler(world=now, rank=r, done=done)[0] for r in range(now)]
    got = [ranks[r].batch_indices(t) for t in range(10) for r in range(now)]
    assert got == stream[4 * saved:4 * saved + 10 * now]
    with pytest.raises(ValueError, match="multiple of the batch size"):
        bucket_sampler(done=4)


def test_the_units_the_floors_leave_over_go_to_the_largest_remainders_then_the_lower_index():
    # 1 draw over 2 : 1.5 = 599186.29 and 449389.71 units: the one unit left over goes to the second, whose
    # remainder is the larger, not to the larger share
    assert list(expected_draws_to_units([2.0, 1.5], 1)) == [599186, 449390]
    # three equal remainders (1/3 each) and one unit left over: the lowest index
    assert list(expected_draws_to_units([1.0, 1.0, 1.0], 1)) == [349526, 349525, 349525]
