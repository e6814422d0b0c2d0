"""Features to diagnose a DiT with (`imba.eval.representations`): the image tokens after each transformer block,
mean-pooled, from one forward pass; and the caption embedding, the mean of the valid T5 tokens.

Works on any diffusers `PixArtTransformer2DModel` (this project's DiTs, exports, PixArt checkpoints): forward hooks
on `transformer_blocks` record each block's output during one `models.dit.predict` call and are removed after it.

`prompt_features` is what the diagnostics commands use: for each caption, `draws` fixed noise latents at one
timestep, the same draws for every caption, so two captions' features differ only through the caption. At a high
timestep the input is (nearly) pure noise, as at the start of sampling: what a block holds there about the
prompt's concepts came from the caption.
"""

from __future__ import annotations

import torch
from diffusers import PixArtTransformer2DModel

from models.dit import predict

__all__ = ["block_features", "caption_features", "prompt_features"]


def _pool(hidden: torch.Tensor, token_mask: torch.Tensor | None) -> torch.Tensor:
    if token_mask is None:
        return hidden.mean(dim=1)
    weights = token_mask.to(hidden.device, hidden.dtype)[..., None]
    return (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp_min(1)


@torch.no_grad()
def block_features(transformer: PixArtTransformer2DModel, noisy: torch.Tensor, timesteps: torch.Tensor,
                   text_embeds: torch.Tensor, text_mask: torch.Tensor, vae_scale_factor: int = 8,
                   token_mask: torch.Tensor | None = None) -> list[torch.Tensor]:
    """[(B, hidden) float32 on the CPU for each block, in order]: the mean over image tokens of the block's output
    for latents `noisy` (B, C, h, w) at `timesteps` (B,), conditioned on the captions' T5 states.

    `token_mask` (B, tokens), 1 where a token counts, pools over part of the image instead (e.g. one object's half
    of a scene); tokens are in the DiT's order, row-major over the patch grid."""
    bare = getattr(transformer, "module", transformer)
    pooled: list[torch.Tensor] = []

    def record(module, inputs, output):
        hidden = output[0] if isinstance(output, tuple) else output
        if token_mask is not None and token_mask.shape != hidden.shape[:2]:
            raise ValueError(f"token_mask is {tuple(token_mask.shape)}, the blocks output {tuple(hidden.shape[:2])} "
                             f"(batch, image tokens)")
        pooled.append(_pool(hidden.float(), token_mask).cpu())

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


@torch.no_grad()
def prompt_features(transformer: PixArtTransformer2DModel, text_embeds: torch.Tensor, text_mask: torch.Tensor,
                    latent_shape: tuple[int, int, int], timestep: float, draws: int = 4, seed: int = 0,
                    batch_size: int = 64, vae_scale_factor: int = 8, token_mask: torch.Tensor | None = None,
                    caption_mask: torch.Tensor | None = None) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Per-block features and caption features of n captions, `draws` rows per caption (row = caption × draws +
    draw): ([(n·draws, hidden) per block], (n·draws, D)).

    Draw d's latent (C, h, w) = `latent_shape` is standard noise from seed `seed + d`, the same for every caption;
    `token_mask` (n, tokens) pools each caption's image tokens over part of the image, `caption_mask` (n, L) its
    caption over some of its tokens (default `text_mask`)."""
    n = text_embeds.shape[0]
    if draws < 1 or n < 1:
        raise ValueError(f"need at least one caption and one draw (got {n} captions, draws={draws})")
    bare = getattr(transformer, "module", transformer)
    device = next(bare.parameters()).device
    noise = torch.stack([torch.randn(latent_shape, generator=torch.Generator().manual_seed(seed + d))
                         for d in range(draws)])
    rows = torch.arange(n * draws)
    caption_of, draw_of = rows // draws, rows % draws
    blocks: list[list[torch.Tensor]] = []
    for chunk in rows.split(batch_size):
        c = caption_of[chunk]
        mask = None if token_mask is None else token_mask[c].to(device)
        out = block_features(transformer, noise[draw_of[chunk]].to(device),
                             torch.full((len(chunk),), float(timestep), device=device),
                             text_embeds[c].to(device), text_mask[c].to(device), vae_scale_factor, mask)
        blocks.append(out)
    per_block = [torch.cat([b[i] for b in blocks]) for i in range(len(blocks[0]))]
    text = caption_features(text_embeds, text_mask if caption_mask is None else caption_mask)
    return per_block, text[caption_of]
