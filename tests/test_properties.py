"""Property-based tests (hypothesis, derandomized so every run tries the same examples):

- the config override parser applies every valid value exactly, in the spellings users write, and answers any
  garbage with a one-line `ConfigError`;
- both tar readers (indexed and streaming), fed a real shard set that was truncated, had bytes flipped or garbage
  appended, raise nothing but their documented one-line errors and still deliver every sample that lies entirely
  before the damage.
"""

from __future__ import annotations

import dataclasses
import datetime
import io
import itertools
import json
import os
import shutil
import string
import tarfile
import tempfile
import typing

import pytest
import torch
import yaml
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from PIL import Image

from data.index import load_or_build_index
from data.indexed import make_indexed_loader
from data.read_spec import ReadSpec
from data.sources import ShardsSource
from data.streaming import make_image_text_loader
from data.settings import BALANCE_RULES
from imba.training.config import CHOICES, KIND_RANGES, KIND_SETTINGS, RANGES, Config, ConfigError, load_config
from shard_helpers import encode, write_tar

CONFIG_SETTINGS = settings(max_examples=300, deadline=None, derandomize=True, database=None)
READER_SETTINGS = settings(max_examples=100, deadline=None, derandomize=True, database=None,
                           suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------------------------------------------------------
# the override parser
# ---------------------------------------------------------------------------------------------------------------


def _fields() -> tuple[dict[str, typing.Any], dict[str, str]]:
    """('section.key' -> type hint, for every key of the config; a kind setting's 'section.key.setting' -> the
    first kind that reads it)."""
    out, kind_of = {}, {}
    for section in dataclasses.fields(Config):
        if section.name in Config.KINDS:  # a kind section: each kind's settings, under the first kind that reads it
            for kind, rule in Config.KINDS[section.name].items():
                for g in dataclasses.fields(rule):
                    out.setdefault(f"{section.name}.{g.name}", typing.get_type_hints(rule)[g.name])
                    kind_of.setdefault(f"{section.name}.{g.name}", kind)
            continue
        hints = typing.get_type_hints(section.default_factory)
        for f in dataclasses.fields(section.default_factory):
            out[f"{section.name}.{f.name}"] = hints[f.name]
            for kind, rule in getattr(section.default_factory, "KINDS", {}).get(f.name, {}).items():
                for g in dataclasses.fields(rule):
                    key = f"{section.name}.{f.name}.{g.name}"
                    out.setdefault(key, typing.get_type_hints(rule)[g.name])
                    kind_of.setdefault(key, kind)
    return out, kind_of


FIELDS, KIND_OF = _fields()
BOOLS = {"true": True, "True": True, "TRUE": True, "yes": True, "on": True,
         "false": False, "False": False, "FALSE": False, "no": False, "off": False}
# Names of folders, hub ids, revisions, captions: no spaces, quotes or comment signs, which YAML would read
# as something other than the plain text.
NAME_CHARS = string.ascii_letters + string.digits + "._/-:+~@%!&*=," + "éß中"


def _plain_scalar(text: str, flow: bool = False) -> bool:
    """True when YAML reads `text` (inside a flow list when `flow`) as one scalar that is not null: a string equal
    to the text, or a number, bool or date (which a str key takes as written)."""
    try:
        value = yaml.safe_load(f"[{text}]" if flow else text)
    except yaml.YAMLError:
        return False
    if flow:
        if not isinstance(value, list) or len(value) != 1:
            return False
        value = value[0]
    if isinstance(value, str):
        return value == text
    return isinstance(value, (int, float, bool, datetime.date))


names = st.text(NAME_CHARS, min_size=1, max_size=24).filter(_plain_scalar)
list_items = st.text(NAME_CHARS.replace(",", ""), min_size=1, max_size=16).filter(
    lambda s: _plain_scalar(s) and _plain_scalar(s, flow=True))


def _float_spellings(x: float) -> list[str]:
    """Ways a user writes about x: repr, scientific notation (both cases, short exponents, no mantissa dot, a bare
    leading dot), a leading +, a trailing dot."""
    mantissa, exponent = f"{x:.6e}".split("e")
    sign, digits = ("-", mantissa[1:]) if mantissa.startswith("-") else ("", mantissa)
    short = digits.rstrip("0").rstrip(".")
    out = [repr(x), f"{x:.6e}", f"{x:.6E}", f"{sign}{short}e{int(exponent)}", f"{sign}{short}E{int(exponent)}",
           f"{sign}.{digits.replace('.', '')}e{int(exponent) + 1}", f"{x:.17g}"]
    if x >= 0:
        out += [f"+{short}e{int(exponent)}", f"+{x!r}"]
    if x == int(x) and abs(x) < 1e15:
        out += [f"{int(x)}.", str(int(x))]
    return out


def _bounds(key: str) -> tuple[float, float, bool, bool]:
    r = KIND_RANGES.get(key, {}).get(KIND_OF[key]) if key in KIND_OF else RANGES.get(key)
    if r is None:
        return -1e6, 1e6, False, False
    high = 1e6 if r.high is None else r.high
    return r.low, high, r.low_open, r.high_open


@st.composite
def valid_override(draw) -> tuple[str, str, typing.Any]:
    """(key, text written after `key=`, the value the config must then hold)."""
    key = draw(st.sampled_from(sorted(FIELDS)))
    hint = FIELDS[key]
    if key == "data.balance":  # cap is valid only with its threshold, another key
        value = draw(st.sampled_from([c for c in CHOICES[key] if c != "cap"]))
        return key, value, BALANCE_RULES[value]()
    if key in CHOICES:  # model.encoder_dtype=float16 is refused (T5 overflows in float16: test_half_precision.py)
        value = draw(st.sampled_from([c for c in CHOICES[key] if (key, c) != ("model.encoder_dtype", "float16")]))
        return key, value, value
    if key in KIND_OF:  # a kind's own setting with choices
        owner, name = key.rsplit(".", 1)
        allowed = KIND_SETTINGS[owner][KIND_OF[key]].CHOICES.get(name)
        if allowed is not None:
            value = draw(st.sampled_from(allowed))
            return key, value, value
    if key == "data.sources":
        shards = draw(st.lists(st.text(string.ascii_letters + string.digits + "_/.-", min_size=1, max_size=16)
                               .filter(_plain_scalar), min_size=1, max_size=3, unique=True))
        share = draw(st.sampled_from(["", ", share: 0.5", ", repeat: 2", ", choose: 7"]))
        text = "[" + ", ".join(f"{{shards: {x}{share}}}" for x in shards) + "]"
        weight = {"": {}, ", share: 0.5": {"share": 0.5}, ", repeat: 2": {"repeat": 2.0}, ", choose: 7": {"choose": 7}}
        return key, text, [ShardsSource(shards=x, **weight[share]) for x in shards]
    named = {"train.trackers": ["none", "tensorboard", "tensorboard,wandb", "all"],
             "objective.beta_schedule": ["linear", "scaled_linear", "squaredcos_cap_v2"],
             "data.cache_limit": ["0", "200GB", "500 MiB", "1.5kb", "7"]}
    if key in named:
        value = draw(st.sampled_from(named[key]))
        return key, value, value
    if key == "loss.lam":
        low, high, low_open, high_open = 0.0, 1.0, False, False
    elif key == "loss.gamma":
        low, high, low_open, high_open = 0.0, 1e6, False, False
    elif key == "objective.beta_start":  # must not exceed the default beta_end, 0.02
        low, high, low_open, high_open = 0.0, 0.02, True, False
    elif key == "objective.beta_end":  # must not fall below the default beta_start, 1e-4
        low, high, low_open, high_open = 1e-4, 1.0, False, True
    else:
        low, high, low_open, high_open = _bounds(key)
    if hint is bool:
        text = draw(st.sampled_from(sorted(BOOLS)))
        return key, text, BOOLS[text]
    if hint is int:
        first = int(low) + (1 if low_open else 0)
        last = min(int(high) - (1 if high_open else 0), first + 10**12)
        value = draw(st.integers(first, last))
        return key, str(value), value
    if hint is float:
        x = draw(st.floats(low, high, exclude_min=low_open, exclude_max=high_open, allow_nan=False,
                           allow_infinity=False, allow_subnormal=False))
        text = draw(st.sampled_from(_float_spellings(x)))
        value = float(text)
        assume(low < value if low_open else low <= value)
        assume(value < high if high_open else value <= high)
        return key, text, value
    if hint == list[str]:
        items = draw(st.lists(list_items, min_size=1, max_size=4))
        return key, f"[{', '.join(items)}]", items
    if hint == str | None and draw(st.booleans()):
        return key, draw(st.sampled_from(["null", "~", "Null"])), None
    text = draw(st.one_of(names, st.sampled_from(["1e4", "1.10", "010", "0x1F", "no", "2024-01-01", "1:30"])))
    return key, text, text


@CONFIG_SETTINGS
@given(valid_override())
def test_valid_values_are_applied_exactly(override):
    key, text, value = override
    # settings valid only beside another: LoRA adapts trained weights, min-SNR weights ε-prediction
    needs = {"model.lora_rank": ["model.pretrained=some/export"], "loss.min_snr_gamma": ["objective.kind=ddpm"]}
    for key_of_kind, kind in KIND_OF.items():  # a kind's own setting: that kind first
        needs[key_of_kind] = [f"{key_of_kind.rsplit('.', 1)[0]}={kind}", *needs.get(key_of_kind, [])]
    cfg = load_config([*needs.get(key, []), f"{key}={text}"])
    got = cfg
    for name in key.split("."):
        got = getattr(got, name)
    if key == "model.max_text_tokens" and value == 0:  # 0: the text encoder's own length (tiny-words: 16)
        value = 16
    assert got == value and type(got) is type(value), (key, text)


@CONFIG_SETTINGS
@given(st.lists(st.one_of(
    st.tuples(st.sampled_from(sorted(FIELDS)), st.text(max_size=40)).map("=".join),  # a real key, any value
    st.tuples(st.text(max_size=20), st.text(max_size=20)).map("=".join),  # any key, any value
    st.sampled_from(sorted(FIELDS)).map(lambda k: f"{k}=[[[[{{x: [1, 2e-4]}}]]]]"),
    st.text(max_size=30),  # no '=' at all
    st.sampled_from(["--config", "--resume", "--config=", "--config=/no/such/file.yaml"]),
), max_size=4))
def test_garbage_overrides_give_one_line_config_errors(argv):
    try:
        load_config(argv)
    except ConfigError as err:
        assert "\n" not in str(err) and str(err)


@CONFIG_SETTINGS
@given(st.one_of(
    st.binary(max_size=200),
    st.text(max_size=200).map(lambda s: s.encode("utf-8", "surrogatepass")),
    st.dictionaries(st.sampled_from(["model", "data", "optim", "train", "x"]),
                    st.one_of(st.none(), st.integers(), st.text(max_size=10),
                              st.dictionaries(st.text(max_size=12), st.one_of(st.integers(), st.floats(),
                                                                              st.text(max_size=10)), max_size=3)),
                    max_size=3).map(lambda d: yaml.safe_dump(d).encode()),
))
def test_garbage_config_files_give_one_line_config_errors(content):
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "exp.yaml")
        with open(path, "wb") as f:
            f.write(content)
        try:
            load_config(["--config", path])
        except ConfigError as err:
            assert "\n" not in str(err) and str(err)


