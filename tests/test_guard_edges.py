"""The divergence guard at its edges: a non-finite value in any position of any input it checks (the loss of any
micro-batch, the gradient norm as a tensor or a float, any tensor of `all_finite`'s list), the decision reset after
each step, and `max_bad_steps` consecutive bad steps as the exact point of divergence."""

import math

import pytest
import torch
from accelerate import Accelerator

from imba.training.guard import DivergenceGuard, all_finite, diverged_message, local_weights

BAD = [float("nan"), float("inf"), float("-inf")]


@pytest.fixture(scope="module")
def accelerator():
    return Accelerator(cpu=True)


@pytest.mark.parametrize("bad", BAD)
@pytest.mark.parametrize("where", [0, 1, 2])
def test_all_finite_finds_a_non_finite_value_in_any_tensor(accelerator, bad, where):
    tensors = [torch.ones(3), torch.zeros(2, 2), torch.full((4,), 2.0)]
    assert all_finite(accelerator, tensors)
    tensors[where] = tensors[where].clone().flatten()
    tensors[where][-1 if where else 0] = bad
    assert not all_finite(accelerator, tensors)


def test_all_finite_of_one_tensor_none_and_a_generator(accelerator):
    assert all_finite(accelerator, [])  # nothing held: nothing diverged
    assert all_finite(accelerator, [torch.tensor(1.0)])
    assert not all_finite(accelerator, [torch.tensor(float("nan"))])
    assert not all_finite(accelerator, (t for t in [torch.tensor([float("inf"), 0.0]), torch.ones(2)]))
    assert all_finite(accelerator, [torch.ones(2, dtype=torch.bfloat16), torch.arange(3)])


@pytest.mark.parametrize("bad", BAD)
def test_a_non_finite_loss_in_any_micro_batch_makes_the_step_bad(accelerator, bad):
    for position in range(3):
        guard = DivergenceGuard(accelerator, max_bad_steps=5)
        for k in range(3):
            guard.add_loss(torch.tensor(bad if k == position else 0.5))
        assert guard.step_is_bad(torch.tensor(1.0)) and guard.skipped == 1 and guard.consecutive == 1
        guard.add_loss(torch.tensor(0.5))  # the next step starts clean
        assert not guard.step_is_bad(1.0) and guard.consecutive == 0 and guard.skipped == 1


@pytest.mark.parametrize("bad", BAD)
def test_a_non_finite_gradient_norm_as_a_tensor_or_a_float_makes_the_step_bad(accelerator, bad):
    guard = DivergenceGuard(accelerator, max_bad_steps=5)
    guard.add_loss(torch.tensor(0.5))
    assert guard.step_is_bad(bad)
    guard.add_loss(torch.tensor(0.5))
    assert guard.step_is_bad(torch.tensor(bad))
    guard.add_loss(torch.tensor(0.5))
    assert not guard.step_is_bad(None) and not guard.step_is_bad(0.0)  # no norm measured; a zero norm is fine
    unchecked = DivergenceGuard(accelerator, max_bad_steps=5, check_grad_norm=False)
    unchecked.add_loss(torch.tensor(0.5))
    assert not unchecked.step_is_bad(bad)
    unchecked.add_loss(torch.tensor(bad))
    assert unchecked.step_is_bad(1.0)  # the loss is still checked


def test_a_loss_with_many_elements_is_bad_if_any_is(accelerator):
    guard = DivergenceGuard(accelerator, max_bad_steps=5)
    guard.add_loss(torch.tensor([0.5, float("nan"), 1.0]).mean())
    assert guard.step_is_bad()
    guard.add_loss(torch.tensor(0.0))  # zero is a finite loss
    assert not guard.step_is_bad()


@pytest.mark.parametrize("max_bad", [1, 3])
def test_the_run_diverges_at_exactly_max_bad_steps_in_a_row(accelerator, max_bad):
    guard = DivergenceGuard(accelerator, max_bad_steps=max_bad)
    assert not guard.diverged
    for k in range(max_bad):
        assert not guard.diverged
        guard.add_loss(torch.tensor(math.nan))
        assert guard.step_is_bad(1.0)
    assert guard.diverged and guard.consecutive == max_bad and guard.skipped == max_bad
    guard.add_loss(torch.tensor(0.1))
    assert not guard.step_is_bad(1.0) and not guard.diverged and guard.skipped == max_bad


def test_local_weights_are_the_parameters_then_the_ema_shadows():
    model = torch.nn.Linear(2, 3)

    class Ema:
        shadow_params = [torch.zeros(3, 2), torch.zeros(3)]

    weights = local_weights(model, Ema())
    assert len(weights) == 4 and weights[0] is model.weight and weights[1] is model.bias
    assert weights[2] is Ema.shadow_params[0] and weights[3] is Ema.shadow_params[1]
    model.weight.ds_tensor = torch.ones(1)  # ZeRO-3: the rank's own slice stands for the parameter
    assert local_weights(model, Ema())[0] is model.weight.ds_tensor


def test_the_verdict_reads_the_weights_only_before_a_save_and_names_why(accelerator):
    model = torch.nn.Linear(2, 3)

    class Ema:
        shadow_params = [torch.full((3, 2), float("nan")), torch.zeros(3)]

    guard = DivergenceGuard(accelerator, max_bad_steps=2)
    assert guard.divergence(False, model, Ema()) is None  # a non-finite EMA, but nothing is saved now
    assert guard.divergence(True, model, Ema()) == "the weights or their EMA are not finite"
    Ema.shadow_params[0] = torch.zeros(3, 2)
    assert guard.divergence(True, model, Ema()) is None
    guard.add_loss(torch.tensor(float("inf")))
    guard.step_is_bad()
    guard.add_loss(torch.tensor(float("inf")))
    guard.step_is_bad()
    assert guard.divergence(False, model, Ema()) == "2 consecutive steps with a non-finite loss or gradient norm"


def test_diverged_message_names_the_step_the_reason_and_where_to_resume():
    line = diverged_message("3 consecutive steps", 42, "out/checkpoints/step_0000040")
    assert "step 42" in line and "3 consecutive steps" in line and "out/checkpoints/step_0000040" in line
    assert "\n" not in line
    line = diverged_message("weights not finite", 7, None)
    assert "weights not finite; nothing was saved" in line and "; no checkpoint was saved before it (resume" in line


class _OnDevice:
    """An accelerator on another device than the tensors' (meta stands in for CUDA): NCCL gathers only tensors on
    the process's own device, so every flag the guard gathers must be there."""

    device = torch.device("meta")

    def __init__(self):
        self.gathered = []

    def gather(self, tensor):
        self.gathered.append(tensor.device)
        return torch.zeros(tensor.shape)  # every rank agrees: nothing bad


def test_every_gathered_flag_is_on_the_accelerators_device():
    accelerator = _OnDevice()
    assert all_finite(accelerator, [torch.ones(2), torch.zeros(3)]) and all_finite(accelerator, [])
    guard = DivergenceGuard(accelerator, max_bad_steps=2)
    guard.add_loss(torch.tensor(0.5))
    assert not guard.step_is_bad(1.0)
    guard.add_loss(torch.tensor(0.5))
    assert not guard.step_is_bad(torch.tensor(2.0))
    assert accelerator.gathered == [torch.device("meta")] * 4
