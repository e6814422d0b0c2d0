"""What a sample grid costs the main process's memory: the prompts encoded once when the run starts, with no text
encoder kept; each grid only its EMA copy in the training dtype and its decode, all freed when the grid is written.

Measured without a GPU and without timing: every tensor storage an operator allocates while a `LiveBytes` is active is
counted from its creation until it is freed (a weak reference on the storage), which gives the bytes the measured
code holds at its peak and at its end, on whatever device they would be. Tensors read from files or made from Python
data are not seen; the models here are built by operators (the tiny T5 and VAE, a preset DiT).
"""

from __future__ import annotations

import weakref
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from imba.training.build import build_dit, load_encoders, load_vae_alone
from imba.training.config import load_config
from imba.training.ema import ema_weights_copy, make_ema
from imba.training.sampling import GridSampler
from models.dit import build_transformer
from models.lora import add_lora, has_lora, merged_state_dict

CPU = torch.device("cpu")
# DiT-S/2 widths (30M parameters) at 64 px with 4 prompts: the EMA copy (57 MiB in bf16) outweighs the decode and
# the sampling passes, so a copy built in float32, or anything kept, shows
SETTINGS = ["train.mixed_precision=bf16", "model.preset=small", "data.resolution=64", "sample.steps=2",
            "model.vae=tiny", "sample.prompts=[a red circle, a blue square, a green triangle, a yellow star]"]


class LiveBytes(TorchDispatchMode):
    """The bytes of the tensor storages created while active and still alive (`now`), and their most (`peak`)."""

    def __init__(self) -> None:
        super().__init__()
        self.now = self.peak = 0
        self.alive: dict[int, weakref.ref] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(r.alias_info is not None for r in func._schema.returns):
            return out  # a view, an in-place or out= op: memory that exists already, or is counted where made
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta":
                self.count(tensor.untyped_storage())
        return out

    def count(self, storage) -> None:
        key = storage._cdata
        if key in self.alive:
            return
        size = storage.nbytes()
        self.now += size
        self.peak = max(self.peak, self.now)
        self.alive[key] = weakref.ref(storage, lambda _, key=key, size=size: self.freed(key, size))

    def freed(self, key: int, size: int) -> None:
        del self.alive[key]
        self.now -= size


def storage_bytes(tensors) -> int:
    return sum({t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}.values())


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    cfg = load_config([*SETTINGS, f"train.output_dir={tmp_path_factory.mktemp('run')}"])
    encoders = load_encoders(cfg, CPU)
    dit = build_dit(cfg, encoders)
    return cfg, encoders, dit, make_ema(dit.parameters())


def modules_run(during):
    """The classes of the modules whose forward ran during `during()`."""
    ran = set()
    handle = torch.nn.modules.module.register_module_forward_hook(lambda module, *_: ran.add(type(module).__name__))
    try:
        during()
    finally:
        handle.remove()
    return ran


def decode_and_pass_peaks(cfg, dit, ema, embeddings) -> tuple[int, int]:
    """What a grid needs besides its EMA copy, measured alone as the pipeline runs it (bf16 DiT, float32 VAE:
    under bf16 autocast): the VAE loaded and decoding the grid's latents; one guided sampling pass of the DiT."""
    n, size = len(cfg.sample.prompts), cfg.data.resolution // 8
    latents = torch.randn(n, 4, size, size)
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        with LiveBytes() as decode:
            vae = load_vae_alone(cfg, CPU)
            vae.decode(latents / vae.config.scaling_factor).sample.float().cpu().numpy()
            del vae
        copy = ema_weights_copy(dit, ema, dtype=torch.bfloat16)
        text = torch.cat([embeddings["negative_prompt_embeds"], embeddings["prompt_embeds"]]).to(torch.bfloat16)
        mask = torch.cat([embeddings["negative_prompt_attention_mask"], embeddings["prompt_attention_mask"]])
        with LiveBytes() as one_pass:
            copy(torch.cat([latents] * 2).to(torch.bfloat16), encoder_hidden_states=text, encoder_attention_mask=mask,
                 timestep=torch.full((2 * n,), 500), added_cond_kwargs={"resolution": None, "aspect_ratio": None})
    return decode.peak, one_pass.peak


