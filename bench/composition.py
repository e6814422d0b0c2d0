"""Synthetic composition benchmark: does IMBA close the gap that data imbalance opens? (paper Tab. 1/3)

    python bench/composition.py                 # control, plain and three IMBA forms × 3 seeds (≈ 85 min, 2 cores)
    python bench/composition.py --variants all  # every form in VARIANTS (≈ 4.5 h on 2 cores)
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
pair on the other; N samples from the EMA weights (DPM-Solver++ 20 steps, classifier-free guidance 3). A prompt
succeeds when the oracle reads both objects right. Reported per bucket of the probed pair (head / torso / tail by
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
                                TilePool, WordEncoder, judge, pair_name, train_oracle)

# kind / reference / normalize / estimator: imba.training_loss.TrainingLoss; balanced: the pair-balanced stream;
# reweight: plain MSE weighted per scene by the mean of its two objects' weights, either the inverse frequency of
# their concepts (offline re-weighting as a user would do it) or the exact importance ratio of the balanced stream,
# p_balanced(pair) / p_pool(pair) (the best any per-sample re-weighting of this stream can do in expectation);
# objective: flow or ddpm (ε)
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
}
# the default fits the time bound on 2 cores (≈ 85 min from the recorded runs' times); `--variants all` runs every
# form (≈ 4.5 h)
DEFAULT_VARIANTS = ["plain", "plain_balanced", "imba_target", "imba_target_tnorm", "imba_target_tnorm_efficient"]
QUICK_VARIANTS = ["plain", "plain_balanced", "imba_target_tnorm"]  # the control, and the best IMBA form measured
# plain and its balanced control also train to 1.3× and 2× each length: the equal-compute references
CONTROLS = {"flow": ("plain", "plain_balanced"), "ddpm": ("plain_eps", "plain_balanced_eps")}
PATCH = 4
MONITOR_EVERY = 50  # steps per point of the distance-per-bucket curve
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


def train_lengths(variant: str, lengths: list[int], equal_compute: bool = True) -> list[int]:
    """Where a run is evaluated: at each length, and for the controls also at the equal-compute lengths."""
    if not equal_compute or variant not in CONTROLS[objective_of(variant)]:
        return sorted(lengths)
    return sorted({equal_compute_steps(n, c) for n in lengths for c in (1.0, 1.3, 2.0)})


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


def probe_prompts(world: PairWorld, per_pair: int) -> list[tuple[tuple[int, int], tuple[int, int], tuple[int, int]]]:
    """(probed pair, left, right) per evaluation sample: each pair `per_pair` times, alternately on the left and
    on the right, next to a head pair (cycled, never the probed pair itself)."""
    heads = [p for p in world.seen if world.buckets[p] == "head"]
    out = []
    for i, pair in enumerate(world.pairs):
        partners = [h for h in heads if h != pair]
        for k in range(per_pair):
            partner = partners[(i + k // 2) % len(partners)]
            out.append((pair, pair, partner) if k % 2 == 0 else (pair, partner, pair))
    return out


@torch.no_grad()
def generate(model, objective, text: WordEncoder, left, right, seed: int, steps: int = 20, guidance: float = 3.0,
             batch_size: int = 256) -> torch.Tensor:
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


def evaluate(model, objective, text, oracle: Oracle, world: PairWorld, per_pair: int, seed: int):
    """Per probed pair (keyed by its name): success rate and the count of each failure kind; and the scenes."""
    prompts = probe_prompts(world, per_pair)
    left, right = [p[1] for p in prompts], [p[2] for p in prompts]
    images = generate(model, objective, text, left, right, seed)
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

    from imba.objectives import build_objective
    from imba.training_loss import TrainingLoss
    from models.dit import build_transformer, predict

    variant, seed, lengths = job["variant"], job["seed"], sorted(job["steps"])
    spec = VARIANTS[variant]
    world, text = PairWorld(), WordEncoder(seed=0)
    oracle = Oracle()
    oracle.load_state_dict(torch.load(job["oracle"], weights_only=True))

    pool = TilePool(world, seed, tiles=job["pool"])
    bucket_of_tile = [world.buckets[p] for p in pool.pair_of_tile]
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

    window = {b: [0.0, 0] for b in BUCKETS}  # IMBA distance per bucket (sum, count) since the last curve point
    curve: list[dict] = []
    results, losses, start = {}, [], time.perf_counter()
    for step in range(1, lengths[-1] + 1):
        left = pool.draw(job["batch_size"], spec.get("balanced", False), data_gen)
        right = pool.draw(job["batch_size"], spec.get("balanced", False), data_gen)
        noised = objective.noise(pool.scenes(left, right), generator=data_gen)
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
                    if math.isfinite(value):
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
                                                  seed=1000 + seed)
            if job.get("grid_dir") and step == lengths[-1]:
                save_grid(images, job["per_pair"], Path(job["grid_dir"]) / f"samples_{variant}_{step}.png")
            model.train()
            ema.restore(model.parameters())
            results[step] = {"per_pair": per_pair, "failures": failures, "train_seconds": train_seconds,
                             "final_loss": statistics.fmean(losses[-50:])}
    return {"variant": variant, "seed": seed, "settings": {k: job[k] for k in JOB_SETTINGS}, "results": results,
            "distance_curve": curve}


JOB_SETTINGS = ("steps", "per_pair", "batch_size", "pool")


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


def bucket_success(per_pair: dict, world: PairWorld) -> dict:
    """Mean success over the pairs of each bucket, and over all seen pairs."""
    out = {}
    for bucket in BUCKETS:
        out[bucket] = statistics.fmean(per_pair[pair_name(p)] for p in world.pairs if world.buckets[p] == bucket)
    out["all_seen"] = statistics.fmean(per_pair[pair_name(p)] for p in world.seen)
    return out


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
        controls = sorted({c for v in variants for c in CONTROLS[objective_of(v)] if c in summary.get(length, {})})
        longer = sorted({n for n in summary if n > length and n <= 2 * length})
        for n in longer:
            for control in controls:
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
    """Grouped bars per bucket: one panel per equal-steps length, plus the controls at 2× for equal compute."""
    from imba.plots import plot_grouped_bars

    panels = {f"{length} training steps": {v: summary[length][v] for v in variants if v in summary.get(length, {})}
              for length in lengths}
    for length in lengths:
        longer = equal_compute_steps(length, 2.0)
        if longer in summary:
            panels[f"controls at {longer} steps (= literal IMBA's compute at {length})"] = {
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="1 seed, 3 variants, 1000 steps, 8 samples per pair, equal steps only")
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
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--pool", type=int, default=8192, help="tiles in the training pool per seed")
    parser.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1),
                        help="parallel training processes (one thread each)")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "composition_results")
    args = parser.parse_args(argv)
    variants = args.variants or (QUICK_VARIANTS if args.quick else DEFAULT_VARIANTS)
    if "all" in variants:
        variants = list(VARIANTS)
    seeds = args.seeds or ([0] if args.quick else [0, 1, 2])
    lengths = sorted(args.steps or ([1000] if args.quick else [2000]))
    equal_compute = not (args.no_equal_compute or args.quick)
    per_pair = args.per_pair or (8 if args.quick else 16)
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
    print(f"oracle: {100 * oracle_report['pair_accuracy']:.2f} % of {oracle_report['test_tiles']} fresh tiles read "
          f"right ({100 * oracle_report['empty_accuracy']:.2f} % of empty ones)", flush=True)

    jobs = [dict(variant=v, seed=s, steps=train_lengths(v, lengths, equal_compute), per_pair=per_pair, batch_size=args.batch_size,
                 pool=args.pool, oracle=str(oracle_path), grid_dir=str(args.out) if s == seeds[0] else None)
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
        "seeds": seeds, "lengths": lengths, "per_pair": per_pair, "variants": variants,
        "oracle": oracle_report, "wall_seconds": time.perf_counter() - started,
        "buckets": {pair_name(p): b for p, b in world.buckets.items()},
        "pool_tiles": {pair_name(p): n for p, n in world.pool_counts(args.pool).items()},
        "summary": {str(k): v for k, v in summary.items()},
        "gap_closed": {t: {str(k): v for k, v in table.items()} for t, table in gaps.items()},
        "failures": failures, "distance_curves": curves, "runs": runs,
    }
    results_path.write_text(json.dumps(payload, indent=1))
    (args.out / "results.md").write_text(report)
    print(report)
    print(f"wrote {args.out}/results.json, results.md, composition.png in {payload['wall_seconds'] / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
