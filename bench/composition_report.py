"""The composition benchmark's report: what it reads over seeds (means with their 95 % intervals from
`seed_stats`, the fraction of the stream controls' gap a variant closes at equal steps and at equal compute), its
tables (per world, per bucket, per exposure bin, failure kinds, the levers against the IMBA forms), its figures, and
the study's record (results.json.gz) they are all written from again by `composition.py --report`."""

from __future__ import annotations

import gzip
import json
import math
import statistics
from pathlib import Path

import torch

from composition_scenes import BUCKETS, COLOURS, FAILURES, SHAPES, Oracle, bucket_success, oracle_per_class
from composition_variants import (CONTROLS, VARIANTS, equal_compute_steps, is_lever, is_stream_control,
                                  objective_of, relative_cost)
from seed_stats import fraction_interval, mean_ci

from imba.loss_settings import PlainLoss

# what a run's success is read from: the whole prompt or the probed half alone, by the oracle or the second one
METRICS = ("per_pair", "per_pair_half", "per_pair_b", "per_pair_half_b")


def per_seed(runs: list[dict], metric: str = "per_pair") -> dict:
    """{variant: {length: {seed: {bucket: success}}}}, each run's buckets its own world's."""
    table: dict = {}
    for run in runs:
        for length, result in run["results"].items():
            if metric in result:
                table.setdefault(run["variant"], {}).setdefault(int(length), {})[run["seed"]] = bucket_success(
                    result[metric], run["buckets"])
    return table


def summarise(runs: list[dict], metric: str = "per_pair") -> dict:
    """{length: {variant: {bucket: (mean, ci)}}} over seeds."""
    out: dict = {}
    for variant, lengths in per_seed(runs, metric).items():
        for length, seeds in lengths.items():
            buckets = {b: [seeds[s][b] for s in sorted(seeds)] for b in (*BUCKETS, "all_seen")}
            out.setdefault(length, {})[variant] = {b: mean_ci(v) for b, v in buckets.items()}
    return out


def at_compute(run: dict, compute: float, metric: str, slack: float = 0.02) -> dict | None:
    """The run's per-pair success at `compute` (plain-step equivalents), linearly interpolated between the two
    evaluations around it; an evaluation within `slack` (relative) of it counts as at it; None out of range."""
    points = sorted((r["compute"], r[metric]) for r in run["results"].values() if metric in r and "compute" in r)
    for c, per_pair in points:
        if abs(c - compute) <= slack * compute:
            return per_pair
    for (c0, p0), (c1, p1) in zip(points, points[1:]):
        if c0 < compute < c1:
            w = (compute - c0) / (c1 - c0)
            return {k: (1 - w) * p0[k] + w * p1[k] for k in p0}
    return None


def bucket_rows(per_pair: dict, buckets: dict[str, str], bucket: str) -> list[float]:
    names = [n for n, b in sorted(buckets.items()) if (b != "held_out" if bucket == "all_seen" else b == bucket)]
    return [per_pair[n] for n in names]


