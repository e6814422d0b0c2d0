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

The efficient form (`drop=`), the per-sample weights (`sample_weights=`, e.g. min-SNR), the running state and what
each stat means: docs/loss.md. Every input the loss cannot use correctly is refused with a one-line ValueError that
says what to pass instead.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable, Union

import torch

from imba.choices import DISTANCES, NORMALIZATIONS, REFERENCES, LossSettingError

GRANULARITIES = ("token", "sample")
STATE_FILE = "imba_loss.pt"  # the loss's file in an accelerate checkpoint folder (`IMBALoss.checkpoint_with`)
STATS_PREFIX = "imba/"  # before each logged stat's name, so none collides with a script's own `loss` key
_EFFICIENT_DROP = "_imba_efficient_drop"  # the attribute by which `efficient_uncond`'s tensor names its drop mask


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


def _sum_over_processes(totals: torch.Tensor) -> None:
    """All-reduce (sum, in place) over the processes of torch.distributed's default group, if one is running."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(totals)


Reduce = Union[Callable[[torch.Tensor], object], str, None]


class TimestepMean:
    """Running mean of the IMBA weight per timestep bin, to divide D by (`normalize="timestep_mean"`).

    The distance's size changes with the noise level by orders of magnitude, so without it D mostly re-weights
    timesteps rather than concepts, and a batch mean is dominated by the noisiest samples. Dividing by the mean D of
    the sample's own timestep bin leaves only the emphasis across samples and tokens at the same noise level.

    Timesteps are the DiT's (0 to `num_train_timesteps`), split into `bins` equal bins. Each bin's mean is an
    exponential moving average of the per-sample mean weight (the first observation sets it) and is updated with
    the current batch before dividing, so the first steps are normalised too. The state is small (`state_dict`):
    save it with the checkpoint for an exact resume.

    `reduce`: how the per-bin sums and counts are summed over processes, so that they cover the global batch and
    every process keeps the same means. "auto" (default): an all-reduce over torch.distributed's default group when
    one is initialised with more than one process, nothing otherwise; every process must then call the loss equally
    often, as a training step does. A function that sums a tensor in place over the processes; or None: each process
    keeps its own means.
    """

    def __init__(self, bins: int = 10, momentum: float = 0.99, num_train_timesteps: int = 1000,
                 reduce: Reduce = "auto") -> None:
        if bins < 1 or not 0.0 <= momentum < 1.0 or num_train_timesteps <= 0:
            raise LossSettingError("timestep_mean", "needs bins >= 1, 0 <= momentum < 1 and num_train_timesteps > 0")
        if isinstance(reduce, str) and reduce != "auto":
            raise LossSettingError("timestep_reduce", f"must be 'auto', None or an all-reduce function, got {reduce!r}")
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
        reduce = _sum_over_processes if isinstance(self.reduce, str) else self.reduce
        if reduce is not None:
            reduce(totals)
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


class LossStats(dict):
    """A loss's statistics, ready to log as they are: the mapping holds scalars only (detached 0-d tensors), and the
    per-sample (B,) and per-token (B, N) tensors are in `tensors`.

    Iterating, `items()`, `len()` and `dict(stats)` see the scalars; a tensor is still found by name
    (`stats["distance_per_sample"]`, `"distance_per_token" in stats`). `floats()` reads every scalar off the device
    in one transfer, for `accelerator.log` and progress bars. Assigning a tensor with dimensions (`stats[k] = t`)
    files it under `tensors`.
    """

    def __init__(self, scalars=(), tensors: dict | None = None) -> None:
        super().__init__()
        self.tensors: dict[str, torch.Tensor] = {}
        for name, value in dict(scalars).items():
            self[name] = value
        for name, value in (tensors or {}).items():
            self.tensors[name] = value

    def __setitem__(self, name: str, value) -> None:
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            self.tensors[name] = value
            dict.pop(self, name, None)
        else:
            dict.__setitem__(self, name, value)

    def __missing__(self, name: str):
        if name in self.tensors:
            return self.tensors[name]
        raise KeyError(name)

    def __contains__(self, name) -> bool:
        return dict.__contains__(self, name) or name in self.tensors

    def get(self, name: str, default=None):
        return self[name] if name in self else default

    def floats(self) -> dict[str, float]:
        """{name: float} of the scalars (NaN where a statistic is undefined for the batch)."""
        if not self:
            return {}
        device = next((v.device for v in self.values() if isinstance(v, torch.Tensor)), torch.device("cpu"))
        dtype = torch.float32 if device.type == "mps" else torch.float64
        values = torch.stack([v.detach().reshape(()).to(device=device, dtype=dtype) if isinstance(v, torch.Tensor)
                              else torch.tensor(float(v), device=device, dtype=dtype) for v in self.values()])
        return dict(zip(self, values.tolist()))

    def __repr__(self) -> str:
        shapes = ", ".join(f"{k}: {tuple(v.shape)}" for k, v in self.tensors.items())
        return f"LossStats({dict.__repr__(self)}, tensors={{{shapes}}})"


def _check_channels(name: str, pred: torch.Tensor, reference: torch.Tensor, reference_name: str = "target") -> None:
    """A prediction with other channels than the target: most often a learned variance (2 × the latent channels)."""
    if pred.dim() != 4 or reference.dim() != 4 or pred.shape[1] == reference.shape[1]:
        return
    c = reference.shape[1]
    hint = (f"the model also predicts its variance (learned sigma): pass {name}[:, :{c}] "
            "(e.g. model_pred.chunk(2, dim=1)[0])" if pred.shape[1] == 2 * c else "they must be the same")
    raise ValueError(f"IMBALoss: {name} has {pred.shape[1]} channels and {reference_name} {c}: {hint}")


def _unwrapped(model):
    """The model inside DDP, DeepSpeed's engine or torch.compile."""
    seen = set()
    while id(model) not in seen:
        seen.add(id(model))
        inner = getattr(model, "module", None)
        if inner is None:
            inner = getattr(model, "_orig_mod", None)
        if inner is None:
            break
        model = inner
    return model


