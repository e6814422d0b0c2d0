"""IMBA: concept-balancing loss for diffusion training (arXiv 2507.13345), usable from any training loop.

Everything imported here needs torch alone (the install without extras); this repository's training stack
(`imba.training`, `imba.eval`, train.py) comes with the `train` extra. From a script of your own: docs/loss.md.
"""

import importlib

# name -> the module that defines it, imported on first use: the training config (`imba.training.config`, and so
# `train.py --help` and config errors) reads the loss's settings without importing torch
_MODULE_OF = {"NullCaption": "imba.captions",
              **dict.fromkeys(["ImbaTrainingLoss", "PlainTrainingLoss", "TrainingLoss"], "imba.training_loss"),
              **dict.fromkeys(["IMBALoss", "LossStats", "TimestepMean", "patchify", "plain_loss", "token_distance"],
                              "imba.loss")}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module 'imba' has no attribute {name!r}")
    return getattr(importlib.import_module(_MODULE_OF[name]), name)