# ---------------------------------------------------------------------------------------------------------------
# the tar readers under damage
# ---------------------------------------------------------------------------------------------------------------

RES = 8


def _image(i: int, fmt: str) -> bytes:
    return encode(Image.new("RGB", (14 + i, 10), (40 * i % 256, 90, 200)), fmt)


def _samples(prefix: str) -> list[dict]:
    """jpg/png images with txt and/or json captions."""
    return [
        {"__key__": f"{prefix}0", "jpg": _image(0, "JPEG"), "txt": f"{prefix} zero".encode()},
        {"__key__": f"{prefix}1", "png": _image(1, "PNG"), "json": json.dumps({"caption": f"{prefix} one"}).encode()},
        {"__key__": f"{prefix}2", "png": _image(2, "PNG"), "txt": f"{prefix} two".encode(),
         "json": json.dumps({"caption": "unused", "width": 16}).encode()},
        {"__key__": f"{prefix}3", "jpg": _image(3, "JPEG"),
         "json": json.dumps({"caption": f"{prefix} three"}).encode()},
        {"__key__": f"{prefix}4", "png": _image(4, "PNG"), "txt": f"{prefix} four".encode()},
    ]


def _sample_ends(blob: bytes) -> dict[str, int]:
    """key -> byte offset just past the sample's last member (its data and padding) in the tar `blob`."""
    ends = {}
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r:") as tf:
        for info in tf:
            ends[info.name.split(".", 1)[0]] = info.offset_data + ((info.size + 511) & ~511)
    return ends


