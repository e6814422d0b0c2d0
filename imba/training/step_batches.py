"""The loop's batches, one optimizer step ahead: a store that died is agreed on between steps, not met inside one.

A shard on object storage whose store stops answering raises `data.remote.StoreUnreachable` from the loader after
the read's deadline. Met inside a step, it would leave this rank out of the step's collectives while the other
ranks wait in them. So the loop takes each step's micro-batches before the step, right after the previous one
ended: a rank that cannot read them says so at the step boundary, in the same small agreement as a pre-emption
(`PreemptionHandler.should_stop`), and every rank checkpoints what was trained and exits for a requeue.
The price is holding one step's micro-batches (train.grad_accum of them) in host memory a step early.
"""

from __future__ import annotations

from typing import Iterator

from data.remote import StoreUnreachable

__all__ = ["StepBatches"]


class StepBatches:
    """`fetch()` reads the next optimizer step's `micro_batches` batches from `batches` (or, when the store is dead,
    the one line that says so in `failure`); iterating yields them, once."""

    def __init__(self, batches: Iterator, micro_batches: int) -> None:
        self.batches, self.micro_batches = batches, micro_batches
        self.pending: list = []
        self.failure: str | None = None

    def fetch(self) -> None:
        try:
            self.pending = [next(self.batches) for _ in range(self.micro_batches)]
        except StoreUnreachable as err:
            self.pending, self.failure = [], str(err)

    def __iter__(self):
        pending, self.pending = self.pending, []
        return iter(pending)