def gap_closed(runs: list[dict], lengths: list[int], compute: bool, metric: str = "per_pair") -> dict:
    """Per variant (every one but the long-tailed plain run and its pair-balanced control) and length: the balance
    gap and how much of it the variant closes.

    Against the controls of its objective at the same steps (compute=False), or at the variant's counted compute
    at that length, the controls' success interpolated between their evaluations (compute=True). Per bucket: the
    variant's gain over plain (mean ± 95 % t interval of the per-seed paired differences), the gap
    (plain_balanced − plain, likewise), the fraction = mean gain / mean gap (None where the gap is not clearly
    there: its interval reaches 0, or it is under 5 points) and its 95 % interval over seeds (`fraction_interval`)."""
    by_key = {(r["variant"], r["seed"]): r for r in runs}
    variants = sorted({r["variant"] for r in runs})
    out: dict = {}
    for variant in variants:
        plain, balanced = CONTROLS[objective_of(variant)]
        if variant in (plain, balanced):
            continue
        for length in lengths:
            seeds, refs = [], {}
            for seed in sorted({s for v, s in by_key if v == variant}):
                mine, base, ctrl = by_key.get((variant, seed)), by_key.get((plain, seed)), by_key.get((balanced, seed))
                if not (mine and base and ctrl) or length not in mine["results"]:
                    continue
                result = mine["results"][length]
                if compute:
                    ref = result["compute"]
                    b, c = at_compute(base, ref, metric), at_compute(ctrl, ref, metric)
                else:
                    ref = length
                    b = base["results"].get(length, {}).get(metric)
                    c = ctrl["results"].get(length, {}).get(metric)
                if b is None or c is None or metric not in result:
                    continue
                seeds.append(seed)
                refs[seed] = (ref, result[metric], b, c, mine["buckets"])
            if not seeds:
                continue
            cells = {}
            for bucket in (*BUCKETS, "all_seen"):
                mine_rows = [bucket_rows(refs[s][1], refs[s][4], bucket) for s in seeds]
                base_rows = [bucket_rows(refs[s][2], refs[s][4], bucket) for s in seeds]
                ctrl_rows = [bucket_rows(refs[s][3], refs[s][4], bucket) for s in seeds]
                gains = [[m - b for m, b in zip(mr, br)] for mr, br in zip(mine_rows, base_rows)]
                gaps = [[c - b for c, b in zip(cr, br)] for cr, br in zip(ctrl_rows, base_rows)]
                gain = mean_ci([statistics.fmean(x) for x in gains])
                gap = mean_ci([statistics.fmean(x) for x in gaps])
                # a fraction of a gap that is not there (its CI reaches 0, or under 5 points) means nothing
                real = gap[0] > max(gap[1], 0.05)
                cells[bucket] = {"gain": gain, "gap": gap, "fraction": gain[0] / gap[0] if real else None,
                                 "fraction_ci": (fraction_interval([statistics.fmean(x) for x in gains],
                                                                   [statistics.fmean(x) for x in gaps])
                                                 if real else None)}
            out.setdefault(length, {})[variant] = {
                "reference": statistics.fmean(refs[s][0] for s in seeds), "seeds": seeds, "buckets": cells}
    return out


EXPOSURE_BINS = (0, 100, 300, 1000, 3000, 10000, float("inf"))  # objects of a pair trained on


def exposure_tables(runs: list[dict], length: int, metric: str = "per_pair_half") -> dict:
    """At one length, per variant: success of seen pairs binned by how many objects of the pair the run trained on
    ({bin: (mean success, pairs × seeds)}); per concept rank and per concept name (colours and shapes), its objects
    trained on and the success of the seen pairs holding it (means over seeds); held-out pairs against the smaller
    exposure of their two concepts."""
    out: dict = {}
    for run in runs:
        result = run["results"].get(length)
        if not result or "exposure" not in result or metric not in result:
            continue
        slot = out.setdefault(run["variant"], {"bins": {}, "colour_rank": {}, "shape_rank": {}, "colour": {},
                                                "shape": {}, "held_out": []})
        exposure, success, buckets = result["exposure"], result[metric], run["buckets"]
        for name, n in exposure.items():
            if buckets[name] == "held_out":
                continue
            k = next(i for i in range(len(EXPOSURE_BINS) - 1) if EXPOSURE_BINS[i] <= n < EXPOSURE_BINS[i + 1])
            slot["bins"].setdefault(k, []).append(success[name])
        for kind, names in (("colour", COLOURS), ("shape", SHAPES)):
            for concept in names:
                holding = [n for n in exposure if concept in n.split(" ")]
                seen = [n for n in holding if buckets[n] != "held_out"]
                total = sum(exposure[n] for n in holding)
                cell = (total, statistics.fmean(success[n] for n in seen))
                slot[kind].setdefault(concept, []).append(cell)
                slot[f"{kind}_rank"].setdefault(run["ranks"][kind][concept], []).append(cell)
        for name in run["held_out"]:
            colour, shape = name.split(" ")
            concept_objects = min(sum(exposure[n] for n in exposure if n.split(" ")[0] == colour),
                                  sum(exposure[n] for n in exposure if n.split(" ")[1] == shape))
            slot["held_out"].append((concept_objects, success[name]))

    def mean_cells(cells):
        return {"objects": statistics.fmean(c[0] for c in cells), "success": statistics.fmean(c[1] for c in cells),
                "runs": len(cells)}

    return {v: {"bins": {f"{EXPOSURE_BINS[k]:g}-{EXPOSURE_BINS[k + 1]:g}": (statistics.fmean(x), len(x))
                         for k, x in sorted(slot["bins"].items())},
                **{key: {str(c): mean_cells(cells) for c, cells in sorted(slot[key].items())}
                   for key in ("colour_rank", "shape_rank", "colour", "shape")},
                "held_out": slot["held_out"]}
            for v, slot in out.items()}


