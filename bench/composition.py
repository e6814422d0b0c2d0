"""Synthetic composition benchmark: does IMBA close the gap that data imbalance opens? (paper Tab. 1/3)

    python bench/composition.py                 # control, plain and three IMBA forms × 3 seeds (54 min, 2 cores)
    python bench/composition.py --variants all  # every form in VARIANTS (hours on 2 cores)
    python bench/composition.py --quick         # 1 seed, plain / plain_balanced / the best IMBA form, 1,000 steps
    python bench/composition.py --variants plain plain_balanced imba_cond --seeds 0 1 --steps 600

World (bench/composition_scenes.py): 16 × 32 scenes of two objects, "a <colour> <shape> and a <colour> <shape>",
8 colours × 5 shapes, each Zipf(2)-distributed, built from a pool of single-object tiles in which head pairs have
thousands of tiles and tail pairs 8; 6 pairs are held out of training. An oracle CNN reads each half of a generated
scene (its accuracy is reported).

The control comes first: `plain_balanced` trains the plain loss on a pair-balanced stream of the same tiles (every
seen pair equally often). The gap between it and `plain` is what a balancing method can close; every other form is
reported as the fraction of that gap it closes, at equal steps and at equal compute.

Every variant trains the same DiT ("micro" preset, pixel space, patch 4 → 32 tokens) with, per seed, the same tile
pool, initial weights and optimiser (AdamW 2e-3 with 100 warm-up steps, batch 32, gradient clipping 1, diffusers EMA
0.999 with its default warm-up); the variants differ in their loss, objective or stream (VARIANTS).

Evaluation after each length: for each of the 40 pairs, N two-object prompts with the pair on one side and a head
pair on the other; N samples from the EMA weights (DPM-Solver++ 10 steps, classifier-free guidance 3). A prompt
succeeds when the oracle reads both objects right. The oracle is shipped (`bench/composition_oracle.pt`, its accuracy
beside it in `composition_oracle.json`), so every run is judged by the same weights; `--train-oracle` trains one
anew. Reported per bucket of the probed pair (head / torso / tail by
training frequency, held-out): mean over seeds with a 95 % t interval, and the failure kinds. Logged during
training: the IMBA distance per bucket (the paper's Fig. 6 monitor), from the tokens of each object's half.
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
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for path in (str(REPO), str(REPO / "bench")):
    if path not in sys.path:
        sys.path.insert(0, path)

import torch  # noqa: E402

from composition_scenes import (BUCKETS, COLOURS, FAILURES, SHAPES, TILE, Oracle, PairWorld,  # noqa: E402
                                TilePool, WordEncoder, bucket_success, judge, pair_name, probe_prompts, train_oracle)

# kind / reference / normalize / estimator: imba.training_loss.TrainingLoss; balanced: the pair-balanced stream;
# reweight: plain MSE weighted per scene by the mean of its two objects' weights, either the inverse frequency of
# their concepts (offline re-weighting as a user would do it) or the exact importance ratio of the balanced stream,
# p_balanced(pair) / p_pool(pair) (the best any per-sample re-weighting of this stream can do in expectation);
# objective: flow or ddpm (ε); hues / bursty / jitter: the data levers of composition_scenes (colour diversity:
# HUES-coloured tiles, half as many as the pool's; burstiness: the share of scenes whose second object takes the
# first one's colour; latent intervention: the largest hue rotation of a training tile, in turns)
VARIANTS = {
    "plain": dict(kind="plain"),
    "plain_balanced": dict(kind="plain", balanced=True),
    "inverse_freq": dict(kind="plain", reweight="inverse_freq"),
    "importance": dict(kind="plain", reweight="importance"),
    "imba_target": dict(kind="imba", reference="target"),
    "imba_sample": dict(kind="imba_sample", reference="target"),
    "imba_target_tnorm": dict(kind="imba", reference="target", normalize="timestep_mean"),
    "imba_cond": dict(kind="imba", reference="cond"),
    "imba_cond_bnorm": dict(kind="imba", reference="cond", normalize="batch_mean"),
    "imba_cond_tnorm": dict(kind="imba", reference="cond", normalize="timestep_mean"),
    "imba_target_efficient": dict(kind="imba", reference="target", estimator="efficient"),
    "imba_target_tnorm_efficient": dict(kind="imba", reference="target", normalize="timestep_mean",
                                        estimator="efficient"),
    "imba_cond_tnorm_efficient": dict(kind="imba", reference="cond", normalize="timestep_mean",
                                      estimator="efficient"),
    "plain_eps": dict(kind="plain", objective="ddpm"),
    "plain_balanced_eps": dict(kind="plain", balanced=True, objective="ddpm"),
    "imba_target_eps": dict(kind="imba", reference="target", objective="ddpm"),
    "imba_target_tnorm_eps": dict(kind="imba", reference="target", normalize="timestep_mean", objective="ddpm"),
    "imba_cond_tnorm_eps": dict(kind="imba", reference="cond", normalize="timestep_mean", objective="ddpm"),
    "plain_hues": dict(kind="plain", hues=0.5),
    "plain_bursty": dict(kind="plain", bursty=0.5),
    "plain_jitter": dict(kind="plain", jitter=0.05),
}
# the default takes 54 min on 2 cores (measured from nothing, bench/README.md); `--variants all` runs every
# form (hours)
DEFAULT_VARIANTS = ["plain", "plain_balanced", "imba_target", "imba_target_tnorm", "imba_target_tnorm_efficient"]
QUICK_VARIANTS = ["plain", "plain_balanced", "imba_target_tnorm"]  # the control, and the best IMBA form measured
# the data-levers experiment (`--levers`): the controls, the IMBA form to compare at equal compute, the three levers
LEVER_VARIANTS = ["plain", "plain_balanced", "imba_target_tnorm_efficient", "plain_hues", "plain_bursty",
                  "plain_jitter"]
LEVERS = ("hues", "bursty", "jitter")
# plain, its balanced control and the data levers also train on to the lengths that give them the compute of each
# IMBA variant in the benchmark (1.3× and 2× each length): the equal-compute references
CONTROLS = {"flow": ("plain", "plain_balanced"), "ddpm": ("plain_eps", "plain_balanced_eps")}
PATCH = 4
MONITOR_EVERY = 50  # steps per point of the distance-per-bucket curve
# DPM-Solver++ steps per evaluation sample: reading the same noise at 10 and at 20 steps moved bucket success by
# at most 2.0 points on six saved models (bench/README.md, "Time."), at half the cost
SAMPLING_STEPS = 10
ORACLE = REPO / "bench" / "composition_oracle.pt"  # the judge's weights; its report: the same name with .json
T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def objective_of(variant: str) -> str:
    return VARIANTS[variant].get("objective", "flow")


def relative_cost(variant: str) -> float:
    """Step cost relative to plain in FLOPs: literal IMBA runs 2B rows; efficient B + (1 − λ)·0 + λ·B without
    backward ≈ 1.3 B (bench/step_time_results.md measures 1.3×)."""
    spec = VARIANTS[variant]
    if spec["kind"] == "plain":
        return 1.0
    return 1.3 if spec.get("estimator") == "efficient" else 2.0


def equal_compute_steps(length: int, cost: float) -> int:
    return round(length * cost)


def is_lever(variant: str) -> bool:
    return any(VARIANTS[variant].get(lever) for lever in LEVERS)


def train_lengths(variant: str, lengths: list[int], equal_compute: bool = True,
                  factors: tuple[float, ...] = (1.0, 1.3, 2.0)) -> list[int]:
    """Where a run is evaluated: at each length, and for the controls and the data levers also at each length
    times each of `factors` (the step costs of the benchmark's variants: their equal-compute lengths)."""
    if not equal_compute or (variant not in CONTROLS[objective_of(variant)] and not is_lever(variant)):
        return sorted(lengths)
    return sorted({equal_compute_steps(n, c) for n in lengths for c in (1.0, *factors)})


def inverse_frequency_weights(pool_pairs: list[tuple[int, int]]) -> dict[tuple[int, int], float]:
    """Per-object weight = mean over its concepts of 1 / (concept frequency), normalised to mean 1 over the pool's
    tiles; concept counts come from the project's concept statistics over the tiles' captions. A scene's weight is
    the mean of its two objects' weights."""
    from data.concepts import count_concepts

    stats = count_concepts([f"a {pair_name(p)}" for p in pool_pairs])
    total = len(pool_pairs)
    raw = {p: 0.5 * (total / stats.counts[COLOURS[p[0]]] + total / stats.counts[SHAPES[p[1]]])
           for p in set(pool_pairs)}
    mean = sum(raw[p] for p in pool_pairs) / total
    return {p: w / mean for p, w in raw.items()}


def importance_weights(pool_pairs: list[tuple[int, int]]) -> dict[tuple[int, int], float]:
    """Per-object weight p_balanced(pair) / p_pool(pair): weighting the long-tailed stream by it gives, in
    expectation, the loss of the pair-balanced stream (mean 1 over the pool's tiles by construction)."""
    counts = Counter(pool_pairs)
    return {p: len(pool_pairs) / (len(counts) * n) for p, n in counts.items()}


@torch.no_grad()
def generate(model, objective, text: WordEncoder, left, right, seed: int, steps: int = SAMPLING_STEPS,
             guidance: float = 3.0, batch_size: int = 256) -> torch.Tensor:
    """Classifier-free-guided scenes, one per (left, right) prompt; scene i's noise depends only on (seed, i)."""
    from models.dit import predict

    scheduler = objective.sampling_scheduler()
    images = []
    for start in range(0, len(left), batch_size):
        b = len(left[start:start + batch_size])
        noise = torch.stack([torch.randn(3, TILE, 2 * TILE, generator=torch.Generator().manual_seed(
            seed * 100003 + start + i)) for i in range(b)])
        cond, null = text.encode(left[start:start + b], right[start:start + b]), text.null(b)
        embeds, mask = torch.cat([cond[0], null[0]]), torch.cat([cond[1], null[1]])
        scheduler.set_timesteps(steps)
        x = noise * scheduler.init_noise_sigma
        for t in scheduler.timesteps:
            out = predict(model, torch.cat([x, x]), t.expand(2 * b), embeds, mask, 1)
            pc, pu = out.chunk(2)
            x = scheduler.step(pu + guidance * (pc - pu), t, x).prev_sample
        images.append(x.clamp(-1, 1))
    return torch.cat(images)


def evaluate(model, objective, text, oracle: Oracle, world: PairWorld, per_pair: int, seed: int,
             sampling_steps: int = SAMPLING_STEPS):
    """Per probed pair (keyed by its name): success rate and the count of each failure kind; and the scenes."""
    prompts = probe_prompts(world, per_pair)
    left, right = [p[1] for p in prompts], [p[2] for p in prompts]
    images = generate(model, objective, text, left, right, seed, steps=sampling_steps)
    colours, shapes = oracle.read_scenes(images)
    ok, kinds = judge(colours, shapes, left, right)
    success, failures = {}, {}
    for i, pair in enumerate(world.pairs):
        rows = slice(i * per_pair, (i + 1) * per_pair)
        success[pair_name(pair)] = ok[rows].float().mean().item()
        failures[pair_name(pair)] = {k: kinds[rows].count(k) for k in FAILURES}
    return success, failures, images


def save_grid(images: torch.Tensor, per_pair: int, path: Path, columns: int = 4, zoom: int = 3) -> None:
    """One row per pair (in PairWorld order: colour-major), the first `columns` scenes of each, upscaled."""
    from PIL import Image

    rows, h, w = images.shape[0] // per_pair, images.shape[2] * zoom, images.shape[3] * zoom
    gap = 2
    grid = Image.new("RGB", (columns * (w + gap), rows * (h + gap)), "white")
    for r in range(rows):
        for c in range(min(columns, per_pair)):
            pixels = ((images[r * per_pair + c] + 1) * 127.5).round().clamp(0, 255).byte().permute(1, 2, 0)
            tile = Image.fromarray(pixels.numpy()).resize((w, h), Image.Resampling.NEAREST)
            grid.paste(tile, (c * (w + gap), r * (h + gap)))
    grid.save(path)


def half_distances(per_token: torch.Tensor, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean IMBA distance over the tokens of the left and of the right half of each scene, each (B,)."""
    grid = per_token.reshape(per_token.shape[0], rows, cols)
    return grid[:, :, : cols // 2].mean(dim=(1, 2)), grid[:, :, cols // 2:].mean(dim=(1, 2))


def run_one(job: dict) -> dict:
    """Train one (variant, seed) and evaluate it at every length in job["steps"]."""
    torch.set_num_threads(1)
    from diffusers.training_utils import EMAModel

    from composition_diagnostics import stream_objects, world_diagnostics
    from composition_scenes import HUES, rotate_hue

    from imba.eval.representations import attribute_nmi
    from imba.objectives import build_objective
    from imba.training_loss import TrainingLoss
    from models.dit import build_transformer, predict

    variant, seed, lengths = job["variant"], job["seed"], sorted(job["steps"])
    spec = VARIANTS[variant]
    world, text = PairWorld(), WordEncoder(seed=0)
    oracle = Oracle()
    oracle.load_state_dict(torch.load(job["oracle"], weights_only=True))

    pool = TilePool(world, seed, tiles=job["pool"], hue_tiles=round(spec.get("hues", 0) * job["pool"]))
    bucket_of_tile = [world.buckets.get(p) for p in pool.pair_of_tile]  # None for a hue tile
    tile_weight = None
    if spec.get("reweight"):
        weights = (inverse_frequency_weights(pool.pair_of_tile) if spec["reweight"] == "inverse_freq"
                   else importance_weights(pool.pair_of_tile))
        tile_weight = torch.tensor([weights[p] for p in pool.pair_of_tile])

    torch.manual_seed(seed)
    model = build_transformer("micro", TILE, text.dim, in_channels=3, patch_size=PATCH)
    ema = EMAModel(model.parameters(), decay=0.999)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.0)
    warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 100))
    objective = build_objective(objective_of(variant))
    loss_fn = TrainingLoss(spec["kind"], patch_size=PATCH, reference=spec.get("reference", "target"),
                           estimator=spec.get("estimator", "literal"), normalize=spec.get("normalize", "none"))
    data_gen = torch.Generator().manual_seed(seed)  # batches and noise: the same sequence for every variant
    drop_gen = torch.Generator().manual_seed(seed + 1)  # caption dropout draws, separate from the data stream

    def predict_fn(noisy, timesteps, embeds, mask):
        return predict(model, noisy, timesteps, embeds, mask, 1)

    lever_gen = torch.Generator().manual_seed(seed + 2)  # the levers' own draws: the stream's stay as plain's
    objects = torch.zeros(len(COLOURS) + HUES, len(SHAPES))  # (colour, shape) of every object trained on
    window = {b: [0.0, 0] for b in BUCKETS}  # IMBA distance per bucket (sum, count) since the last curve point
    curve: list[dict] = []
    results, losses, start = {}, [], time.perf_counter()
    for step in range(1, lengths[-1] + 1):
        left = pool.draw(job["batch_size"], spec.get("balanced", False), data_gen)
        right = pool.draw(job["batch_size"], spec.get("balanced", False), data_gen)
        if spec.get("bursty"):
            right = pool.same_colour(left, spec["bursty"], right, lever_gen)
        drawn = torch.cat([left, right])
        stream_objects(objects, pool.colour_of_tile[drawn], pool.shape_of_tile[drawn])
        scenes = pool.scenes(left, right)
        if spec.get("jitter"):
            turns = spec["jitter"] * (2 * torch.rand(2 * len(left), generator=lever_gen) - 1)
            halves = rotate_hue(torch.cat([scenes[..., :TILE], scenes[..., TILE:]]), turns)
            scenes = torch.cat(halves.chunk(2), dim=3)
        noised = objective.noise(scenes, generator=data_gen)
        cond = text.encode([pool.pair_of_tile[i] for i in left.tolist()],
                           [pool.pair_of_tile[i] for i in right.tolist()])
        extra = {} if tile_weight is None else {"sample_weights": 0.5 * (tile_weight[left] + tile_weight[right])}
        loss, stats = loss_fn(predict_fn, noised, cond, text.null(len(left)), generator=drop_gen, **extra)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        warmup.step()
        ema.step(model.parameters())
        losses.append(loss.item())
        if "distance_per_token" in stats:
            halves = half_distances(stats["distance_per_token"], TILE // PATCH, 2 * TILE // PATCH)
            for tiles, d in zip((left, right), halves):
                for i, value in zip(tiles.tolist(), d.tolist()):
                    if math.isfinite(value) and bucket_of_tile[i] is not None:
                        window[bucket_of_tile[i]][0] += value
                        window[bucket_of_tile[i]][1] += 1
            if step % MONITOR_EVERY == 0:
                curve.append({"step": step, **{b: (s / n if n else None) for b, (s, n) in window.items()}})
                window = {b: [0.0, 0] for b in BUCKETS}
        if step in lengths:
            train_seconds = time.perf_counter() - start
            ema.store(model.parameters())
            ema.copy_to(model.parameters())
            model.eval()
            per_pair, failures, images = evaluate(model, objective, text, oracle, world, job["per_pair"],
                                                  seed=1000 + seed, sampling_steps=job["sampling_steps"])
            if job.get("grid_dir") and step == lengths[-1]:
                save_grid(images, job["per_pair"], Path(job["grid_dir"]) / f"samples_{variant}_{step}.png")
            diagnostics = world_diagnostics(model, text, world, PATCH, seed=seed)
            if job.get("models_dir"):
                model.save_pretrained(Path(job["models_dir"]) / f"{variant}-seed{seed}-{step}")
            model.train()
            ema.restore(model.parameters())
            results[step] = {"per_pair": per_pair, "failures": failures, "train_seconds": train_seconds,
                             "final_loss": statistics.fmean(losses[-50:]), "diagnostics": diagnostics,
                             "attribute_nmi": attribute_nmi(objects)}
    return {"variant": variant, "seed": seed, "settings": {k: job[k] for k in JOB_SETTINGS}, "results": results,
            "distance_curve": curve}


JOB_SETTINGS = ("steps", "per_pair", "sampling_steps", "batch_size", "pool")


def _run_path(runs_dir: Path, variant: str, seed: int) -> Path:
    return runs_dir / f"{variant}-seed{seed}.json"


def save_run(runs_dir: Path, run: dict) -> None:
    path = _run_path(runs_dir, run["variant"], run["seed"])
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(run))
    tmp.replace(path)


def saved_run(runs_dir: Path, job: dict, recorded: list[dict] = ()) -> dict | None:
    """A finished run of this job with the same settings, from `runs_dir` or from the runs of a recorded
    results.json (`recorded`), or None."""
    path = _run_path(runs_dir, job["variant"], job["seed"])
    candidates = [json.loads(path.read_text())] if path.is_file() else []
    candidates += [r for r in recorded if (r["variant"], r["seed"]) == (job["variant"], job["seed"])]
    for run in candidates:
        if run.get("settings") == {k: job[k] for k in JOB_SETTINGS}:
            return {**run, "results": {int(k): v for k, v in run["results"].items()}}
    return None


def mean_ci(values: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95 % t confidence interval over seeds (0 for a single value)."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, 0.0
    return mean, T_975.get(len(values) - 1, 1.96) * statistics.stdev(values) / math.sqrt(len(values))


def per_seed(runs: list[dict], world: PairWorld) -> dict:
    """{variant: {length: {seed: {bucket: success}}}}."""
    table: dict = {}
    for run in runs:
        for length, result in run["results"].items():
            table.setdefault(run["variant"], {}).setdefault(int(length), {})[run["seed"]] = bucket_success(
                result["per_pair"], world)
    return table


def summarise(runs: list[dict], world: PairWorld) -> dict:
    """{length: {variant: {bucket: (mean, ci)}}} over seeds."""
    out: dict = {}
    for variant, lengths in per_seed(runs, world).items():
        for length, seeds in lengths.items():
            buckets = {b: [seeds[s][b] for s in sorted(seeds)] for b in (*BUCKETS, "all_seen")}
            out.setdefault(length, {})[variant] = {b: mean_ci(v) for b, v in buckets.items()}
    return out


def stream_nmi(world: PairWorld, pool: int) -> dict[str, float]:
    """Colour-shape NMI of the objects each training stream shows: the long-tailed stream draws pool tiles
    uniformly (pair frequency = its pool count), the balanced one every seen pair equally often."""
    from imba.eval.representations import attribute_nmi

    counts = world.pool_counts(pool)
    tables = {name: torch.zeros(len(COLOURS), len(SHAPES)) for name in ("long_tailed", "balanced")}
    for (colour, shape), n in counts.items():
        tables["long_tailed"][colour, shape] = n
        tables["balanced"][colour, shape] = 1
    return {name: attribute_nmi(table) for name, table in tables.items()}


def gap_closed(runs: list[dict], world: PairWorld, lengths: list[int], compute: bool) -> dict:
    """Per IMBA-or-reweighting variant and length: the balance gap and how much of it the variant closes.

    Against the controls of its objective at the same steps (compute=False) or at the steps plain could run for
    the variant's compute (compute=True). Per bucket: the variant's gain over plain (mean ± 95 % CI of the per-seed
    paired differences), the gap (plain_balanced − plain, likewise) and the fraction = mean gain / mean gap (None
    where the gap is not clearly there: its 95 % interval reaches 0, or it is under 5 points)."""
    seeds_of = per_seed(runs, world)
    out: dict = {}
    for variant in seeds_of:
        plain, balanced = CONTROLS[objective_of(variant)]
        if variant in (plain, balanced) or plain not in seeds_of or balanced not in seeds_of:
            continue
        for length in lengths:
            ref = equal_compute_steps(length, relative_cost(variant)) if compute else length
            mine, base, ctrl = (seeds_of[variant].get(length), seeds_of[plain].get(ref),
                                seeds_of[balanced].get(ref))
            if not (mine and base and ctrl):
                continue
            seeds = sorted(set(mine) & set(base) & set(ctrl))
            cells = {}
            for bucket in (*BUCKETS, "all_seen"):
                gain = mean_ci([mine[s][bucket] - base[s][bucket] for s in seeds])
                gap = mean_ci([ctrl[s][bucket] - base[s][bucket] for s in seeds])
                # a fraction of a gap that is not there (its CI reaches 0, or under 5 points) means nothing
                real = gap[0] > max(gap[1], 0.05)
                cells[bucket] = {"gain": gain, "gap": gap, "fraction": gain[0] / gap[0] if real else None}
            out.setdefault(length, {})[variant] = {"reference_steps": ref, "seeds": seeds, "buckets": cells}
    return out


def failure_table(runs: list[dict], world: PairWorld, length: int) -> dict:
    """{variant: {bucket: {kind: share of that bucket's prompts, over every seed}}} at one length."""
    out: dict = {}
    for run in runs:
        result = run["results"].get(length)
        if result is None:
            continue
        slot = out.setdefault(run["variant"], {b: {k: 0 for k in (*FAILURES, "prompts")} for b in BUCKETS})
        for pair in world.pairs:
            cell = slot[world.buckets[pair]]
            counts = result["failures"][pair_name(pair)]
            for kind in FAILURES:
                cell[kind] += counts[kind]
            cell["prompts"] += run["settings"]["per_pair"]
    return {v: {b: {k: c[k] / c["prompts"] for k in FAILURES} for b, c in buckets.items()}
            for v, buckets in out.items()}


def _pct(cell: tuple[float, float]) -> str:
    return f"{100 * cell[0]:.1f} ± {100 * cell[1]:.1f}"


def markdown_report(summary: dict, gaps: dict, failures: dict, variants: list[str], lengths: list[int],
                    seeds: int) -> str:
    columns = ("head", "torso", "tail", "held_out", "all_seen")
    lines = []
    for length in lengths:
        spread = "± 95 % CI" if seeds > 1 else "one seed: no CI, the ± 0.0 stands for none"
        lines.append(f"\n**Equal steps: {length}** (composition success %, mean over {seeds} seed(s) {spread})\n")
        lines.append("| variant | " + " | ".join(columns) + " |")
        lines.append("|---" * (len(columns) + 1) + "|")
        for variant in variants:
            cells = summary.get(length, {}).get(variant)
            if cells:
                lines.append(f"| {variant} | " + " | ".join(_pct(cells[c]) for c in columns) + " |")
        longer = sorted({n for n in summary if n > length and n <= 2 * length})
        for n in longer:
            for control in variants:  # the controls and the levers, trained on for equal compute
                cells = summary[n].get(control)
                if cells:
                    lines.append(f"| {control} @ {n} steps | " + " | ".join(_pct(cells[c]) for c in columns) + " |")
    for title, table in gaps.items():
        for length in lengths:
            rows = table.get(length, {})
            if not rows:
                continue
            lines.append(f"\n**Balance gap closed, {title}, {length} steps** (gain over plain in points ± 95 % CI "
                         "of the paired per-seed differences; fraction = gain / gap)\n")
            lines.append("| variant | plain at | head gain | tail gap | tail gain | tail closed | held-out gap | "
                         "held-out gain | held-out closed |")
            lines.append("|---" * 9 + "|")
            for variant in variants:
                row = rows.get(variant)
                if not row:
                    continue
                b = row["buckets"]

                def frac(bucket: str) -> str:
                    f = b[bucket]["fraction"]
                    return "—" if f is None else f"{100 * f:.0f} %"

                lines.append(f"| {variant} | {row['reference_steps']} | {_pct(b['head']['gain'])} | "
                             f"{_pct(b['tail']['gap'])} | {_pct(b['tail']['gain'])} | {frac('tail')} | "
                             f"{_pct(b['held_out']['gap'])} | {_pct(b['held_out']['gain'])} | {frac('held_out')} |")
    if failures:
        lines.append(f"\n**Failure kinds at {lengths[-1]} steps** (% of the bucket's prompts, all seeds: missing "
                     "object / colour on the wrong shape / other)\n")
        lines.append("| variant | " + " | ".join(BUCKETS) + " |")
        lines.append("|---" * (len(BUCKETS) + 1) + "|")
        for variant in variants:
            if variant in failures:
                cells = [" / ".join(f"{100 * failures[variant][b][k]:.1f}" for k in FAILURES) for b in BUCKETS]
                lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def bar_plot(summary: dict, variants: list[str], lengths: list[int], path: Path) -> None:
    """Grouped bars per bucket: one panel per equal-steps length, plus the plain-cost variants trained on to
    1.3× and 2× of it (equal compute with the efficient and the literal IMBA step)."""
    from imba.plots import plot_grouped_bars

    panels = {f"{length} training steps": {v: summary[length][v] for v in variants if v in summary.get(length, {})}
              for length in lengths}
    for length in lengths:
        for cost, name in ((1.3, "the efficient IMBA estimator"), (2.0, "literal IMBA")):
            longer = equal_compute_steps(length, cost)
            if longer in summary:
                panels[f"at {longer} steps (= {name}'s compute at {length})"] = {
                    v: summary[longer][v] for v in variants if v in summary[longer]}
    plot_grouped_bars(panels, BUCKETS, variants, path, ylabel="composition success (%)", scale=100, ylim=(0, 100),
                      title="Two-object composition success per bucket of the probed pair (whiskers: 95 % CI)")


def monitor_curves(runs: list[dict]) -> dict:
    """{variant: {bucket: [(step, mean distance over seeds)]}} from the runs' distance curves."""
    sums: dict = {}
    for run in runs:
        for point in run.get("distance_curve", []):
            for bucket in BUCKETS:
                if point.get(bucket) is not None:
                    sums.setdefault(run["variant"], {}).setdefault(bucket, {}).setdefault(point["step"], []).append(
                        point[bucket])
    return {v: {b: sorted((s, statistics.fmean(x)) for s, x in steps.items()) for b, steps in buckets.items()}
            for v, buckets in sums.items()}


def diagnose_saved_model(folder: Path, out: Path) -> int:
    """`--diagnose`: the representation diagnostics of a model saved by a benchmark run, as JSON and a plot."""
    from composition_diagnostics import world_diagnostics
    from diffusers import PixArtTransformer2DModel

    from imba.plots import plot_block_diagnostics

    if not (folder / "config.json").is_file():
        raise SystemExit(f"error: {folder} holds no saved model (config.json): pass a folder of OUT/models/")
    model = PixArtTransformer2DModel.from_pretrained(folder).eval()
    result = world_diagnostics(model, WordEncoder(seed=0), PairWorld(), PATCH)
    out.mkdir(parents=True, exist_ok=True)
    result["model"] = str(folder)
    (out / "diagnostics.json").write_text(json.dumps(result, indent=1) + "\n")
    plot_block_diagnostics(result, out / "diagnostics.png",
                           title=f"{folder.name}: alignment with the caption and probes, per block")
    last = result["blocks"][-1]
    print(f"last block: CKA on held-out pairs {last['cka']['held_out']:.3f}; probes on held-out pairs: colour "
          f"{last['probe']['colour']['by_group']['held_out']:.2f}, shape "
          f"{last['probe']['shape']['by_group']['held_out']:.2f}")
    print(f"wrote {out / 'diagnostics.json'} and {out / 'diagnostics.png'}")
    return 0


LEVER_COLUMNS = ("head", "tail", "held_out", "attribute_nmi", "colour_probe_held_out", "shape_probe_held_out",
                 "shape_probe_gap", "cka_tail", "cka_held_out")


def levers_against_imba(runs: list[dict], world: PairWorld, lengths: list[int]) -> dict:
    """Each data lever against each IMBA variant at equal compute: the lever trained to length × the IMBA step's
    cost against the IMBA variant at the length, per bucket the mean ± 95 % CI of the per-seed differences.
    {length: {"<lever> vs <imba>": {"lever_steps", "seeds", "buckets": {bucket: (mean, ci)}}}}."""
    seeds_of = per_seed(runs, world)
    out: dict = {}
    for lever in (v for v in seeds_of if is_lever(v)):
        for imba in (v for v in seeds_of if relative_cost(v) > 1 and objective_of(v) == objective_of(lever)):
            for length in lengths:
                steps = equal_compute_steps(length, relative_cost(imba))
                mine, theirs = seeds_of[lever].get(steps), seeds_of[imba].get(length)
                if not (mine and theirs):
                    continue
                seeds = sorted(set(mine) & set(theirs))
                out.setdefault(length, {})[f"{lever} vs {imba}"] = {
                    "lever_steps": steps, "seeds": seeds,
                    "buckets": {b: mean_ci([mine[s][b] - theirs[s][b] for s in seeds]) for b in (*BUCKETS, "all_seen")}}
    return out


def levers_summary(runs: list[dict], world: PairWorld) -> dict:
    """{length: {variant: {number: (mean, ci)}}} of `run_numbers` over seeds, and the relations across runs
    ({length: relations(...)}) between held-out success and the data and representation numbers."""
    from composition_diagnostics import relations, run_numbers

    table: dict = {}
    points: dict = {}
    for run in runs:
        for length in run["results"]:
            numbers = run_numbers(run, int(length), world)
            if numbers is None:
                continue
            table.setdefault(int(length), {}).setdefault(run["variant"], []).append(numbers)
            points.setdefault(int(length), []).append({**numbers, "variant": run["variant"], "seed": run["seed"]})
    summary = {length: {v: {k: mean_ci([n[k] for n in rows if n.get(k) is not None])
                            for k in rows[0] if all(n.get(k) is not None for n in rows)}
                        for v, rows in by_variant.items()}
               for length, by_variant in table.items()}
    return {"summary": summary, "relations": {length: relations(p) for length, p in points.items()},
            "points": points}


def levers_report(levers: dict, variants: list[str]) -> str:
    lines = ["\n**Training-set NMI and representations** (mean ± 95 % CI over seeds; success in %; NMI of colour "
             "and shape over the objects trained on; probes and CKA with the caption: the last block's, on "
             "held-out or tail pairs; shape probe gap = ID − OOD accuracy)\n",
             "| variant @ steps | " + " | ".join(c.replace("_", " ") for c in LEVER_COLUMNS) + " |",
             "|---" * (len(LEVER_COLUMNS) + 1) + "|"]
    for length in sorted(levers["summary"]):
        for variant in variants:
            cells = levers["summary"][length].get(variant)
            if not cells:
                continue
            shown = []
            for c in LEVER_COLUMNS:
                mean, ci = cells.get(c, (None, None))
                scale = 100 if c in BUCKETS else 1
                shown.append("—" if mean is None else (f"{scale * mean:.1f} ± {scale * ci:.1f}" if scale == 100
                                                        else f"{mean:.3f} ± {ci:.3f}"))
            lines.append(f"| {variant} @ {length} | " + " | ".join(shown) + " |")
    for length, rows in sorted(levers.get("against_imba", {}).items()):
        lines.append(f"\n**Data levers against IMBA at equal compute, {length} IMBA steps** (lever − IMBA in points, "
                     "± 95 % CI of the per-seed differences)\n")
        lines.append("| lever vs IMBA form | lever steps | " + " | ".join(BUCKETS) + " |")
        lines.append("|---" * (len(BUCKETS) + 2) + "|")
        for name, row in rows.items():
            lines.append(f"| {name} | {row['lever_steps']} | " + " | ".join(_pct(row["buckets"][b]) for b in BUCKETS)
                         + " |")
    lines.append("\n**Does held-out composition track them?** (Pearson r across every run at one length, "
                 "[95 % interval])\n")
    lines.append("| steps | " + " | ".join(levers_relations_columns()) + " |")
    lines.append("|---" * (len(levers_relations_columns()) + 1) + "|")
    for length, rel in sorted(levers["relations"].items()):
        cells = ["—" if r is None else f"{r[0]:+.2f} [{r[1]:+.2f}, {r[2]:+.2f}]" for r in rel.values()]
        lines.append(f"| {length} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def levers_relations_columns() -> list[str]:
    from composition_diagnostics import RELATIONS

    return [f"held-out vs {name.replace('_', ' ')}" for name in RELATIONS]


def levers_plots(levers: dict, runs: list[dict], variants: list[str], out: Path) -> None:
    """levers.png: held-out success against NMI, the shape probe's gap and CKA, one point per run; blocks.png:
    CKA and the shape probe on held-out pairs per block, mean over seeds, one line per variant."""
    from imba.plots import plot_series

    length = min(levers["points"])
    points = levers["points"][length]
    panels = {f"{name.replace('_', ' ')}": {"xlabel": name.replace("_", " "), "series": {
        v: [(p[name], 100 * p["held_out"]) for p in points if p["variant"] == v] for v in variants}}
        for name in ("attribute_nmi", "shape_probe_gap", "cka_held_out")}
    plot_series(panels, out / "levers.png", ylabel="held-out composition success (%)", scatter=True,
                title=f"Held-out composition against data and representation numbers ({length} steps, one point "
                      "per run)")
    per_block: dict = {"CKA with the caption, held-out pairs": {}, "shape probe, held-out pairs": {},
                       "colour probe, held-out pairs": {}}
    for variant in variants:
        sets = [r["results"][length]["diagnostics"]["blocks"] for r in runs
                if r["variant"] == variant and "diagnostics" in r["results"].get(length, {})]
        if not sets:
            continue
        for title, get in (("CKA with the caption, held-out pairs", lambda b: b["cka"]["held_out"]),
                           ("shape probe, held-out pairs", lambda b: b["probe"]["shape"]["by_group"]["held_out"]),
                           ("colour probe, held-out pairs", lambda b: b["probe"]["colour"]["by_group"]["held_out"])):
            per_block[title][variant] = [(i + 1, statistics.fmean(get(blocks[i]) for blocks in sets))
                                         for i in range(len(sets[0]))]
    plot_series({t: {"xlabel": "block", "series": s} for t, s in per_block.items()}, out / "blocks.png",
                ylabel="CKA / probe accuracy", title=f"Per block, mean over seeds ({length} steps)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="1 seed, 3 variants, 1000 steps, 8 samples per pair, equal steps only (with "
                             "--levers: 1 seed, 400 steps, 4 samples per pair)")
    parser.add_argument("--levers", action="store_true",
                        help=f"the data-levers experiment: {' '.join(LEVER_VARIANTS)}, 1000 steps, the plain-cost "
                             "variants also at the efficient estimator's compute (1,300 steps)")
    parser.add_argument("--diagnose", type=Path, default=None, metavar="MODEL",
                        help="only write the representation diagnostics (JSON and plot) of a model the benchmark "
                             "saved (OUT/models/<variant>-seed<s>-<steps>) into --out")
    parser.add_argument("--variants", nargs="+", choices=[*VARIANTS, "all"], default=None, metavar="NAME",
                        help=f"names from VARIANTS ({', '.join(VARIANTS)}) or all; default: "
                             f"{' '.join(DEFAULT_VARIANTS)}; quick: {' '.join(QUICK_VARIANTS)}")
    parser.add_argument("--seeds", nargs="+", type=int, default=None, help="default 0 1 2 (quick: 0)")
    parser.add_argument("--steps", nargs="+", type=int, default=None,
                        help="equal-step lengths to evaluate at (default 2000; quick: 1000); the controls also "
                             "train to 1.3× and 2× each")
    parser.add_argument("--no-equal-compute", action="store_true",
                        help="do not train the controls on to 1.3× and 2× the lengths (the default with --quick)")
    parser.add_argument("--per-pair", type=int, default=None, help="samples per pair (default 16; quick: 8)")
    parser.add_argument("--sampling-steps", type=int, default=SAMPLING_STEPS,
                        help=f"DPM-Solver++ steps per evaluation sample (default {SAMPLING_STEPS})")
    parser.add_argument("--oracle", type=Path, default=ORACLE,
                        help="the judge's weights, its report beside them as .json (default: the shipped oracle)")
    parser.add_argument("--train-oracle", action="store_true",
                        help="train the oracle anew into OUT/oracle.pt (+ .json) and judge with it (≈ 1.5 min)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--pool", type=int, default=8192, help="tiles in the training pool per seed")
    parser.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1),
                        help="parallel training processes (one thread each)")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "composition_results")
    args = parser.parse_args(argv)
    if args.diagnose:
        return diagnose_saved_model(args.diagnose, args.out)
    variants = args.variants or (LEVER_VARIANTS if args.levers else QUICK_VARIANTS if args.quick
                                 else DEFAULT_VARIANTS)
    if "all" in variants:
        variants = list(VARIANTS)
    seeds = args.seeds or ([0] if args.quick else [0, 1, 2])
    lengths = sorted(args.steps or ([400] if args.quick and args.levers else [1000] if args.quick or args.levers
                                    else [2000]))
    equal_compute = not (args.no_equal_compute or (args.quick and not args.levers))
    per_pair = args.per_pair or (4 if args.quick and args.levers else 8 if args.quick else 16)
    factors = tuple(sorted({relative_cost(v) for v in variants} - {1.0}))
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()

    torch.set_num_threads(max(1, args.workers))
    if args.train_oracle:
        oracle_path = args.out / "oracle.pt"
        oracle, oracle_report = train_oracle()
        torch.save(oracle.state_dict(), oracle_path)
        oracle_path.with_suffix(".json").write_text(json.dumps(oracle_report, indent=1))
    else:
        oracle_path = args.oracle
        if not (oracle_path.is_file() and oracle_path.with_suffix(".json").is_file()):
            raise SystemExit(f"no oracle at {oracle_path} (weights and its .json report); pass --train-oracle")
    oracle_report = json.loads(oracle_path.with_suffix(".json").read_text())
    print(f"oracle: {100 * oracle_report['pair_accuracy']:.2f} % of {oracle_report['test_tiles']} fresh tiles read "
          f"right ({100 * oracle_report['empty_accuracy']:.2f} % of empty ones)", flush=True)

    jobs = [dict(variant=v, seed=s, steps=train_lengths(v, lengths, equal_compute, factors), per_pair=per_pair,
                 sampling_steps=args.sampling_steps, batch_size=args.batch_size, pool=args.pool,
                 oracle=str(oracle_path),
                 grid_dir=str(args.out) if s == seeds[0] else None, models_dir=str(args.out / "models"))
            for s in seeds for v in variants]
    jobs.sort(key=lambda j: -relative_cost(j["variant"]) * max(j["steps"]))  # longest first: better packing
    # every finished (variant, seed) is saved at once: an interrupted benchmark reruns only the missing ones, and the
    # runs recorded in results.json (committed with the results) are reused too
    runs_dir, results_path = args.out / "runs", args.out / "results.json"
    runs_dir.mkdir(exist_ok=True)
    recorded = json.loads(results_path.read_text())["runs"] if results_path.is_file() else []
    runs, todo = [], []
    for job in jobs:
        done = saved_run(runs_dir, job, recorded)
        (runs if done else todo).append(done or job)
    if runs:
        print(f"reusing {len(runs)} finished runs from {runs_dir}", flush=True)
    context = multiprocessing.get_context("spawn")
    with context.Pool(args.workers) as pool:
        for run in pool.imap_unordered(run_one, todo):
            save_run(runs_dir, run)
            runs.append(run)
            last = run["results"][max(run["results"])]
            print(f"[{time.perf_counter() - started:6.0f} s] {run['variant']} seed {run['seed']}: "
                  f"{last['train_seconds']:.0f} s training, final loss {last['final_loss']:.4f}", flush=True)
        pool.close()  # let the workers exit on their own: the terminate() of `with` can deadlock on idle ones
        pool.join()

    from imba.plots import plot_monitor

    world = PairWorld()
    summary = summarise(runs, world)
    gaps = {"equal steps": gap_closed(runs, world, lengths, compute=False),
            "equal compute": gap_closed(runs, world, lengths, compute=True)}
    failures = failure_table(runs, world, lengths[-1])
    report = markdown_report(summary, gaps, failures, variants, lengths, len(seeds))
    levers = levers_summary(runs, world)
    levers["against_imba"] = levers_against_imba(runs, world, lengths)
    if levers["summary"]:
        report += levers_report(levers, variants)
        levers_plots(levers, runs, variants, args.out)
    bar_plot(summary, variants, lengths, args.out / "composition.png")
    curves = monitor_curves(runs)
    if curves:
        plot_monitor(curves, args.out / "monitor.png", ylabel="mean IMBA distance d over the object's tokens",
                     title="IMBA distance per bucket of the object's pair during training (mean over seeds)")
    nmi = stream_nmi(world, args.pool)
    print("colour-shape NMI of the training streams: " + ", ".join(f"{k} {v:.4f}" for k, v in nmi.items()))
    payload = {
        "command": "python bench/composition.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "attribute_nmi": nmi,
        "seeds": seeds, "lengths": lengths, "per_pair": per_pair, "sampling_steps": args.sampling_steps,
        "variants": variants, "oracle": oracle_report, "wall_seconds": time.perf_counter() - started,
        "buckets": {pair_name(p): b for p, b in world.buckets.items()},
        "pool_tiles": {pair_name(p): n for p, n in world.pool_counts(args.pool).items()},
        "summary": {str(k): v for k, v in summary.items()},
        "gap_closed": {t: {str(k): v for k, v in table.items()} for t, table in gaps.items()},
        "failures": failures, "distance_curves": curves, "runs": runs,
        "levers": {"summary": {str(k): v for k, v in levers["summary"].items()},
                   "relations": {str(k): v for k, v in levers["relations"].items()},
                   "against_imba": {str(k): v for k, v in levers["against_imba"].items()}},
    }
    results_path.write_text(json.dumps(payload, indent=1))
    (args.out / "results.md").write_text(report)
    print(report)
    print(f"wrote {args.out}/results.json, results.md, composition.png in {payload['wall_seconds'] / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
