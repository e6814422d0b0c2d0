"""The training step's cost on one GPU, for plain, IMBA literal and IMBA efficient: the step `train.py` runs.

What it times, per mode, is train.py's loop body, built by train.py's own builders from `configs/1b_256.yaml` (or
--config) with the benchmark's settings as overrides:

    batches.fetch()                                   StepBatches over make_loader's precomputed feature shards
                                                      (one step's micro-batches, read before it)     → loader wait
    latents, cond = features.encode_batch(batch)      host → device copy of the latents and T5 states → input
    noised = objective.noise(latents)
    TrainStep(...)(step, batch, noised, cond, null)   loss, backward, clip, divergence guard, AdamW (build_optimizer:
                                                      fused on CUDA) and its schedule, under accelerate's autocast;
                                                      its stats into a MetricWindow
    ema.step(dit.parameters())                        make_ema (diffusers EMAModel, foreach)        → step

The feature shards are written once (`bench/real_size_features.py`: SD-VAE-shaped latent moments and T5-XXL-shaped
caption states, random values, in the precompute format) into --features, so the loader reads and decodes what a
precomputed 1b run reads; no VAE or T5 weights are needed. The modes share one model, optimizer and EMA; each gets
its own loss (`build_training_loss`), loader and `TrainStep`. After --warmup steps, --steps steps are timed, each
part ended by `torch.cuda.synchronize()`; medians are reported.

Reported per mode: images/s (batch ÷ median whole step), the median loader wait, input copy and step (TrainStep +
EMA), the ratio per image to plain, peak allocated memory (`torch.cuda.max_memory_allocated`, reset per mode; n/a on
the CPU), model TFLOP/s and MFU against the FLOP count of `bench/gpu_flops.py` (checked against FlopCounterMode at
start-up), and in the JSON the graphs torch.compile built during the mode (recompiles included). The Markdown
table is printed last; --out FILE appends it with the environment and the command, --json FILE writes everything as
JSON.

    python bench/gpu_benchmark.py --out bench/gpu_results.md                    # one GPU, 1b at 256 px
    python bench/gpu_benchmark.py --compile --gradient-checkpointing --modes plain,efficient
    OMP_NUM_THREADS=1 python bench/gpu_benchmark.py --device cpu --preset tiny --resolution 64 --steps 3 --warmup 1
    OMP_NUM_THREADS=1 python bench/gpu_benchmark.py --estimate-only             # FLOP and memory estimates, no GPU
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "bench"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import torch  # noqa: E402

from gpu_flops import (MODES, PATCH, VAE_SCALE, estimate_only, measured_flops_meta,  # noqa: E402
                       preset_forward_flops, training_flops)
from models.dit import PRESETS, count_parameters  # noqa: E402

OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)
LOSSES = {"plain": ["loss.kind=plain"], "literal": ["loss.kind=imba", "loss.estimator=literal"],
          "efficient": ["loss.kind=imba", "loss.estimator=efficient"]}


def feature_set(args) -> dict:
    """The precomputed feature shards the loader reads (written once into args.features, reused when complete)."""
    from real_size_features import write_feature_set

    return write_feature_set(args.features, samples=args.samples, samples_per_shard=min(args.samples, 256),
                             resolution=args.resolution, text_dtype="float16", max_text_tokens=args.text_tokens,
                             mean_tokens=args.real_tokens, width=args.caption_channels, seed=args.seed)


def config_for(args, mode: str, batch: int):
    """The run's config: --config with the benchmark's settings and `mode`'s loss as command-line overrides."""
    from imba.training.config import load_config

    overrides = [f"model.preset={args.preset}", f"model.max_text_tokens={args.text_tokens}",
                 f"data.shards={args.features}", f"data.resolution={args.resolution}", f"data.batch_size={batch}",
                 f"data.num_workers={args.num_workers}", "data.precompute=false", f"optim.grad_clip={args.grad_clip}",
                 f"speed.gradient_checkpointing={str(args.gradient_checkpointing).lower()}",
                 f"speed.compile={str(args.compile).lower()}", f"speed.attention={args.attention}",
                 f"train.mixed_precision={'bf16' if args.dtype == 'bf16' else 'no'}", f"train.seed={args.seed}",
                 f"train.output_dir={Path(args.features).parent / 'run'}", "train.trackers=none",
                 f"loss.lam={args.lam}", *LOSSES[mode]]
    return load_config(["--config", str(args.config), *overrides])


