"""The precomputed-features format (what `python -m data.prep.precompute` writes) and its reader for training.

A precompute output folder holds tar shards with the keys of the input shards, `null_text.npy` (the T5 state of
the empty caption, the unconditional embedding IMBA and caption dropout use, stored like `KEY.t5.npy`), and, once
complete, the manifest `precompute.json` (settings, latent and text shapes, VAE scaling factor, sample and skip
counts, shard list), which the reader checks against the training config (`find_manifest`, `check_manifest`).

Format (per sample; every array is a plain `.npy`, readable with `np.load(..., allow_pickle=False)`):
- `KEY.latent.npy`: float16 (2, C, h, w): [0] the VAE posterior mean, [1] its log-variance (clamped to
  [-30, 20] as diffusers does), unscaled. `sample_latents` draws mean + exp(logvar / 2)·ε and multiplies by the
  VAE scaling factor, exactly as `models.vae.encode_images` samples the posterior (no shift factor).
- `KEY.t5.npy`: the T5 last hidden state of the valid tokens only, (n, D) with n = the caption's token count
  (<= max_text_tokens, truncated like training), in the manifest's `text_dtype` (`data.text_states`): float16,
  bfloat16 (as uint16 bit patterns), or int8 with its per-token float32 scale in `KEY.t5scale.npy` (n,). The
  mask is implied: the tokenizer pads on the right, so the first n tokens are valid; the reader restores
  (max_text_tokens, D) with zeros at padded positions (the DiT masks them out of cross-attention, so their values
  never matter).
- `KEY.txt`: the caption that was encoded (the reader's caption: `key.txt`, else `json[caption_field]`,
  stripped). `KEY.json`: the original json (if it parsed as an object) plus `"precompute": {"source",
  "image_size": [w, h] of the original image, "resolution", "text_tokens"}`.

Versions: 1 stores float16/bfloat16 states; 2 adds the int8 states, so that a reader that knows only version 1
refuses them in one line instead of misreading them.

Reading. `make_precomputed_loader` is `data.indexed.make_indexed_loader` over the precomputed shards (the same
index, order and `IndexedBatchSampler`: exact resume and equal batches per rank hold unchanged). Its batches carry
the stored bytes, packed (`PrecomputedShards.get_batch`); `unpack_batch` (called by `PrecomputedFeatures.encode_batch`)
widens and pads them on the training device, so the loader workers and the host-to-device copy move a sample's
stored size, not its padded float32 size. Reading imports neither models/ nor diffusers/transformers; only the
writing side loads the encoders (lazily, via models/).
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import io
import itertools
import math
import mmap
import os
import pickle
import re
import threading
import weakref
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from .files import read_json_object
from .index import ShardIndex, parse_sample
from .indexed import BatchFetch, IndexedLoader, IndexedShards, check_stream, indexed_batch_sampler
from .order import IndexedBatchSampler
from .read_spec import ReadSpec
from .remote import ShardCache, is_indexable_remote, read_bytes, read_json as read_remote_json
from .skips import ReaderStats
from .text_states import (
    SCALED_TEXT_DTYPES,
    STORED_TORCH_DTYPE,
    TEXT_DTYPES,
    check_stored,
    dequantize,
    states_from_numpy,
    stored_tensor,
)
from .urls import expand_urls, is_pipe
from .weighted import StreamBatchSampler

__all__ = [
    "FORMAT_KIND",
    "FORMAT_VERSION",
    "READABLE_VERSIONS",
    "format_version",
    "MANIFEST_NAME",
    "NULL_TEXT_NAME",
    "LATENT_MEMBER",
    "TEXT_MEMBER",
    "TEXT_SCALE_MEMBER",
    "TEXT_DTYPES",
    "npy_bytes",
    "load_npy",
    "null_text_dtype",
    "load_manifest",
    "check_manifest",
    "find_manifest",
    "load_null_text",
    "sample_latents",
    "unpack_batch",
    "PrecomputedFeatures",
    "PrecomputedShards",
    "PrecomputedLoader",
    "make_precomputed_loader",
]

FORMAT_KIND = "imba-dit precomputed features"
FORMAT_VERSION = 1  # float16 / bfloat16 T5 states
COMPACT_FORMAT_VERSION = 2  # adds int8 states with a per-token scale member
READABLE_VERSIONS = (FORMAT_VERSION, COMPACT_FORMAT_VERSION)
MANIFEST_NAME = "precompute.json"
NULL_TEXT_NAME = "null_text.npy"
LATENT_MEMBER = "latent.npy"
TEXT_MEMBER = "t5.npy"
TEXT_SCALE_MEMBER = "t5scale.npy"
BAD_PRECOMPUTED = "bad precomputed sample"


def format_version(text_dtype: str) -> int:
    """The format version that stores T5 states as `text_dtype` (the oldest one that can)."""
    return COMPACT_FORMAT_VERSION if text_dtype in SCALED_TEXT_DTYPES else FORMAT_VERSION


def null_text_dtype(text_dtype: str) -> str:
    """How `null_text.npy` is stored: like the samples' states, except that quantised states keep the one null
    caption in float16 (it has no scale member, and is used in every unconditional row)."""
    return "float16" if text_dtype in SCALED_TEXT_DTYPES else text_dtype


# --------------------------------------------------------------------------------------------------------------
# Arrays <-> bytes
# --------------------------------------------------------------------------------------------------------------


def npy_bytes(arr: np.ndarray) -> bytes:
    """`arr` as the bytes of a plain `.npy` file (C order, no pickle)."""
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(arr), allow_pickle=False)
    return buf.getvalue()


def load_npy(data: bytes | memoryview, copy: bool = True) -> np.ndarray:
    """`np.load(..., allow_pickle=False)` of one member, with its header parsed once per distinct header: the
    members of a set share a few dozen headers (one latent shape, one per caption length), and parsing them with
    `np.load` took ~140 of the ~170 µs a sample's two arrays cost. Writable, like np.load's (a copy of `data`);
    `copy=False` returns a view of `data` instead (writable when `data` is)."""
    data = memoryview(data)
    size_bytes = {1: 2, 2: 4}.get(data[6]) if len(data) > 10 and data[:6] == b"\x93NUMPY" else None
    if size_bytes is None:  # not a version 1/2 .npy: np.load's checks and message
        return np.load(io.BytesIO(data), allow_pickle=False)
    offset = 8 + size_bytes + int.from_bytes(data[8:8 + size_bytes], "little")
    shape, fortran_order, dtype = _npy_header(bytes(data[:offset]))
    count = math.prod(shape)
    if len(data) - offset != count * dtype.itemsize:
        raise ValueError(f".npy member holds {len(data) - offset} data bytes, its header says {shape} {dtype}")
    flat = np.frombuffer(bytearray(data) if copy else data, dtype=dtype, count=count, offset=offset)
    return flat.reshape(shape, order="F" if fortran_order else "C")


# The header np.save writes for a plain array, e.g. {'descr': '<f2', 'fortran_order': False, 'shape': (90, 4096), }
_SAVED_HEADER = re.compile(rb"\{'descr': '([<>|=][a-z]\d+)', 'fortran_order': (True|False), 'shape': \(([\d, ]*)\), \}")


@functools.lru_cache(maxsize=1024)
def _npy_header(header: bytes) -> tuple[tuple[int, ...], bool, np.dtype]:
    # numpy's own parser (ast.literal_eval over the header) costs ~1 ms a header: a fresh loader worker meets one
    # header per caption length; np.save's fixed layout is read directly, anything else by numpy
    match = _SAVED_HEADER.search(header)
    if match is not None:
        shape = tuple(int(n) for n in match.group(3).replace(b" ", b"").split(b",") if n)
        return shape, match.group(2) == b"True", np.dtype(match.group(1).decode())
    fp = io.BytesIO(header)
    version = np.lib.format.read_magic(fp)
    read = np.lib.format.read_array_header_1_0 if version[0] == 1 else np.lib.format.read_array_header_2_0
    shape, fortran_order, dtype = read(fp)
    if dtype.hasobject:
        raise ValueError(".npy member holds Python objects; only plain arrays are read (no pickle)")
    return shape, fortran_order, dtype


# --------------------------------------------------------------------------------------------------------------
# Manifest, null text, latent sampling
# --------------------------------------------------------------------------------------------------------------


def _manifest_path(where: str | os.PathLike | Sequence[str]) -> str:
    spec = where if isinstance(where, (str, os.PathLike)) else next(iter(where), "")
    if is_indexable_remote(os.fspath(spec)):  # the manifest beside the first shard on the store
        return expand_urls(where)[0].rsplit("/", 1)[0] + "/" + MANIFEST_NAME
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
    manifest = read_remote_json(path) if is_indexable_remote(path) else read_json_object(path)
    if manifest is None or manifest.get("__kind__") != FORMAT_KIND:
        raise FileNotFoundError(f"no precompute manifest at {path}: the folder is not precomputed, or its precompute "
                                "did not finish (run `python -m data.prep.precompute IN_SHARDS "
                                f"{os.path.dirname(path)} ...` again: it completes it)")
    version, text_dtype = manifest.get("version"), manifest.get("text_dtype")
    if version not in READABLE_VERSIONS:
        raise ValueError(f"{path} is precompute format version {version}, this code reads versions "
                         f"{list(READABLE_VERSIONS)}: precompute again, or read it with the code that wrote it")
    if text_dtype not in TEXT_DTYPES or format_version(text_dtype) != version:
        raise ValueError(f"{path}: format version {version} does not store text_dtype {text_dtype!r} (this code "
                         f"reads {list(TEXT_DTYPES)}): the manifest is damaged or from other code; precompute again")
    manifest["__path__"] = path if is_indexable_remote(path) else os.path.abspath(path)
    return manifest


def find_manifest(shards: str | Sequence[str], **expected: Any) -> dict[str, Any] | None:
    """The manifest when `shards` (a training config's data.shards) are precompute outputs, checked against
    `expected` (see `check_manifest`); None for ordinary image shards, streamed ones and an empty spec."""
    if not shards or is_pipe(expand_urls(shards)[0]):
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
    beside = f"{manifest['__path__'].rsplit('/', 1)[0]}/{manifest['null_text']}"  # a local path or a URL
    stored = np.load(io.BytesIO(read_bytes(beside)), allow_pickle=False)
    states = states_from_numpy(stored, None, null_text_dtype(manifest["text_dtype"]))
    embeds, mask = _pad_text(states, manifest["max_text_tokens"])
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


def unpack_batch(batch: dict[str, Any], manifest: dict[str, Any], device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """A loader batch in the model's layout, on `device`: {"latent_mean", "latent_logvar": (B, C, h, w),
    "text_embeds": (B, max_text_tokens, D) with zeros at padded tokens, of `dtype`; "text_mask": (B,
    max_text_tokens) int64}. The stored bytes cross to the device as they are; widening, the int8 scales and the
    padding are applied there."""
    moments = batch["latent_moments"].to(device).to(dtype)
    lengths = batch["text_lengths"].to(device)
    scale = batch.get("text_scale")
    states = dequantize(batch["text_states"].to(device), None if scale is None else scale.to(device), dtype)
    positions = torch.arange(manifest["max_text_tokens"], device=lengths.device)
    mask = positions[None, :] < lengths[:, None]
    embeds = states.new_zeros(len(lengths), manifest["max_text_tokens"], manifest["text_hidden_size"])
    embeds[mask] = states  # row-major order: sample b's n_b tokens, then sample b + 1's, as packed
    return {"latent_mean": moments[:, 0], "latent_logvar": moments[:, 1], "text_embeds": embeds,
            "text_mask": mask.long()}


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
        """(latents drawn from the stored posterior, (T5 states, mask)) in float32 on `device`."""
        inputs = unpack_batch(batch, self.manifest, device)
        latents = sample_latents(inputs["latent_mean"], inputs["latent_logvar"], self.manifest["vae_scaling_factor"])
        return latents, (inputs["text_embeds"], inputs["text_mask"])

    def null_like(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.null_embeds.expand(batch_size, -1, -1), self.null_mask.expand(batch_size, -1)


def _shared_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    # Allocated in shared memory from the start (as torch's own default_collate does in workers): the batch then
    # reaches the main process by handle; an ordinary tensor would be copied into shared memory.
    storage = torch.UntypedStorage._new_shared(math.prod(shape) * dtype.itemsize)
    return torch.empty(0, dtype=dtype).set_(storage, 0, shape)


class _RecycledMemory:
    """Page-aligned memory for the batches an in-process loader makes, each region reused once every tensor of
    the batch that lived in it is gone. Fresh memory is slow where it matters: touching a new page cost ~3 µs on
    the machines measured, which for the float16 states of a batch of 64 (47 MB) is more than reading them.

    A batch's tensors are `torch.frombuffer` views of memoryview slices of a region; torch holds each memoryview
    for as long as any tensor or view of that storage lives, so the region is free once weak references to all
    of its memoryviews are dead. A consumer that keeps batches simply keeps their regions: nothing is overwritten.
    """

    def __init__(self, keep: int = 6):
        self.keep = keep
        self._regions: list[tuple[mmap.mmap, list[weakref.ref]]] = []

    def _region(self, nbytes: int) -> mmap.mmap:
        for k, (region, views) in enumerate(self._regions):
            if len(region) >= nbytes and all(ref() is None for ref in views):
                del self._regions[k]
                return region
        pages = -(-nbytes * 5 // 4 // mmap.PAGESIZE)  # headroom: batches vary with their captions' lengths
        return mmap.mmap(-1, max(1, pages) * mmap.PAGESIZE)

    def tensors(self, specs: Sequence[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
        sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in specs]
        offsets = [0]
        for size in sizes:
            offsets.append(offsets[-1] + -(-size // 64) * 64)  # each tensor 64-byte aligned
        region = self._region(offsets[-1])
        out, views = [], []
        for (shape, dtype), size, at in zip(specs, sizes, offsets):
            if size == 0:
                out.append(torch.empty(shape, dtype=dtype))
                continue
            view = memoryview(region)[at:at + size]
            out.append(torch.frombuffer(view, dtype=dtype).view(shape))
            views.append(weakref.ref(view))
        self._regions.append((region, views))
        if len(self._regions) > self.keep:  # forget the oldest: if still in use, its tensors keep it alive
            del self._regions[0]
        return out


def _page_aligned(size: int) -> memoryview:
    # Reading into page-aligned memory: on the machines measured, `preadv` into a buffer at an address 8 or 16
    # bytes past a 64-byte boundary (where bytearray data starts) ran 3-4x slower.
    return memoryview(mmap.mmap(-1, max(mmap.PAGESIZE, -(-size // mmap.PAGESIZE) * mmap.PAGESIZE)))


class _DecodePrecomputed:
    """Raw precomputed samples -> {"latent": (2, C, h, w) float16 array, "text": (n, D) and "scale": (n,) or None
    as stored, "caption", "key"}, checked against the manifest (arrays are views of the raw members); bad ones
    are counted (reason "bad precomputed sample") and dropped."""

    def __init__(self, manifest: dict[str, Any], stats: ReaderStats):
        self.manifest = manifest
        self.stats = stats

    def _parse(self, raw: dict[str, Any]) -> dict[str, Any]:
        m = self.manifest
        for member in (LATENT_MEMBER, TEXT_MEMBER, "txt"):
            if raw.get(member) is None:
                raise ValueError(f"no {member} member")
        latent = load_npy(raw[LATENT_MEMBER], copy=False)
        if latent.dtype != np.float16 or list(latent.shape) != m["latent_shape"]:
            raise ValueError(f"latent is {latent.dtype} {latent.shape}, expected float16 {tuple(m['latent_shape'])}")
        text = load_npy(raw[TEXT_MEMBER], copy=False)
        scale = raw.get(TEXT_SCALE_MEMBER)
        scale = None if scale is None else load_npy(scale, copy=False)
        check_stored(text, scale, m["text_dtype"])
        if not 1 <= text.shape[0] <= m["max_text_tokens"] or text.shape[1] != m["text_hidden_size"]:
            raise ValueError(f"T5 states of shape {text.shape}, expected (1..{m['max_text_tokens']}, "
                             f"{m['text_hidden_size']})")
        if scale is not None and not np.isfinite(scale).all():
            raise ValueError("non-finite int8 scales")
        return {"latent": latent, "text": text, "scale": scale, "caption": bytes(raw["txt"]).decode("utf-8"),
                "key": raw["__key__"]}

    def __call__(self, src: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        for raw in src:
            try:
                sample = self._parse(raw)
            except Exception as exn:  # missing member, corrupt array, wrong shape or dtype
                where = f"{raw.get('__url__', '?')}:{raw.get('__key__', '?')}"
                self.stats.count(BAD_PRECOMPUTED, f"skipping {where}: {BAD_PRECOMPUTED} {exn!r}")
                self.stats.failed(f"{BAD_PRECOMPUTED} at {where}")
                continue
            self.stats.good += 1
            self.stats.failures_in_a_row = 0
            yield sample


class PrecomputedShards(IndexedShards):
    """Random access to precomputed samples: `IndexedShards` (index, bad-sample substitution and counting) with
    the precomputed members decoded instead of images.

    `ds[i]` -> {"latent_mean", "latent_logvar": (C, h, w), "text_embeds": (L, D) zero-padded float32,
    "text_mask": (L,) int64, "caption", "key"}. `ds.get_batch(indices)` -> a loader batch with the stored bytes
    packed, not decoded: {"latent_moments": (B, 2, C, h, w) float16, "text_states": (T, D) in the stored dtype
    (float16, bfloat16 or int8) holding the valid tokens of the B samples one after the other, "text_scale": (T,)
    float32 (int8 only), "text_lengths": (B,) int64, "captions", "keys", "indices"}; `unpack_batch` widens and pads it
    on the training device. Each sample is read with one `preadv` into a page-aligned buffer kept per batch row, its
    members are parsed in place, and its arrays are copied once, into the batch: in a worker, shared memory made
    for it; in the main process, memory recycled from batches that are gone (`_RecycledMemory`).
    """

    def __init__(
        self,
        urls: str | Sequence[str] | ShardIndex,
        manifest: dict[str, Any] | None = None,
        index_dir: str | os.PathLike | None = None,
        cache: ShardCache | None = None,
    ):
        if manifest is None:
            manifest = load_manifest(urls.urls if isinstance(urls, ShardIndex) else urls)
        super().__init__(urls, manifest["resolution"], caption_field=manifest["caption_field"], index_dir=index_dir,
                         cache=cache)
        # the image decoder of IndexedShards is replaced: raw precomputed members -> checked arrays
        self.manifest = manifest
        self.decode = _DecodePrecomputed(manifest, self.stats)
        self._buffers: list[memoryview] = []  # one read buffer per batch row, reused from batch to batch
        self._row = 0
        self._largest: int | None = None
        self._memory = _RecycledMemory()

    def decoding(self) -> dict[str, Any]:  # the manifest: how the features were encoded, and from what
        return {k: v for k, v in self.manifest.items() if k != "__path__"}

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_buffers"] = []
        state["_memory"] = _RecycledMemory()  # a worker's batches go to shared memory instead
        return state

    def raw(self, i: int) -> dict[str, Any]:
        """The members of sample i, as memoryviews into a buffer that the next read into the same row reuses."""
        shard, start, end = self.index.locate(i)
        size = end - start
        while len(self._buffers) <= self._row:  # sized once for the largest sample: never reallocated
            self._buffers.append(_page_aligned(self._largest_span()))
        if len(self._buffers[self._row]) < size:  # the shard changed since indexing; raised below
            self._buffers[self._row] = _page_aligned(size)
        view = self._buffers[self._row][:size]
        got = os.preadv(self._fd(shard), [view], start)
        if got != size:
            raise OSError(f"short read ({got} of {size} bytes): the shard changed, rebuild the index")
        sample = parse_sample(view, copy=False)
        sample["__url__"] = self.index.urls[shard]
        sample["__index__"] = i
        return sample

    def _largest_span(self) -> int:
        if self._largest is None:
            spans = self.index.spans
            self._largest = int((spans[:, 1] - spans[:, 0]).max()) if len(spans) else 0
        return self._largest

    def __getitem__(self, i: int) -> dict[str, Any]:
        sample = self.get(i)
        m = self.manifest
        moments = torch.from_numpy(sample["latent"]).float()
        embeds, mask = _pad_text(states_from_numpy(sample["text"], sample["scale"], m["text_dtype"]),
                                 m["max_text_tokens"])
        return {"latent_mean": moments[0], "latent_logvar": moments[1], "text_embeds": embeds, "text_mask": mask,
                "caption": sample["caption"], "key": sample["key"]}

    def get_batch(self, indices: Sequence[int], size: tuple[int, int] | None = None) -> dict[str, Any]:
        samples = []
        try:
            for row, i in enumerate(indices):
                self._row = row
                samples.append(self.get(i))
        finally:
            self._row = 0
        m = self.manifest
        lengths = [s["text"].shape[0] for s in samples]
        scaled = m["text_dtype"] in SCALED_TEXT_DTYPES
        specs = [((len(samples), *m["latent_shape"]), torch.float16),
                 ((sum(lengths), m["text_hidden_size"]), STORED_TORCH_DTYPE[m["text_dtype"]])]
        if scaled:
            specs.append(((sum(lengths),), torch.float32))
        if torch.utils.data.get_worker_info() is not None:
            tensors = [_shared_tensor(shape, dtype) for shape, dtype in specs]
        else:
            tensors = self._memory.tensors(specs)
        latent, text, scale = tensors[0], tensors[1], tensors[2] if scaled else None
        at = 0
        for row, (sample, n) in enumerate(zip(samples, lengths)):
            latent[row].copy_(torch.from_numpy(sample["latent"]))
            text[at:at + n].copy_(stored_tensor(sample["text"], m["text_dtype"]))
            if scaled:
                scale[at:at + n].copy_(torch.from_numpy(sample["scale"]))
            at += n
        batch = {"latent_moments": latent, "text_states": text, "text_lengths": torch.tensor(lengths),
                 "captions": [s["caption"] for s in samples], "keys": [s["key"] for s in samples],
                 "indices": [s["index"] for s in samples]}
        if scaled:
            batch["text_scale"] = scale
        return batch


class _ThreadedBatches:
    """The batches of `sampler`, made by `threads` threads of this process and yielded in the sampler's order
    (at most 2 per thread ahead). Each thread reads through its own copy of the dataset (file descriptors, read
    buffers, recycled batch memory, bad-sample counts), made the way a DataLoader worker's copy is. Reading,
    copying and the device transfer release the GIL, so the threads overlap the training step."""

    def __init__(self, dataset: PrecomputedShards, sampler: IndexedBatchSampler | StreamBatchSampler, threads: int):
        self.dataset, self.sampler, self.threads = dataset, sampler, threads

    def __iter__(self) -> Iterator[dict[str, Any]]:
        local = threading.local()
        state = pickle.dumps(self.dataset)

        def fetch(indices: list[int]) -> dict[str, Any]:
            if not hasattr(local, "fetch"):
                local.fetch = BatchFetch(pickle.loads(state))
            return local.fetch[indices]

        pool = concurrent.futures.ThreadPoolExecutor(self.threads, thread_name_prefix="imba-reader")
        try:
            order = iter(self.sampler)
            pending = collections.deque(pool.submit(fetch, indices)
                                        for indices in itertools.islice(order, 2 * self.threads))
            while pending:
                batch = pending.popleft().result()
                following = next(order, None)
                if following is not None:
                    pending.append(pool.submit(fetch, following))
                yield batch
        finally:
            pool.shutdown(wait=True, cancel_futures=True)


class PrecomputedLoader(IndexedLoader):
    """Iterable of precomputed batches (see `make_precomputed_loader`); each `iter()` starts at `start_batch`.

    `IndexedLoader` over `PrecomputedShards.get_batch`: `stats` sums good/bad samples over workers,
    `batches_per_epoch` is per rank, `sampler.batch_indices(t)` names batch t's samples; plus `manifest`. With
    `num_threads` > 0 (and no worker processes) the batches are made by threads of this process instead.
    """

    def __init__(self, dataset: PrecomputedShards, sampler: IndexedBatchSampler | StreamBatchSampler,
                 num_workers: int = 0, num_threads: int = 0):
        super().__init__(dataset, sampler, num_workers=num_workers)
        self.manifest = dataset.manifest
        if num_threads:
            self._loader = _ThreadedBatches(dataset, sampler, num_threads)


def make_precomputed_loader(
    shards: str | Sequence[str] | ShardIndex, spec: ReadSpec, *, manifest: dict[str, Any] | None = None,
    sampler: StreamBatchSampler | None = None, cache: ShardCache | None = None,
) -> PrecomputedLoader:
    """Infinite, exactly resumable loader over precomputed shards (the output folder, a spec of its shards, or
    their loaded `ShardIndex`), in the order, rank split and position of `spec` (those of `make_indexed_loader`,
    the same `IndexedBatchSampler`; its decoding fields are the manifest's business).

    Batches hold the stored bytes packed (`PrecomputedShards.get_batch`); `unpack_batch(batch, loader.manifest,
    device)` gives {"latent_mean", "latent_logvar", "text_embeds", "text_mask"} in the model's layout and dtype.
    `spec.loader_threads` > 0: batches made by that many threads of this process, in memory recycled from batches
    that are gone; `spec.num_workers` > 0: by worker processes, in shared memory made per batch. `manifest`
    defaults to the precompute.json next to the first shard. `sampler`: a weighted stream (`data.weighted`) to draw
    from instead, as in `make_indexed_loader`. `cache`: where remote shards are kept (`data.remote.ShardCache`).
    """
    dataset = PrecomputedShards(shards, manifest=manifest, cache=cache)
    if sampler is None:
        sampler = indexed_batch_sampler(dataset, spec)
    else:
        check_stream(sampler, len(dataset), spec.batch_size)
    return PrecomputedLoader(dataset, sampler, num_workers=spec.num_workers, num_threads=spec.loader_threads)
