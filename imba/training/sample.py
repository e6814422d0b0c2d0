"""Sample a prompt file with an exported pipeline or a training checkpoint: images, a manifest and a grid.

    python -m imba.training.sample outputs/tiny/export --prompts prompts.txt --out samples/tiny
    python -m imba.training.sample outputs/tiny/checkpoints/step_0001200 --prompts benchmark.json \\
        --out samples/step1200 --guidance-scale 4.5 --steps 20 --images-per-prompt 4 --batch-size 8

MODEL is a diffusers `PixArtAlphaPipeline` folder (what training exports), a training checkpoint folder (exported
first, once, into `<run>/export_<step>` next to `<run>/checkpoints`), or a hub id.

Prompt files: `.txt` (one prompt per line; blank lines and lines starting with `#` are skipped) or `.json`/`.jsonl`
(a list of strings, or of objects with a "prompt" key and any other fields, e.g. the inert-concept benchmark of
`python -m data.prep.concepts build-benchmark`; the other fields are copied into the manifest).

Writes into --out:
    images/00000.png ...   one PNG per image, numbered by global image index = prompt_index × n + sample_index
    manifest.jsonl         one row per image: image, prompt, prompt_index, sample_index, seed, guidance_scale,
                           steps, resolution, max_text_tokens, plus the prompt entry's other fields
    grid.png               the first --grid-max images, one row per prompt when --images-per-prompt > 1

Image i gets its own generator seeded with `seed + i` (its starting noise is drawn in float32 on the CPU, the same
for any device and dtype), so an image does not depend on the batch size or on which images were already done: a
rerun with the same settings skips the images listed in the manifest (resume). Numerically, batched kernels can
differ in the last bits between batch sizes: in float32 on the CPU by at most one grey level on a few pixels (more
is possible in half precision on a GPU); with `--dtype float64` the images are bit-identical for any batch size.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import yaml
from PIL import Image
from tqdm.auto import tqdm

from imba.eval.prompts import PromptFileError, read_prompt_items
from imba.training.checkpoints import is_checkpoint
from imba.training.config import ConfigError
from imba.training.export import export_checkpoint_once
from models.encoders import DTYPES
from models.pipeline import image_grid, is_pipeline_folder, sample_images

# PixArt-α's default; a model exported by train.py uses its run's model.max_text_tokens (read from config.yaml)
DEFAULT_MAX_TEXT_TOKENS = 120
# fields the sampler writes itself; a prompt entry's field of the same name is not copied over them
MANIFEST_FIELDS = ("image", "prompt", "prompt_index", "sample_index", "seed", "guidance_scale", "steps",
                   "resolution", "max_text_tokens")
# settings that must match for a rerun to reuse the images already in a manifest
RESUME_KEYS = ("prompt", "seed", "guidance_scale", "steps", "resolution", "max_text_tokens")
SAMPLE_DTYPES = {**DTYPES, "float64": torch.float64}  # float64: bit-identical images for any batch size


class SampleError(Exception):
    """A problem the user can fix (paths, files, settings): reported as one line."""


# ---- inputs --------------------------------------------------------------------------------------------------

def export_once(checkpoint: Path) -> Path:
    try:
        return export_checkpoint_once(checkpoint)
    except (ConfigError, FileNotFoundError, OSError) as err:
        raise SampleError(f"exporting {checkpoint} failed: {err}") from err


def run_max_text_tokens(model_dir: Path) -> int | None:
    """model.max_text_tokens of the training run an export or checkpoint came from, when its config is there."""
    for config in (model_dir / "config.yaml", model_dir.parent / "config.yaml"):
        if config.is_file():
            try:
                value = (yaml.safe_load(config.read_text()) or {}).get("model", {}).get("max_text_tokens")
            except (yaml.YAMLError, AttributeError):
                return None
            return int(value) if isinstance(value, int) and value > 0 else None
    return None


def resolve_model(spec: str) -> tuple[str, int | None]:
    """(what `from_pretrained` opens, the run's max_text_tokens if known) for an export, checkpoint or hub id."""
    path = Path(spec)
    if path.is_dir():
        if is_pipeline_folder(path):
            return str(path), run_max_text_tokens(path)
        if is_checkpoint(path):
            return str(export_once(path)), run_max_text_tokens(path)
        hint = f" (a run folder? its export is {path / 'export'})" if is_pipeline_folder(path / "export") else ""
        raise SampleError(f"{path} is neither an export folder (model_index.json) nor a training checkpoint "
                          f"(config.yaml + EMA state){hint}")
    if path.exists() or spec.startswith((".", "/", "~")) or spec.count("/") != 1:
        raise SampleError(f"model {spec!r} not found: pass an export folder, a training checkpoint folder or a "
                          "hub id (owner/name)")
    return spec, None  # a hub id; from_pretrained reports what it cannot find


def open_pipeline(model: str, dtype: torch.dtype, device: str, pipeline_class=None):
    """The pipeline `model` (what `resolve_model` returned) on `device`, without progress bars; a load failure is
    one line. `pipeline_class` defaults to PixArtAlphaPipeline."""
    from diffusers import PixArtAlphaPipeline

    cls = pipeline_class or PixArtAlphaPipeline
    try:
        pipe = cls.from_pretrained(model, dtype=dtype)
    except (OSError, ValueError) as err:
        raise SampleError(f"cannot load a {cls.__name__} from {model!r}: {str(err).splitlines()[0]}") from err
    pipe.to(device)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def load_prompt_file(path: Path) -> list[dict]:
    """[{"prompt": ..., **other fields}] from a .txt, .json or .jsonl prompt file."""
    if not path.is_file():
        raise SampleError(f"prompt file {path} not found")
    if path.suffix not in (".txt", ".json", ".jsonl"):
        raise SampleError(f"unknown prompt file type {path.suffix!r} ({path}): use .txt, .json or .jsonl")
    try:  # the prompt-file format is the evaluation runners' (imba.eval), so samples and scores read it alike
        items = read_prompt_items(path)
    except PromptFileError as err:
        raise SampleError(str(err)) from err
    entries = []
    for i, item in enumerate(items):
        entry = {"prompt": item} if isinstance(item, str) else item
        if not isinstance(entry, dict) or not isinstance(entry.get("prompt"), str) or not entry["prompt"].strip():
            raise SampleError(f"{path}: entry {i} has no prompt (expected a string or an object with a 'prompt')")
        entries.append(entry)
    if not entries:
        raise SampleError(f"{path} holds no prompts")
    return entries


# ---- the plan: which images, with which seeds ----------------------------------------------------------------

def plan_images(entries: list[dict], images_per_prompt: int, seed: int, settings: dict) -> list[dict]:
    """One manifest row per image, in global index order (the row is written once its image is saved)."""
    rows = []
    for p, entry in enumerate(entries):
        extra = {k: v for k, v in entry.items() if k not in MANIFEST_FIELDS}
        for j in range(images_per_prompt):
            index = p * images_per_prompt + j
            rows.append({"image": f"images/{index:05d}.png", "prompt": entry["prompt"], "prompt_index": p,
                         "sample_index": j, "seed": seed + index, **settings, **extra})
    return rows


def read_manifest(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut by an interrupted run: that image is redone
                continue
    return rows


def already_done(out: Path, planned: list[dict]) -> set[str]:
    """Images of the plan that an earlier run with the same settings listed in the manifest (and wrote)."""
    done = {}
    for row in read_manifest(out / "manifest.jsonl"):
        done[row.get("image")] = row
    wanted = {row["image"]: row for row in planned}
    reusable = set()
    for image, old in done.items():
        new = wanted.get(image)
        if new is None:
            continue
        changed = [k for k in RESUME_KEYS if old.get(k) != new[k]]
        if changed:
            raise SampleError(f"{out} already holds samples made with other settings ({', '.join(changed)} differ "
                              f"for {image}): use another --out or delete that folder")
        if (out / image).is_file():
            reusable.add(image)
    return reusable


# ---- command line --------------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m imba.training.sample", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="export folder, training checkpoint folder or hub id")
    parser.add_argument("--prompts", required=True, type=Path, help=".txt, .json or .jsonl prompt file")
    parser.add_argument("--out", required=True, type=Path, help="output folder")
    parser.add_argument("--guidance-scale", type=float, default=4.5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0, help="image i is seeded with seed + i")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--resolution", type=int, default=None,
                        help="square size in pixels (default: the transformer's trained size)")
    parser.add_argument("--images-per-prompt", type=int, default=1)
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--dtype", choices=sorted(SAMPLE_DTYPES), default=None,
                        help="default: bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--max-text-tokens", type=int, default=None,
                        help=f"T5 sequence length (default: the run's model.max_text_tokens when its config.yaml "
                             f"is next to the model, else {DEFAULT_MAX_TEXT_TOKENS})")
    parser.add_argument("--grid-max", type=int, default=64, help="at most this many images in grid.png")
    args = parser.parse_args(argv)
    for name in ("steps", "batch_size", "images_per_prompt", "grid_max"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    entries = load_prompt_file(args.prompts)  # before the model: a typo in the path fails in a second
    model, run_tokens = resolve_model(args.model)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = SAMPLE_DTYPES[args.dtype or ("bfloat16" if device.startswith("cuda") else "float32")]

    pipe = open_pipeline(model, dtype, device)
    resolution = args.resolution or pipe.transformer.config.sample_size * pipe.vae_scale_factor
    if resolution % (pipe.vae_scale_factor * pipe.transformer.config.patch_size):
        raise SampleError(f"--resolution {resolution} must be a multiple of "
                          f"{pipe.vae_scale_factor * pipe.transformer.config.patch_size}")
    max_text_tokens = args.max_text_tokens or run_tokens or DEFAULT_MAX_TEXT_TOKENS

    settings = {"guidance_scale": args.guidance_scale, "steps": args.steps, "resolution": resolution,
                "max_text_tokens": max_text_tokens}
    planned = plan_images(entries, args.images_per_prompt, args.seed, settings)
    out = args.out
    (out / "images").mkdir(parents=True, exist_ok=True)
    done = already_done(out, planned)
    todo = [row for row in planned if row["image"] not in done]
    if done:
        print(f"resuming: {len(done)} of {len(planned)} images already in {out / 'manifest.jsonl'}")
    # rewrite the manifest with the reusable rows only (drops rows of images that went missing), then append
    kept = [row for row in read_manifest(out / "manifest.jsonl") if row.get("image") in done]
    with open(out / "manifest.jsonl", "w", encoding="utf-8") as manifest:
        for row in kept:
            manifest.write(json.dumps(row) + "\n")
        with tqdm(total=len(todo), desc="sampling", unit="img") as bar:
            for start in range(0, len(todo), args.batch_size):
                batch = todo[start:start + args.batch_size]
                images = sample_images(pipe, [r["prompt"] for r in batch], resolution, args.guidance_scale,
                                       args.steps, [r["seed"] for r in batch], max_text_tokens)
                for row, image in zip(batch, images):
                    image.save(out / row["image"])
                    manifest.write(json.dumps(row) + "\n")
                manifest.flush()
                bar.update(len(batch))

    shown = planned[:args.grid_max]
    columns = args.images_per_prompt if args.images_per_prompt > 1 else None
    image_grid([Image.open(out / row["image"]).convert("RGB") for row in shown], columns).save(out / "grid.png")
    print(f"{len(planned)} images ({len(todo)} new) of {len(entries)} prompts in {out}: images/, manifest.jsonl, "
          "grid.png")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except SampleError as err:
        sys.exit(f"error: {err}")
