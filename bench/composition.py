"""Synthetic composition benchmark: does IMBA help a DiT compose rare concept pairs? (paper Tab. 1/3)

    python bench/composition.py                 # full: 7 variants × 3 seeds, evaluated at 2 lengths (≈ 50 min, 2 cores)
    python bench/composition.py --quick         # 1 seed, shorter (≈ 8 min)
    python bench/composition.py --variants plain imba_cond --seeds 0 1 --steps 300 1200

World (bench/composition_scenes.py): 16 × 16 scenes with one object, "a <colour> <shape>", 5 colours × 5 shapes,
both Zipf-distributed, so pair frequencies are long-tailed; 4 pairs are held out of training. An oracle CNN
trained on fresh renders reads the colour and shape of every generated image (its accuracy is reported).

Every variant trains the same DiT ("micro" preset, pixel space, patch 4 → 16 tokens) with the same data stream,
noise and initialisation per seed (rectified flow, AdamW 2e-3 with 100 warm-up steps, batch 32, gradient clipping 1,
diffusers EMA 0.999 with its default warm-up), and differs only in its loss:

- plain:          MSE with 10 % caption dropout (the baseline)
- imba_target:    IMBA, token level, D from the target (the paper's form), literal estimator
- imba_cond:      IMBA, token level, D from the conditional prediction (unbiased optimum, docs/method.md)
- imba_sample:    IMBA, one weight per sample (paper ablation), reference target
- inverse_freq:   plain MSE re-weighted per sample by the inverse frequency of its concepts (offline re-balancing;
                  frequencies from data.concepts statistics over the training captions)
- imba_cond_efficient: imba_cond with the efficient (unbiased, ≈ 1.3× plain cost) estimator
- imba_cond_norm:       imba_cond with D divided by its batch mean (normalize=batch_mean)

Evaluation at each length: for each of the 25 pairs, N samples from the EMA weights (DPM-Solver++ 20 steps,
classifier-free guidance 3); success = the oracle reads the prompted colour and shape. Reported per bucket
(head / torso / tail by training pair frequency, and held-out): mean over seeds with a 95 % t confidence interval.
Also logged: the IMBA distance per bucket during training (the paper's Fig. 6 monitor).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for path in (str(REPO), str(REPO / "bench")):
    if path not in sys.path:
        sys.path.insert(0, path)

import torch  # noqa: E402

from composition_scenes import (COLOURS, SHAPES, Oracle, PairWorld, WordEncoder, caption, draw_pairs,  # noqa: E402
                                render, train_oracle)

VARIANTS = {
    "plain": dict(kind="plain"),
    "imba_target": dict(kind="imba", reference="target"),
    "imba_cond": dict(kind="imba", reference="cond"),
    "imba_sample": dict(kind="imba_sample", reference="target"),
    "inverse_freq": dict(kind="plain", reweight=True),
    "imba_cond_efficient": dict(kind="imba", reference="cond", estimator="efficient"),
    "imba_cond_norm": dict(kind="imba", reference="cond", normalize="batch_mean"),
}
DEFAULT_VARIANTS = list(VARIANTS)
BUCKETS = ("head", "torso", "tail", "held_out")
PATCH = 4
T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def relative_cost(variant: str) -> float:
    """Step cost relative to plain (bench/step_time_results.md): literal IMBA runs 2B rows, efficient ≈ 1.3 B."""
    spec = VARIANTS[variant]
    if spec["kind"] == "plain":
        return 1.0
    return 1.3 if spec.get("estimator") == "efficient" else 2.0


def inverse_frequency_weights(train_pairs: list[tuple[int, int]]) -> dict[tuple[int, int], float]:
    """Per-pair sample weight = mean over its concepts of 1 / (concept frequency), normalised to mean 1 over the
    training captions; concept counts come from the project's concept statistics over the captions."""
    from data.concepts import count_concepts

    stats = count_concepts([caption(p) for p in train_pairs])
    total = len(train_pairs)
    raw = {p: 0.5 * (total / stats.counts[COLOURS[p[0]]] + total / stats.counts[SHAPES[p[1]]])
           for p in set(train_pairs)}
    mean = sum(raw[p] for p in train_pairs) / total
    return {p: w / mean for p, w in raw.items()}


