"""The parts of `bench/gpu_check.sh` that are not the benchmark itself; each prints its findings and writes them as
JSON into --out.

    python bench/gpu_check.py imports --out DIR          # versions of what a run imports, the device
    python bench/gpu_check.py sdpa --out DIR [--preset 1b --resolution 256 --text-tokens 120 --caption-channels 4096]
    python bench/gpu_check.py grid --out DIR -- TRAIN_ARGS...   # train.py in this process; the grid's memory
    python bench/gpu_check.py summary --out DIR         # DIR/gpu_check.md from what the parts wrote there

`sdpa`: one bf16-autocast forward of the DiT at the given size, recording the arguments of every
`scaled_dot_product_attention` call; for the cross-attention (keys: the text tokens, with the caption mask) and the
self-attention it reports the aten op the default dispatch runs (from torch.profiler: `_efficient_attention`,
`_flash_attention`, `_cudnn_attention` or the math fallback) and which backends accept the same call when forced
(`torch.nn.attention.sdpa_kernel`).

`grid`: `train.main(TRAIN_ARGS)` with each sample grid (`GridSampler.between_steps`) measured: device memory held
before it, its peak above that, and after it (CUDA), or the process's peak resident memory (CPU).
"""

from __future__ import annotations

import argparse
import importlib
import json
import resource
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

GIB = 2**30
IMPORTS = ("torch", "accelerate", "transformers", "diffusers", "deepspeed", "webdataset", "braceexpand", "numpy",
           "safetensors", "PIL", "yaml")


def check_imports() -> dict:
    """Each module's version (or the error importing it), the device, and whether the project's trainer imports."""
    found = {}
    for name in IMPORTS:
        try:
            found[name] = getattr(importlib.import_module(name), "__version__", "no __version__")
        except Exception as err:  # noqa: BLE001 - any import failure is the finding
            found[name] = f"FAILED: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU only"
    try:
        import train  # noqa: F401 - the trainer and everything it imports
        trainer = "ok"
    except Exception as err:  # noqa: BLE001
        trainer = f"FAILED: {type(err).__name__}: {err}"
    return {"modules": found, "device": device, "cuda": torch.version.cuda, "train.py imports": trainer}


