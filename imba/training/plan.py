"""The memory of a run per GPU, before it is launched: what each part holds and the largest micro-batch that fits.

    python -m imba.training.plan configs/1b_256.yaml [section.key=value ...] --gpu-memory 80GiB --gpus 8

The run's own config is loaded (`load_config`), its own DiT built (`build_dit`) and one training step of its own
loss (`build_training_loss`: the forward passes of its kind, the loss, the backward), with its gradient
checkpointing and mixed precision, traced on fake tensors (`FakeTensorMode`: shapes and dtypes, no memory, no
compute): `LiveTensorBytes` counts the bytes of the tensor storages alive after every operation. Two micro-batches
give, at every allocation of the step, what a sample adds and what does not grow with the batch: the step's peak at
any micro-batch follows (`StepProfile`). The model states (parameters, gradients, AdamW's two fp32 states, the fp32
EMA, the communication buckets) follow from the parameter count, per distributed mode: DDP (accelerate's: fp32
weights under autocast), DeepSpeed ZeRO-2 and ZeRO-3 (launch/deepspeed/*.json: the model held in bf16, no
autocast). Rank 0 also draws the sample grids: an EMA copy in the training dtype, the VAE and its decode, counted on
top of the model states.

The planner predicts tensor bytes; the allocator's fragmentation and the CUDA context are the named assumptions
below. Its prediction of a real step's peak on the CPU is tested (tests/test_plan.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from data.synthetic import CAPTION_WORDS
from imba.training.build import adamw_implementation, build_dit, build_training_loss
from imba.training.config import Config, ConfigError, load_config
from imba.training.inputs import precomputes
from models.dit import apply_speed_settings, predict
from models.encoders import DTYPES
from models.settings import TINY, TINY_WORDS
from models.vae import SHAPES, load_vae

GiB = 2 ** 30
# What the CUDA context, cuBLAS/cuDNN workspaces and NCCL's communicator buffers take on each GPU before any tensor:
# about 0.5 GiB of context on an H100 with torch 2.x plus a few hundred MiB of NCCL and library workspaces.
CUDA_CONTEXT_BYTES = 1 * GiB
# The caching allocator reserves more than the tensors alive at the peak: blocks freed in one size cannot always serve
# another. 5-15 % in long training runs with changing shapes; the fit keeps this fraction of the peak free.
ALLOCATOR_MARGIN = 0.10
# DeepSpeed's own rule for ZeRO-1/2 with overlap_comm: 4.5 × (reduce_bucket_size + allgather_bucket_size) elements
# of the 16-bit communication dtype live in its buckets (DeepSpeed's ZeRO configuration docs).
ZERO_OVERLAP_BUCKET_FACTOR = 4.5
# Known widths of text encoders and layouts of VAEs, for when their config.json is neither a local folder nor in the
# Hugging Face cache (the planner downloads nothing). Facts of the published checkpoints.
TEXT_WIDTHS = {"google/t5-v1_1-xxl": 4096, "google/t5-v1_1-xl": 2048, "google/t5-v1_1-large": 1024,
               "google/t5-v1_1-base": 768, "google/t5-v1_1-small": 512, "PixArt-alpha/PixArt-XL-2-1024-MS": 4096,
               "PixArt-alpha/PixArt-XL-2-512x512": 4096, "PixArt-alpha/PixArt-XL-2-256x256": 4096}
SD_VAE = dict(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=[128, 256, 512, 512],
              layers_per_block=2, norm_num_groups=32, down_block_types=["DownEncoderBlock2D"] * 4,
              up_block_types=["UpDecoderBlock2D"] * 4, sample_size=512, scaling_factor=0.18215)
VAE_CONFIGS = {"stabilityai/sd-vae-ft-ema": SD_VAE, "stabilityai/sd-vae-ft-mse": SD_VAE,
               "PixArt-alpha/PixArt-XL-2-1024-MS": SD_VAE, "PixArt-alpha/PixArt-XL-2-512x512": SD_VAE,
               "PixArt-alpha/PixArt-XL-2-256x256": SD_VAE}
MODES = ("ddp", "zero2", "zero3")
DEEPSPEED_JSON = Path(__file__).resolve().parents[2] / "launch" / "deepspeed"


class LiveTensorBytes(TorchDispatchMode):
    """Counts the bytes of the tensor storages alive (`live`) and their `peak`, on real or fake tensors alike: every
    storage an operation returns is counted once until it is freed. `track(tensor)` counts a tensor made before the
    mode was entered. `watch_gradients(params)` counts the gradients accumulated into `params` in `gradients`;
    `record`: (live, gradients) after every allocation, in `timeline`.
    `kept_rows`: what `nonzero` returns on fake tensors, whose values are unknown: the expected number of kept
    captions, so that the efficient IMBA estimator's no-grad pass is traced at its expected size."""

    def __init__(self, kept_rows: int | None = None, record: bool = False) -> None:
        super().__init__()
        self.live = self.peak = self.gradients = 0
        self.kept_rows = kept_rows
        self.timeline: list[tuple[int, int]] | None = [] if record else None  # (live, gradients) at each allocation
        self._storages: dict[int, weakref.ref] = {}

    def track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in self._storages:
            return
        nbytes = storage.nbytes()
        self.live += nbytes
        self._storages[key] = weakref.ref(storage, lambda _, key=key, nbytes=nbytes: self._free(key, nbytes))
        self._update()

    def _free(self, key: int, nbytes: int) -> None:
        if self._storages.pop(key, None) is not None:
            self.live -= nbytes

    def _update(self) -> None:
        self.peak = max(self.peak, self.live)
        if self.timeline is not None:
            self.timeline.append((self.live, self.gradients))

    def watch_gradients(self, params) -> None:
        def counted(param):
            self.gradients += param.grad.untyped_storage().nbytes()
        for p in params:
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(counted)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.nonzero.default and isinstance(args[0], FakeTensor) and self.kept_rows is not None:
            out = torch.empty((self.kept_rows, args[0].dim()), dtype=torch.long, device=args[0].device)
        else:
            out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.track(t)
        return out


