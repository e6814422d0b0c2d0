"""data/prep/writers/: folders and tables -> img2dataset-layout shards, read back through the project's real loaders."""

from __future__ import annotations

import base64
import csv
import io
import itertools
import json
import os
import pathlib
import subprocess
import sys
import tarfile

import pytest
import torch
import webdataset as wds
from PIL import Image

from data.read_spec import ReadSpec
import data.prep.writers as writers
from data.images import image_to_tensor, resize_center_crop
from data.index import load_or_build_index
from data.indexed import make_indexed_loader
from data.streaming import make_image_text_loader
from shard_helpers import encode

REPO = pathlib.Path(__file__).resolve().parents[1]
RES = 8


def img_bytes(rgb, fmt="PNG", size=(20, 14)) -> bytes:
    return encode(Image.new("RGB", size, rgb), fmt)


def tar_samples(path) -> dict[str, dict[str, bytes]]:
    out: dict[str, dict[str, bytes]] = {}
    with tarfile.open(path) as tf:
        for m in tf.getmembers():
            key, ext = m.name.split(".", 1)
            out.setdefault(key, {})[ext] = tf.extractfile(m).read()
    return out


def all_samples(paths) -> dict[str, dict[str, bytes]]:
    out = {}
    for p in paths:
        out.update(tar_samples(p))
    return out


def indexed_read(spec) -> dict[str, str]:
    """key -> caption over one epoch of the indexed loader (batch 1: every sample once)."""
    loader = make_indexed_loader(spec, ReadSpec(resolution=RES, batch_size=1))
    got = {k: c for b in itertools.islice(loader, loader.batches_per_epoch) for k, c in zip(b["keys"], b["captions"])}
    assert loader.stats.bad == {} and loader.stats.shards_bad == {}
    return got


def streaming_read(spec) -> dict[str, str]:
    loader = make_image_text_loader(spec, ReadSpec(resolution=RES, batch_size=1, shuffle_buffer=0), resampled=False)
    got = {k: c for b in loader for k, c in zip(b["keys"], b["captions"])}
    assert loader.dataset.stats.bad == {} and loader.dataset.stats.shards_bad == {}
    return got


@pytest.fixture()
def src(tmp_path):
    """A folder of captioned images (nested), with every kind of bad input next to them."""
    root = tmp_path / "src"
    (root / "b" / "deeper").mkdir(parents=True)
    (root / "a").mkdir()
    good = {  # relative path -> (bytes, caption)
        "a/cat.jpg": (img_bytes((200, 10, 10), "JPEG"), "a red cat"),
        "a/dog.jpeg": (img_bytes((10, 200, 10), "JPEG", (30, 16)), "a green dog"),
        "b/bird.png": (img_bytes((10, 10, 200)), "a blue bird"),
        "b/deeper/fish.webp": (img_bytes((200, 200, 10), "WEBP"), "a yellow fish"),
        "b/deeper/UPPER.PNG": (img_bytes((9, 9, 9)), "caf\u00e9 cr\u00e8me, UTF-8 with a BOM"),
        "top.png": (img_bytes((100, 100, 100), size=(40, 10)), "  a grey top, padded  "),
    }
    for rel, (data, caption) in good.items():
        (root / rel).write_bytes(data)
        txt = caption.encode("utf-8-sig" if "BOM" in caption else "utf-8")
        (root / rel).with_suffix(".txt").write_bytes(txt)
    (root / "a" / "cat.json").write_text(json.dumps({"license": "cc-by", "width": -1}))  # extras; reserved ignored
    png = img_bytes((1, 2, 3))
    bad = {
        "a/no-caption.png": (png, None),
        "a/empty-caption.png": (png, b" \n"),
        "a/latin1.png": (png, "caf\u00e9".encode("latin-1")),
        "b/corrupt.jpg": (b"\xff\xd8 not a jpeg", b"corrupt"),
        "b/truncated.jpg": (img_bytes((5, 5, 5), "JPEG", (64, 64))[:300], b"truncated"),
        "b/zero.png": (b"", b"zero bytes"),
        "b/really-a-gif.png": (img_bytes((5, 5, 5), "GIF"), b"gif named png"),
        "b/tiny.png": (img_bytes((5, 5, 5), size=(6, 4)), b"tiny"),
    }
    for rel, (data, caption) in bad.items():
        (root / rel).write_bytes(data)
        if caption is not None:
            (root / rel).with_suffix(".txt").write_bytes(caption)
    (root / "a" / "ghost.txt").write_text("a caption whose image was never copied")  # an orphan caption
    (root / "b" / "deeper" / "lost.txt").write_text("another orphan")
    (root / "b" / "deeper" / "lost.json").write_text("{}")  # its sidecar: part of the orphan, not another input
    (root / "b" / "phone.HEIC").write_bytes(b"\0\0\0\x18ftypheic")  # a format the readers do not decode ...
    (root / "b" / "phone.txt").write_text("a photo from a phone")  # ... with its caption, which is no orphan
    (root / "b" / "scan.tiff").write_bytes(b"II*\0")  # ... and without one
    (root / "notes.md").write_text("not an image")  # no input: named as ignored
    (root / "a" / "._cat.jpg").write_bytes(b"macOS resource fork")  # hidden: ignored
    expected_skips = {"missing or empty caption": 2, "non-UTF-8 text": 1, "bad image": 2, "zero-byte image": 1,
                      "unsupported image format": 3, "image too small": 1, "caption without an image": 2}
    return root, good, expected_skips


