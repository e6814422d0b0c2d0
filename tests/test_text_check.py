"""The run's text encoder must read its captions: `text_encoder=auto` and `max_text_tokens=0` resolve to what the
data needs, and a caption set the tokenizer mostly cannot read is refused in one line before any long work."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import ByT5Tokenizer

from data.sources import Source
from data.synthetic import CAPTION_WORDS, write_synthetic_shards
from imba.training.config import ConfigError, load_config
from imba.training.text_check import REFUSE_UNKNOWN, WARN_TRUNCATED, WARN_UNKNOWN, judge, sample_captions
from models.text_encoder import CaptionReading, read_captions, word_tokenizer
from tests.shard_helpers import png, write_tar

REPO = Path(__file__).resolve().parents[1]

PHOTO_CAPTIONS = [
    "a photo of a tabby cat asleep on a wooden bench",
    "two astronauts walking past a red circle",
    "an orange square",
    "a lighthouse on a rocky coast at sunset, oil painting",
]


def write_photo_shards(folder: Path, captions: list[str], per_shard: int = 2) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for start in range(0, len(captions), per_shard):
        samples = [{"__key__": f"{i:06d}", "png": png((40 * i % 256, 90, 160), size=(32, 32)),
                    "txt": captions[i].encode()} for i in range(start, min(start + per_shard, len(captions)))]
        paths.append(write_tar(folder / f"photos-{start // per_shard:06d}.tar", samples))
    return paths


# ---- read_captions: the tokenizer's own count of unknown tokens and of captions cut short ---------------------


def test_the_word_tokenizer_reads_the_synthetic_words_and_names_what_it_cannot():
    tokenizer = word_tokenizer(CAPTION_WORDS)
    reading = read_captions(tokenizer, PHOTO_CAPTIONS, max_length=16)
    # 11 + 6 + 3 + 11 words and commas; of them only a/an/red/circle/orange/square are synthetic words
    words = [caption.replace(",", " ,").split() for caption in PHOTO_CAPTIONS]
    known = sum(w in CAPTION_WORDS for caption in words for w in caption)
    assert reading.captions == 4 and reading.tokens == sum(map(len, words))
    assert reading.unknown == reading.tokens - known
    assert reading.unknown_words[0] == "on"  # the only unknown word of two captions
    assert {"tabby", "cat", "astronauts", "lighthouse", ","} <= set(reading.unknown_words)
    assert not {"a", "an", "red", "circle"} & set(reading.unknown_words)
    # the longest two: 11 tokens + </s>
    assert reading.longest == 12 and reading.truncated == 0
    assert read_captions(tokenizer, PHOTO_CAPTIONS, max_length=11).truncated == 2
    assert read_captions(tokenizer, PHOTO_CAPTIONS, max_length=12).truncated == 0


def test_the_byte_tokenizer_reads_any_text_and_counts_bytes():
    reading = read_captions(ByT5Tokenizer(), ["café", "a cat"], max_length=6)
    assert reading.unknown == 0 and reading.unknown_share == 0.0
    assert reading.tokens == len("café".encode()) + len("a cat")  # one token a byte, </s> left out
    assert reading.longest == 6 and reading.truncated == 0
    assert read_captions(ByT5Tokenizer(), ["café", "a cat"], max_length=5).truncated == 2


def test_the_synthetic_captions_are_all_known_to_the_word_tokenizer(tmp_path):
    shards = write_synthetic_shards(tmp_path / "syn", num_samples=40, resolution=32, seed=0)
    captions = sample_captions([Source("synthetic", shards)], "caption")
    assert len(captions) == 40
    assert read_captions(word_tokenizer(CAPTION_WORDS), captions, max_length=16).unknown == 0


# ---- the rule -----------------------------------------------------------------------------------------------


def reading(unknown_share: float = 0.0, truncated: int = 0, captions: int = 100) -> CaptionReading:
    tokens = 1000
    return CaptionReading(captions, tokens, round(unknown_share * tokens), ("tabby", "cat"), truncated, 40)


def test_more_than_half_unknown_is_refused_with_what_to_set():
    refusal, warnings = judge(reading(REFUSE_UNKNOWN + 0.001), "tiny-words", 16)
    assert refusal == ("model.text_encoder=tiny-words reads 501 of the 1,000 tokens of 100 captions as unknown (50%; "
                       "e.g. 'tabby', 'cat'): set model.text_encoder to a T5 (google/t5-v1_1-xxl, or a local folder) "
                       "or to tiny (a random T5 over bytes: reads any text)")
    assert warnings == []


def test_between_the_bounds_it_warns_and_at_or_under_the_lower_bound_it_is_silent():
    refusal, warnings = judge(reading(REFUSE_UNKNOWN), "tiny-words", 16)
    assert refusal is None and len(warnings) == 1 and warnings[0].startswith("warning: model.text_encoder=tiny-words "
                                                                             "reads 500 of the 1,000 tokens")
    refusal, warnings = judge(reading(WARN_UNKNOWN + 0.001), "tiny-words", 16)
    assert refusal is None and len(warnings) == 1
    assert judge(reading(WARN_UNKNOWN), "tiny-words", 16) == (None, [])


def test_many_captions_cut_short_warn_with_the_setting_to_raise():
    cut = int(WARN_TRUNCATED * 100)
    assert judge(reading(truncated=cut), "tiny", 64) == (None, [])
    refusal, warnings = judge(reading(truncated=cut + 1), "tiny", 64)
    assert refusal is None and warnings == [
        "warning: 26 of 100 captions are longer than model.max_text_tokens=64 tokens (tiny reads bytes: a token is a "
        "character, about a fifth of a word) (the longest 40): their ends never reach the model; raise "
        "model.max_text_tokens"]
    _, [t5] = judge(reading(truncated=cut + 1), "google/t5-v1_1-xxl", 120)  # word pieces: nothing to add
    assert t5.startswith("warning: 26 of 100 captions are longer than model.max_text_tokens=120 tokens (the longest")
    assert judge(reading(0.0, truncated=0, captions=0), "tiny", 64) == (None, [])


# ---- the automatic values -------------------------------------------------------------------------------------


@pytest.mark.parametrize("args, encoder, tokens", [
    ([], "tiny-words", 16),
    (["data.shards=photos/"], "tiny", 64),
    (["data.sources=[{shards: a/}, {shards: b/}]"], "tiny", 64),
    (["data.shards=photos/", "model.text_encoder=tiny-words"], "tiny-words", 16),
    (["model.text_encoder=google/t5-v1_1-xxl"], "google/t5-v1_1-xxl", 120),
    (["data.shards=photos/", "model.max_text_tokens=300"], "tiny", 300),
    (["model.text_encoder=tiny", "model.max_text_tokens=8"], "tiny", 8),
])
def test_auto_reads_real_words_on_your_own_data_and_zero_tokens_is_the_encoders_own(args, encoder, tokens):
    model = load_config(args).model
    assert (model.text_encoder, model.max_text_tokens) == (encoder, tokens)


def test_a_negative_sequence_length_is_refused():
    with pytest.raises(ConfigError, match=r"model.max_text_tokens"):
        load_config(["model.max_text_tokens=-1"])


# ---- end to end ---------------------------------------------------------------------------------------------


def train_py(*args: str, cwd: Path) -> tuple[int, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(REPO / "train.py"), *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)
    return proc.returncode, proc.stdout + proc.stderr


def test_photo_captions_under_the_word_tokenizer_stop_the_run_before_any_encoding(tmp_path):
    shards = write_photo_shards(tmp_path / "photos", PHOTO_CAPTIONS * 2)
    out = tmp_path / "run"
    status, output = train_py(f"data.shards={tmp_path / 'photos'}", "model.text_encoder=tiny-words",
                              "data.precompute=true", "data.resolution=32", f"train.output_dir={out}", cwd=tmp_path)
    assert status != 0 and "Traceback" not in output, output
    last = output.strip().splitlines()[-1]
    assert last.startswith("error: model.text_encoder=tiny-words reads ") and "of 8 captions as unknown" in last, last
    assert "set model.text_encoder to a T5" in last
    assert not (out / "features").exists()  # refused before data.precompute encodes anything
    assert not (out / "config.yaml").exists()  # a start that fails leaves no config behind
    assert len(shards) == 4


def test_the_automatic_encoder_reads_your_photos_and_a_short_sequence_warns(tmp_path, capsys):
    from accelerate import Accelerator

    from imba.training.text_check import check_captions_readable

    write_photo_shards(tmp_path / "photos", PHOTO_CAPTIONS)
    sources = [Source("photos", sorted(str(p) for p in (tmp_path / "photos").glob("*.tar")))]
    accelerator = Accelerator(cpu=True)
    check_captions_readable(load_config([f"data.shards={tmp_path / 'photos'}"]), accelerator, sources)
    assert capsys.readouterr().out == ""  # tiny reads bytes; 64 tokens hold every caption
    check_captions_readable(load_config([f"data.shards={tmp_path / 'photos'}", "model.max_text_tokens=16"]),
                            accelerator, sources)
    assert capsys.readouterr().out.strip() == (
        "warning: 4 of 4 captions are longer than model.max_text_tokens=16 tokens (tiny reads bytes: a token is a "
        "character, about a fifth of a word) (the longest 54): their ends never "
        "reach the model; raise model.max_text_tokens")
    with pytest.raises(ConfigError, match=r"^model.text_encoder=tiny-words reads \d+ of the \d+ tokens of 4 captions"):
        check_captions_readable(load_config([f"data.shards={tmp_path / 'photos'}", "model.text_encoder=tiny-words"]),
                                accelerator, sources)


def test_the_check_reads_the_runs_caption_field_and_names_a_tokenizer_it_cannot_load(tmp_path):
    import json

    from accelerate import Accelerator

    from imba.training.text_check import check_captions_readable

    folder = tmp_path / "photos"
    folder.mkdir()
    write_tar(folder / "photos-000000.tar", [
        {"__key__": f"{i:06d}", "png": png((9, 90, 160), size=(32, 32)), "json": json.dumps({"alt": c}).encode()}
        for i, c in enumerate(PHOTO_CAPTIONS)])
    sources = [Source("photos", [str(folder / "photos-000000.tar")])]
    accelerator = Accelerator(cpu=True)
    # the captions are in the json field `alt` only: the check must read that field to judge them
    with pytest.raises(ConfigError, match=r"^model.text_encoder=tiny-words reads \d+ of the \d+ tokens of 4 captions"):
        check_captions_readable(load_config([f"data.shards={folder}", "data.caption_field=alt",
                                             "model.text_encoder=tiny-words"]), accelerator, sources)
    missing = tmp_path / "no-such-encoder"
    with pytest.raises(ConfigError, match="cannot load the tokenizer of .*no-such-encoder"):
        check_captions_readable(load_config([f"data.shards={folder}", "data.caption_field=alt",
                                             f"model.text_encoder={missing}"]), accelerator, sources)


# ---- a fine-tune reads text as the model it starts from did -----------------------------------------------


def export_with(folder, text_encoder: str):
    """A pipeline folder as train.py exports it, trained with `text_encoder`'s tokenizer."""
    from data.synthetic import CAPTION_WORDS
    from models.dit import build_transformer
    from models.pipeline import build_pipeline, export_pipeline
    from models.text_encoder import load_text_encoder
    from models.vae import load_vae
    from imba.objectives import build_objective

    tokenizer, t5 = load_text_encoder(text_encoder, words=CAPTION_WORDS)
    transformer = build_transformer("micro", sample_size=4, caption_channels=64)
    export_pipeline(build_pipeline(transformer, load_vae("tiny"), t5, tokenizer,
                                   build_objective("flow").sampling_scheduler()), folder)
    return folder