@dataclass
class EncoderSizes:
    """What `build_dit` reads of a run's frozen encoders (`models.encoders.FrozenEncoders`' sizes), and the VAE's
    config, read without loading a weight."""
    latent_channels: int
    caption_channels: int
    vae_scale: int
    vae_config: dict


def encoder_sizes(cfg: Config, caption_channels: int = 0) -> EncoderSizes:
    """The sizes of the run's text encoder and VAE: from the code's own small ones, a local folder or the Hugging Face
    cache, else the published sizes in `TEXT_WIDTHS` / `VAE_CONFIGS`. `caption_channels` > 0 overrides the text
    width."""
    m = cfg.model
    if m.vae in (TINY, SHAPES):
        vae_config = dict(load_vae(m.vae).config)
    else:
        try:
            from diffusers import AutoencoderKL
            vae_config = dict(AutoencoderKL.load_config(m.vae, subfolder=m.vae_subfolder or None,
                                                        local_files_only=True))
        except (OSError, ValueError):
            if m.vae not in VAE_CONFIGS:
                raise ConfigError(f"model.vae={m.vae}: its config.json is not on this machine; download it once "
                                  "(huggingface-cli download MODEL config.json) or name a local folder") from None
            vae_config = dict(VAE_CONFIGS[m.vae])
    if not caption_channels:
        caption_channels = _text_width(m)
    scale = 2 ** (len(vae_config["block_out_channels"]) - 1)
    return EncoderSizes(vae_config["latent_channels"], caption_channels, scale, vae_config)


def _text_width(m) -> int:
    if m.text_encoder in (TINY, TINY_WORDS):
        from models.text_encoder import load_text_encoder
        return load_text_encoder(m.text_encoder, words=CAPTION_WORDS)[1].config.d_model
    try:
        from transformers import AutoConfig
        return AutoConfig.from_pretrained(m.text_encoder, subfolder=m.text_encoder_subfolder or "",
                                          local_files_only=True).d_model
    except (OSError, ValueError):
        if m.text_encoder in TEXT_WIDTHS:
            return TEXT_WIDTHS[m.text_encoder]
        raise ConfigError(f"model.text_encoder={m.text_encoder}: its config.json is not on this machine; download it "
                          "once or pass --caption-channels (T5-XXL: 4096)") from None


