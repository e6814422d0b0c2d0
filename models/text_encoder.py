"""Frozen T5 text encoder and its tokenizer.

Real runs load T5 v1.1 XXL (4096-d) from a hub id or a local folder, e.g. `google/t5-v1_1-xxl`, or the
`text_encoder`/`tokenizer` subfolders of a PixArt repository. `"tiny"` builds a small random T5 encoder with a
byte-level tokenizer (`ByT5Tokenizer`, which needs no vocabulary file): the same classes, no download, for tests and
the CPU default run. Its weights come from a fixed seed, so every process and every resume gets the same encoder.
"""

from __future__ import annotations

import torch
from transformers import AutoTokenizer, ByT5Tokenizer, T5Config, T5EncoderModel

TINY = "tiny"
TINY_SEED = 1234


def _tiny_t5() -> T5EncoderModel:
    config = T5Config(
        vocab_size=384,  # ByT5: 256 bytes + 3 special tokens + 125 sentinel ids
        d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
        feed_forward_proj="gated-gelu",  # T5 v1.1 style
        is_encoder_decoder=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(TINY_SEED)
        return T5EncoderModel(config)


def load_text_encoder(spec: str, subfolder: str = "", tokenizer_subfolder: str = "",
                      dtype: torch.dtype = torch.float32):
    """(tokenizer, frozen T5EncoderModel in eval mode) from "tiny", a hub id or a local path."""
    if spec == TINY:
        tokenizer, encoder = ByT5Tokenizer(), _tiny_t5().to(dtype)
    else:
        try:
            tokenizer = AutoTokenizer.from_pretrained(spec, subfolder=tokenizer_subfolder or "")
            encoder = T5EncoderModel.from_pretrained(spec, subfolder=subfolder or "", torch_dtype=dtype)
        except OSError as err:
            raise OSError(f"cannot load the text encoder from {spec!r} (subfolder {subfolder!r}): set "
                          "model.text_encoder to a local folder or a reachable hub id, or 'tiny' for tests") from err
    encoder.eval().requires_grad_(False)
    return tokenizer, encoder


class TextConditioner:
    """Turns captions into (embeddings, attention mask) with a frozen encoder; holds the null (empty) caption.

    Put the encoder on its device before constructing: the null embedding is computed there, once.
    """

    def __init__(self, tokenizer, encoder: T5EncoderModel, max_length: int):
        self.tokenizer = tokenizer
        self.encoder = encoder
        self.max_length = max_length
        # Computed once through the same encoder, exactly as the pipeline encodes its negative prompt "".
        self.null_embeds, self.null_mask = self.encode([""])

    @property
    def hidden_size(self) -> int:
        return self.encoder.config.d_model

    @torch.no_grad()
    def encode(self, captions: list[str]):
        device = next(self.encoder.parameters()).device
        tokens = self.tokenizer(captions, padding="max_length", max_length=self.max_length, truncation=True,
                                add_special_tokens=True, return_tensors="pt")
        ids, mask = tokens.input_ids.to(device), tokens.attention_mask.to(device)
        embeds = self.encoder(ids, attention_mask=mask)[0]
        return embeds.float(), mask  # float32 like the DiT's weights; autocast lowers it where enabled

    def null_like(self, batch_size: int):
        return self.null_embeds.expand(batch_size, -1, -1), self.null_mask.expand(batch_size, -1)

