"""The reader's order pinned to values: the module promises an order identical on every machine and library version
(old runs resume exactly), which a property test alone cannot hold (any round function gives a permutation). Also
the splitmix64 finaliser against a pure-Python one, the shard windows, the bucket sampler's bookkeeping and every
argument check at its bound."""

import pickle

import numpy as np
import pytest

from data.order import (BucketBatch, BucketBatchSampler, IndexedBatchSampler, _mix64, batches_per_epoch,
                        feistel_permute)

M64 = (1 << 64) - 1


def _splitmix64_finaliser(x: int) -> int:
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def test_mix64_is_the_splitmix64_finaliser():
    xs = [0, 1, 2, 12345, 2 ** 32 + 7, 2 ** 63, M64]
    got = _mix64(np.array(xs, dtype=np.uint64)).tolist()
    assert got == [_splitmix64_finaliser(x) for x in xs]


def test_feistel_orders_are_the_recorded_ones():
    # recorded once; a change here changes every run's order and breaks exact resume of existing runs
    assert feistel_permute(np.arange(12), 12, "k", 7).tolist() == [6, 1, 9, 5, 2, 4, 10, 0, 11, 8, 7, 3]
    assert feistel_permute(np.arange(5), 5, "samples", 0, 0).tolist() == [3, 4, 2, 1, 0]
    assert feistel_permute([0, 999, 500], 1000, "samples", 3, 1).tolist() == [647, 484, 814]
    assert feistel_permute([0], 1, "any").tolist() == [0]  # the only position
    assert feistel_permute([], 4, "any").tolist() == []
    assert sorted(feistel_permute(np.arange(2), 2, "x").tolist()) == [0, 1]


@pytest.mark.parametrize("positions,n", [([0, 3], 3), ([-1], 3), ([0], 0)])
def test_positions_outside_the_range_are_refused(positions, n):
    with pytest.raises(ValueError, match="positions must lie in range"):
        feistel_permute(positions, n, "k")


def test_the_epoch_orders_are_the_recorded_ones():
    uniform = IndexedBatchSampler(10, 2, seed=1)
    assert uniform.epoch_order(0).tolist() == [2, 4, 9, 8, 7, 1, 3, 0, 6, 5]
    assert uniform.epoch_order(1).tolist() == [1, 3, 8, 0, 6, 5, 9, 4, 2, 7]
    windowed = IndexedBatchSampler(12, 2, seed=2, shard_sizes=[3, 4, 5], shard_window=2)
    assert windowed.epoch_order(0).tolist() == [6, 2, 5, 0, 3, 1, 4, 9, 10, 8, 11, 7]
    assert windowed.epoch_order(1).tolist() == [0, 2, 10, 8, 11, 9, 1, 7, 6, 5, 3, 4]
    assert windowed.epoch_indices(0, [7, 0]).tolist() == [9, 6]  # any positions, in the order asked


@pytest.mark.parametrize("window", [1, 2, 3, 4])
def test_each_window_visits_exactly_its_shards_samples(window):
    sizes = [3, 1, 4, 2]
    starts = np.concatenate([[0], np.cumsum(sizes)])
    sampler = IndexedBatchSampler(10, 1, seed=4, shard_sizes=sizes, shard_window=window)
    for epoch in range(3):
        order = sampler.epoch_order(epoch).tolist()
        assert sorted(order) == list(range(10))
        shard_of = {i: int(np.searchsorted(starts, i, side="right")) - 1 for i in range(10)}
        at = 0
        seen_shards = []
        while at < 10:  # cut the order into windows: each holds whole shards, window (or fewer, at the end)
            shards = set()
            taken = 0
            while at + taken < 10 and len(shards | {shard_of[order[at + taken]]}) <= window:
                shards.add(shard_of[order[at + taken]])
                taken += 1
            assert taken == sum(sizes[s] for s in shards), (epoch, order)
            seen_shards.append(shards)
            at += taken
        assert all(len(s) == window for s in seen_shards[:-1])


@pytest.mark.parametrize("kwargs,message", [
    (dict(num_samples=4, batch_size=0), "batch_size >= 1"),
    (dict(num_samples=4, batch_size=1, world_size=0), "world_size >= 1"),
    (dict(num_samples=4, batch_size=1, start_batch=-1), "start_batch >= 0"),
    (dict(num_samples=4, batch_size=1, shard_window=-1), "shard_window >= 0"),
    (dict(num_samples=4, batch_size=1, rank=2, world_size=2), "rank 2 is outside world_size 2"),
    (dict(num_samples=4, batch_size=1, rank=-1, world_size=2), "rank -1 is outside"),
    (dict(num_samples=5, batch_size=3, world_size=2), "5 samples are fewer than one global batch"),
    (dict(num_samples=4, batch_size=1, shard_window=1), "shard_window needs shard_sizes"),
    (dict(num_samples=4, batch_size=1, shard_window=1, shard_sizes=[2, 1]), "shard_window needs shard_sizes"),
])
def test_indexed_sampler_refuses_each_bad_argument(kwargs, message):
    kwargs = dict(kwargs)  # the parameter itself is shared by every run of the test
    n = kwargs.pop("num_samples")
    b = kwargs.pop("batch_size")
    with pytest.raises(ValueError, match=message):
        IndexedBatchSampler(n, b, **kwargs)