def kept_rows(cfg: Config, batch: int) -> int:
    """Rows that keep their caption in a batch, in expectation: B − round(p·B) for the loss's dropout rate p."""
    return batch - round(cfg.loss.build().drop_rate * batch)


def _inputs(cfg: Config, sizes: EncoderSizes, batch: int, dtype: torch.dtype):
    """A noised batch, its captions and the null caption, shaped as the run's (on the current device/mode)."""
    latent = cfg.data.resolution // sizes.vae_scale
    tokens = cfg.model.max_text_tokens
    latents = torch.randn(batch, sizes.latent_channels, latent, latent)
    noised = cfg.objective.build().noise(latents)
    embeds = torch.randn(batch, tokens, sizes.caption_channels, dtype=dtype)
    mask = torch.ones(batch, tokens, dtype=torch.long)
    return noised, (embeds, mask), (embeds.clone(), mask.clone())


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


@dataclass
class StepProfile:
    """The bytes of one micro-step (forward passes, loss, backward) above the model's parameters and buffers, at every
    allocation: `fixed[t] + B × per_sample[t]` of activations and temporaries, and the `gradients[t]` accumulated by
    then. Exact for any micro-batch B where the step runs the same operations, as it does for every B."""
    fixed: torch.Tensor
    per_sample: torch.Tensor
    gradients: torch.Tensor

    def at(self, batch: int, keep_gradients: bool) -> float:
        """The step's peak at micro-batch `batch`, with the gradients kept until the optimizer step (one process,
        DDP) or handed away as they are made (ZeRO's buckets)."""
        return float((self.fixed + batch * self.per_sample + (self.gradients if keep_gradients else 0)).max())

    @property
    def activations_per_sample(self) -> float:
        """What a sample adds when the most is alive (as the backward starts, without checkpointing)."""
        return float(self.per_sample.max())


def _timeline(cfg: Config, sizes: EncoderSizes, batch: int, checkpointing: bool, held_dtype: torch.dtype,
              autocast: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(bytes of activations and temporaries, bytes of gradients) after every allocation of one micro-step of the run
    on fake tensors: its DiT held in `held_dtype`, under the config's autocast when `autocast`."""
    mode = LiveTensorBytes(kept_rows=kept_rows(cfg, batch), record=True)
    amp = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.train.mixed_precision)
    with FakeTensorMode(allow_non_fake_inputs=True), _default_dtype(held_dtype):
        dit = build_dit(cfg, sizes)  # fake parameters cannot be cast after the build (`.to` swaps them)
        apply_speed_settings(dit, cfg.speed.attention, checkpointing, compile=False)
        dit.train()
        loss_fn = build_training_loss(cfg, dit.config.patch_size, same_passes_on_every_rank=False)
        mode.watch_gradients(dit.parameters())
        with mode:
            for t in [*dit.parameters(), *dit.buffers()]:
                mode.track(t)
            start = mode.live
            mode.timeline.clear()
            noised, cond, null = _inputs(cfg, sizes, batch, torch.float32)  # the batch is part of the step
            with torch.autocast("cpu", dtype=amp or torch.bfloat16, enabled=autocast and amp is not None):
                loss, _ = loss_fn(lambda *a: predict(dit, *a, sizes.vae_scale), noised, cond, null)
            loss.backward()
    live, grads = torch.tensor(mode.timeline, dtype=torch.float64).T
    return live - grads - start, grads


# Two micro-batches for the line through each allocation; sizes that keep an exact 90 % of the captions (λ = 0.9)
TRACED_BATCHES = (10, 20)


