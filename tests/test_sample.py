"""`python -m imba.training.sample`: tiny export (or checkpoint) + prompt file → images, manifest, grid; seeds per image."""

import json

import numpy as np
import pytest
import torch
from PIL import Image

from imba.objectives import build_objective
from models.dit import build_transformer
from models.pipeline import build_pipeline, export_pipeline
from imba.training.checkpoints import EMA_STATE_FILE
from imba.training.sample import SampleError, load_prompt_file, main
from models.text_encoder import load_text_encoder
from models.vae import load_vae

RESOLUTION = 32  # tiny VAE downsamples 8×: 4×4 latents, 2×2 patches
FAST = ["--steps", "2", "--max-text-tokens", "16"]


def make_tiny_transformer():
    torch.manual_seed(0)
    return build_transformer("tiny", sample_size=RESOLUTION // 8, caption_channels=64).eval()


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("export")
    tokenizer, t5 = load_text_encoder("tiny")
    scheduler = build_objective("flow").sampling_scheduler()
    export_pipeline(build_pipeline(make_tiny_transformer(), load_vae("tiny"), t5, tokenizer, scheduler), folder)
    return folder


def write_json(path, data):
    path.write_text(json.dumps(data))
    return path


def manifest(out):
    return [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]


def pixels(out, row):
    return np.asarray(Image.open(out / row["image"]), dtype=np.int16)


BENCHMARK = [  # the shape of data.prep.benchmark.build_benchmark's entries
    {"prompt": "a photo of a zebra and a piano", "concepts": ["zebra", "piano"], "counts": [3, 90],
     "buckets": ["tail", "head"], "bins": [0, 5], "template": "a photo of {a} and {b}"},
    {"prompt": "a kite next to an anvil", "concepts": ["kite", "anvil"], "counts": [40, 2],
     "buckets": ["torso", "tail"], "bins": [3, 0], "template": "{a} next to {b}"},
    {"prompt": "a cat on top of a dog", "concepts": ["cat", "dog"], "counts": [99, 98],
     "buckets": ["head", "head"], "bins": [5, 5], "template": "{a} on top of {b}"},
]


def test_writes_images_manifest_and_grid_with_per_image_seeds(export_dir, tmp_path):
    prompts = write_json(tmp_path / "bench.json", BENCHMARK)
    out = tmp_path / "out"
    assert main([str(export_dir), "--prompts", str(prompts), "--out", str(out), *FAST, "--seed", "7",
                 "--images-per-prompt", "2", "--batch-size", "4", "--guidance-scale", "3.0"]) == 0
    rows = manifest(out)
    assert [r["image"] for r in rows] == [f"images/{i:05d}.png" for i in range(6)]
    assert [(r["prompt_index"], r["sample_index"]) for r in rows] == [(p, j) for p in range(3) for j in range(2)]
    assert [r["seed"] for r in rows] == list(range(7, 13))
    for row in rows:
        entry = BENCHMARK[row["prompt_index"]]
        assert row["prompt"] == entry["prompt"]
        assert {k: row[k] for k in ("concepts", "counts", "buckets", "bins", "template")} == {
            k: entry[k] for k in ("concepts", "counts", "buckets", "bins", "template")}
        assert (row["guidance_scale"], row["steps"], row["resolution"], row["max_text_tokens"]) == (3.0, 2, 32, 16)
        assert Image.open(out / row["image"]).size == (RESOLUTION, RESOLUTION)
    # one row per prompt: 2 images wide, 3 prompts high
    assert Image.open(out / "grid.png").size == (2 * RESOLUTION, 3 * RESOLUTION)
    # different seeds give different images (the model is random, but not constant)
    assert np.abs(pixels(out, rows[0]) - pixels(out, rows[1])).max() > 10


def run_with_batch_size(export_dir, prompts, out, batch_size, *extra):
    assert main([str(export_dir), "--prompts", str(prompts), "--out", str(out), *FAST, "--batch-size",
                 str(batch_size), *extra]) == 0
    return [pixels(out, r) for r in manifest(out)]


def test_images_do_not_depend_on_the_batch_size(export_dir, tmp_path):
    prompts = write_json(tmp_path / "p.json", ["a red circle", "a blue square", "a green star"])
    # float64: bit-identical images for batch size 1 and 3
    one = run_with_batch_size(export_dir, prompts, tmp_path / "b1", 1, "--dtype", "float64")
    three = run_with_batch_size(export_dir, prompts, tmp_path / "b3", 3, "--dtype", "float64")
    assert len(one) == 3 and all(np.array_equal(a, b) for a, b in zip(one, three))
    assert not np.array_equal(one[0], one[1])
    # float32: batched kernels may differ in the last bit, at most one grey level after 8-bit rounding
    one32 = run_with_batch_size(export_dir, prompts, tmp_path / "f1", 1)
    three32 = run_with_batch_size(export_dir, prompts, tmp_path / "f3", 3, "--images-per-prompt", "1")
    assert all(np.abs(a - b).max() <= 1 for a, b in zip(one32, three32))
    assert all(np.abs(a - b).max() <= 1 for a, b in zip(one, one32))
    # and the seed does matter: another base seed gives other images
    shifted = run_with_batch_size(export_dir, prompts, tmp_path / "s", 3, "--seed", "1")
    assert np.abs(shifted[0] - one32[0]).max() > 10


def test_resume_skips_listed_images_and_refuses_other_settings(export_dir, tmp_path, capsys):
    prompts = tmp_path / "p.txt"
    prompts.write_text("a red circle\na blue square\n")
    out = tmp_path / "out"
    main([str(export_dir), "--prompts", str(prompts), "--out", str(out), *FAST])
    # mark the first image: a rerun that regenerated it would overwrite the mark
    Image.new("RGB", (RESOLUTION, RESOLUTION), (0, 0, 0)).save(out / "images" / "00000.png")
    prompts.write_text("a red circle\na blue square\na green star\n")
    capsys.readouterr()
    main([str(export_dir), "--prompts", str(prompts), "--out", str(out), *FAST])
    assert "3 images (1 new)" in capsys.readouterr().out
    rows = manifest(out)
    assert sorted(r["image"] for r in rows) == ["images/00000.png", "images/00001.png", "images/00002.png"]
    assert pixels(out, rows[0]).max() == 0  # kept, not redone
    with pytest.raises(SampleError, match="guidance_scale differ"):
        main([str(export_dir), "--prompts", str(prompts), "--out", str(out), *FAST, "--guidance-scale", "2"])


def test_prompt_files(tmp_path):
    txt = tmp_path / "p.txt"
    txt.write_text("# T2I-CompBench style\na red car and a blue bench\n\n  a green apple  \n#skip\n")
    assert load_prompt_file(txt) == [{"prompt": "a red car and a blue bench"}, {"prompt": "a green apple"}]
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"prompt": "a cat", "category": "x"}\n\n"a dog"\n')
    assert load_prompt_file(jsonl) == [{"prompt": "a cat", "category": "x"}, {"prompt": "a dog"}]
    with pytest.raises(SampleError, match="entry 1 has no prompt"):
        load_prompt_file(write_json(tmp_path / "bad.json", [{"prompt": "ok"}, {"text": "no prompt key"}]))
    with pytest.raises(SampleError, match="use .txt, .json or .jsonl"):
        load_prompt_file(write_json(tmp_path / "p.csv", []))