def failure_table(runs: list[dict], length: int) -> dict:
    """{variant: {bucket: {kind: share of that bucket's prompts, over every seed}}} at one length."""
    out: dict = {}
    for run in runs:
        result = run["results"].get(length)
        if result is None:
            continue
        slot = out.setdefault(run["variant"], {b: {k: 0 for k in (*FAILURES, "prompts")} for b in BUCKETS})
        for name, bucket in run["buckets"].items():
            cell = slot[bucket]
            for kind in FAILURES:
                cell[kind] += result["failures"][name][kind]
            cell["prompts"] += run["settings"]["per_pair"]
    return {v: {b: {k: c[k] / c["prompts"] for k in FAILURES} for b, c in buckets.items()}
            for v, buckets in out.items()}


def run_facts(runs: list[dict], length: int) -> dict:
    """Per variant at one length, means over seeds: counted compute per step, training seconds per step, distinct
    tiles and scenes trained on, the largest repeat of one tile overall and among tail tiles, the two oracles'
    largest disagreement on a bucket mean (whole prompts, points), and a weighted stream's factors
    (`WeightedScenes.log`, keys prefixed "stream_")."""
    rows: dict = {}
    for run in runs:
        r = run["results"].get(length)
        if not r:
            continue
        row = {"compute_per_step": r["compute"] / length, "seconds_per_step": r["train_seconds"] / length}
        if "distinct_tiles" in r:
            row.update(distinct_tiles=r["distinct_tiles"], pool_tiles=r["pool_tiles"],
                       distinct_scenes=r["distinct_scenes"], max_tile_repeat=r["max_tile_repeat"],
                       max_tail_tile_repeat=r["max_tile_repeat_by_bucket"].get("tail", 0))
        if "per_pair_b" in r:
            a, b = bucket_success(r["per_pair"], run["buckets"]), bucket_success(r["per_pair_b"], run["buckets"])
            row["oracle_disagreement"] = max(abs(a[k] - b[k]) for k in a)
        row.update({f"stream_{k}": v for k, v in r.get("stream_factors", {}).items()})
        rows.setdefault(run["variant"], []).append(row)

    def mean(values: list):  # a list-valued fact (one value per rarity group) element-wise
        if isinstance(values[0], list):
            return [statistics.fmean(column) for column in zip(*values)]
        return statistics.fmean(values)

    return {v: {k: mean([row[k] for row in rs]) for k in rs[0]} for v, rs in rows.items()}


def _pct(cell: tuple[float, float]) -> str:
    return f"{100 * cell[0]:.1f} ± {100 * cell[1]:.1f}"


def _frac(cell: dict) -> str:
    if cell["fraction"] is None:
        return "—"
    ci = cell.get("fraction_ci")
    return f"{100 * cell['fraction']:.0f} %" + ("" if ci is None else f" [{100 * ci[0]:.0f}, {100 * ci[1]:.0f}]")


