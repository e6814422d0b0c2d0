"""data.balance=imba in the training loop: each batch's IMBA distances feed `data.online_balance.OnlineBalance`, and
every `data.balance.every` steps its weights become a new segment of the weighted stream (`data.weighted.
SegmentedOrder`), identical on every rank and carried by the checkpoints.

Scoring. With the IMBA loss the distances are the loss's own (`stats["distance_per_token"]`, no extra pass); with
the plain loss a no-grad pass of the unconditional prediction over the first `data.balance.fraction` of each batch's
rows gives them (a no-grad row costs about a third of a trained one: 1/8 of the rows, about 4 % of a step).

Timing. The loader draws batches ahead of the step (worker processes or reader threads), so weights refreshed
after step s take effect `lag` steps later, at the stream position of step s + lag; the stream before that position
is already decided, and `SegmentedOrder.known_until` stops a loader that would read past the decided part.

Checkpoints. The state (running statistics, weights, the segments still ahead of the run and the last window summed
over the ranks) is the same on every rank (`before_save` sums the windows), so a resume on any number of
processes continues the same stream and the same statistics.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from data.online_balance import OnlineBalance
from data.weighted import SegmentedOrder, reweighted_units
from imba.loss import token_distance

__all__ = ["OnlineBalancer", "loader_lag", "scored_rows"]


def scored_rows(fraction: float, batch_size: int) -> int:
    """Rows of a batch of `batch_size` that the plain loss's no-grad unconditional pass scores: the first
    ceil(fraction × batch), at least one."""
    return max(1, math.ceil(fraction * batch_size))


def loader_lag(num_workers: int, loader_threads: int, grad_accum: int) -> int:
    """Steps between a refresh and the stream position its weights start at: more than the loader reads ahead
    (a DataLoader's 2 batches per worker process, or 2 per reader thread)."""
    ahead = 2 * num_workers if num_workers else 2 * loader_threads
    return math.ceil((ahead + 1) / grad_accum) + 1


class OnlineBalancer:
    """The online balance of one run (see the module doc). `order` is the stream the loader draws from. It is a
    hook of the run (`imba.training.hooks`): it scores each micro-batch, refreshes after a step, sums the ranks'
    observations before a save, and is checkpointed as `online_balance`."""

    CHECKPOINT = "online_balance"

    def __init__(self, balance: OnlineBalance, base_units: np.ndarray, source_starts: np.ndarray,
                 samples_per_epoch: int, seed: int, *, every: int, fraction: float, lag: int, patch_size: int,
                 num_train_timesteps: int, rank: int = 0):
        if every < 1 or lag < 1 or not 0 < fraction <= 1:
            raise ValueError(f"need every >= 1, lag >= 1 and 0 < fraction <= 1 (got {every}, {lag}, {fraction})")
        self.balance, self.base_units, self.starts = balance, np.asarray(base_units, np.int64), source_starts
        # before the first refresh the stream is the balance's prior
        self.order = SegmentedOrder(reweighted_units(self.base_units, balance.sample_factors(), source_starts),
                                    samples_per_epoch, seed)
        self.every, self.fraction, self.lag, self.rank = every, fraction, lag, rank
        self.patch_size, self.num_train_timesteps = patch_size, num_train_timesteps
        self.segments: list[tuple[int, np.ndarray]] = []  # (start position, entry weights), oldest still needed first
        # scored rows not yet in the statistics: (indices, distances, levels), the tensors still on the device, so a
        # step does not wait for its scoring pass to reach the host
        self.pending: list[tuple[list, torch.Tensor, torch.Tensor]] = []
        self.first_step, self.first_position, self.samples_per_step = 0, 0, 0

    def begin(self, step: int, samples_done: int, samples_per_step: int) -> None:
        """The run (re)starts after `step` steps and `samples_done` stream positions, reading `samples_per_step`
        positions per step from here on: the stream is decided up to the position of the next refresh + lag."""
        self.first_step, self.first_position, self.samples_per_step = step, samples_done, samples_per_step
        self.order.known_until = self.position(step - step % self.every + self.every + self.lag)

    def position(self, step: int) -> int:
        """The stream position the run reaches after `step` steps."""
        return self.first_position + (step - self.first_step) * self.samples_per_step

    @torch.no_grad()
    def observe(self, indices, stats: dict, predict, noised, null: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Score a batch: its rows' sample `indices`, the loss's `stats`, the run's `predict(noisy, timesteps,
        embeds, mask)`, the batch's `noised` inputs and the `null` caption (embeds, mask) per row."""
        per_token = stats.get("distance_per_token")
        if per_token is not None:
            rows, distance = len(indices), per_token.float().mean(dim=1)
        else:
            rows = scored_rows(self.fraction, len(indices))
            uncond = predict(noised.noisy[:rows], noised.timesteps[:rows], null[0][:rows], null[1][:rows])
            distance = token_distance(noised.target[:rows], uncond, self.patch_size).mean(dim=1)
        self.pending.append((list(indices[:rows]), distance.float(), noised.timesteps[:rows]))

    def flush(self) -> None:
        """Move the rows scored since the last call into the statistics (one transfer to the host)."""
        if not self.pending:
            return
        indices = [i for rows, _, _ in self.pending for i in rows]
        distance = torch.cat([d for _, d, _ in self.pending]).cpu().numpy()
        # the noise level t / T in float64: timestep 700 of 1000 through float32 would fall into the bin below
        level = torch.cat([t for _, _, t in self.pending]).cpu().double().numpy() / self.num_train_timesteps
        self.pending = []
        self.balance.observe(np.asarray(indices), distance, level)

    def micro_batch(self, step: int, batch: dict, stats: dict, predict, noised, null) -> None:
        self.observe(batch["indices"], stats, predict, noised, null)

    def step_end(self, step: int, accelerator) -> str | None:
        """After optimizer step `step`: every `every` steps, refresh the weights (summed over the ranks) and start
        their segment `lag` steps on; a line for the log when it did."""
        if step % self.every:
            return None
        self.flush()
        self.balance.refresh(lambda arrays: _sum_over_ranks(accelerator, arrays))
        self._add_segment(self.position(step + self.lag), self.balance.weights.copy())
        self.order.known_until = self.position(step + self.every + self.lag)
        current = self.position(step)
        while len(self.segments) > 1 and self.segments[1][0] <= current:
            self.segments.pop(0)  # a resume from here never reads before the second one's start
        return self.balance.describe()

    def before_save(self, accelerator) -> None:
        """Sum the ranks' windows into the main process's before a checkpoint (the others keep none), so the saved
        state holds every rank's observations."""
        self.flush()
        total = _sum_over_ranks(accelerator, self.balance.window_arrays())
        self.balance.absorb(total if self.rank == 0 else [np.zeros_like(a) for a in total])

    def _add_segment(self, start: int, weights: np.ndarray) -> None:
        units = reweighted_units(self.base_units, self.balance.sample_factors(weights), self.starts)
        self.order.add(start, units)
        self.segments = [s for s in self.segments if s[0] < start] + [(start, weights)]

    def state_dict(self) -> dict:
        self.flush()
        return {"balance": self.balance.state_dict(), "segments": [(int(s), w.copy()) for s, w in self.segments]}

    def load_state_dict(self, state: dict) -> None:
        self.balance.load_state_dict(state["balance"])
        if self.rank != 0:  # the saved window is every rank's summed: one rank carries it on
            self.balance.absorb([np.zeros_like(a) for a in self.balance.window_arrays()])
        self.segments = []
        for start, weights in state["segments"]:
            self._add_segment(int(start), np.asarray(weights, np.int64))


def _sum_over_ranks(accelerator, arrays: list[np.ndarray]) -> list[np.ndarray]:
    """Element-wise int64 sums of every rank's `arrays` (exact: integers)."""
    if accelerator.num_processes == 1:
        return [a.copy() for a in arrays]
    flat = torch.from_numpy(np.concatenate(arrays)).to(accelerator.device)
    total = accelerator.reduce(flat, reduction="sum").cpu().numpy()
    return np.split(total, np.cumsum([a.size for a in arrays])[:-1])
