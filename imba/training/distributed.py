"""The accelerator of a run and what each distributed mode needs from it.

One code path serves a single process, DDP and DeepSpeed ZeRO-1/2/3 (`accelerate launch --config_file
launch/accelerate/*.yaml`). Under ZeRO-3 every rank holds a slice of every DiT parameter, so forward passes and
parameter reads are collectives: the helpers here say so where it matters.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs, ProjectConfiguration
from transformers.integrations import unset_hf_deepspeed_config

from imba.training.config import Config, ConfigError, tracker_names
from imba.training.ema import is_partitioned
from models.dit import predict


def check_output_dir(out: Path) -> None:
    """ConfigError unless the run's folder `out` is a folder or can be made one: neither it nor a folder above it
    may be a file (every rank checks, before the accelerator makes anything there)."""
    for path in (out, *out.parents):
        if path.is_dir():
            return
        if path.exists():
            where = "is a file" if path == out else f"is inside {path}, which is a file"
            raise ConfigError(f"train.output_dir={out} {where}: set train.output_dir to a new or existing folder")


DEEPSPEED_CPU_OP = "deepspeed_shm_comm"  # the C++ op DeepSpeed compiles on a machine's first CPU run


def deepspeed_build_notice() -> str | None:
    """The line announcing DeepSpeed's compile of its CPU collectives' op, when a DeepSpeed launch on the CPU has
    not built it yet on this machine (torch's extension folder: TORCH_EXTENSIONS_DIR, else its default), else
    None: the compile takes minutes with nothing on the screen."""
    if (os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() != "true" or torch.cuda.is_available()
            or os.environ.get("ACCELERATE_USE_CPU", "").lower() == "true"):  # accelerate then drops DeepSpeed
        return None
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    if os.path.isfile(os.path.join(root, DEEPSPEED_CPU_OP, f"{DEEPSPEED_CPU_OP}.so")):
        return None
    return (f"DeepSpeed: compiling its C++ op for collectives on the CPU ({DEEPSPEED_CPU_OP}), once on this machine: "
            f"a few minutes, kept in {root}")


def make_accelerator(cfg: Config, out: Path) -> Accelerator:
    check_output_dir(out)
    if (notice := deepspeed_build_notice()) and os.environ.get("LOCAL_RANK", "0") == "0":
        print(notice, flush=True)  # before the accelerator: DeepSpeed compiles it while the processes connect
    trackers = tracker_names(cfg.train.trackers)
    if "tensorboard" in trackers and importlib.util.find_spec("tensorboard") is None:
        trackers.remove("tensorboard")  # accelerate's tracker needs it; skip quietly when absent
    # CPU multi-process runs (tests, debugging) need gloo, else DeepSpeed asks for oneCCL; naming a backend in a
    # single process would make accelerate expect a process group, so only when launched distributed
    distributed_cpu = not torch.cuda.is_available() and int(os.environ.get("WORLD_SIZE", "1")) > 1
    if not torch.cuda.is_available():  # said, DeepSpeed's CPU accelerator needs no warning in every process
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    accelerator = Accelerator(
        gradient_accumulation_steps=cfg.train.grad_accum,
        mixed_precision=cfg.train.mixed_precision,
        log_with=trackers or None,
        project_config=ProjectConfiguration(project_dir=str(out), logging_dir=str(out / "logs")),
        kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")] if distributed_cpu else [],
    )
    asked_deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true"
    if asked_deepspeed and accelerator.state.deepspeed_plugin is None:
        # accelerate drops a DeepSpeed launch config when told to use the CPU, without a word
        accelerator.print(f"warning: the launch asked for DeepSpeed, but ACCELERATE_USE_CPU=true makes accelerate "
                          f"run {accelerator.distributed_type.value} without it: no ZeRO, DDP checkpoints; for ZeRO on "
                          "the CPU launch without ACCELERATE_USE_CPU")
    cpu_fp16 = accelerator.mixed_precision == "fp16" and accelerator.device.type == "cpu"
    if cpu_fp16 and accelerator.state.deepspeed_plugin is None:
        # accelerate has no fp16 autocast or GradScaler on the CPU: it would train in float32 and not say so
        raise ConfigError("train.mixed_precision=fp16 needs a GPU (on the CPU accelerate would silently train in "
                          "float32); use bf16 or no")
    return accelerator


def describe_world(accelerator: Accelerator) -> str:
    """How the run is spread, for its first line: `DEEPSPEED, ZeRO-2`, `MULTI_GPU`, `NO`, ..."""
    mode = accelerator.distributed_type.value
    plugin = accelerator.state.deepspeed_plugin
    return f"{mode}, ZeRO-{plugin.zero_stage}" if plugin is not None else mode


def threads_per_process(available: int, local_processes: int) -> int:
    """Intra-op threads for each of `local_processes` processes on one machine sharing `available` threads: torch
    gives each process all of them, which oversubscribes the cores as soon as two processes train side by side."""
    return max(1, available // max(1, local_processes))


def set_cpu_threads(accelerator: Accelerator) -> str:
    """On the CPU, each process's intra-op threads (`threads_per_process` of torch's own count, unless
    OMP_NUM_THREADS chose them) and how they were chosen, for the run's first line; "" on a GPU."""
    if accelerator.device.type != "cpu":
        return ""
    if os.environ.get("OMP_NUM_THREADS"):
        return f", {torch.get_num_threads()} CPU threads per process (OMP_NUM_THREADS)"
    local = int(os.environ.get("LOCAL_WORLD_SIZE", accelerator.num_processes))
    available = torch.get_num_threads()
    torch.set_num_threads(threads_per_process(available, local))
    return (f", {torch.get_num_threads()} CPU threads per process ({available} available, {local} process"
            f"{'es' if local > 1 else ''} here; OMP_NUM_THREADS=N chooses)")


