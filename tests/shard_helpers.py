"""Small helpers the data tests share: write real tar shards from in-memory samples."""

import io
import pathlib

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


# ---------------------------------------------------------------------------------------------------------------
# a hostile shard set: every kind of bad sample and bad shard next to good samples
# ---------------------------------------------------------------------------------------------------------------

HOSTILE_MIN_SIZE = 10  # the "too small" image is 8x6; every other image is 20x12


def png(rgb, size=(20, 12)) -> bytes:
    return encode(Image.new("RGB", size, rgb), "PNG")


def good_sample(key: str, i: int) -> dict:
    return {"__key__": key, "png": png((10 * i % 256, 100, 200)), "txt": f"good caption {key}".encode()}


def write_hostile_shards(folder) -> dict:
    """Shards with each bad kind the readers must skip, and good samples around them.

    Returns {"shards": [paths, in order], "good": {key: caption}, "bad": {reason: count}, "shards_bad":
    {reason: count}, "unopenable": path, "truncated": path}. "unopenable" is a valid shard: delete it after
    building a loader (or before indexing) to make it a shard that cannot be opened; "bad"/"shards_bad" are the
    counts a reader with min_size=HOSTILE_MIN_SIZE must report for one pass over all shards.
    """
    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    good: dict[str, str] = {}
    n = 0

    def goods(count: int) -> list[dict]:
        nonlocal n
        out = []
        for _ in range(count):
            key = f"good-{n:04d}"
            s = good_sample(key, n)
            good[key] = s["txt"].decode()
            out.append(s)
            n += 1
        return out

    full = png((1, 2, 3))
    bad_samples = [
        {"__key__": "bad-undecodable", "jpg": b"\xff\xd8 definitely not a jpeg", "txt": b"undecodable image"},
        {"__key__": "bad-truncated-image", "png": full[: len(full) // 2], "txt": b"truncated image"},
        {"__key__": "bad-zero-bytes", "png": b"", "txt": b"zero-byte image member"},
        {"__key__": "bad-no-caption", "png": full},
        {"__key__": "bad-empty-caption", "png": full, "txt": b"  \n "},
        {"__key__": "bad-not-utf8", "png": full, "txt": "caf\u00e9 cr\u00e8me".encode("latin-1")},
        {"__key__": "bad-too-small", "png": png((9, 9, 9), size=(8, 6)), "txt": b"too small"},
    ]
    dirty = []
    for s in bad_samples:  # good and bad interleaved
        dirty += goods(1) + [s]
    dirty += goods(1)
    shards = [write_tar(folder / "hostile-000000.tar", dirty)]

    # a truncated tar: 3 complete good samples, then cut inside the image data of a 4th (not counted as good)
    lost = {"__key__": "lost-in-truncation", "png": png((7, 7, 7), size=(200, 200)), "txt": b"never delivered"}
    whole = folder / "whole.tmp"
    write_tar(whole, goods(3) + [lost])
    blob = whole.read_bytes()
    whole.unlink()
    cut = blob.index(b"lost-in-truncation.png") + 512 + 100  # header block, then 100 bytes of the png
    truncated = folder / "hostile-000001.tar"
    truncated.write_bytes(blob[:cut])
    shards.append(str(truncated))

    unopenable = write_tar(folder / "hostile-000002.tar", goods(2))
    unopenable_keys = list(good)[-2:]
    garbage = folder / "hostile-000003.tar"
    garbage.write_bytes(b"\x00this is not a tar file at all\n" * 40)
    shards.append(unopenable)
    shards.append(str(garbage))
    shards.append(write_tar(folder / "hostile-000004.tar", goods(3)))
    for key in unopenable_keys:  # its samples are never delivered once it cannot be opened
        del good[key]
    return {
        "shards": shards,
        "good": good,
        "bad": {"bad image": 2, "zero-byte member": 1, "missing or empty caption": 2, "non-UTF-8 text": 1,
                "image too small": 1},
        "shards_bad": {"truncated or corrupt tar": 2, "unreadable shard": 1},
        "unopenable": unopenable,
        "truncated": str(truncated),
    }
