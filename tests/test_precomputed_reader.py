"""The precomputed reader's promises at their edges: recycled batch memory never hands out a region while any tensor
of its batch lives (the first, the last, the only one), reader threads yield the sampler's order through copies of
the dataset, and a batch packs each sample's stored bytes, refusing a sample the manifest does not describe."""

import gc
import io
import threading

import numpy as np
import pytest
import torch

from data.precomputed import (
    BAD_PRECOMPUTED,
    LATENT_MEMBER,
    TEXT_MEMBER,
    TEXT_SCALE_MEMBER,
    PrecomputedShards,
    _RecycledMemory,
    _ThreadedBatches,
    npy_bytes,
    unpack_batch,
)
from data.skips import ReaderStats
from data.text_states import encode_states
from shard_helpers import write_tar

# ---------------------------------------------------------------------------------------------------------------
# recycled batch memory
# ---------------------------------------------------------------------------------------------------------------

SPECS = [((2, 3, 4, 4), torch.float16), ((5, 8), torch.int8), ((5,), torch.float32)]


def _batch(memory, fill):
    tensors = memory.tensors(SPECS)
    for t in tensors:
        t.fill_(fill)
    return tensors


@pytest.mark.parametrize("kept", [0, 1, 2])
def test_one_kept_tensor_of_a_batch_keeps_its_region(kept):
    """Keep the first (the latents), a middle or the last tensor of a batch and drop the rest: later batches of the
    same size must not be made in its memory."""
    memory = _RecycledMemory()
    tensors = _batch(memory, 7)
    survivor = tensors[kept]
    del tensors
    gc.collect()
    for fill in range(10):  # more batches than regions are kept
        _batch(memory, fill)
    assert bool((survivor == 7).all())


def test_a_view_of_a_kept_tensor_keeps_its_region():
    memory = _RecycledMemory()
    view = _batch(memory, 7)[0][1:]  # a view alone: the batch's tensors themselves are gone
    gc.collect()
    for fill in range(10):
        _batch(memory, fill)
    assert bool((view == 7).all())


def test_a_region_is_reused_once_every_tensor_of_its_batch_is_gone():
    memory = _RecycledMemory()
    first = memory.tensors(SPECS)
    pointer = first[0].data_ptr()
    del first
    gc.collect()
    again = memory.tensors(SPECS)  # exactly the same size: the freed region fits
    assert again[0].data_ptr() == pointer
    smaller = [((1, 3, 4, 4), torch.float16)]
    del again
    gc.collect()
    assert memory.tensors(smaller)[0].data_ptr() == pointer  # a smaller batch fits in it too


def test_a_batch_exactly_the_size_of_a_free_region_reuses_it():
    memory = _RecycledMemory()
    first = memory.tensors(SPECS)
    pointer, region_bytes = first[0].data_ptr(), len(memory._regions[0][0])
    del first
    gc.collect()
    assert memory.tensors([((region_bytes,), torch.uint8)])[0].data_ptr() == pointer


def test_a_region_too_small_is_not_reused():
    memory = _RecycledMemory()
    small = memory.tensors([((16,), torch.float32)])
    pointer = small[0].data_ptr()
    del small
    gc.collect()
    big = memory.tensors([((4 << 20,), torch.uint8)])  # far beyond the first region and its headroom
    assert big[0].data_ptr() != pointer and big[0].numel() == 4 << 20
    big[0].fill_(1)  # writable across its whole length


def test_tensors_have_their_specs_are_aligned_and_do_not_overlap():
    memory = _RecycledMemory()
    specs = [((3,), torch.float16), ((0, 8), torch.int8), ((5, 7), torch.int8), ((1,), torch.float64)]
    tensors = memory.tensors(specs)
    assert [(tuple(t.shape), t.dtype) for t in tensors] == [(s, d) for s, d in specs]
    spans = []
    for t in tensors:
        if t.numel():
            assert t.data_ptr() % 64 == 0
            spans.append((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()))
    spans.sort()
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
    for k, t in enumerate(tensors):  # each tensor holds what was written into it, none another's
        t.fill_(k + 1)
    assert [bool((t == k + 1).all()) for k, t in enumerate(tensors)] == [True] * 4


