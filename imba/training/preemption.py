"""Graceful pre-emption: a signal asks the loop to finish its step, checkpoint, and exit for a requeue.

SLURM sends SIGUSR1 (`#SBATCH --signal=B:USR1@180`, forwarded by our batch scripts) or SIGTERM before it kills a
job. The handler only sets a flag; the loop checks it after each optimizer step, and all ranks agree through one
tiny collective (a rank whose signal arrived late would otherwise keep training while the others save).
The process then exits with `REQUEUE_EXIT_CODE`. A rank whose next batches cannot be read (its object store is
unreachable, `imba.training.step_batches`) asks for the same stop through the same collective. `accelerate launch`
reports a failed worker as 1, so `launch/slurm/node_launch.sh` restores the 75 after a forwarded signal, or when a
process wrote it into the file `IMBA_REQUEUE_FILE` names (a stop without a signal), and the sbatch scripts requeue
the job.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import torch
from accelerate import Accelerator

REQUEUE_EXIT_CODE = 75  # EX_TEMPFAIL: "try again later"
REQUEUE_FILE_ENV = "IMBA_REQUEUE_FILE"  # a file the node's launch script reads: a process asked for a requeue
SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


class PreemptionHandler:
    def __init__(self, signals=SIGNALS) -> None:
        self.received: int | None = None
        self.why: str | None = None  # what every rank agreed on at the last `should_stop`, for the closing line
        self._previous = {}
        for sig in signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.received = signum

    def should_stop(self, accelerator: Accelerator, cannot_read: bool = False, heed_signal: bool = True) -> bool:
        """True on every rank as soon as any rank has received a signal (unless not `heed_signal`), or cannot read
        its next batches (`cannot_read`: its store is unreachable); one small gather per call."""
        signal_now = heed_signal and self.received is not None
        flags = torch.tensor([[signal_now, cannot_read]], dtype=torch.float32, device=accelerator.device)
        signalled, unreadable = (accelerator.gather(flags).amax(dim=0) > 0).tolist()
        self.why = "pre-empted" if signalled else "stopped: the data of a rank cannot be read" if unreadable else None
        return self.why is not None

    def requeue(self, accelerator: Accelerator, failure: str | None, step: int, saved: bool) -> int:
        """Says why every rank stops and returns `REQUEUE_EXIT_CODE`. `failure`: this rank's unreadable data (its
        one `error:` line, printed by the rank that met it); `saved`: whether a checkpoint of `step` was written."""
        if failure is not None:
            print(f"error: {failure}", flush=True)
        if marker := os.environ.get(REQUEUE_FILE_ENV):  # launch/slurm/node_launch.sh: the launcher reports 1
            Path(marker).write_text(f"{REQUEUE_EXIT_CODE}\n")
        done = f"checkpoint at step {step} saved" if saved else f"nothing trained after step {step}"
        accelerator.print(f"{self.why}: {done}; exiting with {REQUEUE_EXIT_CODE} so the job is requeued (it resumes "
                          "from the latest checkpoint)")
        return REQUEUE_EXIT_CODE

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
