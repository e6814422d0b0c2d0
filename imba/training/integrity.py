"""A folder's manifest (every file's relative path, size and SHA-256), checking a folder against it, and flushing a
folder tree to disk.

SHA-256 rather than a CRC or BLAKE2: x86 (SHA-NI) and ARMv8 CPUs hash it in hardware, so in Python's hashlib it
runs about twice as fast as BLAKE2b or MD5 and within a factor of 2.5 of zlib's CRC-32 (one AMD EPYC core: SHA-256
0.75 GB/s, BLAKE2b 0.4, MD5 0.33, CRC-32 2); unlike a 32-bit CRC it misses no corruption in practice, and a manifest
entry can be checked with the stock `sha256sum`. Files are hashed on parallel threads (hashlib releases
the GIL on large buffers), one thread per file: a checkpoint is a few large files.
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ALGORITHM = "sha256"
_CHUNK = 8 << 20  # large reads: fewer system calls; hashlib runs without the GIL on each chunk
_MAX_THREADS = 8


def file_digest(path: Path) -> str:
    """The file's SHA-256, hex."""
    digest, buffer = hashlib.new(ALGORITHM), bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
    return digest.hexdigest()


def _files(folder: Path, exclude: frozenset[str]) -> list[str]:
    found = []
    for directory, _, names in os.walk(folder):
        for name in names:
            rel = (Path(directory) / name).relative_to(folder).as_posix()
            if rel not in exclude:
                found.append(rel)
    return sorted(found)


def _digests(folder: Path, rel_paths: list[str]) -> dict[str, str]:
    if not rel_paths:
        return {}
    # largest first, so that the biggest file does not start last and finish alone
    order = sorted(rel_paths, key=lambda rel: -(folder / rel).stat().st_size)
    with ThreadPoolExecutor(max_workers=min(len(order), os.cpu_count() or 1, _MAX_THREADS)) as pool:
        return dict(zip(order, pool.map(lambda rel: file_digest(folder / rel), order)))


def folder_manifest(folder: Path, exclude: tuple[str, ...] = ()) -> dict:
    """`{"algorithm": "sha256", "files": {relative path: {"size": bytes, "sha256": hex}}}` for every file under
    `folder` (recursively) except the relative paths in `exclude`."""
    folder = Path(folder)
    rel_paths = _files(folder, frozenset(exclude))
    digests = _digests(folder, rel_paths)
    return {"algorithm": ALGORITHM,
            "files": {rel: {"size": (folder / rel).stat().st_size, ALGORITHM: digests[rel]} for rel in rel_paths}}


def check_manifest(folder: Path, manifest: dict, checksums: bool = True) -> str | None:
    """None when every file the manifest lists is in `folder` with its size (and, with `checksums`, its SHA-256);
    else a short reason naming the first file that is not. Files the manifest does not list are ignored (a folder
    may gain derived files later). Sizes are all checked before any checksum: a truncated file is found without
    reading the others."""
    folder = Path(folder)
    files = manifest.get("files")
    if manifest.get("algorithm") != ALGORITHM or not isinstance(files, dict) or not files:
        return f"unreadable manifest (expected a non-empty {ALGORITHM} file list)"
    for rel, entry in files.items():
        path = folder / rel
        if not path.is_file():
            return f"missing file {rel}"
        size = path.stat().st_size
        if size != entry.get("size"):
            return f"{rel} is {size} bytes, the manifest says {entry.get('size')}"
    if checksums:
        for rel, digest in _digests(folder, list(files)).items():
            if digest != files[rel].get(ALGORITHM):
                return f"{rel} does not match its {ALGORITHM} in the manifest (same size, different bytes)"
    return None


def fsync_dir(path: Path) -> None:
    """Flush a directory's entries (names created, renamed or removed in it) to disk."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(folder: Path) -> None:
    """Flush every file under `folder` and every directory (itself included) to disk: after this, a power loss
    cannot leave the tree with names but no data."""
    for directory, _, names in os.walk(folder):
        for name in names:
            fd = os.open(Path(directory) / name, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(directory))
