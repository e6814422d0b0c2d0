"""The training loop's online balancer (imba/training/balancing.py) on several ranks in one process: each rank runs
in its own thread, and a fake accelerator's `reduce` waits for every rank's tensor and hands each the sum, as an
all-reduce does. The module doc's promise: the state is the same on every rank, so the weights and the global stream
do not depend on the number of ranks, before or after a resume on another number of them."""

import copy
import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from data.balance import build_concept_table
from data.concepts import default_extractor
from data.online_balance import FACTOR_ONE, OnlineBalance
from data.weighted import expected_draws_to_units
from imba.training.balancing import OnlineBalancer, _sum_over_ranks

RARE_SAMPLES = 4
ROWS = 48  # stream positions per step over all ranks: 48, 24 or 16 rows per rank
EVERY, LAG, STEPS, SAVE = 3, 2, 24, 10  # the save falls between refreshes (at 9 and 12): its window is not empty
_rng = np.random.default_rng(0)
LEVELS = _rng.integers(0, 1000, ROWS * STEPS)  # each stream position's timestep
JITTER = _rng.uniform(0.8, 1.2, ROWS * STEPS)


@pytest.fixture(scope="module")
def table():
    captions = ["a red cross and a blue ring"] * RARE_SAMPLES + ["a blue square and a red ring"] * 50 + [""] * 6
    return build_concept_table(captions, default_extractor())


class Group:
    """The ranks of one run: `reduce` is a collective that every rank enters."""

    def __init__(self, size):
        self.size, self.tensors = size, [None] * size
        # a guard against a rank that never arrives (a hang), far beyond a busy machine's wait: BrokenBarrierError
        self.barrier = threading.Barrier(size, timeout=300)


class RankAccelerator:
    device = torch.device("cpu")

    def __init__(self, group, rank):
        self.group, self.process_index, self.num_processes = group, rank, group.size

    def reduce(self, tensor, reduction="sum"):
        assert reduction == "sum"
        group = self.group
        group.tensors[self.process_index] = tensor.clone()
        group.barrier.wait()
        total = torch.stack(group.tensors).sum(dim=0)
        group.barrier.wait()  # every rank has its sum before the next collective overwrites the tensors
        return total


def on_ranks(size, work):
    """`work(accelerator)` on `size` ranks at once; the ranks' results, in rank order."""
    group = Group(size)

    def rank(r):
        try:
            return work(RankAccelerator(group, r))
        except BaseException:
            group.barrier.abort()  # the others fail at their next collective instead of waiting for this one
            raise

    with ThreadPoolExecutor(size) as pool:
        return [f.result() for f in [pool.submit(rank, r) for r in range(size)]]


def balancer(table, rank):
    base = expected_draws_to_units(np.ones(len(table)), len(table))
    return OnlineBalancer(OnlineBalance(table, max_factor=8.0), base, np.array([0, len(table)]), len(table), 7,
                          every=EVERY, fraction=1.0, lag=LAG, patch_size=2, num_train_timesteps=1000, rank=rank)


def train(b, acc, steps, save_at=None):
    """One rank's loop over `steps`: it reads its slice of each step's positions from the stream, scores the rows
    (the IMBA loss's distances: a function of the sample and the position only, so every split of the rows scores
    them alike) and ends the step. At `save_at`: sync, and rank 0 keeps the state. What it read, the weights after
    each step, and at `save_at` its window after the sync and the state."""
    share = ROWS // acc.num_processes
    out = {"read": [], "weights": [], "state": None}
    for step in steps:
        positions = b.position(step - 1) + acc.process_index * share + np.arange(share)
        idx = b.order.samples(positions)
        distance = (1 + LEVELS[positions] / 1000) * np.where(idx < RARE_SAMPLES, 3.0, 1.0) * JITTER[positions]
        noised = SimpleNamespace(timesteps=torch.from_numpy(LEVELS[positions]))
        b.observe(idx.tolist(), {"distance_per_token": torch.from_numpy(distance)[:, None]}, None, noised, None)
        b.step_end(step, acc)
        out["read"].append(idx)
        out["weights"].append(b.balance.weights.copy())
        if step == save_at:
            b.before_save(acc)
            out["synced"] = window(b)
            if acc.process_index == 0:  # the main process writes the checkpoint
                out["state"] = copy.deepcopy(b.state_dict())
    out["ahead"] = b.order.samples(np.arange(b.position(steps[-1]), b.order.known_until))
    return out


