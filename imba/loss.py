"""The IMBA loss (arXiv 2507.13345) and the plain diffusion loss it is compared with.

Both losses take plain tensors, so they can be dropped into any diffusion training loop:

    loss_fn = IMBALoss(gamma=0.8, lam=0.9, patch_size=2)
    loss, stats = loss_fn(pred_cond, pred_uncond, target)

Shapes are (B, C, H, W) latents; a *token* is one DiT patch: a patch_size × patch_size square of latent pixels
across all channels. The method, as this project implements it (docs/method.md):

    d   = per-token distance between the reference (target, or the conditional prediction) and pred_uncond
    D   = stopgrad(d) ** gamma                      (optionally normalised by its batch mean, or by its running
                                                     mean in the sample's timestep bin)
    L*  = mean over tokens of D · mse_token(target, pred_cond)
    L_u = mean of (target − pred_uncond)²           (gradient flows into the unconditional prediction)
    L   = lam · L* + (1 − lam) · L_u
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

GRANULARITIES = ("token", "sample")
DISTANCES = ("mse", "l1", "l2")
REFERENCES = ("target", "cond")
NORMALIZATIONS = ("none", "batch_mean", "timestep_mean")


class LossSettingError(ValueError):
    """A loss setting outside what it accepts; `setting` names it, `problem` says what it must be."""

    def __init__(self, setting: str, problem: str) -> None:
        super().__init__(f"IMBALoss: {setting} {problem}")
        self.setting, self.problem = setting, problem


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise LossSettingError(name, f"must be one of {', '.join(choices)}, got {value!r}")


def _at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """Loss arithmetic in float32 even under bf16/fp16 autocast; float64 inputs stay float64."""
    return x if x.dtype == torch.float64 else x.float()


def patchify(x: torch.Tensor, patch_size: int) -> torch.Tensor:
    """(B, C, H, W) -> (B, N, C·p·p): one row per DiT token, in the DiT's row-major token order."""
    b, c, h, w = x.shape
    p = patch_size
    if h % p or w % p:
        raise ValueError(f"latent size {h}x{w} is not divisible by patch_size={p}")
    x = x.reshape(b, c, h // p, p, w // p, p)
    return x.permute(0, 2, 4, 1, 3, 5).reshape(b, (h // p) * (w // p), c * p * p)


def token_distance(reference: torch.Tensor, other: torch.Tensor, patch_size: int, kind: str = "mse") -> torch.Tensor:
    """Per-token distance between two (B, C, H, W) tensors, shape (B, N)."""
    _check_choice("distance", kind, DISTANCES)
    diff = patchify(_at_least_fp32(reference) - _at_least_fp32(other), patch_size)
    if kind == "mse":
        return diff.pow(2).mean(dim=-1)
    if kind == "l1":
        return diff.abs().mean(dim=-1)
    return diff.pow(2).sum(dim=-1).sqrt()


class TimestepMean:
    """Running mean of the IMBA weight per timestep bin, to divide D by (`normalize="timestep_mean"`).

    The distance's size changes with the noise level by orders of magnitude, so without it D mostly re-weights
    timesteps rather than concepts, and a batch mean is dominated by the noisiest samples. Dividing by the mean D of
    the sample's own timestep bin leaves only the emphasis across samples and tokens at the same noise level.

    Timesteps are the DiT's (0 to `num_train_timesteps`), split into `bins` equal bins. Each bin's mean is an
    exponential moving average of the per-sample mean weight (the first observation sets it) and is updated with
    the current batch before dividing, so the first steps are normalised too. The state is small (`state_dict`):
    save it with the checkpoint for an exact resume.

    `reduce`: with several processes, a function that sums a tensor over them in place (an all-reduce); the
    per-bin sums and counts then cover the global batch and every process keeps the same means. Without it each
    process keeps its own.
    """

    def __init__(self, bins: int = 10, momentum: float = 0.99, num_train_timesteps: int = 1000,
                 reduce: Callable[[torch.Tensor], object] | None = None) -> None:
        if bins < 1 or not 0.0 <= momentum < 1.0 or num_train_timesteps <= 0:
            raise LossSettingError("timestep_mean", "needs bins >= 1, 0 <= momentum < 1 and num_train_timesteps > 0")
        self.bins, self.momentum, self.num_train_timesteps = bins, momentum, num_train_timesteps
        self.reduce = reduce
        self.means = torch.ones(bins, dtype=torch.float64)
        self.seen = torch.zeros(bins, dtype=torch.bool)

    def bin_of(self, timesteps: torch.Tensor) -> torch.Tensor:
        return (timesteps.double() / self.num_train_timesteps * self.bins).long().clamp(0, self.bins - 1)

    def __call__(self, weight: torch.Tensor, timesteps: torch.Tensor, valid: torch.Tensor | None = None
                 ) -> torch.Tensor:
        """weight (B, N) divided by the running mean of its row's timestep bin, after updating the means with the
        rows marked `valid` (all rows by default)."""
        self.means, self.seen = self.means.to(weight.device), self.seen.to(weight.device)
        bins = self.bin_of(timesteps.to(weight.device))
        rows = weight.double().mean(dim=1)
        use = torch.isfinite(rows) if valid is None else valid & torch.isfinite(rows)  # a bad step must not
        # poison the means: the divergence guard skips it, and later steps must see the means from before it
        zeros = torch.zeros(self.bins, dtype=torch.float64, device=weight.device)
        totals = torch.stack([zeros.index_add(0, bins[use], rows[use]),
                              zeros.index_add(0, bins[use], torch.ones_like(rows[use]))])
        if self.reduce is not None:
            self.reduce(totals)
        sums, counts = totals
        present = counts > 0
        batch = sums / counts.clamp_min(1)
        blended = torch.where(self.seen, self.momentum * self.means + (1 - self.momentum) * batch, batch)
        self.means = torch.where(present, blended, self.means)
        self.seen = self.seen | present
        scale = self.means[bins].clamp_min(torch.finfo(torch.float64).tiny).to(weight.dtype)
        return weight / scale[:, None]

    def state_dict(self) -> dict:
        return {"means": self.means.cpu().clone(), "seen": self.seen.cpu().clone()}

    def load_state_dict(self, state: dict) -> None:
        if state["means"].shape != (self.bins,):
            raise ValueError(f"TimestepMean: saved state has {state['means'].shape[0]} bins, this loss {self.bins}")
        self.means, self.seen = state["means"].clone(), state["seen"].clone()


@dataclass
class IMBALoss:
    """Token-level (or sample-level) IMBA loss. Call it with (pred_cond, pred_uncond, target).

    gamma:       exponent of the weight; 0 gives the plain λ-mixed MSE, 2 is known to shift colours.
    lam:         weight of the conditional term; 1 − lam plays the role of caption dropout.
    patch_size:  DiT patch size; the weight is constant over one patch.
    granularity: "token" (one weight per patch) or "sample" (one weight per sample: mean of d over its tokens).
    distance:    "mse" (mean square over the token's values), "l1" (mean absolute) or "l2" (Euclidean norm).
    reference:   "target" (the paper's form: distance from the regression target) or "cond" (distance from the
                 detached conditional prediction; keeps the optimum at the true conditional mean, docs/method.md).
    normalize:   "none", "batch_mean" (divide D by its mean over the batch, so the loss scale stays put) or
                 "timestep_mean" (divide D by its running mean in the sample's timestep bin, `TimestepMean`; the
                 call then needs `timesteps`).
    """

    gamma: float = 0.8
    lam: float = 0.9
    patch_size: int = 2
    granularity: str = "token"
    distance: str = "mse"
    reference: str = "target"
    normalize: str = "none"
    timestep_bins: int = 10
    timestep_momentum: float = 0.99
    num_train_timesteps: int = 1000
    timestep_reduce: Callable[[torch.Tensor], object] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_choice("granularity", self.granularity, GRANULARITIES)
        _check_choice("distance", self.distance, DISTANCES)
        _check_choice("reference", self.reference, REFERENCES)
        _check_choice("normalize", self.normalize, NORMALIZATIONS)
        if not 0.0 <= self.lam <= 1.0:
            raise LossSettingError("lam", f"must lie in [0, 1], got {self.lam}")
        if self.gamma < 0:
            raise LossSettingError("gamma", f"must be >= 0, got {self.gamma}")
        if self.patch_size < 1:
            raise LossSettingError("patch_size", f"must be >= 1, got {self.patch_size}")
        self.timestep_mean = (TimestepMean(self.timestep_bins, self.timestep_momentum, self.num_train_timesteps,
                                           self.timestep_reduce) if self.normalize == "timestep_mean" else None)

    def weights(self, pred_cond: torch.Tensor, pred_uncond: torch.Tensor, target: torch.Tensor,
                valid: torch.Tensor | None = None, timesteps: torch.Tensor | None = None):
        """Return (D, d): the detached weight per token (B, N) and the raw distance per token (B, N).

        `valid` (bool, (B,)) marks the rows whose D is defined; the normalisations use those rows only.
        `timesteps` (B,) are required by `timestep_mean`.
        """
        if self.timestep_mean is not None and timesteps is None:
            raise ValueError("IMBALoss: normalize='timestep_mean' needs the batch's timesteps")
        reference = target if self.reference == "target" else pred_cond
        with torch.no_grad():
            d = token_distance(reference.detach(), pred_uncond.detach(), self.patch_size, self.distance)
            if self.granularity == "sample":
                weight = d.mean(dim=1, keepdim=True).expand_as(d)
            else:
                weight = d
            weight = weight.pow(self.gamma)
            if self.normalize == "batch_mean":
                mean = weight.mean() if valid is None else weight[valid].mean()
                weight = weight / mean.clamp_min(torch.finfo(weight.dtype).tiny)
            elif self.timestep_mean is not None:
                weight = self.timestep_mean(weight, timesteps, valid)
        return weight, d

    def __call__(self, pred_cond: torch.Tensor, pred_uncond: torch.Tensor, target: torch.Tensor,
                 drop: torch.Tensor | None = None, timesteps: torch.Tensor | None = None):
        """The loss and its stats. Without `drop`: the literal form (every row contributes λ·L* + (1 − λ)·L_u).

        With `drop` (bool, (B,), drawn by `draw_drop_mask`): the efficient, unbiased form. Dropped rows contribute
        only their L_u term (pred_uncond must carry the gradient there; pred_cond is ignored); kept rows contribute
        only their L* term (pred_uncond may come from a no-grad pass: it only sets D). Every per-row term is
        divided by B, so over drop ~ Bernoulli(1 − λ) the expected loss and gradient equal the literal form's.
        With reference="cond", D exists only on kept rows, and the normalisations use only them.
        `timesteps` (B,): the DiT timestep of each row, needed by normalize="timestep_mean".
        """
        if not (pred_cond.shape == pred_uncond.shape == target.shape) or pred_cond.dim() != 4:
            raise ValueError(
                "IMBALoss expects pred_cond, pred_uncond and target of one shape (B, C, H, W); got "
                f"{tuple(pred_cond.shape)}, {tuple(pred_uncond.shape)}, {tuple(target.shape)}"
            )
        b = target.shape[0]
        if drop is not None and (drop.shape != (b,) or drop.dtype != torch.bool):
            raise ValueError(f"IMBALoss: drop must be a bool tensor of shape ({b},), got {drop.dtype} {tuple(drop.shape)}")
        keep = None if drop is None else ~drop
        valid = keep if (drop is not None and self.reference == "cond") else None
        weight, d = self.weights(pred_cond, pred_uncond, target, valid, timesteps)
        cond_err = token_distance(target, pred_cond, self.patch_size, "mse")  # (B, N), carries grad
        cond_term = (weight * cond_err).mean(dim=1)  # per sample: mean over tokens of D · error
        uncond_term = (_at_least_fp32(pred_uncond) - _at_least_fp32(target)).pow(2).flatten(1).mean(dim=1)
        if drop is None:
            loss = self.lam * cond_term.mean() + (1.0 - self.lam) * uncond_term.mean()
            loss_cond, valid_rows = cond_term.detach().mean(), slice(None)
        else:
            loss = torch.where(drop, uncond_term, cond_term).mean()
            loss_cond = (cond_term.detach() * keep).sum() / keep.sum().clamp_min(1)
            valid_rows = slice(None) if valid is None else valid
        valid_weight, valid_d = weight[valid_rows], d[valid_rows]
        if valid_weight.numel() == 0:  # reference="cond" and every row dropped: no weight defined this batch
            valid_weight = valid_d = weight.new_full((1,), float("nan"))
        stats = {
            "loss": loss.detach(),
            "loss_cond_weighted": loss_cond,
            # every row has an unconditional prediction (with or without grad): the mean over all is the estimate
            "loss_uncond": uncond_term.detach().mean(),
            "loss_cond_plain": cond_err.detach()[keep if keep is not None else slice(None)].mean(),
            "weight_mean": valid_weight.mean(),
            "weight_std": valid_weight.std(unbiased=False),
            "weight_max": valid_weight.max(),
            "distance_mean": valid_d.mean(),
            # per-sample distance, for monitors that bucket samples by concept frequency (NaN where undefined)
            "distance_per_sample": d.mean(dim=1) if valid is None else d.mean(dim=1).masked_fill(~valid, float("nan")),
            # the same per token (B, N), for monitors that look at parts of an image
            "distance_per_token": d if valid is None else d.masked_fill(~valid[:, None], float("nan")),
            # per-sample conditional error (unweighted), NaN on rows that had no conditional prediction
            "loss_cond_per_sample": (cond_err.detach().mean(dim=1) if drop is None
                                     else cond_err.detach().mean(dim=1).masked_fill(drop, float("nan"))),
        }
        if drop is not None:
            stats["caption_dropout_rate"] = drop.float().mean()
        return loss, stats

    def draw_drop_mask(self, batch_size: int, generator: torch.Generator | None = None, device=None) -> torch.Tensor:
        """Rows that train the unconditional term in the efficient form: each dropped with probability 1 − λ."""
        return torch.rand((batch_size,), generator=generator, device=device) < (1.0 - self.lam)


def plain_loss(pred: torch.Tensor, target: torch.Tensor, sample_weights: torch.Tensor | None = None):
    """Plain diffusion MSE (the baseline; its caption dropout happens before the forward pass).

    `sample_weights` (B,) scale each sample's MSE: offline re-balancing, e.g. by inverse concept frequency (the
    baseline IMBA is compared with). Weights are used as given, so normalise them to mean 1 over the data set to
    keep the loss scale.
    """
    per_sample = (_at_least_fp32(pred) - _at_least_fp32(target)).pow(2).flatten(1).mean(dim=1)
    if sample_weights is None:
        loss = per_sample.mean()
    else:
        if sample_weights.shape != per_sample.shape:
            raise ValueError(f"plain_loss: sample_weights must have shape {tuple(per_sample.shape)}, "
                             f"got {tuple(sample_weights.shape)}")
        loss = (sample_weights.to(per_sample.dtype) * per_sample).mean()
    return loss, {"loss": loss.detach(), "loss_per_sample": per_sample.detach()}