METRIC_TITLES = {"per_pair": "whole prompt", "per_pair_half": "probed half alone",
                 "per_pair_b": "whole prompt, second oracle", "per_pair_half_b": "probed half, second oracle"}


def world_report(world: str, summaries: dict, gaps: dict, failures: dict, exposure: dict, facts: dict,
                 variants: list[str], lengths: list[int], seeds: int, detail: int | None = None) -> str:
    """The report of one world: success tables, the gap closed at each of `lengths`, and the exposure, cost and
    failure tables at `detail` steps (default: the longest of `lengths`)."""
    detail = detail or lengths[-1]
    columns = ("head", "torso", "tail", "held_out", "all_seen")
    lines = [f"\n## World `{world}`\n"]
    spread = "± 95 % CI" if seeds > 1 else "one seed: no CI, the ± 0.0 stands for none"
    for metric in ("per_pair", "per_pair_half"):
        summary = summaries[metric]
        lines.append(f"\n**Success, {METRIC_TITLES[metric]}** (%, mean over {seeds} seed(s) {spread}; "
                     "`@ n` = a stream control evaluated on to n steps)\n")
        lines.append("| variant @ steps | " + " | ".join(columns) + " |")
        lines.append("|---" * (len(columns) + 1) + "|")
        for length in sorted(summary):
            for variant in variants:
                cells = summary[length].get(variant)
                if cells and (length in lengths or is_stream_control(variant)):
                    lines.append(f"| {variant} @ {length} | " + " | ".join(_pct(cells[c]) for c in columns) + " |")
    for (title, metric), table in gaps.items():
        for length in lengths:
            rows = table.get(length, {})
            if not rows:
                continue
            lines.append(f"\n**Balance gap closed, {title}, {length} steps, {METRIC_TITLES[metric]}** (gain over "
                         "plain in points ± 95 % t interval of the paired per-seed differences; closed = gain / gap "
                         "[95 % interval over seeds, Fieller's]; plain at = the controls' compute)\n")
            lines.append("| variant | plain at | head gain | tail gap | tail gain | tail closed | held-out gap | "
                         "held-out gain | held-out closed |")
            lines.append("|---" * 9 + "|")
            for variant in variants:
                row = rows.get(variant)
                if not row:
                    continue
                b = row["buckets"]
                lines.append(f"| {variant} | {row['reference']:.0f} | {_pct(b['head']['gain'])} | "
                             f"{_pct(b['tail']['gap'])} | {_pct(b['tail']['gain'])} | {_frac(b['tail'])} | "
                             f"{_pct(b['held_out']['gap'])} | {_pct(b['held_out']['gain'])} | "
                             f"{_frac(b['held_out'])} |")
    if exposure:
        length = detail
        lines.append(f"\n**Success against exposure at {length} steps** (probed half alone, %; seen pairs binned "
                     "by the objects of that pair the run trained on; in brackets pairs × seeds)\n")
        bins = sorted({k for v in exposure.values() for k in v["bins"]}, key=lambda k: float(k.split("-")[0]))
        lines.append("| variant | " + " | ".join(bins) + " |")
        lines.append("|---" * (len(bins) + 1) + "|")
        for variant in variants:
            if variant in exposure:
                cells = exposure[variant]["bins"]
                lines.append(f"| {variant} | " + " | ".join(
                    f"{100 * cells[k][0]:.0f} ({cells[k][1]})" if k in cells else "—" for k in bins) + " |")
        for kind in ("colour", "shape"):
            lines.append(f"\n**Per {kind} frequency rank at {length} steps** (objects holding the {kind} trained on "
                         f"/ success of the seen pairs with it, probed half, %; rank 0 the most frequent)\n")
            ranks = sorted({k for v in exposure.values() for k in v[f"{kind}_rank"]}, key=int)
            lines.append("| variant | " + " | ".join(f"rank {r}" for r in ranks) + " |")
            lines.append("|---" * (len(ranks) + 1) + "|")
            for variant in variants:
                if variant in exposure:
                    cells = exposure[variant][f"{kind}_rank"]
                    lines.append(f"| {variant} | " + " | ".join(
                        f"{cells[r]['objects']:.0f} / {100 * cells[r]['success']:.0f}" for r in ranks) + " |")
            names = COLOURS if kind == "colour" else SHAPES
            lines.append(f"\n**Per {kind} name at {length} steps** (objects / success as above; the ranks are "
                         "drawn per seed, so a name's difficulty shows apart from its frequency)\n")
            lines.append("| variant | " + " | ".join(names) + " |")
            lines.append("|---" * (len(names) + 1) + "|")
            for variant in variants:
                if variant in exposure:
                    cells = exposure[variant][kind]
                    lines.append(f"| {variant} | " + " | ".join(
                        f"{cells[n]['objects']:.0f} / {100 * cells[n]['success']:.0f}" for n in names) + " |")
    if facts:
        lines.append(f"\n**Cost, repetition and the judge at {detail} steps** (means over seeds; compute in "
                     "plain steps, counted; seconds measured beside other work; repeat = the most times one tile was "
                     "shown; oracle Δ = the largest difference of a bucket mean between the two oracles, points)\n")
        lines.append("| variant | compute/step | s/step | distinct tiles | distinct scenes | max repeat | "
                     "max repeat, tail tile | oracle Δ |")
        lines.append("|---" * 8 + "|")
        for variant in variants:
            f = facts.get(variant)
            if f:
                lines.append(f"| {variant} | {f['compute_per_step']:.3f} | {f['seconds_per_step']:.3f} | "
                             f"{f.get('distinct_tiles', 0):.0f} of {f.get('pool_tiles', 0):.0f} | "
                             f"{f.get('distinct_scenes', 0):.0f} | {f.get('max_tile_repeat', 0):.0f} | "
                             f"{f.get('max_tail_tile_repeat', 0):.0f} | {100 * f.get('oracle_disagreement', 0):.1f} |")
        weighted = [v for v in variants if "stream_max_factor" in facts.get(v, {})]
        if weighted:
            lines.append(f"\n**Scene factors of the weighted streams at {detail} steps** (means over seeds; "
                         "largest factor: relative to a scene of only the most frequent entry; largest rate = how "
                         "many times the uniform rate the most boosted scene is drawn; online: each rarity group's "
                         "multiplier of its prior and its distance ratio to the average row, rarest group first)\n")
            lines.append("| variant | largest factor | largest rate | group multipliers | group distance ratios | "
                         "refreshes |")
            lines.append("|---" * 6 + "|")
            for variant in weighted:
                f = facts[variant]
                online = "stream_refreshes" in f
                groups = (lambda key: " / ".join(f"{x:.2f}" for x in f[key]))
                lines.append(f"| {variant} | {f['stream_max_factor']:.2f} | {f['stream_max_rate_over_uniform']:.2f} | "
                             + (f"{groups('stream_multipliers')} | {groups('stream_ratios')} | "
                                f"{f['stream_refreshes']:.0f} |" if online else "— | — | — |"))
    if failures:
        lines.append(f"\n**Failure kinds at {detail} steps** (% of the bucket's prompts, all seeds: missing "
                     "object / colour on the wrong shape / other)\n")
        lines.append("| variant | " + " | ".join(BUCKETS) + " |")
        lines.append("|---" * (len(BUCKETS) + 1) + "|")
        for variant in variants:
            if variant in failures:
                cells = [" / ".join(f"{100 * failures[variant][b][k]:.1f}" for k in FAILURES) for b in BUCKETS]
                lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def judge_report(judges: dict) -> str:
    lines = ["\n## The judges\n", "| oracle | fresh tiles read right | degraded | worst colour (clean / degraded) | "
             "worst shape (clean / degraded) |", "|---|---|---|---|---|"]
    for name, report in judges.items():
        per = report["per_class"]
        worst = {}
        for kind in ("colour", "shape"):
            k = min(per["degraded"][kind], key=per["degraded"][kind].get)
            worst[kind] = f"{k} {100 * per['clean'][kind][k]:.2f} / {100 * per['degraded'][kind][k]:.2f} %"
        lines.append(f"| {name} | {100 * report['pair_accuracy']:.2f} % | {100 * report['pair_accuracy_degraded']:.2f} % "
                     f"| {worst['colour']} | {worst['shape']} |")
    return "\n".join(lines) + "\n"


