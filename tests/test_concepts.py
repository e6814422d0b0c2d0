"""Concept statistics (data/concepts/, and their command line and benchmark builder in data/prep/): extraction,
counts from shards and caption files, buckets, NPMI, outputs, the inert-concept benchmark builder and the synthetic
set's long tail."""

from __future__ import annotations

import csv
import io
import itertools
import json
import logging
import math
import os
import subprocess
import sys
import tarfile
import types
from collections import Counter
from pathlib import Path

import pytest
from PIL import Image

from data import concepts as C
from data.balance import NoBalance, TemperatureBalance, build_concept_table, entry_counts
from data.draw_plan import entry_table, index_captions, load_entry_table, plan_fingerprint
from data.index import load_or_build_index, parse_sample
from data.prep import concepts as cli
from data.prep.benchmark import TEMPLATES, build_benchmark
from data.sources import ShardsSource, SourceMix, resolve_sources
from data.synthetic import COLOURS, SHAPES, write_synthetic_shards
from shard_helpers import png, write_tar

REPO = Path(__file__).resolve().parents[1]

# (caption, where it lives in the shards) -> expected concepts, each once
CAPTIONS = [
    ("Two cats and a cat sleeping on boxes.", "txt"),
    ("A teddy bear next to a black bear", "json"),
    ("Fresh berries and leaves on a plate", "both"),
    ("Mice running around the children's toys.", "txt"),
    ("A fire hydrant near the traffic lights; a dog.", "json"),
    ("A cat and a DOG", "txt"),
    ("A hot dog on a plate", "json"),
    ("An abstract composition", "txt"),  # names no concept
]
EXPECTED = Counter({
    "cat": 2, "box": 1, "teddy bear": 1, "black": 1, "bear": 1, "berry": 1, "leaf": 1, "plate": 2, "mouse": 1,
    "child": 1, "toy": 1, "fire hydrant": 1, "traffic light": 1, "dog": 2, "hot dog": 1,
})


def _png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (4, 4), (200, 10, 10)).save(buf, format="PNG")
    return buf.getvalue()


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def _write_shards(folder: Path, suffix: str = ".tar", mode: str = "w") -> list[Path]:
    """Two img2dataset-layout shards holding CAPTIONS, plus a sample with an empty caption and one with none."""
    folder.mkdir(parents=True, exist_ok=True)
    png = _png()
    paths = [folder / f"part-{i:06d}{suffix}" for i in range(2)]
    halves = [CAPTIONS[:4], CAPTIONS[4:]]
    for shard, (path, rows) in enumerate(zip(paths, halves)):
        with tarfile.open(path, mode) as tar:
            for i, (caption, where) in enumerate(rows):
                key = f"{shard:04d}{i:05d}"
                _add(tar, f"{key}.jpg", png)
                if where in ("txt", "both"):
                    _add(tar, f"{key}.txt", caption.encode())
                meta = {"key": key, "caption": caption if where in ("json", "both") else None, "width": 4}
                _add(tar, f"{key}.json", json.dumps(meta).encode())
            _add(tar, f"{shard:04d}90000.jpg", png)  # image without any caption
            _add(tar, f"{shard:04d}90001.txt", b"   ")  # empty caption
    return paths


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("shards")
    _write_shards(folder)
    return folder


# ----------------------------------------------------------------------------------------------------------------
# extraction
# ----------------------------------------------------------------------------------------------------------------


def test_singularize_rules_and_vocabulary_folding():
    plurals = {"cats": "cat", "boxes": "box", "berries": "berry", "leaves": "leaf", "mice": "mouse",
               "children": "child", "knives": "knife", "wolves": "wolf", "potatoes": "potato", "shoes": "shoe",
               "horses": "horse", "dresses": "dress", "people": "person", "firemen": "fireman", "bus": "bus",
               "glass": "glass", "sheep": "sheep", "jeans": "jeans", "buses": "bus", "cacti": "cactus"}
    for plural, singular in plurals.items():
        assert C.singularize(plural) == singular, plural
    known = C.default_extractor().vocabulary.words
    for plural, singular in {"cats": "cat", "olives": "olive", "gloves": "glove", "knives": "knife",
                             "octopuses": "octopus", "ponies": "pony", "leaves": "leaf"}.items():
        assert C.singularize(plural, known) == singular, plural
    assert C.singularize("glasses", known) == "glasses"  # a concept of its own (eyewear)
    assert C.singularize("zorbs", known) == "zorbs"  # unknown words stay as they are
    assert C.tokenize("The dog's T-shirt, ok?") == ["the", "dog", "t", "shirt", "ok"]