def test_clear_errors_for_missing_inputs(export_dir, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("a red circle\n")
    with pytest.raises(SampleError, match="prompt file .*missing.txt not found"):
        main([str(export_dir), "--prompts", str(tmp_path / "missing.txt"), "--out", str(tmp_path / "o")])
    with pytest.raises(SampleError, match="not found: pass an export folder, a training checkpoint"):
        main([str(tmp_path / "no-model"), "--prompts", str(prompts), "--out", str(tmp_path / "o")])
    (tmp_path / "run" / "export").mkdir(parents=True)
    (tmp_path / "run" / "export" / "model_index.json").write_text("{}")
    with pytest.raises(SampleError, match="neither an export folder .* its export is"):
        main([str(tmp_path / "run"), "--prompts", str(prompts), "--out", str(tmp_path / "o")])


@pytest.mark.slow
def test_a_training_checkpoint_is_exported_once_then_sampled(tmp_path, capsys):
    """A checkpoint in train.py's layout (resolved config + EMA state) is exported once (into <run>/export_<step>)."""
    from diffusers.training_utils import EMAModel

    checkpoint = tmp_path / "run" / "checkpoints" / "step_0000002"
    checkpoint.mkdir(parents=True)
    config = (f"model:\n  preset: tiny\n  max_text_tokens: 12\ndata:\n  resolution: {RESOLUTION}\n"
              "objective:\n  kind: flow\n")
    (checkpoint / "config.yaml").write_text(config)
    (tmp_path / "run" / "config.yaml").write_text(config)  # train.py writes it next to checkpoints/ too
    transformer = make_tiny_transformer()
    ema = EMAModel(transformer.parameters(), model_cls=type(transformer), model_config=transformer.config)
    torch.save(ema.state_dict(), checkpoint / EMA_STATE_FILE)
    prompts = tmp_path / "p.txt"
    prompts.write_text("a red circle\n")

    assert main([str(checkpoint), "--prompts", str(prompts), "--out", str(tmp_path / "a"), "--steps", "2"]) == 0
    export = tmp_path / "run" / "export_step_0000002"
    assert (export / "model_index.json").is_file()
    assert not [p for p in export.parent.iterdir() if p.name.startswith(".tmp")]
    row = manifest(tmp_path / "a")[0]
    assert (row["resolution"], row["max_text_tokens"]) == (RESOLUTION, 12)  # from the run's config
    capsys.readouterr()
    main([str(checkpoint), "--prompts", str(prompts), "--out", str(tmp_path / "b"), "--steps", "2"])
    assert "using the existing export" in capsys.readouterr().out
    # the same weights either way: sampling the export folder directly gives the same image
    main([str(export), "--prompts", str(prompts), "--out", str(tmp_path / "c"), "--steps", "2"])
    assert np.array_equal(pixels(tmp_path / "b", row), pixels(tmp_path / "c", row))


def test_a_hub_id_is_sampled_from_the_local_hub_cache_offline(export_dir, tmp_path):
    """An export uploaded to the Hub and downloaded again sits in the Hub cache as a snapshot: the sampling
    command opens it by its id with the network off (HF_HUB_OFFLINE=1), as after `huggingface-cli download`."""
    import os
    import shutil
    import subprocess
    import sys

    revision = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--someone--tiny-imba"
    shutil.copytree(export_dir, repo / "snapshots" / revision)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    prompts = tmp_path / "p.txt"
    prompts.write_text("a red circle\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub")}
    proc = subprocess.run([sys.executable, "-m", "imba.training.sample", "someone/tiny-imba", "--prompts",
                           str(prompts), "--out", str(tmp_path / "out"), *FAST], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [r["prompt"] for r in manifest(tmp_path / "out")] == ["a red circle"]
    # the same images as sampling the folder itself
    direct = tmp_path / "direct"
    assert main([str(export_dir), "--prompts", str(prompts), "--out", str(direct), *FAST]) == 0
    via_hub = pixels(tmp_path / "out", manifest(tmp_path / "out")[0])
    assert np.array_equal(via_hub, pixels(direct, manifest(direct)[0]))
