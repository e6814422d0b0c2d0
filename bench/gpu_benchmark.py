"""Training-step cost of the DiT under three loss forms: plain, IMBA literal, IMBA efficient (one GPU).

What it measures: the project's own `models.dit.build_transformer` / `predict` (diffusers `PixArtTransformer2DModel`)
at a preset and resolution, bf16 autocast over fp32 master weights, AdamW (fused on CUDA), TF32 on, synthetic
latents / timesteps / T5-shaped caption embeddings (no weights, no data loading, no VAE/T5, no EMA). Per mode:

    plain      one forward of B rows (10 % of captions replaced by the null caption) + backward + optimizer step
    literal    IMBA literal (imba/training_loss.py TrainingLoss): one forward of 2B rows (B conditional + B null) + backward + step
    efficient  unbiased IMBA: one grad forward of B rows (kept rows conditional, dropped rows null caption) +
               one torch.no_grad() forward of the kept rows with the null caption (≈ 0.9 B) + backward + step

and reports the median step time over --steps timed steps after --warmup steps (torch.cuda.synchronize around each
step), images/s, the cost ratio per image vs plain, peak allocated memory (reset between modes), model TFLOP/s and
MFU. The Markdown table is printed last; --out FILE appends it with the environment.

GPU run (H200, ~1 min without --compile):
    python bench/gpu_benchmark.py --out bench/gpu_results.md
CPU smoke run (seconds):
    OMP_NUM_THREADS=1 python bench/gpu_benchmark.py --device cpu --preset tiny --resolution 64 --steps 3 --warmup 1
No-GPU estimates (FLOPs by component, FlopCounterMode check, saved-activation probe), used by bench/scaling.md:
    OMP_NUM_THREADS=1 python bench/gpu_benchmark.py --estimate-only

FLOP model (see `dit_forward_flops`). Matmul FLOPs only, 2 FLOPs per multiply-add; elementwise ops, norms, softmax and
bias adds are not counted (the usual MFU convention). Per image, with N image tokens (= (latent/patch)²), L text
tokens (all padded tokens are computed: the mask is an additive bias), h hidden, C_txt caption channels (4096 for
T5-XXL), c latent channels, p patch, F = 256 timestep frequencies:

    patch embedding        N · (c·p²) · h
    timestep embedding     F·h + h·h               (TimestepEmbedding: 256 → h → h)
    adaLN-single           h · 6h                  (one per image, shared by all blocks)
    caption projection     L · (C_txt·h + h·h)     (PixArtAlphaTextProjection: 4096 → h → h)
    per block (× layers):
      self-attn q,k,v,out  4 · N · h²
      self-attn QKᵀ, PV    2 · N² · h
      cross-attn q, out    2 · N · h²
      cross-attn k, v      2 · L · h²              (cross_attention_dim = h: the caption is projected first)
      cross-attn QKᵀ, PV   2 · N · L · h
      MLP                  2 · N · h · 4h
    final projection       N · h · (p²·c)
    forward FLOPs / image = 2 × (sum of the multiply-adds above)

For the 1b preset at 256 px (N = 256, L = 120, h = 1472, 28 blocks) that is ≈ 0.48 TFLOP per image forward.
Training FLOPs: 3 × forward for a pass with gradient (backward ≈ 2 × forward), 1 × forward for a no-grad pass:

    plain 3·F·B      literal 3·F·2B      efficient 3·F·B + F·B_kept,  B_kept = B − round((1−λ)·B)

MFU = (training FLOPs per step ÷ median step time) ÷ peak dense bf16 FLOP/s (--peak-tflops, H200/H100 SXM: 989).
The analytic count is checked against torch.utils.flop_counter.FlopCounterMode on the meta device (attention is
decomposed into bmm there, so it is counted) at the benchmarked size, at start-up (--no-flop-check skips it).
Measured (2026-11-30, --estimate-only): 1b at 256 px, 481.895 GFLOP/image forward both ways (ratio 1.0000), forward
+ backward = 2.997 × forward; tiny on real CPU tensors (math SDPA): 2.3365 GFLOP both ways, backward ratio 2.919 (the
input layers need no input gradient; they are a larger share of the tiny model).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from imba.objectives import NoisedBatch  # noqa: E402
from imba.training_loss import TrainingLoss  # noqa: E402
from models.dit import PRESETS, build_transformer, count_parameters, predict  # noqa: E402

MODES = ("plain", "literal", "efficient")
VAE_SCALE = 8  # SD-VAE: 256 px → 32×32×4 latents
LATENT_CHANNELS = 4
PATCH = 2
TIMESTEP_FREQS = 256
OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


# ---------------------------------------------------------------------------------------------------------------
# FLOP model
# ---------------------------------------------------------------------------------------------------------------
def dit_forward_flops(hidden: int, layers: int, image_tokens: int, text_tokens: int, caption_channels: int = 4096,
                      in_channels: int = LATENT_CHANNELS, out_channels: int = LATENT_CHANNELS, patch: int = PATCH,
                      mlp_ratio: int = 4, timestep_freqs: int = TIMESTEP_FREQS) -> dict[str, float]:
    """Forward matmul FLOPs of one image through a PixArt DiT, by component (2 FLOPs per multiply-add).

    Returns a dict of components plus "total". See the module docstring for the formula.
    """
    h, n, l = hidden, image_tokens, text_tokens
    macs = {
        "patch_embed": n * (in_channels * patch * patch) * h,
        "timestep_embed": timestep_freqs * h + h * h,
        "adaln_single": h * 6 * h,
        "caption_projection": l * (caption_channels * h + h * h),
        "self_attn_proj": layers * 4 * n * h * h,
        "self_attn_scores_values": layers * 2 * n * n * h,
        "cross_attn_q_out": layers * 2 * n * h * h,
        "cross_attn_kv": layers * 2 * l * h * h,
        "cross_attn_scores_values": layers * 2 * n * l * h,
        "mlp": layers * 2 * n * h * mlp_ratio * h,
        "final_proj": n * h * (patch * patch * out_channels),
    }
    flops = {k: 2.0 * v for k, v in macs.items()}
    flops["total"] = sum(flops.values())
    return flops


def preset_forward_flops(preset: str, resolution: int, text_tokens: int, caption_channels: int) -> dict[str, float]:
    p = PRESETS[preset]
    latent = resolution // VAE_SCALE
    return dit_forward_flops(p.hidden_size, p.num_layers, (latent // PATCH) ** 2, text_tokens, caption_channels)


def kept_rows(batch: int, lam: float) -> int:
    """Rows that keep their caption: a fixed count (expected value of the Bernoulli mask) keeps shapes constant.

    At least one row is dropped when λ < 1, so that tiny smoke batches exercise both paths (B = 64: 6 dropped).
    """
    dropped = int(round((1.0 - lam) * batch))
    if lam < 1.0 and batch > 1:
        dropped = max(dropped, 1)
    return batch - dropped


def training_flops(mode: str, batch: int, forward_per_image: float, lam: float) -> float:
    """Model FLOPs of one training step: 3× forward for passes with gradient, 1× for no-grad passes."""
    if mode == "plain":
        return 3 * forward_per_image * batch
    if mode == "literal":
        return 3 * forward_per_image * 2 * batch
    if mode == "efficient":
        return 3 * forward_per_image * batch + forward_per_image * kept_rows(batch, lam)
    raise ValueError(mode)


def _synthetic_inputs(batch, latent, text_tokens, caption_channels, real_tokens=40, device="cpu", dtype=None,
                      generator=None):
    """Latents, timesteps, caption embeddings and a T5-like mask (about `real_tokens` real tokens, rest padding)."""
    g = generator
    x = torch.randn(batch, LATENT_CHANNELS, latent, latent, generator=g, device=device, dtype=dtype)
    t = torch.randint(0, 1000, (batch,), generator=g, device=device)
    e = torch.randn(batch, text_tokens, caption_channels, generator=g, device=device, dtype=dtype)
    lengths = (torch.randn(batch, generator=g, device=device) * real_tokens / 3 + real_tokens).round()
    lengths = lengths.clamp(4, text_tokens)
    mask = (torch.arange(text_tokens, device=device)[None] < lengths[:, None]).to(torch.long)
    return x, t, e, mask


def measured_flops_meta(preset: str, resolution: int, text_tokens: int, caption_channels: int,
                        batch: int = 2) -> tuple[float, float]:
    """(forward, forward+backward) FLOPs per image counted by FlopCounterMode on the meta device (no compute)."""
    from torch.utils.flop_counter import FlopCounterMode

    latent = resolution // VAE_SCALE
    with torch.device("meta"):
        model = build_transformer(preset, latent, caption_channels)
        x, t, e, mask = _synthetic_inputs(batch, latent, text_tokens, caption_channels, device="meta")
    with FlopCounterMode(display=False) as fwd:
        predict(model, x, t, e, mask)
    with FlopCounterMode(display=False) as fwdbwd:
        predict(model, x, t, e, mask).float().pow(2).mean().backward()
    return fwd.get_total_flops() / batch, fwdbwd.get_total_flops() / batch


def measured_flops_tiny_cpu(text_tokens: int = 120, caption_channels: int = 4096, resolution: int = 256,
                            batch: int = 2) -> tuple[float, float]:
    """FlopCounterMode on real CPU tensors, `tiny` preset, math SDPA backend (so attention shows up as bmm)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    latent = resolution // VAE_SCALE
    torch.manual_seed(0)
    model = build_transformer("tiny", latent, caption_channels)
    x, t, e, mask = _synthetic_inputs(batch, latent, text_tokens, caption_channels)
    with sdpa_kernel([SDPBackend.MATH]):
        with FlopCounterMode(display=False) as fwd:
            predict(model, x, t, e, mask)
        with FlopCounterMode(display=False) as fwdbwd:
            predict(model, x, t, e, mask).pow(2).mean().backward()
    return fwd.get_total_flops() / batch, fwdbwd.get_total_flops() / batch


