"""IMBA dropped into a training loop written the way diffusers' example scripts write one, not train.py's.

`stock_loop` is such a loop for a PixArt transformer, modelled on PixArt-Σ's LoRA script
(`train_scripts/train_pixart_lora_hf.py`): its flags (`SCRIPT_FLAGS`: 300-token captions, micro-conditions,
min-SNR, caption dropout), a real tiny `PixArtTransformer2DModel` (learned sigma, so 8 output channels for 4 latent
ones; resolution and aspect-ratio conditions), a random tiny T5 encoder with `ByT5Tokenizer`, a tiny
`AutoencoderKL`, `DDPMScheduler`, min-SNR weights from `diffusers.training_utils.compute_snr`,
`Accelerator(mixed_precision="bf16")` on the CPU, and its `save_state` / `load_state` checkpoints. The lines marked
`# IMBA` are docs/loss.md's PixArt drop-in with min-SNR weights (`tests/test_loss_scripts.py` runs the page's lines
as they are written); the lines marked `# probe` are this test's instruments. It runs in one process here and in two (gloo, spawned) in the slow tier, with both estimators, and
checks what a user of the drop-in relies on:

- the losses are finite and the stats log as they are (scalars only, per-sample tensors apart), with the
  micro-conditions on or off;
- the unconditional model trains: the null caption's embeddings are a tensor that only the unconditional path
  reads, so their gradient is non-zero after every literal step and after exactly the efficient steps that
  dropped a row (a loss that detached the unconditional prediction, or read it from a no-grad pass, gives 0);
- the script's own caption dropout, left on, is refused, whatever length the null caption was encoded at;
- the running state (`normalize="timestep_mean"`) goes through `accelerator.save_state` / `load_state`, and with
  two processes it is the same on both (reduced over ranks without being asked), as are the weights;
- a checkpoint of the plain script, saved before IMBA was added, resumes with IMBA set up as the README says.
"""

from __future__ import annotations

import json
import os
import random
import socket
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

B = 4  # images per process and step
STEPS = 4
CAPTIONS = ["a red circle", "a blue square", "two green stars", "a yellow cross", "a cat", "an orange ring"]
# the script's command-line flags that the drop-in meets (its defaults, micro-conditions on as for
# PixArt-XL-2-1024-MS); captions are byte-level tokens here
SCRIPT_FLAGS = {"max_token_length": 300, "micro_conditions": True, "resolution": 16, "snr_gamma": 5.0,
                "proportion_empty_prompts": 0.0}


def tiny_parts(micro_conditions: bool = True):
    """The frozen encoders and the transformer, random and tiny, built offline. With `micro_conditions` the
    transformer embeds `added_cond_kwargs` (resolution, aspect ratio), as PixArt-XL-2-1024-MS does."""
    from diffusers import AutoencoderKL, DDPMScheduler, PixArtTransformer2DModel
    from transformers import ByT5Tokenizer, T5Config, T5EncoderModel

    tokenizer = ByT5Tokenizer()
    text_encoder = T5EncoderModel(T5Config(vocab_size=384, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4,
                                           feed_forward_proj="gated-gelu", is_encoder_decoder=False))
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), layers_per_block=1,
                        latent_channels=4, norm_num_groups=4, sample_size=16)
    # 24 channels: the size conditions take a third each (two for the resolution, one for the aspect ratio)
    transformer = PixArtTransformer2DModel(num_attention_heads=2, attention_head_dim=12, in_channels=4,
                                           out_channels=8, num_layers=1, cross_attention_dim=24, sample_size=8,
                                           patch_size=2, caption_channels=32,
                                           use_additional_conditions=micro_conditions)
    noise_scheduler = DDPMScheduler(num_train_timesteps=1000, beta_schedule="linear", beta_start=1e-4, beta_end=0.02)
    return tokenizer, text_encoder.eval().requires_grad_(False), vae.eval().requires_grad_(False), transformer, \
        noise_scheduler


