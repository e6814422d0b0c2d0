"""Where a resumed run's data continues: at the samples of the global stream the run consumed, counted step by step
into the checkpoint, so that any sequence of changes of process count, batch size or gradient accumulation neither
replays nor skips a sample; a checkpoint that does not record it continues at step x accumulation x its processes x
batch size. Each run below is segments of the real loader of `imba.training.inputs.make_loader`, one loader per
rank in this process, resumed from the previous segment's saved counters as train.py resumes them."""

import json

import pytest
import torch
from accelerate import Accelerator

from data.synthetic import write_synthetic_shards
from imba.training.checkpoints import TrainState
from imba.training.clock import LoopClock
from imba.training.config import ConfigError, load_config
from imba.training.inputs import make_loader, training_sources
from imba.training.metrics import DrawLog, JsonlLogger
from imba.training.resume import ResumePlan, StreamPosition, continue_stream, global_batch_change, stream_position
from imba.training.run_folder import RunFolder

# 24 samples: every segment below starts the plain order at a whole global batch of its process count, and an epoch
# is whole global batches for 1, 2 and 4 x 2 samples, so the plain order is one global stream too
SAMPLES = 24


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("stream_position")
    write_synthetic_shards(root / "a", num_samples=SAMPLES, samples_per_shard=10, resolution=32, seed=1)
    write_synthetic_shards(root / "b", num_samples=12, samples_per_shard=10, resolution=32, seed=2)
    return root


def settings(shards, tmp_path, stream):
    common = ["data.resolution=32", "model.vae=tiny", "data.precompute=false", f"train.output_dir={tmp_path}"]
    if stream == "plain":  # one shard set in the uniform order
        return [*common, f"data.shards={shards / 'a'}"]
    # two sources by share, balanced by concepts, epochs of 10 draws: the segments cross epochs
    return [*common, "data.balance=temperature", "data.balance.alpha=1", "data.epoch_samples=10",
            f"data.sources=[{{shards: {shards / 'a'}, share: 0.6}}, {{shards: {shards / 'b'}, share: 0.4}}]"]


def rank_loader(cfg, sources, position, rank, world):
    accelerator = Accelerator(cpu=True)
    accelerator.state.process_index, accelerator.state.num_processes = rank, world  # this rank's view of the run
    try:
        return iter(make_loader(cfg, accelerator, sources, position, None, bucket_divisor=16))
    finally:
        accelerator.state.process_index, accelerator.state.num_processes = 0, 1


def run(shards, tmp_path, stream, segments, recorded=True):
    """The sample indices a run in `segments` [(processes, grad_accum, batch_size, steps)] trains on, in the order
    of the global stream (per micro-batch, ranks in order), and the lines its resumes print. Each segment after the
    first resumes from the counters the previous one saved, through the trainer's own bookkeeping: `continue_stream`
    places the stream and the loop's clock counts the micro-batches accelerate's accumulation makes into steps.
    `recorded=False`: from a checkpoint that does not record the data position (written before it was recorded)."""
    state, saved_world, drawn, said = TrainState(), None, [], []
    for world, accum, batch, steps in segments:
        cfg = load_config([*settings(shards, tmp_path, stream), f"data.batch_size={batch}",
                           f"train.grad_accum={accum}"])
        sources = training_sources(cfg, Accelerator(cpu=True), tmp_path)
        if state.step:  # the checkpoint's counters, as `load_state` restores them
            saved = state.state_dict()
            if not recorded:
                del saved["samples"], saved["samples_per_step"]
            state = TrainState()
            state.load_state_dict(saved)
        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accum)
        lines = []
        accelerator.print = lines.append
        clock = LoopClock(cfg, world, state)
        accelerator.state.num_processes = world  # continue_stream sees this run's process count
        try:
            position = continue_stream(ResumePlan(None, None, saved_world or world), accelerator, state,
                                       clock.global_batch)
        finally:
            accelerator.state.num_processes = 1
        said.append(lines[0] if lines else None)
        loaders = [rank_loader(cfg, sources, position, rank, world) for rank in range(world)]
        # accelerate keeps the accumulation in a state all accelerators share: this run's, made after the loaders'
        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accum)
        module = torch.nn.Linear(1, 1)
        for _ in range(steps * accum):
            for loader in loaders:
                drawn += next(loader)["indices"]
            with accelerator.accumulate(module):  # as TrainStep: accelerate decides where a step ends
                pass
            clock.micro_batch_done(accelerator.sync_gradients, skipped=False)
        assert state.step == sum(s for *_, s in segments[:segments.index((world, accum, batch, steps)) + 1])
        saved_world = world
    return drawn, said