def trace_step(cfg: Config, sizes: EncoderSizes, checkpointing: bool, held_dtype: torch.dtype,
               autocast: bool) -> StepProfile:
    """The `StepProfile` of the run's micro-step, from two traces on fake tensors."""
    (lo, grads), (hi, _) = (_timeline(cfg, sizes, b, checkpointing, held_dtype, autocast) for b in TRACED_BATCHES)
    if lo.shape != hi.shape:
        raise RuntimeError("the traced step ran other operations at another micro-batch; the planner cannot "
                           "extrapolate it")
    per_sample = (hi - lo) / (TRACED_BATCHES[1] - TRACED_BATCHES[0])
    return StepProfile(lo - TRACED_BATCHES[0] * per_sample, per_sample, grads)


def _meta_parts(cfg: Config, sizes: EncoderSizes):
    """(DiT, EMA) of the run on the meta device: the parameter counts and the EMA the run's own `make_ema` makes
    (its `foreach` update), without a byte allocated."""
    from imba.training.ema import make_ema
    with torch.device("meta"):
        dit = build_dit(cfg, sizes)
        ema = make_ema(dit.parameters(), decay=cfg.optim.ema_decay)
    return dit, ema


def _adam_temporaries(trained: list, device_type: str, partition: float) -> float:
    """Bytes AdamW allocates for its update of `partition` parameters, with the kernels the run's `build_optimizer`
    picks on `device_type`: none fused; one fp32 copy of the parameters with foreach (the square root of the second
    moment); two of the largest parameter one at a time."""
    kernels = adamw_implementation(trained, device_type)
    if kernels.get("fused"):
        return 0.0
    if kernels.get("foreach", device_type == "cuda"):
        return 4 * partition
    return 2 * 4 * min(max(p.numel() for p in trained), partition)


@dataclass
class ModePlan:
    """Bytes per GPU of one distributed mode with or without gradient checkpointing. `states` hold for the whole
    run; `step` (a line in the micro-batch) comes and goes at every step; `step_floor` is the transient of the
    optimizer and EMA updates, which run after the activations are gone; `grid` is what rank 0 adds for a grid."""
    mode: str
    checkpointing: bool
    states: dict[str, float]
    step: StepProfile
    keep_gradients: bool  # DDP and one process hold the step's gradients until the optimizer step
    step_floor: float
    grid: float
    grid_parts: dict[str, float]

    def step_at(self, batch: int) -> float:
        return max(self.step.at(batch, self.keep_gradients), self.step_floor)

    def peak(self, batch: int, rank0: bool = False) -> float:
        extra = max(self.step_at(batch), self.grid if rank0 else 0.0)
        return sum(self.states.values()) + extra

    def largest_batch(self, gpu_memory: float, rank0: bool = False, margin: float = ALLOCATOR_MARGIN,
                      context: float = CUDA_CONTEXT_BYTES, limit: int = 1 << 16) -> int:
        """The largest micro-batch whose peak, with the allocator's margin and the CUDA context, fits `gpu_memory`
        (0: not even one sample)."""
        def fits(b):
            return self.peak(b, rank0) * (1 + margin) + context <= gpu_memory
        lo, hi = 0, limit
        while lo < hi:  # the peak grows with the batch: the largest b that fits
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        return lo


def _deepspeed_buckets(mode: str) -> float:
    """Bytes in DeepSpeed's communication buffers per GPU, from the repository's launch/deepspeed/zero*.json."""
    zero = json.loads((DEEPSPEED_JSON / f"{mode}.json").read_text())["zero_optimization"]
    if mode == "zero2":
        elements = zero.get("reduce_bucket_size", 5e8) + zero.get("allgather_bucket_size", 5e8)
        factor = ZERO_OVERLAP_BUCKET_FACTOR if zero.get("overlap_comm") else 1.0
        return factor * elements * 2
    # ZeRO-3: a reduce bucket (two with overlap_comm) and the prefetched parameters, in 16 bits
    reduce = zero.get("reduce_bucket_size", 5e8) * (2 if zero.get("overlap_comm") else 1)
    return (reduce + zero.get("stage3_prefetch_bucket_size", 5e7)) * 2


def _max_live_parameters() -> float:
    zero = json.loads((DEEPSPEED_JSON / "zero3.json").read_text())["zero_optimization"]
    return zero.get("stage3_max_live_parameters", 1e9)


