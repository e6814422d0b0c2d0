"""The training infrastructure around the method: config, the accelerator and distributed modes, building the
run's parts, inputs, resume, checkpoints, EMA, metrics, pre-emption, the divergence guard, sample grids, export
and the sampling command. `train.py` calls these in order; nothing here is needed to use the loss (`imba`).
`shapes_vae` trains the shipped shapes VAE (`python -m imba.training.shapes_vae`)."""