class CleanSet(tuple):
    """(shards: {name: (tar bytes, {key: end offset})}, clean: {key: (caption, pixels)})."""

    def __repr__(self) -> str:  # hypothesis prints the fixture with a failing example
        return "<clean shards a.tar, b.tar>"


@pytest.fixture(scope="module")
def clean_set(tmp_path_factory):
    """Two shards: their bytes, each sample's end offset, and what a reader gives for each intact sample."""
    folder = tmp_path_factory.mktemp("clean")
    shards = {}
    for name in ("a", "b"):
        path = write_tar(folder / f"{name}.tar", _samples(name))
        with open(path, "rb") as f:
            blob = f.read()
        shards[name] = (blob, _sample_ends(blob))
    loader = make_image_text_loader([str(folder / "a.tar"), str(folder / "b.tar")],
                                    ReadSpec(resolution=RES, batch_size=1, shuffle_buffer=0), resampled=False)
    clean = {b["keys"][0]: (b["captions"][0], b["pixels"][0]) for b in loader}
    assert sorted(clean) == ["a0", "a1", "a2", "a3", "a4", "b0", "b1", "b2", "b3", "b4"]
    return CleanSet((shards, clean))


@st.composite
def damage(draw, ends: list[int], size: int) -> tuple[str, list[tuple[int, bytes]], int | None]:
    """(what, [(offset, bytes written there)], truncate at): one kind of damage to a file of `size` bytes whose
    samples end at `ends`. Offsets fall in a sample (or the end blocks) chosen first, so every sample position is
    hit about as often."""
    bounds = [0, *ends, size]

    def offset():
        region = draw(st.integers(0, len(bounds) - 2))
        return draw(st.integers(bounds[region], bounds[region + 1] - 1))

    kind = draw(st.sampled_from(["truncate", "flip", "append", "truncate+append", "overwrite"]))
    garbage = st.binary(min_size=1, max_size=1500)
    if kind == "truncate":
        return kind, [], offset()
    if kind == "append":
        return kind, [(size, draw(garbage))], None
    if kind == "truncate+append":  # an interrupted write followed by junk
        cut = offset()
        return kind, [(cut, draw(garbage))], cut
    if kind == "flip":
        offsets = sorted({offset() for _ in range(draw(st.integers(1, 4)))})
        return kind, [(o, bytes([draw(st.integers(1, 255))])) for o in offsets], None
    return kind, [(offset(), draw(st.binary(min_size=1, max_size=64)))], None


