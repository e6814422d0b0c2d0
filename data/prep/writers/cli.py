"""Write img2dataset-layout tar shards from a folder of captioned images or from a table, ready to train on.

`python -m data.prep.writers folder|table ...`: the command line of `write_folder` and `write_table`.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Sequence

from .write import write_folder, write_table

__all__ = ["main"]


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
    parser = argparse.ArgumentParser(prog="python -m data.prep.writers", description=__doc__.split("\n\n")[0],
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