def fresh_run(table, save_at=None):
    def work(acc):
        b = balancer(table, acc.process_index)
        b.begin(0, 0, ROWS)
        return train(b, acc, range(1, STEPS + 1), save_at)
    return work


def global_batches(ranks):
    """Each step's samples over all ranks, in rank order: the global stream."""
    return [np.concatenate(rows) for rows in zip(*(r["read"] for r in ranks))]


def window(b):
    """A copy of the rank's observations since the last refresh, by statistic."""
    return {k: a.copy() for k, a in b.balance.window.items()}


def summed(windows):
    windows = list(windows)
    return {k: sum(w[k] for w in windows) for k in windows[0]}


def same(a, b):
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def assert_same_run(ranks, single, first=0):
    """Every rank's weights after each step and the stream they read (and decided ahead) are the single run's from
    step `first` + 1 on."""
    for r in ranks:
        assert all(np.array_equal(a, b) for a, b in zip(r["weights"], single["weights"][first:], strict=True))
        assert np.array_equal(r["ahead"], single["ahead"])
    stream = global_batches(ranks)
    assert all(np.array_equal(a, b) for a, b in zip(stream, single["read"][first:], strict=True))


@pytest.fixture(scope="module")
def single(table):
    """One process that observes every row, with a save at SAVE (on one rank, the sync keeps its window)."""
    run = on_ranks(1, fresh_run(table, save_at=SAVE))[0]
    assert run["weights"][-1][0] > FACTOR_ONE  # the runs compared below moved the rare group and so the stream
    return run


@pytest.mark.parametrize("world", [2, 3])
def test_the_sum_over_ranks_is_exact_and_keeps_each_array(world):
    def work(acc):
        r = acc.process_index
        return _sum_over_ranks(acc, [np.array([2 ** 53 + r, -r]), np.array([r]), np.zeros(0, np.int64),
                                     np.arange(4) * (r + 1)])

    r_sum = sum(range(world))  # 0 + 1 (+ 2)
    expected = [np.array([world * 2 ** 53 + r_sum, -r_sum]), np.array([r_sum]), np.zeros(0),
                np.arange(4) * (r_sum + world)]  # 2**53 + 1 is past float64's integers: the sums must stay int64
    for result in on_ranks(world, work):
        assert [a.dtype for a in result] == [np.int64] * 4
        assert all(np.array_equal(a, b) for a, b in zip(result, expected, strict=True))


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_observing_their_share_of_the_rows_give_the_single_process_weights_and_stream(table, single, world):
    assert_same_run(on_ranks(world, fresh_run(table)), single)


def test_a_sync_before_a_save_moves_every_ranks_window_to_the_main_process_and_changes_nothing(table, single):
    ranks = on_ranks(2, fresh_run(table, save_at=SAVE))
    held = single["synced"]  # every row since the refresh at step 9
    assert held["group_rows"].sum() > 0  # the save falls inside a window
    assert same(ranks[0]["synced"], held)  # the main process: all of it, its own rows and the other's
    assert all((a == 0).all() for a in ranks[1]["synced"].values())  # the other: none, so no row counts twice
    assert_same_run(ranks, single)  # the run goes on as if no checkpoint had been written


@pytest.mark.parametrize("resumed_world", [1, 3])
def test_a_two_rank_checkpoint_continues_the_uninterrupted_run_on_any_number_of_ranks(table, single, resumed_world):
    saved = on_ranks(2, fresh_run(table, save_at=SAVE))
    state = saved[0]["state"]
    assert same(state["balance"]["window"], single["synced"])

    def resume(acc):
        b = balancer(table, acc.process_index)
        b.load_state_dict(copy.deepcopy(state))
        loaded = window(b)
        b.begin(SAVE, SAVE * ROWS, ROWS)
        return loaded, train(b, acc, range(SAVE + 1, STEPS + 1))

    resumed = on_ranks(resumed_world, resume)
    # the saved window is carried on once, by one rank: summed over the ranks it is the saved one, not a multiple
    assert same(summed(loaded for loaded, _ in resumed), state["balance"]["window"])
    assert_same_run([run for _, run in resumed], single, first=SAVE)


