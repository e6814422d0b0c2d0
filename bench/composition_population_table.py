"""The population table of the composition benchmark: each lever judged over a population of worlds
(composition_worlds.py) at equal compute, by its mean and its worst world, against the goal the study is run for.

Per world, a lever's gain over plain and the balance gap (plain_balanced − plain) are means over that world's seeds
of the paired per-seed differences (`composition_report.gap_closed`, the controls read at the lever's counted
compute). Over a group of worlds: the share of the gap closed is Σ gains / Σ gaps over the worlds, its 95 %
interval Fieller's over the worlds (each world one repetition: its seeds' spread is inside its mean); the worst world
is the one that closes the least, with its own interval over its seeds ("—" where its gap is not clearly above 0);
the head cost is the mean head gain over the worlds (± 95 % t) and the worst world's. The goal: at least GOAL of
the gap on tail and on held-out pairs in every world, no world losing more than HEAD_LOSS points on the head.
"""

from __future__ import annotations

from composition_report import gap_closed
from composition_worlds import KEPT_BACK
from seed_stats import fraction_interval, mean_ci

GOAL, HEAD_LOSS = 0.8, 2.0  # of the gap closed; points of head success
GAP_BUCKETS = ("tail", "held_out")


def population_table(runs: list[dict], worlds: list[str], length: int, metric: str = "per_pair") -> dict:
    """{variant: {group: {bucket: cell, "head": cell, "worlds": n}}}, group "all" and "kept back" (the worlds of
    `worlds` in KEPT_BACK); a bucket's cell: closed (Σ gain / Σ gap) with its interval, the worst world, its
    closed share and interval, and how many worlds reach GOAL; the head's: mean gain ± t, the worst world's gain."""
    per_world: dict = {}
    for world in worlds:
        table = gap_closed([r for r in runs if r["world"] == world], [length], compute=True, metric=metric)
        for variant, cell in table.get(length, {}).items():
            per_world.setdefault(variant, {})[world] = cell["buckets"]
    out: dict = {}
    for variant, by_world in per_world.items():
        groups = {"all": [w for w in worlds if w in by_world],
                  "kept back": [w for w in worlds if w in by_world and w in KEPT_BACK]}
        for group, names in groups.items():
            if not names:
                continue
            cells: dict = {"worlds": len(names)}
            for bucket in GAP_BUCKETS:
                gains = [by_world[w][bucket]["gain"][0] for w in names]
                gaps = [by_world[w][bucket]["gap"][0] for w in names]
                share = {w: (by_world[w][bucket]["gain"][0] / by_world[w][bucket]["gap"][0]
                             if by_world[w][bucket]["gap"][0] > 0 else None) for w in names}
                ranked = sorted(names, key=lambda w: (share[w] is not None, share[w] or 0.0))
                worst = ranked[0]
                cells[bucket] = {
                    "closed": sum(gains) / sum(gaps) if sum(gaps) > 0 else None,
                    "closed_ci": fraction_interval(gains, gaps) if len(names) > 1 else None,
                    "gap": mean_ci(gaps), "worst": worst, "worst_closed": share[worst],
                    "worst_ci": by_world[worst][bucket]["fraction_ci"],
                    "at_goal": sum(share[w] is not None and share[w] >= GOAL for w in names)}
            heads = {w: 100 * by_world[w]["head"]["gain"][0] for w in names}  # points
            worst = min(names, key=lambda w: heads[w])
            cells["head"] = {"gain": mean_ci(list(heads.values())), "worst": worst, "worst_gain": heads[worst]}
            out.setdefault(variant, {})[group] = cells
    return out


def _share(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.0f} %"


def _interval(ci) -> str:
    return " [—]" if ci is None else f" [{100 * ci[0]:.0f}, {100 * ci[1]:.0f}]"


def population_report(table: dict, length: int) -> str:
    """The population table as markdown: a row per lever and group of worlds."""
    lines = [f"\n## The population, equal compute, {length} steps, whole prompt\n",
             "Share of the balance gap closed: Σ gains / Σ gaps over the worlds [95 % Fieller over the worlds]; "
             "worst: the world closing least [its 95 % interval over its seeds]; [—]: no bounded interval (one "
             "world, or a gap whose interval reaches 0); at goal: worlds closing ≥ "
             f"{100 * GOAL:.0f} %; head: gain over plain in points, mean ± 95 % t over the worlds, and the worst "
             f"world's. The goal: ≥ {100 * GOAL:.0f} % of both gaps in every world, no head loss beyond "
             f"{HEAD_LOSS:g} points.\n",
             "| lever | worlds | tail closed | worst tail | held-out closed | worst held-out | at goal (tail / "
             "held-out) | head gain | worst head |",
             "|---|---|---|---|---|---|---|---|---|"]
    for variant, groups in sorted(table.items()):
        for group, c in groups.items():
            tail, held, head = c["tail"], c["held_out"], c["head"]
            lines.append(
                f"| {variant} | {group} ({c['worlds']}) | {_share(tail['closed'])}{_interval(tail['closed_ci'])} | "
                f"{tail['worst']}: {_share(tail['worst_closed'])}{_interval(tail['worst_ci'])} | "
                f"{_share(held['closed'])}{_interval(held['closed_ci'])} | "
                f"{held['worst']}: {_share(held['worst_closed'])}{_interval(held['worst_ci'])} | "
                f"{tail['at_goal']} / {held['at_goal']} of {c['worlds']} | "
                f"{head['gain'][0]:+.1f} ± {head['gain'][1]:.1f} | {head['worst']}: {head['worst_gain']:+.1f} |")
    return "\n".join(lines) + "\n"


def world_gaps(runs: list[dict], worlds: list[str], length: int, metric: str = "per_pair") -> str:
    """Per world, the balance gap on tail and held-out pairs at `length` (mean ± 95 % t over its seeds): where the
    population's shares are read against."""
    lines = ["\n| world | tail gap | held-out gap |", "|---|---|---|"]
    for world in worlds:
        table = gap_closed([r for r in runs if r["world"] == world], [length], compute=False, metric=metric)
        cells = next(iter(table.get(length, {}).values()), None)
        if cells is None:
            continue
        gaps = [cells["buckets"][b]["gap"] for b in GAP_BUCKETS]
        lines.append(f"| {world} | " + " | ".join(f"{100 * m:.1f} ± {100 * ci:.1f}" for m, ci in gaps) + " |")
    return "\n".join(lines) + "\n"
