"""Speed switches change speed and memory, not results: each is compared with the default at tiny size."""

import pytest
import torch

from imba.training.config import load_config
from imba.objectives import RectifiedFlow
from imba.training_loss import ImbaTrainingLoss
from models.dit import apply_speed_settings, build_transformer, predict


def tiny_dit():
    torch.manual_seed(0)
    return build_transformer("tiny", sample_size=8, caption_channels=16)


def loss_and_grads(dit, autocast_dtype=None):
    g = torch.Generator().manual_seed(1)
    latents = torch.randn(4, 4, 8, 8, generator=g)
    noised = RectifiedFlow().noise(latents, generator=g)
    mask = torch.ones(4, 6, dtype=torch.long)
    mask[:, 4:] = 0
    cond = (torch.randn(4, 6, 16, generator=g), mask)
    null_mask = torch.zeros(4, 6, dtype=torch.long)
    null_mask[:, 0] = 1
    null = (torch.randn(1, 6, 16, generator=g).expand(4, -1, -1), null_mask)
    dit.zero_grad()
    with torch.autocast("cpu", dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None):
        loss, _ = ImbaTrainingLoss()(lambda *a: predict(dit, *a), noised, cond, null)
    loss.backward()
    return loss.detach(), torch.cat([p.grad.flatten() for p in dit.parameters()])


@pytest.fixture(scope="module")
def reference():
    return loss_and_grads(apply_speed_settings(tiny_dit()))


def test_attention_switch_installs_its_processor_on_every_attention_layer():
    from diffusers.models.attention_processor import AttnProcessor, AttnProcessor2_0

    eager = apply_speed_settings(tiny_dit(), attention="eager").attn_processors
    sdpa = apply_speed_settings(tiny_dit()).attn_processors
    assert len(eager) == len(sdpa) > 0
    assert all(type(p) is AttnProcessor for p in eager.values())
    assert all(type(p) is AttnProcessor2_0 for p in sdpa.values())


def gradient_scale(grads: torch.Tensor) -> float:
    """The gradients' scale, their largest magnitude: another kernel rounds a gradient relative to the terms summed
    into it, which are of this scale, not relative to its own value (one summed from cancelling terms keeps their
    rounding)."""
    return grads.abs().max().item()


def test_eager_attention_matches_sdpa(reference):
    loss, grads = loss_and_grads(apply_speed_settings(tiny_dit(), attention="eager"))
    # the same math in other kernels: float32 rounding, ~1e-7 of the loss and of the gradients' scale (bounds
    # ~100× that); a wrong attention (the text mask ignored: loss 1.2e-4 off, gradients 6% of their scale) is outside
    torch.testing.assert_close(loss, reference[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads, reference[1], rtol=1e-4, atol=1e-5 * gradient_scale(reference[1]))


def test_gradient_checkpointing_gives_the_same_gradients(reference):
    dit = apply_speed_settings(tiny_dit(), gradient_checkpointing=True)
    assert dit.gradient_checkpointing
    calls = []
    checkpoint = dit._gradient_checkpointing_func
    dit._gradient_checkpointing_func = lambda *a, **k: calls.append(a[0]) or checkpoint(*a, **k)
    loss, grads = loss_and_grads(dit)
    # every transformer block ran through activation checkpointing (one forward of 2B rows)
    assert calls == list(dit.transformer_blocks)
    torch.testing.assert_close(loss, reference[0])
    torch.testing.assert_close(grads, reference[1], rtol=1e-5, atol=1e-7)


def test_bf16_autocast_stays_close(reference):
    loss, grads = loss_and_grads(apply_speed_settings(tiny_dit()), autocast_dtype=torch.bfloat16)
    torch.testing.assert_close(loss, reference[0], rtol=3e-2, atol=1e-3)
    cosine = torch.nn.functional.cosine_similarity(grads, reference[1], dim=0)
    assert cosine > 0.99


@pytest.mark.slow
def test_compiled_dit_matches_eager(reference):
    from torch._dynamo.utils import counters

    counters.clear()
    dit = apply_speed_settings(tiny_dit(), compile=True)
    loss, grads = loss_and_grads(dit)
    assert type(dit).__name__ == "PixArtTransformer2DModel"  # compiled in place: checkpoints/export unaffected
    assert counters["stats"]["unique_graphs"] >= 1  # dynamo really captured and compiled the forward
    # fused kernels that sum in other orders: rounding relative to the loss and to the gradients' scale, as for
    # eager attention with 10× more room; a graph that computes something else (the text mask dropped: gradients
    # 6% of their scale apart) is far outside
    torch.testing.assert_close(loss, reference[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(grads, reference[1], rtol=1e-3, atol=1e-4 * gradient_scale(reference[1]))


def test_speed_config_and_errors():
    cfg = load_config(["speed.gradient_checkpointing=true", "speed.attention=eager", "speed.tf32=false"])
    assert cfg.speed.gradient_checkpointing and cfg.speed.attention == "eager" and not cfg.speed.tf32
    with pytest.raises(ValueError, match="sdpa, eager"):
        apply_speed_settings(tiny_dit(), attention="flash3")
