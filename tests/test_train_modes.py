"""`train.py` end to end in the modes the default run does not take: the streaming reader, aspect-ratio buckets on
image shards, and fp16 mixed precision (on a GPU; refused on the CPU). Each test checks that the mode really took
effect, not only that the run finished."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import train
from models.encoders import FrozenEncoders
from test_buckets import TABLE, shards as bucket_shards  # noqa: F401 (a fixture)
from test_train_precomputed import run_main

TINY = ["data.resolution=64", "data.batch_size=2", "data.synthetic_samples=24", "data.shuffle_buffer=8",
        "train.log_every=1", "train.save_every=2", "train.sample_every=0", "sample.steps=2",
        "sample.prompts=[a red circle]", "optim.warmup_steps=1", "train.trackers=none", "train.val_every=0"]


@pytest.fixture
def spied(monkeypatch):
    """What train.main hands the loop: the loaders it built (with the batches they skip), and each batch's keys
    and pixel shape."""
    seen = {"loaders": [], "batches": []}
    real_make_loader, real_encode = train.make_loader, FrozenEncoders.encode_batch

    def make_loader(cfg, accelerator, shards, position, *a, **k):
        loader = real_make_loader(cfg, accelerator, shards, position, *a, **k)
        seen["loaders"].append((loader, position.samples))
        return loader

    def encode_batch(self, batch, device):
        seen["batches"].append((list(batch["keys"]), tuple(batch["pixels"].shape[-2:])))
        return real_encode(self, batch, device)

    monkeypatch.setattr(train, "make_loader", make_loader)
    monkeypatch.setattr(FrozenEncoders, "encode_batch", encode_batch)
    return seen


def final_digest(output: str) -> str:
    return re.search(r"rank 0/1: parameters ([0-9a-f]{16})", output).group(1)


def resume_copy(run, step, dest):
    """`dest` as a run killed right after `run` saved its checkpoint at `step`."""
    name = f"step_{step:07d}"
    shutil.copytree(run / "checkpoints" / name, dest / "checkpoints" / name)
    shutil.copytree(run / "synthetic_shards", dest / "synthetic_shards")
    (dest / "checkpoints" / "latest").write_text(name + "\n")


@pytest.mark.slow
def test_streaming_mode_reads_the_stream_reproducibly_and_resumes_after_the_steps_done(tmp_path, spied, capsys):
    common = [*TINY, "data.mode=streaming", "train.max_steps=4"]
    assert run_main([*common, f"train.output_dir={tmp_path / 'a'}"]) == 0
    (loader, consumed), = spied["loaders"]
    # the webdataset pipeline (an iterable dataset), not the indexed reader's map-style one
    assert isinstance(loader.dataset, torch.utils.data.IterableDataset) and consumed == 0
    first, first_digest = spied["batches"][:], final_digest(capsys.readouterr().out)
    assert len(first) == 4 and all(shape == (64, 64) for _, shape in first)

    # the same seed and arguments: the same stream and the same weights
    spied["batches"].clear()
    assert run_main([*common, f"train.output_dir={tmp_path / 'b'}"]) == 0
    assert spied["batches"] == first and final_digest(capsys.readouterr().out) == first_digest

    # resumed after step 2: the stream is reseeded from the samples consumed (2 steps of 2), so it does not replay
    # the first steps
    resume_copy(tmp_path / "a", 2, tmp_path / "c")
    spied["batches"].clear()
    assert run_main([*common, f"train.output_dir={tmp_path / 'c'}"]) == 0
    assert spied["loaders"][-1][1] == 4
    output = capsys.readouterr().out
    assert "at step 2" in output and "data: each rank continues after 2 batches of 2" in output
    assert len(spied["batches"]) == 2 and spied["batches"] != first[:2]


@pytest.mark.slow
def test_buckets_on_image_shards_train_every_batch_at_its_buckets_shape(bucket_shards, tmp_path, spied):
    folder, paths, _, bucket_of, _ = bucket_shards
    out = tmp_path / "run"
    # 36 samples in 10 full batches of 3 per epoch: 12 steps cross an epoch boundary
    args = [*TINY, f"data.shards={folder}", "data.bucketing=true", "data.batch_size=3", "train.max_steps=12",
            f"train.output_dir={out}", "train.save_every=0"]
    assert run_main(args) == 0
    batches = spied["batches"]
    assert len(batches) == 12
    for keys, shape in batches:  # (height, width) of the batch = the bucket of each of its samples
        assert shape in TABLE and all(bucket_of[key] == shape for key in keys), (keys, shape)
    assert len({shape for _, shape in batches}) >= 3  # several buckets, not everything cropped square
    assert (out / "export" / "model_index.json").is_file()


def test_fp16_on_the_cpu_is_refused_in_one_line(tmp_path):
    # accelerate would run it as float32 without autocast or a GradScaler
    proc = subprocess.run([sys.executable, str(Path(train.__file__)), *TINY, "train.mixed_precision=fp16",
                           f"train.output_dir={tmp_path}"], env={**os.environ, "HF_HUB_OFFLINE": "1"},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert re.fullmatch(r"error: train.mixed_precision=fp16 needs a GPU .*; use bf16 or no",
                        proc.stderr.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="fp16 mixed precision needs a GPU")
def test_fp16_trains_under_autocast_and_resumes_exactly(tmp_path, monkeypatch, capsys):
    dtypes = []
    real_predict = train.predict

    def predict(*a, **k):
        dtypes.append(torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else None)
        return real_predict(*a, **k)

    monkeypatch.setattr(train, "predict", predict)
    common = [*TINY, "train.mixed_precision=fp16", "train.max_steps=4"]
    assert run_main([*common, f"train.output_dir={tmp_path / 'full'}"]) == 0
    assert dtypes and set(dtypes) == {torch.float16}  # every training forward under fp16 autocast
    full_digest = final_digest(capsys.readouterr().out)
    # the GradScaler's state is part of every checkpoint
    assert (tmp_path / "full" / "checkpoints" / "step_0000002" / "scaler.pt").is_file()

    resume_copy(tmp_path / "full", 2, tmp_path / "split")
    assert run_main([*common, f"train.output_dir={tmp_path / 'split'}"]) == 0
    output = capsys.readouterr().out
    assert "at step 2" in output and final_digest(output) == full_digest
