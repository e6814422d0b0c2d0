"""One run of the composition benchmark (`run_one`): one world, variant and seed trained through the trainer's own
step, and evaluated at every length it is asked for: scenes sampled from its EMA weights (`generate`), read by the
judges (`evaluate`), the representation diagnostics and what the run has trained on (`exposure_log`)."""

from __future__ import annotations

import math
import statistics
import time
from pathlib import Path

import torch

from composition_scenes import (BUCKETS, COLOURS, FAILURES, SHAPES, TILE, Oracle, PairWorld, ScenePool, TilePool,
                                WordEncoder, judge, pair_name, probe_prompts)
from composition_variants import VARIANTS, WEIGHTED_STREAMS, objective_of
from composition_weighting import (HalfWeightedLoss, OnlineSceneBalance, WeightedScenes, importance_weights,
                                   inverse_frequency_weights, weights_shuffled_within_levels)

# the run's protocol, equal for every variant
PATCH = 4
MONITOR_EVERY = 50  # steps per point of the distance-per-bucket curve
# DPM-Solver++ steps per evaluation sample: 20 steps read bucket success within 2 points of 10 at twice the cost
# (bench/README.md#the-protocol)
SAMPLING_STEPS = 10
# a run's settings: a saved run is reused for a job only where they are equal
JOB_SETTINGS = ("world", "scenes", "fixed_ranks", "steps", "per_pair", "sampling_steps", "batch_size", "pool",
                "protocol")


def generator_for(seed: int, role: str) -> torch.Generator:
    """One generator per (seed, role), so a stream's selection draws never shift another role's sequence."""
    roles = ("select", "noise", "drop", "lever", "shuffle")
    return torch.Generator().manual_seed(1000 * seed + 17 * roles.index(role) + 1)


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


def evaluate(model, objective, text, oracles: dict, world: PairWorld, per_pair: int, seed: int,
             sampling_steps: int = SAMPLING_STEPS):
    """Per probed pair (keyed by its name), for each oracle (key suffix "" or "_b"): the share of prompts read
    right whole (`per_pair`), of probed halves read right (`per_pair_half`), and the count of each failure kind of
    the whole prompt (`failures`); and the scenes."""
    prompts = probe_prompts(world, per_pair)
    left, right = [p[1] for p in prompts], [p[2] for p in prompts]
    images = generate(model, objective, text, left, right, seed, steps=sampling_steps)
    side = torch.tensor([0 if probe == lhs else 1 for probe, lhs, _ in prompts])
    want = torch.tensor([list(p[0]) for p in prompts])
    rows = torch.arange(len(prompts))
    out: dict = {}
    for suffix, oracle in oracles.items():
        colours, shapes = oracle.read_scenes(images)
        ok, kinds = judge(colours, shapes, left, right)
        half = (colours[rows, side] == want[:, 0]) & (shapes[rows, side] == want[:, 1])
        whole, halves, failures = {}, {}, {}
        for i, pair in enumerate(world.pairs):
            block = slice(i * per_pair, (i + 1) * per_pair)
            whole[pair_name(pair)] = ok[block].float().mean().item()
            halves[pair_name(pair)] = half[block].float().mean().item()
            failures[pair_name(pair)] = {k: kinds[block].count(k) for k in FAILURES}
        out[f"per_pair{suffix}"], out[f"per_pair_half{suffix}"] = whole, halves
        if not suffix:
            out["failures"] = failures
    return out, images


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


def exposure_log(objects: torch.Tensor, tile_seen: torch.Tensor, scenes_seen: int, pool: TilePool,
                 world: PairWorld) -> dict:
    """What a run has trained on so far: objects per named pair (both halves), hue objects, the distinct tiles and
    scenes, and the largest number of times any one tile was shown, overall and per bucket of its pair."""
    named = objects[:len(COLOURS)]
    by_bucket: dict = {}
    for i, pair in enumerate(pool.pair_of_tile):
        bucket = world.buckets.get(pair, "hues")
        by_bucket[bucket] = max(by_bucket.get(bucket, 0), int(tile_seen[i]))
    return {"exposure": {pair_name(p): int(named[p]) for p in world.pairs},
            "hue_objects": int(objects[len(COLOURS):].sum()),
            "distinct_tiles": int((tile_seen > 0).sum()), "pool_tiles": len(pool), "distinct_scenes": scenes_seen,
            "max_tile_repeat": int(tile_seen.max()), "max_tile_repeat_by_bucket": by_bucket}


