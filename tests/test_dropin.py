"""IMBA dropped into a training loop written the way diffusers' example scripts write one, not train.py's.

`stock_loop` is such a loop for a PixArt transformer: real tiny `PixArtTransformer2DModel` (learned sigma, so
8 output channels for 4 latent ones), a random tiny T5 encoder with `ByT5Tokenizer`, a tiny `AutoencoderKL`,
`DDPMScheduler`, min-SNR weights from `diffusers.training_utils.compute_snr`, `Accelerator(mixed_precision="bf16")`
on the CPU. The lines marked `# IMBA` are the README's drop-in ("IMBA in your own training loop"); the lines
marked `# probe` are this test's instruments. It runs in one process here and in two (gloo, spawned) in the slow
tier, with both estimators, and checks what a user of the drop-in relies on:

- the losses are finite and the stats log as they are (scalars only, per-sample tensors apart);
- the unconditional model trains: the null caption's embeddings are a tensor that only the unconditional path
  reads, so their gradient is non-zero after every literal step and after exactly the efficient steps that
  dropped a row (a loss that detached the unconditional prediction, or read it from a no-grad pass, gives 0);
- the running state (`normalize="timestep_mean"`) goes through `accelerator.save_state` / `load_state`, and with
  two processes it is the same on both (reduced over ranks without being asked), as are the weights.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import torch

B = 4  # images per process and step
MAX_LEN = 16  # the script's caption length (byte-level tokens)
STEPS = 4
CAPTIONS = ["a red circle", "a blue square", "two green stars", "a yellow cross", "a cat", "an orange ring"]


def tiny_parts():
    """The frozen encoders and the transformer, random and tiny, built offline."""
    from diffusers import AutoencoderKL, DDPMScheduler, PixArtTransformer2DModel
    from transformers import ByT5Tokenizer, T5Config, T5EncoderModel

    tokenizer = ByT5Tokenizer()
    text_encoder = T5EncoderModel(T5Config(vocab_size=384, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4,
                                           feed_forward_proj="gated-gelu", is_encoder_decoder=False))
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), layers_per_block=1,
                        latent_channels=4, norm_num_groups=4, sample_size=16)
    transformer = PixArtTransformer2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8,
                                           num_layers=1, cross_attention_dim=16, sample_size=8, patch_size=2,
                                           caption_channels=32, use_additional_conditions=False)
    noise_scheduler = DDPMScheduler(num_train_timesteps=1000, beta_schedule="linear", beta_start=1e-4, beta_end=0.02)
    return tokenizer, text_encoder.eval().requires_grad_(False), vae.eval().requires_grad_(False), transformer, \
        noise_scheduler


def stock_loop(estimator: str, out: Path, steps: int = STEPS, snr_gamma: float = 5.0) -> dict:
    """A diffusers-style PixArt training loop with the IMBA drop-in; returns what the probes saw."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from diffusers.training_utils import compute_snr

    from imba import IMBALoss, NullCaption  # IMBA

    accelerator = Accelerator(mixed_precision="bf16", cpu=True)
    set_seed(0)  # the same initial weights on every process
    tokenizer, text_encoder, vae, transformer, noise_scheduler = tiny_parts()
    optimizer = torch.optim.AdamW(transformer.parameters(), lr=1e-3)
    loss_fn = IMBALoss.for_transformer(transformer, lam=0.5, normalize="timestep_mean")  # IMBA
    null = NullCaption.encode(tokenizer, text_encoder, max_length=MAX_LEN).to(accelerator.device)  # IMBA
    accelerator.register_for_checkpointing(loss_fn)  # IMBA
    transformer, optimizer = accelerator.prepare(transformer, optimizer)
    null.embeds.requires_grad_(True)  # probe: only the unconditional path reads the null caption
    data = torch.Generator().manual_seed(100 + accelerator.process_index)  # each process its own images
    torch.manual_seed(200 + accelerator.process_index)  # and its own noise, timesteps and caption dropout

    seen = {"world_size": accelerator.num_processes, "losses": [], "null_grad": [], "dropped": [], "stats": []}
    for step in range(steps):
        pixel_values = torch.rand(B, 3, 16, 16, generator=data) * 2 - 1
        captions = [CAPTIONS[i] for i in torch.randint(len(CAPTIONS), (B,), generator=data).tolist()]
        transformer.train()
        with accelerator.accumulate(transformer):
            with torch.no_grad():
                latents = vae.encode(pixel_values).latent_dist.sample() * vae.config.scaling_factor
                text = tokenizer(captions, padding="max_length", max_length=MAX_LEN, truncation=True,
                                 return_tensors="pt")
                prompt_embeds = text_encoder(text.input_ids, attention_mask=text.attention_mask)[0]
                prompt_attention_mask = text.attention_mask
            noise = torch.randn_like(latents)
            bsz = latents.shape[0]
            timesteps = torch.randint(0, noise_scheduler.config.num_train_timesteps, (bsz,)).long()
            noisy_latents = noise_scheduler.add_noise(latents, noise, timesteps)
            target = noise
            added_cond_kwargs = {"resolution": None, "aspect_ratio": None}
            snr = compute_snr(noise_scheduler, timesteps)
            mse_loss_weights = torch.stack([snr, snr_gamma * torch.ones_like(timesteps)], dim=1).min(dim=1)[0] / snr
            if estimator == "literal":
                prompt_embeds, prompt_attention_mask = null.cat(prompt_embeds, prompt_attention_mask)  # IMBA
                model_pred = transformer(noisy_latents.repeat(2, 1, 1, 1), timestep=timesteps.repeat(2),  # IMBA
                                         encoder_hidden_states=prompt_embeds,
                                         encoder_attention_mask=prompt_attention_mask,
                                         added_cond_kwargs=added_cond_kwargs).sample
                model_pred = model_pred.chunk(2, dim=1)[0]  # learned sigma
                loss, stats = loss_fn(*model_pred.chunk(2), target, timesteps=timesteps,  # IMBA
                                      sample_weights=mse_loss_weights)
                dropped = False
            else:
                drop = loss_fn.draw_drop_mask(bsz)  # IMBA
                prompt_embeds, prompt_attention_mask = null.where(drop, prompt_embeds, prompt_attention_mask)  # IMBA
                model_pred = transformer(noisy_latents, timestep=timesteps, encoder_hidden_states=prompt_embeds,
                                         encoder_attention_mask=prompt_attention_mask,
                                         added_cond_kwargs=added_cond_kwargs).sample
                model_pred = model_pred.chunk(2, dim=1)[0]  # learned sigma
                with torch.no_grad(): uncond = transformer(noisy_latents, timestep=timesteps, **null.kwargs(bsz), added_cond_kwargs=added_cond_kwargs).sample.chunk(2, dim=1)[0]  # IMBA  # noqa: E501, E701
                loss, stats = loss_fn(model_pred, loss_fn.efficient_uncond(model_pred, uncond, drop), target,  # IMBA
                                      drop=drop, timesteps=timesteps, sample_weights=mse_loss_weights)
                dropped = bool(drop.any())
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        grad = null.embeds.grad  # probe
        seen["null_grad"].append(0.0 if grad is None else grad.abs().sum().item())
        null.embeds.grad = None
        seen["dropped"].append(dropped)
        seen["losses"].append(loss.item())
        seen["stats"].append({"floats": stats.floats(), "scalar_dims": sorted({v.dim() for v in stats.values()}),
                              "tensors": {k: list(v.shape) for k, v in stats.tensors.items()}})

    seen["means"] = loss_fn.state_dict()["timestep_mean"]["means"].tolist()
    seen["weights"] = sum(p.detach().double().sum().item() for p in transformer.parameters())
    # the loss's running state travels with the script's own checkpoints
    accelerator.save_state(str(out / f"state_{estimator}"))
    accelerator.wait_for_everyone()  # written by the main process, read by all
    saved = loss_fn.state_dict()
    loss_fn.timestep_mean.means = torch.zeros_like(loss_fn.timestep_mean.means)
    accelerator.load_state(str(out / f"state_{estimator}"))
    seen["state_restored"] = all(torch.equal(saved["timestep_mean"][k], loss_fn.state_dict()["timestep_mean"][k])
                                 for k in ("means", "seen"))
    accelerator.wait_for_everyone()
    return seen


