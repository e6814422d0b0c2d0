"""The training infrastructure around the method: config, the accelerator and distributed modes, building the
run's parts, inputs, resume, checkpoints, EMA, metrics, pre-emption, the divergence guard, sample grids, export
and the sampling command. `train.py` calls these in order; nothing here is needed to use the loss (`imba`).
`shapes_vae` trains the shipped shapes VAE (`python -m imba.training.shapes_vae`)."""

import importlib.util as _util

if _util.find_spec("data") is None or _util.find_spec("models") is None:  # what a checkout has beside imba/
    raise ImportError("imba.training is the trainer of a checkout of this repository: run it from the checkout's "
                      "root (python train.py, python -m imba.training....), where data/ and models/ are; "
                      "`pip install .` installs the loss alone (`from imba import IMBALoss`)")
