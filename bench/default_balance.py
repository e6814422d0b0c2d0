"""The default run, natural vs balanced: `python train.py` at its default 2,500 steps on the natural stream, with
online balancing by the IMBA distance (data.balance=imba) and with offline concept balancing (data.balance=
temperature at α = 1, and at the shipped α = 0.5); does each draw the rare shapes (star, cross, ring) the natural
run draws as blobs?

    python bench/default_balance.py --out bench/default_balance          # 4 runs of train.py, then the reading
    python bench/default_balance.py --runs natural imba --out /tmp/db    # a subset
    python bench/default_balance.py --runs natural imba --seeds 0 1 2 --out bench/default_balance_seeds
                                                                         # three training seeds each
    python bench/default_balance.py --report --out bench/default_balance_seeds   # its results.md again

For every run, the exported pipeline samples "a red <shape>" and "a blue <shape>" for the six shapes of the default
run's grid prompts (circle, square, triangle: head; star, cross, ring: tail), 8 seeds each (guidance 4.5, 20
DPM-Solver steps, 128 px, as the default-run test samples), and each sample's largest object is read as the nearest
of the six shapes' training renders by fill ratio, solidity and hole share, or as a blob when it is farther from
every render than half the smallest distance between two shapes' renders (`shape_reading.py`; the default-run test
reads the head shapes by fill ratio alone, which cannot tell a ring from a triangle). Writes results.json (per run
and shape: read right, what it was read as, median features), results.md and grids.png (the runs' last sample grids
side by side, with the run's name above each; the first training seed's). The runs go to OUT/runs/NAME, or
OUT/runs/NAME-seedS for train.seed=S other than 0 (not committed); a finished run is reused.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for path in (str(REPO), str(REPO / "bench")):
    if path not in sys.path:
        sys.path.insert(0, path)

RUNS = {
    "natural": [],
    "imba": ["data.balance=imba"],
    "temperature": ["data.balance=temperature", "data.balance.alpha=1"],
    "temperature_a05": ["data.balance=temperature", "data.balance.alpha=0.5"],  # the shipped α
}
HEAD, TAIL = ("circle", "square", "triangle"), ("star", "cross", "ring")
COLOURS = ("red", "blue")
SEEDS = list(range(11, 19))


def run_folder(name: str, seed: int) -> str:
    return name if seed == 0 else f"{name}-seed{seed}"


def train(name: str, seed: int, out: Path) -> float:
    """Train run `name` with train.seed=`seed` into `out` unless its export exists; its wall seconds (0 when
    reused)."""
    if (out / "export" / "model_index.json").is_file():
        return 0.0
    start = time.perf_counter()
    cmd = [sys.executable, str(REPO / "train.py"), f"train.output_dir={out}", "train.trackers=none",
           f"train.seed={seed}", *RUNS[name]]
    log = out.parent / f"{out.name}.log"
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        done = subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT,
                              env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if done.returncode != 0:
        raise SystemExit(f"{name}: train.py failed, see {log}")
    return time.perf_counter() - start


def read_run(export: Path, references: dict) -> dict:
    """Per shape: the share of its samples read as that shape, what they were read as, their median features."""
    import numpy as np
    import torch
    from diffusers import PixArtAlphaPipeline

    from models.pipeline import sample_images
    from shape_reading import half_smallest_gap, read_shape, shape_features

    pipe = PixArtAlphaPipeline.from_pretrained(export)
    pipe.set_progress_bar_config(disable=True)
    shapes = (*HEAD, *TAIL)
    prompts = [f"a {c} {s}" for s in shapes for c in COLOURS for _ in SEEDS]
    with torch.random.fork_rng(devices=[]):
        images = sample_images(pipe, prompts, 128, 4.5, 20, SEEDS * (len(shapes) * len(COLOURS)), 64)
    per = len(COLOURS) * len(SEEDS)
    tolerance = half_smallest_gap(references)
    out = {}
    for k, shape in enumerate(shapes):
        feats = []
        for image in images[k * per:(k + 1) * per]:
            try:
                feats.append(shape_features(image))
            except AssertionError:  # nothing drawn on the background: read as no shape
                feats.append(None)
        reads = [read_shape(f, references, tolerance) if f is not None else "nothing" for f in feats]
        drawn = [f for f in feats if f is not None]
        out[shape] = {"right": sum(r == shape for r in reads) / per, "read_as": dict(Counter(reads)),
                      "median_features": np.median(drawn, axis=0).round(3).tolist() if drawn else None}
    return out


def side_by_side(grids: dict[str, Path], path: Path) -> None:
    from PIL import Image, ImageDraw

    images = {name: Image.open(p).convert("RGB") for name, p in grids.items()}
    w, h, top, gap = max(i.width for i in images.values()), max(i.height for i in images.values()), 24, 12
    canvas = Image.new("RGB", (len(images) * w + (len(images) - 1) * gap, h + top), "white")
    draw = ImageDraw.Draw(canvas)
    for k, (name, image) in enumerate(images.items()):
        x = k * (w + gap)
        canvas.paste(image, (x, top))
        draw.text((x + 4, 6), name, fill="black")
    canvas.save(path)


def write_table(folder: Path) -> str:
    """results.md of a study from its results.json: per run and training seed the share of each shape's samples read
    right, with several training seeds their mean and range; returns what it wrote."""
    record = json.loads((folder / "results.json").read_text())
    shapes = (*HEAD, *TAIL)
    per = len(record["colours"]) * len(record["seeds"])
    lines = [f"Command: `{record['command']}`", "", f"Samples read as the prompted shape, of {per} per shape and "
             f"training seed (red and blue, {len(record['seeds'])} sampling seeds); with several training seeds, "
             "their mean and range:", "",
             "| run | train.seed | " + " | ".join(shapes) + " |", "|---" * (len(shapes) + 2) + "|"]
    for name, by_seed in record["results"].items():
        for seed, r in by_seed.items():
            lines.append(f"| {name} | {seed} | "
                         + " | ".join(f"{100 * r['shapes'][s]['right']:.0f} %" for s in shapes) + " |")
        if len(by_seed) > 1:
            cells = []
            for s in shapes:
                rates = [100 * r["shapes"][s]["right"] for r in by_seed.values()]
                cells.append(f"**{sum(rates) / len(rates):.0f} %** ({min(rates):.0f}–{max(rates):.0f})")
            lines.append(f"| **{name}** | mean | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    (folder / "results.md").write_text(text)
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", nargs="+", choices=list(RUNS), default=list(RUNS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0], help="training seeds (train.seed), default 0")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "default_balance")
    parser.add_argument("--report", action="store_true",
                        help="only write --out's results.md again from its results.json (no training, no sampling)")
    args = parser.parse_args(argv)
    if args.report:
        print(write_table(args.out), end="")
        return 0
    from shape_reading import reference_features

    references = {s: reference_features(s) for s in (*HEAD, *TAIL)}
    results, grids = {}, {}
    for name in args.runs:
        for seed in args.seeds:
            folder = run_folder(name, seed)
            run = args.out / "runs" / folder
            seconds = train(name, seed, run)
            steps = sorted((run / "samples").glob("step_*.png"))[-1]
            if seed == args.seeds[0]:
                grids[name] = steps
            shapes = read_run(run / "export", references)
            results.setdefault(name, {})[seed] = {"train_seconds": seconds, "grid": steps.name, "shapes": shapes}
            print(f"{folder}: " + ", ".join(f"{s} {100 * r['right']:.0f} %" for s, r in shapes.items()), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    side_by_side(grids, args.out / "grids.png")
    command = "python bench/default_balance.py " + " ".join(argv if argv is not None else sys.argv[1:])
    (args.out / "results.json").write_text(json.dumps({"command": command, "runs": RUNS, "seeds": SEEDS,
                                                       "colours": COLOURS, "results": results}, indent=1))
    print(write_table(args.out), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