def check(seen: dict, estimator: str, world_size: int) -> None:
    assert seen["world_size"] == world_size
    assert all(torch.isfinite(torch.tensor(seen["losses"]))), seen["losses"]
    for row in seen["stats"]:
        assert row["scalar_dims"] == [0], row  # the mapping logs as it is
        assert row["tensors"] == {"distance_per_sample": [B], "distance_per_token": [B, 16],
                                  "loss_cond_per_sample": [B]}
        floats = row["floats"]
        for key in ("loss", "loss_uncond", "weight_mean", "weight_std", "distance_mean"):
            assert isinstance(floats[key], float) and floats[key] == floats[key], (key, floats)
        assert ("caption_dropout_rate" in floats) == (estimator == "efficient")
    if estimator == "literal":
        assert all(g > 0 for g in seen["null_grad"]), seen["null_grad"]
    else:
        assert any(seen["dropped"]), "no efficient step dropped a row: nothing was checked"
        assert [g > 0 for g in seen["null_grad"]] == seen["dropped"], (seen["null_grad"], seen["dropped"])
    assert seen["state_restored"]
    assert sum(m != 1.0 for m in seen["means"]) >= 1  # the timestep means did move


@pytest.fixture
def fresh_accelerate_state():
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


@pytest.mark.parametrize("estimator", ["literal", "efficient"])
def test_stock_loop_one_process(estimator, tmp_path, fresh_accelerate_state):
    check(stock_loop(estimator, tmp_path), estimator, world_size=1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _process(rank: int, world_size: int, port: int, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    for estimator in ("literal", "efficient"):
        seen = stock_loop(estimator, Path(out))
        seen["rank"] = torch.distributed.get_rank()
        seen["group_size"] = torch.distributed.get_world_size()
        (Path(out) / f"{estimator}_{rank}.json").write_text(json.dumps(seen))
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_stock_loop_two_processes(tmp_path):
    """Two gloo processes: DDP around both passes of either estimator, the timestep means reduced over ranks."""
    torch.multiprocessing.start_processes(_process, args=(2, _free_port(), str(tmp_path)), nprocs=2,
                                          start_method="spawn")
    for estimator in ("literal", "efficient"):
        ranks = [json.loads((tmp_path / f"{estimator}_{r}.json").read_text()) for r in range(2)]
        assert [r["rank"] for r in ranks] == [0, 1] and {r["group_size"] for r in ranks} == {2}
        for seen in ranks:
            check(seen, estimator, world_size=2)
        assert ranks[0]["losses"] != ranks[1]["losses"]  # each process trained on its own batches ...
        assert ranks[0]["means"] == ranks[1]["means"]  # ... and holds the same timestep means
        assert ranks[0]["weights"] == pytest.approx(ranks[1]["weights"], rel=1e-12)  # and the same weights