def bar_plot(summaries: dict, variants: list[str], length: int, path: Path) -> None:
    """Grouped bars per bucket, one panel per world at one length (whole prompts)."""
    from imba.plots import plot_grouped_bars

    panels = {f"{world}, {length} steps": {v: summary[length][v] for v in variants if v in summary.get(length, {})}
              for world, summary in summaries.items()}
    plot_grouped_bars(panels, BUCKETS, variants, path, ylabel="composition success (%)", scale=100, ylim=(0, 100),
                      title="Two-object composition success per bucket of the probed pair (whiskers: 95 % CI)")


def exposure_plot(runs: list[dict], length: int, variants: list[str], path: Path) -> None:
    """Probed-half success of every seen pair against the objects of it trained on (log scale), one point per pair
    and run, one panel per world."""
    from imba.plots import plot_series

    panels = {}
    for world in sorted({r["world"] for r in runs}):
        series: dict = {v: [] for v in variants}  # in the variants' order: the same colours as composition.png
        for run in runs:
            r = run["results"].get(length)
            if run["world"] != world or not r or "exposure" not in r or run["variant"] not in variants:
                continue
            series.setdefault(run["variant"], []).extend(
                (math.log10(max(1, n)), 100 * r["per_pair_half"][name]) for name, n in r["exposure"].items()
                if run["buckets"][name] != "held_out")
        panels[world] = {"xlabel": "log10 objects of the pair trained on",
                         "series": series}
    plot_series(panels, path, ylabel="probed half read right (%)", scatter=True,
                title=f"Success of each seen pair against its exposure ({length} steps, one point per pair and run)")


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