@torch.no_grad()
def generate(model, objective, text: WordEncoder, pairs, seed: int, steps: int = 20, guidance: float = 3.0,
             batch_size: int = 200) -> torch.Tensor:
    """Classifier-free-guided samples, one per pair entry; image i's noise depends only on (seed, i)."""
    from models.dit import predict

    scheduler = objective.sampling_scheduler()
    images = []
    for start in range(0, len(pairs), batch_size):
        chunk = pairs[start:start + batch_size]
        b = len(chunk)
        noise = torch.stack([torch.randn(3, 16, 16, generator=torch.Generator().manual_seed(seed * 100003 + start + i))
                             for i in range(b)])
        cond, null = text.encode_pairs(chunk), text.null(b)
        embeds, mask = torch.cat([cond[0], null[0]]), torch.cat([cond[1], null[1]])
        scheduler.set_timesteps(steps)
        x = noise * scheduler.init_noise_sigma
        for t in scheduler.timesteps:
            out = predict(model, torch.cat([x, x]), t.expand(2 * b), embeds, mask, 1)
            pc, pu = out.chunk(2)
            x = scheduler.step(pu + guidance * (pc - pu), t, x).prev_sample
        images.append(x.clamp(-1, 1))
    return torch.cat(images)


def evaluate(model, objective, text, oracle: Oracle, world: PairWorld, per_pair: int, seed: int) -> dict:
    """Success rate per pair (keyed by caption) at this point of training."""
    prompts = [p for p in world.pairs for _ in range(per_pair)]
    images = generate(model, objective, text, prompts, seed)
    colours, shapes = oracle.read(images)
    ok = (colours == torch.tensor([c for c, _ in prompts])) & (shapes == torch.tensor([s for _, s in prompts]))
    rates = {caption(p): ok[i * per_pair:(i + 1) * per_pair].float().mean().item() for i, p in enumerate(world.pairs)}
    return rates, images


def save_grid(images: torch.Tensor, per_pair: int, path: Path, columns: int = 4, zoom: int = 4) -> None:
    """One row per pair (in PairWorld order: colour-major), the first `columns` samples of each, upscaled."""
    from PIL import Image

    rows = images.shape[0] // per_pair
    grid = Image.new("RGB", (columns * 16 * zoom, rows * 16 * zoom), "white")
    for r in range(rows):
        for c in range(min(columns, per_pair)):
            pixels = ((images[r * per_pair + c] + 1) * 127.5).round().clamp(0, 255).byte().permute(1, 2, 0)
            tile = Image.fromarray(pixels.numpy()).resize((16 * zoom, 16 * zoom), Image.Resampling.NEAREST)
            grid.paste(tile, (c * 16 * zoom, r * 16 * zoom))
    grid.save(path)


def run_one(job: dict) -> dict:
    """Train one (variant, seed) and evaluate it at every length in job["steps"]."""
    torch.set_num_threads(1)
    from diffusers.training_utils import EMAModel

    from imba.objectives import RectifiedFlow
    from imba.training_loss import TrainingLoss
    from models.dit import build_transformer, predict

    variant, seed, lengths = job["variant"], job["seed"], sorted(job["steps"])
    spec = VARIANTS[variant]
    world, text = PairWorld(), WordEncoder(seed=0)
    oracle = Oracle()
    oracle.load_state_dict(torch.load(job["oracle"], weights_only=True))

    data_gen = torch.Generator().manual_seed(seed)  # the data set, batches and noise: identical across variants
    train_pairs = draw_pairs(world, job["pool"], data_gen)
    pool = render(train_pairs, seed, "train")
    pair_index = torch.tensor([world.pairs.index(p) for p in train_pairs])
    bucket_of = [world.buckets[p] for p in world.pairs]
    weight_of_pair = None
    if spec.get("reweight"):
        weights = inverse_frequency_weights(train_pairs)
        weight_of_pair = torch.tensor([weights.get(p, 0.0) for p in world.pairs])

    torch.manual_seed(seed)
    model = build_transformer("micro", 16, text.dim, in_channels=3, patch_size=PATCH)
    ema = EMAModel(model.parameters(), decay=0.999)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.0)
    warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 100))
    objective = RectifiedFlow()
    loss_fn = TrainingLoss(spec["kind"], patch_size=PATCH, reference=spec.get("reference", "target"),
                           estimator=spec.get("estimator", "literal"), normalize=spec.get("normalize", "none"))
    drop_gen = torch.Generator().manual_seed(seed + 1)  # caption dropout draws, separate from the data stream

    def predict_fn(noisy, timesteps, embeds, mask):
        return predict(model, noisy, timesteps, embeds, mask, 1)

    distance = {b: [0.0, 0] for b in BUCKETS}  # IMBA distance per bucket (sum, count), the Fig. 6 monitor
    results, losses, start = {}, [], time.perf_counter()
    for step in range(1, lengths[-1] + 1):
        idx = torch.randint(len(train_pairs), (job["batch_size"],), generator=data_gen)
        noised = objective.noise(pool[idx], generator=data_gen)
        cond = text.encode_pairs([train_pairs[i] for i in idx.tolist()])
        extra = {} if weight_of_pair is None else {"sample_weights": weight_of_pair[pair_index[idx]]}
        loss, stats = loss_fn(predict_fn, noised, cond, text.null(len(idx)), generator=drop_gen, **extra)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        warmup.step()
        ema.step(model.parameters())
        losses.append(loss.item())
        if "distance_per_sample" in stats:
            for i, d in zip(idx.tolist(), stats["distance_per_sample"].tolist()):
                if math.isfinite(d):
                    bucket = bucket_of[pair_index[i]]
                    distance[bucket][0] += d
                    distance[bucket][1] += 1
        if step in lengths:
            train_seconds = time.perf_counter() - start
            ema.store(model.parameters())
            ema.copy_to(model.parameters())
            model.eval()
            per_pair, images = evaluate(model, objective, text, oracle, world, job["per_pair"], seed=1000 + seed)
            if job.get("grid_dir"):
                save_grid(images, job["per_pair"], Path(job["grid_dir"]) / f"samples_{variant}_{step}.png")
            model.train()
            ema.restore(model.parameters())
            results[step] = {
                "per_pair": per_pair,
                "train_seconds": train_seconds,
                "final_loss": statistics.fmean(losses[-50:]),
                "distance_per_bucket": {b: (s / n if n else None) for b, (s, n) in distance.items()},
            }
    return {"variant": variant, "seed": seed, "settings": {k: job[k] for k in JOB_SETTINGS}, "results": results}


