"""Features to diagnose a DiT with (`imba.eval.representations`): the image tokens after each transformer block,
mean-pooled, from one forward pass; and the caption embedding, the mean of the valid T5 tokens.

Works on any diffusers `PixArtTransformer2DModel` (this project's DiTs, exports, PixArt checkpoints): forward hooks
on `transformer_blocks` record each block's output during one `models.dit.predict` call and are removed after it.
"""

from __future__ import annotations

import torch
from diffusers import PixArtTransformer2DModel

from models.dit import predict

__all__ = ["block_features", "caption_features"]


@torch.no_grad()
def block_features(transformer: PixArtTransformer2DModel, noisy: torch.Tensor, timesteps: torch.Tensor,
                   text_embeds: torch.Tensor, text_mask: torch.Tensor, vae_scale_factor: int = 8
                   ) -> list[torch.Tensor]:
    """[(B, hidden) float32 on the CPU for each block, in order]: the mean over image tokens of the block's output
    for latents `noisy` (B, C, h, w) at `timesteps` (B,), conditioned on the captions' T5 states."""
    bare = getattr(transformer, "module", transformer)
    pooled: list[torch.Tensor] = []

    def record(module, inputs, output):
        hidden = output[0] if isinstance(output, tuple) else output
        pooled.append(hidden.mean(dim=1).float().cpu())

    handles = [block.register_forward_hook(record) for block in bare.transformer_blocks]
    try:
        predict(transformer, noisy, timesteps, text_embeds, text_mask, vae_scale_factor)
    finally:
        for handle in handles:
            handle.remove()
    if len(pooled) != len(handles):
        raise RuntimeError(f"{len(handles)} blocks but {len(pooled)} outputs recorded: a block ran more or less "
                           f"than once in one forward pass")
    return pooled


def caption_features(text_embeds: torch.Tensor, text_mask: torch.Tensor) -> torch.Tensor:
    """(B, D) float32 on the CPU: the mean of each caption's valid T5 token states (`text_mask` 1)."""
    mask = text_mask.to(text_embeds.device, torch.float32)[..., None]
    counts = mask.sum(dim=1).clamp_min(1)
    return ((text_embeds.float() * mask).sum(dim=1) / counts).cpu()
