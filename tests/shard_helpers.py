"""Small helpers the data tests share: write real tar shards from in-memory samples."""

import io

import webdataset as wds
from PIL import Image


def encode(img: Image.Image, fmt: str) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


def write_tar(path, samples: list[dict]) -> str:
    """Samples are dicts of member extension → bytes, plus "__key__"; written as-is (no encoding)."""
    with wds.TarWriter(str(path), encoder=False) as w:
        for s in samples:
            w.write(s)
    return str(path)
