"""Synthetic composition benchmark: does a loss or a stream close the gap that data imbalance opens? (paper Tab. 1/3)

    python bench/composition.py                 # the default: 4 variants, both worlds, 5 seeds, fixed scenes
    python bench/composition.py --quick         # 1 seed, both worlds: three streams, efficient IMBA, caption-balanced
    python bench/composition.py --variants all  # every form in VARIANTS
    python bench/composition.py --variants plain plain_balanced plain_concept_balanced imba_target_tnorm_efficient \
        caption_balanced imba_grouped --worlds concept_tail pair_tail captioned --reach-controls \
        --out bench/composition_balance         # streams balanced without labels, on to the controls' 1,950 steps
    python bench/composition.py --variants plain plain_balanced caption_balanced \
        --worlds pair_tail captioned --seeds 5 6 7 8 9 10 11 12 13 --steps 1000 1500 1950 \
        --out bench/composition_heldout         # the headline lever on seeds no setting was chosen on
    python bench/composition.py --population --out bench/composition_population
                                                # the levers over a population of worlds (composition_worlds.py)
    python bench/composition.py --levers        # data levers and representation diagnostics (online scenes)
    python bench/composition.py --diagnose OUT/models/<world>-<variant>-seed<s>-<steps> --out DIR
    python bench/composition.py --report bench/composition_balance   # its tables and figures again from its record

Output, in --out: results.md (every table, for both oracles, per whole prompt and per probed half), results.json.gz
(the record: the settings, the judges, every run and every table), composition.png, exposure.png,
monitor_<world>.png (levers.png and blocks.png with --levers), samples_<world>_<variant>_<steps>.png (the first
seed's last evaluation), models/ (the EMA weights at every evaluation, for --diagnose) and runs/. `--report STUDY`
writes results.md, the record and the figures again from a study's record alone. Each finished run is saved in runs/
as it ends and is reused, as are the runs of the record, when a later command asks for the same (world, variant, seed)
with the same settings: a study can be split over several commands, and an interrupted one reruns only what is
missing. Runs carry the protocol number (PROTOCOL), and runs of another protocol are never reused. Each run trains
in a process of its own (--workers, at most 2 by default, one thread each). The recorded results and their reading
are in bench/README.md ("The composition benchmark").

Worlds (bench/composition_scenes.py): 16 × 32 scenes of two objects, "a <colour> <shape> and a <colour> <shape>",
8 colours × 5 shapes. "concept_tail": colours and shapes each Zipf(2), so rare pairs are pairs of rare words;
"pair_tail": single concepts about equally frequent, their combinations long-tailed (rare pairs of common words);
"captioned": pair_tail's images with captions as a re-captioner writes them (phrasings, synonyms, omitted and wrong
colours, distractor words; `composition_scenes.realistic_caption`), which only the caption-reading streams read: a
variant that reads no captions is the same computation as in pair_tail and its run is shared. "drawn-K": world K of
the family of composition_worlds.py, long-tailed in a way of its own (Zipf exponents of colours and shapes, a law of
their pairs, which pairs are held out, how noisy its captions are, all drawn from K); `--population` judges the
levers over the named worlds and five drawn ones kept back from every choice of setting. Which colour and shape
take which frequency rank, and so which pairs are held out, is drawn from the seed (--fixed-ranks keeps the listed
order). A pool of single-object tiles per seed holds the pairs in proportion (head pairs hundreds to thousands of
tiles, the rarest 8); 6 pairs are held out of training. An oracle CNN (shipped: composition_oracle.pt, or
--train-oracle, or --oracle PATH) reads each half of a generated scene; a second oracle, trained from another seed,
reads the same scenes (the judge's own uncertainty).

Scenes: "fixed" (default) composes each seed's scenes once (every tile in two scenes, once per side) and a stream
draws among them, as a sampler of a real data set can only draw among its images; "online" composes each scene at
batch time from two drawn tiles. Streams: long-tailed (uniform), pair-balanced (every
seen pair equally often, the control a balancing method is measured against) and concept-balanced (colour and shape
marginals uniform); balanced streams draw per object (a pair, then a slot showing it). The gap between
`plain_balanced` and `plain` is what a balancing method can close; every other form is reported as the fraction of
that gap it closes (95 % interval over seeds), at equal steps and at equal compute.

Streams balanced without the pair labels (fixed scenes only), the way a user of the data layer balances a real data
set: each scene drawn in proportion to a factor set from its caption's entries (`data.balance`: concepts,
attribute:object bindings at every mention, object pairs). `caption_balanced` / `caption_balanced_a1`: the offline
temperature factors (data.balance=temperature) with α = 0.5 (the shipped default) / 1.0; `imba_grouped`: the factors
of `data.online_balance.OnlineBalance` (data.balance=imba) with its defaults, refreshed every BALANCE_EVERY steps
from the model's own IMBA distance, measured by a no-grad unconditional pass over the first eighth of every batch
(counted compute 1 + 1/24 plain steps at batch 32). They train with the plain loss and are compared with the
controls; they are no controls themselves and run to the equal-step lengths, and with --reach-controls on to the
controls' last point (1,950 steps, and for the online one also 1,872, where its counted compute is the controls'
1,950).

Every variant trains the same DiT ("micro" preset, pixel space, patch 4 → 32 tokens) with, per seed, the same world,
tile and scene pool, initial weights, optimiser (AdamW 2e-3 with 100 warm-up steps, batch 32, gradient clipping 1,
diffusers EMA 0.999 with its default warm-up, so 0.9955 at 2,000 steps) and noise: which tiles a stream selects
comes from a generator of its own, so every stream's noise stays paired with plain's. Each step is the trainer's
own (`imba.training.step.TrainStep`: loss, hooks, backward, clip, divergence guard, optimizer and schedule, on one
CPU process of accelerate), with the trainer's EMA and its training loss; the online-balanced stream observes its
rows as a hook, as `data.balance=imba` does in a run. The optimiser and its schedule are the trainer's builder's
(`imba.training.build.build_adamw`) with one setting of the benchmark's own, a warm-up head start of one step
(`warmup_head_start=1`): step 1 trains at 1/100 of the rate, where the trainer's starts at 0. Compute is counted
per run: every forward row with gradient costs 3 units, every row of a no-grad pass 1, and a plain step of B rows
3B. The stream controls also train on to the longest length times the largest nominal cost of the other variants,
so that their success can be read at any variant's counted compute by interpolation (--no-equal-compute turns this
off).

Evaluation at every length a run is evaluated at: for each of the 40 pairs, N two-object prompts with the pair on one
side and a head pair on the other; N samples from the EMA weights (DPM-Solver++ 10 steps, classifier-free guidance
3). A prompt succeeds when the oracle reads both objects right; the probed half alone is reported beside it (a
prompt also fails when its partner fails). Reported per world and per bucket of the probed pair (head / torso /
tail by training frequency, held-out), per concept and per pair against its exposure (objects trained on).

The benchmark's parts: this file runs a study (the command line, its runs saved and reused, `--report` and
`--diagnose`); composition_run.py one run (`run_one`: one world, variant and seed, trained and evaluated);
composition_variants.py holds the variants as data and the plan of each mode; composition_weighting.py the
weighting variants' loss and streams; composition_report.py the tables, figures and the study's record;
composition_population_table.py the table of a study over drawn worlds (each lever's mean and worst world);
seed_stats.py the statistics over seeds; composition_scenes.py the worlds, streams and judge; composition_worlds.py
the family of drawn worlds and the population; composition_diagnostics.py the representation diagnostics.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shlex
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for path in (str(REPO), str(REPO / "bench")):
    if path not in sys.path:
        sys.path.insert(0, path)

import torch  # noqa: E402

from composition_report import RESULTS, judge_reports, load_results, study_report  # noqa: E402
from composition_run import JOB_SETTINGS, PATCH, SAMPLING_STEPS, run_one  # noqa: E402
from composition_scenes import (WORLDS, PairWorld, WordEncoder, check_world, images_of, pair_name,  # noqa: E402
                                train_oracle)
from composition_variants import (CAPTION_STREAMS, DEFAULT_PER_PAIR, DEFAULT_SEEDS, DEFAULT_STEPS,  # noqa: E402
                                  DEFAULT_VARIANTS, DEFAULT_WORLDS, LEVER_VARIANTS, POPULATION_VARIANTS, QUICK_STEPS,
                                  QUICK_VARIANTS, VARIANTS, WEIGHTED_STREAMS, equal_compute_steps, relative_cost,
                                  train_lengths)
from composition_worlds import POPULATION, POPULATION_SEEDS, POPULATION_STEPS, is_drawn  # noqa: E402

# the study's judges and protocol
ORACLE = REPO / "bench" / "composition_oracle.pt"  # the judge's weights; its report: the same name with .json
ORACLE_B = REPO / "bench" / "composition_oracle_b.pt"  # a second judge (train_oracle(seed=1)): its reading beside
# the first one's tells the judge's own uncertainty
PROTOCOL = 2  # part of a run's settings: a run of another protocol (bench/history.md) is not reused


def _key(job: dict) -> tuple:
    return job["world"], job["variant"], job["seed"]


def computed_as(job: dict) -> dict:
    """The job whose run `job` is: a variant that reads no captions (image clusters are no captions) trains in the
    captioned world exactly as in pair_tail, whose images, labels and draws it shares, so its run is computed (or
    reused) once, as pair_tail's."""
    if images_of(job["world"]) != job["world"] and VARIANTS[job["variant"]].stream not in CAPTION_STREAMS:
        return {**job, "world": images_of(job["world"])}
    return job


