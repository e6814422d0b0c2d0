"""The DiT's FLOP model and the no-GPU estimates (`python bench/gpu_benchmark.py --estimate-only`) that
`bench/gpu_benchmark.py` and `bench/scaling.md` use.

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

    plain 3·F·B      literal 3·F·2B      efficient 3·F·B + F·λB

(the efficient estimator's no-grad pass runs on the rows that keep their caption, λB in expectation).

MFU = (training FLOPs per step ÷ median step time) ÷ peak dense bf16 FLOP/s (--peak-tflops, H200/H100 SXM: 989).
The analytic count is checked against torch.utils.flop_counter.FlopCounterMode on the meta device (attention is
decomposed into bmm there, so it is counted) at the benchmarked size, at start-up (--no-flop-check skips it).
Measured (2026-11-30, --estimate-only): 1b at 256 px, 481.895 GFLOP/image forward both ways (ratio 1.0000), forward
+ backward = 2.997 × forward; tiny on real CPU tensors (math SDPA): 2.3365 GFLOP both ways, backward ratio 2.919 (the
input layers need no input gradient; they are a larger share of the tiny model).
"""

from __future__ import annotations

import time

import torch

from models.dit import PRESETS, build_transformer, count_parameters, predict

VAE_SCALE = 8  # SD-VAE: 256 px → 32×32×4 latents
LATENT_CHANNELS = 4
PATCH = 2
TIMESTEP_FREQS = 256
MODES = ("plain", "literal", "efficient")


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


def training_flops(mode: str, batch: int, forward_per_image: float, lam: float) -> float:
    """Model FLOPs of one training step: 3× forward for passes with gradient, 1× for no-grad passes (the
    efficient no-grad pass: λ·batch rows, its expected size)."""
    if mode == "plain":
        return 3 * forward_per_image * batch
    if mode == "literal":
        return 3 * forward_per_image * 2 * batch
    if mode == "efficient":
        return 3 * forward_per_image * batch + forward_per_image * lam * batch
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

