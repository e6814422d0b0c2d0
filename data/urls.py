"""Shard specs: brace patterns, globs, folders, files and remote URLs, expanded into the list of shards they name."""

from __future__ import annotations

import glob
import os
import re
from typing import Sequence

import braceexpand

from .tars import INDEXABLE_PREFIXES, REMOTE_PREFIXES

__all__ = ["is_remote", "is_pipe", "expand_urls"]

_GLOB_CHARS = re.compile(r"[*?\[]")


def _remote_glob(url: str, spec: str) -> list[str]:
    from .remote import glob

    found = glob(url)
    if not found:
        raise FileNotFoundError(f"no shards found for {spec!r} on the store")
    return found


def is_remote(spec: str) -> bool:
    """True for specs webdataset streams (pipe:, http(s)://, s3://, gs://) rather than local files."""
    return spec.startswith(REMOTE_PREFIXES)


def is_pipe(spec: str) -> bool:
    """True for a remote spec that is neither s3://, gs:// nor http(s):// (a `pipe:` command): it can only be
    streamed, never indexed or cached."""
    return is_remote(spec) and not spec.startswith(INDEXABLE_PREFIXES)


def expand_urls(spec: str | os.PathLike | Sequence[str | os.PathLike]) -> list[str]:
    """Expand a shard spec (or a list of them) into a list of shard URLs/paths, in order.

    Each spec may be a brace pattern (`shards/part-{000000..000009}.tar`), a glob (`shards/*.tar`), a directory
    (all `*.tar` directly in it, sorted), a plain file, or a remote spec (`pipe:...`, `http(s)://`, `s3://`,
    `gs://`), which is brace-expanded and, for a glob on s3:// or gs://, listed by the store; otherwise passed
    through unchecked. Local specs must match: a spec that matches nothing, or a brace pattern naming missing files,
    raises FileNotFoundError.
    """
    specs = [spec] if isinstance(spec, (str, os.PathLike)) else list(spec)
    if not specs:
        raise FileNotFoundError("no shards given: pass a shard path, directory, glob or brace pattern")
    urls: list[str] = []
    for item in specs:
        item = os.fspath(item)
        if is_remote(item):
            for url in braceexpand.braceexpand(item):
                urls.extend(_remote_glob(url, item) if _GLOB_CHARS.search(url.split("://", 1)[-1]) and
                            url.startswith(INDEXABLE_PREFIXES) else [url])
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