def test_every_input_not_written_is_counted_by_reason_orphan_captions_included(src, tmp_path):
    root, good, skips = src
    summary = writers.write_folder(root, tmp_path / "out", min_size=5, progress=False, build_index=False)
    # the inputs, counted from the folder apart from the writer: each image file (any format) and each caption
    # whose stem names no image
    files = [p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() and not p.name.startswith(".")]
    images = {f for f in files if f.lower().endswith((".jpg", ".jpeg", ".png", ".webp", ".heic", ".tiff"))}
    stems = {f.rsplit(".", 1)[0] for f in images}
    orphans = {f for f in files if f.endswith(".txt") and f.rsplit(".", 1)[0] not in stems}
    assert orphans == {"a/ghost.txt", "b/deeper/lost.txt"}
    assert summary.written == len(good)
    assert sum(summary.skipped.values()) == len(images) + len(orphans) - summary.written == 12
    assert dict(summary.skipped) == skips and summary.ignored == ["notes.md"]
    line = summary.line()
    assert "; skipped 12 (bad image: 2, caption without an image: 2, image too small: 1, " in line
    assert line.endswith("; ignored 1 file that is neither an image nor a caption (notes.md)")
    report = json.loads((tmp_path / "out" / "shard-summary.json").read_text())
    assert report["skipped"] == skips and report["ignored"] == ["notes.md"]

    # a folder of orphan captions and unsupported images alone has no image to write: said as such
    (tmp_path / "none").mkdir()
    (tmp_path / "none" / "x.txt").write_text("orphan")
    (tmp_path / "none" / "y.gif").write_bytes(b"GIF89a")
    with pytest.raises(FileNotFoundError, match="no images"):
        writers.write_folder(tmp_path / "none", tmp_path / "out2", progress=False)


def test_folder_to_shards_and_back_through_both_loaders(src, tmp_path):
    root, good, skips = src
    out = tmp_path / "out"
    summary = writers.write_folder(root, out, samples_per_shard=4, prefix="part", min_size=5, progress=False)
    assert dict(summary.skipped) == skips and summary.written == len(good) == 6
    names = sorted(os.listdir(out))
    assert [n for n in names if n.endswith(".tar")] == ["part-000000.tar", "part-000001.tar"]
    assert not [n for n in names if ".tmp" in n]
    assert summary.shards == [str(out / "part-000000.tar"), str(out / "part-000001.tar")]
    assert len(tar_samples(summary.shards[0])) == 4 and len(tar_samples(summary.shards[1])) == 2

    samples = all_samples(summary.shards)
    order = sorted(good)  # sorted relative paths -> keys 000000000, 000000001, ...
    assert list(samples) == [f"{i:09d}" for i in range(6)]
    for key, rel in zip(samples, order):
        data, caption = good[rel]
        s = samples[key]
        ext = {"JPEG": "jpg", "PNG": "png", "WEBP": "webp"}[Image.open(io.BytesIO(data)).format]
        assert set(s) == {ext, "txt", "json"}
        assert s[ext] == data  # the original bytes, not re-encoded
        assert s["txt"].decode() == caption.strip()
        meta = json.loads(s["json"])
        w, h = Image.open(io.BytesIO(data)).size
        assert (meta["key"], meta["caption"], meta["source"], meta["width"], meta["height"]) == (
            key, caption.strip(), rel, w, h)
    cat = json.loads(samples["000000000"]["json"])
    assert cat["license"] == "cc-by" and cat["width"] == 20  # sidecar extras, reserved fields kept

    # ready to train on: the index is built, and both readers deliver every sample with its caption
    assert summary.index is not None and os.path.isfile(summary.index)
    assert load_or_build_index(str(out)).rescanned == []  # `data.shards=OUT_DIR` finds the index already built
    expected = {key: good[rel][1].strip() for key, rel in zip(samples, order)}
    assert indexed_read(str(out)) == expected
    assert streaming_read(str(out)) == expected
    loader = make_indexed_loader(str(out), ReadSpec(resolution=RES, batch_size=6))
    batch = next(iter(loader))
    i = batch["keys"].index("000000002")  # b/bird.png
    want = image_to_tensor(resize_center_crop(Image.open(io.BytesIO(good["b/bird.png"][0])), RES))
    assert torch.equal(batch["pixels"][i], want)

    report = json.loads((out / "part-summary.json").read_text())
    assert report["written"] == 6 and report["skipped"] == skips
    assert report["shards"] == ["part-000000.tar", "part-000001.tar"]


