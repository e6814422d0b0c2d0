"""The readers' bad-sample policy: skip reasons, their per-process counts, and rate-limited warnings.

Bad samples and shards are skipped, counted per reason (`ReaderStats`), logged (rate-limited, plus a per-reason
summary every few minutes) and never fatal — except when nothing readable has come out at all after many attempts,
which is a wrong path or layout, or a `min_size` above every image: reported in one line (`NoUsableSamples`) instead
of an endless silent loop. Sample reasons (the same for the streaming and the indexed reader):

  bad image                 undecodable or truncated image
  missing image             no jpg/jpeg/png/webp member (e.g. a caption whose image was never written)
  zero-byte member          the image member is empty (a failed download or an interrupted write)
  image too small           shorter side below `min_size` pixels (checked on the header, before any draft)
  missing or empty caption  no txt member and no caption field in json, or only whitespace
  non-UTF-8 text            txt or json bytes that are not valid UTF-8
  bad json                  json needed for the caption but not parseable

Shard reasons (counted once per read of the shard, the shard named in a warning): `unreadable shard` (cannot be
opened or read: permissions, vanished file, I/O error) and `truncated or corrupt tar` (the samples before the
damage are used).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

__all__ = [
    "BAD_IMAGE",
    "NO_IMAGE",
    "ZERO_BYTES",
    "TOO_SMALL",
    "NO_CAPTION",
    "NOT_UTF8",
    "BAD_JSON",
    "UNREADABLE_SHARD",
    "CORRUPT_TAR",
    "BadSample",
    "NoUsableSamples",
    "too_small_advice",
    "ReaderStats",
    "warn_rate_limited",
    "shard_failure_reason",
    "counts_since",
    "reader_stats",
]

log = logging.getLogger(__name__)

# Give up (one clear error) when this many samples/shards failed in a row before any sample was usable.
MAX_FAILURES_BEFORE_FIRST_SAMPLE = 1000
SUMMARY_EVERY_S = 300.0  # a process that skipped something logs its per-reason summary at most this often

# Skip reasons (see the module docstring).
BAD_IMAGE = "bad image"
NO_IMAGE = "missing image"
ZERO_BYTES = "zero-byte member"
TOO_SMALL = "image too small"
NO_CAPTION = "missing or empty caption"
NOT_UTF8 = "non-UTF-8 text"
BAD_JSON = "bad json"
UNREADABLE_SHARD = "unreadable shard"
CORRUPT_TAR = "truncated or corrupt tar"


class BadSample(ValueError):
    """A sample that cannot be used, with the reason it is counted under."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


class NoUsableSamples(RuntimeError):
    """Nothing usable came out of a reader after many attempts: a wrong path or layout, or a setting that no sample
    meets (data.min_size above every image). One line, naming what to change."""


def too_small_advice(bad: dict[str, int]) -> str | None:
    """What to change when every skipped sample was an image too small (`bad`: reason -> count), else None."""
    if bad and set(bad) == {TOO_SMALL}:
        return "every image read is smaller than data.min_size (its shorter side, in pixels): lower data.min_size"
    return None


def warn_rate_limited(count: int, message: str) -> None:
    """Log the `count`-th occurrence of a warning (its first 300 characters): the first 10, then every 1000th."""
    if count <= 10 or count % 1000 == 0:
        log.warning("%s (occurrence %d%s)", message[:300], count,
                    "; further ones logged every 1000th" if count == 10 else "")


@dataclass
class ReaderStats:
    """Per-process counts (each DataLoader worker has its own copy)."""

    good: int = 0
    bad: dict[str, int] = field(default_factory=dict)  # sample reason -> samples skipped
    shards_bad: dict[str, int] = field(default_factory=dict)  # shard reason -> shard reads that failed
    failures_in_a_row: int = 0
    where: str = ""  # shard spec, for messages
    last_summary: float = field(default_factory=time.monotonic)

    @property
    def bad_total(self) -> int:
        return sum(self.bad.values())

    @property
    def shard_errors(self) -> int:
        return sum(self.shards_bad.values())

    def summary(self) -> str:
        """One line for logs: samples used, the skipped ones per reason, and the shards that failed per reason."""
        skipped = ", ".join(f"{reason}: {n}" for reason, n in sorted(self.bad.items())) or "none"
        shards = ", ".join(f"{reason}: {n}" for reason, n in sorted(self.shards_bad.items()))
        errors = f"; bad shards {self.shard_errors} ({shards})" if self.shard_errors else ""
        return f"{self.good} samples read; skipped {self.bad_total} ({skipped}){errors}"

    def count(self, reason: str, message: str, shard: bool = False) -> None:
        """Count one skipped sample (or failed shard read) under `reason` and log it (rate-limited)."""
        table = self.shards_bad if shard else self.bad
        table[reason] = table.get(reason, 0) + 1
        if shard:  # every failed shard is named (its first failures; then every 1000th)
            warn_rate_limited(table[reason], message)
        else:
            warn_rate_limited(self.bad_total, message)
        now = time.monotonic()
        if now - self.last_summary >= SUMMARY_EVERY_S:
            self.last_summary = now
            log.warning("data reader (%s): %s", self.where, self.summary())

    def failed(self, what: str) -> None:
        self.failures_in_a_row += 1
        if self.good == 0 and self.failures_in_a_row >= MAX_FAILURES_BEFORE_FIRST_SAMPLE:
            advice = too_small_advice(self.bad) or "check the shard paths, image format and caption field"
            raise NoUsableSamples(f"no usable sample after {self.failures_in_a_row} failures reading {self.where} "
                                  f"(last: {what}); {advice}")


def shard_failure_reason(exn: BaseException) -> str:
    """`unreadable shard` for I/O errors (cannot open or read the file), else `truncated or corrupt tar`."""
    return UNREADABLE_SHARD if isinstance(exn, OSError) else CORRUPT_TAR


def counts_since(now: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    """What was counted per reason since `before` (a copy of the counts taken earlier); unchanged reasons left out."""
    return {r: n - before.get(r, 0) for r, n in now.items() if n != before.get(r, 0)}


def reader_stats(loader) -> "ReaderStats | None":
    """The skip counters of a streaming or indexed loader, as seen by this process.

    Indexed loaders sum them over their workers; a streaming loader's counters are only visible with
    num_workers=0 (otherwise they live in the worker processes, which still log each skip).
    """
    stats = getattr(loader, "stats", None) or getattr(getattr(loader, "dataset", None), "stats", None)
    return stats if isinstance(stats, ReaderStats) else None