def vae_decode_bytes(cfg: Config, sizes: EncoderSizes, images: int) -> tuple[float, float]:
    """(the VAE's parameter bytes, the peak bytes of decoding `images` latents) in model.encoder_dtype, traced."""
    from diffusers import AutoencoderKL
    dtype = DTYPES[cfg.model.encoder_dtype]
    latent = cfg.data.resolution // sizes.vae_scale
    with FakeTensorMode(allow_non_fake_inputs=True), _default_dtype(dtype):
        vae = AutoencoderKL.from_config(sizes.vae_config)
        weights = sum(p.numel() * p.element_size() for p in vae.parameters())
        z = torch.randn(images, sizes.latent_channels, latent, latent)
        mode = LiveTensorBytes()
        with mode, torch.no_grad():
            for t in [*vae.parameters(), *vae.buffers(), z]:  # a weight's view would count it otherwise
                mode.track(t)
            start = mode.live
            vae.decode(z)
    return weights, mode.peak - start


def sampling_bytes(cfg: Config, sizes: EncoderSizes, dtype: torch.dtype, rows: int) -> float:
    """Peak bytes of one no-grad DiT forward of `rows` rows (a grid's guided step: 2 × its prompts), traced."""
    with FakeTensorMode(allow_non_fake_inputs=True), _default_dtype(dtype):
        dit = build_dit(cfg, sizes).eval()
        noised, cond, _ = _inputs(cfg, sizes, rows, dtype)
        mode = LiveTensorBytes()
        with mode, torch.no_grad():
            for t in [*dit.parameters(), *dit.buffers()]:  # a weight's view would count it otherwise
                mode.track(t)
            start = mode.live
            predict(dit, noised.noisy.to(dtype), noised.timesteps, *cond, sizes.vae_scale)
    return mode.peak - start


def plan_run(cfg: Config, gpus: int, sizes: EncoderSizes | None = None, modes=MODES,
             checkpointing=(False, True), online_encoders: bool | None = None) -> list[ModePlan]:
    """A `ModePlan` per distributed mode and checkpointing setting for `gpus` GPUs. `modes` may also hold "one":
    a single process (no DDP), on `cfg`'s own device (the CPU test of the planner). `online_encoders`: the frozen T5
    and VAE sit on every GPU (data not precomputed; by default: unless the run precomputes its features)."""
    if cfg.model.pretrained:
        raise ConfigError("the planner sizes model.preset runs; for model.pretrained set model.preset to the "
                          "pretrained model's width (PixArt-XL/2 ≈ 1b) and plan that")
    sizes = sizes or encoder_sizes(cfg)
    online = (not precomputes(cfg)) if online_encoders is None else online_encoders
    dit, ema = _meta_parts(cfg, sizes)
    params = list(dit.parameters())
    trained = [p for p in params if p.requires_grad]
    P = sum(p.numel() for p in params)
    T = sum(p.numel() for p in params if p.requires_grad)
    largest = max(p.numel() for p in params)
    mp = cfg.train.mixed_precision
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mp)
    half_bytes = 2 if half else 4
    prompts = max(len(cfg.sample.prompts), 1)
    vae_weights, decode = vae_decode_bytes(cfg, sizes, prompts)
    encoders = _text_encoder_bytes(cfg) + vae_weights if online else 0.0
    grid_rows = 2 * prompts if cfg.sample.guidance_scale > 1 else prompts  # guided: conditional + null rows
    sampling = sampling_bytes(cfg, sizes, half or torch.float32, grid_rows)
    # the EMA copy in the training dtype; the VAE loaded for the grid unless it is already there; then the sampling
    # passes and the decode, one after the other
    grid_parts = {"EMA copy": P * half_bytes, "VAE": 0.0 if online else vae_weights, "sampling pass": sampling,
                  "decode": decode}
    grid = grid_parts["EMA copy"] + grid_parts["VAE"] + max(decode, sampling)
    plans, traced = [], {}
    for mode in modes:
        deepspeed = mode.startswith("zero")
        device = "cpu" if mode == "one" else "cuda"
        held = (half or torch.float32) if deepspeed else torch.float32
        foreach_ema = bool(getattr(ema, "foreach", False))
        for ckpt in checkpointing:
            key = (held, ckpt)
            if key not in traced:
                traced[key] = trace_step(cfg, sizes, ckpt, held, autocast=not deepspeed)
            profile = traced[key]
            n = gpus if deepspeed else 1
            ema_temp = 4 * P if foreach_ema else 2 * 4 * largest
            if not deepspeed:
                adam_temp = _adam_temporaries(trained, device, T)
                states = {"parameters": 4 * P, "gradients": 0.0, "optimizer": 8 * T, "ema": 4 * P,
                          "buckets": 4 * T if mode == "ddp" else 0.0, "encoders": encoders}
                plans.append(ModePlan(mode, ckpt, states, profile, True, max(4 * T + adam_temp, ema_temp), grid,
                                      grid_parts))
                continue
            gathered = min(_max_live_parameters(), P) * half_bytes if mode == "zero3" else 0.0
            adam_temp = _adam_temporaries(trained, device, T / n)  # on the flat fp32 partition
            states = {"parameters": P * half_bytes / (n if mode == "zero3" else 1) + gathered,
                      "gradients": T * half_bytes / n, "optimizer": 12 * T / n,
                      "ema": 4 * P / (n if mode == "zero3" else 1), "buckets": _deepspeed_buckets(mode),
                      "encoders": encoders}
            # the step: the fp32 gradients of this rank's partition and the optimizer's temporaries
            # ZeRO-3's EMA (imba.training.ema.PartitionedEMA): its slices cast to fp32, then their difference
            floor = max(4 * T / n + adam_temp, 2 * 4 * P / n if mode == "zero3" else ema_temp)
            plans.append(ModePlan(mode, ckpt, states, profile, False, floor, grid, grid_parts))
    return plans