@pytest.mark.parametrize("specs", [
    [((5000,), torch.uint8), ((10,), torch.uint8)],  # a size just past a multiple of 64 bytes
    [((8,), torch.uint8), ((100_000,), torch.uint8), ((3,), torch.int16)],  # the region must hold every tensor
])
def test_large_and_small_tensors_get_disjoint_whole_spans(specs):
    tensors = _RecycledMemory().tensors(specs)
    for k, t in enumerate(tensors):
        assert t.numel() == int(np.prod(specs[k][0]))
        t.fill_(k + 1)
    assert [bool((t == k + 1).all()) for k, t in enumerate(tensors)] == [True] * len(specs)


def test_batches_kept_beyond_the_remembered_regions_stay_intact():
    memory = _RecycledMemory(keep=2)
    kept = [_batch(memory, fill) for fill in range(5)]  # the oldest regions are forgotten while still in use
    for fill in range(5, 10):
        _batch(memory, fill)
    for fill, tensors in enumerate(kept):
        assert all(bool((t == fill).all()) for t in tensors)


# ---------------------------------------------------------------------------------------------------------------
# reader threads
# ---------------------------------------------------------------------------------------------------------------

_CALLS: list[tuple[int, int]] = []  # (dataset copy's id, thread id) of each fetch, shared by every copy


class _Numbers:
    """A picklable stand-in for the dataset: a batch is its indices squared, and says who made it."""

    def __init__(self, fail_at: int | None = None):
        self.stats = ReaderStats()
        self.fail_at = fail_at

    def __len__(self):
        return 100

    def get_batch(self, indices, size=None):
        if self.fail_at in indices:
            raise OSError(f"cannot read sample {self.fail_at}")
        _CALLS.append((id(self), threading.get_ident()))
        return {"values": [i * i for i in indices], "maker": id(self)}


@pytest.mark.parametrize("threads,batches", [(1, 0), (1, 1), (2, 4), (3, 7), (2, 30)])
def test_threads_yield_the_samplers_order_through_their_own_copies(threads, batches):
    dataset = _Numbers()
    order = [[b, b + 100] for b in range(batches)]
    _CALLS.clear()
    got = list(_ThreadedBatches(dataset, order, threads))
    assert [b["values"] for b in got] == [[b * b, (b + 100) ** 2] for b in range(batches)]
    assert all(b["_bad"] == {} for b in got)
    makers = {maker: thread for maker, thread in _CALLS}
    assert id(dataset) not in makers and len(makers) <= threads
    assert len(set(makers.values())) == len(makers)  # one copy per thread
    for maker in makers:
        assert {thread for m, thread in _CALLS if m == maker} == {makers[maker]}


_MEETING = threading.Barrier(2, timeout=120)


class _Meeting(_Numbers):
    """Its first two batches wait for each other: made one at a time, the wait breaks."""

    def get_batch(self, indices, size=None):
        if indices[0] < 2:
            _MEETING.wait()
        return super().get_batch(indices, size)


class _Counted:
    """A sampler that counts the batches drawn from it; `limit` None: endless, as the real sampler is."""

    def __init__(self, limit=None):
        self.drawn, self.limit = 0, limit

    def __iter__(self):
        while self.limit is None or self.drawn < self.limit:
            self.drawn += 1
            yield [self.drawn - 1]


