"""`python -m data.prep.precompute`: the command line of `data.precompute.precompute_shards`, which encodes image
tar shards once into VAE latent moments and T5 states (the features a run reads with `data.shards` pointing at them).

    python -m data.prep.precompute 'shards/{000000..000999}.tar' features/ --resolution 256 \
        --vae stabilityai/sd-vae-ft-ema --text-encoder google/t5-v1_1-xxl --max-text-tokens 120
    accelerate launch --num_processes 8 -m data.prep.precompute 'shards/{000000..000999}.tar' features/ \
        --resolution 256 ...

The processes of an `accelerate launch` split the shards (accelerate's `PartialState`; a plain `python -m` run is
process 0 of 1), each writing its own and none waiting for another. The flags name the training config's settings
they must match; models.settings (dataclasses alone) gives their defaults and resolves max_text_tokens as train.py
does.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Sequence

import torch

from models.settings import TINY, ModelConfig

from ..precompute import precompute_shards
from ..precompute_settings import PrecomputeSettings, encoder_dtypes
from ..precomputed import load_manifest
from ..text_states import TEXT_DTYPES

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m data.prep.precompute", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Precompute VAE latent moments and T5 states of img2dataset tar shards into new shards "
                    "(run under `accelerate launch` to split the shards over processes).",
    )
    p.add_argument("shards", nargs="+", help="input shards: brace pattern, glob, folder or files")
    p.add_argument("out_dir", help="output folder (the same shard names; precompute.json when complete)")
    p.add_argument("--resolution", type=int, required=True, help="data.resolution of the training config")
    p.add_argument("--vae", default="shapes", help="model.vae: hub id, local folder, 'shapes' or 'tiny'")
    p.add_argument("--vae-subfolder", default="", help="model.vae_subfolder")
    p.add_argument("--text-encoder", default=TINY,
                   help="model.text_encoder: hub id, local folder, 'tiny-words' or 'tiny' (train.py's on your own "
                        "shards)")
    p.add_argument("--text-encoder-subfolder", default="", help="model.text_encoder_subfolder")
    p.add_argument("--tokenizer-subfolder", default="", help="model.tokenizer_subfolder")
    p.add_argument("--encoder-dtype", default="float32", choices=sorted(encoder_dtypes()),
                   help="model.encoder_dtype: dtype the VAE and T5 run in")
    p.add_argument("--max-text-tokens", type=int, default=0,
                   help="model.max_text_tokens; 0 = the text encoder's own, as train.py's (64 for tiny, 16 for "
                        "tiny-words, 120 for a T5)")
    p.add_argument("--text-dtype", "--dtype", default="float16", choices=TEXT_DTYPES,
                   help="storage of the T5 states: float16, bfloat16, or int8 with a per-token scale (half the "
                        "bytes; data.text_states); latent moments are always float16")
    p.add_argument("--caption-field", default="caption", help="data.caption_field")
    p.add_argument("--min-size", type=int, default=0, help="data.min_size: skip smaller images (pixels)")
    p.add_argument("--batch-size", type=int, default=32, help="images per encoder call")
    p.add_argument("--num-workers", type=int, default=2, help="decoding processes per process (0: in process)")
    p.add_argument("--device", default=None, help="default: the accelerate process's device")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    text = ModelConfig(text_encoder=args.text_encoder, max_text_tokens=args.max_text_tokens)
    text.resolve(synthetic_data=False)  # max_text_tokens=0 as train.py resolves it
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    settings = PrecomputeSettings(
        resolution=args.resolution, vae=args.vae, vae_subfolder=args.vae_subfolder, text_encoder=args.text_encoder,
        text_encoder_subfolder=args.text_encoder_subfolder, tokenizer_subfolder=args.tokenizer_subfolder,
        encoder_dtype=args.encoder_dtype, max_text_tokens=text.max_text_tokens, text_dtype=args.text_dtype,
        caption_field=args.caption_field, min_size=args.min_size,
    )
    from accelerate import PartialState

    # On machines without CUDA, PartialState joins a multi-process launch only when told it runs on the CPU
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    use_cpu = os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes")
    state = PartialState(cpu=use_cpu or (launched > 1 and not torch.cuda.is_available()))
    if state.num_processes != launched:  # each process would otherwise write every shard
        raise ValueError(f"launched as {launched} processes but accelerate reports {state.num_processes}: "
                         f"check the launcher (on CPU: ACCELERATE_USE_CPU=true accelerate launch --multi_gpu ...)")
    device = args.device or state.device
    try:
        report = precompute_shards(
            args.shards, args.out_dir, settings, batch_size=args.batch_size, device=device,
            rank=state.process_index, world_size=state.num_processes, num_workers=args.num_workers,
            progress=state.is_main_process,
        )
    finally:
        state.destroy_process_group()  # no collective is ever used: processes finish independently
    skipped = ", ".join(f"{r}: {n}" for r, n in report["bad"].items()) or "none"
    print(f"rank {report['rank']}/{report['world_size']}: wrote {len(report['written'])} shards "
          f"({report['samples']} samples; skipped {sum(report['bad'].values())} bad: {skipped}), "
          f"{len(report['skipped'])} already complete", flush=True)
    if report["manifest"] is not None:
        manifest = load_manifest(report["manifest"])
        print(f"complete: {manifest['samples']} samples in {len(manifest['shards'])} shards, skipped "
              f"{manifest['skipped'] or 'none'} -> {report['manifest']}", flush=True)
    else:
        print("other processes are still writing; the last one to finish writes precompute.json", flush=True)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (ValueError, FileNotFoundError, OSError) as err:
        sys.exit(f"error: {err}")
