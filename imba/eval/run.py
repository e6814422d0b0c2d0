"""Evaluate a folder of samples written by `python -m imba.training.sample`: VQA success rate or CLIP score.

    python -m imba.eval vqa  --images samples/step1200 --model llava-hf/llava-1.5-7b-hf --out eval/vqa.jsonl
    python -m imba.eval clip --images samples/step1200 --model openai/clip-vit-large-patch14 --out eval/clip.jsonl
    python -m imba.eval vqa  --images samples/compbench_color --prompts color_val.txt --model ... --out ...

Reads DIR/manifest.jsonl (one row per image). `--prompts FILE` joins that file's entries onto the rows (by
prompt_index, else by prompt text; see imba.eval.prompts for the formats), e.g. to add concepts, categories or
buckets the manifest lacks; rows without concepts get them parsed from the prompt (`--category color|shape|texture`
for attribute binding). Writes:
    OUT (JSONL)              one row per image: the manifest row, the joined fields, and
                             vqa: "questions" [{question, p_yes, yes}], "success"; clip: "clip_score"
    OUT with .md             the summary table (also printed): per group (all, category, bucket pair, rarest
                             bucket) the success rate with a 95 % Wilson interval, or the mean CLIP score with a
                             95 % bootstrap interval
    OUT with .summary.json   the same numbers as JSON
Images that are missing or unreadable are skipped, counted and reported.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable

from PIL import Image, UnidentifiedImageError
from tqdm.auto import tqdm

from imba.eval.prompts import PromptFileError, attach_entries, load_prompts, normalize_entry
from imba.eval.summary import markdown_table, summarize
from imba.eval.vqa import PYes, answer_entry

METRICS = {"vqa": "success", "clip": "clip_score"}


class EvalError(Exception):
    """A problem the user can fix: reported as one line."""


def read_manifest(images_dir: Path) -> list[dict[str, Any]]:
    path = Path(images_dir) / "manifest.jsonl"
    if not path.is_file():
        raise EvalError(f"no manifest.jsonl in {images_dir}: --images must be a folder written by "
                        "python -m imba.training.sample")
    rows = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise EvalError(f"{path}, line {n}: not JSON ({err})") from err
        if not isinstance(row, dict) or "image" not in row or "prompt" not in row:
            raise EvalError(f"{path}, line {n}: a manifest row needs 'image' and 'prompt'")
        rows.append(row)
    if not rows:
        raise EvalError(f"{path} lists no images")
    return rows


def prepare_rows(images_dir: Path, prompts: Path | None = None, category: str | None = None,
                 need_concepts: bool = False) -> list[dict[str, Any]]:
    """Manifest rows joined with the prompt file's entries; concepts parsed from the prompt where missing."""
    rows = read_manifest(images_dir)
    if prompts is not None:
        rows = attach_entries(rows, load_prompts(prompts, category))
    if category:
        rows = [{**row, "category": row.get("category") or category} for row in rows]
    if need_concepts:
        rows = [row if row.get("concepts") else normalize_entry(row, category, row["image"]) for row in rows]
    return rows


def _open(images_dir: Path, row: dict[str, Any], skipped: dict[str, int]) -> Image.Image | None:
    try:
        with Image.open(Path(images_dir) / row["image"]) as img:
            return img.convert("RGB")
    except FileNotFoundError:
        skipped["missing image"] = skipped.get("missing image", 0) + 1
    except (UnidentifiedImageError, OSError):
        skipped["unreadable image"] = skipped.get("unreadable image", 0) + 1
    return None


def run_vqa(rows: list[dict[str, Any]], images_dir: Path, p_yes: PYes, threshold: float = 0.5,
            ask_prompt: bool = False, skipped: dict[str, int] | None = None) -> list[dict[str, Any]]:
    skipped = {} if skipped is None else skipped
    results = []
    for row in tqdm(rows, desc="vqa", unit="img"):
        image = _open(images_dir, row, skipped)
        if image is not None:
            results.append({**row, **answer_entry(row, image, p_yes, threshold, ask_prompt)})
    return results


