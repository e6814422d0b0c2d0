"""The snippets of docs/loss.md, read from the page, run in training loops built as diffusers' scripts build theirs.

Two families, each with the classes its scripts use, at tiny sizes:

- PixArt (ε-prediction): `PixArtTransformer2DModel` with learned sigma and micro-conditions, `DDPMScheduler`, a T5
  encoder in bf16, the transformer in fp32 under `Accelerator(mixed_precision="bf16")`, as PixArt-Σ's LoRA script;
- flow matching: `SanaTransformer2DModel` in fp32 without autocast, `FlowMatchEulerDiscreteScheduler`'s timesteps
  and sigmas, `compute_density_for_timestep_sampling` and `compute_loss_weighting_for_sd3`, a Gemma-2 encoder in
  bf16 behind `SanaPipeline.encode_prompt`, whose embeddings the script casts to the transformer's dtype, as
  diffusers' Sana DreamBooth LoRA script.

Each loop runs the page's set-up snippet after its text encoder is loaded and, when the prompt is encoded once
before the loop (DreamBooth's one-prompt mode), deletes the encoder right after, as that script does; then the
page's step snippet (the `+` side of its diff) at every step, in one namespace that lives across steps, as a
script's variables do. "script" runs the `-` side, the script as it ships, so the snippets' context lines are
checked to be a script's. The losses must be finite and every trained parameter must move. SD3's transformer
(no attention mask, pooled projections, preconditioned outputs) is run as the page's prose says, and README's
drop-in must be the page's PixArt snippets.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from doc_snippets import doc_snippets
from test_dropin import fresh_accelerate_state  # noqa: F401 (a fixture: a fresh accelerate state per loop)

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "loss.md"
B, STEPS = 2, 3
CAPTIONS = ["a red circle", "two blue squares", "a green star", "an orange ring"]


def snippets():
    return doc_snippets(PAGE)


def tiny_t5():
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(T5Config(vocab_size=384, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4,
                                   feed_forward_proj="gated-gelu", is_encoder_decoder=False))


def tiny_gemma():
    from transformers import Gemma2Config, Gemma2Model

    return Gemma2Model(Gemma2Config(vocab_size=384, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                    num_attention_heads=2, num_key_value_heads=1, head_dim=16))


def frozen_bf16(encoder):
    return encoder.to(torch.bfloat16).eval().requires_grad_(False)


class Family:
    """One script family: its parts, how it encodes prompts, and the variables its step starts from."""

    setup = literal = efficient = ""
    mixed_precision = "no"

    def build(self, args): ...

    def encode(self, ns, captions): ...

    def step_inputs(self, ns, args, generator) -> dict: ...


class PixArt(Family):
    setup, literal, efficient = "pixart-setup", "pixart-literal", "pixart-efficient"
    mixed_precision = "bf16"

    def build(self, args):
        from diffusers import DDPMScheduler, PixArtTransformer2DModel
        from transformers import ByT5Tokenizer

        transformer = PixArtTransformer2DModel(num_attention_heads=2, attention_head_dim=12, in_channels=4,
                                               out_channels=8, num_layers=1, cross_attention_dim=24, sample_size=8,
                                               patch_size=2, caption_channels=32, use_additional_conditions=True)
        return {"tokenizer": ByT5Tokenizer(), "text_encoder": frozen_bf16(tiny_t5()), "transformer": transformer,
                "noise_scheduler": DDPMScheduler(num_train_timesteps=1000)}

    def encode(self, ns, captions):
        text = ns["tokenizer"](captions, padding="max_length", max_length=ns["args"].max_token_length,
                               truncation=True, return_tensors="pt")
        with torch.no_grad():
            embeds = ns["text_encoder"](text.input_ids, attention_mask=text.attention_mask)[0]
        return {"prompt_embeds": embeds, "prompt_attention_mask": text.attention_mask}

    def step_inputs(self, ns, args, generator):
        latents = torch.randn(B, 4, 8, 8, generator=generator)
        noise = torch.randn(B, 4, 8, 8, generator=generator)
        size = torch.tensor([[64.0, 64.0]] * B)
        return {"latents": latents, "noise": noise, "bsz": B, "target": noise,
                "timesteps": torch.randint(0, 1000, (B,), generator=generator),
                "added_cond_kwargs": {"resolution": size, "aspect_ratio": torch.ones(B, 1)}}


class Sana(Family):
    setup, literal, efficient = "flow-setup", "flow-literal", "flow-efficient"

    def build(self, args):
        from diffusers import FlowMatchEulerDiscreteScheduler, SanaPipeline, SanaTransformer2DModel
        from transformers import ByT5Tokenizer

        tokenizer = ByT5Tokenizer(padding_side="left")  # as Gemma's: the pipeline pads right when it encodes
        text_encoder = frozen_bf16(tiny_gemma())
        scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
        transformer = SanaTransformer2DModel(in_channels=4, out_channels=4, num_attention_heads=2,
                                             attention_head_dim=8, num_layers=1, num_cross_attention_heads=2,
                                             cross_attention_head_dim=8, cross_attention_dim=16, caption_channels=32,
                                             sample_size=8, patch_size=1)
        pipeline = SanaPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=None, transformer=None,
                                scheduler=scheduler)
        return {"tokenizer": tokenizer, "text_encoder": text_encoder, "transformer": transformer,
                "text_encoding_pipeline": pipeline, "noise_scheduler_copy": scheduler}

    def encode(self, ns, captions):
        args = ns["args"]
        with torch.no_grad():
            embeds, mask, _, _ = ns["text_encoding_pipeline"].encode_prompt(
                captions, max_sequence_length=args.max_sequence_length,
                complex_human_instruction=args.complex_human_instruction)
        return {"prompt_embeds": embeds.to(ns["transformer"].dtype), "prompt_attention_mask": mask}

    def step_inputs(self, ns, args, generator):
        from diffusers.training_utils import compute_density_for_timestep_sampling

        scheduler = ns["noise_scheduler_copy"]
        model_input = torch.randn(B, 4, 8, 8, generator=generator)
        u = compute_density_for_timestep_sampling(weighting_scheme=args.weighting_scheme, batch_size=B,
                                                  logit_mean=0.0, logit_std=1.0, mode_scale=1.29,
                                                  generator=generator)
        indices = (u * scheduler.config.num_train_timesteps).long()
        return {"model_input": model_input, "noise": torch.randn(B, 4, 8, 8, generator=generator), "bsz": B,
                "timesteps": scheduler.timesteps[indices], "sigmas": scheduler.sigmas[indices].view(B, 1, 1, 1)}


FAMILIES = {"pixart": PixArt(), "sana": Sana()}
ARGS = {"pixart": SimpleNamespace(max_token_length=24),
        "sana": SimpleNamespace(max_sequence_length=20, weighting_scheme="cosmap",
                                complex_human_instruction=["Describe the image:", "<prompt>: "])}


def train(family_name: str, form: str, prompt_once: bool, steps: int = STEPS) -> dict:
    """The family's loop with `form` ("script": as it ships; "literal", "efficient": the page's drop-in)."""
    import torch.nn.functional as F
    from accelerate import Accelerator
    from diffusers.training_utils import compute_loss_weighting_for_sd3

    family, args = FAMILIES[family_name], ARGS[family_name]
    page = snippets()
    torch.manual_seed(0)
    accelerator = Accelerator(mixed_precision=family.mixed_precision, cpu=True)
    ns = {"torch": torch, "F": F, "compute_loss_weighting_for_sd3": compute_loss_weighting_for_sd3,
          "accelerator": accelerator, "args": args, **family.build(args)}
    if form != "script":
        exec(page[family.setup].after(), ns)  # after the text encoder is loaded
        ns["loss_fn"].lam = 0.5  # probe: rows dropped often enough that a few steps see both kinds
    generator = torch.Generator().manual_seed(1)
    if prompt_once:
        ns.update(family.encode(ns, CAPTIONS[:B]))
        once = {k: ns[k].clone() for k in ("prompt_embeds", "prompt_attention_mask")}
        for name in ("text_encoder", "tokenizer", "text_encoding_pipeline"):
            ns.pop(name, None)  # deleted, as DreamBooth's one-prompt mode deletes them before training
    transformer = ns["transformer"]
    optimizer = torch.optim.AdamW(transformer.parameters(), lr=1e-3)
    ns["transformer"], optimizer = accelerator.prepare(transformer, optimizer)
    start = [p.detach().clone() for p in transformer.parameters()]
    step_code = page[family.literal].before() if form == "script" else page[getattr(family, form)].after()
    seen = {"losses": [], "stats": [], "dropped": 0}
    for step in range(steps):
        if not prompt_once:
            ns.update(family.encode(ns, [CAPTIONS[(step + i) % len(CAPTIONS)] for i in range(B)]))
        ns.update(family.step_inputs(ns, args, generator))
        ns["transformer"].train()
        with accelerator.accumulate(ns["transformer"]):
            exec(step_code, ns)
            accelerator.backward(ns["loss"])
            optimizer.step()
            optimizer.zero_grad()
        seen["losses"].append(ns["loss"].item())
        if form != "script":
            seen["stats"].append(ns["stats"].floats())
        if form == "efficient":
            seen["dropped"] += int(ns["drop"].sum())
    if prompt_once:  # the script's own tensors, encoded once, are as they were
        assert all(torch.equal(ns[k], v) for k, v in once.items())
    seen["moved"] = [not torch.equal(a, p.detach()) for a, p in zip(start, transformer.parameters())]
    return seen


@pytest.mark.parametrize("prompt_once", [False, True], ids=["prompts_per_step", "prompt_once"])
@pytest.mark.parametrize("form", ["script", "literal", "efficient"])
@pytest.mark.parametrize("family", ["pixart", "sana"])
def test_the_pages_snippets_train_in_a_scripts_loop(family, form, prompt_once, fresh_accelerate_state):
    seen = train(family, form, prompt_once)
    assert all(torch.isfinite(torch.tensor(seen["losses"]))), seen["losses"]
    assert all(seen["moved"]), f"{seen['moved'].count(False)} of {len(seen['moved'])} parameters did not train"
    for stats in seen["stats"]:
        assert "imba/loss" in stats and all(name.startswith("imba/") for name in stats), stats
    if form == "efficient":
        assert 0 < seen["dropped"] < STEPS * B, "every step kept (or dropped) every row: one path went unchecked"


def test_the_page_names_both_forms_of_both_families():
    """The snippets the loops read exist, are a set-up (Python) and diffs of a step, and the step's change builds
    the conditioning into new names (the script's prompt_embeds may be encoded once, outside the loop)."""
    page = snippets()
    for family in FAMILIES.values():
        assert page[family.setup].language == "python" and "NullCaption.encode" in page[family.setup].text
        for name in (family.literal, family.efficient):
            assert page[name].language == "diff" and page[name].before() != page[name].after(), name
            added = [line for line in page[name].text.splitlines() if line.startswith("+")]
            assert not any(line[1:].lstrip().startswith(("prompt_embeds", "prompt_attention_mask"))
                           for line in added), (name, added)


def test_readme_shows_the_pages_pixart_snippets():
    """README's short version of the drop-in is the page's, block for block."""
    from test_docs import markdown_lines

    readme = REPO / "README.md"
    blocks, current, previous = [], [], None
    for number, text, language in markdown_lines(readme):
        if language in ("python", "diff"):
            if previous is None or number != previous + 1:
                current = []
                blocks.append(current)
            current.append(text)
            previous = number
    shown = ["\n".join(block) + "\n" for block in blocks]
    imba_blocks = [b for b in shown if "loss_fn" in b or "null." in b]
    page = snippets()
    assert imba_blocks == [page[n].text for n in ("pixart-setup", "pixart-literal", "pixart-efficient")]


def test_the_null_caption_is_sanas_negative_prompt():
    """`NullCaption.encode` on Gemma's left-padding tokenizer gives what SanaPipeline encodes for its negative
    prompt "" (right-padded, without the complex human instruction), and leaves the tokenizer as it was."""
    from imba import NullCaption

    torch.manual_seed(0)
    parts = Sana().build(ARGS["sana"])
    pipeline, tokenizer = parts["text_encoding_pipeline"], parts["tokenizer"]
    null = NullCaption.encode(tokenizer, parts["text_encoder"], max_length=20)
    assert tokenizer.padding_side == "left"
    with torch.no_grad():
        _, _, negative, negative_mask = pipeline.encode_prompt("a cat", max_sequence_length=20,
                                                               complex_human_instruction=["Describe:"])
    assert torch.equal(null.mask, negative_mask) and torch.equal(null.embeds, negative)
    assert null.embeds.dtype == torch.bfloat16 and null.mask[0, 0] == 1


@pytest.mark.parametrize("form", ["literal", "efficient"])
def test_a_transformer_without_a_mask_takes_the_null_caption_as_the_page_says(form):
    """SD3's transformer (no attention mask, pooled projections, outputs preconditioned as its script's default):
    the null caption from the script's own encoding of "" with an all-ones mask, "" 's pooled projection on the
    null rows, every prediction preconditioned; both forms train, and the script's own empty captions are still
    refused."""
    from diffusers import SD3Transformer2DModel

    from imba import IMBALoss, NullCaption

    torch.manual_seed(0)
    transformer = SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_layers=1,
                                        attention_head_dim=8, num_attention_heads=2, joint_attention_dim=32,
                                        caption_projection_dim=16, pooled_projection_dim=16, out_channels=4,
                                        pos_embed_max_size=16)
    null_embeds, null_pooled = torch.randn(1, 10, 32), torch.randn(1, 16)  # the script's encoding of ""
    null = NullCaption(null_embeds, torch.ones(null_embeds.shape[:2], dtype=torch.long))
    prompt_embeds, pooled_prompt_embeds = torch.randn(B, 10, 32), torch.randn(B, 16)
    ones = torch.ones(B, 10, dtype=torch.long)
    model_input, noise, timesteps = torch.randn(B, 4, 8, 8), torch.randn(B, 4, 8, 8), torch.tensor([1000.0, 3.0])
    sigmas = (timesteps / 1000).view(B, 1, 1, 1)
    x = (1.0 - sigmas) * model_input + sigmas * noise
    target = model_input  # --precondition_outputs 1
    loss_fn = IMBALoss.for_transformer(transformer, normalize="timestep_mean")
    if form == "literal":
        embeds, _ = null.cat(prompt_embeds, ones)
        pooled = torch.cat([pooled_prompt_embeds, null_pooled.expand(B, -1)])
        pred = transformer(hidden_states=x.repeat(2, 1, 1, 1), encoder_hidden_states=embeds,
                           pooled_projections=pooled, timestep=timesteps.repeat(2), return_dict=False)[0]
        pred = pred * (-sigmas.repeat(2, 1, 1, 1)) + x.repeat(2, 1, 1, 1)
        loss, _ = loss_fn(*pred.chunk(2), target, timesteps=timesteps)
    else:
        drop = torch.tensor([True, False])
        embeds, _ = null.where(drop, prompt_embeds, ones)
        pooled = torch.where(drop[:, None], null_pooled, pooled_prompt_embeds)
        pred = transformer(hidden_states=x, encoder_hidden_states=embeds, pooled_projections=pooled,
                           timestep=timesteps, return_dict=False)[0]
        pred = pred * (-sigmas) + x
        with torch.no_grad():
            uncond = transformer(hidden_states=x, encoder_hidden_states=null.expand(B)[0],
                                 pooled_projections=null_pooled.expand(B, -1), timestep=timesteps,
                                 return_dict=False)[0] * (-sigmas) + x
        loss, _ = loss_fn(pred, loss_fn.efficient_uncond(pred, uncond, drop), target, drop=drop, timesteps=timesteps)
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in transformer.parameters() if p.requires_grad)
    with pytest.raises(ValueError, match=r"caption rows \[1\] already are the null caption"):
        null.cat(torch.cat([prompt_embeds[:1], null_embeds]), ones)
