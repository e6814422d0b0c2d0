"""The EMA of the trained weights, for every way the model can be held: whole on each rank, or ZeRO-3 partitions.

`make_ema(model.parameters(), ...)` after `accelerator.prepare`:
- whole parameters (single process, DDP, ZeRO-1/2): diffusers' `EMAModel`, with float32 shadows even when
  DeepSpeed holds the module in bf16;
- DeepSpeed ZeRO-3 (each rank holds one slice of every parameter): `PartitionedEMA`.

diffusers' `EMAModel` also runs under ZeRO-3, but keeps a full float32 copy on every rank and gathers every
parameter from all ranks at every step to update it: one more all-gather of the whole model per step and a full
copy per GPU, the memory ZeRO-3 is there to save. `PartitionedEMA` averages each rank's own slice instead
(`param.ds_tensor`, which DeepSpeed's optimizer updates in place): no communication per step and 1/N of the memory.
Full tensors are assembled only to save a checkpoint, sample a grid or export, and are saved in `EMAModel`'s own
format, so `train.py --export`, resume and resume on another process count treat both alike.

DeepSpeed's ZeRO-3 layout (`partition_parameters.py`): a parameter is flattened, padded with zeros to a multiple
of the group size N, and rank r holds elements [r·n, (r+1)·n), n = padded size / N.
"""

from __future__ import annotations

import inspect
from typing import Iterable

import torch
import torch.distributed as dist
from accelerate import init_empty_weights
from diffusers.training_utils import EMAModel

from models.lora import has_lora, merged_state_dict

# torch 2.13 renamed all_gather_into_tensor (deprecated there) to all_gather_single
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def is_partitioned(parameters: Iterable[torch.nn.Parameter]) -> bool:
    """True for ZeRO-3 parameters (DeepSpeed gives them a `ds_tensor` partition)."""
    return any(hasattr(p, "ds_tensor") for p in parameters)


def make_ema(parameters: Iterable[torch.nn.Parameter], **ema_kwargs) -> EMAModel:
    """The EMA for these (prepared) parameters; `ema_kwargs` as diffusers' `EMAModel` (decay, model_cls, ...).

    `foreach=True` by default where the installed diffusers has it: a few multi-tensor ops a step instead of one
    update per parameter tensor. Its update s − (1 − decay)·(s − p) is rounded once where the per-tensor form
    rounds the product first, so the two differ in the last bit of some shadows; it is `PartitionedEMA`'s form."""
    if "foreach" in inspect.signature(EMAModel.__init__).parameters:
        ema_kwargs.setdefault("foreach", True)
    parameters = list(parameters)
    if is_partitioned(parameters):
        return PartitionedEMA(parameters, **ema_kwargs)
    # EMAModel clones what it is given: float32 shadows even when the module itself is held in bf16
    return EMAModel([p.detach().float() for p in parameters], **ema_kwargs)


