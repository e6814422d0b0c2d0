"""The LoRA recipe of docs/checkpoints.md, run as written: its commands (read by test_docs.py's extractor) in a
fresh folder on a user's own captioned images, at a tiny size, then its loading snippet, which must find what the
commands wrote. Slow tier: it trains a base and a LoRA end to end."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import matplotlib
from PIL import Image

from test_docs import commands_in, markdown_lines, shell_snippets

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "checkpoints.md"
SECTION = "LoRA fine-tuning"
TIMEOUT_S = 600  # a hang guard for each command; it says "timed out", never a verdict on speed

# appended to each documented train.py command: a few steps of the micro DiT at 32 px, no grids but the last
TINY = ["train.max_steps=2", "train.save_every=2", "train.sample_every=0", "train.val_every=0", "train.log_every=1",
        "train.trackers=none", "data.resolution=32", "data.batch_size=2", "data.synthetic_samples=8",
        "optim.warmup_steps=1", "sample.steps=2"]

# a user's photos: words the synthetic set never uses (tiny-words would read them as unknown)
PHOTOS = {"bike.jpg": "my red bicycle by the sea", "dog.jpg": "a sleepy brown dog on the sofa",
          "cake.png": "birthday cake with seven candles", "tree.jpg": "an old oak tree in the fog",
          "boat.jpg": "a small blue boat, harbour at dusk", "mug.png": "coffee mug on a wooden desk"}


def section(path: Path, title: str) -> tuple[int, int]:
    """The line range [first, end) of the section under heading `title` (to the next heading of its level or
    higher)."""
    headings = [(number, len(m.group(1)), m.group(2).strip()) for number, text, language in markdown_lines(path)
                if language is None and (m := re.match(r"^(#{1,6})\s+(.*)$", text))]
    start = next((i for i, (_, _, text) in enumerate(headings) if text == title), None)
    assert start is not None, f"{path.name} has no heading {title!r}"
    number, level, _ = headings[start]
    end = next((n for n, lv, _ in headings[start + 1:] if lv <= level), 10 ** 9)
    return number, end


def recipe() -> tuple[list, str]:
    """(the section's commands in order, its python snippet)."""
    first, end = section(PAGE, SECTION)
    commands = [c for s in shell_snippets(PAGE) if first < s.line < end for c in commands_in(s)]
    python = [text for number, text, language in markdown_lines(PAGE) if first < number < end and language == "python"]
    assert commands and python, f"{PAGE.name}: the {SECTION} section lost its commands or its loading snippet"
    return commands, "\n".join(python) + "\n"


def write_photos(folder: Path) -> None:
    folder.mkdir()
    photo = Image.open(Path(matplotlib.get_data_path()) / "sample_data" / "grace_hopper.jpg").convert("RGB")
    for i, (name, caption) in enumerate(PHOTOS.items()):  # crops of a photograph, of a few sizes
        photo.crop((20 * i, 15 * i, 20 * i + 240 + 8 * i, 15 * i + 200)).resize((48 + 4 * i, 40)).save(folder / name)
        (folder / name).with_suffix(".txt").write_text(caption)


def run(argv: list[str], cwd: Path, what: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "2",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    try:
        done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{what}: timed out after {TIMEOUT_S} s", pytrace=False)
    assert done.returncode == 0, f"{what} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return done


def test_the_lora_recipe_runs_as_written_on_a_users_photos(tmp_path):
    commands, snippet = recipe()
    write_photos(tmp_path / "photos")
    trains = [c for c in commands if c.kind == "train"]
    assert [c.kind for c in commands] == ["train", "module", "train"] and commands[1].target == "data.prep.writers"
    lora = dict(a.split("=", 1) for a in trains[-1].args if "=" in a)
    # the points a user stumbled on: its own output folder, the encoder the base was trained with, named
    assert lora.get("train.output_dir") and lora.get("model.text_encoder") == "tiny"
    for command in commands:
        if command.kind == "train":
            argv = [sys.executable, str(REPO / "train.py"), *command.args, *TINY]
        else:
            argv = [sys.executable, "-m", command.target, *command.args]
        done = run(argv, tmp_path, f"{command.where}: {command.text}")
        if command.kind == "module":
            assert "skipped 0" in done.stdout and "train with data.shards=" in done.stdout
    assert "LoRA" in done.stdout  # the last command trained adapters, from the base the first one exported
    # photographs through the shapes VAE the base learnt: said before the first step, with a fix for a fine-tune
    assert re.search(r"^warning: model.vae=shapes reconstructs this run's first images at \d+\.\d dB PSNR .*; "
                     r"fine-tune a base trained with an SD-VAE", done.stdout, re.M), done.stdout[-2000:]

    base = tmp_path / dict(a.split("=", 1) for a in trains[0].args if "=" in a)["train.output_dir"] / "export"
    adapter = tmp_path / lora["train.output_dir"] / "export" / "lora"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(base.resolve())
    assert lora["model.pretrained"] == str(base.relative_to(tmp_path))

    # the loading snippet, as written, reads what the commands wrote
    check = ("\nfrom peft import PeftModel\n"
             "assert isinstance(pipe.transformer, PeftModel), type(pipe.transformer)\n"
             "print('drew', image.size)\n")
    done = run([sys.executable, "-c", snippet + check], tmp_path, f"{PAGE.name}: the loading snippet")
    assert "drew (128, 128)" in done.stdout