def stock_loop(estimator: str, out: Path, steps: int = STEPS, resume_from: Path | None = None,
               null_length: int | None = None, **flags) -> dict:
    """A diffusers-style PixArt training loop, with the IMBA drop-in ("literal", "efficient") or as the script
    ships ("plain": its own caption dropout and MSE); returns what the probes saw. `flags` override
    `SCRIPT_FLAGS`; `resume_from`: a checkpoint to `load_state` after `prepare`, as the script's
    `--resume_from_checkpoint` does; `null_length`: encode the null caption at this length instead of the
    script's. Saves its own checkpoint to `out / f"state_{estimator}"`."""
    import torch.nn.functional as F
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from diffusers.training_utils import compute_snr

    from imba import IMBALoss, NullCaption  # IMBA

    args = SimpleNamespace(**{**SCRIPT_FLAGS, **flags})
    imba = estimator != "plain"
    accelerator = Accelerator(mixed_precision="bf16", cpu=True)
    set_seed(0)  # the same initial weights on every process
    tokenizer, text_encoder, vae, transformer, noise_scheduler = tiny_parts(args.micro_conditions)
    optimizer = torch.optim.AdamW(transformer.parameters(), lr=1e-3)
    if imba:
        loss_fn = IMBALoss.for_transformer(transformer, lam=0.5, normalize="timestep_mean")  # IMBA
        null = NullCaption.encode(tokenizer, text_encoder,  # IMBA
                                  max_length=args.max_token_length if null_length is None else null_length)
        null = null.to(accelerator.device)  # IMBA
        loss_fn.checkpoint_with(accelerator)  # IMBA
    transformer, optimizer = accelerator.prepare(transformer, optimizer)
    seen = {"world_size": accelerator.num_processes, "losses": [], "null_grad": [], "dropped": [], "stats": []}
    if resume_from is not None:
        accelerator.load_state(str(resume_from))
        seen["resumed_weights"] = sum(p.detach().double().sum().item() for p in transformer.parameters())  # probe
        if imba:
            seen["resumed_state"] = {k: v.tolist() for k, v in loss_fn.state_dict()["timestep_mean"].items()}  # probe
    if imba:
        null.embeds.requires_grad_(True)  # probe: only the unconditional path reads the null caption
    data = torch.Generator().manual_seed(100 + accelerator.process_index)  # each process its own images
    torch.manual_seed(200 + accelerator.process_index)  # and its own noise, timesteps and caption dropout
    empty_prompts = random.Random(300 + accelerator.process_index)  # the script's dropout draws with `random`

    for step in range(steps):
        pixel_values = torch.rand(B, 3, args.resolution, args.resolution, generator=data) * 2 - 1
        captions = [CAPTIONS[i] for i in torch.randint(len(CAPTIONS), (B,), generator=data).tolist()]
        captions = ["" if empty_prompts.random() < args.proportion_empty_prompts else c for c in captions]
        transformer.train()
        with accelerator.accumulate(transformer):
            with torch.no_grad():
                latents = vae.encode(pixel_values).latent_dist.sample() * vae.config.scaling_factor
                text = tokenizer(captions, padding="max_length", max_length=args.max_token_length, truncation=True,
                                 return_tensors="pt")
                prompt_embeds = text_encoder(text.input_ids, attention_mask=text.attention_mask)[0]
                prompt_attention_mask = text.attention_mask
            noise = torch.randn_like(latents)
            bsz = latents.shape[0]
            timesteps = torch.randint(0, noise_scheduler.config.num_train_timesteps, (bsz,)).long()
            noisy_latents = noise_scheduler.add_noise(latents, noise, timesteps)
            target = noise
            added_cond_kwargs = {"resolution": None, "aspect_ratio": None}
            if args.micro_conditions:
                resolution = torch.tensor([args.resolution, args.resolution]).repeat(bsz, 1).float()
                aspect_ratio = torch.tensor([float(args.resolution / args.resolution)]).repeat(bsz, 1)
                added_cond_kwargs = {"resolution": resolution, "aspect_ratio": aspect_ratio}
            snr = compute_snr(noise_scheduler, timesteps)
            mse_loss_weights = \
                torch.stack([snr, args.snr_gamma * torch.ones_like(timesteps)], dim=1).min(dim=1)[0] / snr
            dropped = False
            if estimator == "plain":
                model_pred = transformer(noisy_latents, timestep=timesteps, encoder_hidden_states=prompt_embeds,
                                         encoder_attention_mask=prompt_attention_mask,
                                         added_cond_kwargs=added_cond_kwargs).sample.chunk(2, 1)[0]
                loss = F.mse_loss(model_pred.float(), target.float(), reduction="none")
                loss = (loss.mean(dim=list(range(1, len(loss.shape)))) * mse_loss_weights).mean()
            elif estimator == "literal":
                embeds, mask = null.cat(prompt_embeds, prompt_attention_mask)  # IMBA
                cond_kwargs = null.repeat_rows(added_cond_kwargs)  # IMBA
                model_pred = transformer(noisy_latents.repeat(2, 1, 1, 1), timestep=timesteps.repeat(2),  # IMBA
                                         encoder_hidden_states=embeds, encoder_attention_mask=mask,
                                         added_cond_kwargs=cond_kwargs).sample
                model_pred = model_pred.chunk(2, dim=1)[0]  # learned sigma
                loss, stats = loss_fn(*model_pred.chunk(2), target, timesteps=timesteps,  # IMBA
                                      sample_weights=mse_loss_weights)
            else:
                drop = loss_fn.draw_drop_mask(bsz, device=latents.device)  # IMBA
                embeds, mask = null.where(drop, prompt_embeds, prompt_attention_mask)  # IMBA
                model_pred = transformer(noisy_latents, timestep=timesteps, encoder_hidden_states=embeds,  # IMBA
                                         encoder_attention_mask=mask, added_cond_kwargs=added_cond_kwargs).sample
                model_pred = model_pred.chunk(2, dim=1)[0]  # learned sigma
                with torch.no_grad():  # IMBA
                    uncond = transformer(noisy_latents, timestep=timesteps, **null.kwargs(bsz),  # IMBA
                                         added_cond_kwargs=added_cond_kwargs).sample.chunk(2, dim=1)[0]
                pred_uncond = loss_fn.efficient_uncond(model_pred, uncond, drop)  # IMBA
                loss, stats = loss_fn(model_pred, pred_uncond, target, drop=drop, timesteps=timesteps,  # IMBA
                                      sample_weights=mse_loss_weights)
                dropped = bool(drop.any())
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        seen["losses"].append(loss.item())
        if imba:
            grad = null.embeds.grad  # probe
            seen["null_grad"].append(0.0 if grad is None else grad.abs().sum().item())
            null.embeds.grad = None
            seen["dropped"].append(dropped)
            seen["stats"].append({"floats": stats.floats(), "scalar_dims": sorted({v.dim() for v in stats.values()}),
                                  "tensors": {k: list(v.shape) for k, v in stats.tensors.items()}})

    seen["weights"] = sum(p.detach().double().sum().item() for p in transformer.parameters())
    accelerator.save_state(str(out / f"state_{estimator}"))
    accelerator.wait_for_everyone()  # written by the main process, read by all
    if imba:
        # the loss's running state travels with the script's own checkpoints
        seen["means"] = loss_fn.state_dict()["timestep_mean"]["means"].tolist()
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
            key = f"imba/{key}"
            assert isinstance(floats[key], float) and floats[key] == floats[key], (key, floats)
        assert ("imba/caption_dropout_rate" in floats) == (estimator == "efficient")
    if estimator == "literal":
        assert all(g > 0 for g in seen["null_grad"]), seen["null_grad"]
    else:
        assert any(seen["dropped"]), "no efficient step dropped a row: nothing was checked"
        assert [g > 0 for g in seen["null_grad"]] == seen["dropped"], (seen["null_grad"], seen["dropped"])
    assert seen["state_restored"]
    assert sum(m != 1.0 for m in seen["means"]) >= 1  # the timestep means did move


