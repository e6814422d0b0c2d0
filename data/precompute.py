"""Precompute VAE latent moments and T5 states into new tar shards, and read them back for training.

    python -m data.precompute 'shards/{000000..000999}.tar' features/ --resolution 256 \
        --vae stabilityai/sd-vae-ft-ema --text-encoder google/t5-v1_1-xxl --max-text-tokens 120
    accelerate launch --num_processes 8 -m data.precompute 'shards/{000000..000999}.tar' features/ --resolution 256 ...

Writing. Process r of N (accelerate's `PartialState`; a plain `python -m` run is process 0 of 1) takes input shards
r, r+N, r+2N, ... in the order the spec expands to. Each input shard `.../NAME.tar` becomes `OUT_DIR/NAME.tar` with
the same keys, in the same order, minus the bad samples. Images are decoded, resized and centre-cropped by the
training reader's own decoding (`data.shards`), so a latent here is exactly the latent training would have
computed; bad samples (undecodable image, missing caption, unreadable tar data) are skipped and counted with the
reader's reasons, plus "non-finite features" for a sample whose latent or T5 state is not finite in storage dtype.
A shard is written as `NAME.tar.tmp-<pid>` and renamed when complete; then its record `NAME.tar.precompute.json`
(settings, sample and skip counts, byte size) is written the same way. A shard counts as complete only when both
exist, the record's settings equal this run's and the byte size matches: complete shards are skipped (a rerun
after a crash or pre-emption redoes only the missing ones), leftover `*.tmp-*` files of the shards still to do
are removed. Rank 0 also writes `null_text.npy`, the T5 state of the empty caption (the unconditional embedding
IMBA and caption dropout use). The process that finds every shard record present writes the manifest
`OUT_DIR/precompute.json` (settings, latent and text shapes, VAE scaling factor, sample and skip counts, shard
list); no process waits for another, so an uneven split never runs into a collective timeout, and a rerun over
a complete folder only rewrites the manifest. Output made with other settings is refused, never mixed.

Format (per sample; every array is a plain `.npy`, readable with `np.load(..., allow_pickle=False)`):
- `KEY.latent.npy`: float16 (2, C, h, w): [0] the VAE posterior mean, [1] its log-variance (clamped to
  [-30, 20] as diffusers does), unscaled. `sample_latents` draws mean + exp(logvar / 2)·ε and multiplies by the
  VAE scaling factor, exactly as `models.vae.encode_images` samples the posterior (no shift factor).
- `KEY.t5.npy`: the T5 last hidden state of the valid tokens only, (n, D) with n = the caption's token count
  (<= max_text_tokens, truncated like training). float16, or, with `--text-dtype bfloat16`, uint16 holding the
  bfloat16 bit patterns (numpy has no bfloat16; the uint16 dtype is the marker). The mask is implied: the
  tokenizer pads on the right, so the first n tokens are valid; the reader restores (max_text_tokens, D) with
  zeros at padded positions (the DiT masks them out of cross-attention, so their values never matter).
- `KEY.txt`: the caption that was encoded (the reader's caption: `key.txt`, else `json[caption_field]`,
  stripped). `KEY.json`: the original json (if it parsed as an object) plus `"precompute": {"source",
  "image_size": [w, h] of the original image, "resolution", "text_tokens"}`.

Reading. `make_precomputed_loader` is `data.indexed.make_indexed_loader` over the precomputed shards (the same
index, the same (seed, epoch)-pure order and `IndexedBatchSampler`, so exact resume from `start_batch` and equal
batches per rank hold unchanged) yielding {"latent_mean", "latent_logvar": (B, C, h, w) float32, "text_embeds":
(B, max_text_tokens, D) float32, "text_mask": (B, max_text_tokens) int64, "captions", "keys"}. Reading imports
neither models/ nor diffusers/transformers; only the writing side loads the encoders (lazily, via models/).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import glob
import io
import json
import logging
import math
import os
import re
import sys
from typing import Any, Iterator, Sequence

import numpy as np
import torch
import webdataset as wds
from PIL import Image

from .indexed import IndexedBatchSampler, IndexedLoader, IndexedShards
from .shards import (
    IMAGE_EXTENSIONS,
    ReaderStats,
    _DecodeSamples,
    _ReadShards,
    check_loader_args,
    expand_urls,
    is_remote,
)

__all__ = [
    "FORMAT_KIND",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "NULL_TEXT_NAME",
    "PrecomputeSettings",
    "precompute_shards",
    "write_manifest",
    "load_manifest",
    "check_manifest",
    "find_manifest",
    "load_null_text",
    "sample_latents",
    "text_to_numpy",
    "text_from_numpy",
    "PrecomputedFeatures",
    "PrecomputedShards",
    "PrecomputedLoader",
    "make_precomputed_loader",
    "main",
]

log = logging.getLogger(__name__)

FORMAT_KIND = "imba-dit precomputed features"
FORMAT_VERSION = 1
MANIFEST_NAME = "precompute.json"
NULL_TEXT_NAME = "null_text.npy"
RECORD_SUFFIX = ".precompute.json"  # NAME.tar -> NAME.tar.precompute.json
LATENT_MEMBER = "latent.npy"
TEXT_MEMBER = "t5.npy"
NONFINITE = "non-finite features"
BAD_PRECOMPUTED = "bad precomputed sample"
TEXT_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
ENCODER_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_TAR_NAME = re.compile(r"([^/\s'\"]+\.tar)(?![^/\s'\"])")


# --------------------------------------------------------------------------------------------------------------
# Settings
# --------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PrecomputeSettings:
    """What determines the stored features; stored in every shard record and the manifest.

    Names and meanings follow the training config: data.resolution, data.caption_field, model.vae,
    model.vae_subfolder, model.text_encoder, model.text_encoder_subfolder, model.tokenizer_subfolder,
    model.encoder_dtype, model.max_text_tokens, data.min_size; `text_dtype` is the storage dtype of the T5 states.
    """

    resolution: int
    vae: str = "tiny"
    vae_subfolder: str = ""
    text_encoder: str = "tiny"
    text_encoder_subfolder: str = ""
    tokenizer_subfolder: str = ""
    encoder_dtype: str = "float32"
    max_text_tokens: int = 64
    text_dtype: str = "float16"
    caption_field: str = "caption"
    min_size: int = 0

    def __post_init__(self) -> None:
        if self.resolution < 1 or self.max_text_tokens < 1 or self.min_size < 0:
            raise ValueError(f"need resolution >= 1, max_text_tokens >= 1, min_size >= 0 (got {self.resolution}, "
                             f"{self.max_text_tokens}, {self.min_size})")
        if self.text_dtype not in TEXT_DTYPES:
            raise ValueError(f"text_dtype must be one of {sorted(TEXT_DTYPES)} (got {self.text_dtype!r})")
        if self.encoder_dtype not in ENCODER_DTYPES:
            raise ValueError(f"encoder_dtype must be one of {sorted(ENCODER_DTYPES)} (got {self.encoder_dtype!r})")

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _differences(stored: dict[str, Any], wanted: dict[str, Any]) -> list[str]:
    return [f"{k} {stored.get(k)!r} there vs {v!r} now" for k, v in wanted.items() if stored.get(k) != v]


# --------------------------------------------------------------------------------------------------------------
# Arrays <-> bytes
# --------------------------------------------------------------------------------------------------------------


def _npy_bytes(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(arr), allow_pickle=False)
    return buf.getvalue()


def _load_npy(data: bytes) -> np.ndarray:
    """`np.load(..., allow_pickle=False)` of one member, with its header parsed once per distinct header: the
    members of a set share a few dozen headers (one latent shape, one per caption length), and parsing them with
    `np.load` took ~140 of the ~170 µs a sample's two arrays cost. Writable, like np.load's (a copy of `data`)."""
    size_bytes = {1: 2, 2: 4}.get(data[6]) if len(data) > 10 and data[:6] == b"\x93NUMPY" else None
    if size_bytes is None:  # not a version 1/2 .npy: np.load's checks and message
        return np.load(io.BytesIO(data), allow_pickle=False)
    offset = 8 + size_bytes + int.from_bytes(data[8:8 + size_bytes], "little")
    shape, fortran_order, dtype = _npy_header(data[:offset])
    count = math.prod(shape)
    if len(data) - offset != count * dtype.itemsize:
        raise ValueError(f".npy member holds {len(data) - offset} data bytes, its header says {shape} {dtype}")
    flat = np.frombuffer(bytearray(data), dtype=dtype, count=count, offset=offset)
    return flat.reshape(shape, order="F" if fortran_order else "C")


@functools.lru_cache(maxsize=1024)
def _npy_header(header: bytes) -> tuple[tuple[int, ...], bool, np.dtype]:
    fp = io.BytesIO(header)
    version = np.lib.format.read_magic(fp)
    read = np.lib.format.read_array_header_1_0 if version[0] == 1 else np.lib.format.read_array_header_2_0
    shape, fortran_order, dtype = read(fp)
    if dtype.hasobject:
        raise ValueError(".npy member holds Python objects; only plain arrays are read (no pickle)")
    return shape, fortran_order, dtype


def text_to_numpy(states: torch.Tensor, text_dtype: str) -> np.ndarray:
    """T5 states as stored: float16, or uint16 bit patterns of bfloat16 (numpy has no bfloat16)."""
    if text_dtype == "float16":
        return states.detach().to("cpu", torch.float16).numpy()
    if text_dtype == "bfloat16":
        return states.detach().to("cpu", torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    raise ValueError(f"text_dtype must be one of {sorted(TEXT_DTYPES)} (got {text_dtype!r})")


def text_from_numpy(arr: np.ndarray) -> torch.Tensor:
    """float32 tensor from a stored T5 array (float16, or uint16 = bfloat16 bits)."""
    if arr.dtype == np.uint16:
        return torch.from_numpy(np.ascontiguousarray(arr).view(np.int16)).view(torch.bfloat16).float()
    if arr.dtype == np.float16:
        return torch.from_numpy(np.ascontiguousarray(arr)).float()
    raise ValueError(f"stored T5 states must be float16 or uint16 (bfloat16 bits), got {arr.dtype}")


# --------------------------------------------------------------------------------------------------------------
# Files in the output folder
# --------------------------------------------------------------------------------------------------------------


def _output_name(url: str) -> str:
    """NAME.tar of an input shard spec (a path, a URL, or a pipe: command naming a .tar)."""
    names = _TAR_NAME.findall(url)
    if not names:
        raise ValueError(f"cannot tell the shard name of {url!r}: input shards must be named *.tar")
    return names[-1]


def _record_path(out_dir: str, name: str) -> str:
    return os.path.join(out_dir, name + RECORD_SUFFIX)


def _atomic_write(path: str, payload: bytes) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _write_json(path: str, obj: Any) -> None:
    _atomic_write(path, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode("utf-8"))


def _read_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            obj = json.load(f)
    except (OSError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None


def _read_record(out_dir: str, name: str) -> dict | None:
    record = _read_json(_record_path(out_dir, name))
    if record is None or record.get("__kind__") != FORMAT_KIND or record.get("version") != FORMAT_VERSION:
        return None
    return record


def _is_complete(out_dir: str, name: str, settings: PrecomputeSettings) -> bool:
    record = _read_record(out_dir, name)
    path = os.path.join(out_dir, name)
    return (
        record is not None
        and record.get("settings") == settings.as_dict()
        and os.path.isfile(path)
        and os.path.getsize(path) == record.get("bytes")
    )


def _remove_leftovers(out_dir: str, name: str) -> None:
    """Temporary files of an interrupted earlier write of shard `name` (no other process writes this shard)."""
    for pattern in (f"{name}.tmp-*", f"{name}{RECORD_SUFFIX}.tmp-*"):
        for path in glob.glob(os.path.join(glob.escape(out_dir), pattern)):
            log.info("removing the leftover %s of an interrupted run", path)
            try:
                os.remove(path)
            except FileNotFoundError:
                pass


def _plan(urls: Sequence[str], out_dir: str) -> list[tuple[str, str]]:
    """(input url, output NAME.tar) for every input shard; names must be unique and not the inputs themselves."""
    names = [_output_name(u) for u in urls]
    seen: dict[str, str] = {}
    for url, name in zip(urls, names):
        if name in seen:
            raise ValueError(f"input shards {seen[name]} and {url} would both be written to {name}: "
                             f"precompute each folder into its own output folder")
        seen[name] = url
        if os.path.exists(url) and os.path.abspath(url) == os.path.abspath(os.path.join(out_dir, name)):
            raise ValueError(f"the output folder {out_dir} holds the input shard {url}: pick another output folder")
    return list(zip(urls, names))


def _check_existing(out_dir: str, plan: Sequence[tuple[str, str]], settings: PrecomputeSettings) -> None:
    """Refuse an output folder holding features made with other settings (identically on every rank)."""
    wanted = settings.as_dict()
    found = [_read_json(os.path.join(out_dir, MANIFEST_NAME))]
    found += [_read_record(out_dir, name) for _, name in plan]
    for stored in found:
        if stored is None:
            continue
        stored_settings = stored.get("settings", stored)
        diff = _differences(stored_settings, wanted)
        if diff:
            raise ValueError(f"{out_dir} holds features precomputed with other settings ({'; '.join(diff)}): "
                             f"precompute into another folder, or delete it to start over")


# --------------------------------------------------------------------------------------------------------------
# Encoders (writing side only: imports models/ lazily)
# --------------------------------------------------------------------------------------------------------------


class _Encoders:
    """The frozen VAE and T5 of the training config, loaded through models/ exactly as train.py loads them."""

    def __init__(self, settings: PrecomputeSettings, device: str | torch.device = "cpu"):
        from models.text_encoder import TextConditioner, load_text_encoder
        from models.vae import load_vae, vae_scale_factor

        dtype = ENCODER_DTYPES[settings.encoder_dtype]
        tokenizer, t5 = load_text_encoder(settings.text_encoder, settings.text_encoder_subfolder,
                                          settings.tokenizer_subfolder, dtype=dtype)
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
        decode = _DecodeSamples(self.settings.resolution, self.settings.caption_field, stats,
                                min_size=self.settings.min_size)
        read = _ReadShards(stats)  # the training reader's tar reading: counts and names failing shards
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
            yield "end", job, {"decoded": stats.good - good0, "bad": _delta(stats.bad, bad0),
                               "shards_bad": _delta(stats.shards_bad, shards_bad0)}


def _delta(now: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {r: n - before.get(r, 0) for r, n in now.items() if n != before.get(r, 0)}


def _warn_rate_limited(count: int, message: str) -> None:
    if count <= 10 or count % 1000 == 0:
        log.warning("%s (occurrence %d)", message[:300], count)


def _identity(item: Any) -> Any:
    return item


# --------------------------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------------------------


class _ShardOutput:
    """One output shard being written under its temporary name."""

    def __init__(self, out_dir: str, name: str):
        self.path = os.path.join(out_dir, name)
        self.tmp = f"{self.path}.tmp-{os.getpid()}"
        self.file = open(self.tmp, "wb")
        self.writer = wds.TarWriter(self.file, encoder=False, compress=False, mtime=0)
        self.samples = 0
        self.bad: collections.Counter[str] = collections.Counter()

    def commit(self) -> int:
        self.writer.close()
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        os.replace(self.tmp, self.path)
        return os.path.getsize(self.path)

    def abort(self) -> None:
        try:
            self.writer.close()
        except Exception:
            pass
        self.file.close()
        if os.path.exists(self.tmp):
            os.remove(self.tmp)


def _write_batch(out: _ShardOutput, encoders: _Encoders, samples: list[dict[str, Any]], source: str) -> None:
    settings = encoders.settings
    pixels = torch.stack([s["pixels"] for s in samples])
    moments, texts = encoders.encode(pixels, [s["caption"] for s in samples])
    for sample, moment, text in zip(samples, moments, texts):
        latent = moment.to(torch.float16)
        stored_text = text_to_numpy(text, settings.text_dtype)
        if not (torch.isfinite(latent).all() and torch.isfinite(text.to(TEXT_DTYPES[settings.text_dtype])).all()):
            out.bad[NONFINITE] += 1
            _warn_rate_limited(out.bad[NONFINITE], f"skipping {source}:{sample['key']}: {NONFINITE}")
            continue
        meta = dict(sample["json"])
        meta["precompute"] = {
            "source": os.path.basename(source),
            "image_size": sample["image_size"],
            "resolution": settings.resolution,
            "text_tokens": int(text.shape[0]),
        }
        out.writer.write({
            "__key__": sample["key"],
            LATENT_MEMBER: _npy_bytes(latent.numpy()),
            TEXT_MEMBER: _npy_bytes(stored_text),
            "txt": sample["caption"].encode("utf-8"),
            "json": json.dumps(meta, sort_keys=True).encode("utf-8"),
        })
        out.samples += 1


def _write_null_text(out_dir: str, encoders: _Encoders) -> None:
    """The empty caption's T5 state, as TextConditioner computes its null embedding (rewritten by rank 0 whenever it
    has the encoders loaded, so it always follows the settings the shard records were checked against)."""
    null = encoders.encode_text([""])[0]
    _atomic_write(os.path.join(out_dir, NULL_TEXT_NAME), _npy_bytes(text_to_numpy(null, encoders.settings.text_dtype)))


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
) -> dict[str, Any]:
    """Precompute this process's share (input shards rank, rank + world_size, ...) into `out_dir`.

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
    plan = _plan(urls, out_dir)
    _check_existing(out_dir, plan, settings)
    os.makedirs(out_dir, exist_ok=True)
    manifest = _read_json(os.path.join(out_dir, MANIFEST_NAME))
    if manifest is not None and [s.get("name") for s in manifest.get("shards", [])] != [n for _, n in plan]:
        try:  # a manifest of another shard list would describe a folder that is being changed
            os.remove(os.path.join(out_dir, MANIFEST_NAME))
        except FileNotFoundError:
            pass

    mine = plan[rank::world_size]
    todo = [(u, n) for u, n in mine if not _is_complete(out_dir, n, settings)]
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
            _remove_leftovers(out_dir, name)
        _write_shards(todo, out_dir, settings, encoders, batch_size, num_workers, report)
    report["manifest"] = write_manifest(out_dir, urls, settings)
    return report


