"""The sample grids show the run's prompts: by default some of the data's own captions (the validation shards'
first), each written under its image."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageFont

from data.sources import Source
from data.synthetic import write_synthetic_shards
from imba.training.config import SYNTHETIC_PROMPTS, load_config
from imba.training.sampling import GRID_PROMPTS, prompts_from_data
from models.pipeline import LABEL_LINES, image_grid, wrap_label
from tests.shard_helpers import png, write_tar
from tests.test_text_check import write_photo_shards


def tiles(n: int, size: int = 64) -> list[Image.Image]:
    return [Image.new("RGB", (size, size), (20 * i, 200, 30)) for i in range(n)]


def test_a_grid_without_labels_is_its_tiles_edge_to_edge():
    grid = image_grid(tiles(5), columns=3)
    assert grid.size == (3 * 64, 2 * 64)
    assert np.array_equal(np.asarray(grid)[64:128, 64:128], np.asarray(tiles(5)[4]))
    assert np.asarray(grid)[64:, 128:].min() == 255  # the missing sixth tile is white


def test_a_label_wraps_greedily_within_its_width_and_ends_in_an_ellipsis_past_three_lines():
    font = ImageFont.load_default()
    words = "a photo of a tabby cat asleep on a wooden bench".split()
    lines = wrap_label(" ".join(words), font, 80)
    assert " ".join(lines).split() == words and len(lines) <= LABEL_LINES  # every word, in order
    assert len(lines) == 3 and all(font.getlength(line) <= 80 for line in lines)
    # greedy: each line's next word would not have fitted on it
    assert all(font.getlength(f"{line} {nxt.split()[0]}") > 80 for line, nxt in zip(lines, lines[1:]))
    assert wrap_label("a red circle", font, 1000) == ["a red circle"]
    assert wrap_label("a red circle", font, font.getlength("a red circle")) == ["a red circle"]  # exactly fits
    long = wrap_label(" ".join(["word"] * 40), font, 60)
    assert len(long) == LABEL_LINES and long[-1].endswith(" …") and long[0] == long[1] != long[-1]
    assert long[-1] == long[0] + " …"
    assert wrap_label("one two three", font, 1) == ["one", "two", "three"]  # a word wider than the tile stands alone


def test_a_grid_is_square_by_default():
    grid = image_grid(tiles(9, size=16))
    assert grid.size == (48, 48)
    assert image_grid(tiles(10, size=16)).size == (4 * 16, 3 * 16)


def test_each_label_is_written_under_its_own_tile_within_its_width():
    labels = ["a red circle", "x", "a photo of a tabby cat asleep on a wooden bench in the afternoon sun " * 3]
    grid = np.asarray(image_grid(tiles(3), columns=3, labels=labels))
    assert grid.shape[0] > 64  # room for the labels
    for i in range(3):
        tile = grid[:64, 64 * i:64 * (i + 1)]
        assert np.array_equal(tile, np.asarray(tiles(3)[i]))  # labels never cover a picture
        under = grid[64:, 64 * i:64 * (i + 1)]
        assert (under < 128).any()  # dark text under each tile
    font = ImageFont.load_default()
    line = font.getbbox("Ag")[3] + 2
    # the long label is cut to LABEL_LINES lines, the short ones take one
    inked_rows = [np.flatnonzero((grid[64:, 64 * i:64 * (i + 1)] < 128).any(axis=(1, 2))) for i in range(3)]
    assert inked_rows[2].max() > (LABEL_LINES - 1) * line and inked_rows[2].max() < LABEL_LINES * line + 4
    assert inked_rows[0].max() < line + 2
    assert grid.shape == (64 + LABEL_LINES * line + 4, 3 * 64, 3)
    # a second row starts below the first row's labels
    two_rows = np.asarray(image_grid(tiles(4), columns=3, labels=[*labels, "a fourth"]))
    top = 64 + LABEL_LINES * line + 4
    assert two_rows.shape[0] == 2 * top
    assert np.array_equal(two_rows[top:top + 64, :64], np.asarray(tiles(4)[3]))


def test_the_synthetic_set_samples_its_own_prompts_and_your_data_its_captions(tmp_path):
    assert load_config([]).sample.prompts == SYNTHETIC_PROMPTS
    assert load_config(["data.shards=x/"]).sample.prompts == []  # chosen from the captions when the run starts
    assert load_config(["data.shards=x/", "sample.prompts=[a cat]"]).sample.prompts == ["a cat"]

    captions = [f"photo number {i} of a cat" for i in range(40)]
    shards = write_photo_shards(tmp_path / "train", captions, per_shard=8)
    cfg = load_config([f"data.shards={tmp_path / 'train'}"])
    prompts, where = prompts_from_data(cfg, [Source("train", shards)])
    # nine distinct captions spread over the ones read, the first and the last of them included
    assert len(prompts) == GRID_PROMPTS == len(set(prompts)) and where == "9 captions of the training shards"
    assert prompts[0] == captions[0] and prompts[-1] == captions[-1] and prompts == sorted(prompts, key=captions.index)

    # the validation shards come first; duplicates and blank captions count once / not at all
    val = write_photo_shards(tmp_path / "val", ["a dog", "a dog", "  ", "a bird"], per_shard=2)
    cfg = load_config([f"data.shards={tmp_path / 'train'}", f"data.val_shards={tmp_path / 'val'}"])
    assert prompts_from_data(cfg, [Source("train", shards)]) == (["a dog", "a bird"], "2 captions of data.val_shards")


def test_a_single_caption_and_captions_in_another_json_field_are_found(tmp_path):
    import json

    (tmp_path / "one").mkdir()
    path = write_tar(tmp_path / "one" / "one-000000.tar", [
        {"__key__": f"{i:06d}", "png": png((1, 2, 3)), "json": json.dumps({"text": "a lone heron"}).encode()}
        for i in range(3)])
    cfg = load_config([f"data.shards={tmp_path / 'one'}", "data.caption_field=text"])
    assert prompts_from_data(cfg, [Source("one", [path])]) == (["a lone heron"], "1 caption of the training shards")


def test_shards_without_captions_fall_back_to_the_synthetic_prompts_and_say_so(tmp_path):
    (tmp_path / "bare").mkdir()
    path = write_tar(tmp_path / "bare" / "bare-000000.tar", [{"__key__": "000000", "png": png((1, 2, 3))}])
    cfg = load_config([f"data.shards={tmp_path / 'bare'}"])
    prompts, where = prompts_from_data(cfg, [Source("bare", [str(path)])])
    assert prompts == SYNTHETIC_PROMPTS and "set sample.prompts" in where


def test_sample_prompts_the_encoder_cuts_are_one_line_of_ours_not_diffusers_cut_text(tmp_path, capfd):
    from imba.training.sampling import GridSampler

    long = " ".join(["a portrait of an officer in a navy uniform"] * 3)  # 128 bytes: over tiny's 64 tokens
    cfg = load_config(["model.text_encoder=tiny", f"sample.prompts=[{long}, a red circle]",
                       f"train.output_dir={tmp_path}"])
    said = []  # diffusers' own records (its library logger does not propagate to pytest's capture)
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("diffusers").addHandler(handler)
    try:
        sampler = GridSampler(cfg, cfg.objective.build(), torch.device("cpu"), True, encoders=None)
    finally:
        logging.getLogger("diffusers").removeHandler(handler)
    assert sampler.embeddings["prompt_embeds"].shape[:2] == (2, 64)
    assert not [m for m in said if "truncated" in m]  # diffusers prints the cut text (for bytes, padding tokens)
    printed = capfd.readouterr()
    assert printed.out.strip() == ("sample.prompts: 1 of 2 prompts are longer than model.max_text_tokens=64 tokens "
                                   "(tiny reads bytes: a token is a character, about a fifth of a word): the grids "
                                   "show them cut there")