def uninterrupted(shards, tmp_path, stream, samples):
    drawn, _ = run(shards, tmp_path, stream, [(1, 1, 1, samples)])
    return drawn


# (processes, grad_accum, batch_size, steps) per segment; each resume changes what the last checkpoint's formula
# step x grad_accum x processes x batch_size gets wrong
SEQUENCES = {
    "2-1-2": [(2, 1, 2, 3), (1, 1, 2, 2), (2, 1, 2, 2)],
    "1-3-2": [(1, 1, 2, 3), (3, 1, 2, 2), (2, 1, 2, 2)],
    # the global batch kept at 4 by the accumulation while the process count moves
    "grad-accum": [(2, 1, 2, 2), (1, 2, 2, 2), (2, 1, 2, 1)],
    "batch-size": [(1, 1, 4, 2), (2, 1, 2, 2), (1, 1, 3, 2)],
    # three processes with three accumulation steps, then two processes without
    "3x3-2": [(1, 1, 2, 2), (3, 3, 1, 1), (2, 1, 2, 2)],
}
# the plain order is one global stream where every segment starts at a whole global batch of its processes
PLAIN = ["2-1-2", "grad-accum"]


@pytest.mark.parametrize("stream, name", [("weighted", n) for n in SEQUENCES] + [("plain", n) for n in PLAIN])
def test_any_sequence_of_process_counts_batches_and_accumulation_continues_the_uninterrupted_stream(
        shards, tmp_path, stream, name):
    segments = SEQUENCES[name]
    drawn, _ = run(shards, tmp_path, stream, segments)
    total = sum(world * accum * batch * steps for world, accum, batch, steps in segments)
    assert len(drawn) == total
    assert drawn == uninterrupted(shards, tmp_path, stream, total)  # nothing replayed, nothing skipped
    # the position counted from the last checkpoint's step and process count alone replays or skips samples
    legacy, _ = run(shards, tmp_path, stream, segments, recorded=False)
    assert legacy != drawn


def test_a_checkpoint_without_a_recorded_position_continues_as_its_step_count_says(shards, tmp_path):
    # one change of process count (the run before the checkpoint never changed it): the step count is exact
    segments = [(2, 1, 2, 3), (1, 1, 2, 4)]
    drawn, _ = run(shards, tmp_path, "weighted", segments, recorded=False)
    assert drawn == uninterrupted(shards, tmp_path, "weighted", 20)
    state = TrainState()
    state.load_state_dict({"step": 3, "world_size": 2})  # what an older checkpoint's train_state.pt holds
    position = stream_position(state, 2 * 2)
    assert position == StreamPosition(3, 12, recorded=False)
    assert "records no position" in position.describe() and "12 samples" in position.describe()
    assert "recorded" in StreamPosition(3, 12).describe() and "records no" not in StreamPosition(3, 12).describe()


def test_the_counters_carry_the_position_and_the_global_batch():
    state = TrainState(world_size=2)
    state.samples_per_step = 8
    for _ in range(3):
        state.advance(8)
    state.advance(5)
    restored = TrainState()
    restored.load_state_dict(state.state_dict())
    assert (restored.step, restored.samples, restored.samples_per_step) == (4, 29, 8)
    assert stream_position(restored, 999) == StreamPosition(4, 29)  # recorded: the step count does not enter