def _write_shards(todo, out_dir, settings, encoders, batch_size, num_workers, report) -> None:
    loader = torch.utils.data.DataLoader(
        _ShardBatches([u for u, _ in todo], settings, batch_size),
        batch_size=None,
        collate_fn=_identity,
        num_workers=num_workers,
        generator=torch.Generator().manual_seed(0),  # leave the global RNG alone
    )
    outputs: dict[int, _ShardOutput] = {}
    bad: collections.Counter[str] = collections.Counter()
    shards_bad: collections.Counter[str] = collections.Counter()
    try:
        for kind, job, payload in loader:
            url, name = todo[job]
            if job not in outputs:
                outputs[job] = _ShardOutput(out_dir, name)
            out = outputs[job]
            if kind == "batch":
                _write_batch(out, encoders, payload, url)
                continue
            nbytes = out.commit()
            del outputs[job]
            shard_bad = collections.Counter(payload["bad"]) + out.bad
            record = {
                "__kind__": FORMAT_KIND, "version": FORMAT_VERSION, "settings": settings.as_dict(),
                "info": encoders.info, "name": name, "source": url, "samples": out.samples,
                "bad": dict(sorted(shard_bad.items())), "shards_bad": payload["shards_bad"], "bytes": nbytes,
            }
            _write_json(_record_path(out_dir, name), record)
            bad.update(shard_bad)
            report["written"].append(name)
            report["samples"] += out.samples
            shards_bad.update(payload["shards_bad"])
            skipped = ", ".join(f"{r}: {n}" for r, n in sorted(shard_bad.items())) or "none"
            damaged = f"; shard: {', '.join(payload['shards_bad'])}" if payload["shards_bad"] else ""
            log.info("[rank %d] %s: %d samples written, skipped %d (%s)%s", report["rank"], name, out.samples,
                     sum(shard_bad.values()), skipped, damaged)
    finally:
        for out in outputs.values():  # an error mid-shard: nothing half-written stays behind
            out.abort()
    report["bad"] = dict(sorted(bad.items()))
    report["shards_bad"] = dict(sorted(shards_bad.items()))


