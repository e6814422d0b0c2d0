"""Graceful pre-emption: a signal asks the loop to finish its step, checkpoint, and exit for a requeue.

SLURM sends SIGUSR1 (`#SBATCH --signal=B:USR1@180`, forwarded by our batch scripts) or SIGTERM before it kills a
job. The handler only sets a flag; the loop checks it after each optimizer step, and all ranks agree through one
tiny collective (a rank whose signal arrived late would otherwise keep training while the others save).
The process then exits with `REQUEUE_EXIT_CODE`. `accelerate launch` reports a failed worker as 1, so
`launch/slurm/node_launch.sh` restores the 75 after a forwarded signal, and the sbatch scripts requeue the job.
"""

from __future__ import annotations

import signal

import torch
from accelerate import Accelerator

REQUEUE_EXIT_CODE = 75  # EX_TEMPFAIL: "try again later"
SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


class PreemptionHandler:
    def __init__(self, signals=SIGNALS) -> None:
        self.received: int | None = None
        self._previous = {}
        for sig in signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.received = signum

    def should_stop(self, accelerator: Accelerator) -> bool:
        """True on every rank as soon as any rank has received a signal (one small gather per call)."""
        flag = torch.tensor([1.0 if self.received is not None else 0.0], device=accelerator.device)
        return bool(accelerator.gather(flag).max().item() > 0)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