LEVER_COLUMNS = ("head", "tail", "held_out", "attribute_nmi", "colour_probe_held_out", "shape_probe_held_out",
                 "shape_probe_gap", "cka_tail", "cka_held_out")


def levers_against_imba(runs: list[dict], lengths: list[int]) -> dict:
    """Each data lever against each IMBA variant at equal compute: the lever trained to length × the IMBA step's
    cost against the IMBA variant at the length, per bucket the mean ± 95 % CI of the per-seed differences.
    {length: {"<lever> vs <imba>": {"lever_steps", "seeds", "buckets": {bucket: (mean, ci)}}}}."""
    seeds_of = per_seed(runs)
    out: dict = {}
    for lever in (v for v in seeds_of if is_lever(v)):
        for imba in (v for v in seeds_of if not isinstance(VARIANTS[v].loss, PlainLoss) and relative_cost(v) > 1
                     and objective_of(v) == objective_of(lever)):
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


def levers_summary(runs: list[dict]) -> dict:
    """{length: {variant: {number: (mean, ci)}}} of `run_numbers` over seeds, and the relations across runs
    ({length: relations(...)}) between held-out success and the data and representation numbers."""
    from composition_diagnostics import relations, run_numbers

    table: dict = {}
    points: dict = {}
    for run in runs:
        for length in run["results"]:
            numbers = run_numbers(run, int(length))
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

def judge_reports(paths: dict) -> dict:
    """Each oracle's recorded accuracy report with its accuracy per colour, shape and pair on fresh tiles."""
    out = {}
    for name, path in paths.items():
        oracle = Oracle()
        oracle.load_state_dict(torch.load(path, weights_only=True))
        out[name] = {**json.loads(Path(path).with_suffix(".json").read_text()), "per_class": oracle_per_class(oracle)}
    return out



RESULTS = "results.json.gz"  # a study's record: its settings, judges, every run and the tables computed from them