def _apply_damage(blob: bytes, edits: list[tuple[int, bytes]], cut: int | None, kind: str) -> tuple[bytes, int]:
    """The damaged bytes and the first offset at which they differ from `blob` (len(blob) if nowhere)."""
    data = bytearray(blob if cut is None else blob[:cut])
    for offset, chunk in edits:
        if kind == "flip":
            data[offset] ^= chunk[0]
        else:
            data[offset:offset + len(chunk)] = chunk
    common = min(len(data), len(blob))
    return bytes(data), next((i for i in range(common) if data[i] != blob[i]), common)


@st.composite
def damaged_set(draw, clean_set):
    shards, _ = clean_set
    target = draw(st.sampled_from(sorted(shards)))
    blob, ends = shards[target]
    kind, edits, cut = draw(damage(sorted(ends.values()), len(blob)))
    with_intact = draw(st.booleans())  # the other shard next to it (the damaged one first or last)
    first = draw(st.booleans())
    return target, kind, edits, cut, with_intact, first


def _write_damaged(folder: str, clean_set, case) -> tuple[list[str], set[str]]:
    """Write the shard set of `case` into `folder`; return its paths and the keys that must be delivered."""
    shards, _ = clean_set
    target, kind, edits, cut, with_intact, first = case
    blob, ends = shards[target]
    damaged, at = _apply_damage(blob, edits, cut, kind)
    paths, expected = [], {key for key, end in ends.items() if end <= at}
    with open(os.path.join(folder, f"{target}.tar"), "wb") as f:
        f.write(damaged)
    paths.append(os.path.join(folder, f"{target}.tar"))
    if with_intact:
        other = "b" if target == "a" else "a"
        with open(os.path.join(folder, f"{other}.tar"), "wb") as f:
            f.write(shards[other][0])
        paths.insert(len(paths) if first else 0, os.path.join(folder, f"{other}.tar"))
        expected |= set(shards[other][1])
    return paths, expected