def test_extractor_multiword_longest_first_and_once_per_caption():
    ex = C.default_extractor()
    assert ex("A teddy bear and a hot dog") == ["teddy bear", "hot dog"]  # no bear, no dog
    assert ex("Cats, CATS and a cat!") == ["cat"]
    assert ex("two hot air balloons over a fire hydrant") == ["hot air balloon", "fire hydrant"]
    assert ex("Kids wearing t-shirts near wine glasses") == ["child", "t-shirt", "wine glass"]  # aliases
    assert ex("a red circle and an orange square") == ["red", "circle", "orange", "square"]
    assert ex("") == [] and ex("!!!") == []


def test_a_repeated_concept_binds_at_every_mention_and_counts_once_per_caption():
    ex = C.default_extractor()
    assert ex.mentions("a red circle and a red square") == ["red", "circle", "red", "square"]
    assert ex("a red circle and a red square") == ["red", "circle", "square"]  # concepts: each once
    table = build_concept_table(["a red circle and a red square", "a red circle and a blue circle"], ex)
    assert sorted(table.sample_entries(0)) == sorted(
        ["red", "circle", "square", "red:circle", "red:square", "circle + square"])
    assert sorted(table.sample_entries(1)) == sorted(["red", "circle", "blue", "red:circle", "blue:circle"])
    counts = dict(zip(table.entries, entry_counts(table)))
    # samples with the entry: "red" is mentioned three times in two captions
    assert counts == {"red": 2, "circle": 2, "square": 1, "blue": 1, "red:circle": 2, "red:square": 1,
                      "blue:circle": 1, "circle + square": 1}
    stats = C.count_concepts(["a red circle and a red square", "a red circle and a blue circle"])
    assert stats.counts == Counter({"red": 2, "circle": 2, "square": 1, "blue": 1})


class FirstMentionExtractor(C.VocabExtractor):
    """Bindings read from the concepts without repeats: "a red circle and a red square" binds only red:circle."""

    rule = "first-mention"

    def mentions(self, caption: str) -> list[str]:
        return list(dict.fromkeys(super().mentions(caption)))


def test_the_binding_rule_is_part_of_the_plan_fingerprint_and_the_entry_table_key(tmp_path, monkeypatch):
    captions = ["a red circle and a red square", "a red circle and a blue circle"]
    shard = write_tar(tmp_path / "part-000000.tar", [
        {"__key__": f"{i:04d}", "png": png((i, 0, 0)), "txt": c.encode()} for i, c in enumerate(captions)])
    index = load_or_build_index(shard, index_dir=tmp_path)
    mix = SourceMix(resolve_sources([ShardsSource(shards=shard)]), index.nsamples, 0)
    old, new = FirstMentionExtractor(), C.VocabExtractor()
    assert "red:square" not in build_concept_table(captions, old).sample_entries(0)  # the rules differ
    for balance in (NoBalance(), TemperatureBalance(0.5)):
        assert plan_fingerprint(index, mix, balance, new) == plan_fingerprint(index, mix, balance, C.VocabExtractor())
        assert plan_fingerprint(index, mix, balance, old) != plan_fingerprint(index, mix, balance, new)

    # data.balance=imba keys its entry table by the natural plan's fingerprint, made with the default extractor
    natural = NoBalance()
    fresh = plan_fingerprint(index, mix, natural)
    with monkeypatch.context() as m:
        m.setattr(C.VocabExtractor, "rule", FirstMentionExtractor.rule)
        stale = plan_fingerprint(index, mix, natural)
    assert stale != fresh
    entry_table(index, tmp_path / "data", stale, old)
    assert load_entry_table(tmp_path / "data", stale) is not None
    assert load_entry_table(tmp_path / "data", fresh) is None  # the table of the old rule is not reused
    assert "red:square" in entry_table(index, tmp_path / "data", fresh).sample_entries(0)


def test_bundled_vocabulary_is_clean_and_covers_the_synthetic_set(caplog):
    with caplog.at_level(logging.WARNING, logger="data.concepts"):
        vocab = C.load_vocabulary()
    assert not caplog.records, [r.getMessage() for r in caplog.records]  # no duplicate or clashing entries
    assert 300 <= len(vocab) <= 2000
    assert all(vocab.kinds[s] == "object" for s in SHAPES)
    assert all(vocab.kinds[c] == "attribute" for c in COLOURS)