def in_world(run: dict, world: str) -> dict:
    """`run` reported under `world` (a run of the world whose images `world` shares, or its own)."""
    return {**run, "world": world, "settings": {**run["settings"], "world": world}}


def _run_path(runs_dir: Path, run: dict) -> Path:
    return runs_dir / f"{run['world']}-{run['variant']}-seed{run['seed']}.json"


def save_run(runs_dir: Path, run: dict) -> None:
    path = _run_path(runs_dir, run)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(run))
    tmp.replace(path)


def saved_run(runs_dir: Path, job: dict, recorded: list[dict] = ()) -> dict | None:
    """A finished run of this job with the same settings, from `runs_dir` or from the runs of the study's record
    (`recorded`), or None."""
    path = _run_path(runs_dir, job)
    candidates = [json.loads(path.read_text())] if path.is_file() else []
    candidates += [r for r in recorded if (r.get("world"), r["variant"], r["seed"]) ==
                   (job["world"], job["variant"], job["seed"])]
    for run in candidates:
        if run.get("settings") == {k: job[k] for k in JOB_SETTINGS}:
            return {**run, "results": {int(k): v for k, v in run["results"].items()}}
    return None


def diagnose_saved_model(folder: Path, out: Path) -> int:
    """`--diagnose`: the representation diagnostics of a model saved by a benchmark run, as JSON and a plot."""
    from composition_diagnostics import world_diagnostics
    from diffusers import PixArtTransformer2DModel

    from imba.plots import plot_block_diagnostics

    if not (folder / "config.json").is_file():
        raise SystemExit(f"error: {folder} holds no saved model (config.json): pass a folder of OUT/models/")
    model = PixArtTransformer2DModel.from_pretrained(folder).eval()
    # <world>-<variant>-seed<s>-<steps>: the run's own world (ranks drawn from its seed)
    drawn = folder.name.startswith("drawn-")
    world_name, _, rest = folder.name.removeprefix("drawn-").partition("-")
    world_name = f"drawn-{world_name}" if drawn else world_name
    seed = rest.rsplit("-seed", 1)[-1].split("-")[0] if "-seed" in rest else ""
    known = world_name in WORLDS or (drawn and world_name[6:].isdigit())
    world = PairWorld(world_name, int(seed)) if known and seed.isdigit() else PairWorld()
    result = world_diagnostics(model, WordEncoder(seed=0), world, PATCH)
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


