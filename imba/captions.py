"""The null caption: the empty prompt "" as a frozen text encoder sees it, for the unconditional passes of IMBA.

    null = NullCaption.encode(tokenizer, text_encoder, max_length=args.max_token_length).to(device)  # at set-up
    embeds, mask = null.cat(prompt_embeds, prompt_attention_mask)           # literal: 2B rows, captions then ""
    added_cond_kwargs = null.repeat_rows(added_cond_kwargs)                 # literal: micro-conditions of 2B rows
    embeds, mask = null.where(drop, prompt_embeds, prompt_attention_mask)   # efficient: "" on the dropped rows
    transformer(noisy, timestep=t, **null.kwargs(B))                        # efficient: the no-grad "" pass

`encode` tokenises and encodes "" exactly as diffusers' PixArt pipelines encode their default negative prompt
(padded to `max_length` with its attention mask, special tokens added), so the unconditional model trains on the
input that classifier-free guidance gives it at sampling time. It takes any Hugging Face tokenizer and encoder
(a `T5EncoderModel`, or anything whose output's first element is the hidden states) and imports neither
transformers nor diffusers: this module needs torch alone.
"""

from __future__ import annotations

from typing import Union

import torch

Like = Union[torch.Tensor, "tuple[torch.Tensor, torch.Tensor]", None]  # captions: embeds, or (embeds, mask)