def load_results(folder: Path) -> dict | None:
    """The study recorded in `folder` (results.json.gz, or the uncompressed results.json of an older output folder),
    each run's evaluations keyed by their length as an int; None where there is none."""
    folder = Path(folder)
    if (folder / RESULTS).is_file():
        payload = json.loads(gzip.decompress((folder / RESULTS).read_bytes()))
    elif (folder / "results.json").is_file():
        payload = json.loads((folder / "results.json").read_text())
    else:
        return None
    for run in payload["runs"]:
        run["results"] = {int(k): v for k, v in run["results"].items()}
    return payload


def save_results(folder: Path, payload: dict) -> None:
    """Write the study's record, compressed; the same payload gives the same bytes (no time in the gzip header)."""
    tmp = Path(folder) / (RESULTS + ".tmp")
    tmp.write_bytes(gzip.compress(json.dumps(payload, separators=(",", ":")).encode(), compresslevel=9, mtime=0))
    tmp.replace(Path(folder) / RESULTS)


def study_report(out: Path, payload: dict, lengths: list[int], detail: int) -> str:
    """results.md, the figures and the record with its tables (`worlds_results`) of a study, into `out`, from its
    recorded runs and judges (the benchmark's end, and `composition.py --report`). `lengths`: the equal-step
    lengths asked for; `detail`: where the detail tables are read."""
    from imba.plots import plot_monitor

    runs, variants, worlds = payload["runs"], payload["variants"], payload["worlds"]
    report = f"Command: `{payload['command']}`\n" + judge_report(payload["judges"])
    per_world, summaries_prompt = {}, {}
    # the gap is read at every length a variant was evaluated at (with --reach-controls also at the controls' last
    # point, and where a cheaper variant's compute reaches it); the detail tables at the last point every variant has
    gap_lengths = sorted({*lengths, *(n for r in runs if not is_stream_control(r["variant"]) for n in r["results"])})
    for world in worlds:
        mine = [r for r in runs if r["world"] == world]
        summaries = {m: summarise(mine, m) for m in METRICS}
        gaps = {(t, m): gap_closed(mine, gap_lengths, compute=c, metric=m)
                for t, c in (("equal steps", False), ("equal compute", True)) for m in ("per_pair", "per_pair_half")}
        exposure = exposure_tables(mine, detail)
        failures = failure_table(mine, detail)
        facts = run_facts(mine, detail)
        report += world_report(world, summaries, gaps, failures, exposure, facts, variants, gap_lengths,
                               len(payload["seeds"]), detail)
        levers = levers_summary(mine)
        levers["against_imba"] = levers_against_imba(mine, lengths)
        if levers["summary"] and any(is_lever(v) for v in variants):
            report += levers_report(levers, variants)
            levers_plots(levers, mine, variants, out)
        curves = monitor_curves(mine)
        if curves:
            plot_monitor(curves, out / f"monitor_{world}.png", ylabel="mean IMBA distance d over the object's tokens",
                         title=f"{world}: IMBA distance per bucket (seed mean)")
        summaries_prompt[world] = summaries["per_pair"]
        per_world[world] = {
            "summary": {m: {str(k): v for k, v in s.items()} for m, s in summaries.items()},
            "gap_closed": {f"{t}, {m}": {str(k): v for k, v in table.items()} for (t, m), table in gaps.items()},
            "exposure": exposure, "failures": failures, "facts": facts, "distance_curves": curves,
            "levers": {"summary": {str(k): v for k, v in levers["summary"].items()},
                       "relations": {str(k): v for k, v in levers["relations"].items()},
                       "against_imba": {str(k): v for k, v in levers["against_imba"].items()}}}
    bar_plot(summaries_prompt, variants, detail, out / "composition.png")
    exposure_plot(runs, detail, variants, out / "exposure.png")
    payload["worlds_results"] = per_world
    save_results(out, payload)
    (out / "results.md").write_text(report)
    return report