# Parameters of text encoders whose config is not on this machine (T5 v1.1 XXL's encoder: 24 blocks of 4096 wide)
TEXT_ENCODER_PARAMS = {"google/t5-v1_1-xxl": 4_762_310_656}


def _text_encoder_bytes(cfg: Config) -> float:
    m = cfg.model
    size = torch.finfo(DTYPES[m.encoder_dtype]).bits // 8
    if m.text_encoder in (TINY, TINY_WORDS):
        from models.text_encoder import load_text_encoder
        return sum(p.numel() for p in load_text_encoder(m.text_encoder, words=CAPTION_WORDS)[1].parameters()) * size
    try:
        from transformers import AutoConfig, T5EncoderModel
        config = AutoConfig.from_pretrained(m.text_encoder, subfolder=m.text_encoder_subfolder or "",
                                            local_files_only=True)
        with torch.device("meta"):
            return sum(p.numel() for p in T5EncoderModel(config).parameters()) * size
    except (OSError, ValueError):
        if m.text_encoder in TEXT_ENCODER_PARAMS:
            return TEXT_ENCODER_PARAMS[m.text_encoder] * size
        raise ConfigError(f"model.text_encoder={m.text_encoder}: its config.json is not on this machine; download "
                          "it once, or precompute the features (data.precompute=true)") from None


def parse_bytes(text: str) -> float:
    """'80GiB', '80GB', '141 GB', '81559MiB' → bytes."""
    units = {"b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
             "tib": 2**40}
    found = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]+)\s*", text)
    if not found or found.group(2).lower() not in units:
        raise ConfigError(f"--gpu-memory {text!r}: give a size with its unit, e.g. 80GiB, 80GB or 141GB")
    return float(found.group(1)) * units[found.group(2).lower()]


def _gib(x: float) -> str:
    return f"{x / GiB:.2f}"