class NullCaption:
    """(1, L, D) embeddings and (1, L) attention mask of the empty caption.

    `cat` and `where` fit the null caption to the captions' length L' (a null caption is one real token and
    padding, so cutting padding off or adding masked padding leaves what the transformer attends to unchanged),
    to their dtype and device; `expand` and `kwargs` follow the captions last given to `cat` or `where` (a text
    encoder in bf16 and a transformer in fp32: the null caption takes the dtype the script gives the transformer).
    Both refuse captions that already contain the null caption, at whatever length either was encoded: IMBA
    trains the unconditional model with weight 1 − lam, which replaces the script's own caption dropout (it must
    be 0). `allow_empty_captions=True` lets such rows through, for a data set that holds empty captions on
    purpose (they then train the unconditional model on top of its 1 − lam share).
    """

    def __init__(self, embeds: torch.Tensor, mask: torch.Tensor, allow_empty_captions: bool = False) -> None:
        embeds = embeds if embeds.dim() == 3 else embeds.unsqueeze(0)
        mask = mask if mask.dim() == 2 else mask.unsqueeze(0)
        if embeds.shape[0] != 1 or mask.shape != embeds.shape[:2]:
            raise ValueError(f"NullCaption: expects embeds (1, L, D) and mask (1, L), got {tuple(embeds.shape)} and "
                             f"{tuple(mask.shape)}")
        self.embeds, self.mask = embeds.detach(), mask
        self._attended = mask[0].nonzero().flatten()  # the positions of the real tokens ("" is one: </s>)
        self.allow_empty_captions = allow_empty_captions
        self._captions: tuple[torch.Tensor, torch.Tensor] | None = None  # empty, shaped as cat's or where's last

    @classmethod
    @torch.no_grad()
    def encode(cls, tokenizer, text_encoder, max_length: int, device=None, dtype: torch.dtype | None = None,
               allow_empty_captions: bool = False) -> "NullCaption":
        """Encode "" as PixArt's and Sana's pipelines encode the negative prompt (right-padded): `max_length` is
        the script's caption length (its `--max_token_length`: 120 for PixArt-α, 300 for PixArt-Σ; Sana's
        `--max_sequence_length`). `device`: the encoder's by default (pass it for an encoder without parameters);
        `dtype`: the encoder's output's."""
        # right-padded, as the pipelines pad their negative prompt (Sana's sets it on Gemma's left-padding
        # tokenizer), so that `cat` and `where` can cut or extend the padding at the end
        side = getattr(tokenizer, "padding_side", "right")
        try:
            if side != "right":
                tokenizer.padding_side = "right"
            tokens = tokenizer([""], padding="max_length", max_length=max_length, truncation=True,
                               return_attention_mask=True, add_special_tokens=True, return_tensors="pt")
        finally:
            if side != "right":
                tokenizer.padding_side = side
        if device is None:
            device = _device_of(text_encoder)
        mask = tokens.attention_mask.to(device)
        embeds = text_encoder(tokens.input_ids.to(device), attention_mask=mask)[0]
        return cls(embeds if dtype is None else embeds.to(dtype), mask, allow_empty_captions)

    def to(self, device=None, dtype: torch.dtype | None = None) -> "NullCaption":
        """On `device`; `dtype` applies to the embeddings (the mask keeps its integer type)."""
        return NullCaption(self.embeds.to(device=device, dtype=dtype), self.mask.to(device), self.allow_empty_captions)

    @property
    def length(self) -> int:
        return self.mask.shape[1]

    def expand(self, batch_size: int, like: Like = None):
        """(embeds (B, L, D), mask (B, L)): the null caption for every row, e.g. for a no-grad unconditional pass.
        `like`: captions (embeds, or (embeds, mask)) whose length, dtype and device to take; by default those last
        given to `cat` or `where` (so the no-grad pass of the efficient form gets what its pass with gradient got),
        and the encoder's before any."""
        like = self._captions if like is None else like
        embeds, mask = self._fit(like) if like is not None else (self.embeds, self.mask)
        return embeds.expand(batch_size, -1, -1), mask.expand(batch_size, -1)

    def kwargs(self, batch_size: int, like: Like = None) -> dict:
        """`encoder_hidden_states` and `encoder_attention_mask` of the null caption, the keyword arguments a diffusers
        PixArt transformer takes: `transformer(x, timestep=t, **null.kwargs(B), ...)`."""
        embeds, mask = self.expand(batch_size, like)
        return {"encoder_hidden_states": embeds, "encoder_attention_mask": mask}

    def cat(self, embeds: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The literal form's conditioning of 2B rows: the B captions, then B null captions (pair them with the
        noisy latents and timesteps repeated twice, and split the prediction with `.chunk(2)`)."""
        self._check_captions(embeds, mask)
        null_embeds, null_mask = self.expand(embeds.shape[0], like=(embeds, mask))
        self._follow(embeds, mask)
        return torch.cat([embeds, null_embeds]), torch.cat([mask, null_mask])

    @staticmethod
    def repeat_rows(added_cond_kwargs: dict) -> dict:
        """The literal form's other per-row inputs for its 2B rows: each tensor of `added_cond_kwargs` (a diffusers
        PixArt transformer's micro-conditions, `resolution` (B, 2) and `aspect_ratio` (B, 1)) repeated as the
        latents are, `x.repeat(2, ...)`; None and 0-d values unchanged."""
        if not isinstance(added_cond_kwargs, dict):
            raise ValueError(f"NullCaption.repeat_rows: expects a dict of tensors (added_cond_kwargs), got "
                             f"{type(added_cond_kwargs).__name__}")
        return {name: torch.cat([value, value]) if isinstance(value, torch.Tensor) and value.dim() > 0 else value
                for name, value in added_cond_kwargs.items()}

    def where(self, drop: torch.Tensor, embeds: torch.Tensor, mask: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """The efficient form's conditioning: the null caption on the rows where `drop` (bool, (B,)) is True, the
        captions elsewhere."""
        b = embeds.shape[0]
        if drop.shape != (b,) or drop.dtype != torch.bool:
            raise ValueError(f"NullCaption.where: drop must be a bool tensor of shape ({b},), got {drop.dtype} "
                             f"{tuple(drop.shape)}")
        self._check_captions(embeds, mask)
        null_embeds, null_mask = self._fit((embeds, mask))
        self._follow(embeds, mask)
        drop = drop.to(embeds.device)
        return (torch.where(drop[:, None, None], null_embeds, embeds),
                torch.where(drop[:, None], null_mask, mask))

    def _follow(self, embeds: torch.Tensor, mask: torch.Tensor) -> None:
        """Remember the captions' length, dtype and device (in empty tensors, so that nothing stays alive)."""
        self._captions = (embeds.new_empty((0, *embeds.shape[1:])), mask.new_empty((0, mask.shape[1])))

    def _fit(self, like: Like) -> tuple[torch.Tensor, torch.Tensor]:
        """The null caption at the length, dtype and device of the captions `like` (embeds, or (embeds, mask))."""
        embeds, mask = like if isinstance(like, tuple) else (like, None)
        if (embeds.dim() != 3 or embeds.shape[2] != self.embeds.shape[2]
                or (mask is not None and mask.shape != embeds.shape[:2])):
            raise ValueError(f"NullCaption: captions must be embeds (B, L, {self.embeds.shape[2]}) and mask (B, L), "
                             f"got {tuple(embeds.shape)} and {None if mask is None else tuple(mask.shape)}")
        length = embeds.shape[1]
        null_embeds = self.embeds.to(device=embeds.device, dtype=embeds.dtype)
        null_mask = self.mask.to(device=embeds.device, dtype=self.mask.dtype if mask is None else mask.dtype)
        if length < self.length:
            if bool(null_mask[:, length:].any()):
                raise ValueError(f"NullCaption: captions of {length} tokens cannot hold the null caption's "
                                 f"{int(null_mask.sum())} real tokens")
            return null_embeds[:, :length], null_mask[:, :length]
        pad = length - self.length
        return (torch.nn.functional.pad(null_embeds, (0, 0, 0, pad)), torch.nn.functional.pad(null_mask, (0, pad)))

    def _check_captions(self, embeds: torch.Tensor, mask: torch.Tensor) -> None:
        if self.allow_empty_captions:
            return
        null_embeds, null_mask = self._fit((embeds, mask))
        same_mask = (mask == null_mask).all(dim=1)
        # Rows with the null caption's mask: only the tokens it attends to, which the transformer reads (an encoder
        # that masks its padding gives it states that may depend on the padded length).
        attended = self._attended[self._attended < embeds.shape[1]].to(embeds.device)
        if not attended.numel():
            attended = torch.arange(embeds.shape[1], device=embeds.device)
        null_attended = null_embeds.index_select(1, attended)
        # The same tokens give the same states up to the rounding of another batch size or a half-precision encoder.
        tolerance = 0.05 * null_attended.abs().amax() + 1e-6
        close = _farthest(embeds.index_select(1, attended), null_attended) <= tolerance
        # Rows whose mask is all ones (a script that does not pad-mask): the mask tells nothing, so every position
        # both hold is compared, the null caption's padding included; its attended tokens alone would not do (a
        # causal encoder gives every caption the states of its first tokens).
        common = min(embeds.shape[1], self.length)
        unmasked = mask.bool().all(dim=1) & (_farthest(embeds[:, :common], null_embeds[:, :common]) <= tolerance)
        # A caption's first tokens are never all zeros.
        rows = (same_mask & close) | unmasked | (embeds == 0).flatten(1).all(dim=1)
        if bool(rows.any()):
            raise ValueError(f"NullCaption: caption rows {rows.nonzero().flatten().tolist()} already are the null "
                             "caption (or zeros): IMBA's 1 − lam replaces the script's caption dropout, so set that "
                             "to 0 (e.g. --proportion_empty_prompts 0); captions encoded once before the loop: "
                             "keep cat's or where's output under new names (embeds, mask = null.where(...)), not "
                             "prompt_embeds; a data set with empty captions on purpose: "
                             "NullCaption.encode(..., allow_empty_captions=True)")


def _farthest(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per row, the largest absolute difference between (B, L, D) `a` and `b` (0 for L = 0)."""
    return (a - b).abs().flatten(1).amax(dim=1) if a.shape[1] else a.new_zeros(a.shape[0])


def _device_of(text_encoder) -> torch.device:
    """The device of the encoder's first parameter."""
    parameters = getattr(text_encoder, "parameters", None)
    first = next(iter(parameters()), None) if callable(parameters) else None
    if first is None:
        raise ValueError(f"NullCaption.encode: the text encoder ({type(text_encoder).__name__}) has no parameters to "
                         "tell its device from: pass device=")
    return first.device
