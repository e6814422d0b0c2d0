"""Writing files so that a crash at any moment leaves either the old file or the complete new one."""

from __future__ import annotations

import json
import os
from typing import Any, BinaryIO, Callable


def atomic_write(path: str | os.PathLike, payload: bytes | Callable[[BinaryIO], Any]) -> None:
    """Write `payload` (bytes, or a function that writes into the open file) to `path` through a temporary file
    in the same folder, flushed to disk before it is renamed over `path`.

    Several processes may write the same path at once (ranks building one index, say): each uses its own
    temporary name, and the last rename wins with a complete file.
    """
    path = os.fspath(path)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            if isinstance(payload, (bytes, bytearray, memoryview)):
                f.write(payload)
            else:
                payload(f)
            f.flush()
            os.fsync(f.fileno())  # the rename must never expose a file whose data is not on disk yet
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_json(path: str | os.PathLike, obj: Any) -> None:
    """`obj` as indented JSON with sorted keys, written atomically."""
    atomic_write(path, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode("utf-8"))


def read_json_object(path: str | os.PathLike) -> dict | None:
    """The JSON object stored at `path`, or None when the file is missing, unreadable or not an object."""
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except (OSError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None
