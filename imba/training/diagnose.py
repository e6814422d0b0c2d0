"""Representation diagnostics of a trained model over a prompt file: per DiT block, how well its image tokens align
with the caption embeddings, and whether a linear probe reads the prompt's concepts, per concept bucket.

    python -m imba.training.diagnose outputs/tiny/export --prompts probes.jsonl --out diagnostics/tiny
    python -m imba.training.diagnose outputs/tiny/checkpoints/step_0000300 --prompts benchmark.json --out diag

MODEL is what `python -m imba.training.sample` takes (an export folder, a training checkpoint, a hub id); prompt
files are its formats too. Per entry:
    "bucket"              head / torso / tail / held_out / any name (else the rarest of "buckets", the
                          inert-concept benchmark's field; else "unknown")
    "seen"                false for a concept combination the training data never showed (default: the bucket
                          is not "held_out"); the probes are fitted on seen prompts and scored on both
    "labels"              {probe name: value} to probe for, e.g. {"colour": "red", "shape": "circle"}; else the
                          first (attribute, noun) of "pairs" (T2I-CompBench files) as "attribute" and "object";
                          else the first of "concepts" as "concept"

Each prompt gets `--draws` rows: the DiT's features for the caption over fixed noise latents at `--timestep` (the
same draws for every prompt, so rows differ only through the caption), and the caption's mean T5 state. Alignment
compares prompts (features averaged over their draws; mutual k-NN needs more than `--k` prompts), the probes rows.
Writes into --out: diagnostics.json (`imba.eval.representations.diagnose` plus the settings) and diagnostics.png.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from imba.eval.representations import diagnose
from imba.eval.summary import BUCKET_ORDER
from imba.training.sample import (DEFAULT_MAX_TEXT_TOKENS, SAMPLE_DTYPES, SampleError, load_prompt_file,
                                  open_pipeline, resolve_model)

__all__ = ["prompt_groups", "probe_labels", "main"]


def _rarest(buckets: list) -> str:
    known = [b for b in buckets if b in BUCKET_ORDER]
    return max(known, key=BUCKET_ORDER.index) if known else "unknown"


def prompt_groups(entries: list[dict]) -> tuple[list[str], list[bool]]:
    """(bucket, seen) per prompt entry, as the module docstring says."""
    groups, seen = [], []
    for entry in entries:
        bucket = entry.get("bucket")
        if not isinstance(bucket, str):
            buckets = entry.get("buckets")
            bucket = _rarest(buckets) if isinstance(buckets, list) else "unknown"
        flag = entry.get("seen")
        groups.append(bucket)
        seen.append(bool(flag) if isinstance(flag, bool) else bucket != "held_out")
    return groups, seen


def probe_labels(entries: list[dict]) -> dict[str, list[str]]:
    """{probe name: one value per entry} for the probes every entry names a value for."""
    per_entry = []
    for entry in entries:
        if isinstance(entry.get("labels"), dict):
            per_entry.append({str(k): str(v) for k, v in entry["labels"].items()})
        elif entry.get("pairs"):
            attribute, noun = entry["pairs"][0]
            per_entry.append({"attribute": str(attribute), "object": str(noun)})
        elif entry.get("concepts"):
            per_entry.append({"concept": str(entry["concepts"][0])})
        else:
            per_entry.append({})
    names = set(per_entry[0]).intersection(*per_entry[1:]) if per_entry else set()
    return {name: [labels[name] for labels in per_entry] for name in sorted(names)}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m imba.training.diagnose", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="export folder, training checkpoint folder or hub id")
    parser.add_argument("--prompts", required=True, type=Path, help=".txt, .json or .jsonl prompt file")
    parser.add_argument("--out", required=True, type=Path, help="output folder")
    parser.add_argument("--timestep", type=float, default=900.0,
                        help="DiT timestep of the features, in [0, 1000) (default 900: nearly pure noise)")
    parser.add_argument("--draws", type=int, default=4, help="noise latents per prompt")
    parser.add_argument("--k", type=int, default=10, help="neighbours for mutual k-NN")
    parser.add_argument("--seed", type=int, default=0, help="draw d's noise is seeded with seed + d")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--dtype", choices=sorted(SAMPLE_DTYPES), default="float32")
    parser.add_argument("--max-text-tokens", type=int, default=None,
                        help=f"T5 sequence length (default: the run's model.max_text_tokens, else "
                             f"{DEFAULT_MAX_TEXT_TOKENS})")
    args = parser.parse_args(argv)
    for name in ("draws", "k", "batch_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if not 0 <= args.timestep < 1000:
        parser.error("--timestep must be in [0, 1000)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    entries = load_prompt_file(args.prompts)
    groups, seen = prompt_groups(entries)
    labels = probe_labels(entries)
    model, run_tokens = resolve_model(args.model)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")

    from imba.plots import plot_block_diagnostics
    from models.dit_features import prompt_features
    from models.pipeline import PIPELINES, pipeline_kind_of

    pipe = open_pipeline(model, SAMPLE_DTYPES[args.dtype], device, PIPELINES[pipeline_kind_of(model) or "alpha"])
    tokens = args.max_text_tokens or run_tokens or DEFAULT_MAX_TEXT_TOKENS
    with torch.no_grad():
        embeds, mask, _, _ = pipe.encode_prompt([e["prompt"] for e in entries], do_classifier_free_guidance=False,
                                                device=device, max_sequence_length=tokens, clean_caption=False)
    config = pipe.transformer.config
    blocks, text = prompt_features(pipe.transformer, embeds, mask, (config.in_channels, config.sample_size,
                                   config.sample_size), args.timestep, args.draws, args.seed, args.batch_size,
                                   pipe.vae_scale_factor)

    rows = lambda values: [v for v in values for _ in range(args.draws)]  # noqa: E731 (one row per draw)
    probes, skipped = {}, []
    for name, values in labels.items():
        classes = sorted(set(values))
        seen_classes = {v for v, s in zip(values, seen) if s}
        if len(seen_classes) < 2:
            skipped.append(f"{name} (fewer than 2 values among the seen prompts)")
            continue
        probes[name] = torch.tensor(rows([classes.index(v) for v in values]))
    if not any(seen) or all(seen):
        skipped = [f"every probe: {'no' if all(seen) else 'every'} prompt is unseen (bucket held_out or "
                   f"\"seen\": false), and the probe needs both"]
        probes = {}
    k = min(args.k, len(entries) - 1)
    if k < 1:
        raise SampleError(f"{len(entries)} prompt: the diagnostics compare prompts, they need at least 2")
    result = diagnose(blocks, text, probes, rows(groups), torch.tensor(rows(seen)), k=k, seed=args.seed,
                      draws=args.draws)
    result["settings"] = {"model": args.model, "prompts": str(args.prompts), "timestep": args.timestep,
                          "draws": args.draws, "k": k, "seed": args.seed, "max_text_tokens": tokens,
                          "probes": {name: sorted(set(labels[name])) for name in probes}, "skipped": skipped}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "diagnostics.json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    plot_block_diagnostics(result, args.out / "diagnostics.png",
                           title=f"{args.model}: alignment and probes per block (t = {args.timestep:g})")
    last = result["blocks"][-1]
    print(f"{len(entries)} prompts × {args.draws} draws, {len(blocks)} blocks; last block: CKA "
          f"{last['cka']['all']:.3f}, mutual {k}-NN {last['mutual_knn']['all']:.3f}" + "".join(
              f", {name} probe ID {p['id_accuracy']:.2f} / OOD {p['ood_accuracy']:.2f}"
              for name, p in last["probe"].items()))
    for note in skipped:
        print(f"no probe for {note}")
    print(f"wrote {args.out / 'diagnostics.json'} and {args.out / 'diagnostics.png'}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except SampleError as err:
        sys.exit(f"error: {err}")
