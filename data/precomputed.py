"""The precomputed-features format (what `python -m data.precompute` writes) and its reader for training.

A precompute output folder holds tar shards with the keys of the input shards, `null_text.npy` (the T5 state of
the empty caption, the unconditional embedding IMBA and caption dropout use, stored like `KEY.t5.npy`), and, once
complete, the manifest `precompute.json` (settings, latent and text shapes, VAE scaling factor, sample and skip
counts, shard list), which the reader checks against the training config (`find_manifest`, `check_manifest`).

Format (per sample; every array is a plain `.npy`, readable with `np.load(..., allow_pickle=False)`):
- `KEY.latent.npy`: float16 (2, C, h, w): [0] the VAE posterior mean, [1] its log-variance (clamped to
  [-30, 20] as diffusers does), unscaled. `sample_latents` draws mean + exp(logvar / 2)·ε and multiplies by the
  VAE scaling factor, exactly as `models.vae.encode_images` samples the posterior (no shift factor).
- `KEY.t5.npy`: the T5 last hidden state of the valid tokens only, (n, D) with n = the caption's token count
  (<= max_text_tokens, truncated like training). float16, or, with `--text-dtype bfloat16`, uint16 holding the
  bfloat16 bit patterns (numpy has no bfloat16; the uint16 dtype is the marker). The mask is implied: the
  tokenizer pads on the right, so the first n tokens are valid; the reader restores (max_text_tokens, D) with
  zeros at padded positions (the DiT masks them out of cross-attention, so their values never matter).
- `KEY.txt`: the caption that was encoded (the reader's caption: `key.txt`, else `json[caption_field]`,
  stripped). `KEY.json`: the original json (if it parsed as an object) plus `"precompute": {"source",
  "image_size": [w, h] of the original image, "resolution", "text_tokens"}`.

Reading. `make_precomputed_loader` is `data.indexed.make_indexed_loader` over the precomputed shards (the same
index, the same (seed, epoch)-pure order and `IndexedBatchSampler`, so exact resume from `batches_done` and equal
batches per rank hold unchanged) yielding {"latent_mean", "latent_logvar": (B, C, h, w) float32, "text_embeds":
(B, max_text_tokens, D) float32, "text_mask": (B, max_text_tokens) int64, "captions", "keys"}. Reading imports
neither models/ nor diffusers/transformers; only the writing side loads the encoders (lazily, via models/).
"""

from __future__ import annotations

import dataclasses
import functools
import io
import math
import os
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from .files import read_json_object
from .indexed import IndexedLoader, IndexedShards, indexed_batch_sampler
from .order import IndexedBatchSampler
from .skips import ReaderStats
from .streaming import check_loader_args
from .urls import expand_urls, is_remote

__all__ = [
    "FORMAT_KIND",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "NULL_TEXT_NAME",
    "LATENT_MEMBER",
    "TEXT_MEMBER",
    "TEXT_DTYPES",
    "npy_bytes",
    "load_npy",
    "text_to_numpy",
    "text_from_numpy",
    "load_manifest",
    "check_manifest",
    "find_manifest",
    "load_null_text",
    "sample_latents",
    "PrecomputedFeatures",
    "PrecomputedShards",
    "PrecomputedLoader",
    "make_precomputed_loader",
]

FORMAT_KIND = "imba-dit precomputed features"
FORMAT_VERSION = 1
MANIFEST_NAME = "precompute.json"
NULL_TEXT_NAME = "null_text.npy"
LATENT_MEMBER = "latent.npy"
TEXT_MEMBER = "t5.npy"
BAD_PRECOMPUTED = "bad precomputed sample"
TEXT_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


# --------------------------------------------------------------------------------------------------------------
# Arrays <-> bytes
# --------------------------------------------------------------------------------------------------------------


def npy_bytes(arr: np.ndarray) -> bytes:
    """`arr` as the bytes of a plain `.npy` file (C order, no pickle)."""
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(arr), allow_pickle=False)
    return buf.getvalue()