def test_custom_vocabulary_file(tmp_path):
    path = tmp_path / "vocab.txt"
    path.write_text("# mine\nzorb: zorblet\nred panda\n[attribute]\nmauve\n")
    ex = C.VocabExtractor(path)
    assert ex("Two zorblets, a red panda and a mauve zorb") == ["zorb", "red panda", "mauve"]
    assert ex.kind("mauve") == "attribute" and ex.kind("zorb") == "object"
    with pytest.raises(FileNotFoundError, match="not found"):
        C.VocabExtractor(tmp_path / "missing.txt")


def test_spacy_extractor_degrades_with_one_line_message(monkeypatch):
    monkeypatch.setitem(sys.modules, "spacy", None)  # as if not installed (import raises ImportError)
    with pytest.raises(C.ExtractorUnavailable, match="pip install spacy") as info:
        C.make_extractor("spacy")
    assert "\n" not in str(info.value)


def test_spacy_extractor_uses_lemmatised_chunk_heads_with_compounds(monkeypatch):
    def tok(lemma, pos="NOUN", dep="", i=0, children=()):
        return types.SimpleNamespace(lemma_=lemma, pos_=pos, dep_=dep, i=i, children=list(children))

    teddy = tok("teddy", dep="compound", i=1)
    docs = {"a teddy bear and two cats in the picture": [
        tok("bear", i=2, children=[teddy]), tok("cat", i=6), tok("picture", i=9), tok("it", pos="PRON", i=10)]}

    class FakeNlp:
        def __call__(self, text):
            return types.SimpleNamespace(noun_chunks=[types.SimpleNamespace(root=r) for r in docs[text]])

        def pipe(self, texts, batch_size=1):
            return [self(t) for t in texts]

    monkeypatch.setitem(sys.modules, "spacy", types.SimpleNamespace(load=lambda model, disable=(): FakeNlp()))
    ex = C.make_extractor("spacy")
    text = "a teddy bear and two cats in the picture"
    assert ex(text) == ["teddy bear", "cat"] and ex.batch([text]) == [["teddy bear", "cat"]]


# ----------------------------------------------------------------------------------------------------------------
# counting from shards and caption files
# ----------------------------------------------------------------------------------------------------------------


def test_counts_from_tar_shards(shard_dir):
    stats = C.collect_stats(str(shard_dir))
    assert stats.counts == EXPECTED
    assert stats.num_captions == len(CAPTIONS) and stats.num_with_concepts == len(CAPTIONS) - 1
    assert stats.skipped == Counter({"no caption": 4})  # per shard: the image-only and the empty-caption sample
    assert stats.pair_counts[("cat", "dog")] == 1 and stats.pair_counts[("hot dog", "plate")] == 1
    brace = C.collect_stats(str(shard_dir / "part-{000000..000001}.tar"), workers=2)
    assert brace.counts == EXPECTED and brace.pair_counts == stats.pair_counts


def test_compressed_shards_and_caption_files_give_the_same_counts(tmp_path):
    _write_shards(tmp_path / "gz", suffix=".tar.gz", mode="w:gz")  # read through tarfile, not the fast reader
    assert C.collect_stats(sorted(str(p) for p in (tmp_path / "gz").iterdir())).counts == EXPECTED
    texts = [c for c, _ in CAPTIONS]
    (tmp_path / "caps.txt").write_text("\n".join(texts) + "\n\n")
    (tmp_path / "caps.jsonl").write_text("\n".join(json.dumps({"caption": t}) for t in texts) + "\n{bad\n")
    (tmp_path / "caps.json").write_text(json.dumps([{"prompt": t} for t in texts]))
    for name in ("caps.txt", "caps.jsonl", "caps.json"):
        stats = C.collect_stats(captions=str(tmp_path / name))
        assert stats.counts == EXPECTED and stats.num_captions == len(texts), name
    assert C.collect_stats(captions=str(tmp_path / "caps.jsonl")).skipped == Counter({"bad caption": 1})


def test_truncated_shard_is_counted_not_fatal(shard_dir, tmp_path):
    data = (shard_dir / "part-000000.tar").read_bytes()
    bad = tmp_path / "bad.tar"
    bad.write_bytes(data[: 512 * 9 + 100])  # cut inside the second sample's json
    skipped: Counter = Counter()
    captions = list(C.iter_shard_captions(str(bad), skipped=skipped))
    assert captions == [CAPTIONS[0][0]] and skipped["unreadable shard"] == 1


