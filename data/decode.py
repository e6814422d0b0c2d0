"""Raw tar samples ({ext: bytes, "__key__", "__url__"}) -> training samples (pixels, caption, key) and batches.

Shared by the streaming and the indexed reader (and the precompute job), so every path decodes, resizes and
skips alike; bad samples are counted with the reasons of `data.skips`.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch
from PIL import Image

from .images import IMAGE_EXTENSIONS, image_to_tensor, resize_center_crop, resize_cover_crop, to_rgb
from .skips import (
    BAD_IMAGE, BAD_JSON, NO_CAPTION, NO_IMAGE, NOT_UTF8, TOO_SMALL, ZERO_BYTES, BadSample, ReaderStats,
)

__all__ = ["sample_caption", "sample_image", "DecodeSamples", "collate"]


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
    """Decode the first image member (jpg, jpeg, png, webp) of a raw sample; raises if undecodable.

    `resolution` (a square side, or a (width, height) the image must still cover) lets JPEGs decode downscaled.
    A sample without such a member raises `BadSample("missing image")`, an empty member `BadSample("zero-byte
    member")`, an image whose shorter side is below `min_size` (read from the header, before decoding)
    `BadSample("image too small")`.
    """
    for ext in IMAGE_EXTENSIONS:
        data = sample.get(ext)
        if data is not None:
            break
    else:
        members = sorted(k for k in sample if not k.startswith("__"))
        raise BadSample(NO_IMAGE, f"no {'/'.join(IMAGE_EXTENSIONS)} member, the sample has {members}")
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


@dataclass
class DecodeSamples:
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
            except Exception as exn:  # undecodable, truncated, decompression bomb (BadSample: none, empty, too small)
                self._bad(exn.reason if isinstance(exn, BadSample) else BAD_IMAGE, sample, repr(exn))
                continue
            self.stats.good += 1
            self.stats.failures_in_a_row = 0
            yield {"pixels": pixels, "caption": caption, "key": sample["__key__"]}


def collate(samples: list[dict]) -> dict[str, Any]:
    """Decoded samples -> {"pixels": (B, 3, H, W), "captions": [str], "keys": [str]}."""
    return {
        "pixels": torch.stack([s["pixels"] for s in samples]),
        "captions": [s["caption"] for s in samples],
        "keys": [s["key"] for s in samples],
    }
