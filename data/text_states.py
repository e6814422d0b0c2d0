"""How precomputed T5 states are stored, and how the reader turns them back into the training dtype.

A T5-XXL caption state is (n, 4096): at float16 that is 98 % of a precomputed 256 px sample's bytes, so its
storage format decides the input pipeline's bandwidth. The storage dtypes (`data.precompute --text-dtype`):

- "float16": the states as float16 (the default).
- "bfloat16": the bfloat16 bit patterns in a uint16 array (numpy has no bfloat16; the uint16 dtype is the marker).
- "int8" (compact: half the bytes of float16): symmetric per-token quantisation. Token j's scale is
  s_j = max_d |x_jd| / 127, its values q_jd = round(x_jd / s_j) in [-127, 127]; stored q (n, D) int8 in the
  sample's `t5.npy` and s (n,) float32 in `t5scale.npy`. Decoding is q · s, so the error of an element is at
  most s_j / 2 = max |x_j| / 254 (an all-zero token decodes to zeros).

`encode_states` writes these arrays from a float tensor; `check_stored` confirms that arrays read back are what
the manifest's dtype says; `stored_tensor` views them as a tensor without copying, and `dequantize` turns stored
tensors into floats on whatever device they are on, so a loader can hand the stored bytes to the GPU as they are.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["TEXT_DTYPES", "SCALED_TEXT_DTYPES", "STORED_NUMPY_DTYPE", "STORED_TORCH_DTYPE", "bytes_per_token",
           "encode_states", "check_stored", "stored_tensor", "dequantize", "states_from_numpy"]

TEXT_DTYPES = ("float16", "bfloat16", "int8")
SCALED_TEXT_DTYPES = ("int8",)  # stored with a per-token scale member
STORED_NUMPY_DTYPE = {"float16": np.dtype(np.float16), "bfloat16": np.dtype(np.uint16), "int8": np.dtype(np.int8)}
STORED_TORCH_DTYPE = {"float16": torch.float16, "bfloat16": torch.bfloat16, "int8": torch.int8}
_INT8_MAX = 127


def _check_name(text_dtype: str) -> None:
    if text_dtype not in TEXT_DTYPES:
        raise ValueError(f"text_dtype must be one of {list(TEXT_DTYPES)} (got {text_dtype!r})")


def bytes_per_token(text_dtype: str, hidden_size: int) -> int:
    """Stored bytes of one token's state (array data only, without .npy headers)."""
    _check_name(text_dtype)
    return hidden_size * STORED_NUMPY_DTYPE[text_dtype].itemsize + (4 if text_dtype in SCALED_TEXT_DTYPES else 0)


def encode_states(states: torch.Tensor, text_dtype: str) -> tuple[np.ndarray, np.ndarray | None]:
    """(values, per-token scales or None) as stored for float states (n, D)."""
    _check_name(text_dtype)
    states = states.detach().to("cpu")
    if text_dtype == "float16":
        return states.to(torch.float16).numpy(), None
    if text_dtype == "bfloat16":
        return states.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16), None
    x = states.float()
    scale = x.abs().amax(dim=1) / _INT8_MAX
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero token: q = 0, any scale decodes it
    q = torch.round(x / safe[:, None]).clamp_(-_INT8_MAX, _INT8_MAX).to(torch.int8)
    return q.numpy(), scale.numpy()


def check_stored(values: np.ndarray, scale: np.ndarray | None, text_dtype: str) -> None:
    """ValueError unless `values` (and `scale`) are the arrays `text_dtype` stores."""
    want = STORED_NUMPY_DTYPE[text_dtype]
    if values.ndim != 2 or values.dtype != want:
        raise ValueError(f"stored T5 states are {values.dtype} {values.shape}, the manifest's text_dtype "
                         f"{text_dtype!r} stores {want} (n, D)")
    if text_dtype in SCALED_TEXT_DTYPES:
        if scale is None or scale.dtype != np.float32 or scale.shape != values.shape[:1]:
            got = "none" if scale is None else f"{scale.dtype} {scale.shape}"
            raise ValueError(f"text_dtype {text_dtype!r} needs a float32 scale per token ({values.shape[0]},), "
                             f"found {got}")
    elif scale is not None:
        raise ValueError(f"text_dtype {text_dtype!r} has no per-token scale, but the sample holds one")


def stored_tensor(values: np.ndarray, text_dtype: str) -> torch.Tensor:
    """The stored array as a tensor of `STORED_TORCH_DTYPE[text_dtype]`, sharing its memory."""
    if text_dtype == "bfloat16":
        return torch.from_numpy(values.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(values)


def dequantize(stored: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Float states of `dtype` from stored ones (n, D) and their per-token scales (n,) (None for float formats),
    computed on the device `stored` is on (`stored` itself when it already is unscaled `dtype`)."""
    values = stored.to(dtype)
    if scale is not None:
        values.mul_(scale.to(device=values.device, dtype=dtype)[:, None])
    return values


def states_from_numpy(values: np.ndarray, scale: np.ndarray | None, text_dtype: str,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The stored arrays as a new (n, D) tensor of `dtype`."""
    check_stored(values, scale, text_dtype)
    stored = stored_tensor(values, text_dtype).clone()
    return dequantize(stored, None if scale is None else torch.from_numpy(scale), dtype)