def write_manifest(
    out_dir: str | os.PathLike, urls: str | Sequence[str], settings: PrecomputeSettings
) -> str | None:
    """Write `out_dir/precompute.json` if every shard of `urls` is complete and the null text exists.

    Returns the manifest path, or None when some shard is not complete yet. `precompute_shards` calls it at its
    end; safe to call from several processes at once (identical atomic writes).
    """
    out_dir = os.path.abspath(os.path.expanduser(os.fspath(out_dir)))
    urls = expand_urls(urls)
    plan = _plan(urls, out_dir)
    if not os.path.isfile(os.path.join(out_dir, NULL_TEXT_NAME)):
        return None
    records = []
    for _, name in plan:
        if not _is_complete(out_dir, name, settings):
            return None
        records.append(_read_record(out_dir, name))
    info = records[0]["info"]
    if any(r["info"] != info for r in records):
        raise ValueError(f"the shard records in {out_dir} disagree on the latent/text shapes: delete the folder "
                         f"and precompute again")
    null = np.load(os.path.join(out_dir, NULL_TEXT_NAME), allow_pickle=False)
    bad: collections.Counter[str] = collections.Counter()
    shards_bad: collections.Counter[str] = collections.Counter()
    for r in records:
        bad.update(r["bad"])
        shards_bad.update(r["shards_bad"])
    manifest = {
        "__kind__": FORMAT_KIND,
        "version": FORMAT_VERSION,
        "settings": settings.as_dict(),
        **settings.as_dict(),
        **info,
        "latent_shape": [2, info["latent_channels"], info["latent_size"], info["latent_size"]],
        "latent_dtype": "float16",
        "null_text": NULL_TEXT_NAME,
        "null_text_tokens": int(null.shape[0]),
        "samples": sum(r["samples"] for r in records),
        "skipped": dict(sorted(bad.items())),
        "shards_bad": dict(sorted(shards_bad.items())),
        "shards": [{"name": r["name"], "source": r["source"], "samples": r["samples"]} for r in records],
    }
    path = os.path.join(out_dir, MANIFEST_NAME)
    _write_json(path, manifest)
    return path