def test_output_is_deterministic_for_any_workers_and_keeps_uncaptioned_on_request(src, tmp_path):
    root, good, skips = src
    one = writers.write_folder(root, tmp_path / "one", samples_per_shard=3, progress=False, build_index=False)
    two = writers.write_folder(root, tmp_path / "two", samples_per_shard=3, progress=False, build_index=False,
                               workers=2)
    assert [os.path.basename(p) for p in one.shards] == [os.path.basename(p) for p in two.shards]
    assert all(pathlib.Path(a).read_bytes() == pathlib.Path(b).read_bytes() for a, b in zip(one.shards, two.shards))
    assert one.skipped == two.skipped and one.index is None

    keep = writers.write_folder(root, tmp_path / "keep", progress=False, keep_uncaptioned=True, min_size=5)
    assert keep.written == 8 and keep.skipped["missing or empty caption"] == 0
    captions = {json.loads(s["json"])["source"]: s["txt"] for s in all_samples(keep.shards).values()}
    assert captions["a/no-caption.png"] == b"" and captions["a/empty-caption.png"] == b""
    # the reader skips empty captions
    loader = make_indexed_loader(str(tmp_path / "keep"), ReadSpec(resolution=RES, batch_size=1))
    keys = {k for b in itertools.islice(loader, loader.batches_per_epoch) for k in b["keys"]}
    assert len(keys) == 6 and loader.stats.bad == {"missing or empty caption": 2}


def table_rows(tmp_path):
    """(images on disk, rows): 4 good rows and 2 bad ones (missing file, no caption)."""
    folder = tmp_path / "tbl"
    (folder / "img").mkdir(parents=True)
    images = {f"img/{i}.png": img_bytes((40 * i, 0, 0)) for i in range(3)}
    for rel, data in images.items():
        (folder / rel).write_bytes(data)
    absolute = str(folder / "img" / "2.png")
    rows = [
        {"file": "img/0.png", "text": "row zero", "score": 0.5, "tag": "a"},
        {"file": "img/1.png", "text": "row one", "score": 1.5, "tag": "b"},
        {"file": absolute, "text": "row two, absolute path", "score": 2.5, "tag": "c"},
        {"file": "img/missing.png", "text": "no such file", "score": 3.5, "tag": "d"},
        {"file": "img/0.png", "text": "", "score": 4.5, "tag": "e"},
        {"file": img_bytes((0, 0, 250), "JPEG"), "text": "row five, bytes", "score": 5.5, "tag": "f"},
    ]
    return folder, rows


def data_uri(data: bytes) -> str:
    return "data:image/jpeg;base64," + base64.b64encode(data).decode()


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "parquet"])
def test_table_to_shards(tmp_path, fmt):
    folder, rows = table_rows(tmp_path)
    table = folder / f"rows.{fmt}"
    if fmt == "parquet":
        pa = pytest.importorskip("pyarrow")
        import pyarrow.parquet as pq

        cells = [r["file"].encode() if isinstance(r["file"], str) else r["file"] for r in rows]
        # paths as binary would be read as bytes; a struct column holds either, like Hugging Face datasets
        structs = [{"bytes": c, "path": None} if not isinstance(r["file"], str) else {"bytes": None, "path": r["file"]}
                   for c, r in zip(cells, rows)]
        pq.write_table(pa.table({"file": structs, "text": [r["text"] for r in rows],
                                 "score": [r["score"] for r in rows], "tag": [r["tag"] for r in rows]}), table)
    else:
        text_rows = [dict(r, file=r["file"] if isinstance(r["file"], str) else data_uri(r["file"])) for r in rows]
        if fmt == "jsonl":
            table.write_text("".join(json.dumps(r) + "\n" for r in text_rows) + "\n{not json\n[1, 2]\n")
        else:
            with open(table, "w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=list(text_rows[0]))
                w.writeheader()
                w.writerows(text_rows)
    out = tmp_path / "out"
    summary = writers.write_table(table, out, image_column="file", caption_column="text", samples_per_shard=2,
                                  progress=False)
    skips = {"unreadable file": 1, "missing or empty caption": 1}
    if fmt == "jsonl":
        skips["unreadable row"] = 2  # lines that are not JSON objects
    assert summary.written == 4 and dict(summary.skipped) == skips
    assert len(summary.shards) == 2
    samples = all_samples(summary.shards)
    metas = [json.loads(s["json"]) for s in samples.values()]
    assert [m["caption"] for m in metas] == ["row zero", "row one", "row two, absolute path", "row five, bytes"]
    assert [m["tag"] for m in metas] == ["a", "b", "c", "f"]  # extra columns copied
    assert [float(m["score"]) for m in metas] == [0.5, 1.5, 2.5, 5.5]  # CSV keeps them as text
    assert "file" not in metas[0] and "text" not in metas[0]
    assert metas[0]["source"] == "img/0.png" and metas[3]["source"] == f"rows.{fmt}#5"
    assert samples["000000000"]["png"] == (folder / "img" / "0.png").read_bytes()
    assert samples["000000003"]["jpg"] == rows[5]["file"]  # bytes kept, extension from the real format
    expected = {f"{i:09d}": m["caption"] for i, m in enumerate(metas)}
    assert indexed_read(str(out)) == expected
    assert streaming_read(str(out)) == expected


def test_parquet_binary_column_and_missing_pyarrow(tmp_path, monkeypatch):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    table = tmp_path / "t.parquet"
    pq.write_table(pa.table({"image": [img_bytes((i, 0, 0)) for i in range(3)], "caption": ["a", "b", "c"]}), table)
    summary = writers.write_table(table, tmp_path / "out", progress=False)
    assert summary.written == 3 and indexed_read(str(tmp_path / "out")) == {"000000000": "a", "000000001": "b",
                                                                             "000000002": "c"}

    monkeypatch.setitem(sys.modules, "pyarrow", None)  # as if not installed
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ImportError, match="needs pyarrow: pip install pyarrow"):
        writers.write_table(table, tmp_path / "again", progress=False)


