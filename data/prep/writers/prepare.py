"""Preparing one record: read its image and caption, check them, never re-encode; in order over a process pool.

Every image is fully decoded once, so the training readers will not meet it as undecodable or truncated; the bytes
written are the original ones, under the extension of their real format.
"""

from __future__ import annotations

import io
import itertools
import json
import logging
import warnings
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

from PIL import Image

from .records import (
    BAD_IMAGE,
    NO_CAPTION,
    NO_IMAGE,
    NOT_UTF8,
    TOO_SMALL,
    UNREADABLE,
    UNSUPPORTED,
    ZERO_BYTES,
    Record,
    SkipSample,
)

__all__ = ["FORMAT_EXT", "PrepareOptions", "prepare_record", "ordered_parallel"]

log = logging.getLogger(__package__)  # the package's name, as the warnings of `python -m data.prep.writers` print it

FORMAT_EXT = {"JPEG": "jpg", "MPO": "jpg", "PNG": "png", "WEBP": "webp"}  # MPO: multi-picture JPEG from cameras
_RESERVED = ("key", "caption", "source", "width", "height")


@dataclass(frozen=True)
class PrepareOptions:
    """What `prepare_record` accepts: images whose shorter side is >= min_size, uncaptioned ones if asked."""

    min_size: int = 0
    keep_uncaptioned: bool = False


def _text(data: str | bytes, what: str) -> str:
    if isinstance(data, str):
        return data
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exn:
        raise SkipSample(NOT_UTF8, f"{what}: {exn}") from None


def _caption(record: Record) -> str:
    if record.caption_path is not None:
        try:
            with open(record.caption_path, "rb") as f:
                return _text(f.read(), record.caption_path).strip()
        except FileNotFoundError:
            return ""
        except OSError as exn:
            raise SkipSample(UNREADABLE, f"{record.caption_path}: {exn}") from None
    value = record.caption
    if value is None or (isinstance(value, float) and value != value):  # None or NaN (pandas-written tables)
        return ""
    return _text(value if isinstance(value, (str, bytes)) else str(value), "caption").strip()


def _check_image(data: bytes, min_size: int) -> tuple[str, int, int]:
    """(extension, width, height) of image bytes that every reader can decode; raises SkipSample otherwise."""
    if len(data) == 0:
        raise SkipSample(ZERO_BYTES)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as img:
                ext = FORMAT_EXT.get(img.format or "")
                if ext is None:
                    raise SkipSample(UNSUPPORTED, str(img.format))
                width, height = img.size
                if min_size and min(width, height) < min_size:
                    raise SkipSample(TOO_SMALL, f"{width}x{height} < {min_size}")
                img.load()  # the whole image: truncated or corrupt data fails here, not in training
    except SkipSample:
        raise
    except Exception as exn:  # undecodable, truncated, decompression bomb
        raise SkipSample(BAD_IMAGE, f"{type(exn).__name__}: {exn}") from None
    return ext, width, height


def _prepare_many(jobs: list[tuple[Record, PrepareOptions]]) -> list[tuple[dict[str, Any] | None, str, str]]:
    return [prepare_record(job) for job in jobs]


def ordered_parallel(pool, jobs: Iterable, window: int, chunk: int = 8) -> Iterator:
    """`prepare_record` over `jobs` in a process pool, results in input order, at most `window` chunks in flight
    (Pool.imap would read the whole input ahead: all image bytes of a big table in memory)."""
    jobs = iter(jobs)
    pending: deque = deque()

    def submit() -> bool:
        batch = list(itertools.islice(jobs, chunk))
        if batch:
            pending.append(pool.apply_async(_prepare_many, (batch,)))
        return bool(batch)

    for _ in range(window):
        if not submit():
            break
    while pending:
        results = pending.popleft().get()
        submit()
        yield from results


def prepare_record(args: tuple[Record, PrepareOptions]) -> tuple[dict[str, Any] | None, str, str]:
    """(sample without its key, or None; skip reason; detail) for one record."""
    record, options = args
    try:
        if record.skip is not None:
            raise SkipSample(record.skip)
        caption = _caption(record)
        if not caption and not options.keep_uncaptioned:
            raise SkipSample(NO_CAPTION)
        if record.data is not None:
            data = record.data
        elif record.path is not None:
            try:
                with open(record.path, "rb") as f:
                    data = f.read()
            except OSError as exn:
                raise SkipSample(UNREADABLE, f"{type(exn).__name__}: {exn}") from None
        else:
            raise SkipSample(NO_IMAGE)
        ext, width, height = _check_image(data, options.min_size)
        extras = dict(record.extras)
        if record.extras_path is not None:
            try:
                with open(record.extras_path, "rb") as f:
                    loaded = json.loads(_text(f.read(), record.extras_path))
                if isinstance(loaded, dict):
                    extras.update(loaded)
            except (OSError, ValueError) as exn:  # a broken sidecar loses its extras, not the sample
                log.warning("ignoring sidecar %s: %s", record.extras_path, exn)
    except SkipSample as skip:
        return None, skip.reason, f"{record.source}: {skip}"
    meta = {"caption": caption, "source": record.source, "width": width, "height": height}
    meta.update({k: v for k, v in extras.items() if k not in _RESERVED})
    return {"image": (ext, data), "caption": caption, "meta": meta}, "", ""