def saved_activation_bytes(preset: str, resolution: int, text_tokens: int, caption_channels: int,
                           batch: int = 2, block_index: int = 1, autocast: bool = True) -> dict[str, float]:
    """Bytes autograd saves for backward in one DiT block, per sample — without computing anything.

    Runs the forward on FakeTensors and records every tensor saved for backward inside one block (deduplicated by
    storage). autocast=True: fp32 weights under bf16 autocast (CPU autocast, whose cast policy for linear,
    layer_norm and SDPA matches CUDA's; this is what the benchmark and accelerate's DDP bf16 run); the bf16 weight
    copies autocast makes are reported separately ("weight_copies", per block, not per sample). autocast=False: a
    model held in bf16, as DeepSpeed's bf16 mode does (accelerate does not autocast under DeepSpeed). The fused SDPA
    kernels save q, k, v, the output and the log-sum-exp, as the CUDA flash / memory-efficient kernels do.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.multiprocessing.reductions import StorageWeakRef

    latent = resolution // VAE_SCALE
    seen: dict[int, tuple[tuple[int, ...], torch.dtype, int]] = {}
    inside = [False]

    def pack(t):
        if inside[0]:
            key = StorageWeakRef(t.untyped_storage()).cdata
            seen.setdefault(key, (tuple(t.shape), t.dtype, t.untyped_storage().nbytes()))
        return t

    default_dtype = torch.get_default_dtype()
    try:
        if not autocast:
            torch.set_default_dtype(torch.bfloat16)
        with FakeTensorMode():
            model = build_transformer(preset, latent, caption_channels)
            x, t, e, mask = _synthetic_inputs(batch, latent, text_tokens, caption_channels)
            block = model.transformer_blocks[block_index]
            block.register_forward_pre_hook(lambda *a: inside.__setitem__(0, True))
            block.register_forward_hook(lambda *a: inside.__setitem__(0, False))
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                    predict(model, x, t, e, mask)
    finally:
        torch.set_default_dtype(default_dtype)
    weight_shapes = {tuple(p.shape) for p in block.parameters() if p.dim() == 2}
    weights = sum(n for s, d, n in seen.values() if s in weight_shapes and d == torch.bfloat16)
    acts = sum(n for s, d, n in seen.values()) - weights
    p = PRESETS[preset]
    n_tokens = (latent // PATCH) ** 2
    per_sample = acts / batch
    return {"per_sample_per_block": per_sample, "weight_copies_per_block": weights,
            "bytes_per_token_hidden": per_sample / (n_tokens * p.hidden_size)}


# ---------------------------------------------------------------------------------------------------------------
# The three training steps
# ---------------------------------------------------------------------------------------------------------------
class Bench:
    def __init__(self, args, device: torch.device):
        self.args = args
        self.device = device
        self.latent = args.resolution // VAE_SCALE
        common = dict(gamma=args.gamma, lam=args.lam, patch_size=PATCH)
        self.losses = {"plain": TrainingLoss("plain", **common),
                       "literal": TrainingLoss("imba", estimator="literal", **common),
                       "efficient": TrainingLoss("imba", estimator="efficient", **common)}
        with torch.device(device):  # initialise directly on the device: a 1B random init on CPU takes a while
            torch.manual_seed(args.seed)
            self.model = build_transformer(args.preset, self.latent, args.caption_channels)
        self.model.to(device).train()  # .to: any buffer built from numpy outside the device context
        if args.gradient_checkpointing:
            self.model.enable_gradient_checkpointing()
        if args.compile:
            # Regional compilation: the 28 identical blocks share one compiled graph, so compile time stays short.
            for block in self.model.transformer_blocks:
                block.compile()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, weight_decay=0.03,
                                           fused=device.type == "cuda")
        self.autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.dtype == "bf16")
        self.data = None

    def make_data(self, batch: int) -> None:
        a = self.args
        g = torch.Generator(device=self.device).manual_seed(a.seed)
        x, t, e, mask = _synthetic_inputs(batch, self.latent, a.text_tokens, a.caption_channels, a.real_tokens,
                                          device=self.device, generator=g)
        target = torch.randn(x.shape, generator=g, device=self.device)
        # Null (empty) caption: T5 gives one real token (EOS) followed by padding.
        null_e = torch.randn(1, a.text_tokens, a.caption_channels, generator=g, device=self.device)
        null_mask = torch.zeros(1, a.text_tokens, dtype=torch.long, device=self.device)
        null_mask[:, 0] = 1
        self.data = dict(x=x, t=t, e=e, mask=mask, target=target,
                         null_e=null_e.expand(batch, -1, -1), null_mask=null_mask.expand(batch, -1))

    def loss(self, mode: str) -> torch.Tensor:
        """The project's own per-batch loss (imba/training_loss.py) for the mode."""
        d = self.data
        b = d["x"].shape[0]
        # Rows [keep:] get the null caption. The rows are i.i.d. synthetic samples, so a fixed split stands in for a
        # Bernoulli(1 − λ) mask and keeps the shapes (and so the timings) constant from step to step.
        drop = torch.arange(b, device=self.device) >= kept_rows(b, self.args.lam)
        noised = NoisedBatch(noisy=d["x"], timesteps=d["t"], target=d["target"])
        loss, _ = self.losses[mode](lambda *a: predict(self.model, *a), noised, (d["e"], d["mask"]),
                                    (d["null_e"], d["null_mask"]), drop=None if mode == "literal" else drop)
        return loss

    def step(self, mode: str) -> None:
        with self.autocast:
            loss = self.loss(mode)
        loss.backward()
        if self.args.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.args.grad_clip, foreach=True)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def measure(self, mode: str, batch: int) -> dict:
        """Warm-up, then --steps timed steps; on CUDA OOM retry with half the batch."""
        note = ""
        while True:
            oom = False
            try:
                return self._measure_once(mode, batch) | {"note": note}
            except OOM:
                oom = True
            if oom:  # outside the except block, so the traceback's frames (and their tensors) are gone
                self.data = None
                self.optimizer.zero_grad(set_to_none=True)
                gc.collect()
                torch.cuda.empty_cache()
                if batch == 1:
                    raise SystemExit(f"{mode}: out of memory even at batch 1; try --gradient-checkpointing")
                note = note or f"OOM at {batch}"
                print(f"  {mode}: out of memory at batch {batch}; retrying with {batch // 2}", flush=True)
                batch //= 2

    def _measure_once(self, mode: str, batch: int) -> dict:
        a = self.args
        self.make_data(batch)
        if self.device.type == "cuda":
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
        for _ in range(a.warmup):
            self.step(mode)
        self.sync()
        times = []
        for _ in range(a.steps):
            self.sync()
            t0 = time.perf_counter()
            self.step(mode)
            self.sync()
            times.append(time.perf_counter() - t0)
        peak = torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else float("nan")
        self.data = None
        return {"mode": mode, "batch": batch, "median_s": statistics.median(times), "min_s": min(times),
                "max_s": max(times), "peak_bytes": peak}