class PartitionedEMA(EMAModel):
    """EMA of ZeRO-3-partitioned parameters: `shadow_params` holds this rank's float32 slice of each parameter.

    `state_dict`, `load_state_dict` and `full_tensors` are collectives: every rank of the group must call them (the
    training loop does, accelerate's `save_state`/`load_state` too). The state dict holds the full tensors, as an
    `EMAModel` over the whole model would; loading it takes this rank's slices, for any process count.
    """

    def __init__(self, parameters: Iterable[torch.nn.Parameter], **ema_kwargs):
        parameters = list(parameters)
        if not all(hasattr(p, "ds_tensor") for p in parameters):
            raise ValueError("PartitionedEMA needs DeepSpeed ZeRO-3 parameters (after accelerator.prepare)")
        super().__init__([p.ds_tensor.detach().float() for p in parameters], **ema_kwargs)
        self.shapes = [p.ds_shape for p in parameters]
        self.group = parameters[0].ds_process_group

    @torch.no_grad()
    def step(self, parameters: Iterable[torch.nn.Parameter]) -> None:
        """One update from the rank's current slices, with `EMAModel`'s decay schedule; no communication."""
        self.optimization_step += 1
        decay = self.cur_decay_value = self.get_decay(self.optimization_step)
        slices = [p.ds_tensor.float() for p in parameters]
        # s ← s − (1 − decay)·(s − p): EMAModel's update, on the slices
        torch._foreach_sub_(self.shadow_params, torch._foreach_sub(self.shadow_params, slices), alpha=1 - decay)

    def full_tensors(self, keep: bool = True, device="cpu") -> list[torch.Tensor]:
        """Every parameter's full EMA tensor on `device`, gathered one parameter at a time (so only one full
        parameter is ever on the accelerator). Every rank must call it; with keep=False a rank takes part and
        gets an empty list (the main process keeps the tensors it samples or saves from)."""
        world = dist.get_world_size(self.group)
        full = []
        for shard, shape in zip(self.shadow_params, self.shapes):
            gathered = shard.new_empty(world * shard.numel())
            _all_gather(gathered, shard, group=self.group)
            if keep:
                full.append(gathered[:shape.numel()].view(shape).to(device))
        return full

    def state_dict(self) -> dict:
        # whole tensors on the CPU of every rank, briefly (accelerate writes the main process's copy, or each
        # node's with save_on_each_node): 4 bytes per parameter, e.g. 4 GB per rank for the 1b preset
        return {**super().state_dict(), "shadow_params": self.full_tensors()}

    def load_state_dict(self, state_dict: dict) -> None:
        slices = self.shadow_params  # this rank's slices: their sizes and device
        super().load_state_dict(state_dict)  # checks and sets the counters; shadow_params = the full tensors
        full = self.shadow_params
        if [tuple(t.shape) for t in full] != [tuple(s) for s in self.shapes]:
            raise ValueError("the EMA state does not match this model's parameter shapes")
        rank = dist.get_rank(self.group)
        self.shadow_params = []
        for tensor, old in zip(full, slices):
            n = old.numel()
            piece = tensor.reshape(-1)[rank * n:(rank + 1) * n]  # the last rank's slice may run past the end
            self.shadow_params.append(torch.cat([piece, piece.new_zeros(n - piece.numel())]).to(old))


def ema_weights_copy(model: torch.nn.Module, ema: EMAModel, build: bool = True, dtype: torch.dtype = torch.float32,
                     device=None) -> torch.nn.Module | None:
    """A fresh copy of `model` (a diffusers model) holding the EMA weights in `dtype` (float32: the export's; a grid's
    is the training's, e.g. bf16), on `device` (default: the EMA's), in eval mode, without compile or checkpointing
    state, LoRA adapters merged into the weights: what a sample grid and the export run. None where `build` is False.
    With a `PartitionedEMA` every rank must call it (the slices are gathered from all ranks); pass
    build=is_main_process."""
    weights = ema.full_tensors(keep=build) if isinstance(ema, PartitionedEMA) else ema.shadow_params
    if not build:
        return None
    device = torch.device(device or ema.shadow_params[0].device)
    # the parameters on the meta device, allocated once below in `dtype`: no random initialisation (nothing drawn
    # from the training's random streams, so a resumed run does not diverge from an uninterrupted one at the first
    # grid) and never a float32 model on the way to a bf16 one; buffers (the positional table) computed as usual
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), \
            init_empty_weights(include_buffers=False):
        copy = type(model).from_config(model.config)
    if has_lora(model):  # the adapters folded into the base weights: a stock transformer
        state = merged_state_dict(model, weights)
    else:
        state = {**copy.state_dict(), **dict(zip([n for n, _ in copy.named_parameters()], weights, strict=True))}
    # copy=True: never the EMA's own tensors, which the next EMA step changes in place
    copy.load_state_dict({name: t.to(device, dtype if t.is_floating_point() else t.dtype, copy=True)
                          for name, t in state.items()}, assign=True)
    torch.nn.Module.to(copy, device, dtype)  # the buffers; diffusers' own `to` warns about float32 modules
    return copy.eval()
