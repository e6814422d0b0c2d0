"""The 2-D IMBA experiment (paper Fig. 5; docs/method.md on the choice of reference), small enough to run on a laptop
CPU.

Setup
-----
Data: two Gaussian classes in the plane, *head* centred at (−1.5, 0) and *tail* at (+1.5, 0), std 0.5. The class
label plays the role of the caption; a third label (``NULL_CLASS``) is the empty caption.

Objective: 2-D flow matching / rectified flow. With noise x0 ~ N(0, I), data x1 and t ~ U(0, 1),

    x_t = (1 − t)·x0 + t·x1,        target velocity v = x1 − x0.

Model: a class-conditional MLP f(x_t, t, class) -> velocity (input = x_t, t and a learned class embedding; 64
wide, SiLU). Adam, lr 1e-3, batch 256, constant learning rate (the trainer's builder, `build_adamw`: AdamW without
weight decay or warm-up).

Variants (trained with equal steps, equal seeds and the *same* stream of random draws, so they differ only in
their loss and their class frequencies):

- ``plain_balanced``:   plain MSE with caption (class) dropout p = 1 − λ = 0.1, head:tail = 1:1.
- ``plain_imbalanced``: the same with head:tail = 100:1.
- ``imba_target``:      IMBA loss on 100:1, ``IMBALoss(gamma=0.8, lam=0.9, patch_size=1, reference="target")``.
- ``imba_cond``:        the same with ``reference="cond"``.

IMBALoss works on (B, C, H, W) latents and weighs DiT tokens; a 2-D point is fed as a (B, 2, 1, 1) "latent", so with
patch_size=1 every sample is exactly one token and the per-token weight is a per-sample weight. The IMBA variants
compute the conditional and the unconditional (null-class) prediction on every sample, both with gradient, which
is the literal form of the loss (no dropout).

Sampling: 50 Euler steps of dx/dt = f(x, t, class) from t = 0 (noise) to t = 1, conditional prediction only (no
classifier-free guidance), so the result shows what the conditional model itself has learned.

What the numbers mean
---------------------
- **tail drift**: Euclidean distance between the mean of generated tail-class samples and the true tail mean
  (1.5, 0). A tail class that the model under-serves is pulled towards the head, so drift measures how much the
  imbalance leaks into the conditional model. Reported per variant and training length, mean ± std over seeds.
  With 2000 samples the Monte-Carlo noise of the mean alone is ≈ 0.5 / √2000 ≈ 0.01 per coordinate.
  The learning rate is constant and the tail sees ~2.5 samples per batch, so after the early phase the drift is
  mostly seed-to-seed scatter; the **signed x offset** of the tail mean (− = towards the head, + = away from it)
  tells a systematic pull or push apart from that scatter.
- **IMBA distance**: on a fresh batch with equally many head and tail samples (so both means are well estimated
  even for the 100:1 models), the raw per-token distance d = mean over the token's 2 values of (v − p_uncond)²
  (before ``** gamma``), averaged over the head samples and over the tail samples; the weight D = d ** γ is
  reported next to it. Under 100:1 the unconditional model leans to the head, so the tail's distance is several
  times the head's; on balanced data they are about equal. This is the signal IMBA uses as its loss weight.

Run ``python bench/toy2d.py`` from the repository root for the full table (writes ``bench/toy2d_results.md`` and
``bench/toy2d.png``), or import ``run_experiment`` / ``train_variant`` / ``tail_drift`` / ``head_tail_distance`` (with
``bench/`` on ``sys.path``, as ``tests/test_toy2d.py`` does) for a shorter version.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script, only bench/ is on the path; the project's packages sit above it
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from imba.loss import IMBALoss, token_distance  # noqa: E402

HEAD_CLASS, TAIL_CLASS, NULL_CLASS = 0, 1, 2
CLASS_MEANS = torch.tensor([[-1.5, 0.0], [1.5, 0.0]])  # row = class id (head, tail)
CLASS_STD = 0.5

VARIANTS = ("plain_balanced", "plain_imbalanced", "imba_target", "imba_cond")
# the method's table (docs/method.md) uses 200 / 600 / 1500 steps; 100 is added because in this implementation the
# early-training pull of the tail towards the head is mostly gone by step 200 (see bench/toy2d_results.md).
DEFAULT_STEPS = (100, 200, 600, 1500)
DEFAULT_SEEDS = tuple(range(8))


@dataclass(frozen=True)
class ToyConfig:
    """Everything that defines one training run except the variant, the length and the seed."""

    imbalance: float = 100.0  # head:tail ratio of the "imbalanced" variants
    batch_size: int = 256
    lr: float = 1e-3
    width: int = 64
    depth: int = 3  # hidden layers
    class_embed_dim: int = 16
    gamma: float = 0.8
    lam: float = 0.9  # IMBA's λ; the plain variants use caption dropout 1 − λ
    sample_steps: int = 50  # Euler steps
    num_samples: int = 2000  # generated tail samples per drift measurement
    distance_batch: int = 4096  # fresh (x_t, t) draws per class for the IMBA distance


def variant_settings(variant: str) -> tuple[str, str]:
    """(loss kind: plain|target|cond, data: balanced|imbalanced) for a variant name; ToyConfig.imbalance gives the
    head:tail ratio of "imbalanced"."""
    table = {
        "plain_balanced": ("plain", "balanced"),
        "plain_imbalanced": ("plain", "imbalanced"),
        "imba_target": ("target", "imbalanced"),
        "imba_cond": ("cond", "imbalanced"),
    }
    if variant not in table:
        raise ValueError(f"toy2d: unknown variant {variant!r}; choose one of {', '.join(VARIANTS)}")
    return table[variant]


class VelocityMLP(nn.Module):
    """f(x_t, t, class) -> velocity. Class ids: 0 head, 1 tail, 2 null (the empty caption)."""

    def __init__(self, width: int = 64, depth: int = 3, class_embed_dim: int = 16):
        super().__init__()
        self.class_embed = nn.Embedding(3, class_embed_dim)
        layers: list[nn.Module] = []
        in_features = 2 + 1 + class_embed_dim
        for _ in range(depth):
            layers += [nn.Linear(in_features, width), nn.SiLU()]
            in_features = width
        layers.append(nn.Linear(in_features, 2))
        self.net = nn.Sequential(*layers)

    def forward(self, x_t: torch.Tensor, t: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat([x_t, t[:, None], self.class_embed(labels)], dim=1))


def sample_data(labels: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Draw one data point x1 per label (0 head, 1 tail)."""
    noise = torch.randn(labels.shape[0], 2, generator=generator)
    return CLASS_MEANS[labels] + CLASS_STD * noise