def add_population(out: Path, payload: dict) -> str:
    """A study over drawn worlds: the population table (composition_population_table.py) at its longest equal-step
    length, appended to its results.md; "" for a study of the named worlds alone."""
    from composition_population_table import population_report, population_table, world_gaps

    if not any(is_drawn(w) for w in payload["worlds"]):
        return ""
    length = max(payload["lengths"])
    text = (population_report(population_table(payload["runs"], payload["worlds"], length), length)
            + world_gaps(payload["runs"], payload["worlds"], length))
    with open(out / "results.md", "a") as f:
        f.write(text)
    return text


def world_name(name: str) -> str:
    """--worlds' type: a world's name, checked."""
    if name != "population":
        try:
            check_world(name)
        except ValueError as exn:
            raise argparse.ArgumentTypeError(str(exn)) from None
    return name


def run_plan(args):
    """What a command line runs: (variants, worlds, scenes, seeds, lengths, per_pair), each the one given or the
    default of its mode (the benchmark, `--quick`, `--levers`, `--levers --quick`, `--population`)."""
    if args.population:
        args.variants = args.variants or POPULATION_VARIANTS
        args.worlds, args.seeds = args.worlds or ["population"], args.seeds or list(POPULATION_SEEDS)
        args.steps = args.steps or [POPULATION_STEPS]
    variants = args.variants or (LEVER_VARIANTS if args.levers else QUICK_VARIANTS if args.quick
                                 else DEFAULT_VARIANTS)
    if "all" in variants:
        variants = list(VARIANTS)
    worlds = args.worlds or (["concept_tail"] if args.levers else list(DEFAULT_WORLDS))
    worlds = list(dict.fromkeys(w for name in worlds for w in (POPULATION if name == "population" else [name])))
    scenes = args.scenes or ("online" if args.levers else "fixed")
    seeds = args.seeds or ([0] if args.quick else [0, 1, 2] if args.levers else DEFAULT_SEEDS)
    lengths = sorted(args.steps or ([400] if args.quick and args.levers else QUICK_STEPS if args.quick
                                    else [1000] if args.levers else DEFAULT_STEPS))
    per_pair = args.per_pair or (4 if args.quick and args.levers else 8 if args.quick else 16 if args.levers
                                 else DEFAULT_PER_PAIR)
    return variants, worlds, scenes, seeds, lengths, per_pair


