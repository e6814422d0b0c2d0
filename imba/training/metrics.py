"""Training metrics: averaged over the logging window, reduced over ranks, written to a JSONL file, to
accelerate's trackers and the progress bar (`StepLog`); and the images/s of the window.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from data.files import atomic_write
from imba.monitor import BucketMonitor
from imba.training.config import ConfigError


class MetricWindow:
    """Accumulates scalar stats between log points; `means()` returns and clears their averages.

    Non-finite values are not averaged in, but their key is kept (its mean is NaN if nothing finite came), so
    every rank reports the same keys in the same order and one collective can reduce them.

    Values are accumulated as tensors where they live and read (`.item()`) only in `means()`: reading every stat
    every step would force a GPU synchronisation per stat per step.
    """

    def __init__(self) -> None:
        self._sums: dict[str, torch.Tensor] = {}
        self._counts: dict[str, torch.Tensor] = {}

    def add(self, stats: dict) -> None:
        """`stats`: a loss's `LossStats`, whose items are its scalars (the per-sample and per-token tensors, for the
        concept-bucket monitor, are apart), or a dict, whose `*_per_sample` / `*_per_token` entries are skipped."""
        for name, value in stats.items():
            if name.endswith(("_per_sample", "_per_token")):
                continue
            value = torch.as_tensor(value).detach()
            value = value.reshape(()).float()
            finite = torch.isfinite(value)  # e.g. a weight statistic that is undefined for this batch
            self._sums[name] = self._sums.get(name, 0.0) + torch.where(finite, value, torch.zeros_like(value))
            self._counts[name] = self._counts.get(name, 0.0) + finite.float()

    def means(self) -> dict[str, float]:
        out = {}
        for name, total in self._sums.items():
            count = self._counts[name].item()
            out[name] = total.item() / count if count else math.nan
        self._sums.clear()
        self._counts.clear()
        return out


class JsonlLogger:
    """Appends one JSON object per log point, readable with pandas.read_json. A run that resumes at step s keeps
    the rows up to s (`keep_until`): the rows a killed run wrote after its last checkpoint are written again by the
    resumed run, and would otherwise be there twice (a row cut short by the kill is dropped too)."""

    def __init__(self, path: Path, keep_until: int = 0) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.is_file():
            kept = [line for line in self.path.read_text().splitlines() if _step_of(line) <= keep_until]
            atomic_write(self.path, "".join(f"{line}\n" for line in kept).encode())

    def log(self, step: int, metrics: dict) -> None:
        row = {"step": step, **{k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                                for k, v in metrics.items()}}
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")


class ConceptBuckets(BucketMonitor):
    """The IMBA monitor as a hook (`imba.training.hooks`): each micro-batch's per-sample stats by its captions'
    concept bucket (`bucketer`: captions → head/torso/tail labels, train.concept_stats); with no bucketer it adds
    nothing and its means are empty."""

    def __init__(self, bucketer=None) -> None:
        super().__init__()
        self.bucketer = bucketer

    def micro_batch(self, step: int, batch: dict, stats: dict, predict, noised, null) -> None:
        if self.bucketer is not None:
            self.add(self.bucketer(batch["captions"]), stats)


class DrawLog:
    """data.record_draws: the sample indices of every batch this rank trains on, one row a micro-batch in order,
    in `path` (the run folder's `draw_log(rank)`; {"step": s, "indices": [...]}); a resume at step s keeps the rows
    up to s. Over the ranks, step s's k-th rows of ranks 0, 1, ... are consecutive positions of the global stream."""

    def __init__(self, path: Path, keep_until: int) -> None:
        self.log = JsonlLogger(Path(path), keep_until)

    def micro_batch(self, step: int, batch: dict, stats: dict, predict, noised, null) -> None:
        """A hook (`imba.training.hooks`): each micro-batch's indices."""
        self.add(step, batch)

    def add(self, step: int, batch: dict) -> None:
        if "indices" not in batch:
            raise ConfigError("data.record_draws=true needs indexed reading (remote shards are streamed, and a "
                              "streamed sample has no index); set data.record_draws=false")
        self.log.log(step, {"indices": [int(i) for i in batch["indices"]]})


def _step_of(line: str) -> float:
    """The step of a JSONL row; infinity for a line that is not a complete row."""
    try:
        row = json.loads(line)
    except ValueError:
        return math.inf
    return row["step"] if isinstance(row, dict) and isinstance(row.get("step"), int) else math.inf


def reduce_over_ranks(accelerator, means: dict[str, float]) -> dict[str, float]:
    """The NaN-aware mean over ranks of each window mean: every rank passes the same keys in the same order (the
    windows guarantee it), so one gather carries them all."""
    values = torch.tensor([list(means.values())], device=accelerator.device)
    return dict(zip(means, accelerator.gather(values).nanmean(dim=0).tolist()))


class Throughput:
    """Images per second of training over a logging window; time spent in `paused()` (checkpoints, sample grids)
    does not count, so their I/O stays out of the training rate."""

    def __init__(self, images_per_step: int, step: int) -> None:
        self.images_per_step = images_per_step
        self.restart(step)

    def restart(self, step: int) -> None:
        self.start, self.start_step, self.paused_s = time.perf_counter(), step, 0.0

    @contextlib.contextmanager
    def paused(self):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.paused_s += time.perf_counter() - start

    def images_per_s(self, step: int) -> float:
        elapsed = time.perf_counter() - self.start - self.paused_s
        return self.images_per_step * (step - self.start_step) / elapsed


class StepLog:
    """The run's log of its logging steps: each one's metrics with the images/s since the last one (time spent in
    `paused()` left out) and the samples the readers skipped so far (`data_stats`, a `data.skips.ReaderStats`, or
    None), to accelerate's trackers, to `path` (metrics.jsonl, main process; a resume at `step` keeps its rows up to
    it) and as the loss on the progress bar, which `advance` moves one step."""

    def __init__(self, accelerator, path: Path, step: int, max_steps: int, images_per_step: int,
                 data_stats=None) -> None:
        self.accelerator, self.data_stats = accelerator, data_stats
        self.file = JsonlLogger(path, keep_until=step) if accelerator.is_main_process else None
        self.throughput = Throughput(images_per_step, step)
        self.progress = tqdm(total=max_steps, initial=step, disable=not accelerator.is_main_process, desc="train")

    def paused(self):
        """Time in this context does not count towards the images/s (checkpoints, validation, sample grids)."""
        return self.throughput.paused()

    def advance(self) -> None:
        self.progress.update(1)

    def write(self, step: int, metrics: dict) -> None:
        metrics["images_per_s"] = self.throughput.images_per_s(step)
        if self.data_stats is not None:
            metrics["data_skipped"] = self.data_stats.bad_total
        self.throughput.restart(step)
        self.accelerator.log(metrics, step=step)
        if self.file is not None:
            self.file.log(step, metrics)
            self.progress.set_postfix(loss=f"{metrics['loss']:.4f}")

    def close(self) -> None:
        self.progress.close()
