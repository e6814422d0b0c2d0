"""Captions of a caption set, without reading any image: from img2dataset-layout tar shards and caption files."""

from __future__ import annotations

import json
import logging
import os
import tarfile
from collections import Counter
from typing import Any, Iterator

from ..decode import sample_caption
from ..remote import ShardCache, is_indexable_remote
from ..tars import split_key_ext, walk_tar

__all__ = ["iter_shard_captions", "iter_caption_file"]

log = logging.getLogger(__package__)  # the package's name, as the warnings of `python -m data.prep.concepts` print it

_CAPTION_MEMBERS = ("txt", "json")


def _is_caption_member(name: str) -> bool:
    key_ext = split_key_ext(name)
    return key_ext is not None and key_ext[1] in _CAPTION_MEMBERS


def iter_shard_captions(url: str, caption_field: str = "caption", skipped: Counter | None = None,
                        keep_missing: bool = False, cache: ShardCache | None = None) -> Iterator[str]:
    """Captions of the samples in one img2dataset-layout tar shard, in order, without reading any image.
    `keep_missing=True` yields "" for a sample without a usable caption, so the captions line up with the samples.
    A shard on object storage is read from its copy in `cache` (default `ShardCache()`), downloaded there first and
    checked as the training reader's is; a store that does not answer raises `StoreUnreachable`.

    A sample's caption is its `key.txt`, else `key.json[caption_field]` (`data.decode.sample_caption`). Samples
    without a caption, with an undecodable json, and shards that cannot be read (to the end) are counted in
    `skipped` ("no caption", "bad caption", "unreadable shard") and logged; what was read before an error is kept.
    """
    skipped = Counter() if skipped is None else skipped
    current_key: str | None = None
    sample: dict[str, Any] = {}

    def flush() -> Iterator[str]:
        if current_key is None:
            return
        try:
            caption = sample_caption(sample, caption_field)
        except (ValueError, UnicodeDecodeError, AttributeError):
            skipped["bad caption"] += 1
            caption = None
        else:
            if not caption:
                skipped["no caption"] += 1
        if caption:
            yield caption
        elif keep_missing:
            yield ""

    fd = None
    try:
        path = url
        if is_indexable_remote(url):  # through the descriptor: another process's eviction cannot take the copy
            store = cache or ShardCache()
            fd = store.open(url, store.stat(url))
            path = f"/dev/fd/{fd}"
        for name, data in walk_tar(path, _is_caption_member):
            key_ext = split_key_ext(name)
            if key_ext is None:  # webdataset's own members (__index__, ...) belong to no sample
                continue
            key, ext = key_ext
            if key != current_key:
                yield from flush()
                current_key, sample = key, {}
            if data is not None:
                sample[ext] = data
        yield from flush()
    except (OSError, tarfile.TarError, EOFError, ValueError) as exn:
        skipped["unreadable shard"] += 1
        log.warning("skipping the rest of unreadable shard %s: %r", url, exn)
    finally:
        if fd is not None:
            os.close(fd)


_JSON_TEXT_FIELDS = ("caption", "text", "prompt")


def iter_caption_file(path: str, caption_field: str = "caption", skipped: Counter | None = None) -> Iterator[str]:
    """Captions in a file: `.jsonl`/`.ndjson` (one JSON string or object per line), `.json` (a list of strings or
    objects), anything else one caption per line. Objects give `caption_field`, else "caption", "text" or "prompt"
    (so a benchmark prompts.json reads too). Empty and undecodable entries are counted in `skipped`."""
    skipped = Counter() if skipped is None else skipped
    fields = (caption_field,) + tuple(f for f in _JSON_TEXT_FIELDS if f != caption_field)

    def text_of(item: Any) -> str | None:
        if isinstance(item, str):
            return item.strip()
        if isinstance(item, dict):
            for name in fields:
                value = item.get(name)
                if isinstance(value, str):
                    return value.strip()
        return None

    lower = path.lower()
    if lower.endswith(".json"):
        with open(path, encoding="utf-8") as f:
            try:
                items = json.load(f)
            except ValueError as exn:
                raise ValueError(f"{path}: not a JSON list of captions ({exn}); use .jsonl for one per line") from None
        if not isinstance(items, list):
            raise ValueError(f"{path}: expected a JSON list of captions or objects, got {type(items).__name__}")
        for item in items:
            text = text_of(item)
            if text:
                yield text
            else:
                skipped["no caption"] += 1
        return
    is_jsonl = lower.endswith((".jsonl", ".ndjson"))
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            if is_jsonl:
                try:
                    text = text_of(json.loads(line))
                except ValueError:
                    skipped["bad caption"] += 1
                    continue
                if not text:
                    skipped["no caption"] += 1
                    continue
                yield text
            else:
                yield line
