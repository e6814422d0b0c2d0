"""IMBA: concept-balancing loss for diffusion training (arXiv 2507.13345), usable from any training loop.

Everything imported here needs torch alone (the install without extras); this repository's training stack
(`imba.training`, `imba.eval`, train.py) comes with the `train` extra. From a script of your own: docs/loss.md.
"""

from imba.captions import NullCaption
from imba.loss import IMBALoss, LossStats, TimestepMean, patchify, plain_loss, token_distance
from imba.training_loss import TrainingLoss

__all__ = ["IMBALoss", "LossStats", "NullCaption", "TimestepMean", "TrainingLoss", "patchify", "plain_loss",
           "token_distance"]
