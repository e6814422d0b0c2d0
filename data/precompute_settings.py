"""What determines the features `data.precompute` stores: `PrecomputeSettings`, written into every shard record and
the manifest (`data.precompute_output`), so that output made with other settings is refused, never mixed.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from .text_states import TEXT_DTYPES

__all__ = ["PrecomputeSettings", "encoder_dtypes"]


def encoder_dtypes() -> dict[str, torch.dtype]:
    """model.encoder_dtype name -> torch dtype (models/ is imported only once settings are checked)."""
    from models.encoders import DTYPES

    return DTYPES



@dataclasses.dataclass(frozen=True)
class PrecomputeSettings:
    """What determines the stored features; stored in every shard record and the manifest.

    Names and meanings follow the training config: data.resolution, data.caption_field, model.vae,
    model.vae_subfolder, model.text_encoder, model.text_encoder_subfolder, model.tokenizer_subfolder,
    model.encoder_dtype, model.max_text_tokens, data.min_size; `text_dtype` is the storage dtype of the T5 states.
    """

    resolution: int
    vae: str = "shapes"
    vae_subfolder: str = ""
    text_encoder: str = "tiny"
    text_encoder_subfolder: str = ""
    tokenizer_subfolder: str = ""
    encoder_dtype: str = "float32"
    max_text_tokens: int = 64
    text_dtype: str = "float16"
    caption_field: str = "caption"
    min_size: int = 0

    def __post_init__(self) -> None:
        if self.resolution < 1 or self.max_text_tokens < 1 or self.min_size < 0:
            raise ValueError(f"need resolution >= 1, max_text_tokens >= 1, min_size >= 0 (got {self.resolution}, "
                             f"{self.max_text_tokens}, {self.min_size})")
        if self.text_dtype not in TEXT_DTYPES:
            raise ValueError(f"text_dtype must be one of {list(TEXT_DTYPES)} (got {self.text_dtype!r})")
        known = encoder_dtypes()
        if self.encoder_dtype not in known:
            raise ValueError(f"encoder_dtype must be one of {sorted(known)} (got {self.encoder_dtype!r})")

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