class TrainerBench:
    """One DiT, its optimizer, schedule and EMA, prepared by one accelerator, as train.py builds them; each mode's
    loss, loader and `TrainStep` on top (`measure`)."""

    def __init__(self, args, manifest: dict):
        from data.precomputed import PrecomputedFeatures
        from imba.training.build import build_dit, build_optimizer
        from imba.training.distributed import make_accelerator, run_predict
        from imba.training.ema import make_ema
        from models.dit import apply_speed_settings

        self.args = args
        cfg = config_for(args, "plain", args.batch_size)
        self.accelerator = make_accelerator(cfg, Path(cfg.train.output_dir))
        self.device = self.accelerator.device
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = cfg.speed.tf32  # as train.py
        torch.manual_seed(args.seed)
        self.features = PrecomputedFeatures(manifest, self.device)
        dit = build_dit(cfg, self.features)
        optimizer, lr_scheduler = build_optimizer(cfg, dit.parameters(), self.accelerator.num_processes, self.device)
        apply_speed_settings(dit, cfg.speed.attention, cfg.speed.gradient_checkpointing, cfg.speed.compile)
        self.wrapped, self.optimizer, self.lr_scheduler = self.accelerator.prepare(dit, optimizer, lr_scheduler)
        self.dit = self.accelerator.unwrap_model(self.wrapped)
        self.ema = make_ema(self.dit.parameters(), decay=cfg.optim.ema_decay)
        self.objective = cfg.objective.build()
        self.predict = run_predict(self.wrapped, self.dit, self.features.vae_scale)
        self.kernels = {"adamw": {k: self.optimizer.param_groups[0][k] for k in ("fused", "foreach")},
                        "ema_foreach": getattr(self.ema, "foreach", None)}

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def measure(self, mode: str, batch: int) -> dict:
        """Warm-up, then timed steps; on CUDA out of memory, again with half the batch."""
        note = ""
        while True:
            try:
                return self._measure_once(mode, batch) | {"note": note}
            except OOM:
                pass
            self.optimizer.zero_grad(set_to_none=True)  # outside the except block: the traceback's tensors are gone
            gc.collect()
            torch.cuda.empty_cache()
            if batch == 1:
                raise SystemExit(f"{mode}: out of memory even at batch 1; try --gradient-checkpointing")
            note = note or f"OOM at {batch}"
            print(f"  {mode}: out of memory at batch {batch}; retrying with {batch // 2}", flush=True)
            batch //= 2

    def _measure_once(self, mode: str, batch: int) -> dict:
        from data.stream import all_shards
        from imba.training.build import build_training_loss
        from imba.training.guard import DivergenceGuard
        from imba.training.hooks import Hooks
        from imba.training.inputs import make_loader, training_sources
        from imba.training.metrics import MetricWindow
        from imba.training.resume import StreamPosition
        from imba.training.step import TrainStep
        from imba.training.step_batches import StepBatches
        from torch._dynamo.utils import counters

        a, acc = self.args, self.accelerator
        cfg = config_for(a, mode, batch)
        sources = training_sources(cfg, acc, Path(cfg.train.output_dir))
        assert all_shards(sources), "no feature shards"
        loader = make_loader(cfg, acc, sources, StreamPosition(0, 0), self.features.manifest,
                             bucket_divisor=self.features.vae_scale * self.dit.config.patch_size)
        loss_fn = build_training_loss(cfg, self.dit.config.patch_size, same_passes_on_every_rank=False,
                                      num_processes=acc.num_processes)
        guard = DivergenceGuard(acc, cfg.train.max_bad_steps, check_grad_norm=acc.scaler is None)
        train_step = TrainStep(acc, self.wrapped, self.optimizer, self.lr_scheduler, loss_fn, self.predict,
                               Hooks(acc), guard, cfg.optim.grad_clip)
        if self.device.type == "cuda":
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
        graphs = counters["stats"]["unique_graphs"]
        batches, window = StepBatches(iter(loader), cfg.train.grad_accum), MetricWindow()
        times: dict[str, list[float]] = {"loader": [], "input": [], "step": []}
        skipped = 0
        for n in range(1, a.warmup + a.steps + 1):
            self.sync()
            t0 = time.perf_counter()
            batches.fetch()  # the step's micro-batches, read before it as train.py reads them
            if batches.failure:
                raise SystemExit(batches.failure)
            took = {"loader": time.perf_counter() - t0, "input": 0.0, "step": 0.0}
            for got in batches:
                t1 = time.perf_counter()
                latents, cond = self.features.encode_batch(got, self.device)
                self.sync()
                t2 = time.perf_counter()
                noised = self.objective.noise(latents)
                stats, skip = train_step(n, got, noised, cond, self.features.null_like(latents.shape[0]))
                window.add(stats)
                self.sync()
                took["input"] += t2 - t1
                took["step"] += time.perf_counter() - t2
            t3 = time.perf_counter()
            if not skip:
                self.ema.step(self.dit.parameters())
            self.sync()
            took["step"] += time.perf_counter() - t3
            skipped += bool(skip)
            if n > a.warmup:
                for part, seconds in took.items():
                    times[part].append(seconds)
        peak = torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else None
        whole = [sum(parts) for parts in zip(*times.values())]
        return {"mode": mode, "batch": batch, "steps": a.steps, "skipped_steps": skipped,
                "graphs_compiled": counters["stats"]["unique_graphs"] - graphs,
                "median_s": statistics.median(whole), "min_s": min(whole), "max_s": max(whole),
                **{f"{part}_median_s": statistics.median(ts) for part, ts in times.items()}, "peak_bytes": peak}


