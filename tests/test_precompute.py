"""data/precompute.py (and its command line, data/prep/precompute.py), data/precomputed.py: precomputed VAE
moments and T5 states round-trip against the live encoders, interrupted and split runs produce the same shards as
one clean run, and the loader over them keeps the indexed reader's exact resume and equal batches per rank. Tiny
random VAE/T5, real tar shards, no download."""

from __future__ import annotations

import glob
import io
import itertools
import json
import os
import re
import socket
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from accelerate import PartialState
from PIL import Image

import data.precompute as precompute
import data.precomputed as precomputed
import data.prep.precompute as precompute_cli
from data.indexed import IndexedShards
from data.precompute import PrecomputeSettings, precompute_shards
from data.precomputed import (
    MANIFEST_NAME,
    PrecomputedShards,
    check_manifest,
    load_manifest,
    load_null_text,
    make_precomputed_loader,
    sample_latents,
    unpack_batch,
)
from data.read_spec import ReadSpec
from data.synthetic import write_synthetic_shards
from models.text_encoder import TextConditioner, load_text_encoder
from models.vae import encode_images, load_vae
from shard_helpers import encode, write_tar

REPO = Path(__file__).resolve().parents[1]
RES = 32
TOKENS = 24
SETTINGS = PrecomputeSettings(resolution=RES, max_text_tokens=TOKENS, vae="tiny")  # the encoders below
LONG_CAPTION = "a caption much longer than twenty-four byte tokens, so the tokenizer truncates it"
GOOD = 29  # 25 synthetic + 4 good mixed samples


# ---------------------------------------------------------------------------------------------------------------
# fixtures
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """junk-000000.tar (not a tar), mixed-000000.tar (4 good samples of various formats, 2 bad), then 3 synthetic
    shards of 10, 10, 5 samples: 5 input shards, in the order a folder spec lists them."""
    folder = tmp_path_factory.mktemp("precompute_in")
    mixed = [
        {"__key__": "m0", "jpg": encode(Image.new("RGB", (48, 24), (200, 30, 30)), "JPEG"), "txt": b"a wide photo"},
        {"__key__": "m1", "png": encode(Image.new("RGBA", (20, 40), (0, 90, 200, 128)), "PNG"),
         "txt": LONG_CAPTION.encode()},
        {"__key__": "m2", "jpg": b"\xff\xd8 not a jpeg", "txt": b"undecodable"},
        {"__key__": "m3", "png": encode(Image.new("L", (33, 33), 77), "PNG"),
         "json": json.dumps({"caption": "from the json field", "width": 33, "height": 33}).encode()},
        {"__key__": "m4", "png": encode(Image.new("RGB", (16, 16)), "PNG"), "txt": b"   "},
        {"__key__": "m5", "png": encode(Image.new("P", (40, 40), 3), "PNG"), "txt": b"a palette image",
         "json": b'{"url": "http://example.com/m5.png"}'},
    ]
    paths = [write_tar(folder / "mixed-000000.tar", mixed)]
    junk = folder / "junk-000000.tar"
    junk.write_bytes(b"\x00this is not a tar file\n" * 40)
    paths.append(str(junk))
    paths += write_synthetic_shards(str(folder), num_samples=25, samples_per_shard=10, resolution=RES, seed=3)
    return sorted(paths)


@pytest.fixture(scope="module")
def reference(inputs, tmp_path_factory):
    """One clean single-process precompute of all inputs: (output folder, report)."""
    out = tmp_path_factory.mktemp("precompute_ref")
    report = precompute_shards(inputs, out, SETTINGS, batch_size=4)
    return str(out), report


@pytest.fixture(scope="module")
def encoders():
    tokenizer, t5 = load_text_encoder("tiny")
    return load_vae("tiny"), TextConditioner(tokenizer, t5, TOKENS)


def names(paths) -> list[str]:
    return [os.path.basename(p) for p in paths]


def tar_bytes(folder) -> dict[str, bytes]:
    return {os.path.basename(p): Path(p).read_bytes() for p in sorted(glob.glob(os.path.join(folder, "*.tar")))}


def tar_keys(path) -> list[str]:
    with tarfile.open(path) as tf:
        return list(dict.fromkeys(m.name.split(".", 1)[0] for m in tf.getmembers()))


def members(path) -> dict[str, bytes]:
    with tarfile.open(path) as tf:
        return {m.name: tf.extractfile(m).read() for m in tf.getmembers()}


