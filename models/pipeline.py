"""Assemble the trained parts into a stock diffusers pipeline: sample grids and the export folder.

The export is a plain diffusers folder (transformer, vae, text_encoder, tokenizer, scheduler, model_index.json):
`PixArtAlphaPipeline.from_pretrained(folder)` (or `PixArtSigmaPipeline` for a PixArt-Σ fine-tune) opens it with no
code from this project. The grids are drawn by the same class, so what a run shows is what a user of the export gets.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

import diffusers
import torch
from diffusers import DiffusionPipeline
from PIL import Image, ImageDraw, ImageFont

from models.settings import PIPELINE_CLASSES

# The stock pipelines a model is exported for (config key model.pipeline). They differ in what they give the
# transformer: α passes the image size (micro-conditioning) exactly when the transformer's sample_size is 128, Σ
# never does; α encodes 120 text tokens by default, Σ 300.
PIPELINES = {kind: getattr(diffusers, name) for kind, name in PIPELINE_CLASSES.items()}
SIZE_CONDITIONED_SAMPLE_SIZE = 128  # the only sample_size for which PixArtAlphaPipeline passes resolution/aspect


def is_pipeline_folder(folder: Path) -> bool:
    """True for a folder `save_pretrained` wrote completely (`model_index.json` is written last)."""
    return (Path(folder) / "model_index.json").is_file()


def pipeline_kind_of(spec: str, subfolder: str = "") -> str | None:
    """The kind (a key of PIPELINES) whose class the model_index.json of the pipeline folder or Hub repository `spec`
    (a pretrained model) names; None for a transformer-only folder or repository (e.g. PixArt-Sigma-XL-2-512-MS).

    A local transformer folder inside a pipeline folder (`<export>/transformer`) is read from its parent."""
    roots = [spec]
    path = Path(spec)
    if path.is_dir() and not subfolder and (path / "config.json").is_file():
        roots.append(str(path.parent))
    for root in roots:
        try:
            name = DiffusionPipeline.load_config(root).get("_class_name")
        except OSError:  # no model_index.json there (or not reachable): no pipeline class to follow
            continue
        return next((kind for kind, cls in PIPELINES.items() if cls.__name__ == name), None)
    return None


def unsamplable_reason(config, kind: str) -> str | None:
    """Why the stock pipeline of `kind` cannot sample a transformer with `config`, or None when it can: a
    size-conditioned transformer given no image size fails inside diffusers' size embedding."""
    if not config.get("use_additional_conditions"):
        return None
    if kind == "sigma":
        return ("PixArtSigmaPipeline passes no image size, so it cannot sample a transformer with size "
                "micro-conditioning (use_additional_conditions): set model.pipeline=alpha")
    if config.get("sample_size") != SIZE_CONDITIONED_SAMPLE_SIZE:
        return (f"PixArtAlphaPipeline passes the image size only to transformers of sample_size "
                f"{SIZE_CONDITIONED_SAMPLE_SIZE}, so it cannot sample this one with size micro-conditioning "
                f"(use_additional_conditions) at sample_size {config.get('sample_size')}")
    return None


def build_pipeline(transformer, vae, text_encoder, tokenizer, scheduler, pipeline: str = "alpha") -> DiffusionPipeline:
    """The stock pipeline class `pipeline` ("alpha" or "sigma", see PIPELINES) around the parts; text_encoder and
    tokenizer may be None (both optional in diffusers): it then samples from `encode_prompts`' embeddings only."""
    pipe = PIPELINES[pipeline](tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer,
                               scheduler=scheduler)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@contextlib.contextmanager
def diffusers_errors_only():
    """diffusers' warnings silenced inside, where the caller says what matters in its own words."""
    verbosity = diffusers.utils.logging.get_verbosity()
    diffusers.utils.logging.set_verbosity_error()
    try:
        yield
    finally:
        diffusers.utils.logging.set_verbosity(verbosity)


def encode_prompts(text_encoder, tokenizer, prompts: list[str], max_text_tokens: int, pipeline: str = "alpha",
                   device="cpu") -> dict[str, torch.Tensor]:
    """The text embeddings of `prompts` and of the empty negative prompt (one per prompt) as the stock pipeline
    computes them for classifier-free guidance, on `device`: the keywords (`prompt_embeds`,
    `prompt_attention_mask`, `negative_prompt_embeds`, `negative_prompt_attention_mask`) that `sample_images` and
    the pipeline take instead of text, so the text encoder need not be there when the images are drawn. Prompts
    longer than `max_text_tokens` are cut there without diffusers' warning (it prints the cut text, a wall of
    padding tokens for a byte tokenizer): the caller counts them (`models.text_encoder.read_captions`)."""
    pipe = PIPELINES[pipeline](tokenizer=tokenizer, text_encoder=text_encoder, vae=None, transformer=None,
                               scheduler=None)
    with torch.no_grad(), diffusers_errors_only():
        embeds, mask, negative, negative_mask = pipe.encode_prompt(
            prompts, do_classifier_free_guidance=True, negative_prompt="", device=text_encoder.device,
            clean_caption=False, max_sequence_length=max_text_tokens)
    return {key: t.to(device) for key, t in dict(
        prompt_embeds=embeds, prompt_attention_mask=mask, negative_prompt_embeds=negative,
        negative_prompt_attention_mask=negative_mask).items()}


