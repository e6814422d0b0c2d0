"""The trainer's micro-step (imba/training/step.py), which train.py and the composition benchmark both take: equal to
the hand-written step it stands for, accumulation, clipping, the hooks' point and a skipped step."""

from types import SimpleNamespace

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState

from imba.training.guard import DivergenceGuard
from imba.training.hooks import Hooks
from imba.training.step import TrainStep


@pytest.fixture(autouse=True)
def fresh_state():
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def mse(predict, noised, cond, null, scale=1.0):
    """The squared error of `predict` (a model of one input); `cond` and `null` are checked, as a training loss
    reads them."""
    assert (cond, null) == ("cond", "null"), (cond, null)
    loss = (predict(noised.noisy) - noised.target).square().mean() * scale
    return loss, {"loss": loss.detach()}


def batches(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [SimpleNamespace(noisy=torch.randn(4, 3, generator=g), target=torch.randn(4, 2, generator=g))
            for _ in range(n)]


class Seen:
    def __init__(self):
        self.calls = []

    def micro_batch(self, step, batch, stats, predict, noised, null):
        self.calls.append((step, batch, float(stats["loss"]), noised, null, predict))


def made(accumulate=1, clip=1.0, seed=0):
    torch.manual_seed(seed)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accumulate)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 3))
    model, optimizer, schedule = accelerator.prepare(model, optimizer, schedule)
    hooks, seen = Hooks(accelerator), Seen()
    hooks.add(seen)
    step = TrainStep(accelerator, model, optimizer, schedule, mse, model, hooks, DivergenceGuard(accelerator, 3), clip)
    return step, model, seen, accelerator


def test_the_step_is_the_hand_written_step_it_stands_for():
    step, model, seen, _ = made(clip=0.5)
    given = batches(5)
    torch.manual_seed(0)
    reference = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(reference.parameters(), lr=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 3))
    for n, noised in enumerate(given, start=1):
        stats, skip = step(n, {"i": n}, noised, "cond", "null")
        loss = (reference(noised.noisy) - noised.target).square().mean()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        assert skip is False and float(stats["grad_norm"]) == float(norm) and float(stats["loss"]) == loss.item()
    for a, b in zip(model.parameters(), reference.parameters()):
        assert torch.equal(a, b)
    assert [(c[0], c[1]) for c in seen.calls] == [(n, {"i": n}) for n in range(1, 6)]
    # the hooks see the batch, its stats, its inputs, the null caption and the run's predict
    assert all(c[3] is noised and c[4:] == ("null", model) for c, noised in zip(seen.calls, given, strict=True))


def test_accumulation_steps_the_optimizer_once_per_group_and_clips_only_then():
    step, model, seen, accelerator = made(accumulate=2, clip=1.0)
    before = [p.detach().clone() for p in model.parameters()]
    stats, skip = step(1, {}, batches(1)[0], "cond", "null")
    assert not accelerator.sync_gradients and "grad_norm" not in stats and skip is False
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))  # no update inside the group
    stats, skip = step(1, {}, batches(2)[1], "cond", "null")
    assert accelerator.sync_gradients and "grad_norm" in stats
    assert not all(torch.equal(a, b) for a, b in zip(model.parameters(), before))
    assert [c[0] for c in seen.calls] == [1, 1]  # both micro-batches belong to optimizer step 1


def test_no_clip_no_grad_norm_and_the_loss_keywords_reach_the_loss():
    step, model, _, _ = made(clip=0.0)
    noised = batches(1)[0]
    with torch.no_grad():
        expected = 2.0 * (model(noised.noisy) - noised.target).square().mean()
    stats, _ = step(1, {}, noised, "cond", "null", scale=2.0)
    assert "grad_norm" not in stats and float(stats["loss"]) == float(expected)


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before `optimizer.step\\(\\)`")
def test_a_non_finite_loss_skips_the_update_and_the_schedule_still_advances():
    step, model, _, _ = made(clip=1.0)
    before = [p.detach().clone() for p in model.parameters()]
    lr = step.lr_scheduler.get_last_lr()[0]
    stats, skip = step(1, {}, batches(1)[0], "cond", "null", scale=float("nan"))
    assert skip and step.guard.skipped == 1
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))
    assert step.lr_scheduler.get_last_lr()[0] > lr
    stats, skip = step(2, {}, batches(1)[0], "cond", "null")
    assert not skip and step.guard.consecutive == 0


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before `optimizer.step\\(\\)`")
def test_a_non_finite_gradient_norm_with_a_finite_loss_skips_the_update():
    step, model, _, _ = made(clip=1.0)
    before = [p.detach().clone() for p in model.parameters()]
    handle = model.weight.register_hook(lambda grad: grad * float("inf"))
    stats, skip = step(1, {}, batches(1)[0], "cond", "null")
    handle.remove()
    assert skip and torch.isfinite(stats["loss"]) and not torch.isfinite(torch.as_tensor(stats["grad_norm"]))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))


