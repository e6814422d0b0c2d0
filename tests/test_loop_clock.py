"""The training loop's clock (`imba.training.clock.LoopClock`), the object train.py asks at every micro-batch: the
micro-batches it counts into optimizer steps follow accelerate's own accumulation, each step advances the stream
position by the global batch of every process (not by what this process read), and the log / checkpoint / stop
decisions fall on the steps the settings name. The resumed stream these counters feed is checked through the real
loaders in tests/test_stream_position.py."""

import pytest
import torch
from accelerate import Accelerator

from imba.training.checkpoints import TrainState
from imba.training.clock import LoopClock, StepEnd
from imba.training.config import load_config
from imba.training.resume import ResumePlan, continue_stream


def config(accum=1, batch=2, **train):
    return load_config([f"train.grad_accum={accum}", f"data.batch_size={batch}",
                        *(f"train.{key}={value}" for key, value in train.items())])


def fake_world(accelerator, world):
    """This process's accelerator as one rank of `world` processes (the shared state accelerate keeps)."""
    accelerator.state.process_index, accelerator.state.num_processes = 0, world


@pytest.fixture
def accelerator_of():
    """An accelerator with `accum` accumulation steps, seen as one of `world` processes; restored afterwards."""
    made = []

    def make(world, accum):
        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accum)
        fake_world(accelerator, world)
        made.append(accelerator)
        return accelerator

    yield make
    for accelerator in made:
        fake_world(accelerator, 1)


def train_micro_batches(accelerator, clock, micro_batches, skipped=()):
    """Runs `micro_batches` micro-batches through accelerate's `accumulate`, as `TrainStep` does, and asks the clock
    after each as train.py does; returns the steps that ended."""
    module, ends = torch.nn.Linear(1, 1), []
    for _ in range(micro_batches):
        with accelerator.accumulate(module):
            step = clock.next_step
        end = clock.micro_batch_done(accelerator.sync_gradients, skipped=step in skipped)
        if end is not None:
            assert end.step == step  # the micro-batches trained for `next_step` end that step
            ends.append(end)
    return ends


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("accum", [1, 3])
def test_each_optimizer_step_counts_the_global_batch_of_every_process(accelerator_of, world, accum):
    accelerator = accelerator_of(world, accum)
    cfg, state = config(accum=accum, batch=2), TrainState(world_size=world)
    clock = LoopClock(cfg, accelerator.num_processes, state)
    assert clock.global_batch == world * accum * 2
    ends = train_micro_batches(accelerator, clock, 5 * accum)
    assert [end.step for end in ends] == [1, 2, 3, 4, 5]  # one optimizer step per `accum` micro-batches
    assert (state.step, state.samples) == (5, 5 * world * accum * 2)
    # a partial accumulation is no step: the position stays where the last optimizer step left it
    assert train_micro_batches(accelerator, clock, accum - 1) == []
    assert (state.step, state.samples) == (5, 5 * world * accum * 2)


@pytest.mark.parametrize("before, after", [((2, 1), (3, 3)), ((3, 3), (2, 1)), ((2, 3), (1, 1))])
def test_a_resume_on_another_world_size_continues_at_the_samples_consumed(accelerator_of, before, after):
    (world, accum), batch, steps = before, 2, 4
    first = accelerator_of(world, accum)
    state = TrainState(world_size=world)
    clock = LoopClock(config(accum=accum, batch=batch), world, state)
    continue_stream(ResumePlan(None, None, world), first, state, clock.global_batch)  # a fresh run, as train.py
    train_micro_batches(first, clock, steps * accum)
    consumed = steps * world * accum * batch

    saved = state.state_dict()  # what the checkpoint's train_state.pt holds
    (world, accum), said = after, []
    second = accelerator_of(world, accum)
    second.print = said.append
    resumed = TrainState()
    resumed.load_state_dict(saved)
    clock = LoopClock(config(accum=accum, batch=batch), world, resumed)
    position = continue_stream(ResumePlan(None, None, before[0]), second, resumed, clock.global_batch)
    assert (position.step, position.samples, position.recorded) == (steps, consumed, True)
    assert (resumed.world_size, resumed.samples_per_step) == (world, world * accum * batch)
    assert said == [] if world * accum == before[0] * before[1] else "global batch changes" in said[0]
    train_micro_batches(second, clock, 2 * accum)
    assert (resumed.step, resumed.samples) == (steps + 2, consumed + 2 * world * accum * batch)


def test_log_checkpoint_and_stop_fall_on_the_steps_the_settings_name(accelerator_of):
    accelerator = accelerator_of(1, 2)
    state = TrainState()
    clock = LoopClock(config(accum=2, max_steps=7, log_every=3, save_every=2), 1, state)
    ends = []
    while clock.running:
        ends += train_micro_batches(accelerator, clock, 1, skipped={4})
    assert [end.step for end in ends] == list(range(1, 8))
    assert [end.step for end in ends if end.log] == [3, 6, 7]  # every log_every, and the last step
    assert [end.step for end in ends if end.last] == [7]
    # every save_every, except a skipped step (it may be diverging), and the last step
    assert [end.step for end in ends if end.saving(preempted=False)] == [2, 6, 7]
    assert [end.step for end in ends if end.periodic_save] == [2, 6]
    assert ends[2].saving(preempted=True)  # a pre-emption checkpoints whatever the step
    assert state.step == 7 and not clock.running


def test_save_every_zero_checkpoints_only_the_last_step():
    end = StepEnd(step=500, last=False, log=True, periodic_save=False)
    assert not end.saving(preempted=False)
    clock = LoopClock(config(max_steps=4, save_every=0), 1, TrainState())
    ends = [clock.micro_batch_done(True, skipped=False) for _ in range(4)]
    assert [end.saving(preempted=False) for end in ends] == [False, False, False, True]