def load_npy(data: bytes) -> np.ndarray:
    """`np.load(..., allow_pickle=False)` of one member, with its header parsed once per distinct header: the
    members of a set share a few dozen headers (one latent shape, one per caption length), and parsing them with
    `np.load` took ~140 of the ~170 µs a sample's two arrays cost. Writable, like np.load's (a copy of `data`)."""
    size_bytes = {1: 2, 2: 4}.get(data[6]) if len(data) > 10 and data[:6] == b"\x93NUMPY" else None
    if size_bytes is None:  # not a version 1/2 .npy: np.load's checks and message
        return np.load(io.BytesIO(data), allow_pickle=False)
    offset = 8 + size_bytes + int.from_bytes(data[8:8 + size_bytes], "little")
    shape, fortran_order, dtype = _npy_header(data[:offset])
    count = math.prod(shape)
    if len(data) - offset != count * dtype.itemsize:
        raise ValueError(f".npy member holds {len(data) - offset} data bytes, its header says {shape} {dtype}")
    flat = np.frombuffer(bytearray(data), dtype=dtype, count=count, offset=offset)
    return flat.reshape(shape, order="F" if fortran_order else "C")


@functools.lru_cache(maxsize=1024)
def _npy_header(header: bytes) -> tuple[tuple[int, ...], bool, np.dtype]:
    fp = io.BytesIO(header)
    version = np.lib.format.read_magic(fp)
    read = np.lib.format.read_array_header_1_0 if version[0] == 1 else np.lib.format.read_array_header_2_0
    shape, fortran_order, dtype = read(fp)
    if dtype.hasobject:
        raise ValueError(".npy member holds Python objects; only plain arrays are read (no pickle)")
    return shape, fortran_order, dtype


