"""Precompute VAE latent moments and T5 states of image tar shards into new tar shards (read back for training by
`data.precomputed`): `precompute_shards`, the job that `python -m data.prep.precompute` runs over a set of shards
and that a run with `data.precompute=true` runs over its own.

Process r of N (`rank` and `world_size`: an accelerate process's index and count) takes input shards r, r+N,
r+2N, ... in the order the spec expands to. Each input shard `.../NAME.tar` becomes `OUT_DIR/NAME.tar` with
the same keys, in the same order, minus the bad samples. Images are decoded, resized and centre-cropped by the
training reader's own decoding (`data.decode`), so a latent here is exactly the latent training would have
computed; bad samples (undecodable image, missing caption, unreadable tar data) are skipped and counted with the
reader's reasons, plus "non-finite features" for a sample whose latent or T5 state is not finite in storage dtype.
A shard is written under a temporary name and renamed when complete, then its record is written
(`data.precompute_output`): complete shards are skipped (a rerun after a crash or pre-emption redoes only the
missing ones), leftover `*.tmp-*` files of the shards still to do are removed. Rank 0 also writes `null_text.npy`,
the T5 state of the empty caption (the unconditional embedding IMBA and caption dropout use). The process that
finds every shard record present writes the manifest `OUT_DIR/precompute.json`; no process waits for another, so
an uneven split never runs into a collective timeout, and a rerun over a complete folder only rewrites the
manifest. Output made with other settings is refused, never mixed.

The encoders are loaded through models/, imported inside the functions that need them, so that only this job (not
the reader) depends on diffusers and transformers.
"""

from __future__ import annotations

import collections
import io
import json
import logging
import os
from typing import Any, Iterator, Sequence

import torch
from PIL import Image

from .decode import DecodeSamples
from .files import read_json_object
from .images import IMAGE_EXTENSIONS
from .precompute_output import (
    ShardOutput,
    check_existing,
    is_complete,
    plan_outputs,
    remove_leftovers,
    write_manifest,
    write_null_text,
    write_record,
)
from .precompute_settings import PrecomputeSettings, encoder_dtypes
from .precomputed import (
    LATENT_MEMBER,
    MANIFEST_NAME,
    NULL_TEXT_NAME,
    TEXT_MEMBER,
    TEXT_SCALE_MEMBER,
    npy_bytes,
)
from .skips import ReaderStats, counts_since, warn_rate_limited
from .streaming import ReadShards
from .synthetic import CAPTION_WORDS
from .text_states import encode_states, states_from_numpy
from .urls import expand_urls

__all__ = ["NONFINITE", "PrecomputeSettings", "feature_members", "precompute_shards", "write_manifest"]

log = logging.getLogger(__name__)

NONFINITE = "non-finite features"


# --------------------------------------------------------------------------------------------------------------
# Encoders (writing side only: imports models/ lazily)
# --------------------------------------------------------------------------------------------------------------