def run_one(job: dict) -> dict:
    """Train one (world, variant, seed) and evaluate it at every length in job["steps"]."""
    torch.set_num_threads(1)
    from accelerate import Accelerator

    from composition_diagnostics import stream_objects, world_diagnostics
    from composition_scenes import HUES, rotate_hue

    from imba.eval.representations import attribute_nmi
    from imba.objectives import build_objective
    from imba.training.build import build_adamw
    from imba.training.ema import make_ema
    from imba.training.guard import DivergenceGuard
    from imba.training.hooks import Hooks
    from imba.training.step import TrainStep
    from models.dit import build_transformer, predict

    variant, seed, lengths = job["variant"], job["seed"], sorted(job["steps"])
    spec = VARIANTS[variant]
    stream = spec.stream
    world = PairWorld(job["world"], None if job["fixed_ranks"] else seed)
    text = WordEncoder(seed=0)
    oracles = {}
    for suffix, path in (("", job["oracle"]), ("_b", job.get("oracle_b"))):
        if path:
            oracles[suffix] = Oracle()
            oracles[suffix].load_state_dict(torch.load(path, weights_only=True))

    pool = TilePool(world, seed, tiles=job["pool"], hue_tiles=round(spec.hues * job["pool"]))
    scene_pool = ScenePool(pool, seed) if job["scenes"] == "fixed" else None
    if scene_pool is not None and spec.bursty:  # main refuses it first: a worker must not exit
        raise ValueError(f"{variant} composes its scenes at batch time; run it with --scenes online")
    if scene_pool is None and stream in WEIGHTED_STREAMS:
        raise ValueError(f"{variant} weights a fixed pool of scenes; run it with --scenes fixed")
    weighted = (WeightedScenes(stream, scene_pool.captions(world.caption_noise), spec.alpha, spec.keep,
                               scenes=pool.scenes(scene_pool.left, scene_pool.right), seed=seed)
                if stream in WEIGHTED_STREAMS else None)
    bucket_of_tile = [world.buckets.get(p) for p in pool.pair_of_tile]  # None for a hue tile
    tile_weight = None
    if spec.reweight:
        weights = (inverse_frequency_weights(pool.pair_of_tile) if spec.reweight == "inverse_freq"
                   else importance_weights(pool.pair_of_tile))
        tile_weight = torch.tensor([weights.get(p, 1.0) for p in pool.pair_of_tile])

    torch.manual_seed(seed)
    model = build_transformer("micro", TILE, text.dim, in_channels=3, patch_size=PATCH)
    ema = make_ema(model.parameters(), decay=0.999)
    # the trainer's builder; the warm-up's head start of one step is the protocol's own (composition.py's docstring)
    optimizer, warmup = build_adamw(model.parameters(), lr=2e-3, weight_decay=0.0, warmup_steps=100,
                                    warmup_head_start=1)
    accelerator = Accelerator(cpu=True)  # one process: the trainer's step on this machine's CPU
    model, optimizer, warmup = accelerator.prepare(model, optimizer, warmup)
    objective = build_objective(objective_of(variant))
    loss_fn = spec.loss.build(patch_size=PATCH)
    if spec.shuffle_weights:  # a timestep_mean form: the loss's own level bins
        imba = loss_fn.imba
        imba.weights = weights_shuffled_within_levels(imba.weights, imba.timestep_mean.bin_of,
                                                      generator_for(seed, "shuffle"))
    if tile_weight is not None:
        loss_fn = HalfWeightedLoss(loss_fn.draw_drop, tile_weight, joint=spec.reweight == "importance_joint")
    select_gen, noise_gen = generator_for(seed, "select"), generator_for(seed, "noise")
    drop_gen, lever_gen = generator_for(seed, "drop"), generator_for(seed, "lever")
    units = [0]  # forward rows × 3 with gradient, × 1 without: a plain step of B rows is 3B

    def predict_fn(noisy, timesteps, embeds, mask):
        units[0] += noisy.shape[0] * (3 if torch.is_grad_enabled() else 1)
        return predict(model, noisy, timesteps, embeds, mask, 1)

    online = weighted is not None and weighted.online is not None
    hooks = Hooks(accelerator, [OnlineSceneBalance(weighted, objective.num_train_timesteps, PATCH) if online else None])
    # the trainer's step: loss, hooks, backward, the gradient clip at 1, the divergence guard, AdamW and warm-up
    train_step = TrainStep(accelerator, model, optimizer, warmup, loss_fn, predict_fn, hooks,
                           DivergenceGuard(accelerator, max_bad_steps=10), grad_clip=1.0)

    batch = job["batch_size"]
    objects = torch.zeros(len(COLOURS) + HUES, len(SHAPES))  # (colour, shape) of every object trained on
    tile_seen = torch.zeros(len(pool), dtype=torch.long)
    scene_seen = torch.zeros(len(scene_pool) if scene_pool is not None else 0, dtype=torch.long)
    online_scenes: set = set()
    window = {b: [0.0, 0] for b in BUCKETS}  # IMBA distance per bucket (sum, count) since the last curve point
    curve: list[dict] = []
    results, losses, start = {}, [], time.perf_counter()
    for step in range(1, lengths[-1] + 1):
        if weighted is not None:
            chosen = weighted.draw(batch, select_gen)
            scene_seen.index_add_(0, chosen, torch.ones_like(chosen))
            left, right = scene_pool.left[chosen], scene_pool.right[chosen]
        elif scene_pool is not None:
            chosen = scene_pool.draw(batch, stream, select_gen)
            scene_seen.index_add_(0, chosen, torch.ones_like(chosen))
            left, right = scene_pool.left[chosen], scene_pool.right[chosen]
        else:
            left, right = pool.draw(batch, stream, select_gen), pool.draw(batch, stream, select_gen)
            if spec.bursty:
                right = pool.same_colour(left, spec.bursty, right, lever_gen)
            online_scenes.update(zip(left.tolist(), right.tolist()))
        drawn = torch.cat([left, right])
        stream_objects(objects, pool.colour_of_tile[drawn], pool.shape_of_tile[drawn])
        tile_seen.index_add_(0, drawn, torch.ones_like(drawn))
        scenes = pool.scenes(left, right)
        if spec.jitter:
            turns = spec.jitter * (2 * torch.rand(2 * len(left), generator=lever_gen) - 1)
            halves = rotate_hue(torch.cat([scenes[..., :TILE], scenes[..., TILE:]]), turns)
            scenes = torch.cat(halves.chunk(2), dim=3)
        noised = objective.noise(scenes, generator=noise_gen)
        cond = text.encode([pool.pair_of_tile[i] for i in left.tolist()],
                           [pool.pair_of_tile[i] for i in right.tolist()])
        null = text.null(len(left))
        reweighted = dict(left=left, right=right) if tile_weight is not None else {}
        stats, skip = train_step(step, {"chosen": chosen} if online else {}, noised, cond, null, generator=drop_gen,
                                 **reweighted)
        hooks.step_end(step)
        if not skip:
            ema.step(model.parameters())
        losses.append(stats["loss"].item())
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
            evaluation_start = time.perf_counter()
            train_seconds = evaluation_start - start
            ema.store(model.parameters())
            ema.copy_to(model.parameters())
            model.eval()
            read, images = evaluate(model, objective, text, oracles, world, job["per_pair"],
                                    seed=1000 + seed, sampling_steps=job["sampling_steps"])
            if job.get("grid_dir") and step == lengths[-1]:
                save_grid(images, job["per_pair"],
                          Path(job["grid_dir"]) / f"samples_{job['world']}_{variant}_{step}.png")
            diagnostics = world_diagnostics(model, text, world, PATCH, seed=seed)
            if job.get("models_dir"):
                model.save_pretrained(Path(job["models_dir"]) / f"{job['world']}-{variant}-seed{seed}-{step}")
            model.train()
            ema.restore(model.parameters())
            scenes_seen = int((scene_seen > 0).sum()) if scene_pool is not None else len(online_scenes)
            results[step] = {**read, "train_seconds": train_seconds, "compute": units[0] / (3 * batch),
                             "final_loss": statistics.fmean(losses[-50:]), "diagnostics": diagnostics,
                             "attribute_nmi": attribute_nmi(objects),
                             **exposure_log(objects, tile_seen, scenes_seen, pool, world)}
            if weighted is not None:
                results[step]["stream_factors"] = weighted.log()
            start += time.perf_counter() - evaluation_start  # train_seconds counts training steps only
    return {"variant": variant, "seed": seed, "world": job["world"], "settings": {k: job[k] for k in JOB_SETTINGS},
            "buckets": world.bucket_of_name, "held_out": [pair_name(p) for p in world.held_out],
            "ranks": {"colour": {COLOURS[c]: r for c, r in enumerate(world.colour_rank)},
                      "shape": {SHAPES[s]: r for s, r in enumerate(world.shape_rank)}},
            "results": results, "distance_curve": curve}