def leftovers(folder) -> list[str]:
    return glob.glob(os.path.join(folder, "*.tmp-*"))


def stripped(manifest: dict) -> dict:
    return {k: v for k, v in manifest.items() if k != "__path__"}


# ---------------------------------------------------------------------------------------------------------------
# round trip
# ---------------------------------------------------------------------------------------------------------------


def test_round_trip_matches_the_live_encoders(inputs, reference, encoders):
    out, report = reference
    vae, text = encoders
    assert report["written"] == names(inputs) and report["skipped"] == [] and report["samples"] == GOOD
    assert report["bad"] == {"bad image": 1, "missing or empty caption": 1}
    assert sum(report["shards_bad"].values()) == 1  # the junk shard, counted with the reader's shard reason

    manifest = load_manifest(out)
    assert manifest["samples"] == GOOD and manifest["skipped"] == report["bad"]
    assert manifest["shards_bad"] == report["shards_bad"]
    assert [s["name"] for s in manifest["shards"]] == names(inputs)
    assert manifest["latent_shape"] == [2, 4, RES // 8, RES // 8] and manifest["latent_channels"] == 4
    assert manifest["vae_scaling_factor"] == vae.config.scaling_factor == 0.18215
    assert manifest["text_hidden_size"] == 64 and manifest["max_text_tokens"] == TOKENS
    check_manifest(manifest, resolution=RES, max_text_tokens=TOKENS, vae="tiny", text_encoder="tiny",
                   encoder_dtype="float32", caption_field="caption", latent_channels=4, text_hidden_size=64)

    # same keys in the same order, minus the bad samples; the junk shard becomes an empty shard
    for path in inputs:
        want = {"mixed-000000.tar": ["m0", "m1", "m3", "m5"], "junk-000000.tar": []}.get(os.path.basename(path))
        assert tar_keys(os.path.join(out, os.path.basename(path))) == (tar_keys(path) if want is None else want)

    # the images as the training reader decodes them, through the VAE directly
    source = IndexedShards(inputs, RES)
    originals = {}
    for i in range(len(source)):
        s = source[i]
        originals[s["key"]] = s
    ds = PrecomputedShards(out)
    assert len(ds) == GOOD
    got = [ds[i] for i in range(GOOD)]
    keys = [g["key"] for g in got]
    assert sorted(keys) == sorted(k for k in originals if k not in ("m2", "m4"))
    pixels = torch.stack([originals[k]["pixels"] for k in keys])
    with torch.no_grad():
        posterior = vae.encode(pixels).latent_dist
    mean = torch.stack([g["latent_mean"] for g in got])
    logvar = torch.stack([g["latent_logvar"] for g in got])
    assert mean.dtype == torch.float32 and mean.shape == (GOOD, 4, RES // 8, RES // 8)
    torch.testing.assert_close(mean, posterior.mean, rtol=1e-3, atol=1e-5)  # float16 storage
    torch.testing.assert_close(logvar, posterior.logvar, rtol=1e-3, atol=1e-5)

    # T5: the valid tokens equal TextConditioner's output, the mask is restored, padding is zero
    captions = [g["caption"] for g in got]
    assert captions == [originals[k]["caption"] for k in keys]
    assert "from the json field" in captions and LONG_CAPTION in captions
    embeds, mask = text.encode(captions)
    stored_embeds = torch.stack([g["text_embeds"] for g in got])
    stored_mask = torch.stack([g["text_mask"] for g in got])
    assert stored_embeds.shape == (GOOD, TOKENS, 64) and stored_mask.dtype == torch.long
    assert torch.equal(stored_mask, mask)
    assert stored_mask[captions.index(LONG_CAPTION)].sum() == TOKENS  # truncated like training
    valid = mask.bool()
    torch.testing.assert_close(stored_embeds[valid], embeds[valid], rtol=2e-3, atol=2e-3)
    assert torch.all(stored_embeds[~valid] == 0)

    null_embeds, null_mask = load_null_text(out)
    assert torch.equal(null_mask, text.null_mask) and null_embeds.shape == (1, TOKENS, 64)
    torch.testing.assert_close(null_embeds[null_mask.bool()], text.null_embeds[text.null_mask.bool()],
                               rtol=2e-3, atol=2e-3)

    # members: plain .npy (no pickle), original json kept plus sizes
    m = members(os.path.join(out, "mixed-000000.tar"))
    latent = np.load(io.BytesIO(m["m3.latent.npy"]), allow_pickle=False)
    t5 = np.load(io.BytesIO(m["m3.t5.npy"]), allow_pickle=False)
    assert latent.dtype == np.float16 and latent.shape == (2, 4, RES // 8, RES // 8)
    assert t5.dtype == np.float16 and t5.shape == (len("from the json field") + 1, 64)  # bytes + </s>
    assert m["m3.txt"] == b"from the json field"
    meta = json.loads(m["m3.json"])
    assert meta["width"] == 33 and meta["precompute"]["image_size"] == [33, 33]
    assert meta["precompute"]["resolution"] == RES and meta["precompute"]["text_tokens"] == t5.shape[0]
    assert json.loads(m["m5.json"])["url"] == "http://example.com/m5.png"
    assert json.loads(m["m0.json"])["precompute"]["image_size"] == [48, 24]

    # latents sampled from the stored moments decode to images of the training resolution
    latents = sample_latents(mean[:3], logvar[:3], manifest["vae_scaling_factor"], torch.Generator().manual_seed(0))
    with torch.no_grad():
        images = vae.decode(latents / manifest["vae_scaling_factor"]).sample
    assert images.shape == (3, 3, RES, RES)


def test_sample_latents_draws_what_encode_images_draws(encoders):
    vae, _ = encoders
    pixels = torch.rand(3, 3, RES, RES) * 2 - 1
    with torch.no_grad():
        posterior = vae.encode(pixels).latent_dist
    sf = vae.config.scaling_factor
    direct = encode_images(vae, pixels, generator=torch.Generator().manual_seed(5))
    ours = sample_latents(posterior.mean, posterior.logvar, sf, torch.Generator().manual_seed(5))
    torch.testing.assert_close(ours, direct, rtol=0, atol=1e-6)
    other = sample_latents(posterior.mean, posterior.logvar, sf, torch.Generator().manual_seed(6))
    assert not torch.allclose(other, direct)
    # from float16-stored moments: the same draw up to storage precision
    stored = sample_latents(posterior.mean.half().float(), posterior.logvar.half().float(), sf,
                            torch.Generator().manual_seed(5))
    torch.testing.assert_close(stored, direct, rtol=1e-2, atol=2e-3)


def test_bfloat16_text_states(inputs, encoders, tmp_path):
    _, text = encoders
    settings = PrecomputeSettings(resolution=RES, max_text_tokens=TOKENS, vae="tiny", text_dtype="bfloat16")
    precompute_shards(inputs[-1], tmp_path, settings, batch_size=3)
    t5 = np.load(io.BytesIO(members(tmp_path / names(inputs)[-1])["000000020.t5.npy"]), allow_pickle=False)
    assert t5.dtype == np.uint16  # bfloat16 bit patterns
    ds = PrecomputedShards(str(tmp_path))
    got = [ds[i] for i in range(len(ds))]
    embeds, mask = text.encode([g["caption"] for g in got])
    valid = mask.bool()
    stored = torch.stack([g["text_embeds"] for g in got])
    assert torch.equal(stored[valid], embeds.to(torch.bfloat16).float()[valid])  # exact: one rounding to bf16
    assert load_manifest(tmp_path)["text_dtype"] == "bfloat16"


# ---------------------------------------------------------------------------------------------------------------
# interruption, resume, ranks
# ---------------------------------------------------------------------------------------------------------------


def test_interrupted_precompute_resumes_without_duplicates(inputs, reference, tmp_path, monkeypatch):
    out = str(tmp_path / "out")
    real_write = precompute._write_batch
    calls = []

    def failing_write(*args):
        calls.append(1)
        if len(calls) == 4:  # junk (no batch), mixed (1 batch), synthetic-000000 (3 batches): dies in its last
            raise RuntimeError("simulated crash mid-shard")
        return real_write(*args)

    monkeypatch.setattr(precompute, "_write_batch", failing_write)
    with pytest.raises(RuntimeError, match="simulated crash"):
        precompute_shards(inputs, out, SETTINGS, batch_size=4)
    done = names(inputs)[:2]
    assert sorted(n for n in os.listdir(out) if n.endswith(".tar")) == sorted(done)  # nothing half-written
    assert leftovers(out) == [] and not os.path.exists(os.path.join(out, MANIFEST_NAME))
    monkeypatch.setattr(precompute, "_write_batch", real_write)

    # what a kill -9 leaves: a temporary file, and a renamed shard whose record was never written
    Path(out, names(inputs)[3] + ".tmp-4242").write_bytes(b"half a shard")
    Path(out, names(inputs)[4]).write_bytes(b"a shard without its record")
    mtimes = {n: os.stat(os.path.join(out, n)).st_mtime_ns for n in done}

    report = precompute_shards(inputs, out, SETTINGS, batch_size=4)
    assert report["skipped"] == done and report["written"] == names(inputs)[2:]
    assert {n: os.stat(os.path.join(out, n)).st_mtime_ns for n in done} == mtimes  # not rewritten
    assert leftovers(out) == []
    assert tar_bytes(out) == tar_bytes(reference[0])  # identical to one clean run: no duplicate, no corruption
    assert stripped(load_manifest(out)) == stripped(load_manifest(reference[0]))

    # a complete folder: nothing is redone, the encoders are not even loaded
    monkeypatch.setattr(precompute, "_Encoders", lambda *a, **k: pytest.fail("encoders loaded for nothing"))
    again = precompute_shards(inputs, out, SETTINGS, batch_size=4)
    assert again["written"] == [] and again["skipped"] == names(inputs) and again["manifest"] is not None


def test_two_ranks_write_disjoint_shards_whose_union_is_complete(inputs, reference, tmp_path):
    out = str(tmp_path)
    first = precompute_shards(inputs, out, SETTINGS, batch_size=4, rank=0, world_size=2)
    assert first["written"] == names(inputs)[0::2] and first["manifest"] is None
    assert not os.path.exists(os.path.join(out, MANIFEST_NAME))  # rank 1 has not finished
    second = precompute_shards(inputs, out, SETTINGS, batch_size=4, rank=1, world_size=2)
    assert second["written"] == names(inputs)[1::2] and second["manifest"] is not None  # the last one writes it
    assert not set(first["written"]) & set(second["written"])
    assert sorted(first["written"] + second["written"]) == sorted(names(inputs))
    assert first["samples"] + second["samples"] == GOOD
    assert tar_bytes(out) == tar_bytes(reference[0])
    assert stripped(load_manifest(out)) == stripped(load_manifest(reference[0]))


def test_other_settings_and_missing_manifests_are_refused(reference, inputs, tmp_path):
    out, _ = reference
    with pytest.raises(ValueError, match="holds features precomputed with other settings.*resolution 32 there vs 64"):
        precompute_shards(inputs, out, PrecomputeSettings(resolution=64, max_text_tokens=TOKENS, vae="tiny"))
    manifest = load_manifest(out)
    with pytest.raises(ValueError, match="resolution=64 wanted, 32 precomputed; max_text_tokens=120 wanted"):
        check_manifest(manifest, resolution=64, max_text_tokens=120, vae="tiny")
    with pytest.raises(KeyError):
        check_manifest(manifest, no_such_setting=1)
    with pytest.raises(FileNotFoundError, match="precompute did not finish"):
        load_manifest(str(tmp_path))
    with pytest.raises(ValueError, match="would both be written to"):
        precompute_shards([inputs[0], reference[0] + "/" + names(inputs)[0]], tmp_path / "x", SETTINGS)


# ---------------------------------------------------------------------------------------------------------------
# loader
# ---------------------------------------------------------------------------------------------------------------


def keys_of(loader, n: int) -> list[list[str]]:
    return [b["keys"] for b in itertools.islice(loader, n)]


def test_loader_resumes_exactly_with_equal_batches_per_rank(reference):
    out, _ = reference
    args = dict(batch_size=2, seed=4, world_size=3)
    loaders = [make_precomputed_loader(out, ReadSpec(rank=r, **args)) for r in range(3)]
    assert [ld.batches_per_epoch for ld in loaders] == [GOOD // 6] * 3  # 4 each, the remainder is dropped
    full = [list(itertools.islice(ld, 10)) for ld in loaders]  # crosses two epoch boundaries
    ds = PrecomputedShards(out)
    position = {ds[i]["key"]: i for i in range(len(ds))}
    for batch in full[0]:
        assert set(batch) == {"latent_moments", "text_states", "text_lengths", "captions", "keys", "indices"}
        assert batch["indices"] == [position[k] for k in batch["keys"]]
        assert batch["latent_moments"].dtype == batch["text_states"].dtype == torch.float16  # as stored
        assert batch["text_states"].shape == (int(batch["text_lengths"].sum()), 64)
        inputs = unpack_batch(batch, loaders[0].manifest)
        assert inputs["latent_mean"].shape == inputs["latent_logvar"].shape == (2, 4, RES // 8, RES // 8)
        assert inputs["text_embeds"].shape == (2, TOKENS, 64) and inputs["text_mask"].shape == (2, TOKENS)
        assert inputs["latent_mean"].dtype == inputs["text_embeds"].dtype == torch.float32
        for row, key in enumerate(batch["keys"]):  # unpacked on the device = decoded sample by sample
            alone = ds[position[key]]
            assert all(torch.equal(inputs[k][row], alone[k])
                       for k in ("latent_mean", "latent_logvar", "text_embeds", "text_mask"))
    epoch0 = [k for rank in full for b in rank[:4] for k in b["keys"]]
    assert len(epoch0) == len(set(epoch0)) == 24  # ranks are disjoint within an epoch
    for rank in range(3):
        for start in (1, 4, 5):
            resumed = make_precomputed_loader(out, ReadSpec(rank=rank, batches_done=start, **args))
            assert keys_of(resumed, 10 - start) == [b["keys"] for b in full[rank][start:]], (rank, start)
    resumed = list(itertools.islice(make_precomputed_loader(out, ReadSpec(rank=1, batches_done=5, num_workers=2,
                                                                          **args)), 3))
    for a, b in zip(full[1][5:], resumed):
        assert a["keys"] == b["keys"] and a["captions"] == b["captions"]
        assert all(torch.equal(a[k], b[k]) for k in ("latent_moments", "text_states", "text_lengths"))
    assert loaders[0].stats.good == 20 and loaders[0].stats.bad == {}


def test_reader_threads_give_the_same_batches_and_kept_batches_are_never_overwritten(reference):
    out, _ = reference
    args = dict(batch_size=3, seed=2, world_size=2, rank=1, batches_done=2)
    tensors = ("latent_moments", "text_states", "text_lengths")
    plain = list(itertools.islice(make_precomputed_loader(out, ReadSpec(**args)), 12))  # 12 > one epoch of 4 batches
    for threads in (1, 3):
        loader = make_precomputed_loader(out, ReadSpec(loader_threads=threads, **args))
        threaded = list(itertools.islice(loader, 12))  # every batch kept: none may share memory with a later one
        for a, b in zip(plain, threaded):
            assert a["keys"] == b["keys"] and a["captions"] == b["captions"]
            assert all(torch.equal(a[k], b[k]) for k in tensors)
        assert loader.stats.good == 36 and loader.stats.bad == {}
    with pytest.raises(ValueError, match="loader_threads=1 needs precomputed features and data.num_workers=0"):
        make_precomputed_loader(out, ReadSpec(batch_size=2, num_workers=1, loader_threads=1))

    # in-process batches reuse the memory of batches that are gone, and only theirs
    ds = PrecomputedShards(out)
    kept = ds.get_batch([0, 1, 2])
    copy = {k: kept[k].clone() for k in tensors}
    pointers = set()
    for start in range(3, 27, 3):
        batch = ds.get_batch([start, start + 1, start + 2])
        pointers.add(batch["text_states"].data_ptr())
        del batch
    assert kept["text_states"].data_ptr() not in pointers and len(pointers) < 8  # regions were recycled
    assert all(torch.equal(kept[k], copy[k]) for k in tensors)
    view = kept["text_states"][1:]  # a view alone keeps its region too
    del kept
    later = [ds.get_batch([i, i + 1, i + 2]) for i in range(0, 24, 3)]
    assert torch.equal(view, copy["text_states"][1:]) and len(later) == 8


# ---------------------------------------------------------------------------------------------------------------
# the command, in real processes
# ---------------------------------------------------------------------------------------------------------------


def run_env() -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def assert_same_features(folder, reference_folder) -> None:
    """Same shards, keys, captions and json; arrays equal to float16 storage tolerance (another process may
    use another thread count)."""
    assert sorted(tar_bytes(folder)) == sorted(tar_bytes(reference_folder))
    for name in tar_bytes(folder):
        got, want = members(os.path.join(folder, name)), members(os.path.join(reference_folder, name))
        assert list(got) == list(want)
        for member, data in got.items():
            if member.endswith(".npy"):
                a, b = (np.load(io.BytesIO(x), allow_pickle=False).astype(np.float32) for x in (data, want[member]))
                np.testing.assert_allclose(a, b, rtol=2e-3, atol=1e-4)
            else:
                assert data == want[member]
    assert stripped(load_manifest(folder)) == stripped(load_manifest(reference_folder))


def test_command_line_and_reader_needs_no_encoders(inputs, reference, tmp_path, capsys):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "data.prep.precompute", os.path.dirname(inputs[0]), str(out), "--resolution",
           str(RES), "--max-text-tokens", str(TOKENS), "--vae", "tiny", "--batch-size", "4", "--num-workers", "2"]
    proc = subprocess.run(cmd, cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rank 0/1: wrote 5 shards (29 samples; skipped 2 bad" in proc.stdout
    assert f"complete: {GOOD} samples in 5 shards" in proc.stdout
    # a progress bar of the images encoded, shard by shard: a long precompute is never silent
    assert re.search(rf"precompute -> {re.escape(str(out))}: .*\b{GOOD} img.*shard 5/5", proc.stderr), proc.stderr
    assert_same_features(out, reference[0])

    try:  # again, in this process: nothing left to do
        assert precompute_cli.main(cmd[3:]) == 0
        printed = capsys.readouterr().out
        assert "rank 0/1: wrote 0 shards (0 samples; skipped 0 bad: none), 5 already complete" in printed
        with pytest.raises(ValueError, match="other settings.*resolution"):
            precompute_cli.main([*cmd[3:5], "--resolution", "64"])
    finally:
        PartialState._reset_state()  # main() made this process's accelerate state: leave none to later tests

    # training on precomputed shards loads neither the VAE nor T5 (nor the libraries that hold them)
    script = (
        "import sys\n"
        "from data.precomputed import make_precomputed_loader, load_null_text, sample_latents, unpack_batch\n"
        "from data.read_spec import ReadSpec\n"
        f"loader = make_precomputed_loader({str(out)!r}, ReadSpec(batch_size=4))\n"
        "b = unpack_batch(next(iter(loader)), loader.manifest); e, m = load_null_text(loader.manifest)\n"
        "z = sample_latents(b['latent_mean'], b['latent_logvar'], loader.manifest['vae_scaling_factor'])\n"
        "loaded = [n for n in sys.modules if n.split('.')[0] in ('models', 'diffusers', 'transformers')]\n"
        "print('LOADED', loaded, tuple(z.shape))\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=run_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"LOADED [] (4, 4, {RES // 8}, {RES // 8})" in proc.stdout


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_accelerate_launch_splits_shards_over_two_processes(inputs, reference, tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--main_process_port", str(free_port()), "--mixed_precision", "no",
           "--dynamo_backend", "no", "-m", "data.prep.precompute", *inputs, str(out), "--resolution", str(RES),
           "--max-text-tokens", str(TOKENS), "--vae", "tiny", "--batch-size", "4", "--num-workers", "0"]
    env = {**run_env(), "ACCELERATE_USE_CPU": "true"}  # the CPU form that really starts 2 processes
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])
    assert "rank 0/2: wrote 3 shards" in proc.stdout and "rank 1/2: wrote 2 shards" in proc.stdout
    assert f"complete: {GOOD} samples in 5 shards" in proc.stdout
    assert_same_features(out, reference[0])


@pytest.mark.parametrize("array", [
    np.arange(2 * 4 * 3 * 5, dtype=np.float16).reshape(2, 4, 3, 5),  # a latent
    np.arange(7 * 6, dtype=np.uint16).reshape(7, 6),  # bf16 bits
    np.asfortranarray(np.arange(12, dtype=np.float32).reshape(3, 4)),
    np.zeros((0, 6), np.float16),
])
@pytest.mark.parametrize("version", [(1, 0), (2, 0)])
def test_npy_members_read_like_np_load_with_cached_headers(array, version):
    buf = io.BytesIO()
    np.lib.format.write_array(buf, array, version=version, allow_pickle=False)
    data = buf.getvalue()
    for _ in range(2):  # the second read takes the header from the cache
        got = precomputed.load_npy(data)
        assert got.dtype == array.dtype and got.shape == array.shape and np.array_equal(got, array)
        assert got.flags.writeable and got.flags.f_contiguous == array.flags.f_contiguous
        got[...] = 0  # a copy: the member's bytes stay as they were
    assert np.array_equal(precomputed.load_npy(data), array)


def test_bad_npy_members_raise_value_errors():
    data = precomputed.npy_bytes(np.ones((4, 5), np.float16))
    with pytest.raises(ValueError, match="holds 38 data bytes, its header says"):
        precomputed.load_npy(data[:-2])  # truncated
    objects = io.BytesIO()
    np.save(objects, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError, match="pickle"):
        precomputed.load_npy(objects.getvalue())
    with pytest.raises(ValueError):
        precomputed.load_npy(b"not an array at all")