def reset_accelerate() -> None:
    """A fresh accelerate state, as a new run of the script starts with."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)


@pytest.fixture
def fresh_accelerate_state():
    reset_accelerate()
    yield
    reset_accelerate()


@pytest.mark.parametrize("micro_conditions", [True, False], ids=["micro_conditions", "no_micro_conditions"])
@pytest.mark.parametrize("estimator", ["literal", "efficient"])
def test_stock_loop_one_process(estimator, micro_conditions, tmp_path, fresh_accelerate_state):
    check(stock_loop(estimator, tmp_path, micro_conditions=micro_conditions), estimator, world_size=1)


@pytest.mark.parametrize("estimator", ["literal", "efficient"])
@pytest.mark.parametrize("script_length, null_length", [(300, 120), (120, 300), (300, 300)])
def test_the_scripts_own_caption_dropout_is_refused_at_any_length(estimator, script_length, null_length, tmp_path,
                                                                   fresh_accelerate_state):
    """`--proportion_empty_prompts` left on: its empty captions are refused, also when the null caption was
    encoded at another length than the script's captions (their padding positions differ, the attended one
    does not)."""
    with pytest.raises(ValueError, match=r"already are the null caption .*--proportion_empty_prompts 0"):
        stock_loop(estimator, tmp_path, null_length=null_length, max_token_length=script_length,
                   proportion_empty_prompts=0.5)


def test_imba_starts_from_a_checkpoint_of_the_plain_script(tmp_path, fresh_accelerate_state):
    """The plain script's checkpoint (no loss state in it) resumes with IMBA set up as the README says: the
    transformer goes on from the saved weights and the loss starts fresh; IMBA's own checkpoints then carry the
    loss's state into the next resume."""
    plain = stock_loop("plain", tmp_path, proportion_empty_prompts=0.1)
    reset_accelerate()
    imba = stock_loop("literal", tmp_path, resume_from=tmp_path / "state_plain")
    assert imba["resumed_weights"] == plain["weights"]
    assert imba["resumed_state"] == {"means": [1.0] * 10, "seen": [False] * 10}  # nothing to resume: a fresh loss
    check(imba, "literal", world_size=1)
    reset_accelerate()
    again = stock_loop("efficient", tmp_path, steps=1, resume_from=tmp_path / "state_literal")
    assert again["resumed_weights"] == imba["weights"]
    assert again["resumed_state"]["means"] == imba["means"] and any(again["resumed_state"]["seen"])


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
