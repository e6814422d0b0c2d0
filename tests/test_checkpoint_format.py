"""Checkpoints across versions: the golden checkpoints under tests/golden/ (one per checkpoint format, each written by
the code of its day) resume to their recorded weights and export with today's code."""

import shutil
import signal
from pathlib import Path

import pytest
import torch
from accelerate.state import AcceleratorState
from diffusers import PixArtTransformer2DModel
from safetensors.torch import load_file

import train
from imba.training.checkpoints import load_ema_state
from imba.training.export import export_checkpoint

REPO = Path(__file__).resolve().parents[1]
GOLDEN = REPO / "tests" / "golden"
# format → the parameter digest of its checkpoint at step 2 (what `train.py` printed when it wrote it; a resume
# prints it again once loaded): bitwise, it depends on nothing but the loading
GOLDEN_DIGESTS = {1: "76904443620e2e08"}


def run_main(argv):
    """`train.main` in this process; the accelerate state it made is reset, and its signal handlers must be back."""
    before = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGTERM)}
    try:
        return train.main(argv)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        assert {s: signal.getsignal(s) for s in before} == before


def gap_and_moved(now: dict, expected: dict, before: dict) -> tuple[float, float]:
    assert now.keys() == expected.keys() == before.keys()
    gap = max((now[k] - expected[k]).abs().max().item() for k in now)
    moved = max((expected[k] - before[k]).abs().max().item() for k in now)
    return gap, moved


@pytest.mark.parametrize("fmt", sorted(GOLDEN_DIGESTS))
def test_the_golden_checkpoint_resumes_to_its_recorded_weights_and_exports(fmt, tmp_path, monkeypatch, capsys):
    golden = GOLDEN / f"format{fmt}" / "step_0000002"
    expected = load_file(GOLDEN / f"format{fmt}" / "expected_step_0000004.safetensors")
    out = tmp_path / "run"
    shutil.copytree(golden, out / "checkpoints" / golden.name)
    monkeypatch.chdir(REPO)  # its config names model.pretrained=tests/golden/nano_dit
    assert run_main(["--config", str(golden / "config.yaml"), f"train.output_dir={out}", "train.max_steps=4"]) == 0
    log = capsys.readouterr().out
    assert f"at step 2, parameters {GOLDEN_DIGESTS[fmt]}" in log  # loaded bitwise

    # Two steps later: the weights and the EMA the code of the golden's day reached (recorded with it, see
    # tests/golden/README.md), up to a fraction of what the two steps move them. On one machine and torch version
    # they are bitwise equal (the digest in the README); another CPU may round the sums differently, and on
    # parameters whose gradient is zero in exact arithmetic AdamW turns that rounding into steps. A resume that
    # loses AdamW's moments, the LR schedule's position, the RNG states, the loss's running means or the step (so
    # other batches) moves them by the order of `moved` or more
    step4 = out / "checkpoints" / "step_0000004"
    weights = load_file(step4 / "model.safetensors")
    before = load_file(golden / "model.safetensors")
    gap, moved = gap_and_moved(weights, {k[len("param."):]: v for k, v in expected.items() if k.startswith("param.")},
                               before)
    assert moved > 1e-4 and gap <= 0.05 * moved, (gap, moved)
    ema = load_ema_state(step4)
    assert ema["optimization_step"] == 4
    as_dict = lambda tensors: {f"{i:03d}": t for i, t in enumerate(tensors)}  # noqa: E731
    gap, moved = gap_and_moved(as_dict(ema["shadow_params"]),
                               {k[len("ema."):]: v for k, v in expected.items() if k.startswith("ema.")},
                               as_dict(load_ema_state(golden)["shadow_params"]))
    assert moved > 1e-4 and gap <= 0.05 * moved, (gap, moved)

    # and it exports: the pipeline's transformer holds its EMA weights
    exported = export_checkpoint(out / "checkpoints" / golden.name, tmp_path / "export")
    transformer = PixArtTransformer2DModel.from_pretrained(exported / "transformer")
    for param, shadow in zip(transformer.parameters(), load_ema_state(golden)["shadow_params"], strict=True):
        assert torch.equal(param, shadow)