def flow_matching_batch(labels: torch.Tensor, generator: torch.Generator):
    """(x_t, t, target velocity) for the given data labels; x0 is noise, x1 the data."""
    n = labels.shape[0]
    x1 = sample_data(labels, generator)
    x0 = torch.randn(n, 2, generator=generator)
    t = torch.rand(n, generator=generator)
    x_t = (1 - t[:, None]) * x0 + t[:, None] * x1
    return x_t, t, x1 - x0


def as_latent(v: torch.Tensor) -> torch.Tensor:
    """(B, 2) -> (B, 2, 1, 1): a one-token "latent" with 2 channels, the shape IMBALoss works on."""
    return v[:, :, None, None]


def build_model(config: ToyConfig, seed: int) -> VelocityMLP:
    # fork_rng keeps the caller's global RNG untouched while making the initialisation a function of the seed only
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return VelocityMLP(config.width, config.depth, config.class_embed_dim)


def train_variant(
    variant: str,
    steps: int | tuple[int, ...] | list[int],
    seed: int,
    config: ToyConfig = ToyConfig(),
) -> dict[int, VelocityMLP]:
    """Train one variant and return a frozen copy of the model after each requested number of steps.

    The learning rate is constant, so the model after 200 steps of a 1500-step run is exactly the model of a
    200-step run: one run gives all the lengths. Every variant of one seed sees the same initialisation and the
    same random draws (labels are thresholded from the same uniforms, so the balanced and imbalanced streams differ
    only in which samples are tail; the IMBA variants draw the dropout mask too and ignore it).
    """
    loss_kind, balance = variant_settings(variant)
    checkpoints = sorted({int(s) for s in ((steps,) if isinstance(steps, int) else steps)})
    if not checkpoints or checkpoints[0] < 1:
        raise ValueError(f"toy2d: training lengths must be positive, got {steps!r}")
    tail_fraction = 0.5 if balance == "balanced" else 1.0 / (config.imbalance + 1.0)

    from imba.training.build import build_adamw

    model = build_model(config, seed)
    # the trainer's builder without weight decay or warm-up: Adam's update at a constant rate
    optimizer, schedule = build_adamw(model.parameters(), lr=config.lr, weight_decay=0.0, warmup_steps=0)
    imba_loss = None
    if loss_kind != "plain":
        imba_loss = IMBALoss(gamma=config.gamma, lam=config.lam, patch_size=1, reference=loss_kind)
    generator = torch.Generator().manual_seed(seed)
    dropout_p = 1.0 - config.lam
    batch = config.batch_size
    snapshots: dict[int, VelocityMLP] = {}

    for step in range(1, checkpoints[-1] + 1):
        labels = (torch.rand(batch, generator=generator) < tail_fraction).long()
        x_t, t, target = flow_matching_batch(labels, generator)
        drop = torch.rand(batch, generator=generator) < dropout_p

        if imba_loss is None:
            # the usual baseline: replace 10 % of the captions by the null caption, one forward pass
            pred = model(x_t, t, torch.where(drop, torch.full_like(labels, NULL_CLASS), labels))
            loss = F.mse_loss(pred, target)
        else:
            # the literal IMBA form: conditional and unconditional prediction on every sample, both with gradient;
            # one forward pass over the stacked batch
            pred = model(
                torch.cat([x_t, x_t]), torch.cat([t, t]), torch.cat([labels, torch.full_like(labels, NULL_CLASS)])
            )
            pred_cond, pred_uncond = pred[:batch], pred[batch:]
            loss, _ = imba_loss(as_latent(pred_cond), as_latent(pred_uncond), as_latent(target))

        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()

        if step in checkpoints:
            snapshot = build_model(config, seed)
            snapshot.load_state_dict(model.state_dict())
            snapshots[step] = snapshot.eval().requires_grad_(False)
    return snapshots