LABEL_LINES = 3  # a label longer than this many lines of its tile's width ends in "…"


def wrap_label(text: str, font, width: float) -> list[str]:
    """`text` in lines no wider than `width` pixels (a word wider than that stands alone), at most LABEL_LINES."""
    lines: list[str] = []
    for word in text.split():
        if lines and font.getlength(f"{lines[-1]} {word}") <= width:
            lines[-1] += f" {word}"
        else:
            lines.append(word)
    if len(lines) > LABEL_LINES:
        lines = lines[:LABEL_LINES]
        lines[-1] += " …"
    return lines


def image_grid(images: list[Image.Image], columns: int | None = None,
               labels: list[str] | None = None) -> Image.Image:
    """`images` in rows of `columns` (a square grid by default); `labels`: a text under each image (its prompt),
    wrapped to the image's width under it; every row leaves room for the longest label."""
    columns = columns or math.ceil(math.sqrt(len(images)))
    rows = math.ceil(len(images) / columns)
    w, h = images[0].size
    font = ImageFont.load_default()
    line_height = font.getbbox("Ag")[3] + 2
    wrapped = [wrap_label(label, font, w - 4) for label in labels] if labels else [[] for _ in images]
    label_height = max(map(len, wrapped)) * line_height + (4 if labels else 0)
    grid = Image.new("RGB", (columns * w, rows * (h + label_height)), "white")
    draw = ImageDraw.Draw(grid)
    for i, img in enumerate(images):
        x, y = (i % columns) * w, (i // columns) * (h + label_height)
        grid.paste(img, (x, y))
        for j, line in enumerate(wrapped[i]):
            draw.text((x + 2, y + h + 2 + j * line_height), line, fill="black", font=font)
    return grid


@torch.no_grad()
def sample_images(pipe: DiffusionPipeline, prompts: list[str], resolution: int, guidance_scale: float,
                  steps: int, seed: int | list[int], max_text_tokens: int,
                  embeddings: dict[str, torch.Tensor] | None = None) -> list[Image.Image]:
    """Fixed prompts, fixed seed, classifier-free guidance; one image per prompt.

    `embeddings`: the prompts already encoded (`encode_prompts`); the pipeline then needs no text encoder.

    `seed`: one int seeds a single generator for the whole batch (the training grids); a list gives every image its
    own CPU generator, and its initial noise is drawn in float32 on the CPU from it, so an image's starting noise
    depends on its seed only: not on the batch it is sampled in, the device or the pipeline's dtype.

    During training the frozen encoders may be in bf16/fp16 while the DiT is float32; the pipeline itself assumes
    one dtype, so mixed parts are run under autocast to the lowest one.
    """
    latents = None
    if isinstance(seed, int):
        generator = torch.Generator(device="cpu").manual_seed(seed)
    else:
        if len(seed) != len(prompts):
            raise ValueError(f"got {len(seed)} seeds for {len(prompts)} prompts")
        generator = [torch.Generator(device="cpu").manual_seed(s) for s in seed]
        channels, size = pipe.transformer.config.in_channels, resolution // pipe.vae_scale_factor
        latents = torch.cat([torch.randn(1, channels, size, size, generator=g) for g in generator])
        latents = latents.to(pipe.device, pipe.transformer.dtype)
    text = dict(prompt=None, negative_prompt=None, **embeddings) if embeddings else dict(prompt=prompts)
    dtypes = {part.dtype for part in (pipe.transformer, pipe.vae, pipe.text_encoder) if part is not None}
    mixed = contextlib.nullcontext()
    if len(dtypes) > 1:
        low = min(dtypes, key=lambda d: torch.finfo(d).bits)
        mixed = torch.autocast(pipe.device.type, dtype=low)
    with mixed:
        return pipe(
            **text, height=resolution, width=resolution, guidance_scale=guidance_scale, num_inference_steps=steps,
            generator=generator, latents=latents, max_sequence_length=max_text_tokens, clean_caption=False,
            # Resolution binning only knows PixArt's 256/512/1024 grids; we sample exactly the trained size.
            use_resolution_binning=False,
        ).images


def export_pipeline(pipe: DiffusionPipeline, folder: Path) -> Path:
    """Write the pipeline folder in float32, so `from_pretrained(folder)` gives one consistent dtype.

    Moves the parts to the CPU in float32 in place: call it once, at the end of a run. For inference in half
    precision, load with `from_pretrained(folder, torch_dtype=torch.bfloat16)`.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    # diffusers warns on every cast to a dtype about modules "that should be kept in float32": all of them are here
    with diffusers_errors_only():
        pipe.to("cpu", torch.float32)
    pipe.save_pretrained(folder, safe_serialization=True)
    return folder


def save_grid(transformer, parts: dict, path: Path, prompts: list[str], resolution: int, guidance_scale: float,
              steps: int, seed: int, max_text_tokens: int, embeddings: dict[str, torch.Tensor] | None = None) -> None:
    """A grid of `prompts` sampled from `transformer`, each labelled with its prompt. `parts`: vae, scheduler,
    optionally pipeline (the kind, see build_pipeline), text_encoder and tokenizer (None where `embeddings` holds
    the prompts encoded, see `encode_prompts`)."""
    images = sample_images(build_pipeline(transformer=transformer, **parts), prompts, resolution, guidance_scale,
                           steps, seed, max_text_tokens, embeddings)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    image_grid(images, labels=prompts).save(path)