def test_indexed_sampler_accepts_the_closed_bounds_and_keeps_its_settings():
    sampler = IndexedBatchSampler(6, 3, seed=9, rank=1, world_size=2, start_batch=0, shard_window=0)
    assert (sampler.num_samples, sampler.batch_size, sampler.seed, sampler.rank, sampler.world_size) == (6, 3, 9, 1, 2)
    assert sampler.batches_per_epoch == 1 and sampler.shard_sizes.tolist() == [6]
    assert sampler.shard_starts.tolist() == [0, 6]
    other = IndexedBatchSampler(6, 3, seed=9, rank=0, world_size=2)
    order = IndexedBatchSampler(6, 3, seed=9).epoch_order(0).tolist()
    assert other.batch_indices(0) == order[:3] and sampler.batch_indices(0) == order[3:]
    assert sampler.batch_indices(1) == IndexedBatchSampler(6, 3, seed=9).epoch_order(1).tolist()[3:]
    resumed = iter(IndexedBatchSampler(6, 3, seed=9, rank=1, world_size=2, start_batch=3))
    assert next(resumed) == sampler.batch_indices(3)
    assert batches_per_epoch(7, 2) == 3 and batches_per_epoch(8, 2, 2) == 2 and batches_per_epoch(7, 2, 2) == 1


IDS = [0, 1, 0, 0, 1, 2, 0, 1, 0, 1]  # bucket 0: 5 samples, bucket 1: 4, bucket 2: 1
BUCKETS = [(8, 16), (16, 8), (4, 4)]


def test_bucket_batches_are_the_recorded_ones():
    sampler = BucketBatchSampler(IDS, BUCKETS, 2, seed=5, world_size=2, rank=1)
    got = [(list(b), b.size) for b in (sampler.batch_indices(t) for t in range(4))]
    assert got == [([6, 2], (8, 16)), ([3, 0], (8, 16)), ([6, 8], (8, 16)), ([9, 7], (16, 8))]


def test_bucket_bookkeeping_counts_full_batches_and_drops_the_rest():
    sampler = BucketBatchSampler(IDS, BUCKETS, 2, world_size=2)
    assert sampler.counts.tolist() == [5, 4, 1] and sampler.bucket_batches.tolist() == [2, 2, 0]
    assert sampler.total_batches == 4 and sampler.batches_per_epoch == 2 and sampler.samples_per_epoch == 8
    assert sampler.describe() == "8x16: 5, 16x8: 4, 4x4: 1"
    assert BucketBatchSampler([1, 1], BUCKETS, 2).describe() == "16x8: 2"  # empty buckets are left out
    for epoch in range(3):  # one epoch of both ranks: single-bucket batches, no sample twice
        batches = [BucketBatchSampler(IDS, BUCKETS, 2, world_size=2, rank=r).batch_indices(2 * epoch + k)
                   for k in range(2) for r in range(2)]
        flat = [i for b in batches for i in b]
        assert len(set(flat)) == 8
        for b in batches:
            assert len(b) == 2 and {IDS[i] for i in b} == {BUCKETS.index(b.size)}
    stream = iter(BucketBatchSampler(IDS, BUCKETS, 2, world_size=2, rank=1, start_batch=3))
    assert list(next(stream)) == list(BucketBatchSampler(IDS, BUCKETS, 2, world_size=2, rank=1).batch_indices(3))


@pytest.mark.parametrize("ids,kwargs,message", [
    (IDS, dict(batch_size=0), "batch_size >= 1"),
    (IDS, dict(batch_size=1, world_size=0), "world_size >= 1"),
    (IDS, dict(batch_size=1, start_batch=-1), "start_batch >= 0"),
    (IDS, dict(batch_size=1, rank=1), "rank 1 is outside world_size 1"),
    (IDS, dict(batch_size=1, rank=-1), "rank -1 is outside"),
    ([0, 3], dict(batch_size=1), r"bucket ids must lie in range\(3\)"),
    ([-1, 0], dict(batch_size=1), r"bucket ids must lie in range\(3\)"),
    (IDS, dict(batch_size=3, world_size=3), r"give 2 full batches of 3 from 10 samples \(per bucket: 8x16: 5, "
                                            r"16x8: 4, 4x4: 1\), fewer than one per rank \(world_size 3\)"),
    ([], dict(batch_size=1), r"give 0 full batches of 1 from 0 samples \(per bucket: none\)"),
])
def test_bucket_sampler_refuses_each_bad_argument(ids, kwargs, message):
    with pytest.raises(ValueError, match=message):
        BucketBatchSampler(ids, BUCKETS, **kwargs)


def test_bucket_sampler_accepts_the_last_bucket_id_and_keeps_its_settings():
    sampler = BucketBatchSampler([2, 2], BUCKETS, 2, seed=3, start_batch=0)
    assert sampler.batch_indices(0).size == (4, 4) and sorted(sampler.batch_indices(0)) == [0, 1]
    assert (sampler.num_samples, sampler.seed, sampler.rank, sampler.world_size) == (2, 3, 0, 1)
    assert sampler.buckets == BUCKETS and all(type(v) is int for hw in sampler.buckets for v in hw)


def test_a_bucket_batch_pickles_with_its_size_and_reads_as_a_list():
    batch = BucketBatch([3, 1], (16.0, 8))
    assert batch == [3, 1] and batch.size == (16, 8)
    back = pickle.loads(pickle.dumps(batch))
    assert type(back) is BucketBatch and back == [3, 1] and back.size == (16, 8)
    assert repr(batch) == "BucketBatch([3, 1], size=(16, 8))"