# --------------------------------------------------------------------------------------------------------------
# Reading: manifest, null text, latent sampling
# --------------------------------------------------------------------------------------------------------------


def _manifest_path(where: str | os.PathLike | Sequence[str]) -> str:
    if isinstance(where, (str, os.PathLike)):
        where = os.path.expanduser(os.fspath(where))
        if os.path.isfile(where) and where.endswith(".json"):
            return where
        if os.path.isdir(where):
            return os.path.join(where, MANIFEST_NAME)
    return os.path.join(os.path.dirname(os.path.abspath(expand_urls(where)[0])), MANIFEST_NAME)


def load_manifest(where: str | os.PathLike | Sequence[str]) -> dict[str, Any]:
    """The manifest of precomputed shards: `where` is the output folder, its precompute.json, or a shard spec
    (the manifest is then the one next to the first shard). Its "__path__" entry is where it was read from."""
    path = _manifest_path(where)
    manifest = _read_json(path)
    if manifest is None or manifest.get("__kind__") != FORMAT_KIND:
        raise FileNotFoundError(
            f"no precompute manifest at {path}: the folder is not precomputed, or its precompute did not finish "
            f"(run `python -m data.precompute IN_SHARDS {os.path.dirname(path)} ...` again: it completes it)"
        )
    if manifest.get("version") != FORMAT_VERSION:
        raise ValueError(f"{path} is precompute format version {manifest.get('version')}, this code reads "
                         f"{FORMAT_VERSION}: precompute again")
    manifest["__path__"] = os.path.abspath(path)
    return manifest


