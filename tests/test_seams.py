"""Promises that hold only where one module's output is consumed by another: the training step telling the guard
every micro-batch's loss, the guard's decision gathered over the ranks, the LoRA adapter export taking the EMA's
adapters as the merged export does, the checkpoint map carrying the counters and a hook's per-rank state, the LR
schedule's step count across process counts, the stream's fingerprint and order following the shards and the run's
seed, and the online balancer's rows, positions and saved window. Each test drives the real classes at tiny sizes;
the last one checks that the promise table of docs/testing.md ("What the tests promise") names tests that exist."""

from __future__ import annotations

import ast
import dataclasses
import os
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, PartialState

from data.balance import build_concept_table
from data.concepts import default_extractor
from data.indexed import IndexedShards
from data.online_balance import OnlineBalance
from data.sources import Source
from data.stream import make_stream, reader_fingerprint
from data.synthetic import write_synthetic_shards
from data.weighted import expected_draws_to_units
from imba.loss import token_distance
from imba.training import checkpoints
from imba.training.balancing import OnlineBalancer
from imba.training.build import build_optimizer
from imba.training.checkpoints import TrainState, load_checkpoint, register_state, save_checkpoint
from imba.training.config import load_config
from imba.training.ema import ema_weights_copy, make_ema
from imba.training.export import export_adapter
from imba.training.guard import DivergenceGuard
from imba.training.hooks import Hooks
from imba.training.inputs import make_loader, online_balancer, training_sources
from imba.training.resume import StreamPosition, rescale_schedule
from models.lora import add_lora
from tests.test_lora import TARGETS, out, perturb_adapters, tiny_dit
from tests.test_train_step import batches, made

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def fresh_state():
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


# ---- the guard sees the loss of every micro-batch of an accumulation -------------------------------------------

@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before `optimizer.step\\(\\)`")
@pytest.mark.parametrize("bad", [0, 1, 2])
def test_a_non_finite_loss_in_any_micro_batch_of_an_accumulation_skips_the_step_without_a_clip(bad):
    # grad_clip=0: no gradient norm is measured, so only the losses the step hands the guard can stop a NaN from
    # reaching the optimizer (AdamW turns a NaN gradient into NaN weights)
    step, model, _, _ = made(accumulate=3, clip=0.0)
    before = [p.detach().clone() for p in model.parameters()]
    group = batches(6)
    skips = [step(1, {}, noised, "cond", "null", scale=float("nan") if i == bad else 1.0)[1]
             for i, noised in enumerate(group[:3])]
    assert skips == [False, False, True] and step.guard.skipped == 1
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))
    skips = [step(2, {}, noised, "cond", "null")[1] for noised in group[3:]]  # the next step trains
    assert skips == [False, False, False] and step.guard.consecutive == 0
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert not all(torch.equal(a, b) for a, b in zip(model.parameters(), before))


class OtherRankBad:
    """This process as rank 0 of two: `gather` hands back its own flag and rank 1's, which found its step bad."""

    device = torch.device("cpu")

    def gather(self, tensor):
        return torch.cat([tensor, torch.ones_like(tensor)])


def test_a_step_another_rank_found_bad_is_skipped_here_too():
    guard = DivergenceGuard(OtherRankBad(), max_bad_steps=3)
    guard.add_loss(torch.tensor(0.5))  # finite here
    assert guard.step_is_bad(torch.tensor(1.0)) and guard.skipped == 1 and guard.consecutive == 1


# ---- every export holds the EMA's weights ---------------------------------------------------------------------

def test_the_adapter_export_takes_the_emas_adapters_as_the_merged_export_does(tmp_path):
    from peft import PeftModel

    model = add_lora(tiny_dit(), rank=4, alpha=6, targets=TARGETS)
    perturb_adapters(model, seed=2)
    ema = make_ema(model.parameters())  # the EMA holds these adapters ...
    perturb_adapters(model, seed=5)  # ... and the live ones moved on: no export may take them
    cfg = load_config(["model.pretrained=base-export", "model.lora_rank=4", "model.lora_alpha=6",
                       f"model.lora_targets={','.join(TARGETS)}"])
    folder = export_adapter(tmp_path / "export", model, ema, cfg)
    adapter = PeftModel.from_pretrained(tiny_dit(), folder).get_base_model()  # the base with the exported adapters
    merged = ema_weights_copy(model, ema)  # the pipeline's transformer: the EMA's adapters merged
    # float32 rounding of W + s·BA against the adapter's path; the live adapters' 0.2-sized moves are far outside
    torch.testing.assert_close(out(adapter), out(merged), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(out(adapter), out(model), rtol=1e-3, atol=1e-3)  # the live adapters predict otherwise


# ---- the checkpoint map: a hook's per-rank state in each rank's own file ----------------------------------------

class Tally:
    """A hook with state (the steps it saw, from `n`): per rank when `per_rank`, else the same on every rank."""

    def __init__(self, name: str, per_rank: bool, n: int = 0):
        self.CHECKPOINT, self.CHECKPOINT_PER_RANK, self.n = name, per_rank, n

    def step_end(self, step: int, accelerator) -> None:
        self.n += 1

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, state: dict) -> None:
        self.n = state["n"]