def detail_length(args, lengths: list[int], factors: tuple[float, ...]) -> int:
    """Where the detail tables are read: the longest equal-step length, or with --reach-controls the controls' last
    point (the longest length times the largest nominal cost)."""
    if args.reach_controls and not args.no_equal_compute and factors:
        return equal_compute_steps(lengths[-1], max(factors))
    return lengths[-1]


def report_from_record(folder: Path, out: Path) -> int:
    """`--report`: the study recorded in `folder` reported again from its runs and judges, into `out`, as the
    command it records wrote it (no training, no sampling)."""
    payload = load_results(folder)
    if payload is None or "judges" not in payload:
        raise SystemExit(f"error: {folder} holds no study of this benchmark's protocol ({RESULTS} with its judges); "
                         "pass a folder the benchmark wrote")
    recorded = build_parser().parse_args(shlex.split(payload["command"])[2:])
    factors = tuple(sorted({relative_cost(v, recorded.batch_size) for v in payload["variants"]} - {1.0}))
    out.mkdir(parents=True, exist_ok=True)
    study_report(out, payload, payload["lengths"], detail_length(recorded, payload["lengths"], factors))
    add_population(out, payload)
    print(f"wrote {out / 'results.md'}, {out / RESULTS} and the figures from the {len(payload['runs'])} runs recorded "
          f"in {folder}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"1 seed, both worlds, {' '.join(QUICK_VARIANTS)}, {QUICK_STEPS[0]} steps, 8 samples "
                             "per pair (with --levers: 1 seed, 400 steps, 4 samples per pair)")
    parser.add_argument("--population", action="store_true",
                        help=f"the population study: {' '.join(POPULATION_VARIANTS)} on the worlds of "
                             f"composition_worlds.POPULATION, seeds {' '.join(map(str, POPULATION_SEEDS))}, "
                             f"{POPULATION_STEPS} steps")
    parser.add_argument("--levers", action="store_true",
                        help=f"the data-levers experiment: {' '.join(LEVER_VARIANTS)}, 1000 steps, online scenes, "
                             "concept_tail world, the plain-cost variants also at the efficient estimator's compute")
    parser.add_argument("--diagnose", type=Path, default=None, metavar="MODEL",
                        help="only write the representation diagnostics (JSON and plot) of a model the benchmark "
                             "saved (OUT/models/<world>-<variant>-seed<s>-<steps>) into --out")
    parser.add_argument("--variants", nargs="+", choices=[*VARIANTS, "all"], default=None, metavar="NAME",
                        help=f"names from VARIANTS ({', '.join(VARIANTS)}) or all; default: "
                             f"{' '.join(DEFAULT_VARIANTS)}")
    parser.add_argument("--worlds", nargs="+", type=world_name, default=None, metavar="WORLD",
                        help=f"{', '.join(WORLDS)}, drawn-K (a world of composition_worlds.py's family) or "
                             f"population (its population); default: {' '.join(DEFAULT_WORLDS)} "
                             "(--levers: concept_tail)")
    parser.add_argument("--scenes", choices=("fixed", "online"), default=None,
                        help="fixed: each seed's scenes composed once, streams draw among them (default); online: "
                             "each scene composed at batch time (the default with --levers)")
    parser.add_argument("--fixed-ranks", action="store_true",
                        help="keep the listed order of colours and shapes as their frequency ranks for every seed "
                             "instead of drawing it from the seed")
    parser.add_argument("--seeds", nargs="+", type=int, default=None,
                        help=f"default {' '.join(map(str, DEFAULT_SEEDS))} (quick: 0; levers: 0 1 2)")
    parser.add_argument("--steps", nargs="+", type=int, default=None,
                        help=f"equal-step lengths every variant is evaluated at (default "
                             f"{' '.join(map(str, DEFAULT_STEPS))}); the stream controls also run on to the longest "
                             "times the largest nominal cost of the other variants, for the equal-compute "
                             "comparisons")
    parser.add_argument("--reach-controls", action="store_true",
                        help="train every variant cheaper than the costliest on to the stream controls' last point "
                             "too (the longest length times the largest nominal cost), evaluated there at equal steps "
                             "and at equal compute, and report the detail tables there")
    parser.add_argument("--no-equal-compute", action="store_true",
                        help="do not train the stream controls on to the other variants' compute")
    parser.add_argument("--per-pair", type=int, default=None,
                        help=f"samples per pair (default {DEFAULT_PER_PAIR}; quick: 8; levers: 16)")
    parser.add_argument("--sampling-steps", type=int, default=SAMPLING_STEPS,
                        help=f"DPM-Solver++ steps per evaluation sample (default {SAMPLING_STEPS})")
    parser.add_argument("--oracle", type=Path, default=ORACLE,
                        help="the judge's weights, its report beside them as .json (default: the shipped oracle)")
    parser.add_argument("--oracle-b", type=Path, default=ORACLE_B,
                        help="a second judge read beside the first (default: the shipped second oracle)")
    parser.add_argument("--train-oracle", action="store_true",
                        help="train the oracle anew into OUT/oracle.pt (+ .json) and judge with it (≈ 1.5 min)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--pool", type=int, default=8192, help="tiles in the training pool per seed")
    parser.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1),
                        help="parallel training processes (one thread each)")
    parser.add_argument("--report", type=Path, default=None, metavar="STUDY",
                        help=f"only report the study recorded in STUDY ({RESULTS}) again: its results.md, record and "
                             "figures from its runs, into --out (default: STUDY itself)")
    parser.add_argument("--out", type=Path, default=None,
                        help="output folder (default bench/composition_results; with --report, STUDY)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.report:
        return report_from_record(args.report, args.out or args.report)
    args.out = args.out or REPO / "bench" / "composition_results"
    if args.diagnose:
        return diagnose_saved_model(args.diagnose, args.out)
    variants, worlds, scenes, seeds, lengths, per_pair = run_plan(args)
    equal_compute = not args.no_equal_compute
    factors = tuple(sorted({relative_cost(v, args.batch_size) for v in variants} - {1.0}))
    batch_time = [v for v in variants if VARIANTS[v].bursty]
    if scenes == "fixed" and batch_time:
        raise SystemExit(f"error: {' '.join(batch_time)} composes its scenes at batch time; run it with "
                         "--scenes online")
    weighted = [v for v in variants if VARIANTS[v].stream in WEIGHTED_STREAMS]
    if scenes == "online" and weighted:
        raise SystemExit(f"error: {' '.join(weighted)} weights a fixed pool of scenes; run it with "
                         "--scenes fixed")
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
    oracle_b = args.oracle_b if args.oracle_b and args.oracle_b.is_file() else None
    oracle_report = json.loads(oracle_path.with_suffix(".json").read_text())
    print(f"oracle: {100 * oracle_report['pair_accuracy']:.2f} % of {oracle_report['test_tiles']} fresh tiles read "
          f"right ({100 * oracle_report['empty_accuracy']:.2f} % of empty ones)", flush=True)

    jobs = [dict(variant=v, seed=s, world=w, scenes=scenes, fixed_ranks=args.fixed_ranks, protocol=PROTOCOL,
                 steps=train_lengths(v, lengths, equal_compute, factors, args.reach_controls, args.batch_size),
                 per_pair=per_pair,
                 sampling_steps=args.sampling_steps, batch_size=args.batch_size, pool=args.pool,
                 oracle=str(oracle_path), oracle_b=str(oracle_b) if oracle_b else None,
                 grid_dir=str(args.out) if s == seeds[0] else None, models_dir=str(args.out / "models"))
            for w in worlds for s in seeds for v in variants]
    # seed by seed, so a study stopped part-way has whole seeds of every world; within a seed longest first, for
    # packing
    jobs.sort(key=lambda j: (seeds.index(j["seed"]), -relative_cost(j["variant"], args.batch_size) * max(j["steps"])))
    # every finished run is saved at once: an interrupted benchmark reruns only the missing ones, and the runs
    # of the study's record (committed with the results) are reused too
    runs_dir = args.out / "runs"
    runs_dir.mkdir(exist_ok=True)
    recorded = (load_results(args.out) or {"runs": []})["runs"]
    finished, todo = {}, []
    for job in {_key(computed_as(j)): computed_as(j) for j in jobs}.values():
        done = saved_run(runs_dir, job, recorded)
        if done:
            finished[_key(job)] = done
        else:
            todo.append(job)
    if finished:
        print(f"reusing {len(finished)} finished runs from {runs_dir}", flush=True)
    context = multiprocessing.get_context("spawn")
    with context.Pool(args.workers) as pool:
        for run in pool.imap_unordered(run_one, todo):
            save_run(runs_dir, run)
            finished[_key(run)] = run
            last = run["results"][max(run["results"])]
            print(f"[{time.perf_counter() - started:6.0f} s] {run['world']} {run['variant']} seed {run['seed']}: "
                  f"{last['train_seconds']:.0f} s training, final loss {last['final_loss']:.4f}", flush=True)
        pool.close()  # let the workers exit on their own: the terminate() of `with` can deadlock on idle ones
        pool.join()
    runs = [in_world(finished[_key(computed_as(job))], job["world"]) for job in jobs]
    command = "python bench/composition.py " + " ".join(argv if argv is not None else sys.argv[1:])
    judges = judge_reports({"oracle": oracle_path, **({"second oracle": oracle_b} if oracle_b else {})})
    payload = {
        "command": command, "seeds": seeds, "lengths": lengths, "worlds": worlds, "scenes": scenes,
        "fixed_ranks": args.fixed_ranks, "per_pair": per_pair, "sampling_steps": args.sampling_steps,
        "variants": variants, "oracle": oracle_report, "judges": judges, "wall_seconds": time.perf_counter() - started,
        "pool_tiles": {w: {pair_name(p): n for p, n in PairWorld(w).pool_counts(args.pool).items()} for w in worlds},
        "worlds_results": None, "runs": runs,
    }
    report = study_report(args.out, payload, lengths, detail_length(args, lengths, factors))
    report += add_population(args.out, payload)
    print(report)
    print(f"wrote {args.out}/{RESULTS}, results.md, composition.png in {payload['wall_seconds'] / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
