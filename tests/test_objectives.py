"""Objectives: noising formulas, and that each objective's sampling scheduler inverts its own noising.

The round-trip test is the one that catches convention mismatches (σ vs 1 − σ, timestep scale, target sign): an
oracle that knows the single data point answers exactly what a perfectly trained model would, given only what the
sampler passes it (x_t and the timestep), and sampling must land on that data point.
"""

import pytest
import torch

from imba.objectives import DDPMEpsilon, RectifiedFlow, build_objective


def test_flow_noising_is_the_straight_path_with_velocity_target():
    obj = RectifiedFlow()
    x0 = torch.randn(4, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    batch = obj.noise(x0, generator=torch.Generator().manual_seed(1))
    sigma = (batch.timesteps / 1000).view(4, 1, 1, 1)
    noise = batch.target + x0  # target = ε − x0
    torch.testing.assert_close(batch.noisy, (1 - sigma) * x0 + sigma * noise)
    assert ((batch.timesteps > 0) & (batch.timesteps < 1000)).all()


def test_flow_sigmas_are_logit_normal_and_shift_moves_them_to_noise():
    g = torch.Generator().manual_seed(0)
    sigmas = RectifiedFlow().sample_sigmas(20000, generator=g)
    assert abs(sigmas.median().item() - 0.5) < 0.02  # logit-normal(0, 1) has median 0.5
    shifted = RectifiedFlow(shift=3.0).sample_sigmas(20000, generator=torch.Generator().manual_seed(0))
    assert abs(shifted.median().item() - 0.75) < 0.02  # 3·0.5 / (1 + 2·0.5)


def test_ddpm_noising_matches_the_closed_form():
    obj = DDPMEpsilon()
    x0 = torch.randn(4, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    batch = obj.noise(x0, generator=torch.Generator().manual_seed(1))
    abar = obj.noise_scheduler.alphas_cumprod[batch.timesteps].view(4, 1, 1, 1)
    torch.testing.assert_close(batch.noisy, abar.sqrt() * x0 + (1 - abar).sqrt() * batch.target)
    assert batch.timesteps.dtype == torch.int64


def _sample_with_oracle(scheduler, x0, oracle, steps=30):
    scheduler.set_timesteps(steps)
    x = torch.randn(x0.shape, generator=torch.Generator().manual_seed(2)) * scheduler.init_noise_sigma
    for t in scheduler.timesteps:
        x = scheduler.step(oracle(scheduler.scale_model_input(x, t), t), t, x).prev_sample
    return x


def test_flow_sampler_inverts_flow_noising():
    x0 = torch.randn(1, 4, 4, 4, generator=torch.Generator().manual_seed(0))

    def oracle(x_t, t):  # the exact velocity ε − x0 for a point mass at x0, from what the sampler provides
        sigma = t.float() / 1000
        return (x_t - x0) / sigma

    out = _sample_with_oracle(RectifiedFlow().sampling_scheduler(), x0, oracle)
    torch.testing.assert_close(out, x0, atol=1e-3, rtol=1e-3)


def test_ddpm_sampler_inverts_ddpm_noising():
    obj = DDPMEpsilon()
    x0 = torch.randn(1, 4, 4, 4, generator=torch.Generator().manual_seed(0))
    abar = obj.noise_scheduler.alphas_cumprod

    def oracle(x_t, t):  # the exact ε for a point mass at x0
        a = abar[int(t)]
        return (x_t - a.sqrt() * x0) / (1 - a).sqrt()

    out = _sample_with_oracle(obj.sampling_scheduler(), x0, oracle)
    torch.testing.assert_close(out, x0, atol=1e-3, rtol=1e-3)


def test_unknown_objective_names_choices():
    with pytest.raises(ValueError, match="ddpm, flow"):
        build_objective("edm")