def test_streamed_shards_read_like_local_ones(shard_dir):
    url = f"pipe:cat {shard_dir / 'part-000000.tar'}"  # remote specs are streamed (webdataset gopen + tarfile)
    assert list(C.iter_shard_captions(url)) == list(C.iter_shard_captions(str(shard_dir / "part-000000.tar")))


# ----------------------------------------------------------------------------------------------------------------
# captions line up with the samples, whatever is wrong with one
# ----------------------------------------------------------------------------------------------------------------

# sample i's caption names NOUNS[i]: no two samples share a concept, so a caption read for the wrong sample shows
NOUNS = ["cat", "dog", "horse", "boat", "chair", "clock", "kite", "zebra", "bird", "cup", "lamp", "tree", "car",
         "bench", "bus"]


def _aligned_shards(folder: Path) -> tuple[list[str], list[tuple[str, str, list[str]]]]:
    """Two shards: the first with each kind of bad sample between good ones, the second good only. Returns the shard
    paths and, per sample in shard order, (key, the caption it must give, its concepts); every caption names its
    sample's index."""
    folder.mkdir(parents=True, exist_ok=True)
    rows: list[tuple[str, str, list[str]]] = []
    image = png((1, 2, 3))

    def sample(members: dict, caption: str = "", concepts: tuple[str, ...] = ()) -> dict:
        key = f"s{len(rows):03d}"
        rows.append((key, caption, list(concepts)))
        return {"__key__": key, **members}

    def good(image_member: str = "png", image_bytes: bytes = image) -> dict:
        noun = NOUNS[len(rows)]
        caption = f"sample {len(rows)}: a {noun}"
        return sample({image_member: image_bytes, "txt": caption.encode()}, caption, (noun,))

    bad = [
        lambda: sample({"png": image, "json": b'{"caption": "sample 1: a dog", '}),  # json that does not parse
        lambda: sample({"png": image, "json": json.dumps({"width": 20, "height": 12}).encode()}),  # no caption field
        lambda: sample({"png": image}),  # no txt, no json
        lambda: good("jpg", b"\xff\xd8 not a jpeg"),  # undecodable image: the loader skips it, its caption counts
        lambda: sample({"png": image, "txt": b"  \n "}),  # empty caption
        lambda: sample({"png": image, "txt": "caf\u00e9 cr\u00e8me".encode("latin-1")}),  # not UTF-8
    ]
    first = [good()]
    for make in bad:
        first += [make(), good()]
    second = [good(), good()]
    shards = [write_tar(folder / "part-000000.tar", first), write_tar(folder / "part-000001.tar", second)]
    return shards, rows


def test_shard_captions_line_up_with_the_samples_whatever_is_wrong_with_one(tmp_path):
    shards, rows = _aligned_shards(tmp_path)
    skipped: Counter = Counter()
    got = [c for url in shards for c in C.iter_shard_captions(url, "caption", skipped, keep_missing=True)]
    assert got == [caption for _, caption, _ in rows]
    assert got[1] == "" and got[2] == "sample 2: a horse"  # the sample after the unparsable json keeps its own
    # unparsable json and non-UTF-8 text; a json without the field, no caption member, an empty caption
    assert skipped == Counter({"bad caption": 2, "no caption": 3})
    assert [c for url in shards for c in C.iter_shard_captions(url)] == [c for _, c, _ in rows if c]


def test_the_draw_plan_reads_each_sample_its_own_caption_and_concepts(tmp_path, caplog):
    shards, rows = _aligned_shards(tmp_path / "shards")
    index = load_or_build_index(shards, index_dir=tmp_path / "index")
    assert len(index) == len(rows)
    by_key = {key: (caption, concepts) for key, caption, concepts in rows}
    keys = []
    for i in range(len(index)):  # the key of sample i as the index (and so the loader) reads it
        shard, start, end = index.locate(i)
        with open(index.urls[shard], "rb") as f:
            f.seek(start)
            keys.append(parse_sample(f.read(end - start))["__key__"])
    assert keys == [key for key, _, _ in rows]
    with caplog.at_level(logging.WARNING, logger="data.draw_plan"):
        captions = list(index_captions(index))
        table = entry_table(index, tmp_path / "data", "fingerprint", C.default_extractor())
    assert captions == [by_key[k][0] for k in keys]
    assert [table.sample_entries(i) for i in range(len(table))] == [by_key[k][1] for k in keys]
    assert not caplog.records, [r.getMessage() for r in caplog.records]  # no shard padded or cut to its count


