"""LoRA fine-tuning of the DiT with peft: low-rank adapters on chosen linear layers, the base weights frozen.

`add_lora` injects the adapters in place: the model stays a `PixArtTransformer2DModel`, so the training loop, the
EMA and checkpoints see one module as before, and the adapters' B matrices start at zero, so the first step predicts
exactly what the pretrained model does. `merged_state_dict` folds W + (alpha / rank) B A back into plain weights:
the grids and the export are a stock transformer. `save_adapter` writes the adapters alone as a peft adapter folder
(`adapter_config.json`, `adapter_model.safetensors`) that `peft.PeftModel.from_pretrained(transformer, folder)`
loads onto the base model (diffusers' PixArt pipelines have no `load_lora_weights`), plus `base_model.json`: where
the base came from and a digest of its weights (`base_digest`). `load_adapter` is peft's loading behind a check of
that digest: an adapter added to other base weights than it was trained on predicts something it never learned, and
nothing in peft would say so.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Sequence

import torch
from peft import LoraConfig, get_peft_model_state_dict, inject_adapter_in_model
from peft.tuners.lora import LoraLayer
from safetensors.torch import save_file

ADAPTER = "default"  # peft's adapter name
PEFT_PREFIX = "base_model.model."  # how a PeftModel names the wrapped model's keys in adapter_model.safetensors
BASE_FILE = "base_model.json"  # beside peft's files: the base's source and the digest of its weights
DIGEST = "sha256"

log = logging.getLogger(__name__)


def lora_config(rank: int, alpha: float, targets: Sequence[str]) -> LoraConfig:
    """`alpha` 0 = `rank` (scale 1)."""
    return LoraConfig(r=rank, lora_alpha=alpha or rank, target_modules=list(targets), lora_dropout=0.0,
                      init_lora_weights=True)


def add_lora(model: torch.nn.Module, rank: int, alpha: float, targets: Sequence[str]) -> torch.nn.Module:
    """Freeze `model` and give the linear layers named by `targets` (suffixes of module names, e.g. "to_q",
    "ff.net.2") trainable rank-`rank` adapters; in place, returns `model`. A target naming no layer is refused."""
    known = {name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}
    missing = [t for t in targets if not any(name == t or name.endswith(f".{t}") for name in known)]
    if missing:
        raise ValueError(f"model.lora_targets {missing} name no linear layer of the DiT (e.g. to_q, to_k, to_v, "
                         "to_out.0, ff.net.0.proj, ff.net.2)")
    model.requires_grad_(False)
    inject_adapter_in_model(lora_config(rank, alpha, targets), model, adapter_name=ADAPTER)
    return model


def has_lora(model: torch.nn.Module) -> bool:
    return any(isinstance(module, LoraLayer) for module in model.modules())


def describe(model: torch.nn.Module) -> str:
    """'N parameters' or, with adapters, 'N parameters, of which M train (LoRA)', for the start-up log."""
    total = sum(p.numel() for p in model.parameters())
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if trained == total:
        return f"{total:,} parameters"
    return f"{total:,} parameters, of which {trained:,} train ({100 * trained / total:.2f} %, LoRA)"


def _named(model: torch.nn.Module, weights: Sequence[torch.Tensor] | None) -> dict[str, torch.Tensor]:
    """`weights` (in the order of `model.parameters()`, e.g. the EMA's; None: the model's own) by parameter name."""
    names = [name for name, _ in model.named_parameters()]
    if weights is None:
        weights = [p.detach() for p in model.parameters()]
    return dict(zip(names, weights, strict=True))


def merged_state_dict(model: torch.nn.Module, weights: Sequence[torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The state dict of `model` without adapters: each adapted layer's weight is W + scale · B A, every other
    parameter and saved buffer as it is. `weights`: see `_named`."""
    named = _named(model, weights)
    named |= {name: buffer for name, buffer in model.state_dict().items() if name not in named}  # saved buffers
    merged: dict[str, torch.Tensor] = {}
    for prefix, module in model.named_modules():
        if isinstance(module, LoraLayer):
            a, b = named.pop(f"{prefix}.lora_A.{ADAPTER}.weight"), named.pop(f"{prefix}.lora_B.{ADAPTER}.weight")
            base = named.pop(f"{prefix}.base_layer.weight")
            merged[f"{prefix}.weight"] = base + module.scaling[ADAPTER] * (b.to(base.dtype) @ a.to(base.dtype))
            if f"{prefix}.base_layer.bias" in named:
                merged[f"{prefix}.bias"] = named.pop(f"{prefix}.base_layer.bias")
    return {**named, **merged}