class _Named(_Numbers):
    def get_batch(self, indices, size=None):
        batch = super().get_batch(indices, size)
        batch["thread"] = threading.current_thread().name
        return batch


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_at_most_two_batches_per_thread_are_drawn_ahead_of_the_consumer(threads):
    sampler = _Counted()
    batches = iter(_ThreadedBatches(_Named(), sampler, threads))
    for i in range(6):
        batch = next(batches)
        assert batch["values"] == [i * i] and batch["thread"].startswith("imba-reader")
        assert sampler.drawn == 2 * threads + i + 1  # the batches in flight, and the one that replaced batch i
    batches.close()


def test_two_threads_read_two_batches_at_the_same_time():
    _MEETING.reset()
    got = list(_ThreadedBatches(_Meeting(), [[i] for i in range(6)], 2))
    assert [b["values"] for b in got] == [[i * i] for i in range(6)]


def test_a_failed_read_reaches_the_consumer_and_stopping_early_ends_the_threads():
    with pytest.raises(OSError, match="cannot read sample 5"):
        list(_ThreadedBatches(_Numbers(fail_at=5), [[i] for i in range(10)], 2))
    batches = iter(_ThreadedBatches(_Numbers(), [[i] for i in range(50)], 3))
    assert next(batches)["values"] == [0]
    batches.close()  # the consumer stops after one batch: the pool is shut down, its threads end
    assert not [t for t in threading.enumerate() if t.name.startswith("imba-reader")]


# ---------------------------------------------------------------------------------------------------------------
# packed batches of a hand-written precomputed shard
# ---------------------------------------------------------------------------------------------------------------

TOKENS, WIDTH, LATENT = 4, 8, [2, 3, 2, 2]


def _manifest(text_dtype):
    return {"resolution": 16, "caption_field": "caption", "latent_shape": LATENT, "text_dtype": text_dtype,
            "max_text_tokens": TOKENS, "text_hidden_size": WIDTH}


def _sample(key, n, text_dtype, rng, scale_value=None, width=WIDTH):
    states = torch.from_numpy(rng.standard_normal((n, width)).astype(np.float32))
    values, scale = encode_states(states, text_dtype)
    if scale_value is not None:
        scale = scale.copy()
        scale[-1] = scale_value
    sample = {"__key__": key, LATENT_MEMBER: npy_bytes(rng.standard_normal(LATENT).astype(np.float16)),
              TEXT_MEMBER: npy_bytes(values), "txt": f"caption {key}".encode()}
    if scale is not None:
        sample[TEXT_SCALE_MEMBER] = npy_bytes(scale)
    return sample