@torch.no_grad()
def generate(model: VelocityMLP, label: int, num_samples: int, seed: int, euler_steps: int = 50) -> torch.Tensor:
    """Euler-integrate dx/dt = f(x, t, label) from noise at t = 0 to t = 1 (conditional prediction, no guidance)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_samples, 2, generator=generator)
    labels = torch.full((num_samples,), label, dtype=torch.long)
    dt = 1.0 / euler_steps
    for i in range(euler_steps):
        t = torch.full((num_samples,), i * dt)
        x = x + dt * model(x, t, labels)
    return x


def tail_mean_error(model: VelocityMLP, seed: int, config: ToyConfig = ToyConfig()) -> torch.Tensor:
    """mean(generated tail samples) − (1.5, 0). Its x component is negative when the tail is pulled towards the
    head at (−1.5, 0) and positive when it overshoots away from it."""
    # offset the sampling seed so that the sampler noise is not the training stream's first draws
    samples = generate(model, TAIL_CLASS, config.num_samples, seed + 10_000, config.sample_steps)
    return samples.mean(dim=0) - CLASS_MEANS[TAIL_CLASS]


def tail_drift(model: VelocityMLP, seed: int, config: ToyConfig = ToyConfig()) -> float:
    """Distance between the mean of generated tail samples and the true tail mean (1.5, 0)."""
    return float(tail_mean_error(model, seed, config).norm())


@torch.no_grad()
def head_tail_distance(model: VelocityMLP, seed: int, config: ToyConfig = ToyConfig()) -> dict[str, float]:
    """Mean IMBA distance on a fresh batch, separately for head and tail samples.

    Returns ``head_d`` / ``tail_d``: the raw per-token distance d = mean over the 2 values of (v − p_uncond)², the
    quantity IMBALoss computes with reference="target" before ``** gamma``; and ``head_D`` / ``tail_D``: the mean of
    the weight D = d ** gamma. The batch holds ``distance_batch`` samples of each class, with fresh noise and t.
    """
    generator = torch.Generator().manual_seed(seed + 20_000)
    n = config.distance_batch
    labels = torch.cat([torch.full((n,), HEAD_CLASS), torch.full((n,), TAIL_CLASS)])
    x_t, t, target = flow_matching_batch(labels, generator)
    pred_uncond = model(x_t, t, torch.full_like(labels, NULL_CLASS))
    d = token_distance(as_latent(target), as_latent(pred_uncond), patch_size=1, kind="mse")[:, 0]
    weight = d.pow(config.gamma)
    return {
        "head_d": float(d[:n].mean()),
        "tail_d": float(d[n:].mean()),
        "head_D": float(weight[:n].mean()),
        "tail_D": float(weight[n:].mean()),
    }


@dataclass
class ToyResults:
    """Per-seed measurements: ``drift[variant][steps]``, ``x_offset[variant][steps]`` (signed x component of the
    tail-mean error) and ``distance[variant][key]`` are lists over seeds."""

    config: ToyConfig
    steps: tuple[int, ...]
    seeds: tuple[int, ...]
    variants: tuple[str, ...]
    drift: dict[str, dict[int, list[float]]] = field(default_factory=dict)
    x_offset: dict[str, dict[int, list[float]]] = field(default_factory=dict)
    distance: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    # generated samples of the first seed at the shortest length, for the picture: variant -> (head, tail)
    samples: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    seconds: float = 0.0

    def mean_drift(self, variant: str, steps: int) -> float:
        return statistics.fmean(self.drift[variant][steps])

    def mean_distance(self, variant: str, key: str) -> float:
        return statistics.fmean(self.distance[variant][key])


def run_experiment(
    steps: tuple[int, ...] = DEFAULT_STEPS,
    seeds: tuple[int, ...] = DEFAULT_SEEDS,
    variants: tuple[str, ...] = VARIANTS,
    config: ToyConfig = ToyConfig(),
    plot_samples: int = 0,
) -> ToyResults:
    """Train every variant for every seed, measure the tail drift at every length and the IMBA distance at the end.

    ``plot_samples`` > 0 also keeps that many generated head and tail samples per variant (first seed, shortest
    length) for ``draw_scatter``.
    """
    started = time.perf_counter()
    steps = tuple(sorted(set(steps)))
    results = ToyResults(config=config, steps=steps, seeds=tuple(seeds), variants=tuple(variants))
    for variant in variants:
        variant_settings(variant)  # fail early on a typo, before any training
    for variant in variants:
        results.drift[variant] = {s: [] for s in steps}
        results.x_offset[variant] = {s: [] for s in steps}
        results.distance[variant] = {}
        for seed in seeds:
            models = train_variant(variant, steps, seed, config)
            for s in steps:
                error = tail_mean_error(models[s], seed, config)
                results.drift[variant][s].append(float(error.norm()))
                results.x_offset[variant][s].append(float(error[0]))
            for key, value in head_tail_distance(models[steps[-1]], seed, config).items():
                results.distance[variant].setdefault(key, []).append(value)
            if plot_samples and seed == seeds[0]:
                shortest = models[steps[0]]
                results.samples[variant] = (
                    generate(shortest, HEAD_CLASS, plot_samples, seed + 30_000, config.sample_steps),
                    generate(shortest, TAIL_CLASS, plot_samples, seed + 40_000, config.sample_steps),
                )
    results.seconds = time.perf_counter() - started
    return results


def _mean_std(values: list[float], signed: bool = False) -> str:
    std = statistics.pstdev(values) if len(values) > 1 else 0.0
    mean = f"{statistics.fmean(values):+.3f}" if signed else f"{statistics.fmean(values):.3f}"
    return f"{mean} ± {std:.3f}"


def format_results(results: ToyResults) -> str:
    """Markdown: the drift table (rows = steps, columns = variants) and the head/tail distance lines."""
    cfg = results.config
    lines = [
        f"Tail drift |mean(generated tail) − (1.5, 0)|, mean ± std over seeds {list(results.seeds)} "
        f"({cfg.num_samples} samples, {cfg.sample_steps} Euler steps, conditional only; "
        f"imbalanced = {cfg.imbalance:g}:1, λ = {cfg.lam}, γ = {cfg.gamma}):",
        "",
        "| steps | " + " | ".join(results.variants) + " |",
        "|---|" + "---|" * len(results.variants),
    ]
    for s in results.steps:
        cells = [_mean_std(results.drift[v][s]) for v in results.variants]
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Signed x component of the same error, mean ± std over seeds (− = pulled towards the head at (−1.5, 0), "
        "+ = pushed away from it); it separates a systematic bias from seed-to-seed scatter, which the drift "
        "(a distance) mixes:",
        "",
        "| steps | " + " | ".join(results.variants) + " |",
        "|---|" + "---|" * len(results.variants),
    ]
    for s in results.steps:
        cells = [_mean_std(results.x_offset[v][s], signed=True) for v in results.variants]
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"IMBA distance on a fresh batch after {results.steps[-1]} steps ({cfg.distance_batch} head + "
        f"{cfg.distance_batch} tail samples), mean over seeds; d = mean over the 2 values of (v − p_uncond)² "
        f"(raw, before ** γ), D = d ** {cfg.gamma}:",
        "",
    ]
    for v in results.variants:
        head_d, tail_d = results.mean_distance(v, "head_d"), results.mean_distance(v, "tail_d")
        head_w, tail_w = results.mean_distance(v, "head_D"), results.mean_distance(v, "tail_D")
        lines.append(
            f"- {v}: d head {head_d:.3f}, tail {tail_d:.3f} (tail/head {tail_d / head_d:.2f}); "
            f"D head {head_w:.3f}, tail {tail_w:.3f} (tail/head {tail_w / head_w:.2f})"
        )
    lines += ["", f"Wall time {results.seconds:.1f} s with torch.get_num_threads() = {torch.get_num_threads()}."]
    return "\n".join(lines) + "\n"


def draw_scatter(results: ToyResults, path: str | Path, size: tuple[int, int] | None = None) -> None:
    """One scatter panel per variant (first seed, shortest length): generated head and tail samples in the bucket
    colours of imba.plots, the true class means as crosses and the generated tail mean as a ring."""
    from imba.plots import ScatterPanel, plot_scatter_2d

    variants = [v for v in results.variants if v in results.samples]
    if not variants:
        raise ValueError("toy2d: no samples to draw; run run_experiment(..., plot_samples=N) first")
    steps, seed = results.steps[0], results.seeds[0]
    panels = []
    for variant in variants:
        head, tail = results.samples[variant]
        drift = results.drift[variant][steps][0]
        panels.append(ScatterPanel(title=f"{variant}: tail drift {drift:.3f}",
                                   points={"head": head.numpy(), "tail": tail.numpy()},
                                   crosses=[tuple(m) for m in CLASS_MEANS.tolist()],
                                   rings=[tuple(tail.mean(dim=0).tolist())]))
    plot_scatter_2d(panels, path, xlim=(-3.5, 3.5), ylim=(-2.5, 2.5), cross_label="true class mean",
                    ring_label="generated tail mean", size=size,
                    title=f"2-D experiment: generated samples after {steps} steps, seed {seed} "
                          "(conditional, no guidance)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, nargs="+", default=list(DEFAULT_STEPS), help="training lengths")
    parser.add_argument("--seeds", type=int, nargs="+", default=list(DEFAULT_SEEDS))
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: leave as is)")
    parser.add_argument("--out-dir", default="bench", help="where toy2d_results.md and toy2d.png go")
    parser.add_argument("--plot-samples", type=int, default=1000, help="generated samples per class in the picture")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    results = run_experiment(tuple(args.steps), tuple(args.seeds), tuple(args.variants), plot_samples=args.plot_samples)
    report = format_results(results)
    print(report, end="")
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config_line = ", ".join(f"{k}={v}" for k, v in asdict(results.config).items())
    (out_dir / "toy2d_results.md").write_text(
        "# 2-D IMBA experiment (`python bench/toy2d.py`)\n\n"
        f"Setup: see the docstring of `bench/toy2d.py` and docs/method.md. Config: {config_line}.\n\n" + report
    )
    draw_scatter(results, out_dir / "toy2d.png")
    print(f"wrote {out_dir / 'toy2d_results.md'} and {out_dir / 'toy2d.png'}")


if __name__ == "__main__":
    main()