# ----------------------------------------------------------------------------------------------------------------
# buckets
# ----------------------------------------------------------------------------------------------------------------


def test_assign_buckets_by_cumulative_share():
    # total 100: a (before 0) and b (before 40 %) are head, the concept crossing 50 % included; c (before 70 %)
    # torso; d (before 85 %) and the rest tail
    counts = {"a": 40, "b": 30, "c": 15, "d": 8, "e": 4, "f": 2, "g": 1}
    assert C.assign_buckets(counts) == {"a": "head", "b": "head", "c": "torso", "d": "tail", "e": "tail",
                                        "f": "tail", "g": "tail"}
    # the first 50 % exactly: b starts at 50 %, so it is torso; ties share a bucket
    tied = {"a": 50, "b": 20, "c": 10, "d": 10, "e": 5, "f": 3, "g": 2}
    assert C.assign_buckets(tied) == {"a": "head", "b": "torso", "c": "torso", "d": "torso", "e": "tail",
                                      "f": "tail", "g": "tail"}
    assert C.assign_buckets(counts, head_share=0.7, torso_share=0.2) == {
        "a": "head", "b": "head", "c": "torso", "d": "torso", "e": "tail", "f": "tail", "g": "tail"}
    assert C.assign_buckets({"x": 150, "y": 100, "z": 11, "w": 3}, method="count") == {
        "x": "head", "y": "torso", "z": "torso", "w": "tail"}
    assert C.assign_buckets(counts, thresholds={"head_min_count": 30, "torso_min_count": 15}) == \
        C.assign_buckets(counts)
    summary = C.bucket_summary(counts, C.assign_buckets(counts))
    assert summary["head"] == {"num_concepts": 2, "min_count": 30, "max_count": 40, "first_rank": 1,
                               "last_rank": 2, "occurrence_share": 0.7}
    with pytest.raises(ValueError):
        C.assign_buckets(counts, head_share=0.8, torso_share=0.3)


def test_caption_buckets_rarest_first():
    buckets = {"cat": "head", "dog": "head", "teddy bear": "torso", "fire hydrant": "tail"}
    assert C.caption_buckets("a cat and a teddy bear", buckets) == ("torso", "head")
    assert C.caption_bucket("a cat and a teddy bear", buckets) == "torso"
    assert C.caption_buckets("dogs near a fire hydrant", buckets) == ("tail", "head")
    assert C.caption_buckets("a zebra and a cat", buckets) == ("tail", "head")  # unseen concepts are tail
    assert C.caption_buckets("a zebra and a cat", buckets, unseen=None) == ("head",)
    assert C.caption_bucket("an abstract composition", buckets) is None


# ----------------------------------------------------------------------------------------------------------------
# co-occurrence
# ----------------------------------------------------------------------------------------------------------------


def test_npmi_hand_computed():
    assert C.npmi(2, 2, 1, 4) == pytest.approx(0.0, abs=1e-12)  # p(a)=p(b)=1/2, p(ab)=1/4: independent
    assert C.npmi(2, 2, 0, 4) == -1.0  # never together
    assert C.npmi(2, 2, 2, 4) == pytest.approx(1.0)  # only together
    assert C.npmi(4, 5, 3, 10) == pytest.approx(math.log(0.3 / (0.4 * 0.5)) / -math.log(0.3))  # ≈ 0.3368
    assert C.npmi(3, 3, 3, 3) == 1.0  # p(ab) = 1


def test_cooccurrence_table_from_captions():
    stats = C.count_concepts(["a cat and a dog", "a cat", "a dog", "a tree", "a tree and a tree"])
    rows = {(r["a"], r["b"]): r for r in C.cooccurrence_table(stats, top_k=3)}
    assert rows[("cat", "dog")]["count_ab"] == 1
    assert rows[("cat", "dog")]["npmi"] == pytest.approx(math.log(0.2 / 0.16) / -math.log(0.2))
    assert rows[("cat", "tree")]["npmi"] == -1.0 and rows[("dog", "tree")]["count_ab"] == 0
    ordered = [r["npmi"] for r in C.cooccurrence_table(stats, top_k=3)]
    assert ordered == sorted(ordered, reverse=True)
    independent = C.count_concepts(["cat dog", "cat", "dog", ""])
    assert C.cooccurrence_table(independent)[0]["npmi"] == pytest.approx(0.0, abs=1e-12)