@pytest.mark.parametrize("text_dtype", ["int8", "float16", "bfloat16"])
def test_a_batch_packs_each_samples_tokens_in_order_and_unpacks_to_the_samples(tmp_path, text_dtype):
    rng = np.random.default_rng(0)
    # token counts: the only token, the closed upper bound (max_text_tokens), and in between
    lengths = [1, TOKENS, 2, TOKENS, 3]
    rows = [_sample(f"s{i}", n, text_dtype, rng) for i, n in enumerate(lengths)]
    shard = write_tar(tmp_path / "f-000000.tar", rows)
    manifest = _manifest(text_dtype)
    ds = PrecomputedShards([shard], manifest=manifest, index_dir=tmp_path / "index")
    assert len(ds) == 5
    order = [4, 0, 3]
    batch = ds.get_batch(order)
    assert batch["keys"] == ["s4", "s0", "s3"] and batch["captions"] == ["caption s4", "caption s0", "caption s3"]
    assert batch["text_lengths"].tolist() == [3, 1, TOKENS] and ds.stats.bad == {}
    assert batch["latent_moments"].dtype == torch.float16 and batch["latent_moments"].shape == (3, *LATENT)
    stored = {"int8": torch.int8, "float16": torch.float16, "bfloat16": torch.bfloat16}[text_dtype]
    assert batch["text_states"].dtype == stored and batch["text_states"].shape == (3 + 1 + TOKENS, WIDTH)
    assert ("text_scale" in batch) == (text_dtype == "int8")
    at = 0
    for row, i in enumerate(order):
        n = lengths[i]
        values = np.load(io.BytesIO(rows[i][TEXT_MEMBER]))
        packed = batch["text_states"][at:at + n]
        packed = packed.view(torch.int16).numpy().view(np.uint16) if text_dtype == "bfloat16" else packed.numpy()
        assert np.array_equal(packed, values)  # the stored bits, not their values converted
        if text_dtype == "int8":
            scale = np.load(io.BytesIO(rows[i][TEXT_SCALE_MEMBER]))
            assert np.array_equal(batch["text_scale"][at:at + n].numpy(), scale)
        latent = np.load(io.BytesIO(rows[i][LATENT_MEMBER]))
        assert np.array_equal(batch["latent_moments"][row].numpy(), latent)
        at += n
    unpacked = unpack_batch(batch, manifest)
    for row, i in enumerate(order):
        single = ds[i]
        assert torch.equal(unpacked["text_embeds"][row], single["text_embeds"])
        assert torch.equal(unpacked["text_mask"][row], single["text_mask"])
        assert single["text_mask"].tolist() == [1] * lengths[i] + [0] * (TOKENS - lengths[i])
        assert single["text_mask"].dtype == torch.int64 and unpacked["text_mask"].dtype == torch.int64
        assert torch.equal(unpacked["latent_mean"][row], single["latent_mean"])
        assert unpacked["latent_mean"].dtype == unpacked["text_embeds"].dtype == torch.float32
        assert torch.equal(unpacked["latent_logvar"][row], single["latent_logvar"])
    assert not torch.equal(unpacked["latent_mean"][0], unpacked["latent_logvar"][0])
    assert not batch["latent_moments"].is_shared()  # in this process: recycled memory, not shared memory


def test_a_batch_made_in_a_loader_worker_is_in_shared_memory(tmp_path, monkeypatch):
    rng = np.random.default_rng(2)
    shard = write_tar(tmp_path / "f-000000.tar", [_sample(f"s{i}", 2, "int8", rng) for i in range(3)])
    ds = PrecomputedShards([shard], manifest=_manifest("int8"), index_dir=tmp_path / "index")
    plain = ds.get_batch([0, 2])
    monkeypatch.setattr(torch.utils.data, "get_worker_info", lambda: object())  # as inside a DataLoader worker
    shared = ds.get_batch([0, 2])
    for name in ("latent_moments", "text_states", "text_scale"):
        assert shared[name].is_shared() and shared[name].dtype == plain[name].dtype
        assert torch.equal(shared[name], plain[name])


@pytest.mark.parametrize("bad,reason", [
    ("nan scale", "non-finite int8 scales"), ("inf scale", "non-finite int8 scales"),
    ("-inf scale", "non-finite int8 scales"), ("no tokens", "T5 states of shape (0, 8), expected (1..4, 8)"),
    ("too many tokens", "T5 states of shape (5, 8), expected (1..4, 8)"),
    ("wrong width", "T5 states of shape (2, 9), expected (1..4, 8)"), ("no caption", "no txt member"),
    ("latent float32", "latent is float32 (2, 3, 2, 2), expected float16 (2, 3, 2, 2)")])
