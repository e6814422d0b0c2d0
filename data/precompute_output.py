"""The precompute output folder: which output shard each input shard becomes, the per-shard records that mark a
shard complete, leftovers of interrupted runs, refusing features of other settings, and the manifest.

Each input shard `.../NAME.tar` becomes `OUT_DIR/NAME.tar` (`ShardOutput`: written as `NAME.tar.tmp-<pid>` and
renamed when complete); then its record `NAME.tar.precompute.json` (settings, sample and skip counts, byte size)
is written atomically too. A shard counts as complete only when both exist, the record's settings equal this run's
and the byte size matches (`is_complete`). `write_manifest` writes `OUT_DIR/precompute.json` (the format of
`data.precomputed`) once every shard is complete and the null text exists.
"""

from __future__ import annotations

import collections
import glob
import logging
import os
import re
from typing import Any, Sequence

import numpy as np
import webdataset as wds

from .files import read_json_object, write_json
from .files import atomic_write
from .precompute_settings import PrecomputeSettings
from .precomputed import (
    FORMAT_KIND,
    MANIFEST_NAME,
    NULL_TEXT_NAME,
    READABLE_VERSIONS,
    format_version,
    npy_bytes,
    null_text_dtype,
)
from .text_states import encode_states

__all__ = [
    "RECORD_SUFFIX",
    "plan_outputs",
    "record_path",
    "read_record",
    "write_record",
    "write_null_text",
    "is_complete",
    "remove_leftovers",
    "check_existing",
    "ShardOutput",
    "write_manifest",
]

log = logging.getLogger(__name__)

RECORD_SUFFIX = ".precompute.json"  # NAME.tar -> NAME.tar.precompute.json
_TAR_NAME = re.compile(r"([^/\s'\"]+\.tar)(?![^/\s'\"])")


def _output_name(url: str) -> str:
    """NAME.tar of an input shard spec (a path, a URL, or a pipe: command naming a .tar)."""
    names = _TAR_NAME.findall(url)
    if not names:
        raise ValueError(f"cannot tell the shard name of {url!r}: input shards must be named *.tar")
    return names[-1]


def record_path(out_dir: str, name: str) -> str:
    """Where the record of output shard `name` lies."""
    return os.path.join(out_dir, name + RECORD_SUFFIX)


def read_record(out_dir: str, name: str) -> dict | None:
    """The record of output shard `name`; None when missing, unreadable or of another format version."""
    record = read_json_object(record_path(out_dir, name))
    if record is None or record.get("__kind__") != FORMAT_KIND or record.get("version") not in READABLE_VERSIONS:
        return None
    return record


def write_record(out_dir: str, name: str, source: str, settings: PrecomputeSettings, info: dict[str, Any],
                 samples: int, bad: dict[str, int], shards_bad: dict[str, int], nbytes: int) -> None:
    """The record that marks output shard `name` (committed, `nbytes` long) complete; `info` holds the latent and
    text shapes (latent_channels, latent_size, vae_downsample, vae_scaling_factor, vae_shift_factor,
    text_hidden_size)."""
    write_json(record_path(out_dir, name), {
        "__kind__": FORMAT_KIND, "version": format_version(settings.text_dtype), "settings": settings.as_dict(),
        "info": info, "name": name, "source": source, "samples": samples, "bad": dict(sorted(bad.items())),
        "shards_bad": shards_bad, "bytes": nbytes,
    })


def write_null_text(out_dir: str, states: Any, text_dtype: str) -> None:
    """`null_text.npy`: the empty caption's T5 states (n, D), stored as `null_text_dtype(text_dtype)`."""
    values, _ = encode_states(states, null_text_dtype(text_dtype))
    atomic_write(os.path.join(out_dir, NULL_TEXT_NAME), npy_bytes(values))


def is_complete(out_dir: str, name: str, settings: PrecomputeSettings) -> bool:
    """True when output shard `name` and its record exist, the record holds `settings` and the shard's size."""
    record = read_record(out_dir, name)
    path = os.path.join(out_dir, name)
    return (
        record is not None
        and record.get("settings") == settings.as_dict()
        and os.path.isfile(path)
        and os.path.getsize(path) == record.get("bytes")
    )


def remove_leftovers(out_dir: str, name: str) -> None:
    """Temporary files of an interrupted earlier write of shard `name` (no other process writes this shard)."""
    for pattern in (f"{name}.tmp-*", f"{name}{RECORD_SUFFIX}.tmp-*"):
        for path in glob.glob(os.path.join(glob.escape(out_dir), pattern)):
            log.info("removing the leftover %s of an interrupted run", path)
            try:
                os.remove(path)
            except FileNotFoundError:
                pass


def plan_outputs(urls: Sequence[str], out_dir: str) -> list[tuple[str, str]]:
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


def _differences(stored: dict[str, Any], wanted: dict[str, Any]) -> list[str]:
    return [f"{k} {stored.get(k)!r} there vs {v!r} now" for k, v in wanted.items() if stored.get(k) != v]


def check_existing(out_dir: str, plan: Sequence[tuple[str, str]], settings: PrecomputeSettings) -> None:
    """Refuse an output folder holding features made with other settings (identically on every rank)."""
    wanted = settings.as_dict()
    found = [read_json_object(os.path.join(out_dir, MANIFEST_NAME))]
    found += [read_record(out_dir, name) for _, name in plan]
    for stored in found:
        if stored is None:
            continue
        stored_settings = stored.get("settings", stored)
        diff = _differences(stored_settings, wanted)
        if diff:
            raise ValueError(f"{out_dir} holds features precomputed with other settings ({'; '.join(diff)}): "
                             f"precompute into another folder, or delete it to start over")


class ShardOutput:
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


def write_manifest(out_dir: str | os.PathLike, urls: Sequence[str], settings: PrecomputeSettings) -> str | None:
    """Write `out_dir/precompute.json` if the output shard of every input shard in `urls` (expanded URLs, in
    order: what `expand_urls` gives) is complete and the null text exists.

    Returns the manifest path, or None when some shard is not complete yet. `data.precompute.precompute_shards` calls it
    at its end; safe to call from several processes at once (identical atomic writes).
    """
    out_dir = os.path.abspath(os.path.expanduser(os.fspath(out_dir)))
    plan = plan_outputs(list(urls), out_dir)
    if not os.path.isfile(os.path.join(out_dir, NULL_TEXT_NAME)):
        return None
    records = []
    for _, name in plan:
        if not is_complete(out_dir, name, settings):
            return None
        records.append(read_record(out_dir, name))
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
        "version": format_version(settings.text_dtype),
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
    write_json(path, manifest)
    return path