def find_manifest(shards: str | Sequence[str], **expected: Any) -> dict[str, Any] | None:
    """The manifest when `shards` (a training config's data.shards) are precompute outputs, checked against
    `expected` (see `check_manifest`); None for ordinary image shards, remote ones and an empty spec."""
    if not shards or is_remote(expand_urls(shards)[0]):
        return None
    try:
        manifest = load_manifest(shards)
    except FileNotFoundError:
        return None
    check_manifest(manifest, **expected)
    return manifest


def check_manifest(manifest: dict[str, Any], **expected: Any) -> None:
    """Raise ValueError (one line, every mismatch) unless manifest[k] == v for each keyword.

    Keys: the `PrecomputeSettings` fields (resolution, vae, vae_subfolder, text_encoder, text_encoder_subfolder,
    tokenizer_subfolder, encoder_dtype, max_text_tokens, text_dtype, caption_field) and the derived ones
    (latent_channels, latent_size, vae_downsample, vae_scaling_factor, text_hidden_size).
    """
    unknown = [k for k in expected if k not in manifest or k.startswith("_")]
    if unknown:
        raise KeyError(f"check_manifest: unknown keys {unknown}")
    diff = [f"{k}={v!r} wanted, {manifest[k]!r} precomputed" for k, v in expected.items() if manifest[k] != v]
    if diff:
        where = manifest.get("__path__", "the precompute manifest")
        raise ValueError(f"the precomputed features ({where}) do not match: {'; '.join(diff)}; precompute with "
                         f"matching settings or change the config")


