"""Storing T5 states compactly: the int8 format's error bound, the precompute → manifest → reader round trip, the
refusals of what a reader cannot read, and the training loss with int8 states against float16 ones."""

import json
import shutil

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

import data.precomputed as precomputed
from data.precompute import PrecomputeSettings, precompute_shards
from data.precomputed import (
    BAD_PRECOMPUTED,
    MANIFEST_NAME,
    TEXT_MEMBER,
    TEXT_SCALE_MEMBER,
    PrecomputedShards,
    load_manifest,
    load_null_text,
    make_precomputed_loader,
    npy_bytes,
    unpack_batch,
)
from data.read_spec import ReadSpec
from data.synthetic import write_synthetic_shards
from data.text_states import TEXT_DTYPES, bytes_per_token, check_stored, encode_states, states_from_numpy
from models.text_encoder import TextConditioner, load_text_encoder
from shard_helpers import write_tar
from test_train_precomputed import args as train_args
from test_train_precomputed import run_main

RES, TOKENS = 32, 16


# ---------------------------------------------------------------------------------------------------------------
# the formats
# ---------------------------------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(arrays(np.float32, st.tuples(st.integers(1, 6), st.integers(1, 40)),
              elements=st.floats(-1e4, 1e4, width=32)))
def test_int8_error_is_at_most_half_a_step_of_each_tokens_scale(x):
    states = torch.from_numpy(x)
    values, scale = encode_states(states, "int8")
    assert values.dtype == np.int8 and scale.dtype == np.float32 and scale.shape == (x.shape[0],)
    assert np.abs(values.astype(np.int32)).max() <= 127
    back = states_from_numpy(values, scale, "int8")
    bound = torch.from_numpy(scale)[:, None] / 2 * (1 + 1e-5) + 1e-30
    assert ((back - states).abs() <= bound).all()


def test_each_dtype_round_trips_as_documented():
    torch.manual_seed(0)
    states = torch.randn(7, 64) * torch.logspace(-2, 1, 64)
    states[3] = 0  # an all-zero token decodes to zeros
    for dtype, torch_dtype in (("float16", torch.float16), ("bfloat16", torch.bfloat16)):
        values, scale = encode_states(states, dtype)
        assert scale is None and values.dtype == {"float16": np.float16, "bfloat16": np.uint16}[dtype]
        assert torch.equal(states_from_numpy(values, None, dtype), states.to(torch_dtype).float())
    values, scale = encode_states(states, "int8")
    back = states_from_numpy(values, scale, "int8")
    assert torch.equal(back[3], torch.zeros(64)) and scale[3] == 0
    # each token's largest magnitude decodes to itself (it is 127 steps of its scale) and stays a largest value of
    # the decoded token (another value within half a step of it may round to 127 as well: a tie, not an error)
    top = states.abs().argmax(dim=1, keepdim=True)
    assert torch.allclose(back.gather(1, top), states.gather(1, top), rtol=1e-6, atol=0)
    assert torch.equal(back.abs().gather(1, top)[:, 0], back.abs().amax(dim=1))
    assert bytes_per_token("int8", 4096) == 4100 and bytes_per_token("float16", 4096) == 8192
    assert bytes_per_token("int8", 4096) / bytes_per_token("float16", 4096) < 0.51  # "at least halves"


def test_stored_arrays_of_another_dtype_are_refused():
    values, scale = encode_states(torch.randn(3, 8), "int8")
    with pytest.raises(ValueError, match="text_dtype 'float16' stores float16"):
        check_stored(values, None, "float16")
    with pytest.raises(ValueError, match="needs a float32 scale per token"):
        check_stored(values, None, "int8")
    with pytest.raises(ValueError, match="needs a float32 scale per token"):
        check_stored(values, scale[:2], "int8")
    half, _ = encode_states(torch.randn(3, 8), "float16")
    with pytest.raises(ValueError, match="has no per-token scale"):
        check_stored(half, scale, "float16")
    with pytest.raises(ValueError, match="text_dtype must be one of"):
        encode_states(torch.randn(3, 8), "fp4")
    assert set(TEXT_DTYPES) == {"float16", "bfloat16", "int8"}


# ---------------------------------------------------------------------------------------------------------------
# precompute → manifest → reader
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def features(tmp_path_factory):
    """The same 12 synthetic images precomputed with float16 and with int8 states."""
    raw = tmp_path_factory.mktemp("raw")
    shards = write_synthetic_shards(str(raw), num_samples=12, samples_per_shard=6, resolution=RES, seed=1)
    out = {}
    for dtype in ("float16", "int8"):
        out[dtype] = tmp_path_factory.mktemp(dtype)
        settings_ = PrecomputeSettings(resolution=RES, max_text_tokens=TOKENS, text_dtype=dtype)
        precompute_shards(shards, out[dtype], settings_, batch_size=4)
    return out


