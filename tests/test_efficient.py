"""The efficient IMBA estimator is unbiased: exactly, by enumerating every dropout mask of a small batch.

Literal form: L = λ·L* + (1 − λ)·L_u on every row. Efficient form: rows dropped with probability 1 − λ train L_u,
kept rows train L* with D from a no-grad unconditional pass. Σ over all 2^B masks of P(mask)·∇L_eff(mask) must
equal ∇L_literal up to float rounding (float64 here).
"""

import itertools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from imba import IMBALoss
from imba.objectives import build_objective
from imba.loss_settings import LOSS_SETTINGS
from imba.training_loss import ImbaTrainingLoss, PlainTrainingLoss
from models.dit import build_transformer, predict

B = 4


def all_masks(b):
    for bits in itertools.product([False, True], repeat=b):
        yield torch.tensor(bits)


def mask_probability(drop, lam):
    p = 1.0
    for dropped in drop.tolist():
        p *= (1 - lam) if dropped else lam
    return p


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    dit = build_transformer("tiny", sample_size=4, caption_channels=16).double()
    g = torch.Generator().manual_seed(1)
    latents = torch.randn(B, 4, 4, 4, generator=g, dtype=torch.float64)
    noised = build_objective("flow").noise(latents, generator=g)
    cond = (torch.randn(B, 5, 16, generator=g, dtype=torch.float64), torch.ones(B, 5, dtype=torch.long))
    null_mask = torch.zeros(B, 5, dtype=torch.long)
    null_mask[:, 0] = 1
    null = (torch.randn(1, 5, 16, generator=g, dtype=torch.float64).expand(B, -1, -1), null_mask)
    return dit, noised, cond, null


def gradient(dit, loss):
    dit.zero_grad()
    loss.backward()
    return torch.cat([p.grad.flatten() for p in dit.parameters()])


@pytest.mark.parametrize("kind,reference,normalize", [
    ("imba", "target", "none"), ("imba", "cond", "none"), ("imba_sample", "target", "none"),
    ("imba_sample", "cond", "none"), ("imba", "target", "batch_mean"),
])
def test_efficient_gradient_is_the_literal_gradient_in_expectation(setup, kind, reference, normalize):
    dit, noised, cond, null = setup
    lam = 0.7  # not 0.9, so every mask has a probability well above float64 rounding
    settings = dict(gamma=0.8, lam=lam, reference=reference, normalize=normalize)
    predict_fn = lambda *a: predict(dit, *a)  # noqa: E731
    literal_loss, _ = LOSS_SETTINGS[kind](**settings, estimator="literal").build()(predict_fn, noised, cond, null)
    literal = gradient(dit, literal_loss)

    efficient = LOSS_SETTINGS[kind](**settings, estimator="efficient").build()
    expected_grad = torch.zeros_like(literal)
    expected_loss = 0.0
    for drop in all_masks(B):
        loss, _ = efficient(predict_fn, noised, cond, null, drop=drop)
        p = mask_probability(drop, lam)
        expected_grad += p * gradient(dit, loss)
        expected_loss += p * loss.item()
    assert expected_loss == pytest.approx(literal_loss.item(), rel=1e-10)
    torch.testing.assert_close(expected_grad, literal, rtol=1e-9, atol=1e-12)
    # and the estimator is not trivially the literal form: single masks give other gradients
    one_mask, _ = efficient(predict_fn, noised, cond, null, drop=torch.tensor([True, False, False, False]))
    assert not torch.allclose(gradient(dit, one_mask), literal)


def test_loss_level_expectation_over_masks():
    g = torch.Generator().manual_seed(0)
    pc, pu, t = (torch.randn(3, 4, 4, 4, generator=g, dtype=torch.float64) for _ in range(3))
    fn = IMBALoss(gamma=0.8, lam=0.6)
    literal, _ = fn(pc, pu, t)
    expected = sum(mask_probability(m, 0.6) * fn(pc, pu, t, drop=m)[0] for m in all_masks(3))
    torch.testing.assert_close(expected, literal)


def test_dropped_rows_ignore_pred_cond_and_kept_rows_ignore_uncond_gradient():
    g = torch.Generator().manual_seed(0)
    pc = torch.randn(2, 4, 2, 2, generator=g, requires_grad=True)
    pu = torch.randn(2, 4, 2, 2, generator=g, requires_grad=True)
    t = torch.randn(2, 4, 2, 2, generator=g)
    drop = torch.tensor([True, False])
    loss, stats = IMBALoss()(pc, pu, t, drop=drop)
    loss.backward()
    assert torch.count_nonzero(pc.grad[0]) == 0 and torch.count_nonzero(pc.grad[1]) > 0
    assert torch.count_nonzero(pu.grad[1]) == 0 and torch.count_nonzero(pu.grad[0]) > 0
    assert stats["imba/caption_dropout_rate"].item() == 0.5


