"""The per-batch training loss with a real tiny DiT: every loss kind with every objective."""

import itertools

import pytest
import torch

from imba import IMBALoss
from imba.objectives import build_objective
from imba.loss_settings import LOSS_SETTINGS
from imba.training_loss import ImbaTrainingLoss, PlainTrainingLoss
from models.dit import build_transformer, predict


@pytest.fixture(scope="module")
def dit():
    torch.manual_seed(0)
    return build_transformer("tiny", sample_size=8, caption_channels=16)


def batch(b=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    latents = torch.randn(b, 4, 8, 8, generator=g)
    cond = (torch.randn(b, 6, 16, generator=g), torch.ones(b, 6, dtype=torch.long))
    null_mask = torch.zeros(b, 6, dtype=torch.long)
    null_mask[:, 0] = 1
    null = (torch.randn(1, 6, 16, generator=g).expand(b, -1, -1), null_mask)
    return latents, cond, null


@pytest.mark.parametrize("kind,objective", list(itertools.product(LOSS_SETTINGS, ["flow", "ddpm"])))
def test_every_loss_fits_a_fixed_batch_with_every_objective(kind, objective):
    """A few AdamW steps on one batch with its noise fixed: the conditional and unconditional predictions both move
    towards the objective's own target, measured here without the loss module (a loss that regressed the wrong
    target, or trained one branch only, would not get there)."""
    torch.manual_seed(0)
    dit = build_transformer("tiny", sample_size=8, caption_channels=16)
    latents, cond, null = batch()
    noised = build_objective(objective).noise(latents, generator=torch.Generator().manual_seed(1))
    drop = torch.tensor([False, True, False, True])  # plain: half the rows train the null caption
    loss_fn = LOSS_SETTINGS[kind]().build()
    optimizer = torch.optim.AdamW(dit.parameters(), lr=3e-3)

    def errors():
        with torch.no_grad():
            return [(predict(dit, noised.noisy, noised.timesteps, *c) - noised.target).square().mean().item()
                    for c in (cond, null)]

    before = errors()
    for _ in range(12):
        loss, _ = loss_fn(lambda *a: predict(dit, *a), noised, cond, null, drop=drop)
        assert torch.isfinite(loss) and loss > 0
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    after = errors()
    assert after[0] < 0.5 * before[0] and after[1] < 0.5 * before[1], (before, after)


def test_batched_forward_equals_separate_passes(dit):
    """imba runs cond and uncond as one 2B forward; it must equal IMBALoss on two separate forwards."""
    latents, cond, null = batch()
    noised = build_objective("flow").noise(latents, generator=torch.Generator().manual_seed(1))
    dit.eval()
    with torch.no_grad():
        loss, _ = ImbaTrainingLoss()(lambda *a: predict(dit, *a), noised, cond, null)
        p_c = predict(dit, noised.noisy, noised.timesteps, *cond)
        p_u = predict(dit, noised.noisy, noised.timesteps, *null)
        expected, _ = IMBALoss()(p_c, p_u, noised.target)
    dit.train()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)


def test_plain_drops_captions_at_rate_one_minus_lambda():
    calls = []

    def record(noisy, t, embeds, mask):
        calls.append(mask[:, 1:].sum(dim=1) == 0)  # null caption: only the first token is real
        return torch.zeros_like(noisy, requires_grad=True)

    b = 4000
    noised = build_objective("flow").noise(torch.zeros(b, 4, 2, 2))
    cond = (torch.ones(b, 3, 8), torch.ones(b, 3, dtype=torch.long))
    null_mask = torch.tensor([[1, 0, 0]]).expand(b, -1)
    _, stats = PlainTrainingLoss(lam=0.9)(record, noised, cond, (torch.zeros(b, 3, 8), null_mask),
                                          generator=torch.Generator().manual_seed(0))
    dropped = calls[0].float().mean().item()
    assert abs(dropped - 0.1) < 0.015
    assert stats["caption_dropout_rate"].item() == pytest.approx(dropped)
