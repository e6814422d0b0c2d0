"""The run folder, `train.output_dir`: every path a run writes under it, named here and nowhere else.

    <train.output_dir>/
      config.yaml              the settings the run started with (written once the run starts)
      metrics.jsonl            one line per logging step (imba/training/metrics.py)
      checkpoints/step_*/      verified accelerate states (imba/training/checkpoints.py)
      samples/step_*.png       the sample grids, from the EMA weights
      export/                  the diffusers pipeline of the last step, with its model card
      data/                    the draw plan of data.sources / data.balance, and data.balance=imba's entries
      draws/rank_<R>.jsonl     data.record_draws: the sample indices each rank trained on
      features/{train,val}/    data.precompute: the shards encoded once by the frozen VAE and T5
      synthetic_shards/        the synthetic training set, when data.synthetic_dir does not name one
      synthetic_val/           the synthetic validation set
      sources/<i>-<name>/      what a source of data.sources writes (kind synthetic, without a folder of its own)
      concepts/concepts.json   train.concept_stats=auto: the synthetic set's concept statistics
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["CHECKPOINTS_DIR", "RunFolder"]

CHECKPOINTS_DIR = "checkpoints"


@dataclass(frozen=True)
class RunFolder:
    """The paths of one run folder (see the module doc)."""

    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def checkpoints(self) -> Path:
        return self.root / CHECKPOINTS_DIR

    @property
    def samples(self) -> Path:
        return self.root / "samples"

    def sample_grid(self, step: int) -> Path:
        return self.samples / f"step_{step:07d}.png"

    @property
    def export(self) -> Path:
        return self.root / "export"

    @property
    def plan(self) -> Path:
        return self.root / "data"

    def draw_log(self, rank: int) -> Path:
        return self.root / "draws" / f"rank_{rank}.jsonl"

    def features(self, name: str) -> Path:
        return self.root / "features" / name

    @property
    def synthetic_train(self) -> Path:
        return self.root / "synthetic_shards"

    @property
    def sources(self) -> Path:
        return self.root / "sources"

    @property
    def synthetic_val(self) -> Path:
        return self.root / "synthetic_val"

    @property
    def concept_stats(self) -> Path:
        return self.root / "concepts" / "concepts.json"