def test_on_precomputed_features_the_prompts_are_encoded_at_the_start_and_the_text_encoder_freed(run):
    cfg, _, _, _ = run
    with LiveBytes() as start:
        sampler = GridSampler(cfg, cfg.objective.build(), CPU, True, encoders=None)
    embeddings = sampler.embeddings
    assert set(embeddings) == {"prompt_embeds", "prompt_attention_mask", "negative_prompt_embeds",
                               "negative_prompt_attention_mask"}
    assert embeddings["prompt_embeds"].shape[:2] == (len(cfg.sample.prompts), cfg.model.max_text_tokens)
    assert all(t.device == CPU for t in embeddings.values())
    assert start.peak > start.now  # the text encoder was there, for the encoding
    assert start.now == storage_bytes(embeddings.values())  # and only the embeddings outlive it


@pytest.mark.parametrize("precomputed", [True, False], ids=["precomputed-features", "run-encoders"])
def test_a_grid_adds_its_copy_in_the_training_dtype_and_its_decode_then_nothing(run, precomputed):
    cfg, encoders, dit, ema = run
    sampler = GridSampler(cfg, cfg.objective.build(), CPU, True, encoders=None if precomputed else encoders)
    decode, one_pass = decode_and_pass_peaks(cfg, dit, ema, sampler.embeddings)
    copy = sum(p.numel() for p in dit.parameters()) * torch.bfloat16.itemsize  # train.mixed_precision=bf16
    assert decode + one_pass < copy / 2  # else a copy in float32 could hide in the margin

    with LiveBytes() as grid:
        ran = modules_run(lambda: sampler.grid(dit, ema, step=7))
    assert (Path(cfg.train.output_dir) / "samples" / "step_0000007.png").is_file()
    assert "PixArtTransformer2DModel" in ran and "AutoencoderKL" not in ran  # the VAE decodes: its decoder runs
    assert "Decoder" in ran and not any(name.startswith("T5") for name in ran)  # the prompts were encoded before
    assert grid.now == 0, f"{grid.now} bytes of the grid outlive it"
    assert copy <= grid.peak <= copy + decode + one_pass, (grid.peak, copy, decode, one_pass)


def test_the_export_gets_every_frozen_part_in_float32_on_the_cpu_and_the_sampler_keeps_none(run):
    cfg, _, dit, ema = run
    sampler = GridSampler(cfg, cfg.objective.build(), CPU, True, encoders=None)
    with LiveBytes() as export:
        model = sampler.save(dit, ema, step=8)  # the last grid, then the export's copy
        parts = sampler.pipeline_parts()
        assert {parts["text_encoder"].dtype, parts["vae"].dtype, model.dtype} == {torch.float32}
        assert {parts["text_encoder"].device, parts["vae"].device, model.device} == {CPU}
        assert all(torch.equal(p, s) for p, s in zip(model.parameters(), ema.shadow_params, strict=True))
        del model, parts
    assert export.now == 0, f"{export.now} bytes outlive the export's parts"


def test_a_copy_is_the_ema_rounded_to_its_dtype_and_never_shares_the_ema_s_tensors(run):
    _, _, dit, ema = run
    half = ema_weights_copy(dit, ema, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in half.parameters())
    assert all(torch.equal(p, s.to(torch.bfloat16)) for p, s in zip(half.parameters(), ema.shadow_params))
    assert all(b.dtype == torch.bfloat16 for b in half.buffers())  # as `.to(bfloat16)` gives them
    full = ema_weights_copy(dit, ema)
    before = [p.clone() for p in full.parameters()]
    shadows = [s.clone() for s in ema.shadow_params]
    try:
        for s in ema.shadow_params:  # what the next EMA step does: in place
            s.add_(1.0)
        assert all(torch.equal(p, b) for p, b in zip(full.parameters(), before))
    finally:
        for s, old in zip(ema.shadow_params, shadows):
            s.copy_(old)
    buffers = dict(dit.named_buffers())
    assert all(torch.equal(b, buffers[name]) for name, b in full.named_buffers())  # the positional table


def test_a_lora_model_s_copy_is_a_stock_transformer_with_the_merged_ema_weights_in_its_dtype():
    model = add_lora(build_transformer("micro", 4, 8, in_channels=4), rank=4, alpha=8, targets=["to_q", "ff.net.2"])
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:  # B = 0 at the start: merging would add nothing
                p.normal_()
    ema = make_ema(model.parameters())
    with torch.no_grad():
        for p in model.parameters():  # the trained weights move on: the copy holds the EMA's
            p.add_(1.0)
    copy = ema_weights_copy(model, ema, dtype=torch.bfloat16)
    merged = merged_state_dict(model, ema.shadow_params)
    assert not has_lora(copy) and copy.state_dict().keys() == merged.keys()
    assert all(torch.equal(t, merged[name].to(torch.bfloat16)) for name, t in copy.state_dict().items())
