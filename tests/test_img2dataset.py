"""Shards written by the real `img2dataset` tool (its webdataset layout, with its .parquet and _stats.json side files
and a failed download) train, precompute and give concept statistics as they are, with no conversion.

The images are served over HTTP on 127.0.0.1; the command is the one docs/data.md gives users."""

import csv
import functools
import http.server
import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from PIL import Image, ImageDraw

from test_train_precomputed import run_main

pytestmark = pytest.mark.slow
COLOURS = {"red": (220, 30, 30), "blue": (30, 30, 220), "green": (30, 200, 30)}
SHAPES = ("circle", "square")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A folder of 12 pictures behind an HTTP server on 127.0.0.1, and a CSV of their URLs and captions plus
    one URL that answers 404."""
    root = tmp_path_factory.mktemp("web")
    (root / "images").mkdir()
    rows = []
    for colour, rgb in COLOURS.items():
        for shape in SHAPES:
            for k in range(2):
                image = Image.new("RGB", (96, 80), (255, 255, 255))
                draw = ImageDraw.Draw(image)
                (draw.ellipse if shape == "circle" else draw.rectangle)((20 + 5 * k, 15, 70 + 5 * k, 65), fill=rgb)
                name = f"{len(rows):03d}.png"
                image.save(root / "images" / name)
                rows.append((name, f"a {colour} {shape}"))
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root / "images"))
    handler.log_message = lambda *a: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    with open(root / "urls.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["url", "caption"])
        writer.writerows([f"{base}/{name}", caption] for name, caption in rows)
        writer.writerow([f"{base}/missing.png", "a picture that is not there"])
    yield root, rows
    server.shutdown()


@pytest.fixture(scope="module")
def shards(served):
    root, rows = served
    out = root / "shards"
    cmd = [str(Path(sys.executable).parent / "img2dataset"), "--url_list", str(root / "urls.csv"),
           "--input_format", "csv", "--url_col", "url", "--caption_col", "caption", "--output_format", "webdataset",
           "--output_folder", str(out), "--image_size", "64", "--resize_mode", "center_crop",
           "--processes_count", "1", "--thread_count", "4", "--number_sample_per_shard", "8",
           "--enable_wandb", "False"]
    env = {**os.environ, "NO_ALBUMENTATIONS_UPDATE": "1"}  # albumentations would look for its newer versions
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def test_img2dataset_output_is_its_default_layout(shards):
    import pyarrow.parquet as pq

    assert sorted(p.name for p in shards.iterdir()) == [
        "00000.parquet", "00000.tar", "00000_stats.json", "00001.parquet", "00001.tar", "00001_stats.json"]
    stats = [json.loads((shards / f"0000{i}_stats.json").read_text()) for i in range(2)]
    assert sum(s["successes"] for s in stats) == 12 and sum(s["failed_to_download"] for s in stats) == 1
    status = [s for i in range(2) for s in pq.read_table(shards / f"0000{i}.parquet").column("status").to_pylist()]
    assert sorted(status) == ["failed_to_download"] + ["success"] * 12


def test_img2dataset_shards_train_precompute_and_count_concepts(shards, served, tmp_path, capsys):
    from data.concepts.counting import collect_stats
    from data.precompute import PrecomputeSettings, precompute_shards

    out = tmp_path / "run"
    assert run_main([f"data.shards={shards}", "data.resolution=64", "data.batch_size=2", "train.max_steps=3",
                     "train.save_every=0", "train.sample_every=0", "sample.steps=2", "sample.prompts=[a red circle]",
                     "train.trackers=none", f"train.output_dir={out}"]) == 0
    # the indexed reader read every downloaded sample (the failed download is in no tar) and skipped none
    assert re.search(r"data: 6 samples read; skipped 0", capsys.readouterr().out)
    assert (out / "export" / "model_index.json").is_file()

    report = precompute_shards(str(shards), tmp_path / "features", PrecomputeSettings(resolution=64,
                                                                                        max_text_tokens=16))
    assert report["samples"] == 12 and report["bad"] == {} and report["manifest"] is not None

    stats = collect_stats(str(shards))
    _, rows = served
    assert stats.num_captions == 12
    for shape in SHAPES:
        assert stats.counts[shape] == sum(caption.endswith(shape) for _, caption in rows) == 6