def test_adamw_is_fused_where_the_parameters_train_on_cuda_and_foreach_elsewhere():
    from imba.training.build import build_optimizer
    from imba.training.config import load_config

    cfg = load_config([])
    params = list(torch.nn.Linear(3, 2).parameters())  # built on the CPU; train.py's prepare moves them
    on_gpu, _ = build_optimizer(cfg, params, 1, device="cuda")
    on_cpu, _ = build_optimizer(cfg, params, 1)
    kernels = lambda opt: {(g["fused"], g["foreach"]) for g in opt.param_groups}  # noqa: E731
    assert kernels(on_gpu) == {(True, None)} and kernels(on_cpu) == {(None, True)}
    gpu_state, cpu_state = on_gpu.state_dict(), on_cpu.state_dict()
    on_gpu.load_state_dict(cpu_state)  # a checkpoint of the other machine: its kernels are not taken over
    on_cpu.load_state_dict(gpu_state)
    assert kernels(on_gpu) == {(True, None)} and kernels(on_cpu) == {(None, True)}


def test_adamw_on_the_cpu_steps_bitwise_as_torchs_default_adamw():
    """The CPU default run's weights stay what they were before AdamW's kernels were chosen."""
    from imba.training.build import build_optimizer
    from imba.training.config import load_config

    cfg = load_config(["optim.warmup_steps=2"])
    models = []
    for build in ("ours", "default"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(7, 16), torch.nn.GELU(), torch.nn.Linear(16, 3))
        optimizer, schedule = build_optimizer(cfg, model.parameters(), 1)
        if build == "default":  # torch picks the kernels, as AdamW does when given none
            optimizer.param_groups[0].update(foreach=None, fused=None)
        g = torch.Generator().manual_seed(1)
        for _ in range(5):
            model(torch.randn(8, 7, generator=g)).square().mean().backward()
            optimizer.step()
            schedule.step()
            optimizer.zero_grad()
        models.append(model)
    assert all(torch.equal(a, b) for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True))


def test_one_warm_up_the_trainers_as_diffusers_and_the_benchmarks_a_step_ahead():
    """`build_adamw`'s schedule, the trainer's and every benchmark's: without a head start it is diffusers'
    constant_with_warmup (factors and state, so checkpoints and runs made with diffusers' are unchanged); with a
    head start of 1 it is the composition benchmark's recorded warm-up, min(1, (step + 1) / warmup), to the last bit."""
    from diffusers.optimization import get_constant_schedule_with_warmup

    from imba.training.build import build_adamw

    params = [torch.nn.Parameter(torch.zeros(2))]
    for warmup in (0, 1, 3, 20, 100):
        _, ours = build_adamw(params, lr=2e-3, weight_decay=0.0, warmup_steps=warmup)
        theirs = get_constant_schedule_with_warmup(torch.optim.AdamW(params, lr=2e-3), warmup)
        _, ahead = build_adamw(params, lr=2e-3, weight_decay=0.0, warmup_steps=warmup, warmup_head_start=1)
        for step in range(warmup + 3):
            assert ours.lr_lambdas[0](step) == theirs.lr_lambdas[0](step)
            assert ahead.lr_lambdas[0](step) == (min(1.0, (step + 1) / warmup) if warmup else 1.0)
        assert ours.state_dict() == theirs.state_dict()
    with pytest.raises(ValueError, match="warmup_head_start=-1"):
        build_adamw(params, lr=2e-3, weight_decay=0.0, warmup_steps=3, warmup_head_start=-1)