def test_the_run_map_carries_the_counters_and_a_hooks_per_rank_state_in_each_ranks_file(tmp_path, monkeypatch, capsys):
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(4, 2)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    mine, shared = Tally("tally", per_rank=True, n=5), Tally("shared", per_rank=False, n=3)
    hooks = Hooks(accelerator, [mine, shared])
    state = TrainState(world_size=1)
    state.advance(12)
    state.data = "0123456789abcdef"  # the fingerprint of what the loader read (data.stream.reader_fingerprint)
    register_state(accelerator, make_ema(model.parameters()), state, None, hooks.checkpointed())
    saved = save_checkpoint(accelerator, tmp_path / "checkpoints", 1, 3, config_text="tiny: 1\n")
    assert torch.load(checkpoints.rank_file(saved, 0), weights_only=False) == {"tally": {"n": 5}}
    assert torch.load(saved / "shared.pt", weights_only=False) == {"n": 3} and not (saved / "tally.pt").exists()
    torch.save({"tally": {"n": 7}}, checkpoints.rank_file(saved, 1))  # as rank 1 of a 2-process run writes it

    for rank, expected in ((0, 5), (1, 7), (2, 0)):  # rank 2 was not in the saving run: it starts fresh
        monkeypatch.setattr(Accelerator, "process_index", property(lambda self, rank=rank: rank))
        monkeypatch.setattr(Accelerator, "is_main_process", property(lambda self, rank=rank: rank == 0))
        mine.n, shared.n, state.step, state.samples, state.data = 0, 0, 0, 0, None
        capsys.readouterr()
        load_checkpoint(accelerator, saved)
        assert (mine.n, shared.n) == (expected, 3), rank
        # the counters and the fingerprint of the data the position counts in, which a resume compares
        assert (state.step, state.samples, state.data) == (1, 12, "0123456789abcdef")
        assert ("rank 2: " in capsys.readouterr().out) == (rank == 2)


def test_the_lr_schedules_warm_up_continues_on_another_process_count():
    # accelerate steps a prepared schedule once per process per optimizer step, and the run's warm-up is counted in
    # those steps (build_optimizer): a resume on another process count must count the steps taken in its own unit
    cfg = load_config(["optim.warmup_steps=10"])

    def prepared(world):
        AcceleratorState._reset_state(reset_partial_state=True)
        accelerator = Accelerator(cpu=True)
        # this process as one of `world` (accelerate's scheduler reads the count from a fresh AcceleratorState, which
        # copies PartialState's)
        accelerator.state.num_processes = PartialState().num_processes = world
        model = torch.nn.Linear(2, 2)
        optimizer, schedule = build_optimizer(cfg, model.parameters(), world)
        return accelerator.prepare(model, optimizer, schedule)

    def steps(model, optimizer, schedule, n):
        for _ in range(n):
            model(torch.ones(1, 2)).sum().backward()
            optimizer.step()
            schedule.step()
            optimizer.zero_grad()
        return schedule.get_last_lr()[0]

    saved = prepared(2)
    steps(*saved, 3)
    state = saved[2].state_dict()
    after_four = steps(*saved, 1)  # what the two-process run reaches at step 4: 4 of 10 warm-up steps
    resumed = prepared(3)
    resumed[2].load_state_dict(state)
    rescale_schedule(resumed[2], 2, 3)
    assert steps(*resumed, 1) == after_four == 0.4 * cfg.optim.lr


# ---- the stream's fingerprint follows the data --------------------------------------------------------------------