def test_a_change_of_the_global_batch_is_said_in_one_line(shards, tmp_path):
    _, said = run(shards, tmp_path, "weighted", SEQUENCES["batch-size"])
    assert said[0] is None  # a fresh run
    assert "from 4 to 4" not in (said[1] or "")
    assert said[1] is None  # 1 x 4 -> 2 x 2: the same global batch
    assert "the global batch changes from 4 to 3 samples per step" in said[2]
    assert "0.75x" in said[2] and "optim.lr" in said[2] and "\n" not in said[2]
    _, said = run(shards, tmp_path, "weighted", SEQUENCES["2-1-2"])
    assert "from 4 to 2" in said[1] and "from 2 to 4" in said[2]
    # a checkpoint that does not record its global batch: its processes under this run's accumulation and batch
    state = TrainState()
    state.load_state_dict({"step": 3, "world_size": 2})
    assert "from 8 to 4" in global_batch_change(state, 8, 4)
    assert global_batch_change(state, 4, 4) is None


def test_the_metrics_log_keeps_the_rows_up_to_the_resumed_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    log = JsonlLogger(path)
    for step in range(1, 6):
        log.log(step, {"loss": 1.0 / step})
    with path.open("a") as f:
        f.write('{"step": 6, "lo')  # a row cut short by a kill
    resumed = JsonlLogger(path, keep_until=3)  # the checkpoint of step 3
    resumed.log(4, {"loss": 0.0})
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and rows[-1]["loss"] == 0.0
    JsonlLogger(path)  # a fresh run into the same folder starts the log anew
    assert path.read_text() == ""


def test_the_draw_log_names_each_micro_batch_and_refuses_a_batch_without_indices(tmp_path):
    log = DrawLog(RunFolder(tmp_path).draw_log(1), keep_until=0)
    log.add(1, {"indices": [3, 1]})
    log.add(1, {"indices": [0, 2]})
    rows = [json.loads(line) for line in (tmp_path / "draws" / "rank_1.jsonl").read_text().splitlines()]
    assert rows == [{"step": 1, "indices": [3, 1]}, {"step": 1, "indices": [0, 2]}]
    with pytest.raises(ConfigError, match="data.record_draws=true needs indexed reading"):
        log.add(2, {"keys": ["a", "b"]})
    with pytest.raises(ConfigError, match="data.record_draws=true needs indexed reading"):
        load_config(["data.record_draws=true", "data.mode=streaming"])


def test_continuing_the_stream_says_a_changed_batch_and_counts_on_in_this_runs_units(capsys):
    from imba.training.resume import ResumePlan, continue_stream

    accelerator = Accelerator(cpu=True)
    fresh = TrainState(world_size=1)
    assert continue_stream(ResumePlan(None, None, 1), accelerator, fresh, 8) == StreamPosition(0, 0)
    assert (fresh.world_size, fresh.samples, fresh.samples_per_step) == (1, 0, 8) and capsys.readouterr().out == ""
    recorded = TrainState()
    recorded.load_state_dict({"step": 5, "world_size": 2, "samples": 40, "samples_per_step": 8})
    assert continue_stream(ResumePlan(None, None, 2), accelerator, recorded, 4) == StreamPosition(5, 40)
    assert "the global batch changes from 8 to 4" in capsys.readouterr().out
    assert (recorded.world_size, recorded.samples, recorded.samples_per_step) == (1, 40, 4)
    older = TrainState()  # a checkpoint of 2 processes that records no position: 2 x this run's 4 a step
    older.load_state_dict({"step": 3, "world_size": 2})
    assert continue_stream(ResumePlan(None, None, 2), accelerator, older, 4) == StreamPosition(3, 24, recorded=False)
    assert "from 8 to 4" in capsys.readouterr().out and older.samples == 24
