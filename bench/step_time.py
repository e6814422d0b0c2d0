"""CPU step-time benchmark: plain vs literal IMBA vs efficient IMBA, on the same model, batch and data.

    python bench/step_time.py                      # tiny preset, batch 8, 16×16 latents, 64 text tokens
    python bench/step_time.py --preset small --latent-size 32 --steps 20

One training step = loss forward passes + backward + AdamW step, on synthetic latents and text embeddings (the
frozen VAE/T5 cost the same in every mode, so they are left out). The modes are timed *interleaved* in one
process — step k of every mode runs back to back — so machine noise hits all of them alike; the median over the
timed steps is reported, with the ratio to plain. Memory: the bytes of activations autograd saves for the
backward pass of one step (distinct storages, counted with saved-tensor hooks) — the part of peak memory that
differs between the modes; weights, gradients and optimizer states are the same in all three.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from imba.loss_settings import ImbaLoss, PlainLoss  # noqa: E402
from imba.objectives import RectifiedFlow  # noqa: E402
from imba.training.build import build_optimizer  # noqa: E402
from imba.training.config import load_config  # noqa: E402
from models.dit import build_transformer, count_parameters, predict  # noqa: E402

MODES = {
    "plain": PlainLoss(),
    "imba_literal": ImbaLoss(estimator="literal"),
    "imba_efficient": ImbaLoss(estimator="efficient"),
}


def make_step(args, mode: str):
    torch.manual_seed(0)
    model = build_transformer(args.preset, args.latent_size, args.caption_dim)
    optimizer, schedule = build_optimizer(load_config([]), model.parameters(), num_processes=1)  # the trainer's
    loss_fn = MODES[mode].build()
    objective = RectifiedFlow()
    g = torch.Generator().manual_seed(1)
    b, n_text = args.batch_size, args.text_tokens
    latents = torch.randn(b, 4, args.latent_size, args.latent_size, generator=g)
    mask = torch.zeros(b, n_text, dtype=torch.long)
    mask[:, : n_text // 3] = 1  # captions shorter than the padded length, as in real batches
    cond = (torch.randn(b, n_text, args.caption_dim, generator=g), mask)
    null_mask = torch.zeros(b, n_text, dtype=torch.long)
    null_mask[:, 0] = 1
    null = (torch.randn(1, n_text, args.caption_dim, generator=g).expand(b, -1, -1), null_mask)

    def step():
        noised = objective.noise(latents, generator=g)
        loss, _ = loss_fn(lambda *a: predict(model, *a), noised, cond, null, generator=g)
        loss.backward()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def time_interleaved(args) -> dict[str, list[float]]:
    steps = {mode: make_step(args, mode) for mode in args.modes}
    for _ in range(args.warmup):
        for step in steps.values():
            step()
    times: dict[str, list[float]] = {mode: [] for mode in args.modes}
    for _ in range(args.steps):
        for mode, step in steps.items():
            start = time.perf_counter()
            step()
            times[mode].append(time.perf_counter() - start)
    return times


def saved_activation_mib(args, mode: str) -> float:
    """MiB of distinct tensor storages autograd keeps for the backward pass of one step of `mode`."""
    step = make_step(args, mode)
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return sum(storages.values()) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--latent-size", type=int, default=16, help="latent height = width (128 px → 16)")
    parser.add_argument("--text-tokens", type=int, default=64)
    parser.add_argument("--caption-dim", type=int, default=64, help="text embedding width (tiny T5: 64)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    args = parser.parse_args()

    n_params = count_parameters(args.preset, args.latent_size, args.caption_dim)
    print(f"preset {args.preset} ({n_params / 1e6:.2f} M params), batch {args.batch_size}, latents 4×{args.latent_size}"
          f"×{args.latent_size}, {args.text_tokens} text tokens, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; {args.warmup} warm-up + {args.steps} timed steps per mode, interleaved")
    times = time_interleaved(args)
    plain = statistics.median(times["plain"]) if "plain" in times else None
    print("\n| mode | median step (ms) | min–max (ms) | ratio vs plain | activations saved for backward (MiB) |")
    print("|---|---|---|---|---|")
    for mode, ts in times.items():
        med = statistics.median(ts)
        ratio = f"{med / plain:.2f}×" if plain else "—"
        print(f"| {mode} | {med * 1e3:.1f} | {min(ts) * 1e3:.1f}–{max(ts) * 1e3:.1f} | {ratio} | "
              f"{saved_activation_mib(args, mode):.1f} |")


if __name__ == "__main__":
    main()