def format_plan(cfg: Config, plans: list[ModePlan], gpus: int, gpu_memory: float, online: bool) -> str:
    """The plan as text: the run, the terms per GPU, then the largest micro-batch per mode."""
    b = cfg.data.batch_size
    lines = [f"memory plan: preset {cfg.model.preset} at {cfg.data.resolution} px, loss {cfg.loss.describe()}, "
             f"mixed precision {cfg.train.mixed_precision}, {gpus} GPUs of {_gib(gpu_memory)} GiB; features "
             f"{'encoded online (T5 and VAE on every GPU)' if online else 'precomputed'}",
             "DDP: fp32 weights under autocast; ZeRO-2/3 (launch/deepspeed/*.json): the model held in the mixed "
             "precision's dtype, no autocast. GiB = 2^30 bytes, per GPU.", "",
             "| mode | checkpointing | parameters | gradients | optimizer | EMA | buckets | encoders | "
             f"activations/sample | step at batch {b} | peak at batch {b} | grid on rank 0 | peak on rank 0 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in plans:
        s = p.states
        lines.append(f"| {p.mode} | {'on' if p.checkpointing else 'off'} | {_gib(s['parameters'])} | "
                     f"{_gib(s['gradients'])} | {_gib(s['optimizer'])} | {_gib(s['ema'])} | {_gib(s['buckets'])} | "
                     f"{_gib(s['encoders'])} | {_gib(p.step.activations_per_sample)} | {_gib(p.step_at(b))} | "
                     f"{_gib(p.peak(b))} | {_gib(p.grid)} | "
                     f"{_gib(p.peak(b, rank0=True))} |")
    lines += ["", f"largest micro-batch that fits {_gib(gpu_memory)} GiB (peak × {1 + ALLOCATOR_MARGIN:.2f} for the "
              f"allocator, + {_gib(CUDA_CONTEXT_BYTES)} GiB CUDA context; 0 = not one sample):", "",
              "| mode | checkpointing | other ranks | rank 0 (with the grid) |", "|---|---|---|---|"]
    for p in plans:
        lines.append(f"| {p.mode} | {'on' if p.checkpointing else 'off'} | {p.largest_batch(gpu_memory)} | "
                     f"{p.largest_batch(gpu_memory, rank0=True)} |")
    parts = ", ".join(f"{k} {_gib(v)}" for k, v in plans[0].grid_parts.items())
    lines += ["", f"grid on rank 0 ({len(cfg.sample.prompts)} prompts): {parts} GiB (the larger of the last two)."]
    lines += ["", "\"step\": what one micro-step adds at its peak (activations, temporaries, autocast's weight "
              "copies; under DDP the fp32 gradients it holds until the optimizer step), or the optimizer's and the "
              "EMA's update when more. Not counted: the data loader's pinned buffers, torch.compile's workspaces"
              + (", the online encoders' pass (T5 and VAE encode the batch before the DiT's step)." if online
                 else ".")]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m imba.training.plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="the run's config file, as train.py --config takes it")
    parser.add_argument("overrides", nargs="*", help="section.key=value, as train.py takes them")
    parser.add_argument("--gpu-memory", default="80GiB", help="memory of one GPU, e.g. 80GiB (H100), 141GB (H200)")
    parser.add_argument("--gpus", type=int, default=8, help="GPUs of the run (ZeRO partitions over them)")
    parser.add_argument("--features", choices=("auto", "precomputed", "online"), default="auto",
                        help="whether the frozen encoders run on every GPU; auto: as the run decides (data.precompute)")
    parser.add_argument("--caption-channels", type=int, default=0,
                        help="the text encoder's width, when its config.json is not on this machine")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated: ddp,zero2,zero3")
    args = parser.parse_args(argv)
    gpu_memory = parse_bytes(args.gpu_memory)
    if args.gpus < 1:
        raise ConfigError("--gpus must be at least 1")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or set(modes) - set(MODES):
        raise ConfigError(f"--modes {args.modes!r}: choose among {', '.join(MODES)}")
    cfg = load_config(["--config", args.config, *args.overrides])
    online = None if args.features == "auto" else args.features == "online"
    online = (not precomputes(cfg)) if online is None else online
    plans = plan_run(cfg, args.gpus, encoder_sizes(cfg, args.caption_channels), modes, online_encoders=online)
    print(format_plan(cfg, plans, args.gpus, gpu_memory, online))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except (ConfigError, FileNotFoundError) as err:
        sys.exit(f"error: {err}")