def test_a_sample_the_manifest_does_not_describe_is_skipped_and_counted(tmp_path, caplog, bad, reason):
    rng = np.random.default_rng(1)
    rows = [_sample(f"s{i}", 2, "int8", rng) for i in range(3)]
    broken = {"nan scale": lambda: _sample("s1", 3, "int8", rng, scale_value=np.nan),
              "inf scale": lambda: _sample("s1", 3, "int8", rng, scale_value=np.inf),
              "-inf scale": lambda: _sample("s1", 3, "int8", rng, scale_value=-np.inf),
              "no tokens": lambda: _sample("s1", 0, "int8", rng),
              "too many tokens": lambda: _sample("s1", TOKENS + 1, "int8", rng),
              "wrong width": lambda: _sample("s1", 2, "int8", rng, width=WIDTH + 1)}
    if bad in broken:
        rows[1] = broken[bad]()
    elif bad == "no caption":
        del rows[1]["txt"]
    else:
        rows[1][LATENT_MEMBER] = npy_bytes(rng.standard_normal(LATENT).astype(np.float32))
    shard = write_tar(tmp_path / "f-000000.tar", rows)
    ds = PrecomputedShards([shard], manifest=_manifest("int8"), index_dir=tmp_path / "index")
    with caplog.at_level("WARNING"):
        assert ds.get_batch([0, 1, 2])["keys"] == ["s0", "s2", "s2"]  # the bad one's place goes to the next one
    assert ds.stats.bad == {BAD_PRECOMPUTED: 1} and ds.stats.good == 3
    assert f":s1: {BAD_PRECOMPUTED} ValueError({reason!r})" in caplog.text  # which sample, and what is wrong


# ---------------------------------------------------------------------------------------------------------------
# decoding a stream of raw samples, and .npy members
# ---------------------------------------------------------------------------------------------------------------


def test_the_decoder_skips_a_bad_sample_names_it_and_goes_on(caplog):
    from data.precomputed import _DecodePrecomputed
    from data.skips import MAX_FAILURES_BEFORE_FIRST_SAMPLE, NoUsableSamples

    rng = np.random.default_rng(3)
    good = [dict(_sample(f"g{i}", 2, "int8", rng), __url__="shard-a.tar") for i in range(2)]
    bad = dict(_sample("b0", 2, "int8", rng), __url__="shard-a.tar")
    del bad["txt"]
    stats = ReaderStats()
    decode = _DecodePrecomputed(_manifest("int8"), stats)
    with caplog.at_level("WARNING"):
        keys = [s["key"] for s in decode(iter([good[0], bad, good[1]]))]
    assert keys == ["g0", "g1"] and stats.good == 2 and stats.bad == {BAD_PRECOMPUTED: 1}
    assert stats.failures_in_a_row == 0  # a good sample after a bad one resets the count
    assert "skipping shard-a.tar:b0: bad precomputed sample ValueError('no txt member')" in caplog.text
    nameless = {k: v for k, v in bad.items() if k not in ("__url__", "__key__")}
    with caplog.at_level("WARNING"):
        assert list(decode(iter([nameless]))) == []
    assert "skipping ?:?: bad precomputed sample" in caplog.text  # neither shard nor key known: said so
    stats = ReaderStats()  # nothing good yet: the reader gives up after so many bad ones, naming the last
    with pytest.raises(NoUsableSamples, match=r"last: bad precomputed sample at shard-a.tar:b0\)"):
        list(_DecodePrecomputed(_manifest("int8"), stats)(iter([bad] * MAX_FAILURES_BEFORE_FIRST_SAMPLE)))


@pytest.mark.parametrize("version", [(1, 0), (2, 0)])
def test_npy_members_of_both_header_versions_are_read_without_np_load(monkeypatch, version):
    from data.precomputed import load_npy

    array = np.arange(12, dtype=np.float16).reshape(3, 4)
    buf = io.BytesIO()
    np.lib.format.write_array(buf, array, version=version)
    data = bytearray(buf.getvalue())
    monkeypatch.setattr(np, "load", lambda *a, **k: pytest.fail("np.load used for a plain .npy member"))
    copied = load_npy(data)
    assert np.array_equal(copied, array) and copied.flags.writeable
    view = load_npy(data, copy=False)
    data[-2:] = np.float16(99).tobytes()  # the view reads the member's bytes themselves
    assert view[2, 3] == 99 and copied[2, 3] == 11
    fortran = io.BytesIO()
    np.lib.format.write_array(fortran, np.asfortranarray(array), version=version)
    assert np.array_equal(load_npy(fortran.getvalue()), array)
