"""The trackers a run writes to: TensorBoard and Weights & Biases (offline) get every metric, the IMBA monitor's
per-bucket curves and the sample grids as images."""

import glob
import json
import struct
from pathlib import Path

import pytest

from test_train_precomputed import run_main

RUN = ["data.resolution=64", "data.batch_size=2", "data.synthetic_samples=24", "train.max_steps=4",
       "train.log_every=1", "train.sample_every=2", "train.save_every=0", "sample.steps=2",
       "sample.prompts=[a red circle]", "train.trackers=tensorboard,wandb", "loss.kind=imba"]
MONITOR = [f"monitor/{name}_{bucket}" for name in ("distance", "loss_cond") for bucket in ("head", "torso", "tail")]


def wandb_records(path):
    """The protobuf records of a W&B run file (`run-*.wandb`): a 7-byte header, then LevelDB-log framing (32 KiB
    blocks; each piece: checksum u32, length u16, type u8 — full 1, first 2, middle 3, last 4)."""
    from wandb.proto import wandb_internal_pb2

    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


@pytest.mark.slow
def test_tensorboard_and_wandb_get_the_metrics_the_monitor_and_the_grids(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    assert run_main([*RUN, f"train.output_dir={out}"]) == 0

    events = EventAccumulator(str(out / "logs" / "imba-dit"), size_guidance={"images": 0})
    events.Reload()
    assert [e.step for e in events.Scalars("loss")] == [1, 2, 3, 4]
    assert set(MONITOR) <= set(events.Tags()["scalars"])
    grids = events.Images("samples")
    # the grid as samples/ holds it: one 64 px image with its prompt written under it
    from PIL import Image

    saved = Image.open(out / "samples" / "step_0000002.png")
    assert [g.step for g in grids] == [2, 4] and (grids[0].width, grids[0].height) == saved.size
    assert saved.width == 64 and saved.height > 64

    run_dir, = glob.glob(str(out / "wandb" / "offline-run-*"))
    history = {}
    for record in wandb_records(glob.glob(f"{run_dir}/run-*.wandb")[0]):
        if record.WhichOneof("record_type") == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                   for item in record.history.item}
            history[row["_step"]] = row
    assert sorted(history) == [1, 2, 3, 4]
    assert all({"loss", "nonfinite_steps", *MONITOR} <= row.keys() for row in history.values())
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [history[m["step"]]["loss"] for m in metrics] == pytest.approx([m["loss"] for m in metrics])
    for step in (2, 4):  # the grid of each sampled step, as an image of that step
        assert history[step]["samples/_type"] == "images/separated"
        image, = history[step]["samples/filenames"]
        assert image.startswith(f"media/images/samples_{step}_") and (Path(run_dir) / "files" / image).is_file()
