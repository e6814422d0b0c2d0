"""Writing shards: prepared samples in input order into `{prefix}-000000.tar`, ..., a summary, then the index.

Each shard is written under a temporary name and renamed when complete; see the package docstring for the
layout, the skip policy and the guarantees (atomic shards, refusal to overwrite, deterministic output).
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable

import webdataset as wds

from ...files import atomic_write
from .prepare import PrepareOptions, ordered_parallel, prepare_record
from .records import IMAGE_SUFFIXES, Record, folder_listing, table_records

__all__ = ["SHARD_NAME", "WriteSummary", "write_shards", "write_folder", "write_table"]

log = logging.getLogger(__package__)  # the package's name, as the warnings of `python -m data.prep.writers` print it

SHARD_NAME = "{prefix}-{index:06d}.tar"


@dataclass
class WriteSummary:
    out_dir: str
    shards: list[str] = field(default_factory=list)
    written: int = 0
    skipped: Counter = field(default_factory=Counter)  # reason -> count
    index: str | None = None  # the JSON of the shard index (None: not built, or kept in memory)
    ignored: list[str] = field(default_factory=list)  # files of a folder that are no input: not images nor captions

    def line(self) -> str:
        """One line: what was written, every input not written by reason, and the files that were no input."""
        skipped = sum(self.skipped.values())
        reasons = ", ".join(f"{r}: {n}" for r, n in sorted(self.skipped.items()))
        ignored = ""
        if self.ignored:
            shown = ", ".join(self.ignored[:3]) + (", ..." if len(self.ignored) > 3 else "")
            files = "1 file that is" if len(self.ignored) == 1 else f"{len(self.ignored)} files that are"
            ignored = f"; ignored {files} neither an image nor a caption ({shown})"
        return (f"wrote {self.written} samples in {len(self.shards)} shards to {self.out_dir}; skipped {skipped}"
                + (f" ({reasons})" if reasons else "") + ignored)


class _ShardSink:
    """Samples in, complete shards out: each shard is written under a temporary name and renamed when full."""

    def __init__(self, out_dir: str, prefix: str, samples_per_shard: int):
        self.out_dir, self.prefix, self.samples_per_shard = out_dir, prefix, samples_per_shard
        self.paths: list[str] = []
        self._tmp: str | None = None
        self._file = None
        self._writer = None
        self._count = 0

    def _open(self) -> None:
        path = os.path.join(self.out_dir, SHARD_NAME.format(prefix=self.prefix, index=len(self.paths)))
        self._tmp = f"{path}.tmp{os.getpid()}"
        self._file = open(self._tmp, "wb")
        self._writer = wds.TarWriter(self._file, encoder=False, compress=False, mtime=0)  # reproducible tars
        self._final = path
        self._count = 0

    def write(self, sample: dict[str, bytes]) -> None:
        if self._writer is None:
            self._open()
        self._writer.write(sample)
        self._count += 1
        if self._count == self.samples_per_shard:
            self.finish()

    def finish(self) -> None:
        """Close and rename the open shard, if any."""
        if self._writer is None:
            return
        self._writer.close()
        self._file.close()
        os.replace(self._tmp, self._final)
        self.paths.append(self._final)
        self._writer = self._file = self._tmp = None

    def abort(self) -> None:
        """Drop the open shard (its temporary file); the completed ones stay."""
        try:
            if self._writer is not None:
                self._writer.close()
            if self._file is not None:
                self._file.close()
        except Exception:  # the write failure that brought us here may repeat; the file is removed anyway
            pass
        finally:
            if self._tmp is not None and os.path.exists(self._tmp):
                os.remove(self._tmp)
            self._writer = self._file = self._tmp = None


def _existing_shards(out_dir: str, prefix: str) -> list[str]:
    pattern = re.compile(re.escape(prefix) + r"-\d{6,}\.tar$")
    return sorted(p for p in glob.glob(os.path.join(glob.escape(out_dir), f"{glob.escape(prefix)}-*.tar"))
                  if pattern.search(os.path.basename(p)))


def write_shards(
    records: Iterable[Record],
    out_dir: str | os.PathLike,
    samples_per_shard: int = 1000,
    prefix: str = "shard",
    workers: int = 1,
    min_size: int = 0,
    keep_uncaptioned: bool = False,
    overwrite: bool = False,
    build_index: bool = True,
    progress: bool = True,
    total: int | None = None,
    desc: str = "writing shards",
    ignored: Iterable[str] = (),
) -> WriteSummary:
    """Write `records` as img2dataset-layout shards into `out_dir` (see the module docstring); return the summary.
    `ignored`: files beside the inputs that are none (a folder's notes), named in the summary."""
    if samples_per_shard < 1 or workers < 1 or min_size < 0:
        raise ValueError(f"need samples_per_shard >= 1, workers >= 1, min_size >= 0 "
                         f"(got {samples_per_shard}, {workers}, {min_size})")
    if not prefix or "/" in prefix or os.sep in prefix:
        raise ValueError(f"prefix must be a plain file-name part, got {prefix!r}")
    out_dir = os.path.abspath(os.path.expanduser(os.fspath(out_dir)))
    os.makedirs(out_dir, exist_ok=True)
    existing = _existing_shards(out_dir, prefix)
    if existing and not overwrite:
        raise FileExistsError(f"{out_dir} already holds {len(existing)} '{prefix}-*.tar' shards: pass --overwrite "
                              f"to replace them, or choose another --prefix or folder")
    summary = WriteSummary(out_dir=out_dir, ignored=list(ignored))
    options = PrepareOptions(min_size=min_size, keep_uncaptioned=keep_uncaptioned)
    jobs = ((record, options) for record in records)
    sink = _ShardSink(out_dir, prefix, samples_per_shard)

    from tqdm.auto import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    bar = tqdm(total=total, desc=desc, unit="img", disable=not progress, dynamic_ncols=True)
    pool = None
    quiet = contextlib.ExitStack()
    if progress:  # warnings print above the bar instead of through it
        quiet.enter_context(logging_redirect_tqdm())
    try:
        if workers > 1:
            import multiprocessing

            pool = multiprocessing.get_context().Pool(workers)
            results: Iterable = ordered_parallel(pool, jobs, window=4 * workers)  # input order, any workers
        else:
            results = map(prepare_record, jobs)
        for prepared, reason, detail in results:
            bar.update(1)
            if prepared is None:
                summary.skipped[reason] += 1
                n = summary.skipped[reason]
                if n <= 5 or n % 1000 == 0:
                    log.warning("skipping %s (%s occurrence %d)", detail[:300], reason, n)
                bar.set_postfix(written=summary.written, skipped=sum(summary.skipped.values()), refresh=False)
                continue
            key = f"{summary.written:09d}"
            ext, data = prepared["image"]
            meta = {"key": key, **prepared["meta"]}
            sink.write({
                "__key__": key,
                ext: data,
                "txt": prepared["caption"].encode("utf-8"),
                "json": json.dumps(meta, ensure_ascii=False, sort_keys=False).encode("utf-8"),
            })
            summary.written += 1
        sink.finish()
        if pool is not None:
            # every result is in: let the workers exit on their own. terminate() on idle workers can kill one while
            # it holds the task queue's lock, and join() then waits forever for another blocked on that lock.
            pool.close()
            pool.join()
            pool = None
    except BaseException:
        sink.abort()
        raise
    finally:
        bar.close()
        quiet.close()
        if pool is not None:  # an error: stop the workers now
            pool.terminate()
            pool.join()
    summary.shards = sink.paths
    if summary.written == 0:  # nothing new was written: an earlier set (--overwrite) stays as it was
        reasons = ", ".join(f"{r}: {n}" for r, n in sorted(summary.skipped.items())) or "no input"
        raise ValueError(f"no sample written ({reasons}); check the captions and images")
    for stale in _existing_shards(out_dir, prefix):  # --overwrite: shards of an earlier, larger set
        if stale not in summary.shards:
            os.remove(stale)
    report = {"written": summary.written, "skipped": dict(sorted(summary.skipped.items())),
              "ignored": summary.ignored, "samples_per_shard": samples_per_shard,
              "shards": [os.path.basename(p) for p in summary.shards]}
    summary_path = os.path.join(out_dir, f"{prefix}-summary.json")
    atomic_write(summary_path, (json.dumps(report, indent=1) + "\n").encode("utf-8"))
    if build_index:
        from ...index import load_or_build_index

        summary.index = load_or_build_index(summary.shards).path
    return summary


def write_folder(src_dir: str | os.PathLike, out_dir: str | os.PathLike, **kwargs: Any) -> WriteSummary:
    """Shards from a folder of images with sidecar .txt captions; keyword arguments as `write_shards`."""
    listing = folder_listing(src_dir)
    if not any(record.skip is None for record in listing.records):
        raise FileNotFoundError(f"no images ({', '.join(IMAGE_SUFFIXES)}) below {os.fspath(src_dir)!r}")
    kwargs.setdefault("desc", f"{os.path.basename(os.path.abspath(src_dir))} -> shards")
    return write_shards(listing.records, out_dir, total=len(listing.records), ignored=listing.ignored, **kwargs)


def write_table(
    table: str | os.PathLike,
    out_dir: str | os.PathLike,
    image_column: str = "image",
    caption_column: str = "caption",
    fmt: str = "auto",
    **kwargs: Any,
) -> WriteSummary:
    """Shards from a JSONL/CSV/TSV/parquet table; keyword arguments as `write_shards`."""
    records, total = table_records(table, image_column, caption_column, fmt)
    kwargs.setdefault("desc", f"{os.path.basename(os.fspath(table))} -> shards")
    return write_shards(records, out_dir, total=total, **kwargs)