def test_a_shard_rewritten_in_place_at_the_same_size_changes_the_fingerprint_the_checkpoint_records(tmp_path):
    shards = write_synthetic_shards(tmp_path / "a", num_samples=20, samples_per_shard=8, resolution=32, seed=3)
    other = write_synthetic_shards(tmp_path / "b", num_samples=20, samples_per_shard=8, resolution=32, seed=4)

    def recorded() -> str:  # what a run over `shards` records in its checkpoint (TrainState.data)
        d = load_config(["data.resolution=32", "data.batch_size=4"]).data
        stream = make_stream(d, Accelerator(cpu=True), [Source("a", shards)], seed=0, samples_done=0, manifest=None,
                             bucket_divisor=16, plan_folder=tmp_path / "plan")
        return reader_fingerprint(stream.loader)

    before = recorded()
    assert before == IndexedShards(shards, 32).fingerprint()
    # another set's shard of the same size copied over the first: other samples under the same path and size
    same_size = next(o for o in other if os.path.getsize(o) == os.path.getsize(shards[0]))
    stat = os.stat(shards[0])
    shutil.copyfile(same_size, shards[0])
    os.utime(shards[0], ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # a later write, as a rewrite has
    assert os.path.getsize(shards[0]) == stat.st_size
    assert recorded() != before


@pytest.mark.parametrize("balance", ["none", "temperature", "imba"])
def test_the_streams_order_follows_the_runs_seed(tmp_path, balance):
    # the order the saved position counts in is a function of train.seed, through the run's own loader (the plain
    # order, the plan's weighted order, the online balancer's): a seed that does not reach it gives every run one
    # and the same order
    shards = write_synthetic_shards(tmp_path / "a", num_samples=24, samples_per_shard=8, resolution=32, seed=3)
    out = tmp_path / "run"

    def first_batch(seed: int) -> list[int]:
        cfg = load_config(["data.resolution=32", "data.batch_size=8", f"data.balance={balance}",
                           f"data.shards={os.path.dirname(shards[0])}", f"train.output_dir={out}",
                           f"train.seed={seed}"])
        accelerator = Accelerator(cpu=True)
        sources = training_sources(cfg, accelerator, out)
        balancer = online_balancer(cfg, accelerator, sources, patch_size=4, num_train_timesteps=1000)
        loader = make_loader(cfg, accelerator, sources, StreamPosition(0, 0), None, bucket_divisor=16,
                             balancer=balancer)
        return [int(i) for i in next(iter(loader))["indices"]]

    assert first_batch(3) == first_batch(3) != first_batch(4)
    assert first_batch(0) != first_batch(4)


# ---- the online balancer credits the rows the step scored, at their noise level ------------------------------------

def test_the_plain_losss_scored_rows_reach_the_balance_with_their_own_samples_and_noise_levels(monkeypatch):
    objective = load_config([]).objective.build()  # the default run's (flow: float32 timesteps sigma × T)
    captions = ["a red cross and a blue ring"] * 4 + ["a blue square and a red ring"] * 8
    balancer = OnlineBalancer(OnlineBalance(build_concept_table(captions, default_extractor())),
                              expected_draws_to_units(np.ones(12), 12), np.array([0, 12]), 12, 0, every=2,
                              fraction=0.5, lag=2, patch_size=2, num_train_timesteps=objective.num_train_timesteps)
    g = torch.Generator().manual_seed(0)
    noised = objective.noise(torch.randn(8, 4, 8, 8, generator=g), generator=g)
    # noise levels 0.7 and 0.9 in the objective's own dtype: read in float32 they would fall a bin low
    noised = dataclasses.replace(noised, timesteps=noised.timesteps.new_tensor([700, 900, 300, 100, 0, 0, 0, 0]))
    seen = []
    real = balancer.balance.observe
    monkeypatch.setattr(balancer.balance, "observe", lambda i, d, t: (seen.append((i, d, t)), real(i, d, t)))
    indices = [5, 9, 2, 7, 11, 3, 8, 1]
    null = (torch.zeros(8, 3, 5), torch.ones(8, 3))
    hooks = Hooks(Accelerator(cpu=True), [balancer])  # as the training step calls it, at its micro_batch point
    hooks.micro_batch(1, {"indices": indices}, {}, lambda noisy, t, embeds, mask: torch.zeros_like(noisy), noised, null)
    balancer.flush()
    [(rows, distance, level)] = seen
    assert list(rows) == [5, 9, 2, 7]  # the first half of the rows: the ones the unconditional pass scored
    expected = token_distance(noised.target[:4], torch.zeros_like(noised.target[:4]), 2).mean(dim=1)
    np.testing.assert_allclose(distance, expected.numpy(), rtol=1e-6)  # each row's own distance
    assert list(np.flatnonzero(balancer.balance.window["bin_rows"])) == [1, 3, 7, 9]


def test_the_online_balancers_stream_position_counts_the_global_batch_of_every_process(tmp_path):
    # its refreshes start their segments at stream positions: a step is the global batch of every process, not this
    # process's (on 2 processes a position counted per process puts a refresh's weights at another step's draws)
    shards = write_synthetic_shards(tmp_path / "a", num_samples=20, samples_per_shard=8, resolution=32, seed=3)
    accelerator = Accelerator(cpu=True)
    cfg = load_config(["data.resolution=32", "data.batch_size=2", "train.grad_accum=3", "data.balance=imba",
                       "data.balance.every=2", f"data.shards={os.path.dirname(shards[0])}",
                       f"train.output_dir={tmp_path}"])
    sources = training_sources(cfg, accelerator, tmp_path)
    balancer = online_balancer(cfg, accelerator, sources, patch_size=4, num_train_timesteps=1000)
    per_step = 2 * 3 * 2  # batch × accumulation × processes
    accelerator.state.num_processes = 2  # this process as rank 0 of two
    try:
        make_loader(cfg, accelerator, sources, StreamPosition(3, 3 * per_step), None, bucket_divisor=16,
                    balancer=balancer)
    finally:
        accelerator.state.num_processes = 1
    assert [balancer.position(step) for step in (3, 4, 6)] == [3 * per_step, 4 * per_step, 6 * per_step]
    # the stream is decided up to the next refresh (step 4) plus the lag, in the same positions
    assert balancer.order.known_until == (4 + balancer.lag) * per_step


def test_a_resume_on_two_processes_counts_the_saved_window_of_the_online_balance_once(tmp_path):
    # the run's balancer knows its rank (inputs.online_balancer): the saved window, every rank's observations summed,
    # is carried on by rank 0 alone; on every rank it would count once per process at the next refresh
    shards = write_synthetic_shards(tmp_path / "a", num_samples=20, samples_per_shard=8, resolution=32, seed=3)
    cfg = load_config(["data.resolution=32", "data.batch_size=4", "data.balance=imba",
                       f"data.shards={os.path.dirname(shards[0])}", f"train.output_dir={tmp_path}"])
    accelerator = Accelerator(cpu=True)
    sources = training_sources(cfg, accelerator, tmp_path)

    def balancer_of_rank(rank: int):
        accelerator.state.process_index = PartialState().process_index = rank
        return online_balancer(cfg, accelerator, sources, patch_size=4, num_train_timesteps=1000)

    saving = balancer_of_rank(0)
    rows = torch.ones(6, 4)
    saving.micro_batch(1, {"indices": [0, 1, 2, 3, 4, 5]}, {"distance_per_token": rows}, None,
                       SimpleNamespace(timesteps=torch.arange(6) * 100), None)
    state = saving.state_dict()
    saved_rows = int(state["balance"]["window"]["bin_rows"].sum())
    assert saved_rows == 6
    resumed = [balancer_of_rank(rank) for rank in (0, 1)]
    accelerator.state.process_index = PartialState().process_index = 0
    for balancer in resumed:
        balancer.load_state_dict(state)
    assert [int(b.balance.window["bin_rows"].sum()) for b in resumed] == [saved_rows, 0]


# ---- the promise table of docs/testing.md names tests that exist ------------------------------------------------

def _marked_slow(node: ast.AST) -> bool:
    return any("slow" in ast.unparse(d) for d in getattr(node, "decorator_list", []))


def test_every_promise_names_tests_that_exist():
    """Each `tests/FILE.py::NAME` of the table is a test function of that file; the ones in the fast column (all but
    those after "slow only:") are not marked slow, nor is their file."""
    text = (REPO / "docs" / "testing.md").read_text()
    table = text.split("## What the tests promise", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| Promise")]
    assert len(rows) >= 20
    problems = []
    for row in rows:
        tests_cell = row.rstrip(" |").rsplit(" | ", 1)[1]
        fast, _, slow = tests_cell.partition("slow only:")
        named = [(m, True) for m in re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", fast)]
        named += [(m, False) for m in re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", slow)]
        if not named:
            problems.append(f"no test named: {row[:80]}")
        for (path, name), must_be_fast in named:
            file = REPO / path
            tree = ast.parse(file.read_text()) if file.is_file() else None
            found = [n for n in (tree.body if tree else []) if isinstance(n, ast.FunctionDef) and n.name == name]
            file_slow = tree is not None and any(
                isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in n.targets)
                and "slow" in ast.unparse(n.value) for n in tree.body)
            if not found:
                problems.append(f"{path}::{name} does not exist")
            elif must_be_fast and (file_slow or _marked_slow(found[0])):
                problems.append(f"{path}::{name} is marked slow")
    assert problems == []