def test_drop_mask_rate_and_validation():
    fn = IMBALoss(lam=0.9)
    drop = fn.draw_drop_mask(20000, generator=torch.Generator().manual_seed(0))
    assert abs(drop.float().mean().item() - 0.1) < 0.01
    z = torch.zeros(2, 4, 2, 2)
    with pytest.raises(ValueError, match="drop must be a bool tensor"):
        fn(z, z, z, drop=torch.tensor([1, 0]))


def counting(dit, passes: list):
    """The DiT's predict, recording (batch size, grad enabled) of every pass in `passes`."""
    def counting_predict(noisy, t, embeds, mask):
        passes.append((noisy.shape[0], torch.is_grad_enabled()))
        return predict(dit, noisy, t, embeds, mask)
    return counting_predict


def test_efficient_runs_one_grad_pass_and_a_no_grad_pass_of_the_kept_rows(setup):
    dit, noised, cond, null = setup
    passes = []
    counting_predict = counting(dit, passes)
    drop = torch.tensor([True, False, True, False])
    ImbaTrainingLoss(estimator="efficient")(counting_predict, noised, cond, null, drop=drop)
    assert passes == [(4, True), (2, False)]
    passes.clear()
    ImbaTrainingLoss(estimator="efficient")(counting_predict, noised, cond, null, drop=torch.ones(4, dtype=torch.bool))
    assert passes == [(4, True)]  # nothing kept: no unconditional pass needed
    passes.clear()
    ImbaTrainingLoss(estimator="literal")(counting_predict, noised, cond, null)
    assert passes == [(8, True)]


def test_same_passes_on_every_rank_run_the_no_grad_pass_on_every_row_and_give_the_same_loss(setup):
    """ZeRO-3 (every forward is a collective): the same passes whatever the batch draws, the same loss."""
    dit, noised, cond, null = setup
    passes = []
    counting_predict = counting(dit, passes)
    uniform = ImbaTrainingLoss(estimator="efficient", same_passes_on_every_rank=True)
    for drop in (torch.tensor([True, False, True, False]), torch.ones(4, dtype=torch.bool)):
        passes.clear()
        loss, _ = uniform(counting_predict, noised, cond, null, drop=drop)
        assert passes == [(4, True), (4, False)]
        expected, _ = ImbaTrainingLoss(estimator="efficient")(counting_predict, noised, cond, null, drop=drop)
        assert torch.allclose(loss, expected, rtol=1e-12, atol=0)


class HostReads(TorchDispatchMode):
    """The ops that read a tensor's values on the host (on a GPU, each waits for the device to catch up):
    nonzero, a scalar read, a selection by a boolean mask."""

    SYNCING = {torch.ops.aten.nonzero.default, torch.ops.aten._local_scalar_dense.default,
               torch.ops.aten.is_nonzero.default, torch.ops.aten.masked_select.default}

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        indexing = func in (torch.ops.aten.index.Tensor, torch.ops.aten.index_put.default,
                            torch.ops.aten.index_put_.default)
        by_mask = indexing and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1])
        if func in self.SYNCING or by_mask:
            self.ops.append(func.__name__)
        return func(*args, **(kwargs or {}))


def test_the_efficient_loss_reads_the_device_once_for_its_kept_rows_and_never_with_same_passes(setup):
    dit, noised, cond, null = setup
    drop = torch.tensor([True, False, True, False])
    run = lambda loss_fn: loss_fn(lambda *a: predict(dit, *a), noised, cond, null, drop=drop)  # noqa: E731
    with HostReads() as plain:
        run(PlainTrainingLoss())
    assert plain.ops == []  # the DiT and the plain loss read nothing on the host
    with HostReads() as kept_rows:
        run(ImbaTrainingLoss(estimator="efficient"))
    assert kept_rows.ops == ["nonzero.default"]  # which rows the no-grad pass runs on: once, not again
    with HostReads() as every_row:
        loss, stats = run(ImbaTrainingLoss(estimator="efficient", same_passes_on_every_rank=True))
    assert every_row.ops == []
    expected, expected_stats = run(ImbaTrainingLoss(estimator="efficient"))
    assert torch.allclose(loss, expected, rtol=1e-12, atol=0)
    assert torch.allclose(stats["loss_cond_plain"], expected_stats["loss_cond_plain"], rtol=1e-12, atol=0)


def test_the_plain_conditional_error_is_the_mean_over_the_kept_rows(setup):
    dit, noised, cond, null = setup
    loss_fn = ImbaTrainingLoss(estimator="efficient")
    for drop in (torch.tensor([True, False, True, False]), torch.tensor([False, False, False, True])):
        _, stats = loss_fn(lambda *a: predict(dit, *a), noised, cond, null, drop=drop)
        per_row = stats.tensors["loss_cond_per_sample"]  # NaN on the dropped rows
        assert torch.allclose(stats["loss_cond_plain"], per_row.nanmean(), rtol=1e-12, atol=0)
    _, stats = loss_fn(lambda *a: predict(dit, *a), noised, cond, null, drop=torch.ones(B, dtype=torch.bool))
    assert torch.isnan(stats["loss_cond_plain"])  # no kept row: undefined, as the mean of no rows