def test_int8_features_are_recorded_read_back_and_close_to_float16(features):
    half, compact = load_manifest(features["float16"]), load_manifest(features["int8"])
    assert (half["version"], compact["version"]) == (1, 2)  # version 1 readers refuse int8 features
    assert compact["text_dtype"] == "int8" and compact["settings"]["text_dtype"] == "int8"
    ds_half, ds_int8 = PrecomputedShards(features["float16"]), PrecomputedShards(features["int8"])
    half_bytes = len(ds_half.raw(0)[TEXT_MEMBER])
    raw = ds_int8.raw(0)
    assert TEXT_SCALE_MEMBER in raw and len(raw[TEXT_MEMBER]) + len(raw[TEXT_SCALE_MEMBER]) < 0.8 * half_bytes
    for i in range(len(ds_half)):
        a, b = ds_half[i], ds_int8[i]
        assert a["key"] == b["key"] and torch.equal(a["text_mask"], b["text_mask"])
        assert torch.equal(a["latent_mean"], b["latent_mean"])  # latents are float16 in both
        valid = a["text_mask"].bool()
        err = (a["text_embeds"] - b["text_embeds"])[valid].abs()
        # both round the same float32 states: int8 by at most half its step (amax / 254), float16 by at most half
        # an ulp, 2^-11 of the value, so at most 2^-11 of amax (times 1 + 2^-10 for amax itself read in float16);
        # relative to each token's largest value, whatever the encoder's scale. A wrong scale (another token's,
        # not / 127) or truncating instead of rounding exceeds it
        bound = a["text_embeds"][valid].abs().amax(dim=1) * (1 / 254 + 2 ** -11) * (1 + 2 ** -10)
        assert (err.amax(dim=1) <= bound).all()
        assert torch.equal(b["text_embeds"][~valid], torch.zeros_like(b["text_embeds"][~valid]))

    # the null caption stays float16, so both folders hold the same unconditional embedding
    assert torch.equal(load_null_text(half)[0], load_null_text(compact)[0])
    tokenizer, t5 = load_text_encoder("tiny")
    null = TextConditioner(tokenizer, t5, TOKENS)
    n = int(null.null_mask.sum())
    # float16 storage of the encoder's own null state: each value within half an ulp, 2^-11 of itself (2^-25 below
    # float16's normal range), 1% slack for the encoder's float32 rounding; a null stored as bfloat16 (2^-9) or
    # int8, or another caption's state, is outside
    assert torch.allclose(load_null_text(compact)[0][0, :n], null.null_embeds[0, :n], rtol=2 ** -11 * 1.01,
                          atol=2 ** -25)

    # the loader's packed int8 batch, unpacked, equals the sample-by-sample decoding
    batch = next(iter(make_precomputed_loader(features["int8"], ReadSpec(batch_size=3, num_workers=1))))
    assert batch["text_states"].dtype == torch.int8 and batch["text_scale"].shape == batch["text_states"].shape[:1]
    inputs = unpack_batch(batch, compact)
    position = {ds_int8[i]["key"]: i for i in range(len(ds_int8))}
    for row, key in enumerate(batch["keys"]):
        assert torch.equal(inputs["text_embeds"][row], ds_int8[position[key]]["text_embeds"])


def test_readers_refuse_features_they_cannot_read(features, tmp_path, monkeypatch):
    folder = tmp_path / "int8"
    shutil.copytree(features["int8"], folder)
    manifest_path = folder / MANIFEST_NAME
    manifest = json.loads(manifest_path.read_text())

    monkeypatch.setattr(precomputed, "READABLE_VERSIONS", (1,))  # a reader from before the int8 format
    with pytest.raises(ValueError, match=r"format version 2, this code reads versions \[1\]"):
        load_manifest(folder)
    monkeypatch.undo()

    for version, dtype, message in ((1, "int8", "does not store text_dtype 'int8'"),
                                    (2, "float16", "does not store text_dtype 'float16'"),
                                    (2, "fp4", "does not store text_dtype 'fp4'"),
                                    (3, "int8", "format version 3")):
        manifest_path.write_text(json.dumps({**manifest, "version": version, "text_dtype": dtype}))
        with pytest.raises(ValueError, match=message) as err:
            load_manifest(folder)
        assert "\n" not in str(err.value)


def test_samples_whose_states_do_not_match_the_manifest_are_counted_bad(features, tmp_path):
    """int8 features in which one sample holds float16 states and one lost its scale member: both are skipped
    and counted, and their places go to good samples."""
    folder = tmp_path / "mixed"
    shutil.copytree(features["int8"], folder)
    good = PrecomputedShards(folder, index_dir=tmp_path / "index0")
    # the first shard's members, copied out: raw() views a buffer that its next call reuses
    members = [{k: v if k.startswith("__") else bytes(v) for k, v in good.raw(i).items()} for i in range(6)]
    rows = []
    for i, raw in enumerate(members):
        row = {k: v for k, v in raw.items() if not k.startswith("__")}
        if i == 1:
            row[TEXT_MEMBER] = npy_bytes(np.zeros((2, 64), np.float16))
            row.pop(TEXT_SCALE_MEMBER)
        if i == 4:
            row.pop(TEXT_SCALE_MEMBER)
        rows.append({"__key__": raw["__key__"], **row})
    shard = sorted(folder.glob("*.tar"))[0]
    write_tar(shard, rows)
    ds = PrecomputedShards(folder, index_dir=tmp_path / "index1")
    keys = [ds[i]["key"] for i in range(len(ds))]
    assert keys[1] == keys[2] and keys[4] == keys[5]  # each bad one replaced by its next good sample
    assert ds.stats.bad == {BAD_PRECOMPUTED: 2}


# ---------------------------------------------------------------------------------------------------------------
# training: int8 states give the float16 loss curve, within run-to-run noise
# ---------------------------------------------------------------------------------------------------------------


def losses(out) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_training_on_int8_states_follows_the_float16_loss_curve(features, tmp_path):
    curves = {}
    for dtype, seed in (("float16", 0), ("int8", 0), ("float16", 1)):
        out = tmp_path / f"{dtype}-{seed}"
        assert run_main(train_args(out, features[dtype], "train.max_steps=24", "train.save_every=24",
                                   f"train.seed={seed}")) == 0
        curves[dtype, seed] = np.array(losses(out))
    assert all(len(c) == 24 for c in curves.values())
    compact_vs_half = np.abs(curves["int8", 0] - curves["float16", 0]).mean()
    seed_vs_seed = np.abs(curves["float16", 1] - curves["float16", 0]).mean()
    assert compact_vs_half < 0.1 * seed_vs_seed, (compact_vs_half, seed_vs_seed)