def _check_delivered(delivered: dict, expected: set[str], clean: dict) -> None:
    assert expected <= set(delivered), f"lost {sorted(expected - set(delivered))}"
    for key in expected:
        caption, pixels = delivered[key]
        assert caption == clean[key][0] and torch.equal(pixels, clean[key][1]), key


def _one_line(err: BaseException) -> None:
    assert str(err) and "\n" not in str(err), repr(err)


@READER_SETTINGS
@given(data=st.data())
def test_indexed_reader_survives_damaged_shards(clean_set, data):
    case = data.draw(damaged_set(clean_set))
    folder = tempfile.mkdtemp()
    try:
        paths, expected = _write_damaged(folder, clean_set, case)
        try:
            index = load_or_build_index(paths)
            assert len(index) >= len(expected)
            loader = make_indexed_loader(paths, ReadSpec(resolution=RES, batch_size=1))
            delivered = {b["keys"][0]: (b["captions"][0], b["pixels"][0])
                         for b in itertools.islice(loader, loader.batches_per_epoch)}
        except (ValueError, RuntimeError) as err:  # no samples indexed / none usable: documented one-liners
            _one_line(err)
            # garbage that starts like gzip/bzip2/xz/zstd makes the shard a compressed one, which indexed mode
            # refuses as a whole (a documented refusal: data.index)
            if "-compressed: decompress it or use data.mode=streaming" in str(err):
                assert f"{case[0]}.tar" in str(err)
                return
            assert not expected, f"{err!r} although {sorted(expected)} lie before the damage"
            return
        _check_delivered(delivered, expected, clean_set[1])
    finally:
        shutil.rmtree(folder)


@READER_SETTINGS
@given(data=st.data())
def test_streaming_reader_survives_damaged_shards(clean_set, data):
    case = data.draw(damaged_set(clean_set))
    folder = tempfile.mkdtemp()
    try:
        paths, expected = _write_damaged(folder, clean_set, case)
        loader = make_image_text_loader(paths, ReadSpec(resolution=RES, batch_size=1, shuffle_buffer=0),
                                        resampled=False)
        try:
            delivered = {b["keys"][0]: (b["captions"][0], b["pixels"][0]) for b in loader}
        except RuntimeError as err:  # "no usable sample after N failures": documented, one line
            assert not expected, f"{err!r} although {sorted(expected)} lie before the damage"
            _one_line(err)
            return
        _check_delivered(delivered, expected, clean_set[1])
    finally:
        shutil.rmtree(folder)
