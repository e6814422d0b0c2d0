"""IMBA: concept-balancing loss for diffusion training (arXiv 2507.13345), usable from any training loop."""

from imba.loss import IMBALoss, patchify, plain_loss, token_distance

__all__ = ["IMBALoss", "patchify", "plain_loss", "token_distance"]