# ---------------------------------------------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------------------------------------------
def summarise(results: list[dict], forward_per_image: float, lam: float, peak_tflops: float) -> list[dict]:
    """Each result with images/s, its ratio per image to plain, model TFLOP/s and MFU (of the whole step)."""
    plain = next((r for r in results if r["mode"] == "plain"), None)
    out = []
    for r in results:
        tflops = training_flops(r["mode"], r["batch"], forward_per_image, lam) / r["median_s"] / 1e12
        ratio = (r["median_s"] / r["batch"]) / (plain["median_s"] / plain["batch"]) if plain else None
        out.append(r | {"images_per_s": r["batch"] / r["median_s"], "ratio_vs_plain": ratio, "tflops": tflops,
                        "mfu": tflops / peak_tflops})
    return out


def results_table(rows: list[dict]) -> str:
    lines = ["| mode | batch | images/s | step ms | loader wait ms | input ms | ratio vs plain | peak GiB | TFLOP/s | "
             "MFU % |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        batch = f"{r['batch']} ({r['note']})" if r["note"] else str(r["batch"])
        ratio = "–" if r["ratio_vs_plain"] is None else f"{r['ratio_vs_plain']:.2f}"
        peak = "n/a" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**30:.1f}"
        lines.append(f"| {r['mode']} | {batch} | {r['images_per_s']:.1f} | {r['step_median_s'] * 1e3:.1f} | "
                     f"{r['loader_median_s'] * 1e3:.1f} | {r['input_median_s'] * 1e3:.1f} | {ratio} | {peak} | "
                     f"{r['tflops']:.3g} | {100 * r['mfu']:.3g} |")
    return "\n".join(lines)