def _pad_text(states: torch.Tensor, max_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    n, dim = states.shape
    embeds = states.new_zeros(max_tokens, dim)
    embeds[:n] = states
    mask = torch.zeros(max_tokens, dtype=torch.long)
    mask[:n] = 1
    return embeds, mask


def load_null_text(manifest: dict[str, Any] | str | os.PathLike) -> tuple[torch.Tensor, torch.Tensor]:
    """The empty caption's T5 state: (embeds (1, max_text_tokens, D) float32, zero-padded; mask (1, L) int64),
    what `TextConditioner.null_embeds`/`null_mask` hold when the encoder is loaded (equal on valid tokens)."""
    if not isinstance(manifest, dict):
        manifest = load_manifest(manifest)
    path = os.path.join(os.path.dirname(manifest["__path__"]), manifest["null_text"])
    embeds, mask = _pad_text(text_from_numpy(np.load(path, allow_pickle=False)), manifest["max_text_tokens"])
    return embeds[None], mask[None]


def sample_latents(
    mean: torch.Tensor, logvar: torch.Tensor, scaling_factor: float, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Latents drawn from stored posterior moments: (mean + exp(logvar / 2) · ε) · scaling_factor.

    The same computation as `models.vae.encode_images` (diffusers' `latent_dist.sample(generator)` times
    `vae.config.scaling_factor`, no shift): with the same moments and generator state it gives the same latents.
    `scaling_factor` is the manifest's "vae_scaling_factor". ε is drawn on the generator's device.
    """
    std = torch.exp(0.5 * logvar.clamp(-30.0, 20.0))
    noise_device = generator.device if generator is not None else mean.device
    noise = torch.randn(mean.shape, generator=generator, device=noise_device, dtype=mean.dtype).to(mean.device)
    return (mean + std * noise) * scaling_factor


# --------------------------------------------------------------------------------------------------------------
# Reading: dataset and loader over precomputed shards (the indexed reader's machinery)
# --------------------------------------------------------------------------------------------------------------


class PrecomputedFeatures:
    """Training inputs from precomputed shards, with the interface of `models.encoders.FrozenEncoders`
    (latent_channels, caption_channels, vae_scale, features(batch, device), null_like(n)): no VAE or T5 loaded."""

    def __init__(self, manifest: dict[str, Any], device: torch.device | str = "cpu"):
        self.manifest = manifest
        self.latent_channels = manifest["latent_channels"]
        self.caption_channels = manifest["text_hidden_size"]
        self.vae_scale = manifest["vae_downsample"]
        embeds, mask = load_null_text(manifest)
        self.null_embeds, self.null_mask = embeds.to(device), mask.to(device)

    def features(self, batch: dict[str, Any], device) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        latents = sample_latents(batch["latent_mean"].to(device), batch["latent_logvar"].to(device),
                                 self.manifest["vae_scaling_factor"])
        return latents, (batch["text_embeds"].to(device), batch["text_mask"].to(device))

    def null_like(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.null_embeds.expand(batch_size, -1, -1), self.null_mask.expand(batch_size, -1)


@dataclasses.dataclass
class _DecodePrecomputed:
    """Raw precomputed sample -> tensors; bad ones are counted (reason "bad precomputed sample") and dropped."""

    manifest: dict[str, Any]
    stats: ReaderStats

    def _parse(self, raw: dict[str, Any]) -> dict[str, Any]:
        m = self.manifest
        for member in (LATENT_MEMBER, TEXT_MEMBER, "txt"):
            if raw.get(member) is None:
                raise ValueError(f"no {member} member")
        latent = _load_npy(raw[LATENT_MEMBER])
        if latent.dtype != np.float16 or list(latent.shape) != m["latent_shape"]:
            raise ValueError(f"latent is {latent.dtype} {latent.shape}, expected float16 {tuple(m['latent_shape'])}")
        text = _load_npy(raw[TEXT_MEMBER])
        if text.ndim != 2 or not 1 <= text.shape[0] <= m["max_text_tokens"] or text.shape[1] != m["text_hidden_size"]:
            raise ValueError(f"T5 states of shape {text.shape}, expected (1..{m['max_text_tokens']}, "
                             f"{m['text_hidden_size']})")
        latent_t = torch.from_numpy(latent).float()
        embeds, mask = _pad_text(text_from_numpy(text), m["max_text_tokens"])
        return {
            "latent_mean": latent_t[0],
            "latent_logvar": latent_t[1],
            "text_embeds": embeds,
            "text_mask": mask,
            "caption": raw["txt"].decode("utf-8"),
            "key": raw["__key__"],
        }

    def __call__(self, src: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        for raw in src:
            try:
                sample = self._parse(raw)
            except Exception as exn:  # missing member, corrupt array, wrong shape
                where = f"{raw.get('__url__', '?')}:{raw.get('__key__', '?')}"
                self.stats.count(BAD_PRECOMPUTED, f"skipping {where}: {BAD_PRECOMPUTED} {exn!r}")
                self.stats.failed(f"{BAD_PRECOMPUTED} at {where}")
                continue
            self.stats.good += 1
            self.stats.failures_in_a_row = 0
            yield sample


class PrecomputedShards(IndexedShards):
    """`ds[i]` -> {"latent_mean", "latent_logvar": (C, h, w) float32, "text_embeds": (L, D) float32 zero-padded,
    "text_mask": (L,) int64, "caption", "key"}: `IndexedShards` (index, random access, bad-sample substitution
    and counting) with the precomputed members decoded instead of images."""

    def __init__(
        self,
        urls: str | Sequence[str],
        manifest: dict[str, Any] | None = None,
        index_dir: str | os.PathLike | None = None,
    ):
        manifest = manifest if manifest is not None else load_manifest(urls)
        super().__init__(urls, manifest["resolution"], caption_field=manifest["caption_field"], index_dir=index_dir)
        # the image decoder of IndexedShards is replaced: raw precomputed members -> tensors
        self.manifest = manifest
        self._decode = _DecodePrecomputed(manifest, self.stats)


def _collate_precomputed(samples: list[dict[str, Any]]) -> dict[str, Any]:
    batch = {k: torch.stack([s[k] for s in samples]) for k in ("latent_mean", "latent_logvar", "text_embeds",
                                                               "text_mask")}
    batch["captions"] = [s["caption"] for s in samples]
    batch["keys"] = [s["key"] for s in samples]
    return batch


class PrecomputedLoader(IndexedLoader):
    """Iterable of precomputed batches (see `make_precomputed_loader`); each `iter()` starts at `start_batch`.

    `IndexedLoader` with the precomputed collate: `stats` sums good/bad samples over workers, `batches_per_epoch`
    is per rank, `sampler.batch_indices(t)` names batch t's samples; plus `manifest`.
    """

    def __init__(self, dataset: PrecomputedShards, sampler: IndexedBatchSampler, num_workers: int = 0):
        super().__init__(dataset, sampler, num_workers=num_workers, collate=_collate_precomputed)
        self.manifest = dataset.manifest


def make_precomputed_loader(
    urls: str | Sequence[str],
    batch_size: int,
    num_workers: int = 0,
    seed: int = 0,
    rank: int = 0,
    world_size: int = 1,
    start_batch: int = 0,
    index_dir: str | os.PathLike | None = None,
    shard_window: int = 0,
    manifest: dict[str, Any] | None = None,
) -> PrecomputedLoader:
    """Infinite, exactly resumable loader over precomputed shards (the output folder, or a spec of its shards).

    Batches: {"latent_mean", "latent_logvar": (B, C, h, w) float32, "text_embeds": (B, max_text_tokens, D)
    float32 (zeros at padded tokens), "text_mask": (B, max_text_tokens) int64, "captions": [str], "keys": [str]}.
    Order, rank split, `start_batch` resume and `shard_window` are those of `make_indexed_loader` (the same
    `IndexedBatchSampler`). `manifest` defaults to the precompute.json next to the first shard.
    """
    check_loader_args(1, batch_size, num_workers)
    dataset = PrecomputedShards(urls, manifest=manifest, index_dir=index_dir)
    sampler = IndexedBatchSampler(
        len(dataset),
        batch_size,
        seed=seed,
        rank=rank,
        world_size=world_size,
        start_batch=start_batch,
        shard_sizes=dataset.index.nsamples,
        shard_window=shard_window,
    )
    return PrecomputedLoader(dataset, sampler, num_workers=num_workers)


# --------------------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m data.precompute",
        description="Precompute VAE latent moments and T5 states of img2dataset tar shards into new shards "
                    "(run under `accelerate launch` to split the shards over processes).",
    )
    p.add_argument("shards", nargs="+", help="input shards: brace pattern, glob, folder or files")
    p.add_argument("out_dir", help="output folder (the same shard names; precompute.json when complete)")
    p.add_argument("--resolution", type=int, required=True, help="data.resolution of the training config")
    p.add_argument("--vae", default="tiny", help="model.vae: hub id, local folder or 'tiny'")
    p.add_argument("--vae-subfolder", default="", help="model.vae_subfolder")
    p.add_argument("--text-encoder", default="tiny", help="model.text_encoder: hub id, local folder or 'tiny'")
    p.add_argument("--text-encoder-subfolder", default="", help="model.text_encoder_subfolder")
    p.add_argument("--tokenizer-subfolder", default="", help="model.tokenizer_subfolder")
    p.add_argument("--encoder-dtype", default="float32", choices=sorted(ENCODER_DTYPES),
                   help="model.encoder_dtype: dtype the VAE and T5 run in")
    p.add_argument("--max-text-tokens", type=int, default=64, help="model.max_text_tokens")
    p.add_argument("--text-dtype", "--dtype", default="float16", choices=sorted(TEXT_DTYPES),
                   help="storage dtype of the T5 states (latent moments are always float16)")
    p.add_argument("--caption-field", default="caption", help="data.caption_field")
    p.add_argument("--min-size", type=int, default=0, help="data.min_size: skip smaller images (pixels)")
    p.add_argument("--batch-size", type=int, default=32, help="images per encoder call")
    p.add_argument("--num-workers", type=int, default=2, help="decoding processes per process (0: in process)")
    p.add_argument("--device", default=None, help="default: the accelerate process's device")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    settings = PrecomputeSettings(
        resolution=args.resolution, vae=args.vae, vae_subfolder=args.vae_subfolder, text_encoder=args.text_encoder,
        text_encoder_subfolder=args.text_encoder_subfolder, tokenizer_subfolder=args.tokenizer_subfolder,
        encoder_dtype=args.encoder_dtype, max_text_tokens=args.max_text_tokens, text_dtype=args.text_dtype,
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