def configure_deepspeed(accelerator: Accelerator, batch_size: int) -> bool:
    """Adapt accelerate's DeepSpeed config to this loop, before any model is loaded; True under ZeRO-3."""
    plugin = accelerator.state.deepspeed_plugin
    if plugin is None:
        return False
    plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = batch_size  # the loaders batch, not DeepSpeed
    zero3 = plugin.zero_stage == 3
    if zero3:  # the engine partitions the DiT in prepare; without this, transformers' from_pretrained would
        unset_hf_deepspeed_config()  # partition the frozen T5 too (zero.Init), and every rank needs it whole
    return zero3


def check_zero3_settings(cfg: Config) -> None:
    """The settings ZeRO-3 cannot take, refused in one line each before any model is built."""
    if cfg.model.lora_rank:  # the adapters' export needs the EMA whole on one rank
        raise ConfigError("model.lora_rank is not supported under ZeRO-3: use ZeRO-2 or DDP (LoRA's optimizer "
                          "state is small, and ZeRO-2 partitions it)")
    if cfg.speed.compile:  # measured over gloo with DeepSpeed's own engine.compile: no faster than eager, and worse
        raise ConfigError("speed.compile is not supported under ZeRO-3: DeepSpeed's parameter hooks break the compiled "
                          "graph at every submodule and recompile it until torch falls back to eager; use ZeRO-2 or "
                          "DDP with speed.compile=true (python -m imba.training.plan CONFIG says what fits), or "
                          "speed.compile=false")


def compile_prepared(accelerator: Accelerator, wrapped: torch.nn.Module, model: torch.nn.Module) -> None:
    """`torch.compile` for the DiT after `accelerator.prepare`, so that the compiled graphs are those of the model as
    it trains: under DeepSpeed through its engine's `compile` (which compiles the module with ZeRO-3's parameter hooks
    already in place and turns off the NVTX ranges that break graphs; compiled before `prepare`, ZeRO-3's hooks were
    traced into the graphs and recompiled at every call until dynamo gave up), otherwise the bare DiT in place
    (`nn.Module.compile`: DDP's gradient hooks stay outside the graph; the no-grad passes are compiled too)."""
    if accelerator.state.deepspeed_plugin is not None:
        wrapped.compile()
    else:
        model.compile()


def parameter_digest(model: torch.nn.Module) -> str:
    """A short hash of every parameter's bytes: equal on all ranks iff their weights are bitwise identical.
    Under ZeRO-3 the parameters are gathered first, a collective: call it on every rank."""
    params = list(model.parameters())
    gathered = contextlib.nullcontext()
    if is_partitioned(params):
        import deepspeed

        gathered = deepspeed.zero.GatheredParameters(params)
    digest = hashlib.sha256()
    with gathered:
        for p in params:
            digest.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def run_predict(wrapped: torch.nn.Module, model: torch.nn.Module, vae_scale: int):
    """The run's `predict(noisy, timesteps, embeds, mask)`: with gradients through the prepared (wrapped) DiT, without
    them through the bare `model`. A no-grad pass (the efficient estimator's) bypasses the DDP wrapper: its forward
    broadcasts buffers, a collective, and ranks may differ in whether they run that pass at all."""
    def predict_fn(noisy, timesteps, embeds, mask):
        return predict(wrapped if torch.is_grad_enabled() else model, noisy, timesteps, embeds, mask, vae_scale)

    return predict_fn