# ----------------------------------------------------------------------------------------------------------------
# outputs, CLI and benchmark
# ----------------------------------------------------------------------------------------------------------------


def test_cli_writes_tables_plot_and_reports(shard_dir, tmp_path, capsys):
    out = tmp_path / "stats"
    assert cli.main(["--shards", str(shard_dir), "--out", str(out), "--no-progress", "--min-pair-count", "1"]) == 0
    printed = capsys.readouterr().out
    assert "read 8 captions" in printed and "spurious" in printed
    with open(out / "concepts.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["concept", "count", "fraction", "rank", "bucket"]
    assert {r["concept"]: int(r["count"]) for r in rows} == EXPECTED
    assert [int(r["rank"]) for r in rows] == list(range(1, len(EXPECTED) + 1))
    assert rows[0]["concept"] == "cat" and float(rows[0]["fraction"]) == pytest.approx(2 / 8)
    stats = C.load_stats(out)
    assert stats["num_captions"] == 8 and stats["num_occurrences"] == sum(EXPECTED.values())
    assert stats["skipped"] == {"no caption": 4}
    buckets = C.load_buckets(out / "concepts.json")
    assert buckets == C.assign_buckets(dict(EXPECTED))
    assert C.assign_buckets(dict(EXPECTED), thresholds=stats["thresholds"]) == buckets
    with open(out / "cooccurrence.csv", newline="") as f:
        pairs = list(csv.DictReader(f))
    assert list(pairs[0]) == ["a", "b", "count_a", "count_b", "count_ab", "npmi"]
    assert len(pairs) == len(EXPECTED) * (len(EXPECTED) - 1) // 2
    with Image.open(out / "long_tail.png") as img:
        assert img.format == "PNG" and img.size == C.PLOT_SIZE


def test_cli_one_line_errors(tmp_path, capsys):
    assert cli.main(["--shards", str(tmp_path / "nothing-{000000..000003}.tar"), "--out", str(tmp_path / "o")]) == 2
    assert cli.main(["--captions", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "o")]) == 2
    assert cli.main(["--out", str(tmp_path / "o")]) == 2
    assert cli.main(["build-benchmark", "--stats", str(tmp_path / "none.json"), "--out", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 4 and all(line.startswith("error: ") for line in err)


def _zipf_stats(tmp_path: Path) -> Path:
    names = [n for n in C.default_extractor().vocabulary.names if C.default_extractor().kind(n) == "object"][:200]
    captions = [f"a {name}" for k, name in enumerate(names) for _ in range(max(1, 2000 // (k + 1)))]
    C.write_stats(C.count_concepts(captions), tmp_path / "zipf")
    return tmp_path / "zipf" / "concepts.json"


def test_benchmark_builder_is_deterministic_and_names_its_concepts(tmp_path, capsys):
    stats_path = _zipf_stats(tmp_path)
    a = build_benchmark(stats_path, per_bin=5, num_pairs=50, captions_per_pair=4, seed=0)
    assert a == build_benchmark(stats_path, per_bin=5, num_pairs=50, captions_per_pair=4, seed=0)
    assert a != build_benchmark(stats_path, per_bin=5, num_pairs=50, captions_per_pair=4, seed=1)
    assert len(a) == 200
    counts = {r["concept"]: r for r in C.load_stats(stats_path)["concepts"]}
    pairs = Counter(frozenset(p["concepts"]) for p in a)
    assert len(pairs) == 50 and set(pairs.values()) == {4}
    for p in a:
        first, second = p["concepts"]
        assert first != second and first in p["prompt"] and second in p["prompt"]
        assert p["prompt"] == p["template"].format(a=C.noun_phrase(first), b=C.noun_phrase(second))
        assert p["buckets"] == [counts[first]["bucket"], counts[second]["bucket"]]
        assert p["template"] in TEMPLATES
    for pair in {frozenset(p["concepts"]) for p in a}:  # 4 distinct templates per pair
        assert len({p["template"] for p in a if frozenset(p["concepts"]) == pair}) == 4
    bins = Counter(tuple(sorted(p["bins"])) for p in a)
    assert (0, 0) in bins and (0, 5) in bins and (5, 5) in bins  # tail x tail, tail x head, head x head
    drawn = Counter(b for p in a for b in p["bins"])
    assert set(drawn) == set(range(6))
    out = tmp_path / "prompts.json"
    argv = ["build-benchmark", "--stats", str(stats_path), "--out", str(out), "--per-bin", "5", "--pairs", "50",
            "--captions-per-pair", "4", "--seed", "0"]
    assert cli.main(argv) == 0
    assert json.loads(out.read_text()) == a and "200 prompts" in capsys.readouterr().out


def test_articles_in_prompts():
    assert C.noun_phrase("apple") == "an apple" and C.noun_phrase("unicorn") == "a unicorn"
    assert C.noun_phrase("water") == "some water" and C.noun_phrase("jeans") == "a pair of jeans"


# ----------------------------------------------------------------------------------------------------------------
# synthetic data set and the module entry point
# ----------------------------------------------------------------------------------------------------------------


def test_synthetic_shapes_are_long_tailed_concepts(tmp_path):
    shards = write_synthetic_shards(tmp_path / "syn", num_samples=400, samples_per_shard=200, resolution=16)
    stats = C.collect_stats(shards)
    assert stats.num_captions == 400 and set(stats.counts) == set(SHAPES) | set(COLOURS)
    shape_counts = [stats.counts[s] for s in SHAPES]
    assert min(shape_counts) > 0
    assert shape_counts[0] > 5 * shape_counts[-1]  # Zipf 1.2 over 8: about 10x
    assert shape_counts[0] == max(shape_counts)
    buckets = C.assign_buckets(stats.counts)
    assert buckets[SHAPES[0]] == "head" and buckets[SHAPES[-1]] == "tail"
    assert buckets[COLOURS[0]] == "head" and buckets[COLOURS[-1]] == "tail"
    assert C.caption_bucket("a red ring", buckets) == "tail"


def test_module_entry_point(tmp_path):
    caps = tmp_path / "caps.txt"
    caps.write_text("a cat on a mat\na dog\n")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "-m", "data.prep.concepts", "--captions", str(caps), "--out",
                          str(tmp_path / "out"), "--no-progress"], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "spacy" not in run.stderr.lower()
    assert sorted(os.listdir(tmp_path / "out")) == ["concepts.csv", "concepts.json", "cooccurrence.csv",
                                                    "long_tail.png"]
    assert C.load_buckets(tmp_path / "out") == {"cat": "head", "dog": "head"}
    assert C.extractor_from_stats(tmp_path / "out") is C.default_extractor()


def test_benchmark_leaves_out_pairs_seen_together(tmp_path, capsys):
    captions = ["a cat and a dog", "a cat", "a cat", "a dog", "a horse", "a bird and a horse", "a bird",
                "a car", "a tree", "a tree and a car", "a cat and a dog on a bench", "a bench"]
    C.write_stats(C.count_concepts(captions), tmp_path / "stats")
    path = tmp_path / "stats" / "concepts.json"
    payload = C.load_stats(path)
    together = {frozenset(("cat", "dog")), frozenset(("bird", "horse")), frozenset(("car", "tree")),
                frozenset(("bench", "cat")), frozenset(("bench", "dog"))}
    assert {frozenset(p[:2]) for p in payload["pairs"]} == together
    assert payload["pairs"][0] == ["cat", "dog", 2]  # most frequent first, a < b

    concepts = {"cat", "dog", "horse", "bird", "car", "tree", "bench"}
    every = {frozenset(p) for p in itertools.combinations(sorted(concepts), 2)}
    args = dict(per_bin=10, num_pairs=100, captions_per_pair=1, num_bins=1)
    inert = {frozenset(p["concepts"]) for p in build_benchmark(path, **args)}
    assert inert == every - together  # all 21 - 5 pairs, none of them seen together
    allowed = {frozenset(p["concepts"]) for p in build_benchmark(path, allow_cooccurring=True, **args)}
    assert allowed == every

    out = tmp_path / "prompts.json"
    base = ["build-benchmark", "--stats", str(path), "--out", str(out), "--pairs", "100", "--per-bin", "10",
            "--captions-per-pair", "1", "--bins", "1"]
    assert cli.main(base) == 0
    assert {frozenset(p["concepts"]) for p in json.loads(out.read_text())} == every - together
    assert cli.main(base + ["--allow-cooccurring"]) == 0
    assert {frozenset(p["concepts"]) for p in json.loads(out.read_text())} == every

    old = dict(payload)  # statistics written before pair counts were recorded: one-line error naming the fix
    del old["pairs"]
    with pytest.raises(ValueError, match="no pair counts.*--allow-cooccurring"):
        build_benchmark(old, **args)
    assert {frozenset(p["concepts"]) for p in build_benchmark(old, allow_cooccurring=True, **args)} == every


def test_caption_files_read_each_format_and_count_what_they_skip(tmp_path):
    from data.concepts.captions import iter_caption_file

    def read(name, text, **kw):
        path = tmp_path / name
        path.write_bytes(text.encode("utf-8") if isinstance(text, str) else text)
        skipped = Counter()
        return list(iter_caption_file(str(path), skipped=skipped, **kw)), skipped

    rows = ['"a red ring"', '{"caption": " a blue cross "}', '{"alt": "x", "txt": "y"}', '{"text": ""}', "{oops",
            "", '{"prompt": "a ring"}']
    for name in ("c.jsonl", "C.NDJSON"):
        assert read(name, "\n".join(rows)) == (["a red ring", "a blue cross", "a ring"],
                                               Counter({"no caption": 2, "bad caption": 1}))
    # a named field first, then caption, text, prompt
    assert read("f.jsonl", '{"alt": "mine", "caption": "theirs"}\n{"text": "t"}', caption_field="alt")[0] == [
        "mine", "t"]
    items = ["a red ring", {"caption": "a cross"}, {"other": 1}, "  ", {"prompt": "p"}]
    assert read("l.json", json.dumps(items)) == (["a red ring", "a cross", "p"], Counter({"no caption": 2}))
    assert read("u.json", json.dumps(["café ü"]))[0] == ["café ü"]  # UTF-8 whatever the locale
    # plain text: a caption per line, undecodable bytes replaced rather than failing
    assert read("p.txt", "  a red ring \n\nsecond line\n".encode() + b"bad \xff byte\n")[0] == [
        "a red ring", "second line", "bad \ufffd byte"]
    with pytest.raises(ValueError, match=r"b\.json: not a JSON list of captions .*use \.jsonl for one per line"):
        read("b.json", "[1,")
    with pytest.raises(ValueError, match=r"d\.json: expected a JSON list of captions or objects, got dict"):
        read("d.json", '{"caption": "x"}')
    assert list(iter_caption_file(str(tmp_path / "c.jsonl"))) == ["a red ring", "a blue cross", "a ring"]


def _member_tar(path: Path, members: list[tuple[str, bytes]]) -> str:
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return str(path)


def test_shard_captions_read_the_json_field_and_pass_over_members_of_no_sample(tmp_path, caplog):
    def meta(caption):
        return json.dumps({"caption": caption, "alt": f"alt {caption}"}).encode()

    shard = _member_tar(tmp_path / "part-000000.tar", [
        ("0000.json", meta("a red circle")), ("__meta__", b"not a sample"), ("0001.png", png((1, 2, 3))),
        ("0001.json", meta("a cyan ring")), ("README", b"no extension"), ("0002.json", meta("a blue square"))])
    assert list(C.iter_shard_captions(shard)) == ["a red circle", "a cyan ring", "a blue square"]
    assert list(C.iter_shard_captions(shard, "alt")) == ["alt a red circle", "alt a cyan ring", "alt a blue square"]
    # a shard cut short: what was read is kept, and every unreadable shard counts once
    bad = tmp_path / "bad.tar"
    bad.write_bytes(Path(shard).read_bytes()[:512 * 7 + 10])  # inside 0001.json, after the first sample
    skipped: Counter = Counter()
    with caplog.at_level(logging.WARNING, logger="data.concepts"):
        for _ in range(2):
            assert list(C.iter_shard_captions(str(bad), skipped=skipped)) == ["a red circle"]
    assert skipped == Counter({"unreadable shard": 2})
    message = caplog.records[0].getMessage()
    assert message.startswith(f"skipping the rest of unreadable shard {bad}: ") and "truncated" in message


def test_every_undecodable_line_of_a_jsonl_file_is_counted(tmp_path):
    from data.concepts.captions import iter_caption_file

    path = tmp_path / "c.jsonl"
    path.write_text('{oops\n"a red ring"\n[unclosed\n')
    skipped: Counter = Counter()
    assert list(iter_caption_file(str(path), skipped=skipped)) == ["a red ring"]
    assert skipped == Counter({"bad caption": 2})