def environment(device: torch.device) -> dict:
    import diffusers

    gpu = (torch.cuda.get_device_name(device) if device.type == "cuda"
           else f"CPU ({platform.machine()}, {os.cpu_count()} cores)")
    return {"device": gpu, "torch": torch.__version__, "cuda": torch.version.cuda if device.type == "cuda" else None,
            "diffusers": diffusers.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def compile_note() -> str:
    return " (TORCH_COMPILE_DISABLE=1: not compiled)" if os.environ.get("TORCH_COMPILE_DISABLE") == "1" else ""


def describe(env: dict) -> str:
    cuda = f", CUDA {env['cuda']}" if env["cuda"] else ""
    return f"{env['device']}; torch {env['torch']}{cuda}; diffusers {env['diffusers']}; {env['date']}"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "1b_256.yaml", help="the run's config")
    ap.add_argument("--preset", default="1b", choices=list(PRESETS))
    ap.add_argument("--resolution", type=int, default=256, help="pixels; latents are resolution/8 (SD-VAE)")
    ap.add_argument("--batch-size", type=int, default=None, help="per GPU; default 64 on CUDA, 4 on CPU; halved on OOM")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per mode (medians reported)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    ap.add_argument("--gradient-checkpointing", action="store_true")
    ap.add_argument("--compile", action="store_true", help="speed.compile=true, as a run would set it")
    ap.add_argument("--attention", default="sdpa", help="speed.attention")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"], help="train.mixed_precision bf16, or no")
    ap.add_argument("--text-tokens", type=int, default=120, help="model.max_text_tokens")
    ap.add_argument("--real-tokens", type=float, default=90, help="mean caption length of the written features")
    ap.add_argument("--caption-channels", type=int, default=4096, help="width of the written text states (T5-XXL)")
    ap.add_argument("--features", type=Path, default=None,
                    help="folder of the feature shards (written once; default: bench/gpu_features/<size>)")
    ap.add_argument("--samples", type=int, default=None, help="samples written (default 512 on CUDA, 32 on CPU)")
    ap.add_argument("--num-workers", type=int, default=None, help="data.num_workers (default 8 on CUDA, 0 on CPU)")
    ap.add_argument("--lam", type=float, default=0.9)
    ap.add_argument("--grad-clip", type=float, default=1.0, help="optim.grad_clip, as configs/1b_256.yaml")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="peak dense bf16 TFLOP/s (H100/H200 SXM: 989)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-flop-check", action="store_true", help="skip the FlopCounterMode check at start-up")
    ap.add_argument("--estimate-only", action="store_true", help="print FLOP/memory estimates and exit (no GPU)")
    ap.add_argument("--out", type=Path, default=None, help="append the table and environment to this Markdown file")
    ap.add_argument("--json", type=Path, default=None, help="write the settings and results to this JSON file")
    args = ap.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        ap.error(f"--modes: unknown {bad}; choose from {','.join(MODES)}")
    args.modes = modes
    if args.resolution % (VAE_SCALE * PATCH):
        ap.error(f"--resolution {args.resolution} must be a multiple of {VAE_SCALE * PATCH}")
    if args.estimate_only:
        return args
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda but torch sees no CUDA device; for a CPU smoke run add: "
                 "--device cpu --preset tiny --resolution 64 --steps 3 --warmup 1")
    if args.device == "cpu" and args.preset == "1b":
        ap.error("the 1b preset is far too slow on CPU; for a smoke run use: "
                 "--device cpu --preset tiny --resolution 64 --steps 3 --warmup 1")
    cuda = args.device == "cuda"
    if args.device == "cpu":
        os.environ["ACCELERATE_USE_CPU"] = "true"  # accelerate's own switch: the run on the CPU
    args.batch_size = args.batch_size or (64 if cuda else 4)
    args.samples = args.samples or (512 if cuda else 32)
    args.num_workers = (8 if cuda else 0) if args.num_workers is None else args.num_workers
    args.features = (args.features or ROOT / "bench" / "gpu_features" /
                     f"{args.resolution}px-{args.text_tokens}x{args.caption_channels}-{args.samples}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.estimate_only:
        estimate_only(args)
        return 0
    t_start = time.perf_counter()
    manifest = feature_set(args)
    forward = preset_forward_flops(args.preset, args.resolution, args.text_tokens, args.caption_channels)["total"]
    flop_check = None
    if not args.no_flop_check:
        counted, _ = measured_flops_meta(args.preset, args.resolution, args.text_tokens, args.caption_channels)
        flop_check = counted / forward
        print(f"FLOP check: analytic {forward / 1e9:.3f} GFLOP/image forward, FlopCounterMode (meta) "
              f"{counted / 1e9:.3f} (ratio {flop_check:.4f})", flush=True)
    bench = TrainerBench(args, manifest)
    env = environment(bench.device)
    params = count_parameters(args.preset, args.resolution // VAE_SCALE, args.caption_channels)
    n_tokens = (args.resolution // VAE_SCALE // PATCH) ** 2
    print(f"{describe(env)}\npreset {args.preset} ({params / 1e6:.1f} M params), {args.resolution} px → {n_tokens} "
          f"image tokens, {args.text_tokens} text tokens (~{args.real_tokens:g} real); {args.dtype}; batch "
          f"{args.batch_size}; checkpointing {'on' if args.gradient_checkpointing else 'off'}; compile "
          f"{'on' if args.compile else 'off'}{compile_note() if args.compile else ''}; AdamW "
          f"{bench.kernels['adamw']}, EMA foreach {bench.kernels['ema_foreach']}; {args.num_workers} loader workers",
          flush=True)
    results = []
    for mode in args.modes:
        t0 = time.perf_counter()
        r = bench.measure(mode, args.batch_size)
        results.append(r)
        print(f"  {mode}: batch {r['batch']}, median {r['median_s'] * 1e3:.1f} ms (step {r['step_median_s'] * 1e3:.1f},"
              f" loader wait {r['loader_median_s'] * 1e3:.1f}, input {r['input_median_s'] * 1e3:.1f}) "
              f"[{time.perf_counter() - t0:.0f} s]", flush=True)
    rows = summarise(results, forward, args.lam, args.peak_tflops)
    table = results_table(rows)
    command = " ".join(["python", "bench/gpu_benchmark.py", *(sys.argv[1:] if argv is None else argv)])
    total = time.perf_counter() - t_start
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        ratios = {f"{r['mode']}_vs_plain": r["ratio_vs_plain"] for r in rows if r["mode"] != "plain"}
        args.json.write_text(json.dumps(
            {"benchmark": "gpu_benchmark", "command": command, "environment": env, "settings": settings,
             "kernels": bench.kernels, "compiled": args.compile and not compile_note(),
             "forward_flops_per_image": forward, "flop_check_ratio": flop_check,
             "results": rows, "ratios": ratios, "total_s": total},
            indent=1, default=lambda v: None if isinstance(v, float) and math.isnan(v) else str(v)) + "\n")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with args.out.open("a") as f:
            f.write(f"\n## {args.preset}, {args.resolution} px, {args.dtype}, checkpointing "
                    f"{'on' if args.gradient_checkpointing else 'off'}, compile {'on' if args.compile else 'off'}"
                    f"{compile_note() if args.compile else ''}\n\n"
                    f"{describe(env)}  \n`{command}`  \nforward {forward / 1e9:.4g} GFLOP/image; MFU vs "
                    f"{args.peak_tflops:g} TFLOP/s; total {total:.0f} s\n\n{table}\n")
    print(f"\n{table}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