def text_to_numpy(states: torch.Tensor, text_dtype: str) -> np.ndarray:
    """T5 states as stored: float16, or uint16 bit patterns of bfloat16 (numpy has no bfloat16)."""
    if text_dtype == "float16":
        return states.detach().to("cpu", torch.float16).numpy()
    if text_dtype == "bfloat16":
        return states.detach().to("cpu", torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    raise ValueError(f"text_dtype must be one of {sorted(TEXT_DTYPES)} (got {text_dtype!r})")


def text_from_numpy(arr: np.ndarray) -> torch.Tensor:
    """float32 tensor from a stored T5 array (float16, or uint16 = bfloat16 bits)."""
    if arr.dtype == np.uint16:
        return torch.from_numpy(np.ascontiguousarray(arr).view(np.int16)).view(torch.bfloat16).float()
    if arr.dtype == np.float16:
        return torch.from_numpy(np.ascontiguousarray(arr)).float()
    raise ValueError(f"stored T5 states must be float16 or uint16 (bfloat16 bits), got {arr.dtype}")


# --------------------------------------------------------------------------------------------------------------
# Manifest, null text, latent sampling
# --------------------------------------------------------------------------------------------------------------


def _manifest_path(where: str | os.PathLike | Sequence[str]) -> str:
    if isinstance(where, (str, os.PathLike)):
        where = os.path.expanduser(os.fspath(where))
        if os.path.isfile(where) and where.endswith(".json"):
            return where
        if os.path.isdir(where):
            return os.path.join(where, MANIFEST_NAME)
    return os.path.join(os.path.dirname(os.path.abspath(expand_urls(where)[0])), MANIFEST_NAME)


def load_manifest(where: str | os.PathLike | Sequence[str]) -> dict[str, Any]:
    """The manifest of precomputed shards: `where` is the output folder, its precompute.json, or a shard spec
    (the manifest is then the one next to the first shard). Its "__path__" entry is where it was read from."""
    path = _manifest_path(where)
    manifest = read_json_object(path)
    if manifest is None or manifest.get("__kind__") != FORMAT_KIND:
        raise FileNotFoundError(
            f"no precompute manifest at {path}: the folder is not precomputed, or its precompute did not finish "
            f"(run `python -m data.precompute IN_SHARDS {os.path.dirname(path)} ...` again: it completes it)"
        )
    if manifest.get("version") != FORMAT_VERSION:
        raise ValueError(f"{path} is precompute format version {manifest.get('version')}, this code reads "
                         f"{FORMAT_VERSION}: precompute again")
    manifest["__path__"] = os.path.abspath(path)
    return manifest


def find_manifest(shards: str | Sequence[str], **expected: Any) -> dict[str, Any] | None:
    """The manifest when `shards` (a training config's data.shards) are precompute outputs, checked against
    `expected` (see `check_manifest`); None for ordinary image shards, remote ones and an empty spec."""
    if not shards or is_remote(expand_urls(shards)[0]):
        return None
    try:
        manifest = load_manifest(shards)
    except FileNotFoundError:
        return None
    check_manifest(manifest, **expected)
    return manifest


def check_manifest(manifest: dict[str, Any], **expected: Any) -> None:
    """Raise ValueError (one line, every mismatch) unless manifest[k] == v for each keyword.

    Keys: the `PrecomputeSettings` fields (resolution, vae, vae_subfolder, text_encoder, text_encoder_subfolder,
    tokenizer_subfolder, encoder_dtype, max_text_tokens, text_dtype, caption_field) and the derived ones
    (latent_channels, latent_size, vae_downsample, vae_scaling_factor, text_hidden_size).
    """
    unknown = [k for k in expected if k not in manifest or k.startswith("_")]
    if unknown:
        raise KeyError(f"check_manifest: unknown keys {unknown}")
    diff = [f"{k}={v!r} wanted, {manifest[k]!r} precomputed" for k, v in expected.items() if manifest[k] != v]
    if diff:
        where = manifest.get("__path__", "the precompute manifest")
        raise ValueError(f"the precomputed features ({where}) do not match: {'; '.join(diff)}; precompute with "
                         f"matching settings or change the config")


def _pad_text(states: torch.Tensor, max_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    n, dim = states.shape
    embeds = states.new_zeros(max_tokens, dim)
    embeds[:n] = states
    mask = torch.zeros(max_tokens, dtype=torch.long)
    mask[:n] = 1
    return embeds, mask


def load_null_text(manifest: dict[str, Any] | str | os.PathLike) -> tuple[torch.Tensor, torch.Tensor]:
    """The empty caption's T5 state: (embeds (1, max_text_tokens, D) float32, zero-padded; mask (1, L) int64),
    what `TextConditioner.null_embeds`/`null_mask` hold when the encoder is loaded (equal on valid tokens)."""
    if not isinstance(manifest, dict):
        manifest = load_manifest(manifest)
    path = os.path.join(os.path.dirname(manifest["__path__"]), manifest["null_text"])
    embeds, mask = _pad_text(text_from_numpy(np.load(path, allow_pickle=False)), manifest["max_text_tokens"])
    return embeds[None], mask[None]


def sample_latents(
    mean: torch.Tensor, logvar: torch.Tensor, scaling_factor: float, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Latents drawn from stored posterior moments: (mean + exp(logvar / 2) · ε) · scaling_factor.

    The same computation as `models.vae.encode_images` (diffusers' `latent_dist.sample(generator)` times
    `vae.config.scaling_factor`, no shift): with the same moments and generator state it gives the same latents.
    `scaling_factor` is the manifest's "vae_scaling_factor". ε is drawn on the generator's device.
    """
    std = torch.exp(0.5 * logvar.clamp(-30.0, 20.0))
    noise_device = generator.device if generator is not None else mean.device
    noise = torch.randn(mean.shape, generator=generator, device=noise_device, dtype=mean.dtype).to(mean.device)
    return (mean + std * noise) * scaling_factor


# --------------------------------------------------------------------------------------------------------------
# Reading: dataset and loader over precomputed shards (the indexed reader's machinery)
# --------------------------------------------------------------------------------------------------------------


class PrecomputedFeatures:
    """Training inputs from precomputed shards, with the interface of `models.encoders.FrozenEncoders`
    (latent_channels, caption_channels, vae_scale, encode_batch(batch, device), null_like(n)): no VAE or T5 loaded."""

    def __init__(self, manifest: dict[str, Any], device: torch.device | str = "cpu"):
        self.manifest = manifest
        self.latent_channels = manifest["latent_channels"]
        self.caption_channels = manifest["text_hidden_size"]
        self.vae_scale = manifest["vae_downsample"]
        embeds, mask = load_null_text(manifest)
        self.null_embeds, self.null_mask = embeds.to(device), mask.to(device)

    def encode_batch(self, batch: dict[str, Any], device) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        latents = sample_latents(batch["latent_mean"].to(device), batch["latent_logvar"].to(device),
                                 self.manifest["vae_scaling_factor"])
        return latents, (batch["text_embeds"].to(device), batch["text_mask"].to(device))

    def null_like(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.null_embeds.expand(batch_size, -1, -1), self.null_mask.expand(batch_size, -1)


@dataclasses.dataclass
class _DecodePrecomputed:
    """Raw precomputed sample -> tensors; bad ones are counted (reason "bad precomputed sample") and dropped."""

    manifest: dict[str, Any]
    stats: ReaderStats

    def _parse(self, raw: dict[str, Any]) -> dict[str, Any]:
        m = self.manifest
        for member in (LATENT_MEMBER, TEXT_MEMBER, "txt"):
            if raw.get(member) is None:
                raise ValueError(f"no {member} member")
        latent = load_npy(raw[LATENT_MEMBER])
        if latent.dtype != np.float16 or list(latent.shape) != m["latent_shape"]:
            raise ValueError(f"latent is {latent.dtype} {latent.shape}, expected float16 {tuple(m['latent_shape'])}")
        text = load_npy(raw[TEXT_MEMBER])
        if text.ndim != 2 or not 1 <= text.shape[0] <= m["max_text_tokens"] or text.shape[1] != m["text_hidden_size"]:
            raise ValueError(f"T5 states of shape {text.shape}, expected (1..{m['max_text_tokens']}, "
                             f"{m['text_hidden_size']})")
        latent_t = torch.from_numpy(latent).float()
        embeds, mask = _pad_text(text_from_numpy(text), m["max_text_tokens"])
        return {
            "latent_mean": latent_t[0],
            "latent_logvar": latent_t[1],
            "text_embeds": embeds,
            "text_mask": mask,
            "caption": raw["txt"].decode("utf-8"),
            "key": raw["__key__"],
        }

    def __call__(self, src: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        for raw in src:
            try:
                sample = self._parse(raw)
            except Exception as exn:  # missing member, corrupt array, wrong shape
                where = f"{raw.get('__url__', '?')}:{raw.get('__key__', '?')}"
                self.stats.count(BAD_PRECOMPUTED, f"skipping {where}: {BAD_PRECOMPUTED} {exn!r}")
                self.stats.failed(f"{BAD_PRECOMPUTED} at {where}")
                continue
            self.stats.good += 1
            self.stats.failures_in_a_row = 0
            yield sample


class PrecomputedShards(IndexedShards):
    """`ds[i]` -> {"latent_mean", "latent_logvar": (C, h, w) float32, "text_embeds": (L, D) float32 zero-padded,
    "text_mask": (L,) int64, "caption", "key"}: `IndexedShards` (index, random access, bad-sample substitution
    and counting) with the precomputed members decoded instead of images."""

    def __init__(
        self,
        urls: str | Sequence[str],
        manifest: dict[str, Any] | None = None,
        index_dir: str | os.PathLike | None = None,
    ):
        manifest = manifest if manifest is not None else load_manifest(urls)
        super().__init__(urls, manifest["resolution"], caption_field=manifest["caption_field"], index_dir=index_dir)
        # the image decoder of IndexedShards is replaced: raw precomputed members -> tensors
        self.manifest = manifest
        self.decode = _DecodePrecomputed(manifest, self.stats)


def _collate_precomputed(samples: list[dict[str, Any]]) -> dict[str, Any]:
    batch = {k: torch.stack([s[k] for s in samples]) for k in ("latent_mean", "latent_logvar", "text_embeds",
                                                               "text_mask")}
    batch["captions"] = [s["caption"] for s in samples]
    batch["keys"] = [s["key"] for s in samples]
    return batch


class PrecomputedLoader(IndexedLoader):
    """Iterable of precomputed batches (see `make_precomputed_loader`); each `iter()` starts at `start_batch`.

    `IndexedLoader` with the precomputed collate: `stats` sums good/bad samples over workers, `batches_per_epoch`
    is per rank, `sampler.batch_indices(t)` names batch t's samples; plus `manifest`.
    """

    def __init__(self, dataset: PrecomputedShards, sampler: IndexedBatchSampler, num_workers: int = 0):
        super().__init__(dataset, sampler, num_workers=num_workers, collate=_collate_precomputed)
        self.manifest = dataset.manifest


def make_precomputed_loader(
    urls: str | Sequence[str], batch_size: int, num_workers: int = 0, seed: int = 0, rank: int = 0,
    world_size: int = 1, batches_done: int = 0, index_dir: str | os.PathLike | None = None, shard_window: int = 0,
    manifest: dict[str, Any] | None = None,
) -> PrecomputedLoader:
    """Infinite, exactly resumable loader over precomputed shards (the output folder, or a spec of its shards).

    Batches: {"latent_mean", "latent_logvar": (B, C, h, w) float32, "text_embeds": (B, max_text_tokens, D)
    float32 (zeros at padded tokens), "text_mask": (B, max_text_tokens) int64, "captions": [str], "keys": [str]}.
    Order, rank split, `batches_done` resume and `shard_window` are those of `make_indexed_loader` (the same
    `IndexedBatchSampler`). `manifest` defaults to the precompute.json next to the first shard.
    """
    check_loader_args(1, batch_size, num_workers)
    dataset = PrecomputedShards(urls, manifest=manifest, index_dir=index_dir)
    sampler = indexed_batch_sampler(dataset, batch_size, seed, rank, world_size, batches_done, shard_window)
    return PrecomputedLoader(dataset, sampler, num_workers=num_workers)