def sdpa_calls(preset: str, resolution: int, text_tokens: int, caption_channels: int, device: str) -> list[dict]:
    """The (q, k, v, attn_mask) of each SDPA call of one forward of the DiT under bf16 autocast, first of each
    (query length, key length, masked or not)."""
    import torch
    import torch.nn.functional as F

    from models.dit import build_transformer, predict

    latent = resolution // 8
    with torch.device(device):
        torch.manual_seed(0)
        model = build_transformer(preset, latent, caption_channels).eval()
        x = torch.randn(2, 4, latent, latent)
        t = torch.tensor([10, 500])
        e = torch.randn(2, text_tokens, caption_channels)
    mask = (torch.arange(text_tokens, device=device)[None] < torch.tensor([[text_tokens // 3], [text_tokens // 2]],
                                                                          device=device)).long()
    calls: dict[tuple, dict] = {}
    original = F.scaled_dot_product_attention

    def recording(q, k, v, attn_mask=None, *args, **kwargs):
        key = (q.shape[-2], k.shape[-2], attn_mask is not None)
        if key not in calls:
            calls[key] = {"q": q.detach(), "k": k.detach(), "v": v.detach(),
                          "attn_mask": None if attn_mask is None else attn_mask.detach(), "kwargs": kwargs}
        return original(q, k, v, attn_mask, *args, **kwargs)

    F.scaled_dot_product_attention = recording
    try:
        with torch.no_grad(), torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
            predict(model, x, t, e, mask)
    finally:
        F.scaled_dot_product_attention = original
    return [{"query_tokens": q, "key_tokens": k, **c} for (q, k, _), c in calls.items()]


def probe_sdpa(call: dict) -> dict:
    """The aten op the default dispatch picks for this call, and which forced backends accept it."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.profiler import ProfilerActivity, profile

    q, k, v, mask = call["q"], call["k"], call["v"], call["attn_mask"]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if q.is_cuda else [])
    try:
        with torch.no_grad(), profile(activities=activities) as prof:
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **call["kwargs"])
            if q.is_cuda:
                torch.cuda.synchronize()
        names = [e.name for e in prof.events()]
        chosen = sorted({n for n in names if n.startswith("aten::_scaled_dot_product") or "attention" in n.lower()
                         and not n.startswith("aten::scaled_dot_product_attention")})
        kernels = sorted({e.name for e in prof.events()
                          if q.is_cuda and e.device_type == torch.autograd.DeviceType.CUDA})
    except Exception as err:  # noqa: BLE001 - a profiler that cannot start (no CUPTI): the forced backends still say
        chosen, kernels = [f"profiler failed: {type(err).__name__}: {str(err).splitlines()[0][:160]}"], []
    forced = {}
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                    SDPBackend.MATH):
        with warnings.catch_warnings(record=True) as said:  # torch warns why each kernel was not used
            warnings.simplefilter("always")
            try:
                with torch.no_grad(), sdpa_kernel([backend]):
                    F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **call["kwargs"])
                forced[backend.name] = "runs"
            except Exception as err:  # noqa: BLE001 - a backend that cannot run this call, whatever it raises
                reasons = "; ".join(str(w.message).splitlines()[0][:200] for w in said)
                forced[backend.name] = f"refused: {reasons or str(err).splitlines()[0][:160]}"
    return {"query_tokens": call["query_tokens"], "key_tokens": call["key_tokens"], "dtype": str(q.dtype),
            "shape_q": list(q.shape), "mask": None if mask is None else f"{mask.dtype} {list(mask.shape)}",
            "dispatched_ops": chosen, "device_kernels": kernels, "forced_backends": forced}


def check_sdpa(args) -> dict:
    import torch

    device = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
    calls = sdpa_calls(args.preset, args.resolution, args.text_tokens, args.caption_channels, device)
    probes = [probe_sdpa(c) for c in calls]
    for p in probes:
        cross = p["key_tokens"] == args.text_tokens and p["mask"] is not None
        p["role"] = "cross-attention (caption mask)" if cross else "self-attention"
    return {"preset": args.preset, "resolution": args.resolution, "device": device, "calls": probes}


def run_grid(args) -> dict:
    """train.main(args.train_args) with every GridSampler.between_steps measured; grid.json is written after each
    grid too (exit_code null), so a run stopped later, in its final checkpoint say, keeps its grids' numbers."""
    import torch

    import train
    from imba.training.sampling import GridSampler

    cuda = torch.cuda.is_available() and not args.cpu
    grids: list[dict] = []
    original = GridSampler.between_steps
    args.out.mkdir(parents=True, exist_ok=True)

    def measured(self, step, model, ema):
        before_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        if cuda:
            torch.cuda.synchronize()
            held, peak_so_far = torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        out = original(self, step, model, ema)
        entry = {"step": step, "seconds": time.perf_counter() - start}
        if cuda:
            torch.cuda.synchronize()
            entry |= {"held_before_gib": held / GIB, "training_peak_before_gib": peak_so_far / GIB,
                      "grid_peak_gib": torch.cuda.max_memory_allocated() / GIB,
                      "grid_adds_gib": (torch.cuda.max_memory_allocated() - held) / GIB,
                      "held_after_gib": torch.cuda.memory_allocated() / GIB}
        else:
            entry |= {"max_rss_before_gib": before_rss / GIB,
                      "max_rss_after_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB}
        grids.append(entry)
        print(f"gpu_check grid: {entry}", flush=True)
        partial = {"train_args": args.train_args, "exit_code": None, "seconds": time.perf_counter() - start,
                   "grids": grids}
        (args.out / "grid.json").write_text(json.dumps(partial, indent=1, default=str) + "\n")
        return out

    GridSampler.between_steps = measured
    start = time.perf_counter()
    try:
        code = train.main(args.train_args)
    finally:
        GridSampler.between_steps = original
    result = {"train_args": args.train_args, "exit_code": code, "seconds": time.perf_counter() - start,
              "grids": grids}
    if cuda:
        result["run_peak_gib"] = torch.cuda.max_memory_allocated() / GIB
    out_dir = next((a.split("=", 1)[1] for a in args.train_args if a.startswith("train.output_dir=")), None)
    if out_dir:
        result["grid_images"] = sorted(str(p.relative_to(out_dir)) for p in Path(out_dir).rglob("*.png"))
    return result


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def summary(out: Path) -> str:
    """gpu_check.md: the parts' outcomes, the imports, the SDPA kernels, the benchmark tables and the grid."""
    lines = ["# GPU check", ""]
    imports = _read_json(out / "imports.json")
    if imports:
        m = imports["modules"]
        lines += [f"{imports['device']}; CUDA {imports['cuda']}; " + ", ".join(f"{k} {v}" for k, v in m.items()), ""]
    parts = [row.split("\t") for row in (out / "parts.tsv").read_text().splitlines()[1:]] \
        if (out / "parts.tsv").is_file() else []
    lines += ["| part | status | seconds | budget s |", "|---|---|---|---|"]
    lines += [f"| {' | '.join(row)} |" for row in parts] + [""]
    sdpa = _read_json(out / "sdpa.json")
    if sdpa:
        lines += [f"## SDPA kernels ({sdpa['preset']}, {sdpa['resolution']} px, {sdpa['device']}, bf16 autocast)", "",
                  "| attention | query × key tokens | mask | dispatched | device kernels | forced backends |",
                  "|---|---|---|---|---|---|"]
        for c in sdpa["calls"]:
            forced = ", ".join(f"{k.lower()}: {v.split(':')[0]}" for k, v in c["forced_backends"].items())
            lines.append(f"| {c['role']} | {c['query_tokens']} × {c['key_tokens']} | {c['mask']} | "
                         f"{', '.join(c['dispatched_ops'])} | {', '.join(c['device_kernels'])[:200]} | {forced} |")
        lines.append("")
    tables = (out / "benchmarks.md").read_text() if (out / "benchmarks.md").is_file() else ""
    if tables.strip():
        lines += ["## Training step (bench/gpu_benchmark.py)", tables.replace("\n## ", "\n### "), ""]
    grid = _read_json(out / "grid.json")
    if grid:
        ended = "did not finish" if grid["exit_code"] is None else f"exit {grid['exit_code']}"
        lines += [f"## Grid at step 2 (train.py, {ended}, {grid['seconds']:.0f} s; run peak "
                  f"{grid.get('run_peak_gib', float('nan')):.2f} GiB)", "",
                  "`" + " ".join(grid["train_args"]) + "`", ""]
        lines += [f"- {g}" for g in grid["grids"]] + [""]
    text = "\n".join(lines)
    (out / "gpu_check.md").write_text(text)
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("part", choices=["imports", "sdpa", "grid", "summary"])
    ap.add_argument("--out", type=Path, required=True, help="folder for <part>.json")
    ap.add_argument("--cpu", action="store_true", help="on the CPU even where a GPU is present")
    ap.add_argument("--preset", default="1b")
    ap.add_argument("--resolution", type=int, default=256)
    ap.add_argument("--text-tokens", type=int, default=120)
    ap.add_argument("--caption-channels", type=int, default=4096)
    argv = sys.argv[1:] if argv is None else list(argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    args = ap.parse_args(argv[:cut])
    args.train_args = argv[cut + 1:]  # grid: train.py's arguments
    if args.part == "summary":
        print(summary(args.out))
        return 0
    found = {"imports": check_imports, "sdpa": lambda: check_sdpa(args), "grid": lambda: run_grid(args)}[args.part]()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.part}.json").write_text(json.dumps(found, indent=1, default=str) + "\n")
    print(json.dumps(found, indent=1, default=str))
    if args.part == "imports":
        return int(any(str(v).startswith("FAILED") for v in [*found["modules"].values(), found["train.py imports"]]))
    return int(args.part == "grid" and found["exit_code"] != 0)


if __name__ == "__main__":
    sys.exit(main())