def test_interrupted_shard_never_appears_under_its_final_name(src, tmp_path, monkeypatch):
    root, _, _ = src
    out = tmp_path / "out"
    real_write = wds.TarWriter.write
    calls = []

    def failing_write(self, sample):
        calls.append(sample["__key__"])
        names = os.listdir(out)
        if len(calls) > 3:  # inside the second shard: its final name must not exist yet
            assert "shard-000001.tar" not in names and any(n.startswith("shard-000001.tar.tmp") for n in names)
        if len(calls) == 5:
            raise OSError(28, "No space left on device (simulated)")
        return real_write(self, sample)

    monkeypatch.setattr(wds.TarWriter, "write", failing_write)
    with pytest.raises(OSError, match="No space left"):
        writers.write_folder(root, out, samples_per_shard=3, progress=False)
    assert sorted(os.listdir(out)) == ["shard-000000.tar"]  # complete shard kept, the partial one removed
    assert len(tar_samples(out / "shard-000000.tar")) == 3


def test_existing_set_is_refused_or_replaced(src, tmp_path):
    root, _, _ = src
    out = tmp_path / "out"
    first = writers.write_folder(root, out, samples_per_shard=2, progress=False, min_size=5)
    assert len(first.shards) == 3
    with pytest.raises(FileExistsError, match="--overwrite"):
        writers.write_folder(root, out, samples_per_shard=2, progress=False, min_size=5)
    again = writers.write_folder(root, out, samples_per_shard=5, progress=False, overwrite=True, min_size=5)
    assert sorted(p for p in os.listdir(out) if p.endswith(".tar")) == ["shard-000000.tar", "shard-000001.tar"]
    assert [os.path.basename(p) for p in again.shards] == ["shard-000000.tar", "shard-000001.tar"]
    assert len(indexed_read(str(out))) == 6  # the stale third shard is gone


def test_cli(src, tmp_path):
    root, _, skips = src
    out = tmp_path / "out"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "-m", "data.prep.writers", "folder", str(root), str(out),
                          "--samples-per-shard", "4", "--min-size", "5", "--no-progress"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert f"wrote 6 samples in 2 shards to {out}; skipped 12 (bad image: 2, caption without an image: 2," in run.stdout
    assert f"train with data.shards={out}" in run.stdout


def test_cli_errors_are_one_line(tmp_path, capsys):
    table = tmp_path / "t.jsonl"  # columns are read from the first line that is a JSON object
    table.write_text("not json\n" + json.dumps({"path": "x.png", "caption": "c"}) + "\n")
    (tmp_path / "t.xlsx").write_text("x")
    assert writers.main(["table", str(table), str(tmp_path / "o"), "--no-progress"]) == 2
    assert writers.main(["folder", str(tmp_path / "nowhere"), str(tmp_path / "o")]) == 2
    assert writers.main(["table", str(tmp_path / "t.xlsx"), str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(line.startswith("error: ") for line in err)
    assert "no column 'image' (columns: path, caption); pass --image-column" in err[0]
    assert "--format" in err[2]
