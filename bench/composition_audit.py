"""The outside audit's numbers, recomputed from the runs recorded under the benchmark's first protocol
(bench/history.md, "The composition benchmark's first protocol"):

    python bench/composition_audit.py            # reads bench/composition_results, composition_levers, composition_reweight

Those recordings used one world for every seed (`PairWorld()`: the listed order of colours and shapes as their
frequency ranks), so pair names and buckets are the same in every run. Prints, at 2,000 steps unless said:
- finding 2: how much of the tail gap (plain_balanced − plain) sits on the tail pairs holding cross or orange, and
  each group's success; the held-out gain of imba_target_tnorm per pair; each IMBA form on those pairs;
- finding 3: tiles per shape in the pool and plain's success on the pairs holding it;
- finding 4: how many of the 16 prompts of each pair have red cross as the partner, and plain's red cross;
- finding 5: the efficient form's paired differences at equal compute, its step time over plain's (training
  seconds to 2,000 steps, same seeds), and how many distinct NMI values the levers' 18 runs take;
- finding 6: the EMA decay in effect at 2,000 steps, and what the distance curves log (d, not D = d^0.8).
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for path in (str(REPO), str(REPO / "bench")):
    if path not in sys.path:
        sys.path.insert(0, path)

from composition_report import load_results  # noqa: E402
from composition_scenes import SHAPES, PairWorld, pair_name, probe_prompts  # noqa: E402
from seed_stats import mean_ci  # noqa: E402

BENCH = REPO / "bench"


def mean_per_pair(runs: list[dict], variant: str, length: int) -> dict[str, float]:
    """Each pair's success averaged over the seeds of one variant at one length."""
    chosen = [r["results"][length]["per_pair"] for r in runs if r["variant"] == variant and length in r["results"]]
    return {name: statistics.fmean(p[name] for p in chosen) for name in chosen[0]}


def seed_differences(runs: list[dict], a: str, la: int, b: str, lb: int, names: list[str]) -> list[float]:
    """Per seed: mean over `names` of a's success at la minus b's at lb."""
    out = []
    for seed in sorted({r["seed"] for r in runs}):
        ra = next(r for r in runs if (r["variant"], r["seed"]) == (a, seed))["results"][la]["per_pair"]
        rb = next(r for r in runs if (r["variant"], r["seed"]) == (b, seed))["results"][lb]["per_pair"]
        out.append(statistics.fmean(ra[n] - rb[n] for n in names))
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    world = PairWorld()
    runs = load_results(BENCH / "composition_results")["runs"]
    names = {b: [pair_name(p) for p in world.pairs if world.buckets[p] == b] for b in world.buckets.values()}
    plain, balanced = mean_per_pair(runs, "plain", 2000), mean_per_pair(runs, "plain_balanced", 2000)

    rare = [n for n in names["tail"] if "cross" in n or "orange" in n]
    others = [n for n in names["tail"] if n not in rare]
    gap = {n: balanced[n] - plain[n] for n in names["tail"]}
    print(f"finding 2: the {len(rare)} tail pairs with cross or orange ({', '.join(rare)}) hold "
          f"{100 * sum(gap[n] for n in rare) / sum(gap.values()):.1f} % of the tail gap; plain "
          f"{100 * statistics.fmean(plain[n] for n in rare):.1f} % vs balanced "
          f"{100 * statistics.fmean(balanced[n] for n in rare):.1f} % there, the other {len(others)}: "
          f"{100 * statistics.fmean(plain[n] for n in others):.1f} vs "
          f"{100 * statistics.fmean(balanced[n] for n in others):.1f} %")
    tnorm = mean_per_pair(runs, "imba_target_tnorm", 2000)
    print("  imba_target_tnorm − plain on held-out pairs (points): "
          + ", ".join(f"{n} {100 * (tnorm[n] - plain[n]):+.1f}" for n in names["held_out"]))
    for variant in ("imba_target", "imba_target_tnorm", "imba_target_tnorm_efficient", "imba_cond_tnorm"):
        mine = mean_per_pair(runs, variant, 2000)
        print(f"  {variant} on those {len(rare)} pairs: {100 * statistics.fmean(mine[n] for n in rare):.1f} %")

    counts = world.pool_counts()
    for s, shape in enumerate(SHAPES):
        holding = [pair_name(p) for p in world.seen if p[1] == s]
        print(f"finding 3: {shape}: {sum(n for p, n in counts.items() if p[1] == s)} tiles, plain "
              f"{100 * statistics.fmean(plain[n] for n in holding):.1f} % over its {len(holding)} seen pairs")

    prompts = probe_prompts(world, 16)
    per_pair = [sum((q[2] if q[1] == p else q[1]) == (0, 3) for q in prompts[16 * i:16 * (i + 1)])
                for i, p in enumerate(world.pairs)]
    print(f"finding 4: red cross is the partner in 2 of 16 prompts for {per_pair.count(2)} of 40 pairs "
          f"(per bucket: " + ", ".join(
              f"{b} {sum(k == 2 for k, p in zip(per_pair, world.pairs) if world.buckets[p] == b)} of "
              f"{len(names[b])}" for b in ("head", "torso", "tail", "held_out")) + f"); plain reads red cross "
          f"{100 * plain['red cross']:.1f} %")

    for bucket in ("tail", "held_out"):
        d = seed_differences(runs, "imba_target_tnorm_efficient", 2000, "plain", 2600, names[bucket])
        print(f"finding 5: imba_target_tnorm_efficient @ 2000 − plain @ 2600 on {bucket}: "
              "{:+.1f} ± {:.1f} points".format(*(100 * x for x in mean_ci(d))))
    seconds = {v: statistics.fmean(r["results"][2000]["train_seconds"] for r in runs if r["variant"] == v)
               for v in ("plain", "imba_target_tnorm_efficient", "imba_target_tnorm")}
    print(f"  training seconds to 2,000 steps over plain's: efficient {seconds['imba_target_tnorm_efficient'] / seconds['plain']:.2f}×, "
          f"literal {seconds['imba_target_tnorm'] / seconds['plain']:.2f}×")
    levers = load_results(BENCH / "composition_levers")["runs"]
    nmi: dict = {}
    for r in levers:
        nmi.setdefault(r["variant"], []).append(r["results"][1000]["attribute_nmi"])
    print(f"  levers: NMI of the {sum(map(len, nmi.values()))} runs at 1,000 steps, per variant (min-max over seeds): "
          + ", ".join(f"{v} {min(x):.4f}-{max(x):.4f}" for v, x in nmi.items()))

    print(f"finding 6: diffusers' EMA warm-up decay min(0.999, (1 + n) / (10 + n)) at n = 2000: "
          f"{min(0.999, 2001 / 2010):.5f}")
    curve = next(r for r in runs if (r["variant"], r["seed"]) == ("imba_target", 0))["distance_curve"]
    print(f"  imba_target seed 0, logged distance (d, per token, before ** 0.8) on head pairs: step "
          f"{curve[0]['step']} {curve[0]['head']:.3f}, step {curve[-1]['step']} {curve[-1]['head']:.3f}; "
          f"D = d^0.8: {curve[0]['head'] ** 0.8:.3f} → {curve[-1]['head'] ** 0.8:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