# ---------------------------------------------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------------------------------------------
def results_table(results: list[dict], forward_per_image: float, lam: float, peak_tflops: float) -> str:
    rows = ["| mode | batch | step ms (median) | images/s | ratio vs plain | peak GiB | TFLOP/s | MFU % |",
            "|---|---|---|---|---|---|---|---|"]
    plain = next((r for r in results if r["mode"] == "plain"), None)
    plain_per_image = plain["median_s"] / plain["batch"] if plain else None
    for r in results:
        per_image = r["median_s"] / r["batch"]
        ratio = f"{per_image / plain_per_image:.2f}" if plain_per_image else "–"
        tflops = training_flops(r["mode"], r["batch"], forward_per_image, lam) / r["median_s"] / 1e12
        peak = "–" if math.isnan(r["peak_bytes"]) else f"{r['peak_bytes'] / 2**30:.1f}"
        batch = f"{r['batch']} ({r['note']})" if r["note"] else str(r["batch"])
        rows.append(f"| {r['mode']} | {batch} | {r['median_s'] * 1e3:.1f} | {r['batch'] / r['median_s']:.1f} | "
                    f"{ratio} | {peak} | {tflops:.3g} | {100 * tflops / peak_tflops:.3g} |")
    return "\n".join(rows)


def environment(device: torch.device) -> str:
    import diffusers

    if device.type == "cuda":
        gpu = torch.cuda.get_device_name(device)
    else:
        gpu = f"CPU ({platform.machine()}, {os.cpu_count()} cores)"
    cuda = f", CUDA {torch.version.cuda}" if device.type == "cuda" else ""
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return f"{gpu}; torch {torch.__version__}{cuda}; diffusers {diffusers.__version__}; {date}"


