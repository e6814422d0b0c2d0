"""Write img2dataset-layout tar shards from a folder of captioned images or from a table, ready to train on.

    python -m data.writers folder SRC_DIR OUT_DIR [--samples-per-shard 1000] [--prefix shard] [--workers 4]
    python -m data.writers table TABLE OUT_DIR [--image-column image] [--caption-column caption] [...]

Output: `OUT_DIR/{prefix}-000000.tar`, ... Each sample `{key}` (a zero-padded running number, unique in the set)
holds `{key}.jpg|png|webp` (the original bytes, never re-encoded; the extension follows the bytes' real format),
`{key}.txt` (the caption, UTF-8) and `{key}.json` ({"key", "caption", "source", "width", "height"} plus extras:
the other columns of a table row, or the fields of a folder image's sidecar `.json`). Then the index of indexed
mode is built (`data.indexed.load_or_build_index`, as `data.shards=OUT_DIR` will look for it), and
`{prefix}-summary.json` records what was written and skipped.

Inputs.
  folder  images *.jpg|jpeg|png|webp anywhere below SRC_DIR (sorted by relative path, so the same folder gives
          the same shards), each captioned by the `.txt` file with the same stem next to it (`a/cat.jpg` ->
          `a/cat.txt`); an optional `a/cat.json` object adds extra fields.
  table   JSONL (.jsonl/.ndjson), CSV (.csv, .tsv) or parquet (.parquet, needs pyarrow) rows. The image column
          holds a path (relative to the table's folder, or absolute), image bytes (parquet binary), a
          {"bytes", "path"} struct (the Hugging Face datasets layout) or a `data:image/...;base64,...` URI (bytes in
          JSONL/CSV); the caption column holds the caption; every other column is copied into key.json.

Bad inputs are skipped and counted per reason, never fatal: unreadable file, zero-byte image, bad image (every
image is fully decoded once, so the readers will not meet it as undecodable or truncated), unsupported image
format (not JPEG/PNG/WebP), image too small (`--min-size`), missing or empty caption, non-UTF-8 text, missing
image (an empty image cell), unreadable row (a JSONL line that is not a JSON object). Images without
a caption are skipped unless `--keep-uncaptioned`, which writes them with an empty caption (to caption them later;
the training readers skip empty captions). Failures to write the output (disk full, permissions) are fatal.

Atomicity: each shard is written as `{name}.tmp<pid>` and renamed when complete, so an interrupted run never leaves
a partial tar under a final name (a killed run may leave a `.tmp` file, which no reader picks up). An existing set
with the same prefix is refused unless `--overwrite`, which replaces it and removes its shards beyond the new count.
Output is deterministic: the same input and options give byte-identical shards, whatever `--workers` is.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import contextlib
import csv
import glob
import io
import itertools
import json
import logging
import os
import re
import sys
import warnings
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Sequence

import webdataset as wds
from PIL import Image

__all__ = [
    "IMAGE_SUFFIXES",
    "WriteSummary",
    "folder_records",
    "table_records",
    "write_shards",
    "write_folder",
    "write_table",
    "main",
]

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp")
FORMAT_EXT = {"JPEG": "jpg", "MPO": "jpg", "PNG": "png", "WEBP": "webp"}  # MPO: multi-picture JPEG from cameras
TABLE_FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".csv": "csv", ".tsv": "tsv", ".parquet": "parquet",
                 ".pq": "parquet"}
SHARD_NAME = "{prefix}-{index:06d}.tar"
_RESERVED = ("key", "caption", "source", "width", "height")
_DATA_URI = re.compile(r"^data:image/[A-Za-z0-9.+-]+;base64,", re.ASCII)

# skip reasons
UNREADABLE = "unreadable file"
ZERO_BYTES = "zero-byte image"
BAD_IMAGE = "bad image"
UNSUPPORTED = "unsupported image format"
TOO_SMALL = "image too small"
NO_CAPTION = "missing or empty caption"
NOT_UTF8 = "non-UTF-8 text"
NO_IMAGE = "missing image"
BAD_ROW = "unreadable row"  # a JSONL line that is not a JSON object

_BAD_ROW_KEY = "\0bad row"  # marks such a line among the rows


class _Skip(Exception):
    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


# --------------------------------------------------------------------------------------------------------------
# Records: what one sample will be made of (cheap to make; read and checked by `_prepare`, maybe in a worker)
# --------------------------------------------------------------------------------------------------------------


@dataclass
class Record:
    source: str  # relative path, absolute path or "table#row", for key.json and messages
    path: str | None = None  # image file to read ...
    data: bytes | None = None  # ... or its bytes
    caption: str | bytes | None = None  # the caption ...
    caption_path: str | None = None  # ... or a file holding it (read when the record is prepared)
    extras: dict[str, Any] = field(default_factory=dict)
    extras_path: str | None = None  # sidecar JSON object of extra fields (folder mode)
    skip: str | None = None  # already known to be bad: the reason


def folder_records(src_dir: str | os.PathLike) -> list[Record]:
    """Records of every image below `src_dir`, sorted by relative path (POSIX separators)."""
    src_dir = os.path.abspath(os.path.expanduser(os.fspath(src_dir)))
    if not os.path.isdir(src_dir):
        raise FileNotFoundError(f"source folder {src_dir!r} not found: give a folder of images with .txt captions")
    found = []
    for folder, dirs, files in os.walk(src_dir):
        dirs.sort()
        for name in files:
            if name.lower().endswith(IMAGE_SUFFIXES) and not name.startswith("."):
                found.append(os.path.relpath(os.path.join(folder, name), src_dir).replace(os.sep, "/"))
    records = []
    for rel in sorted(found):
        path = os.path.join(src_dir, rel)
        stem = os.path.splitext(path)[0]
        sidecar = stem + ".json"
        records.append(Record(source=rel, path=path, caption_path=stem + ".txt",
                              extras_path=sidecar if os.path.isfile(sidecar) else None))
    return records


def _table_format(path: str, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    ext = os.path.splitext(path)[1].lower()
    if ext not in TABLE_FORMATS:
        raise ValueError(f"cannot tell the format of {path!r} from its extension: pass --format "
                         f"jsonl|csv|tsv|parquet")
    return TABLE_FORMATS[ext]


def _read_rows(path: str, fmt: str) -> tuple[Iterator[dict[str, Any]], list[str] | None, int | None]:
    """(rows, column names if known up front, row count if known up front)."""
    if fmt == "parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ImportError("reading parquet tables needs pyarrow: pip install pyarrow") from None
        table = pq.ParquetFile(path)

        def parquet_rows() -> Iterator[dict[str, Any]]:
            for batch in table.iter_batches(batch_size=256):
                yield from batch.to_pylist()

        return parquet_rows(), list(table.schema_arrow.names), table.metadata.num_rows
    if fmt in ("csv", "tsv"):
        delimiter = "\t" if fmt == "tsv" else ","
        with open(path, newline="", encoding="utf-8-sig") as f:
            columns = list(csv.DictReader(f, delimiter=delimiter).fieldnames or [])

        def csv_rows() -> Iterator[dict[str, Any]]:
            with open(path, newline="", encoding="utf-8-sig") as f:
                yield from csv.DictReader(f, delimiter=delimiter)

        return csv_rows(), columns, None
    if fmt == "jsonl":

        def json_rows() -> Iterator[dict[str, Any]]:
            with open(path, encoding="utf-8-sig") as f:
                for number, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        row = json.loads(line)
                    except ValueError as exn:
                        row = f"{exn}"
                    if not isinstance(row, dict):
                        yield {_BAD_ROW_KEY: f"line {number} is not a JSON object ({str(row)[:100]})"}
                        continue
                    yield row

        return json_rows(), None, None
    raise ValueError(f"unknown table format {fmt!r}: use jsonl, csv, tsv or parquet")


def _image_value(value: Any, folder: str) -> tuple[str | None, str | None, bytes | None]:
    """(path as given, path to open, bytes) from an image cell: a path, bytes, a {"bytes", "path"} struct or a
    base64 data URI."""
    if isinstance(value, dict):  # Hugging Face datasets' Image feature
        if value.get("bytes"):
            return None, None, bytes(value["bytes"])
        value = value.get("path")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return None, None, bytes(value)
    if isinstance(value, str) and value.strip():
        value = value.strip()
        match = _DATA_URI.match(value)
        if match:
            try:
                return None, None, base64.b64decode(value[match.end():], validate=True)
            except (binascii.Error, ValueError):
                raise _Skip(BAD_IMAGE, "data URI is not valid base64") from None
        path = os.path.expanduser(value)
        return value, (path if os.path.isabs(path) else os.path.join(folder, path)), None
    return None, None, None


def _jsonable(value: Any) -> Any:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return None  # binary extras are not copied
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)  # dates, decimals, ...


def table_records(
    table: str | os.PathLike,
    image_column: str = "image",
    caption_column: str = "caption",
    fmt: str = "auto",
) -> tuple[Iterator[Record], int | None]:
    """(records of the table's rows, the row count when known); column names are checked up front."""
    path = os.path.abspath(os.path.expanduser(os.fspath(table)))
    if not os.path.isfile(path):
        raise FileNotFoundError(f"table {path!r} not found: give a .jsonl, .csv, .tsv or .parquet file")
    rows, columns, total = _read_rows(path, _table_format(path, fmt))
    folder, name = os.path.dirname(path), os.path.basename(path)
    rows = iter(rows)
    head: list[dict[str, Any]] = []  # rows up to the first readable one, which names the columns (JSONL)
    for row in rows:
        head.append(row)
        if _BAD_ROW_KEY not in row:
            break
    if columns is None and head and _BAD_ROW_KEY not in head[-1]:
        columns = list(head[-1])
    for column, flag in ((image_column, "--image-column"), (caption_column, "--caption-column")):
        if columns is not None and column not in columns:
            raise ValueError(f"{name} has no column {column!r} (columns: {', '.join(map(str, columns))}); "
                             f"pass {flag}")

    def records() -> Iterator[Record]:
        for number, row in enumerate(itertools.chain(head, rows)):
            source = f"{name}#{number}"
            if _BAD_ROW_KEY in row:
                yield Record(source=source, skip=BAD_ROW)
                continue
            try:
                given, image_path, data = _image_value(row.get(image_column), folder)
            except _Skip as skip:
                yield Record(source=source, skip=skip.reason)
                continue
            source = given or source
            extras = {str(k): _jsonable(v) for k, v in row.items()
                      if k is not None and k not in (image_column, caption_column)}  # None: CSV overflow cells
            extras = {k: v for k, v in extras.items() if v is not None}
            yield Record(source=source, path=image_path, data=data, caption=row.get(caption_column),
                         extras=extras)

    return records(), total


# --------------------------------------------------------------------------------------------------------------
# Preparing one sample: read, check, never re-encode
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Options:
    min_size: int = 0
    keep_uncaptioned: bool = False


def _text(data: str | bytes, what: str) -> str:
    if isinstance(data, str):
        return data
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exn:
        raise _Skip(NOT_UTF8, f"{what}: {exn}") from None


def _caption(record: Record) -> str:
    if record.caption_path is not None:
        try:
            with open(record.caption_path, "rb") as f:
                return _text(f.read(), record.caption_path).strip()
        except FileNotFoundError:
            return ""
        except OSError as exn:
            raise _Skip(UNREADABLE, f"{record.caption_path}: {exn}") from None
    value = record.caption
    if value is None or (isinstance(value, float) and value != value):  # None or NaN (pandas-written tables)
        return ""
    return _text(value if isinstance(value, (str, bytes)) else str(value), "caption").strip()


def _check_image(data: bytes, min_size: int) -> tuple[str, int, int]:
    """(extension, width, height) of image bytes that every reader can decode; raises _Skip otherwise."""
    if len(data) == 0:
        raise _Skip(ZERO_BYTES)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as img:
                ext = FORMAT_EXT.get(img.format or "")
                if ext is None:
                    raise _Skip(UNSUPPORTED, str(img.format))
                width, height = img.size
                if min_size and min(width, height) < min_size:
                    raise _Skip(TOO_SMALL, f"{width}x{height} < {min_size}")
                img.load()  # the whole image: truncated or corrupt data fails here, not in training
    except _Skip:
        raise
    except Exception as exn:  # undecodable, truncated, decompression bomb
        raise _Skip(BAD_IMAGE, f"{type(exn).__name__}: {exn}") from None
    return ext, width, height


def _prepare_many(jobs: list[tuple[Record, _Options]]) -> list[tuple[dict[str, Any] | None, str, str]]:
    return [_prepare(job) for job in jobs]


def _ordered_parallel(pool, jobs: Iterable, window: int, chunk: int = 8) -> Iterator:
    """`_prepare` over `jobs` in a process pool, results in input order, at most `window` chunks in flight
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


def _prepare(args: tuple[Record, _Options]) -> tuple[dict[str, Any] | None, str, str]:
    """(sample without its key, or None; skip reason; detail) for one record."""
    record, options = args
    try:
        if record.skip is not None:
            raise _Skip(record.skip)
        caption = _caption(record)
        if not caption and not options.keep_uncaptioned:
            raise _Skip(NO_CAPTION)
        if record.data is not None:
            data = record.data
        elif record.path is not None:
            try:
                with open(record.path, "rb") as f:
                    data = f.read()
            except OSError as exn:
                raise _Skip(UNREADABLE, f"{type(exn).__name__}: {exn}") from None
        else:
            raise _Skip(NO_IMAGE)
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
    except _Skip as skip:
        return None, skip.reason, f"{record.source}: {skip}"
    meta = {"caption": caption, "source": record.source, "width": width, "height": height}
    meta.update({k: v for k, v in extras.items() if k not in _RESERVED})
    return {"image": (ext, data), "caption": caption, "meta": meta}, "", ""


# --------------------------------------------------------------------------------------------------------------
# Writing shards
# --------------------------------------------------------------------------------------------------------------


@dataclass
class WriteSummary:
    out_dir: str
    shards: list[str] = field(default_factory=list)
    written: int = 0
    skipped: Counter = field(default_factory=Counter)  # reason -> count
    index: str | None = None  # the JSON of the shard index (None: not built, or kept in memory)

    def line(self) -> str:
        skipped = sum(self.skipped.values())
        reasons = ", ".join(f"{r}: {n}" for r, n in sorted(self.skipped.items()))
        return (f"wrote {self.written} samples in {len(self.shards)} shards to {self.out_dir}; skipped {skipped}"
                + (f" ({reasons})" if reasons else ""))


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
) -> WriteSummary:
    """Write `records` as img2dataset-layout shards into `out_dir` (see the module docstring); return the summary."""
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
    summary = WriteSummary(out_dir=out_dir)
    options = _Options(min_size=min_size, keep_uncaptioned=keep_uncaptioned)
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
            results: Iterable = _ordered_parallel(pool, jobs, window=4 * workers)  # input order, any workers
        else:
            results = map(_prepare, jobs)
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
    except BaseException:
        sink.abort()
        raise
    finally:
        bar.close()
        quiet.close()
        if pool is not None:
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
              "samples_per_shard": samples_per_shard,
              "shards": [os.path.basename(p) for p in summary.shards]}
    summary_path = os.path.join(out_dir, f"{prefix}-summary.json")
    tmp = f"{summary_path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
        f.write("\n")
    os.replace(tmp, summary_path)
    if build_index:
        from .indexed import load_or_build_index

        summary.index = load_or_build_index(summary.shards).path
    return summary


def write_folder(src_dir: str | os.PathLike, out_dir: str | os.PathLike, **kwargs: Any) -> WriteSummary:
    """Shards from a folder of images with sidecar .txt captions; keyword arguments as `write_shards`."""
    records = folder_records(src_dir)
    if not records:
        raise FileNotFoundError(f"no images ({', '.join(IMAGE_SUFFIXES)}) below {os.fspath(src_dir)!r}")
    kwargs.setdefault("desc", f"{os.path.basename(os.path.abspath(src_dir))} -> shards")
    return write_shards(records, out_dir, total=len(records), **kwargs)


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


# --------------------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------------------


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out_dir", metavar="OUT_DIR", help="folder for the shards (created)")
    parser.add_argument("--samples-per-shard", type=int, default=1000, help="samples per tar (default 1000)")
    parser.add_argument("--prefix", default="shard", help="shard names: PREFIX-000000.tar, ... (default shard)")
    parser.add_argument("--workers", type=int, default=1, help="processes reading and checking images (default 1)")
    parser.add_argument("--min-size", type=int, default=0,
                        help="skip images whose shorter side is below this many pixels (default 0: keep all)")
    parser.add_argument("--keep-uncaptioned", action="store_true",
                        help="write images without a caption with an empty one instead of skipping them")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing set with the same prefix")
    parser.add_argument("--no-index", action="store_true", help="do not build the indexed-mode index afterwards")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m data.writers", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="{folder,table}", required=True)
    folder = sub.add_parser("folder", help="images with sidecar .txt captions -> shards",
                            description="Images (jpg, jpeg, png, webp; recursive) captioned by the .txt file of the "
                                        "same stem -> img2dataset-layout shards.")
    folder.add_argument("src_dir", metavar="SRC_DIR", help="folder of images and .txt captions")
    _common(folder)
    table = sub.add_parser("table", help="JSONL/CSV/parquet rows (image path or bytes + caption) -> shards",
                           description="Rows with an image (path relative to the table or absolute, bytes, or a "
                                       "base64 data URI) and a caption -> img2dataset-layout shards; other columns "
                                       "go into key.json.")
    table.add_argument("table", metavar="TABLE", help=".jsonl, .csv, .tsv or .parquet file")
    table.add_argument("--image-column", default="image", help="column holding the image (default image)")
    table.add_argument("--caption-column", default="caption", help="column holding the caption (default caption)")
    table.add_argument("--format", default="auto", choices=("auto", "jsonl", "csv", "tsv", "parquet"),
                       help="table format (default: from the file extension)")
    _common(table)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    common = dict(samples_per_shard=args.samples_per_shard, prefix=args.prefix, workers=args.workers,
                  min_size=args.min_size, keep_uncaptioned=args.keep_uncaptioned, overwrite=args.overwrite,
                  build_index=not args.no_index, progress=not args.no_progress)
    try:
        if args.command == "folder":
            summary = write_folder(args.src_dir, args.out_dir, **common)
        else:
            summary = write_table(args.table, args.out_dir, args.image_column, args.caption_column, args.format,
                                  **common)
    except (FileNotFoundError, FileExistsError, ValueError, ImportError) as exn:
        print(f"error: {exn}", file=sys.stderr)
        return 2
    print(summary.line())
    if summary.index:
        print(f"index: {summary.index}; train with data.shards={summary.out_dir}")
    return 0


if __name__ == "__main__":
    from data.writers import main as _main  # the package's copy, so worker processes pickle data.writers.*

    sys.exit(_main())