def base_weights(model: torch.nn.Module, weights: Sequence[torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The base model's parameters under a stock transformer's names: an adapted layer's `base_layer` weights as its
    own, the adapters left out; buffers (the sin-cos position table, rebuilt for each resolution) are no weights.
    `weights`: see `_named`."""
    return {name.replace(".base_layer.", "."): w for name, w in _named(model, weights).items()
            if ".lora_A." not in name and ".lora_B." not in name}


def base_digest(model: torch.nn.Module, weights: Sequence[torch.Tensor] | None = None,
                rounded_to: torch.dtype | None = None, dtype: torch.dtype | None = None) -> str:
    """"sha256:<hex>" over the base weights (`base_weights`) in name order: each name, dtype, shape and bytes. The
    same for a stock transformer and for the adapted model trained from it; any changed weight changes it. Each
    tensor is first rounded to `rounded_to`, then cast to `dtype`, where given."""
    digest = hashlib.sha256()
    for name, tensor in sorted(base_weights(model, weights).items()):
        tensor = tensor.detach().cpu()
        if rounded_to is not None:
            tensor = tensor.to(rounded_to)
        tensor = tensor.to(dtype or tensor.dtype).contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}\n".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy())
    return f"{DIGEST}:{digest.hexdigest()}"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _base_dtype(model: torch.nn.Module, weights: Sequence[torch.Tensor] | None = None) -> str:
    return _dtype_name(next(iter(base_weights(model, weights).values())).dtype)


def _held_in(model: torch.nn.Module, weights: Sequence[torch.Tensor] | None = None) -> str | None:
    """The half-precision dtype every base weight is exact in, or None. DeepSpeed's bf16 and fp16 hold the whole
    module, the frozen base too, in half precision: such a run trained on the base rounded, and a float32 base
    loaded to take its adapter is compared rounded the same way."""
    tensors = list(base_weights(model, weights).values())
    for half in (torch.bfloat16, torch.float16):
        if all(t.dtype == half or torch.equal(t, t.to(half).to(t.dtype)) for t in tensors):
            return _dtype_name(half)
    return None


def save_adapter(model: torch.nn.Module, folder: Path, rank: int, alpha: float, targets: Sequence[str],
                 weights: Sequence[torch.Tensor] | None = None, base: str = "", base_subfolder: str = "") -> Path:
    """The adapters of `model` as a peft adapter folder, with `BASE_FILE`; `weights`: see `_named` (the base's
    digest is taken from them too); `base`: the model they adapt (a hub id or an absolute folder) and its
    `base_subfolder`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = lora_config(rank, alpha, targets)
    config.base_model_name_or_path = base or None
    config.save_pretrained(str(folder))
    state = get_peft_model_state_dict(model, state_dict=_named(model, weights), adapter_name=ADAPTER)
    save_file({PEFT_PREFIX + k: w.detach().float().contiguous().cpu() for k, w in state.items()},
              str(folder / "adapter_model.safetensors"))
    record = {"base_model_name_or_path": base or None, "subfolder": base_subfolder or None,
              "digest": base_digest(model, weights), "dtype": _base_dtype(model, weights),
              "held_in": _held_in(model, weights)}
    (folder / BASE_FILE).write_text(json.dumps(record, indent=1) + "\n")
    return folder


def load_adapter(transformer: torch.nn.Module, folder: str | Path):
    """`peft.PeftModel.from_pretrained(transformer, folder)` (what the pipeline's transformer becomes), refused
    (`ValueError`, one line) where `transformer`'s weights are not the base the adapter was trained on
    (`BASE_FILE`'s digest). An adapter folder without that record (written elsewhere) loads with a warning."""
    from peft import PeftModel

    folder = Path(folder)
    if not (folder / "adapter_config.json").is_file():
        raise FileNotFoundError(f"{folder} holds no adapter (adapter_config.json): give the lora/ folder of a LoRA "
                                "run's export")
    record_file = folder / BASE_FILE
    if not record_file.is_file():
        log.warning("%s has no %s: the base weights it was trained on cannot be checked", folder, BASE_FILE)
    else:
        record = json.loads(record_file.read_text())
        source = record.get("base_model_name_or_path") or "an unrecorded source"
        if record.get("subfolder"):
            source += f", subfolder {record['subfolder']}"
        theirs, ours = _base_dtype(transformer), base_digest(transformer)
        held_in = record.get("held_in")
        if ours != record["digest"] and held_in:  # trained on the base rounded to half precision: compare it so
            rounded = base_digest(transformer, rounded_to=getattr(torch, held_in), dtype=getattr(torch, record["dtype"]))
            ours = rounded  # the same form as the record's, in a refusal too
        if ours != record["digest"] and theirs != record["dtype"] and theirs != held_in:
            raise ValueError(f"the adapter in {folder} was trained on {record['dtype']} base weights (from {source}); "
                             f"these are {theirs}: load the base in {record['dtype']} (torch_dtype), load the "
                             "adapter, then cast the pipeline")
        if ours != record["digest"]:
            short = record["digest"].partition(":")[2][:8]
            raise ValueError(f"the adapter in {folder} was trained on base weights {short} (from {source}); these "
                             f"are {ours.partition(':')[2][:8]}: load the base it was trained from")
    return PeftModel.from_pretrained(transformer, str(folder))
