"""Walking the members of img2dataset / webdataset tar shards, and naming the samples they belong to.

A sample is the run of consecutive members that share a key: `dir/000123.jpg`, `dir/000123.txt` and
`dir/000123.json` are the `jpg`, `txt` and `json` of sample `dir/000123` (the key ends at the first dot of the
base name, webdataset's rule). Members named like `__index__` are webdataset's own and belong to no sample.
"""

from __future__ import annotations

import os
import re
import tarfile
from typing import Callable, Iterator

REMOTE_PREFIXES: tuple[str, ...] = ("pipe:", "http://", "https://", "s3://", "gs://")
# the stores whose shards the indexed reader reads through its cache (data.remote); pipe: commands are streamed
INDEXABLE_PREFIXES: tuple[str, ...] = ("s3://", "gs://", "http://", "https://")

_KEY_EXT = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")
_META = re.compile(r"__[^/]*__($|/)")


def split_key_ext(name: str) -> tuple[str, str] | None:
    """'dir/000123.txt' → ('dir/000123', 'txt') (extension lower-cased); None for a member of no sample."""
    if _META.match(name):
        return None
    match = _KEY_EXT.match(name)
    if match is None:
        return None
    return match.group(1), match.group(2).lower()


def _octal(field: bytes) -> int:
    if field[:1] and field[0] & 0x80:  # GNU base-256 for sizes >= 8 GiB
        return int.from_bytes(field[1:], "big")
    text = field.split(b"\0", 1)[0].strip()
    return int(text, 8) if text else 0


def _check_header(header: bytes, where: int) -> tuple[bytes, int]:
    """(type flag, data size) of one 512-byte tar header; tarfile.ReadError on a bad checksum."""
    if _octal(header[148:156]) != sum(header[:148]) + 256 + sum(header[156:]):
        raise tarfile.ReadError(f"bad tar header checksum at byte {where}")
    return bytes(header[156:157]), _octal(header[124:136])


def _extended_name(kind: bytes, data: bytes | memoryview) -> str | None:
    """The member name a GNU long-name (L) or pax (x) record gives the next member (None: a pax record without
    a path, or a global pax header)."""
    if kind == b"L":
        return bytes(data).split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
    if kind == b"x":
        for record in bytes(data).split(b"\n"):
            _, _, kv = record.partition(b" ")
            key, _, value = kv.partition(b"=")
            if key == b"path":
                return value.decode("utf-8", "surrogateescape")
    return None


def _header_name(header: bytes) -> str:
    name = header[:100].split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
    if header[257:262] == b"ustar":
        prefix = header[345:500].split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
        if prefix:
            name = f"{prefix}/{name}"
    return name


def walk_local_tar(path: str, wanted: Callable[[str], bool]) -> Iterator[tuple[str, bytes | None]]:
    """(name, data or None) of the regular files of an uncompressed local tar, reading only `wanted` members.

    A lean header walk (ustar, GNU long names, pax path records), ~20x faster than `tarfile` on small members;
    raises tarfile.ReadError on a bad checksum or a truncated archive, like tarfile would.
    """
    with open(path, "rb") as f:
        size_of_file = os.fstat(f.fileno()).st_size
        long_name: str | None = None
        while True:
            header = f.read(512)
            if len(header) < 512:
                if not header:
                    return  # no end-of-archive blocks: accepted, as tarfile does
                raise tarfile.ReadError(f"truncated tar header at byte {f.tell() - len(header)}")
            if header.count(0) == 512:
                return
            kind, size = _check_header(header, f.tell() - 512)
            padded = (size + 511) & ~511
            if f.tell() + padded > size_of_file:
                raise tarfile.ReadError(f"truncated tar member at byte {f.tell()}")
            if kind in (b"L", b"x", b"g"):
                long_name = _extended_name(kind, f.read(padded)[:size]) or long_name
                continue
            name = long_name or _header_name(header)
            long_name = None
            if kind not in (b"0", b"\0", b"7"):
                f.seek(padded, 1)
                continue
            if wanted(name):
                data = f.read(size)
                f.seek(padded - size, 1)
                yield name, data
            else:
                f.seek(padded, 1)
                yield name, None


def walk_tar_buffer(buf: memoryview) -> Iterator[tuple[str, memoryview]]:
    """(name, data) of the regular files in a tar fragment held in memory, the data as views into `buf` (no
    copy). The fragment may end right after its last member's data (a sample's indexed span). The same header
    walk as `walk_local_tar`; tarfile.ReadError on a bad checksum or a member running past the end."""
    pos, end = 0, len(buf)
    long_name: str | None = None
    while pos + 512 <= end:
        header = bytes(buf[pos:pos + 512])
        if header.count(0) == 512:
            return
        kind, size = _check_header(header, pos)
        data_at = pos + 512
        if data_at + size > end:
            raise tarfile.ReadError(f"truncated tar member at byte {data_at}")
        pos = data_at + ((size + 511) & ~511)
        if kind in (b"L", b"x", b"g"):
            long_name = _extended_name(kind, buf[data_at:data_at + size]) or long_name
            continue
        name = long_name or _header_name(header)
        long_name = None
        if kind in (b"0", b"\0", b"7"):
            yield name, buf[data_at:data_at + size]
    if pos < end:
        raise tarfile.ReadError(f"truncated tar header at byte {pos}")


def walk_tar(url: str, wanted: Callable[[str], bool]) -> Iterator[tuple[str, bytes | None]]:
    """(name, data or None) of a shard's regular files, in archive order; only `wanted` members are read.

    Local `.tar` files take the fast walk; compressed or oddly named local archives go through `tarfile`, and
    remote URLs (pipe:, http(s), s3, gs) through webdataset's openers.
    """
    if not url.startswith(REMOTE_PREFIXES) and url.endswith(".tar"):
        yield from walk_local_tar(url, wanted)
        return
    if url.startswith(REMOTE_PREFIXES):
        from webdataset.gopen import gopen

        tar = tarfile.open(fileobj=gopen(url, "rb"), mode="r|*")
    else:
        tar = tarfile.open(url, mode="r:*")
    with tar:
        for member in tar:
            if not member.isfile():
                continue
            if wanted(member.name):
                handle = tar.extractfile(member)
                yield member.name, handle.read() if handle is not None else b""
            else:
                yield member.name, None