class _Encoders:
    """The frozen VAE and T5 of the training config, loaded through models/ exactly as training loads them."""

    def __init__(self, settings: PrecomputeSettings, device: str | torch.device = "cpu"):
        from models.text_encoder import TextConditioner, load_text_encoder
        from models.vae import load_vae, vae_scale_factor

        dtype = encoder_dtypes()[settings.encoder_dtype]
        tokenizer, t5 = load_text_encoder(settings.text_encoder, settings.text_encoder_subfolder,
                                          settings.tokenizer_subfolder, dtype=dtype, words=CAPTION_WORDS)
        vae = load_vae(settings.vae, settings.vae_subfolder, dtype=dtype)
        downsample = vae_scale_factor(vae)
        latent_size, rest = divmod(settings.resolution, downsample)
        if rest:
            raise ValueError(f"resolution {settings.resolution} must be a multiple of the VAE's downsampling factor "
                             f"{downsample}")
        self.device = torch.device(device)
        self.settings = settings
        self.vae = vae.to(self.device)
        self.text = TextConditioner(tokenizer, t5.to(self.device), settings.max_text_tokens)
        shift = getattr(vae.config, "shift_factor", None)
        self.info = {
            "latent_channels": int(vae.config.latent_channels),
            "latent_size": latent_size,
            "vae_downsample": downsample,
            "vae_scaling_factor": float(vae.config.scaling_factor),
            "vae_shift_factor": None if shift is None else float(shift),  # recorded; encode_images does not use it
            "text_hidden_size": int(self.text.hidden_size),
        }

    @torch.no_grad()
    def encode_text(self, captions: list[str]) -> list[torch.Tensor]:
        """T5 states of the valid tokens of each caption: a list of (n_i, D) float32 CPU tensors."""
        embeds, mask = self.text.encode(captions)
        lengths = mask.sum(dim=1)
        positions = torch.arange(mask.shape[1], device=mask.device)
        if not torch.equal(mask.bool(), positions[None, :] < lengths[:, None]):
            raise ValueError("the tokenizer does not pad on the right: precompute stores the first n tokens as valid")
        return [embeds[i, :n].float().cpu() for i, n in enumerate(lengths.tolist())]

    @torch.no_grad()
    def encode(self, pixels: torch.Tensor, captions: list[str]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(moments (B, 2, C, h, w) float32 on the CPU: posterior mean and log-variance, T5 states per caption)."""
        posterior = self.vae.encode(pixels.to(self.device, self.vae.dtype)).latent_dist
        moments = torch.stack([posterior.mean, posterior.logvar], dim=1).float().cpu()
        return moments, self.encode_text(captions)


# --------------------------------------------------------------------------------------------------------------
# Input: decoded batches of this process's shards (optionally in DataLoader workers)
# --------------------------------------------------------------------------------------------------------------


def _source_meta(raw: dict[str, Any]) -> dict[str, Any]:
    """The original json (if an object) and the original image size, from the raw members."""
    meta: dict[str, Any] = {}
    data = raw.get("json")
    if data is not None:
        try:
            parsed = json.loads(data)
            if isinstance(parsed, dict):
                meta = parsed
        except ValueError:
            pass
    size = None
    for ext in IMAGE_EXTENSIONS:
        if raw.get(ext) is not None:
            try:
                size = list(Image.open(io.BytesIO(raw[ext])).size)  # header only
            except Exception:  # decoded fine a moment ago; a size is informative only
                pass
            break
    return {"json": meta, "image_size": size}


class _ShardBatches(torch.utils.data.IterableDataset):
    """("batch", job, [decoded samples]) ... then ("end", job, counts) for each job (input shard) in turn.

    Worker w of W takes jobs w, w+W, ...; one worker reads a whole shard, so its samples stay in order.
    """

    def __init__(self, jobs: Sequence[str], settings: PrecomputeSettings, batch_size: int):
        self.jobs = list(jobs)
        self.settings = settings
        self.batch_size = batch_size

    def __iter__(self) -> Iterator[tuple[str, int, Any]]:
        info = torch.utils.data.get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        stats = ReaderStats(where=f"{len(self.jobs)} input shards")  # one per worker, like the training reader
        decode = DecodeSamples(self.settings.resolution, self.settings.caption_field, stats,
                               min_size=self.settings.min_size)
        read = ReadShards(stats)  # the training reader's tar reading: counts and names failing shards
        for job in range(worker, len(self.jobs), workers):
            url = self.jobs[job]
            good0, bad0, shards_bad0 = stats.good, dict(stats.bad), dict(stats.shards_bad)
            batch: list[dict[str, Any]] = []
            for raw in read([{"url": url}]):
                for sample in decode([raw]):  # counts and logs bad samples with the reader's reasons
                    sample.update(_source_meta(raw))
                    batch.append(sample)
                if len(batch) == self.batch_size:
                    yield "batch", job, batch
                    batch = []
            if batch:
                yield "batch", job, batch
            yield "end", job, {"decoded": stats.good - good0, "bad": counts_since(stats.bad, bad0),
                               "shards_bad": counts_since(stats.shards_bad, shards_bad0)}


def _identity(item: Any) -> Any:
    return item


# --------------------------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------------------------


def feature_members(key: str, moments: torch.Tensor, text: torch.Tensor, caption: str, meta: dict[str, Any],
                    text_dtype: str) -> dict[str, Any] | None:
    """The tar members of one precomputed sample, for `wds.TarWriter`: posterior moments (2, C, h, w) and T5
    states of the valid tokens (n, D), stored as the format says; None when either is not finite once stored."""
    latent = moments.to(torch.float16)
    values, scale = encode_states(text, text_dtype)
    if not (torch.isfinite(latent).all() and torch.isfinite(states_from_numpy(values, scale, text_dtype)).all()):
        return None
    members = {
        "__key__": key,
        LATENT_MEMBER: npy_bytes(latent.numpy()),
        TEXT_MEMBER: npy_bytes(values),
        "txt": caption.encode("utf-8"),
        "json": json.dumps(meta, sort_keys=True).encode("utf-8"),
    }
    if scale is not None:
        members[TEXT_SCALE_MEMBER] = npy_bytes(scale)
    return members


def _write_batch(out: ShardOutput, encoders: _Encoders, samples: list[dict[str, Any]], source: str) -> None:
    settings = encoders.settings
    pixels = torch.stack([s["pixels"] for s in samples])
    moments, texts = encoders.encode(pixels, [s["caption"] for s in samples])
    for sample, moment, text in zip(samples, moments, texts):
        meta = dict(sample["json"])
        meta["precompute"] = {
            "source": os.path.basename(source),
            "image_size": sample["image_size"],
            "resolution": settings.resolution,
            "text_tokens": int(text.shape[0]),
        }
        members = feature_members(sample["key"], moment, text, sample["caption"], meta, settings.text_dtype)
        if members is None:
            out.bad[NONFINITE] += 1
            warn_rate_limited(out.bad[NONFINITE], f"skipping {source}:{sample['key']}: {NONFINITE}")
            continue
        out.writer.write(members)
        out.samples += 1


def _write_null_text(out_dir: str, encoders: _Encoders) -> None:
    """The empty caption's T5 state, as TextConditioner computes its null embedding (rewritten by rank 0 whenever it
    has the encoders loaded, so it always follows the settings the shard records were checked against)."""
    write_null_text(out_dir, encoders.encode_text([""])[0], encoders.settings.text_dtype)


def precompute_shards(
    urls: str | Sequence[str],
    out_dir: str | os.PathLike,
    settings: PrecomputeSettings,
    *,
    batch_size: int = 32,
    device: str | torch.device = "cpu",
    rank: int = 0,
    world_size: int = 1,
    num_workers: int = 0,
    progress: bool = False,
) -> dict[str, Any]:
    """Precompute this process's share (input shards rank, rank + world_size, ...) into `out_dir`; `progress`: a
    progress bar of the images encoded (give it to one process of a run).

    Returns a report: {"rank", "world_size", "written": [names], "skipped": [names already complete],
    "samples": written samples, "bad": {reason: n}, "shards_bad": {reason: n}, "manifest": path or None}. The
    manifest is written by whichever process finds every shard complete (see the module doc). The encoders are
    loaded only when this process has a shard to write (or, on rank 0, the null text is missing).
    """
    if batch_size < 1 or num_workers < 0 or world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need batch_size >= 1, num_workers >= 0, 0 <= rank < world_size (got {batch_size}, "
                         f"{num_workers}, {rank}, {world_size})")
    out_dir = os.path.abspath(os.path.expanduser(os.fspath(out_dir)))
    urls = expand_urls(urls)
    plan = plan_outputs(urls, out_dir)
    check_existing(out_dir, plan, settings)
    os.makedirs(out_dir, exist_ok=True)
    manifest = read_json_object(os.path.join(out_dir, MANIFEST_NAME))
    if manifest is not None and [s.get("name") for s in manifest.get("shards", [])] != [n for _, n in plan]:
        try:  # a manifest of another shard list would describe a folder that is being changed
            os.remove(os.path.join(out_dir, MANIFEST_NAME))
        except FileNotFoundError:
            pass

    mine = plan[rank::world_size]
    todo = [(u, n) for u, n in mine if not is_complete(out_dir, n, settings)]
    report: dict[str, Any] = {
        "rank": rank, "world_size": world_size, "written": [], "skipped": [n for u, n in mine if (u, n) not in todo],
        "samples": 0, "bad": {}, "shards_bad": {}, "manifest": None,
    }
    for name in report["skipped"]:
        log.info("[rank %d] %s is complete, skipping it", rank, name)
    need_null = rank == 0 and not os.path.isfile(os.path.join(out_dir, NULL_TEXT_NAME))
    if todo or need_null:
        encoders = _Encoders(settings, device)
        if rank == 0:
            _write_null_text(out_dir, encoders)
    if todo:
        for _, name in todo:
            remove_leftovers(out_dir, name)
        _write_shards(todo, out_dir, settings, encoders, batch_size, num_workers, report, progress)
    report["manifest"] = write_manifest(out_dir, urls, settings)
    return report


def _write_shards(todo, out_dir, settings, encoders, batch_size, num_workers, report, progress) -> None:
    from tqdm.auto import tqdm

    bar = tqdm(desc=f"precompute -> {out_dir}", unit=" img", disable=not progress, dynamic_ncols=True,
               postfix=f"shard 1/{len(todo)}")
    loader = torch.utils.data.DataLoader(
        _ShardBatches([u for u, _ in todo], settings, batch_size),
        batch_size=None,
        collate_fn=_identity,
        num_workers=num_workers,
        generator=torch.Generator().manual_seed(0),  # leave the global RNG alone
    )
    outputs: dict[int, ShardOutput] = {}
    bad: collections.Counter[str] = collections.Counter()
    shards_bad: collections.Counter[str] = collections.Counter()
    try:
        for kind, job, payload in loader:
            url, name = todo[job]
            if job not in outputs:
                outputs[job] = ShardOutput(out_dir, name)
            out = outputs[job]
            if kind == "batch":
                _write_batch(out, encoders, payload, url)
                bar.update(len(payload))
                continue
            nbytes = out.commit()
            del outputs[job]
            shard_bad = collections.Counter(payload["bad"]) + out.bad
            write_record(out_dir, name, url, settings, encoders.info, out.samples, shard_bad, payload["shards_bad"],
                         nbytes)
            bad.update(shard_bad)
            report["written"].append(name)
            report["samples"] += out.samples
            shards_bad.update(payload["shards_bad"])
            skipped = ", ".join(f"{r}: {n}" for r, n in sorted(shard_bad.items())) or "none"
            damaged = f"; shard: {', '.join(payload['shards_bad'])}" if payload["shards_bad"] else ""
            log.info("[rank %d] %s: %d samples written, skipped %d (%s)%s", report["rank"], name, out.samples,
                     sum(shard_bad.values()), skipped, damaged)
            bar.set_postfix_str(f"shard {min(len(report['written']) + 1, len(todo))}/{len(todo)}")
    finally:
        bar.close()
        for out in outputs.values():  # an error mid-shard: nothing half-written stays behind
            out.abort()
    report["bad"] = dict(sorted(bad.items()))
    report["shards_bad"] = dict(sorted(shards_bad.items()))


if __name__ == "__main__":  # the module is the library; its command line is data/prep/precompute.py
    raise SystemExit("error: the precompute command is python -m data.prep.precompute (--help for its options)")