def run_clip(rows: list[dict[str, Any]], images_dir: Path, score: Callable[[list, list], list[float]],
             batch_size: int = 16, skipped: dict[str, int] | None = None) -> list[dict[str, Any]]:
    skipped = {} if skipped is None else skipped
    results = []
    with tqdm(total=len(rows), desc="clip", unit="img") as bar:
        for start in range(0, len(rows), batch_size):
            batch = []
            for row in rows[start:start + batch_size]:
                image = _open(images_dir, row, skipped)
                if image is not None:
                    batch.append((row, image))
            if batch:
                scores = score([im for _, im in batch], [row["prompt"] for row, _ in batch])
                results.extend({**row, "clip_score": float(s)} for (row, _), s in zip(batch, scores))
            bar.update(min(batch_size, len(rows) - start))
    return results


def write_outputs(results: list[dict[str, Any]], out: Path, metric: str, header: str = "") -> list[dict[str, Any]]:
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        for row in results:
            f.write(json.dumps(row) + "\n")
    summary = summarize(results, metric)
    table = markdown_table(summary, metric)
    out.with_suffix(".md").write_text((header + "\n\n" if header else "") + table, encoding="utf-8")
    out.with_suffix(".summary.json").write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    return summary


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m imba.eval", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=sorted(METRICS), help="vqa: success rate; clip: CLIP score")
    parser.add_argument("--images", required=True, type=Path, help="folder written by python -m imba.training.sample")
    parser.add_argument("--model", required=True, help="hub id or local folder of the VLM / CLIP model")
    parser.add_argument("--out", required=True, type=Path, help="per-image results (JSONL)")
    parser.add_argument("--prompts", type=Path, default=None, help="prompt file to join (concepts, buckets, ...)")
    parser.add_argument("--category", default=None, help="color, shape, texture or any label for all prompts")
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default=None, help="float32, bfloat16, float16 (default: bf16 on cuda for vqa)")
    parser.add_argument("--batch-size", type=int, default=16, help="images per CLIP forward")
    parser.add_argument("--threshold", type=float, default=0.5, help="vqa: answer is yes when p_yes >= this")
    parser.add_argument("--ask-prompt", action="store_true",
                        help="vqa: also ask 'Does the image show <prompt>?' for every entry (else only for "
                             "entries with a 'relation')")
    parser.add_argument("--prompt-template", default="{question} Answer with yes or no.",
                        help="vqa: text sent to the model for each question")
    parser.add_argument("--trust-remote-code", action="store_true", help="vqa: for models with custom code")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    metric = METRICS[args.mode]
    rows = prepare_rows(args.images, args.prompts, args.category, need_concepts=args.mode == "vqa")
    skipped: dict[str, int] = {}
    if args.mode == "vqa":
        from imba.eval.vqa import HFYesNoVQA

        vqa = HFYesNoVQA(args.model, args.device, args.dtype, args.prompt_template, args.trust_remote_code)
        results = run_vqa(rows, args.images, vqa, args.threshold, args.ask_prompt, skipped)
    else:
        from imba.eval.clip_score import CLIPScorer

        results = run_clip(rows, args.images, CLIPScorer(args.model, args.device, args.dtype), args.batch_size,
                           skipped)
    if not results:
        raise EvalError(f"no readable images in {args.images}")
    header = f"{args.mode} of {args.images} with {args.model}" + (
        f" (yes when p_yes >= {args.threshold})" if args.mode == "vqa" else "")
    summary = write_outputs(results, args.out, metric, f"# {header}")
    print(f"# {header}\n")
    print(markdown_table(summary, metric))
    if skipped:
        print(f"skipped {sum(skipped.values())} images (" + ", ".join(f"{k}: {v}" for k, v in skipped.items()) + ")")
    print(f"wrote {args.out}, {args.out.with_suffix('.md')}, {args.out.with_suffix('.summary.json')}")
    return 0


def cli() -> None:
    try:
        sys.exit(main())
    except (EvalError, PromptFileError, OSError) as err:
        sys.exit(f"error: {err}")
