"""Write img2dataset-layout tar shards from a folder of captioned images or from a table, ready to train on.

    python -m data.prep.writers folder SRC_DIR OUT_DIR [--samples-per-shard 1000] [--prefix shard] [--workers 4]
    python -m data.prep.writers table TABLE OUT_DIR [--image-column image] [--caption-column caption] [...]

Output: `OUT_DIR/{prefix}-000000.tar`, ... Each sample `{key}` (a zero-padded running number, unique in the set)
holds `{key}.jpg|png|webp` (the original bytes, never re-encoded; the extension follows the bytes' real format),
`{key}.txt` (the caption, UTF-8) and `{key}.json` ({"key", "caption", "source", "width", "height"} plus extras:
the other columns of a table row, or the fields of a folder image's sidecar `.json`). Then the index of indexed
mode is built (`data.index.load_or_build_index`, as `data.shards=OUT_DIR` will look for it), and
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
format (not JPEG/PNG/WebP, by its bytes or, in a folder, a .gif/.heic/.tiff/... file), image too small
(`--min-size`), missing or empty caption, non-UTF-8 text, caption without an image (a folder's `.txt` whose stem
names no image), missing image (an empty image cell), unreadable row (a JSONL line that is not a JSON object).
The summary line counts each reason, so written + skipped is every input; a folder's other files (notes, hidden
files aside) are named as ignored. Images without
a caption are skipped unless `--keep-uncaptioned`, which writes them with an empty caption (to caption them later;
the training readers skip empty captions). Failures to write the output (disk full, permissions) are fatal.

Atomicity: each shard is written as `{name}.tmp<pid>` and renamed when complete, so an interrupted run never leaves
a partial tar under a final name (a killed run may leave a `.tmp` file, which no reader picks up). An existing set
with the same prefix is refused unless `--overwrite`, which replaces it and removes its shards beyond the new count.
Output is deterministic: the same input and options give byte-identical shards, whatever `--workers` is.

Modules: `records` (what a sample is made of, from a folder or a table), `prepare` (reading and checking one
record, in order over a process pool), `write` (the shards, the summary and the index), `cli` (the command line).
"""

from .cli import main
from .records import IMAGE_SUFFIXES, FolderListing, Record, folder_listing, folder_records, table_records
from .write import WriteSummary, write_folder, write_shards, write_table

__all__ = [
    "IMAGE_SUFFIXES",
    "FolderListing",
    "Record",
    "WriteSummary",
    "folder_listing",
    "folder_records",
    "table_records",
    "write_shards",
    "write_folder",
    "write_table",
    "main",
]
