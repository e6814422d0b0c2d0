"""Mistakes train.py can only find once it runs (a file where the output folder goes, a data.min_size above every
image) end in one line naming the fix and a non-zero exit status, like a bad config key, not in a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from data.indexed import make_indexed_loader
from data.read_spec import ReadSpec
from data.skips import NoUsableSamples
from data.streaming import make_image_text_loader
from data.synthetic import write_synthetic_shards
from imba.training.config import ConfigError
from imba.training.config import load_config
from imba.training.distributed import check_output_dir, check_zero3_settings

REPO = Path(__file__).resolve().parents[1]


def train_py(*args: str, cwd: Path) -> tuple[int, str]:
    """`python train.py ARGS` (offline, one thread); (exit status, stderr)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(REPO / "train.py"), *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)
    return proc.returncode, proc.stderr


def test_an_output_dir_that_is_a_file_is_one_line(tmp_path):
    run = tmp_path / "run"
    run.write_text("a file where the run's folder would go")
    status, stderr = train_py(f"train.output_dir={run}", cwd=tmp_path)
    assert status != 0 and "Traceback" not in stderr, stderr
    assert stderr.strip().splitlines()[-1] == (f"error: train.output_dir={run} is a file: set train.output_dir to a "
                                               f"new or existing folder")
    assert run.read_text() == "a file where the run's folder would go"


def test_an_output_dir_inside_a_file_is_refused_and_a_new_one_is_not(tmp_path):
    (tmp_path / "notes").write_text("")
    with pytest.raises(ConfigError, match=r"is inside .*notes, which is a file: set train.output_dir"):
        check_output_dir(tmp_path / "notes" / "run" / "deeper")
    check_output_dir(tmp_path / "new" / "run")  # made later by the run
    check_output_dir(tmp_path)
    check_output_dir(Path("relative-run"))


def test_a_min_size_above_every_image_is_one_line(tmp_path):
    # the default run: a synthetic set of data.resolution-pixel images, encoded once (data.precompute=auto)
    status, stderr = train_py(f"train.output_dir={tmp_path / 'run'}", "data.min_size=100000",
                              "data.synthetic_samples=16", cwd=tmp_path)
    assert status != 0 and "Traceback" not in stderr, stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("error: data.precompute: no usable sample") and last.endswith("lower data.min_size"), last


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return write_synthetic_shards(tmp_path_factory.mktemp("synthetic"), num_samples=8, resolution=32)


def test_the_indexed_loader_refuses_a_min_size_above_every_image_before_reading(shards):
    with pytest.raises(ValueError, match=r"data.min_size=33: no image in .* is that large \(the largest shorter side "
                                         r"is 32 px\); lower data.min_size"):
        make_indexed_loader(shards, ReadSpec(resolution=32, batch_size=2, min_size=33))
    make_indexed_loader(shards, ReadSpec(resolution=32, batch_size=2, min_size=32))  # every image is 32 px: all usable


def test_the_streaming_reader_names_data_min_size_when_every_image_was_too_small(shards):
    loader = make_image_text_loader(shards, ReadSpec(resolution=32, batch_size=2, shuffle_buffer=0, min_size=33))
    with pytest.raises(NoUsableSamples, match="every image read is smaller than data.min_size") as info:
        next(iter(loader))
    assert "\n" not in str(info.value) and isinstance(info.value, RuntimeError)


@pytest.mark.parametrize("resume,message", [
    ("laest", "checkpoint 'laest' not found; pass --resume latest or a step_* folder"),
    ("RUN", "is a run's output folder, not a checkpoint: resume it with train.output_dir="),
])
def test_a_resume_path_that_names_no_checkpoint_is_one_line_before_any_work(tmp_path, resume, message):
    earlier = tmp_path / "earlier"
    (earlier / "checkpoints").mkdir(parents=True)
    run = tmp_path / "run"
    status, stderr = train_py(f"train.output_dir={run}", "--resume", str(earlier) if resume == "RUN" else resume,
                              cwd=tmp_path)
    assert status != 0 and "Traceback" not in stderr, stderr
    assert message in stderr.strip().splitlines()[-1]
    # refused before the synthetic set is written or anything is encoded: the new run's folder stays empty
    assert not run.exists() or not any(run.iterdir())


@pytest.mark.parametrize("section, key, value", [("model", "lora_rank", 4), ("speed", "compile", True)])
def test_what_zero3_cannot_take_is_refused_in_one_line(section, key, value):
    cfg = load_config([])
    check_zero3_settings(cfg)  # the defaults pass
    setattr(getattr(cfg, section), key, value)
    with pytest.raises(ConfigError) as err:
        check_zero3_settings(cfg)
    assert str(err.value).startswith(f"{section}.{key} is not supported under ZeRO-3: ")
    assert "use ZeRO-2 or DDP" in str(err.value) and "\n" not in str(err.value)