@pytest.fixture(scope="module")
def byte_export(tmp_path_factory):
    """A pipeline folder as train.py exports it, trained with the byte-level `tiny` tokenizer."""
    return export_with(tmp_path_factory.mktemp("export"), "tiny")


def test_a_fine_tune_names_its_start_and_checks_the_tokenizer(byte_export):
    from imba.training.build import fine_tune_source

    for pretrained in (byte_export, byte_export / "transformer"):
        cfg = load_config([f"model.pretrained={pretrained}", "model.text_encoder=tiny"])
        assert fine_tune_source(cfg) == (f"fine-tuning from {pretrained}: its transformer's weights; its tokenizer is "
                                         "model.text_encoder=tiny's")
    # the same width (64) under the word-level tokenizer: every id would mean another token
    cfg = load_config([f"model.pretrained={byte_export}", "model.text_encoder=tiny-words"])
    with pytest.raises(ConfigError, match=rf"^model.pretrained={byte_export} was trained with model.text_encoder=tiny, "
                                          r"not model.text_encoder=tiny-words \(\d+ tokens, not 22\): the DiT would "
                                          r"read text it never learned; set model.text_encoder=tiny$"):
        fine_tune_source(cfg)


def test_a_fine_tune_refused_for_its_tokenizer_names_the_encoder_its_base_was_trained_with(tmp_path):
    from imba.training.build import fine_tune_source

    # the quick start's export (tiny-words) under a run on your own captions (tiny): named, with the way out
    words = export_with(tmp_path / "words", "tiny-words")
    cfg = load_config([f"model.pretrained={words}", "model.text_encoder=tiny"])
    with pytest.raises(ConfigError) as refused:
        fine_tune_source(cfg)
    assert str(refused.value).startswith(f"model.pretrained={words} was trained with model.text_encoder=tiny-words, "
                                         "not model.text_encoder=tiny (22 tokens, not ")
    assert str(refused.value).endswith("set model.text_encoder=tiny-words (tiny-words reads only the synthetic "
                                       "shapes' words: to fine-tune on your own captions, start from a base trained "
                                       "with model.text_encoder=tiny, docs/checkpoints.md#lora-fine-tuning)")
    # a tokenizer of neither tiny encoder: the pipeline's own encoder and tokenizer folders are what to set
    from transformers import PreTrainedTokenizerFast

    from models.text_encoder import word_tokenizer

    other = export_with(tmp_path / "other", "tiny-words")
    word_tokenizer(["one", "two"]).save_pretrained(other / "tokenizer")
    assert isinstance(PreTrainedTokenizerFast.from_pretrained(other / "tokenizer"), PreTrainedTokenizerFast)
    with pytest.raises(ConfigError, match=rf"was trained with model.text_encoder={other} "
                                          r"model.text_encoder_subfolder=text_encoder "
                                          r"model.tokenizer_subfolder=tokenizer, not model.text_encoder=tiny-words"):
        fine_tune_source(load_config([f"model.pretrained={other}", "model.text_encoder=tiny-words"]))


def test_a_transformer_alone_is_named_and_not_checked():
    from imba.training.build import fine_tune_source

    nano = REPO / "tests" / "golden" / "nano_dit"
    assert fine_tune_source(load_config([f"model.pretrained={nano}"])) == (
        f"fine-tuning from {nano}: its transformer's weights (no tokenizer beside them to check "
        "model.text_encoder=tiny-words against)")


def test_the_first_captions_of_each_source_are_read_from_its_caption_field(tmp_path):
    import json

    def shard(name, captions):
        return write_tar(tmp_path / f"{name}.tar", [
            {"__key__": f"{i:04d}", "json": json.dumps({"alt_text": c}).encode()} for i, c in enumerate(captions)])

    a = [shard("a0", ["a red circle", "a cyan ring"]), shard("a1", ["a blue square"])]
    b = [shard("b0", ["a green star", "a black cross", "a red ring"])]
    assert sample_captions([Source("a", a), b], "alt_text", per_source=2) == [
        "a red circle", "a cyan ring", "a green star", "a black cross"]
    assert sample_captions([a], "alt_text") == ["a red circle", "a cyan ring", "a blue square"]
    assert sample_captions([a], "caption") == []  # no caption under that field