JOB_SETTINGS = ("steps", "per_pair", "batch_size", "pool")


def _run_path(runs_dir: Path, variant: str, seed: int) -> Path:
    return runs_dir / f"{variant}-seed{seed}.json"


def save_run(runs_dir: Path, run: dict) -> None:
    path = _run_path(runs_dir, run["variant"], run["seed"])
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(run))
    tmp.replace(path)


def saved_run(runs_dir: Path, job: dict) -> dict | None:
    """A finished run of this job with the same settings, or None."""
    path = _run_path(runs_dir, job["variant"], job["seed"])
    if not path.is_file():
        return None
    run = json.loads(path.read_text())
    if run.get("settings") != {k: job[k] for k in JOB_SETTINGS}:
        return None
    run["results"] = {int(k): v for k, v in run["results"].items()}
    return run


def bucket_success(per_pair: dict, world: PairWorld) -> dict:
    """Mean success over the pairs of each bucket, and over all seen pairs."""
    out = {}
    for bucket in BUCKETS:
        rates = [per_pair[caption(p)] for p in world.pairs if world.buckets[p] == bucket]
        out[bucket] = statistics.fmean(rates)
    out["all_seen"] = statistics.fmean(per_pair[caption(p)] for p in world.pairs if world.buckets[p] != "held_out")
    return out


