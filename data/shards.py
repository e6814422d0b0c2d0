"""Reading img2dataset-layout tar shards (`key.jpg|jpeg|png|webp`, `key.txt`, `key.json`) into training batches.

The stream is infinite and step-based: shards are drawn with replacement (webdataset `ResampledShards`), samples
pass through a shuffle buffer, and every random choice is seeded explicitly from (seed, rank, worker id,
resume_step) — never from pid or time — so the same arguments reproduce the same stream, and different ranks,
workers or resume steps get different streams. Exact resume (skip what was consumed) is the job of an indexed
reader (wids), not of this one.

Bad samples and shards are skipped, counted per reason (`ReaderStats`), logged (rate-limited, plus a per-reason
summary every few minutes) and never fatal — except when nothing readable has come out at all after many attempts,
which is a wrong path or layout, reported in one line instead of an endless silent loop. Sample reasons (the same
in data.indexed):

  bad image                 undecodable or truncated image, or no jpg/jpeg/png/webp member
  zero-byte member          the image member is empty (a failed download or an interrupted write)
  image too small           shorter side below `min_size` pixels (checked on the header, before any draft)
  missing or empty caption  no txt member and no caption field in json, or only whitespace
  non-UTF-8 text            txt or json bytes that are not valid UTF-8
  bad json                  json needed for the caption but not parseable

Shard reasons (counted once per read of the shard, the shard named in a warning): `unreadable shard` (cannot be
opened or read: permissions, vanished file, I/O error) and `truncated or corrupt tar` (the samples before the
damage are used).
"""

from __future__ import annotations

import glob
import hashlib
import io
import json
import logging
import os
import re
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Sequence

import braceexpand
import numpy as np
import torch
import webdataset as wds
from PIL import Image

__all__ = [
    "IMAGE_EXTENSIONS",
    "REMOTE_PREFIXES",
    "expand_urls",
    "resize_center_crop",
    "resize_cover_crop",
    "to_rgb",
    "image_to_tensor",
    "sample_caption",
    "sample_image",
    "derive_seed",
    "BadSample",
    "ReaderStats",
    "make_image_text_pipeline",
    "make_image_text_loader",
]

log = logging.getLogger(__name__)

IMAGE_EXTENSIONS: tuple[str, ...] = ("jpg", "jpeg", "png", "webp")
REMOTE_PREFIXES: tuple[str, ...] = ("pipe:", "http://", "https://", "s3://", "gs://")
_GLOB_CHARS = re.compile(r"[*?\[]")

# Give up (one clear error) when this many samples/shards failed in a row before any sample was usable.
MAX_FAILURES_BEFORE_FIRST_SAMPLE = 1000
SUMMARY_EVERY_S = 300.0  # a process that skipped something logs its per-reason summary at most this often

# Skip reasons (see the module docstring).
BAD_IMAGE = "bad image"
ZERO_BYTES = "zero-byte member"
TOO_SMALL = "image too small"
NO_CAPTION = "missing or empty caption"
NOT_UTF8 = "non-UTF-8 text"
BAD_JSON = "bad json"
UNREADABLE_SHARD = "unreadable shard"
CORRUPT_TAR = "truncated or corrupt tar"