def estimate_only(args) -> None:
    """No-GPU numbers for bench/scaling.md: parameters, FLOPs by component, FLOP checks, saved activations."""
    torch.set_num_threads(1)
    latent = args.resolution // VAE_SCALE
    n_tokens = (latent // PATCH) ** 2
    params = count_parameters(args.preset, latent, args.caption_channels)
    flops = preset_forward_flops(args.preset, args.resolution, args.text_tokens, args.caption_channels)
    print(f"preset {args.preset}: {params:,} parameters; {args.resolution} px → {n_tokens} image tokens, "
          f"{args.text_tokens} text tokens")
    print("forward GFLOP per image by component:")
    for k, v in flops.items():
        print(f"  {k:26s} {v / 1e9:10.3f}   ({100 * v / flops['total']:.1f} %)")
    t0 = time.perf_counter()
    fwd, fwdbwd = measured_flops_meta(args.preset, args.resolution, args.text_tokens, args.caption_channels)
    print(f"FlopCounterMode (meta, {args.preset}): forward {fwd / 1e9:.3f} GFLOP/image vs analytic "
          f"{flops['total'] / 1e9:.3f} (ratio {fwd / flops['total']:.4f}); forward+backward / forward = "
          f"{fwdbwd / fwd:.3f} ({time.perf_counter() - t0:.1f} s)")
    t0 = time.perf_counter()
    tiny = preset_forward_flops("tiny", args.resolution, args.text_tokens, args.caption_channels)["total"]
    fwd, fwdbwd = measured_flops_tiny_cpu(args.text_tokens, args.caption_channels, args.resolution)
    print(f"FlopCounterMode (real CPU tensors, tiny, math SDPA): forward {fwd / 1e9:.4f} GFLOP/image vs analytic "
          f"{tiny / 1e9:.4f} (ratio {fwd / tiny:.4f}); forward+backward / forward = {fwdbwd / fwd:.3f} "
          f"({time.perf_counter() - t0:.1f} s)")
    layers = PRESETS[args.preset].num_layers
    for autocast, label in ((True, "fp32 weights + bf16 autocast"), (False, "bf16 model (DeepSpeed bf16)")):
        act = saved_activation_bytes(args.preset, args.resolution, args.text_tokens, args.caption_channels,
                                     autocast=autocast)
        copies = (f"; autocast bf16 weight copies {act['weight_copies_per_block'] * layers / 2**30:.2f} GiB"
                  if autocast else "")
        print(f"saved activations, {label}: {act['per_sample_per_block'] / 2**20:.1f} MiB per sample per block = "
              f"{act['bytes_per_token_hidden']:.1f} bytes × N·h; × {layers} blocks = "
              f"{act['per_sample_per_block'] * layers / 2**30:.3f} GiB per sample{copies}")
    for mode in MODES:
        print(f"training GFLOP per image, {mode}: "
              f"{training_flops(mode, 64, flops['total'], args.lam) / 64 / 1e9:.1f} (B = 64)")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--preset", default="1b", choices=list(PRESETS))
    ap.add_argument("--resolution", type=int, default=256, help="pixels; latents are resolution/8 (SD-VAE)")
    ap.add_argument("--batch-size", type=int, default=None, help="per GPU; default 64 on CUDA, 4 on CPU; halved on OOM")
    ap.add_argument("--steps", type=int, default=30, help="timed steps per mode (median reported)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    ap.add_argument("--gradient-checkpointing", action="store_true")
    ap.add_argument("--compile", action="store_true", help="torch.compile each transformer block (regional)")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"], help="autocast dtype (fp32 = no autocast)")
    ap.add_argument("--text-tokens", type=int, default=120)
    ap.add_argument("--real-tokens", type=int, default=40, help="mean number of unmasked caption tokens")
    ap.add_argument("--caption-channels", type=int, default=4096)
    ap.add_argument("--lam", type=float, default=0.9)
    ap.add_argument("--gamma", type=float, default=0.8)
    ap.add_argument("--grad-clip", type=float, default=1.0, help="as configs/1b_256.yaml; 0 disables")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="peak dense bf16 TFLOP/s (H100/H200 SXM: 989)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-flop-check", action="store_true", help="skip the FlopCounterMode check at start-up")
    ap.add_argument("--estimate-only", action="store_true", help="print FLOP/memory estimates and exit (no GPU)")
    ap.add_argument("--out", type=Path, default=None, help="append the table and environment to this Markdown file")
    args = ap.parse_args(argv)

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        ap.error(f"--modes: unknown {bad}; choose from {','.join(MODES)}")
    if args.resolution % (VAE_SCALE * PATCH):
        ap.error(f"--resolution {args.resolution} must be a multiple of {VAE_SCALE * PATCH}")
    if args.estimate_only:
        estimate_only(args)
        return
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda but torch sees no CUDA device; for a CPU smoke run add: "
                 "--device cpu --preset tiny --resolution 64 --steps 3 --warmup 1")
    if device.type == "cpu" and args.preset == "1b":
        ap.error("the 1b preset is far too slow on CPU; for a smoke run use: "
                 "--device cpu --preset tiny --resolution 64 --steps 3 --warmup 1")
    if args.batch_size is None:
        args.batch_size = 64 if device.type == "cuda" else 4
    if device.type == "cuda":
        if hasattr(torch.backends.cuda.matmul, "fp32_precision"):  # torch ≥ 2.9
            torch.backends.cuda.matmul.fp32_precision = "tf32"
            torch.backends.cudnn.conv.fp32_precision = "tf32"
        else:
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True

    forward = preset_forward_flops(args.preset, args.resolution, args.text_tokens, args.caption_channels)["total"]
    params = count_parameters(args.preset, args.resolution // VAE_SCALE, args.caption_channels)
    n_tokens = (args.resolution // VAE_SCALE // PATCH) ** 2
    print(f"{environment(device)}\npreset {args.preset} ({params / 1e6:.1f} M params), {args.resolution} px → "
          f"{n_tokens} image tokens, {args.text_tokens} text tokens (~{args.real_tokens} real); {args.dtype}; "
          f"batch {args.batch_size}; checkpointing {'on' if args.gradient_checkpointing else 'off'}; "
          f"compile {'on' if args.compile else 'off'}", flush=True)
    if not args.no_flop_check:
        counted, _ = measured_flops_meta(args.preset, args.resolution, args.text_tokens, args.caption_channels)
        print(f"FLOP check: analytic {forward / 1e9:.3f} GFLOP/image forward, FlopCounterMode (meta) "
              f"{counted / 1e9:.3f} (ratio {counted / forward:.4f})", flush=True)

    bench = Bench(args, device)
    results = []
    t_start = time.perf_counter()
    for mode in modes:
        t0 = time.perf_counter()
        r = bench.measure(mode, args.batch_size)
        results.append(r)
        print(f"  {mode}: batch {r['batch']}, median {r['median_s'] * 1e3:.1f} ms (min {r['min_s'] * 1e3:.1f}, "
              f"max {r['max_s'] * 1e3:.1f}) [{time.perf_counter() - t0:.0f} s]", flush=True)
    table = results_table(results, forward, args.lam, args.peak_tflops)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        command = " ".join(["python", "bench/gpu_benchmark.py", *(sys.argv[1:] if argv is None else argv)])
        with args.out.open("a") as f:
            f.write(f"\n## {args.preset}, {args.resolution} px, {args.dtype}\n\n{environment(device)}  \n"
                    f"`{command}`  \n"
                    f"forward {forward / 1e9:.4g} GFLOP/image; MFU vs {args.peak_tflops:g} TFLOP/s; "
                    f"total {time.perf_counter() - t_start:.0f} s\n\n{table}\n")
    print(f"\n{table}")


if __name__ == "__main__":
    main()
