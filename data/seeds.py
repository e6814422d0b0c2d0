"""Seeds derived from text, so every process of a run (ranks, DataLoader workers) derives the same ones."""

from __future__ import annotations

import hashlib
from typing import Any

__all__ = ["derive_seed"]


def derive_seed(*parts: Any) -> int:
    """A 63-bit seed from the parts' text (SHA-256), identical in every process (unlike `hash()` of a str)."""
    digest = hashlib.sha256("/".join(str(p) for p in parts).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)