def transformer_patch_size(transformer) -> int:
    """`config.patch_size` of a diffusers transformer (bare, or wrapped by DDP, DeepSpeed or torch.compile)."""
    model = _unwrapped(transformer)
    config = getattr(model, "config", None)
    size = config.get("patch_size") if isinstance(config, dict) else getattr(config, "patch_size", None)
    if not isinstance(size, int):
        raise LossSettingError("patch_size", f"cannot be read from {type(model).__name__} (no integer "
                                             "config.patch_size): pass IMBALoss(patch_size=...) yourself")
    return size


@dataclass
class IMBALoss:
    """Token-level (or sample-level) IMBA loss. Call it with (pred_cond, pred_uncond, target).

    gamma:       exponent of the weight; 0 gives the plain λ-mixed MSE, 2 is known to shift colours.
    lam:         weight of the conditional term; 1 − lam is the caption dropout: it replaces the script's own
                 (empty-prompt dropout must then be 0), and the efficient form draws it (`draw_drop_mask`).
    patch_size:  DiT patch size; the weight is constant over one patch. `IMBALoss.for_transformer(transformer)`
                 reads it from a diffusers transformer's config.
    granularity: "token" (one weight per patch) or "sample" (one weight per sample: mean of d over its tokens).
    distance:    "mse" (mean square over the token's values), "l1" (mean absolute) or "l2" (Euclidean norm).
    reference:   "target" (the paper's form: distance from the regression target) or "cond" (distance from the
                 detached conditional prediction; keeps the optimum at the true conditional mean, docs/method.md).
    normalize:   "none", "batch_mean" (divide D by its mean over the batch, so the loss scale stays put) or
                 "timestep_mean" (divide D by its running mean in the sample's timestep bin, `TimestepMean`; the
                 call then needs `timesteps`, and the means are the loss's only running state: `state_dict`, and
                 `loss_fn.checkpoint_with(accelerator)` saves them with `accelerator.save_state`).
    num_train_timesteps: the timesteps' range for the bins, 0 to this (integers below it; floats up to it, as a
                 flow schedule's σ = 1 gives exactly this); 1 declares a schedule whose timesteps are t in [0, 1]
                 (otherwise floating timesteps all in [0, 1] are refused as a likely mistake).
    timestep_reduce: how the timestep means are summed over processes: "auto" (an all-reduce when a
                 torch.distributed process group is initialised), a function, or None (per-process means).
    stats_prefix: put before the name of each scalar stat ("imba/loss", ...), so that logging the stats next to a
                 script's own `loss` overwrites nothing; "" for the bare names.
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
    timestep_reduce: Reduce = field(default="auto", repr=False, compare=False)
    stats_prefix: str = field(default=STATS_PREFIX, repr=False, compare=False)

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
        if isinstance(self.timestep_reduce, str) and self.timestep_reduce != "auto":
            raise LossSettingError("timestep_reduce",
                                   f"must be 'auto', None or an all-reduce function, got {self.timestep_reduce!r}")
        self.timestep_mean = (TimestepMean(self.timestep_bins, self.timestep_momentum, self.num_train_timesteps,
                                           self.timestep_reduce) if self.normalize == "timestep_mean" else None)
        self._first_timesteps_checked = False

    @classmethod
    def for_transformer(cls, transformer, **settings) -> "IMBALoss":
        """The loss with the patch size of `transformer`, a diffusers DiT (bare or wrapped by DDP, DeepSpeed or
        torch.compile); `settings` are the other fields."""
        size = transformer_patch_size(transformer)
        if settings.get("patch_size", size) != size:
            raise LossSettingError("patch_size", f"is {settings['patch_size']}, but the transformer's config has "
                                                 f"patch_size={size}: leave it out")
        return cls(**{**settings, "patch_size": size})

    def check_transformer(self, transformer) -> None:
        """Refuses a transformer whose tokens are not this loss's (another `config.patch_size`)."""
        size = transformer_patch_size(transformer)
        if size != self.patch_size:
            raise LossSettingError("patch_size", f"is {self.patch_size}, but the transformer's config has "
                                                 f"patch_size={size}: build the loss with "
                                                 "IMBALoss.for_transformer(transformer, ...)")

    def state_dict(self) -> dict:
        """The running state: the per-bin means of normalize="timestep_mean", empty otherwise."""
        return {} if self.timestep_mean is None else {"timestep_mean": self.timestep_mean.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        foreign = sorted(map(str, set(state) - {"timestep_mean"})) if isinstance(state, dict) else None
        if foreign is None or foreign:
            found = type(state).__name__ if foreign is None else f"keys {', '.join(foreign)}"
            raise ValueError(f"IMBALoss: the saved state ({found}) is not an IMBALoss's, most likely another object "
                             "registered for checkpointing in its place: register the objects in the order they "
                             "were saved, or use loss_fn.checkpoint_with(accelerator)")
        saved = "timestep_mean" in state
        if self.timestep_mean is None and saved:
            raise ValueError(f"IMBALoss: the saved state holds timestep means but this loss has "
                             f"normalize={self.normalize!r}: build it with normalize='timestep_mean' to resume it")
        if self.timestep_mean is not None:
            if not saved:
                raise ValueError("IMBALoss: the saved state holds no timestep means (it comes from a loss without "
                                 "normalize='timestep_mean'): build the loss as it was saved")
            self.timestep_mean.load_state_dict(state["timestep_mean"])

    def checkpoint_with(self, accelerator):
        """Make `accelerator.save_state` save the loss's running state and `load_state` restore it, in a file of
        its own in the checkpoint folder (`imba_loss.pt`, written by the main process), whatever else the script
        registers. A checkpoint without that file (one saved before IMBA was added) loads as it is, and the loss
        starts fresh. Call it once at set-up, before any `load_state`; returns the two hooks' handles (`.remove()`
        undoes it)."""
        def save(models, weights, output_dir):
            accelerator.save(self.state_dict(), os.path.join(output_dir, STATE_FILE))

        def load(models, input_dir):
            path = os.path.join(input_dir, STATE_FILE)
            if os.path.exists(path):
                self.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))

        return accelerator.register_save_state_pre_hook(save), accelerator.register_load_state_pre_hook(load)

    def _check_timesteps(self, timesteps: torch.Tensor) -> None:
        """Refuses timesteps outside the bins' range (0 to num_train_timesteps: integers below it, floats up to
        it), and a first batch of floating timesteps all in [0, 1] with some not whole (a flow schedule's t or σ
        where the transformer's t·T belong) unless the loss declares that range (num_train_timesteps=1). The first
        batch is read, and every batch on the CPU: a wrong scale is in the script, not in one batch, and reading
        every batch on an accelerator would wait on the device at every step."""
        if self._first_timesteps_checked and timesteps.device.type != "cpu":
            return
        total = self.num_train_timesteps
        t = timesteps.double()
        above = t > total if timesteps.is_floating_point() else t >= total
        if bool((~torch.isfinite(t) | (t < 0) | above).any()):
            top = total if timesteps.is_floating_point() else total - 1
            raise ValueError(f"IMBALoss: timesteps range from {t.min().item():g} to {t.max().item():g}, outside the "
                             f"0 to {top} that the timestep bins of num_train_timesteps={total} split: build the loss "
                             "with the scheduler's num_train_timesteps and pass the timesteps the transformer receives")
        if not self._first_timesteps_checked and timesteps.is_floating_point() and total > 1:
            if bool(((timesteps >= 0) & (timesteps <= 1)).all() & (timesteps.frac() != 0).any()):
                raise ValueError(f"IMBALoss: timesteps are floats in [0, 1], but the timestep bins span 0 to "
                                 f"num_train_timesteps={total}: pass the transformer's timesteps (e.g. sigmas * "
                                 f"{total}), or, for timesteps that are t in [0, 1], build the loss with "
                                 "num_train_timesteps=1")
        self._first_timesteps_checked = True

    def weights(self, pred_cond: torch.Tensor, pred_uncond: torch.Tensor, target: torch.Tensor,
                valid: torch.Tensor | None = None, timesteps: torch.Tensor | None = None):
        """Return (D, d): the detached weight per token (B, N) and the raw distance per token (B, N).

        `valid` (bool, (B,)) marks the rows whose D is defined; the normalisations use those rows only.
        `timesteps` (B,) are required by `timestep_mean`.
        """
        if self.timestep_mean is not None:
            if timesteps is None:
                raise ValueError("IMBALoss: normalize='timestep_mean' needs the batch's timesteps")
            self._check_timesteps(timesteps)
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

    def _check_call(self, pred_cond, pred_uncond, target, drop, timesteps, sample_weights) -> None:
        _check_channels("pred_cond", pred_cond, target)
        _check_channels("pred_uncond", pred_uncond, target)
        if not (pred_cond.shape == pred_uncond.shape == target.shape) or pred_cond.dim() != 4:
            raise ValueError(
                "IMBALoss expects pred_cond, pred_uncond and target of one shape (B, C, H, W); got "
                f"{tuple(pred_cond.shape)}, {tuple(pred_uncond.shape)}, {tuple(target.shape)}"
            )
        b = target.shape[0]
        if drop is not None and (drop.shape != (b,) or drop.dtype != torch.bool):
            raise ValueError(f"IMBALoss: drop must be a bool tensor of shape ({b},), got {drop.dtype} {tuple(drop.shape)}")
        # the efficient form's pred_uncond is only right with its own mask: without drop= the loss would read it as
        # the literal form's, and its gradient on the dropped rows would pass the check below
        marked = getattr(pred_uncond, _EFFICIENT_DROP, None)
        if marked is not None and drop is None:
            raise ValueError("IMBALoss: pred_uncond comes from efficient_uncond, the efficient form, but the call "
                             "has no drop=: pass drop=drop, the mask given to efficient_uncond")
        if marked is not None and marked is not drop and (marked.shape != drop.shape
                                                          or not torch.equal(marked.to(drop.device), drop)):
            raise ValueError("IMBALoss: pred_uncond comes from efficient_uncond with another drop mask than this "
                             "call's drop=: pass the same mask to both")
        if timesteps is not None and timesteps.shape not in ((b,), ()):
            raise ValueError(f"IMBALoss: timesteps must have shape ({b},), the DiT timestep of each row, "
                             f"got {tuple(timesteps.shape)}")
        if sample_weights is not None and sample_weights.shape != (b,):
            raise ValueError(f"IMBALoss: sample_weights must have shape ({b},), one weight per sample (e.g. min-SNR), "
                             f"got {tuple(sample_weights.shape)}")
        training = torch.is_grad_enabled() and pred_cond.requires_grad
        if not training or pred_uncond.requires_grad or self.lam == 1.0:
            return
        if drop is None:
            raise ValueError("IMBALoss: pred_uncond carries no gradient, so the unconditional model would never train: "
                             "compute it with gradient (one forward of 2B rows, captions then the null caption: "
                             "NullCaption.cat), or use the efficient form (drop=)")
        raise ValueError("IMBALoss(drop=...): pred_uncond carries no gradient, so the dropped rows would never train "
                         "the unconditional model: give those rows the null caption in the pass with gradient "
                         "(NullCaption.where) and pass pred_uncond=loss_fn.efficient_uncond(pred, uncond, drop)")

    def __call__(self, pred_cond: torch.Tensor, pred_uncond: torch.Tensor, target: torch.Tensor,
                 drop: torch.Tensor | None = None, timesteps: torch.Tensor | None = None,
                 sample_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, LossStats]:
        """The loss and its stats (`LossStats`: scalars named `stats_prefix` + name, "imba/loss" and so on, and the
        per-sample tensors). All predictions and the target are (B, C, H, W), with the target's channels (slice a
        learned variance off first).

        Without `drop`: the literal form; every row contributes λ·L* + (1 − λ)·L_u, and both predictions must carry
        their gradient (one forward of 2B rows: captions, then the null caption).

        With `drop` (bool, (B,), drawn by `draw_drop_mask`): the efficient, unbiased form. `pred_cond` comes from
        one pass with gradient in which the dropped rows had the null caption (`NullCaption.where`); dropped rows
        contribute only their L_u term, from `pred_uncond`, which must be that pass's prediction there, gradient
        included; kept rows contribute only their L* term, and their `pred_uncond` (a no-grad unconditional pass)
        only sets D. `efficient_uncond(pred, uncond, drop)` builds that `pred_uncond`. Every per-row term is
        divided by B, so over drop ~ Bernoulli(1 − λ) the expected loss and gradient equal the literal form's.
        With reference="cond", D exists only on kept rows, and the normalisations use only them.

        `timesteps` (B,): the DiT timestep of each row, needed by normalize="timestep_mean".
        `sample_weights` (B,): a weight per sample multiplying both of its terms (min-SNR, or any per-sample
        weighting the script already has); the expectation over `drop` is still the weighted literal loss.
        """
        self._check_call(pred_cond, pred_uncond, target, drop, timesteps, sample_weights)
        b = target.shape[0]
        if timesteps is not None and timesteps.dim() == 0:
            timesteps = timesteps.expand(b)
        keep = None if drop is None else ~drop
        valid = keep if (drop is not None and self.reference == "cond") else None
        weight, d = self.weights(pred_cond, pred_uncond, target, valid, timesteps)
        cond_err = token_distance(target, pred_cond, self.patch_size, "mse")  # (B, N), carries grad
        cond_term = (weight * cond_err).mean(dim=1)  # per sample: mean over tokens of D · error
        uncond_term = (_at_least_fp32(pred_uncond) - _at_least_fp32(target)).pow(2).flatten(1).mean(dim=1)
        sample_weight = None if sample_weights is None else sample_weights.detach().to(cond_term)
        if drop is None:
            if sample_weight is None:
                loss = self.lam * cond_term.mean() + (1.0 - self.lam) * uncond_term.mean()
            else:
                loss = (sample_weight * (self.lam * cond_term + (1.0 - self.lam) * uncond_term)).mean()
            loss_cond, valid_rows = cond_term.detach().mean(), slice(None)
        else:
            per_row = torch.where(drop, uncond_term, cond_term)
            loss = per_row.mean() if sample_weight is None else (sample_weight * per_row).mean()
            loss_cond = (cond_term.detach() * keep).sum() / keep.sum().clamp_min(1)
            valid_rows = slice(None) if valid is None else valid
        valid_weight, valid_d = weight[valid_rows], d[valid_rows]
        if valid_weight.numel() == 0:  # reference="cond" and every row dropped: no weight defined this batch
            valid_weight = valid_d = weight.new_full((1,), float("nan"))
        scalars = {
            "loss": loss.detach(),
            "loss_cond_weighted": loss_cond,
            # every row has an unconditional prediction (with or without grad): the mean over all is the estimate
            "loss_uncond": uncond_term.detach().mean(),
            # a masked mean, not cond_err[keep]: selecting the rows would wait for the device at every step
            "loss_cond_plain": (cond_err.detach().mean() if keep is None
                                else (cond_err.detach() * keep[:, None]).sum() / (keep.sum() * cond_err.shape[1])),
            "weight_mean": valid_weight.mean(),
            "weight_std": valid_weight.std(unbiased=False),
            "weight_max": valid_weight.max(),
            "distance_mean": valid_d.mean(),
        }
        tensors = {
            # per-sample distance, for monitors that bucket samples by concept frequency (NaN where undefined)
            "distance_per_sample": d.mean(dim=1) if valid is None else d.mean(dim=1).masked_fill(~valid, float("nan")),
            # the same per token (B, N), for monitors that look at parts of an image
            "distance_per_token": d if valid is None else d.masked_fill(~valid[:, None], float("nan")),
            # per-sample conditional error (unweighted), NaN on rows that had no conditional prediction
            "loss_cond_per_sample": (cond_err.detach().mean(dim=1) if drop is None
                                     else cond_err.detach().mean(dim=1).masked_fill(drop, float("nan"))),
        }
        if drop is not None:
            scalars["caption_dropout_rate"] = drop.float().mean()
        scalars = {self.stats_prefix + name: value for name, value in scalars.items()}
        return loss, LossStats(scalars, tensors)

    def draw_drop_mask(self, batch_size: int, generator: torch.Generator | None = None, device=None) -> torch.Tensor:
        """Rows that train the unconditional term in the efficient form: each dropped with probability 1 − λ.
        Those rows get the null caption in the pass with gradient (`NullCaption.where(drop, ...)`)."""
        return torch.rand((batch_size,), generator=generator, device=device) < (1.0 - self.lam)

    @staticmethod
    def efficient_uncond(pred: torch.Tensor, uncond: torch.Tensor, drop: torch.Tensor,
                         kept: torch.Tensor | None = None) -> torch.Tensor:
        """The `pred_uncond` of the efficient form: `pred` on the dropped rows, where it is the unconditional
        prediction with its gradient (those rows had the null caption in `pred`'s pass), and the no-grad
        unconditional prediction `uncond` on the kept rows, where it only sets D. `uncond` holds all B rows or
        only the kept ones, in order; `kept`, the kept rows' indices where the caller has them (finding them
        again would wait for the device). The tensor carries `drop`, so that a loss call without the same
        `drop=` is refused rather than taken for the literal form."""
        b = pred.shape[0]
        if drop.shape != (b,) or drop.dtype != torch.bool:
            raise ValueError(f"IMBALoss: drop must be a bool tensor of shape ({b},), got {drop.dtype} "
                             f"{tuple(drop.shape)}")
        _check_channels("uncond", uncond, pred, "pred")
        uncond = uncond.detach().to(pred.dtype)
        if uncond.shape == pred.shape:
            merged = torch.where(drop.view(-1, *([1] * (pred.dim() - 1))), pred, uncond)
        else:
            kept = (~drop).nonzero(as_tuple=True)[0] if kept is None else kept
            if uncond.shape[1:] != pred.shape[1:] or uncond.shape[0] != kept.numel():
                raise ValueError(f"IMBALoss.efficient_uncond: uncond must hold all {b} rows or the {kept.numel()} "
                                 f"kept ones, each of shape {tuple(pred.shape[1:])}; got {tuple(uncond.shape)}")
            merged = pred.index_put((kept,), uncond)
        setattr(merged, _EFFICIENT_DROP, drop)
        return merged


def plain_loss(pred: torch.Tensor, target: torch.Tensor, sample_weights: torch.Tensor | None = None):
    """Plain diffusion MSE (the baseline; its caption dropout happens before the forward pass).

    `sample_weights` (B,) scale each sample's MSE: offline re-balancing, e.g. by inverse concept frequency (the
    baseline IMBA is compared with). Weights are used as given, so normalise them to mean 1 over the data set to
    keep the loss scale. Stats: `loss`, and the per-sample MSE in `stats.tensors["loss_per_sample"]`.
    """
    per_sample = (_at_least_fp32(pred) - _at_least_fp32(target)).pow(2).flatten(1).mean(dim=1)
    if sample_weights is None:
        loss = per_sample.mean()
    else:
        if sample_weights.shape != per_sample.shape:
            raise ValueError(f"plain_loss: sample_weights must have shape {tuple(per_sample.shape)}, "
                             f"got {tuple(sample_weights.shape)}")
        loss = (sample_weights.to(per_sample.dtype) * per_sample).mean()
    return loss, LossStats({"loss": loss.detach()}, {"loss_per_sample": per_sample.detach()})
