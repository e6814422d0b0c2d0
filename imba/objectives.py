"""Training objectives: how clean latents become (noisy input, timestep, regression target).

Two objectives, both usable with every loss in `imba.loss`:

- `DDPMEpsilon`: the PixArt / Stable Diffusion objective. Noising through diffusers' `DDPMScheduler`
  (PixArt's linear beta schedule by default), integer timesteps uniform in [0, T), target = the noise ε.
- `RectifiedFlow`: x_t = (1 − σ)·x0 + σ·ε with σ drawn logit-normal (SD3), target = the velocity ε − x0,
  model timestep = σ·T.

Each objective also builds the diffusers scheduler used to *sample* from a model trained with it; that scheduler is
what the exported pipeline carries, so a stock `PixArtAlphaPipeline` samples correctly from either.

diffusers is imported where a scheduler is built, not with the module: `NoisedBatch` and `RectifiedFlow`'s noising
need torch alone, like the rest of what `imba` offers a training loop of its own (the light install).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from diffusers import DPMSolverMultistepScheduler


@dataclass
class NoisedBatch:
    noisy: torch.Tensor  # x_t, (B, C, H, W)
    timesteps: torch.Tensor  # (B,), what the DiT receives as `timestep`
    target: torch.Tensor  # regression target, (B, C, H, W)
    # (B,) signal-to-noise ratio ᾱ_t / (1 − ᾱ_t) of each row's noise level where the target is the noise ε (what
    # min-SNR weighting reads, `loss.min_snr_gamma`); None for other targets
    snr: torch.Tensor | None = None




class DDPMEpsilon:
    """ε-prediction on a discrete DDPM schedule (PixArt-α: linear betas 1e-4 → 0.02, T = 1000)."""

    name = "ddpm"
    predicts_epsilon = True  # what min-SNR weighting (loss.min_snr_gamma) is defined for

    def __init__(self, num_train_timesteps: int = 1000, beta_schedule: str = "linear",
                 beta_start: float = 0.0001, beta_end: float = 0.02):
        from diffusers import DDPMScheduler

        self.noise_scheduler = DDPMScheduler(
            num_train_timesteps=num_train_timesteps, beta_schedule=beta_schedule,
            beta_start=beta_start, beta_end=beta_end, prediction_type="epsilon",
        )

    @property
    def num_train_timesteps(self) -> int:
        return self.noise_scheduler.config.num_train_timesteps

    def noise(self, latents: torch.Tensor, generator: torch.Generator | None = None) -> NoisedBatch:
        b = latents.shape[0]
        noise = torch.randn(latents.shape, generator=generator, dtype=latents.dtype, device=latents.device)
        t = torch.randint(0, self.num_train_timesteps, (b,), generator=generator,
                          device=latents.device)
        noisy = self.noise_scheduler.add_noise(latents, noise, t)
        from diffusers.training_utils import compute_snr

        return NoisedBatch(noisy=noisy, timesteps=t, target=noise, snr=compute_snr(self.noise_scheduler, t))

    def sampling_scheduler(self) -> DPMSolverMultistepScheduler:
        from diffusers import DPMSolverMultistepScheduler

        cfg = self.noise_scheduler.config
        return DPMSolverMultistepScheduler(
            num_train_timesteps=cfg.num_train_timesteps, beta_schedule=cfg.beta_schedule,
            beta_start=cfg.beta_start, beta_end=cfg.beta_end, prediction_type="epsilon",
        )


class RectifiedFlow:
    """Velocity prediction on the straight path from data (σ = 0) to noise (σ = 1).

    σ = sigmoid(n), n ~ N(logit_mean, logit_std²) (logit-normal, as in SD3), then optionally shifted towards noise
    with σ' = s·σ / (1 + (s − 1)·σ) — the same shift the sampling scheduler applies, so train and sample agree.
    """

    name = "flow"
    predicts_epsilon = False

    def __init__(self, num_train_timesteps: int = 1000, logit_mean: float = 0.0, logit_std: float = 1.0,
                 shift: float = 1.0):
        if shift <= 0:
            raise ValueError(f"RectifiedFlow: shift={shift} must be > 0")
        self.num_train_timesteps = num_train_timesteps
        self.logit_mean = logit_mean
        self.logit_std = logit_std
        self.shift = shift

    def sample_sigmas(self, n: int, generator=None, device=None) -> torch.Tensor:
        normal = torch.randn((n,), generator=generator, device=device)
        sigmas = torch.sigmoid(self.logit_mean + self.logit_std * normal)
        return self.shift * sigmas / (1 + (self.shift - 1) * sigmas)

    def noise(self, latents: torch.Tensor, generator: torch.Generator | None = None) -> NoisedBatch:
        b = latents.shape[0]
        noise = torch.randn(latents.shape, generator=generator, dtype=latents.dtype, device=latents.device)
        sigmas = self.sample_sigmas(b, generator=generator, device=latents.device).to(latents.dtype)
        s = sigmas.view(b, 1, 1, 1)
        noisy = (1 - s) * latents + s * noise
        return NoisedBatch(noisy=noisy, timesteps=sigmas * self.num_train_timesteps, target=noise - latents)

    def sampling_scheduler(self) -> DPMSolverMultistepScheduler:
        # DPM-Solver++ in its flow mode: has everything PixArtAlphaPipeline calls (init_noise_sigma,
        # scale_model_input), unlike FlowMatchEulerDiscreteScheduler, and treats the output as ε − x0.
        from diffusers import DPMSolverMultistepScheduler

        return DPMSolverMultistepScheduler(
            num_train_timesteps=self.num_train_timesteps, prediction_type="flow_prediction",
            use_flow_sigmas=True, flow_shift=self.shift,
        )


OBJECTIVES = {"flow": RectifiedFlow, "ddpm": DDPMEpsilon}


def build_objective(name: str, **kwargs):
    """'ddpm' or 'flow' → an objective; kwargs are passed to its constructor."""
    if name not in OBJECTIVES:
        raise ValueError(f"unknown objective {name!r}; choose one of {', '.join(sorted(OBJECTIVES))}")
    return OBJECTIVES[name](**kwargs)