class BadSample(ValueError):
    """A sample that cannot be used, with the reason it is counted under."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


# --------------------------------------------------------------------------------------------------------------
# Shard specs
# --------------------------------------------------------------------------------------------------------------


def is_remote(spec: str) -> bool:
    """True for specs webdataset streams (pipe:, http(s)://, s3://, gs://) rather than local files."""
    return spec.startswith(REMOTE_PREFIXES)


def expand_urls(spec: str | os.PathLike | Sequence[str | os.PathLike]) -> list[str]:
    """Expand a shard spec (or a list of them) into a list of shard URLs/paths, in order.

    Each spec may be a brace pattern (`shards/part-{000000..000009}.tar`), a glob (`shards/*.tar`), a directory
    (all `*.tar` directly in it, sorted), a plain file, or a remote spec (`pipe:...`, `http(s)://`, `s3://`,
    `gs://`), which is brace-expanded but otherwise passed through unchecked. Local specs must match: a spec
    that matches nothing, or a brace pattern naming missing files, raises FileNotFoundError.
    """
    specs = [spec] if isinstance(spec, (str, os.PathLike)) else list(spec)
    if not specs:
        raise FileNotFoundError("no shards given: pass a shard path, directory, glob or brace pattern")
    urls: list[str] = []
    for item in specs:
        item = os.fspath(item)
        if is_remote(item):
            urls.extend(braceexpand.braceexpand(item))
            continue
        found: list[str] = []
        missing: list[str] = []
        for path in braceexpand.braceexpand(os.path.expanduser(item)):
            if os.path.isdir(path):
                found.extend(sorted(glob.glob(os.path.join(glob.escape(path), "*.tar"))))
            elif _GLOB_CHARS.search(path):
                found.extend(p for p in sorted(glob.glob(path)) if os.path.isfile(p))
            elif os.path.isfile(path):
                found.append(path)
            else:
                missing.append(path)
        if missing and found:
            raise FileNotFoundError(
                f"shard spec {item!r}: {len(missing)} of its files are missing (first: {missing[0]}); "
                f"fix the range or path"
            )
        if not found:
            raise FileNotFoundError(
                f"no shards found for {item!r}: give an existing .tar file, a directory of .tar shards, "
                f"a glob or a brace pattern like 'shards/part-{{000000..000009}}.tar'"
            )
        urls.extend(found)
    return urls


# --------------------------------------------------------------------------------------------------------------
# Image helpers (PIL + numpy/torch; no torchvision)
# --------------------------------------------------------------------------------------------------------------


def to_rgb(img: Image.Image, background: tuple[int, int, int] = (255, 255, 255)) -> Image.Image:
    """RGB version of `img`; transparent images (RGBA, LA, P with transparency) are composited over white."""
    if img.mode == "RGB":
        return img
    if img.mode in ("RGBA", "LA", "PA") or (img.mode == "P" and "transparency" in img.info):
        rgba = img.convert("RGBA")
        base = Image.new("RGBA", rgba.size, background + (255,))
        return Image.alpha_composite(base, rgba).convert("RGB")
    return img.convert("RGB")


def resize_center_crop(img: Image.Image, size: int) -> Image.Image:
    """Resize so the shorter side is `size` (bicubic, antialiased when shrinking), then crop the centre square."""
    return resize_cover_crop(img, size, size)


def resize_cover_crop(img: Image.Image, width: int, height: int) -> Image.Image:
    """Resize (keeping the aspect ratio; bicubic, antialiased when shrinking) to the smallest size that covers
    width x height, then crop the centre width x height. `resize_center_crop` is the square case."""
    w, h = img.size
    if w <= 0 or h <= 0:
        raise ValueError(f"empty image ({w}x{h})")
    if width * h >= height * w:  # the width is the tighter constraint: scale it to `width`
        nw, nh = width, max(height, round(h * width / w))
    else:
        nw, nh = max(width, round(w * height / h)), height
    if (nw, nh) != (w, h):
        img = img.resize((nw, nh), Image.Resampling.BICUBIC)
    left, top = (nw - width) // 2, (nh - height) // 2
    if (nw, nh) != (width, height):
        img = img.crop((left, top, left + width, top + height))
    return img


def image_to_tensor(img: Image.Image) -> torch.Tensor:
    """(3, H, W) float32 tensor in [-1, 1] from a PIL image of any common mode (L, RGBA, P, CMYK, ...)."""
    arr = np.asarray(to_rgb(img), dtype=np.uint8)
    return torch.from_numpy(arr.copy()).permute(2, 0, 1).float().div_(127.5).sub_(1.0)


# --------------------------------------------------------------------------------------------------------------
# Sample fields
# --------------------------------------------------------------------------------------------------------------


def _utf8(data: bytes | bytearray | str, member: str) -> str:
    if isinstance(data, str):
        return data
    try:
        return bytes(data).decode("utf-8-sig")  # a leading byte-order mark is dropped
    except UnicodeDecodeError as exn:
        raise BadSample(NOT_UTF8, f"{member} member: {exn}") from None


def sample_caption(sample: dict[str, Any], caption_field: str = "caption") -> str:
    """The caption of a raw sample: its `txt` member if non-empty, else `json[caption_field]`; "" if none.

    Raises `BadSample` for text that is not UTF-8 ("non-UTF-8 text") or json that cannot be parsed ("bad json").
    """
    txt = sample.get("txt")
    if txt is not None:
        text = _utf8(txt, "txt").strip()
        if text:
            return text
    meta = sample.get("json")
    if meta is not None:
        if isinstance(meta, (bytes, bytearray, str)):
            try:
                meta = json.loads(_utf8(meta, "json"))
            except ValueError as exn:
                if isinstance(exn, BadSample):
                    raise
                raise BadSample(BAD_JSON, str(exn)) from None
        value = meta.get(caption_field) if isinstance(meta, dict) else None
        if isinstance(value, str):
            return value.strip()
    return ""


def sample_image(
    sample: dict[str, Any], resolution: int | tuple[int, int] | None = None, min_size: int = 0
) -> Image.Image:
    """Decode the first image member (jpg, jpeg, png, webp) of a raw sample; raises if none or undecodable.

    `resolution` (a square side, or a (width, height) the image must still cover) lets JPEGs decode downscaled.
    An empty member raises `BadSample("zero-byte member")`; an image whose shorter side is below `min_size`
    (read from the header, before decoding) raises `BadSample("image too small")`.
    """
    for ext in IMAGE_EXTENSIONS:
        data = sample.get(ext)
        if data is not None:
            break
    else:
        raise ValueError(f"no image member ({', '.join(IMAGE_EXTENSIONS)}) in sample, has {sorted(sample)}")
    if len(data) == 0:
        raise BadSample(ZERO_BYTES, f"{ext} member is empty")
    img = Image.open(io.BytesIO(data))
    if min_size and min(img.size) < min_size:
        raise BadSample(TOO_SMALL, f"{img.size[0]}x{img.size[1]}, shorter side below min_size {min_size}")
    if resolution is not None and img.format == "JPEG":
        size = (resolution, resolution) if isinstance(resolution, int) else tuple(resolution)
        img.draft("RGB", size)  # DCT-domain downscale, never below the requested size
    img.load()
    return img


# --------------------------------------------------------------------------------------------------------------
# Seeding
# --------------------------------------------------------------------------------------------------------------


def derive_seed(*parts: Any) -> int:
    """A 63-bit seed from the parts' text (SHA-256), identical in every process (unlike `hash()` of a str)."""
    digest = hashlib.sha256("/".join(str(p) for p in parts).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _worker_id() -> int:
    info = torch.utils.data.get_worker_info()
    return 0 if info is None else info.id


@dataclass
class _StreamSeed:
    """Called at iteration time (inside the DataLoader worker): seed for one purpose of this worker's stream."""

    seed: int
    rank: int
    resume_step: int
    purpose: str

    def __call__(self) -> int:
        return derive_seed("imba-data", self.purpose, self.seed, self.rank, _worker_id(), self.resume_step)


# --------------------------------------------------------------------------------------------------------------
# Pipeline stages
# --------------------------------------------------------------------------------------------------------------


@dataclass
class ReaderStats:
    """Per-process counts (each DataLoader worker has its own copy)."""

    good: int = 0
    bad: dict[str, int] = field(default_factory=dict)  # sample reason -> samples skipped
    shards_bad: dict[str, int] = field(default_factory=dict)  # shard reason -> shard reads that failed
    failures_in_a_row: int = 0
    where: str = ""  # shard spec, for messages
    last_summary: float = field(default_factory=time.monotonic)

    @property
    def bad_total(self) -> int:
        return sum(self.bad.values())

    @property
    def shard_errors(self) -> int:
        return sum(self.shards_bad.values())

    def summary(self) -> str:
        """One line for logs: samples used, the skipped ones per reason, and the shards that failed per reason."""
        skipped = ", ".join(f"{reason}: {n}" for reason, n in sorted(self.bad.items())) or "none"
        shards = ", ".join(f"{reason}: {n}" for reason, n in sorted(self.shards_bad.items()))
        errors = f"; bad shards {self.shard_errors} ({shards})" if self.shard_errors else ""
        return f"{self.good} samples read; skipped {self.bad_total} ({skipped}){errors}"

    def count(self, reason: str, message: str, shard: bool = False) -> None:
        """Count one skipped sample (or failed shard read) under `reason` and log it (rate-limited)."""
        table = self.shards_bad if shard else self.bad
        table[reason] = table.get(reason, 0) + 1
        if shard:  # every failed shard is named (its first failures; then every 1000th)
            _log_rate_limited(table[reason], message[:300])
        else:
            _log_rate_limited(self.bad_total, message[:300])
        now = time.monotonic()
        if now - self.last_summary >= SUMMARY_EVERY_S:
            self.last_summary = now
            log.warning("data reader (%s): %s", self.where, self.summary())

    def failed(self, what: str) -> None:
        self.failures_in_a_row += 1
        if self.good == 0 and self.failures_in_a_row >= MAX_FAILURES_BEFORE_FIRST_SAMPLE:
            raise RuntimeError(
                f"no usable sample after {self.failures_in_a_row} failures reading {self.where} "
                f"(last: {what}); check the shard paths, image format and caption field"
            )


def _log_rate_limited(count: int, message: str) -> None:
    if count <= 10 or count % 1000 == 0:
        log.warning("%s (occurrence %d%s)", message, count, "; further ones logged every 1000th" if count == 10 else "")


def shard_failure_reason(exn: BaseException) -> str:
    """`unreadable shard` for I/O errors (cannot open or read the file), else `truncated or corrupt tar`."""
    return UNREADABLE_SHARD if isinstance(exn, OSError) else CORRUPT_TAR


@dataclass
class _ReadShards:
    """{"url"} dicts -> raw samples, one shard at a time through webdataset's tar reader.

    A shard that fails (cannot be opened, truncated, corrupt) keeps the samples read before the failure and is
    counted once per read, under the reason of its first error, and named in a warning (webdataset may report
    one truncation twice: at the member and at the next header; its own warn_and_continue also sleeps 0.5 s).
    """

    stats: ReaderStats

    def __call__(self, src: Iterable[dict]) -> Iterator[dict]:
        for shard in src:
            url = shard["url"]
            errors: list[BaseException] = []

            def handler(exn: BaseException) -> bool:
                errors.append(exn)
                return True

            source = dict(shard)  # webdataset's opener adds the open "stream" to it
            try:
                yield from wds.tarfile_samples([source], handler=handler)
            finally:
                stream = source.get("stream")
                if stream is not None:  # closed now, not whenever the garbage collector gets to it
                    stream.close()
            if errors:
                exn = errors[0]
                reason = shard_failure_reason(exn)
                self.stats.count(reason, f"skipping shard {url}: {reason} ({type(exn).__name__}: {exn})", shard=True)
                self.stats.failed(f"{reason} {url}")


@dataclass
class _SeededShuffle:
    bufsize: int
    seed: _StreamSeed

    def __call__(self, src: Iterable[dict]) -> Iterator[dict]:
        initial = min(self.bufsize, 100)
        return wds.shuffle(self.bufsize, initial=initial, seed=self.seed())(src)


@dataclass
class _DecodeSamples:
    """Raw tar sample -> {"pixels", "caption", "key"}; bad samples are counted and dropped.

    Pixels are `resolution` x `resolution`, or `size` = (height, width) when given (an aspect-ratio bucket).
    """

    resolution: int
    caption_field: str
    stats: ReaderStats
    min_size: int = 0
    size: tuple[int, int] | None = None

    def _bad(self, reason: str, sample: dict, detail: str = "") -> None:
        where = f"{sample.get('__url__', '?')}:{sample.get('__key__', '?')}"
        self.stats.count(reason, f"skipping bad sample {where}: {reason} {detail}")
        self.stats.failed(f"{reason} at {where}")

    def __call__(self, src: Iterable[dict]) -> Iterator[dict]:
        for sample in src:
            try:
                caption = sample_caption(sample, self.caption_field)
            except Exception as exn:  # non-UTF-8 text, bad json
                self._bad(exn.reason if isinstance(exn, BadSample) else BAD_JSON, sample, repr(exn))
                continue
            if not caption:
                self._bad(NO_CAPTION, sample)
                continue
            try:
                if self.size is None:
                    img = sample_image(sample, self.resolution, self.min_size)
                    pixels = image_to_tensor(resize_center_crop(to_rgb(img), self.resolution))
                else:
                    height, width = self.size
                    img = sample_image(sample, (width, height), self.min_size)
                    pixels = image_to_tensor(resize_cover_crop(to_rgb(img), width, height))
            except Exception as exn:  # undecodable, truncated, decompression bomb, no image member, too small
                self._bad(exn.reason if isinstance(exn, BadSample) else BAD_IMAGE, sample, repr(exn))
                continue
            self.stats.good += 1
            self.stats.failures_in_a_row = 0
            yield {"pixels": pixels, "caption": caption, "key": sample["__key__"]}


def _collate(samples: list[dict]) -> dict[str, Any]:
    return {
        "pixels": torch.stack([s["pixels"] for s in samples]),
        "captions": [s["caption"] for s in samples],
        "keys": [s["key"] for s in samples],
    }


def make_image_text_pipeline(
    urls: str | Sequence[str],
    resolution: int,
    batch_size: int,
    seed: int = 0,
    rank: int = 0,
    resume_step: int = 0,
    shuffle_buffer: int = 1000,
    caption_field: str = "caption",
    min_size: int = 0,
    resampled: bool = True,
    world_size: int = 1,
    partial: bool = False,
) -> wds.DataPipeline:
    """The batched webdataset pipeline behind `make_image_text_loader` (its `.stats` counts skips).

    `resampled=False`: one pass over this rank's shards (`urls[rank::world_size]`, split across DataLoader
    workers) in the given order, then the stream ends (statistics, evaluation, tests); `partial` keeps a last,
    smaller batch.
    """
    urls = expand_urls(urls)
    stats = ReaderStats(where=urls[0] if len(urls) == 1 else f"{len(urls)} shards ({urls[0]}, ...)")
    if resampled:
        shards: list[Any] = [
            wds.ResampledShards(
                urls,
                seed=0,
                worker_seed=_StreamSeed(seed, rank, resume_step, "shards"),
                deterministic=True,  # otherwise webdataset mixes pid, time_ns and urandom into the seed
            )
        ]
    else:
        shards = [wds.SimpleShardList(urls[rank::world_size]), wds.split_by_worker]
    stages: list[Any] = [*shards, _ReadShards(stats)]
    if shuffle_buffer > 1:
        stages.append(_SeededShuffle(shuffle_buffer, _StreamSeed(seed, rank, resume_step, "shuffle")))
    stages.append(_DecodeSamples(resolution, caption_field, stats, min_size))
    stages.append(wds.batched(batch_size, collation_fn=_collate, partial=partial))
    pipeline = wds.DataPipeline(*stages)
    pipeline.stats = stats
    return pipeline


def reader_stats(loader) -> "ReaderStats | None":
    """The skip counters of a loader from this module or data.indexed, as seen by this process.

    Indexed loaders sum them over their workers; a streaming loader's counters are only visible with
    num_workers=0 (otherwise they live in the worker processes, which still log each skip).
    """
    stats = getattr(loader, "stats", None) or getattr(getattr(loader, "dataset", None), "stats", None)
    return stats if isinstance(stats, ReaderStats) else None


def check_loader_args(resolution: int, batch_size: int, num_workers: int, min_size: int = 0) -> None:
    if resolution < 1 or batch_size < 1 or num_workers < 0 or min_size < 0:
        raise ValueError(
            f"need resolution >= 1, batch_size >= 1, num_workers >= 0, min_size >= 0 "
            f"(got {resolution}, {batch_size}, {num_workers}, {min_size})"
        )


def make_image_text_loader(
    urls: str | Sequence[str],
    resolution: int,
    batch_size: int,
    num_workers: int = 0,
    seed: int = 0,
    rank: int = 0,
    world_size: int = 1,
    resume_step: int = 0,
    shuffle_buffer: int = 1000,
    caption_field: str = "caption",
    min_size: int = 0,
    resampled: bool = True,
) -> torch.utils.data.DataLoader:
    """Infinite DataLoader of {"pixels": (B, 3, R, R) float32 in [-1, 1], "captions": [str], "keys": [str]}.

    `urls` is anything `expand_urls` accepts. Shards are resampled with replacement, so every rank reads all
    shards and `world_size` is only checked; ranks, workers and resume steps differ through the seed.
    `min_size` > 0 skips images whose shorter side is below it (pixels). `resampled=False` reads this rank's
    shards once, in order, and ends (the last, smaller batch is kept).
    """
    check_loader_args(resolution, batch_size, num_workers, min_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world_size {world_size}")
    pipeline = make_image_text_pipeline(
        urls,
        resolution,
        batch_size,
        seed=seed,
        rank=rank,
        resume_step=resume_step,
        shuffle_buffer=shuffle_buffer,
        caption_field=caption_field,
        min_size=min_size,
        resampled=resampled,
        world_size=world_size,
        partial=not resampled,
    )
    return torch.utils.data.DataLoader(
        pipeline,
        batch_size=None,  # the pipeline batches
        num_workers=num_workers,
        persistent_workers=num_workers > 0,
        generator=torch.Generator().manual_seed(seed),  # leave torch's global RNG alone (see data/indexed.py)
    )
