"""Records: what one sample of a shard set will be made of, listed from a folder of images or from a table's rows.

Making a record is cheap (paths and cells only); reading and checking it is `prepare.prepare_record`'s job, maybe
in a worker process. A table row that is already known to be bad becomes a record with its skip reason.
"""

from __future__ import annotations

import base64
import binascii
import csv
import itertools
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Iterator

__all__ = [
    "IMAGE_SUFFIXES",
    "TABLE_FORMATS",
    "UNREADABLE",
    "ZERO_BYTES",
    "BAD_IMAGE",
    "UNSUPPORTED",
    "TOO_SMALL",
    "NO_CAPTION",
    "NOT_UTF8",
    "NO_IMAGE",
    "BAD_ROW",
    "NO_IMAGE_FILE",
    "SkipSample",
    "Record",
    "FolderListing",
    "folder_listing",
    "folder_records",
    "table_records",
]

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp")
# images in formats the readers do not decode: skipped as unsupported (their captions are not orphans)
OTHER_IMAGE_SUFFIXES = (".gif", ".bmp", ".tif", ".tiff", ".heic", ".heif", ".avif", ".jxl", ".jp2", ".ico", ".dng",
                        ".cr2", ".cr3", ".nef", ".arw", ".raf", ".orf", ".rw2", ".psd", ".svg")
CAPTION_SUFFIX, SIDECAR_SUFFIX = ".txt", ".json"
TABLE_FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".csv": "csv", ".tsv": "tsv", ".parquet": "parquet",
                 ".pq": "parquet"}
_DATA_URI = re.compile(r"^data:image/[A-Za-z0-9.+-]+;base64,", re.ASCII)

# Skip reasons, the keys of WriteSummary.skipped (see the package docstring).
UNREADABLE = "unreadable file"
ZERO_BYTES = "zero-byte image"
BAD_IMAGE = "bad image"
UNSUPPORTED = "unsupported image format"
TOO_SMALL = "image too small"
NO_CAPTION = "missing or empty caption"
NOT_UTF8 = "non-UTF-8 text"
NO_IMAGE = "missing image"
BAD_ROW = "unreadable row"  # a JSONL line that is not a JSON object
NO_IMAGE_FILE = "caption without an image"  # folder mode: a .txt whose stem names no image beside it

_BAD_ROW_KEY = "\0bad row"  # marks such a line among the rows


class SkipSample(Exception):
    """A record that is not written: `reason` is one of the skip reasons above, the message adds the detail."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass
class Record:
    """One sample to be: where its image and caption come from, and extra fields for its key.json."""

    source: str  # relative path, absolute path or "table#row", for key.json and messages
    path: str | None = None  # image file to read ...
    data: bytes | None = None  # ... or its bytes
    caption: str | bytes | None = None  # the caption ...
    caption_path: str | None = None  # ... or a file holding it (read when the record is prepared)
    extras: dict[str, Any] = field(default_factory=dict)
    extras_path: str | None = None  # sidecar JSON object of extra fields (folder mode)
    skip: str | None = None  # already known to be bad: the reason


@dataclass
class FolderListing:
    """What a folder holds for the writer: a record per image, per image in a format the readers do not decode and
    per caption without an image (the last two already marked skipped), and the other files, which are no sample."""

    records: list[Record]
    ignored: list[str]  # relative paths of files that are neither images, captions nor sidecars (hidden ones aside)


def folder_listing(src_dir: str | os.PathLike) -> FolderListing:
    """Every image below `src_dir`, captioned by the `.txt` of its stem, sorted by relative path (POSIX separators);
    an image in another format and a caption whose stem has no image become skipped records, so the summary counts
    every input that is not written."""
    src_dir = os.path.abspath(os.path.expanduser(os.fspath(src_dir)))
    if not os.path.isdir(src_dir):
        raise FileNotFoundError(f"source folder {src_dir!r} not found: give a folder of images with .txt captions")
    records, ignored = [], []
    for folder, dirs, files in os.walk(src_dir):
        dirs.sort()

        def rel(name: str) -> str:
            return os.path.relpath(os.path.join(folder, name), src_dir).replace(os.sep, "/")

        images, other_images = {}, {}  # file name -> stem
        captions, sidecars = {}, {}  # stem -> file name (`a.TXT` beside `a.txt`: the first one sorted)
        for name in sorted(files):
            if name.startswith("."):  # macOS resource forks, editors' swap files
                continue
            stem, suffix = os.path.splitext(name)
            suffix = suffix.lower()
            if suffix in IMAGE_SUFFIXES:
                images[name] = stem
            elif suffix in OTHER_IMAGE_SUFFIXES:
                other_images[name] = stem
            elif suffix == CAPTION_SUFFIX:
                captions.setdefault(stem, name)
            elif suffix == SIDECAR_SUFFIX:
                sidecars.setdefault(stem, name)
            else:
                ignored.append(rel(name))
        for name, stem in images.items():
            records.append(Record(source=rel(name), path=os.path.join(folder, name),
                                  caption_path=os.path.join(folder, captions.get(stem, stem + CAPTION_SUFFIX)),
                                  extras_path=os.path.join(folder, sidecars[stem]) if stem in sidecars else None))
        records += [Record(source=rel(name), skip=UNSUPPORTED) for name in other_images]
        imaged = {*images.values(), *other_images.values()}
        records += [Record(source=rel(name), skip=NO_IMAGE_FILE) for stem, name in captions.items()
                    if stem not in imaged]
    records.sort(key=lambda r: r.source)
    return FolderListing(records, sorted(ignored))


def folder_records(src_dir: str | os.PathLike) -> list[Record]:
    """The records of `folder_listing(src_dir)`: images to write, and the inputs already known to be skipped."""
    return folder_listing(src_dir).records


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
                raise SkipSample(BAD_IMAGE, "data URI is not valid base64") from None
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
            except SkipSample as skip:
                yield Record(source=source, skip=skip.reason)
                continue
            source = given or source
            extras = {str(k): _jsonable(v) for k, v in row.items()
                      if k is not None and k not in (image_column, caption_column)}  # None: CSV overflow cells
            extras = {k: v for k, v in extras.items() if v is not None}
            yield Record(source=source, path=image_path, data=data, caption=row.get(caption_column),
                         extras=extras)

    return records(), total