def mean_ci(values: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95 % t confidence interval over seeds (0 for a single value)."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, 0.0
    return mean, T_975.get(len(values) - 1, 1.96) * statistics.stdev(values) / math.sqrt(len(values))


def summarise(runs: list[dict], world: PairWorld) -> dict:
    """{length: {variant: {bucket: (mean, ci)}}} over seeds."""
    table: dict = {}
    for run in runs:
        for length, result in run["results"].items():
            per_bucket = bucket_success(result["per_pair"], world)
            slot = table.setdefault(int(length), {}).setdefault(run["variant"], {})
            for bucket, value in per_bucket.items():
                slot.setdefault(bucket, []).append(value)
    return {length: {variant: {b: mean_ci(v) for b, v in buckets.items()} for variant, buckets in variants.items()}
            for length, variants in table.items()}


def markdown_table(summary: dict, variants: list[str], seeds: int) -> str:
    columns = ("head", "torso", "tail", "held_out", "all_seen")
    lines = []
    for length in sorted(summary):
        lines.append(f"\n**{length} steps** (composition success %, mean over {seeds} seed(s) ± 95 % CI)\n")
        lines.append("| variant | " + " | ".join(columns) + " |")
        lines.append("|---" * (len(columns) + 1) + "|")
        for variant in variants:
            cells = summary[length].get(variant)
            if cells:
                lines.append(f"| {variant} | " + " | ".join(f"{100 * cells[c][0]:.1f} ± {100 * cells[c][1]:.1f}"
                                                           for c in columns) + " |")
    return "\n".join(lines) + "\n"


def bar_plot(summary: dict, variants: list[str], path: Path) -> None:
    """Grouped bars: one panel per length, one group per bucket, one bar per variant, whiskers = 95 % CI
    (imba.plots.plot_grouped_bars)."""
    from imba.plots import plot_grouped_bars

    panels = {f"{length} training steps": {v: summary[length][v] for v in variants if v in summary[length]}
              for length in sorted(summary)}
    plot_grouped_bars(panels, BUCKETS, variants, path, ylabel="composition success (%)", scale=100, ylim=(0, 100),
                      title="Composition success per pair bucket (mean over seeds, whiskers: 95 % CI)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 seed, 400/1000 steps, 8 samples per pair")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=DEFAULT_VARIANTS)
    parser.add_argument("--seeds", nargs="+", type=int, default=None, help="default 0 1 2 (quick: 0)")
    parser.add_argument("--steps", nargs="+", type=int, default=None,
                        help="evaluate after these many steps (default 1000 2000; quick: 400 1000)")
    parser.add_argument("--per-pair", type=int, default=None, help="samples per pair (default 24; quick: 8)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--pool", type=int, default=16384, help="training images per seed")
    parser.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1),
                        help="parallel training processes (one thread each)")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "composition_results")
    args = parser.parse_args(argv)
    seeds = args.seeds or ([0] if args.quick else [0, 1, 2])
    lengths = args.steps or ([400, 1000] if args.quick else [1000, 2000])
    per_pair = args.per_pair or (8 if args.quick else 24)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()

    torch.set_num_threads(max(1, args.workers))
    oracle_path = args.out / "oracle.pt"
    oracle_report_path = args.out / "oracle.json"
    if oracle_path.is_file() and oracle_report_path.is_file():
        oracle_report = json.loads(oracle_report_path.read_text())
    else:
        oracle, oracle_report = train_oracle()
        torch.save(oracle.state_dict(), oracle_path)
        oracle_report_path.write_text(json.dumps(oracle_report, indent=1))
    print(f"oracle: pair accuracy {100 * oracle_report['pair_accuracy']:.2f} % on "
          f"{oracle_report['test_images']} fresh renders", flush=True)

    jobs = [dict(variant=v, seed=s, steps=lengths, per_pair=per_pair, batch_size=args.batch_size, pool=args.pool,
                 oracle=str(oracle_path), grid_dir=str(args.out) if s == seeds[0] else None)
            for s in seeds for v in args.variants]
    jobs.sort(key=lambda j: -relative_cost(j["variant"]))  # longest first: better packing onto the workers
    # every finished (variant, seed) is saved at once: an interrupted benchmark reruns only the missing ones
    runs_dir = args.out / "runs"
    runs_dir.mkdir(exist_ok=True)
    runs, todo = [], []
    for job in jobs:
        done = saved_run(runs_dir, job)
        (runs if done else todo).append(done or job)
    if runs:
        print(f"reusing {len(runs)} finished runs from {runs_dir}", flush=True)
    context = multiprocessing.get_context("spawn")
    with context.Pool(args.workers) as pool:
        for run in pool.imap_unordered(run_one, todo):
            save_run(runs_dir, run)
            runs.append(run)
            last = run["results"][max(lengths)]
            print(f"[{time.perf_counter() - started:6.0f} s] {run['variant']} seed {run['seed']}: "
                  f"{last['train_seconds']:.0f} s training, final loss {last['final_loss']:.4f}", flush=True)
        pool.close()  # let the workers exit on their own: the terminate() of `with` can deadlock on idle ones
        pool.join()

    world = PairWorld()
    summary = summarise(runs, world)
    table = markdown_table(summary, args.variants, len(seeds))
    bar_plot(summary, args.variants, args.out / "composition.png")
    payload = {
        "command": "python bench/composition.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "seeds": seeds, "lengths": lengths, "per_pair": per_pair, "variants": args.variants,
        "oracle": oracle_report, "wall_seconds": time.perf_counter() - started,
        "buckets": {caption(p): b for p, b in world.buckets.items()},
        "train_frequency": {caption(p): world.prob(p) for p in world.pairs},
        "summary": {str(k): v for k, v in summary.items()}, "runs": runs,
    }
    (args.out / "results.json").write_text(json.dumps(payload, indent=1))
    (args.out / "results.md").write_text(table)
    print(table)
    print(f"wrote {args.out}/results.json, results.md, composition.png in {payload['wall_seconds'] / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
