"""The frozen encoders of a run (tokenizer + T5, VAE) behind the small interface the training loop uses.

`data.precomputed.PrecomputedFeatures` has the same interface for shards that already hold the VAE moments and T5
states, so the loop does not care which one it has:

    latent_channels, caption_channels, vae_scale     sizes the DiT
    encode_batch(batch, device) -> (latents, (embeds, mask))
    null_like(batch_size)   -> (embeds, mask) of the empty caption
"""

from __future__ import annotations

from typing import Sequence

import torch

from models.settings import ENCODER_DTYPES
from models.text_encoder import TextConditioner, load_text_encoder
from models.vae import encode_images, load_vae, vae_scale_factor

DTYPES = {name: getattr(torch, name) for name in ENCODER_DTYPES}  # of the frozen encoders (model.encoder_dtype)


class FrozenEncoders:
    def __init__(self, tokenizer, t5, vae, max_text_tokens: int):
        self.tokenizer, self.t5, self.vae = tokenizer, t5, vae
        self.text = TextConditioner(tokenizer, t5, max_text_tokens)
        self.latent_channels = vae.config.latent_channels
        self.caption_channels = t5.config.d_model
        self.vae_scale = vae_scale_factor(vae)

    @classmethod
    def load(cls, text_encoder: str, vae: str, max_text_tokens: int, device, dtype: torch.dtype = torch.float32,
             text_encoder_subfolder: str = "", tokenizer_subfolder: str = "", vae_subfolder: str = "",
             words: Sequence[str] = ()):
        """From "tiny", hub ids or local folders; raises OSError with a one-line message when they cannot load.
        `words`: the vocabulary of the "tiny-words" text encoder."""
        tokenizer, t5 = load_text_encoder(text_encoder, text_encoder_subfolder, tokenizer_subfolder, dtype=dtype,
                                          words=words)
        vae_model = load_vae(vae, vae_subfolder, dtype=dtype)
        return cls(tokenizer, t5.to(device), vae_model.to(device), max_text_tokens)

    def encode_batch(self, batch: dict, device) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        return encode_images(self.vae, batch["pixels"].to(device)), self.text.encode(batch["captions"])

    def null_like(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.text.null_like(batch_size)

    def pipeline_parts(self) -> dict:
        """What `models.pipeline.build_pipeline` needs besides the transformer and the scheduler."""
        return dict(vae=self.vae, text_encoder=self.t5, tokenizer=self.tokenizer)