@pytest.mark.parametrize("every, lag, fraction", [(0, 1, 0.5), (1, 0, 0.5), (1, 1, 0.0), (1, 1, 1.01), (-2, -2, 2)])
def test_a_refresh_interval_or_lag_below_one_or_a_fraction_outside_0_1_is_refused(table, every, lag, fraction):
    base = expected_draws_to_units(np.ones(len(table)), len(table))
    with pytest.raises(ValueError, match="need every >= 1, lag >= 1 and 0 < fraction <= 1"):
        OnlineBalancer(OnlineBalance(table), base, np.array([0, len(table)]), len(table), 7, every=every,
                       fraction=fraction, lag=lag, patch_size=2, num_train_timesteps=1000)
    OnlineBalancer(OnlineBalance(table), base, np.array([0, len(table)]), len(table), 7, every=1, fraction=1.0,
                   lag=1, patch_size=2, num_train_timesteps=1000)  # the bounds themselves are allowed


@pytest.mark.parametrize("step", [0, 7, 9])
def test_a_run_restarting_between_refreshes_decides_the_stream_up_to_the_next_refresh_plus_the_lag(table, step):
    b = balancer(table, 0)  # every 3 steps, lag 2
    b.begin(step, 1000, ROWS)
    following = step - step % EVERY + EVERY  # 3, 9, 12
    assert b.position(following + LAG) == 1000 + (following + LAG - step) * ROWS
    assert b.order.known_until == b.position(following + LAG)
    b.order.samples([b.order.known_until - 1])
    with pytest.raises(RuntimeError, match="past"):
        b.order.samples([b.order.known_until])


def test_the_balancers_stream_follows_its_seed(table):
    base = expected_draws_to_units(np.ones(len(table)), len(table))
    draws = {seed: OnlineBalancer(OnlineBalance(table), base, np.array([0, len(table)]), len(table), seed, every=3,
                                  fraction=1.0, lag=2, patch_size=2, num_train_timesteps=1000).order.samples(range(60))
             for seed in (0, 7)}
    again = OnlineBalancer(OnlineBalance(table), base, np.array([0, len(table)]), len(table), 7, every=3,
                           fraction=1.0, lag=2, patch_size=2, num_train_timesteps=1000).order.samples(range(60))
    assert not np.array_equal(draws[0], draws[7]) and np.array_equal(draws[7], again)


def test_a_balancer_made_without_a_rank_is_the_main_process_and_carries_its_saved_window_on(table):
    def made():
        base = expected_draws_to_units(np.ones(len(table)), len(table))
        return OnlineBalancer(OnlineBalance(table), base, np.array([0, len(table)]), len(table), 7, every=3,
                              fraction=1.0, lag=2, patch_size=2, num_train_timesteps=1000)

    b = made()
    noised = SimpleNamespace(timesteps=torch.tensor([100, 900]))
    b.observe([0, 1], {"distance_per_token": torch.ones(2, 4)}, None, noised, None)
    state = b.state_dict()
    assert state["balance"]["window"]["bin_rows"].sum() == 2
    resumed = made()
    resumed.load_state_dict(copy.deepcopy(state))
    assert same(window(resumed), state["balance"]["window"])


def test_each_row_counts_in_the_noise_bin_of_its_timestep(table):
    # timestep t of T is the noise level t / T, in bin floor(10 t / T): 700 and 900 of 1000 in bins 7 and 9 (through
    # float32 they would fall into 6 and 8)
    base = expected_draws_to_units(np.ones(len(table)), len(table))
    b = OnlineBalancer(OnlineBalance(table), base, np.array([0, len(table)]), len(table), 7, every=3,
                       fraction=1.0, lag=2, patch_size=2, num_train_timesteps=1000)
    noised = SimpleNamespace(timesteps=torch.tensor([0, 100, 700, 900, 999]))
    b.observe([0, 1, 2, 3, 4], {"distance_per_token": torch.ones(5, 4)}, None, noised, None)
    b.flush()
    assert list(np.flatnonzero(b.balance.window["bin_rows"])) == [0, 1, 7, 9]
    assert b.balance.window["bin_rows"][9] == 2
