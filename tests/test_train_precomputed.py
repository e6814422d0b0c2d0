"""Training on precomputed shards: no VAE or T5 is loaded for the steps, the config is checked against the features,
and the run resumes and exports like an image run."""

import json
import os
import re
import signal

import pytest
from accelerate.state import AcceleratorState

import train
from data.precompute import PrecomputeSettings, precompute_shards
from data.synthetic import write_synthetic_shards
from imba.training.config import ConfigError
from models.encoders import FrozenEncoders

RES, TOKENS = 32, 16


@pytest.fixture(scope="module")
def precomputed(tmp_path_factory):
    raw = tmp_path_factory.mktemp("raw")
    shards = write_synthetic_shards(str(raw), num_samples=12, samples_per_shard=6, resolution=RES, seed=1)
    out = tmp_path_factory.mktemp("features")
    precompute_shards(shards, out, PrecomputeSettings(resolution=RES, max_text_tokens=TOKENS), batch_size=4)
    return out


def run_main(argv):
    """`train.main` in this process. It must give back the signal handlers it installed (pre-emption); the
    accelerate state it made is reset here, so later tests start from none."""
    before = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGTERM)}
    try:
        return train.main(argv)
    finally:
        after = {s: signal.getsignal(s) for s in before}
        AcceleratorState._reset_state(reset_partial_state=True)
        assert after == before, "train.main left its signal handlers installed"


def args(out, features, *extra):
    return [f"data.shards={features}", f"train.output_dir={out}", f"data.resolution={RES}",
            f"model.max_text_tokens={TOKENS}", "model.text_encoder=tiny", "data.batch_size=2", "train.log_every=1",
            "train.save_every=2", "train.sample_every=0", "sample.steps=2", "sample.prompts=[a red circle]",
            "train.trackers=none", "optim.warmup_steps=1", *extra]  # the features' encoders: precompute's defaults


@pytest.mark.slow
def test_training_on_precomputed_features_loads_the_encoders_only_to_sample(precomputed, tmp_path, monkeypatch):
    out = tmp_path / "run"
    loads = []
    real_load = FrozenEncoders.load.__func__

    def counting_load(cls, *a, **k):
        # when the encoders are loaded, the final checkpoint must already exist: training did not need them
        loads.append(sorted(p.name for p in (out / "checkpoints").glob("step_*")))
        return real_load(cls, *a, **k)

    monkeypatch.setattr(FrozenEncoders, "load", classmethod(counting_load))
    assert run_main(args(out, precomputed, "train.max_steps=2")) == 0
    assert loads == [["step_0000002"]]  # once, after the last step, for the grid and the export
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["loss"] > 0 for r in rows)
    assert (out / "export" / "model_index.json").is_file() and (out / "samples" / "step_0000002.png").is_file()

    # resume continues from the checkpoint over the same precomputed data
    loads.clear()
    assert run_main(args(out, precomputed, "train.max_steps=4")) == 0
    assert loads == [["step_0000002", "step_0000004"]]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]


def test_a_config_that_does_not_match_the_features_is_refused(precomputed, tmp_path):
    with pytest.raises(ConfigError, match="resolution=64 wanted, 32 precomputed"):
        run_main(args(tmp_path / "run", precomputed, "data.resolution=64"))


@pytest.mark.slow
def test_reader_threads_train_exactly_as_the_training_process_reading_alone(precomputed, tmp_path):
    runs = {}
    for threads in (0, 2):
        out = tmp_path / f"threads{threads}"
        assert run_main(args(out, precomputed, "train.max_steps=3", f"data.loader_threads={threads}")) == 0
        runs[threads] = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert runs[2] == runs[0] and len(runs[0]) == 3


def test_reader_threads_are_refused_for_image_shards_and_with_worker_processes(precomputed, tmp_path):
    with pytest.raises(ConfigError, match="loader_threads=2 needs precomputed features.*these shards are images"):
        run_main([f"train.output_dir={tmp_path / 'run'}", "data.resolution=32", "data.synthetic_samples=8",
                  "data.precompute=false", "data.batch_size=4", "data.loader_threads=2", "train.max_steps=1",
                  "train.trackers=none"])
    with pytest.raises(ConfigError, match="loader_threads=1 needs precomputed features and data.num_workers=0"):
        run_main(args(tmp_path / "run2", precomputed, "data.loader_threads=1", "data.num_workers=1",
                      "train.max_steps=1"))


def test_bucketing_is_refused_on_precomputed_features(precomputed, tmp_path):
    with pytest.raises(ConfigError, match="precomputed latents have one fixed size"):
        run_main(args(tmp_path / "run", precomputed, "data.bucketing=true", "train.max_steps=1"))


def test_bad_precomputed_samples_are_skipped_counted_and_substituted_deterministically(precomputed, tmp_path):
    """A wrong-dtype latent, a truncated latent .npy, a missing t5.npy and a shard rewritten after indexing: the
    reader delivers only good samples, counts each bad one under its reason, and substitutes the same way twice."""
    import shutil

    import numpy as np
    import webdataset as wds

    from data.precomputed import BAD_PRECOMPUTED, LATENT_MEMBER, TEXT_MEMBER, PrecomputedShards, npy_bytes
    from shard_helpers import write_tar

    folder = tmp_path / "features"
    shutil.copytree(precomputed, folder)
    shard = sorted(folder.glob("*.tar"))[0]
    samples = [dict(s) for s in wds.WebDataset(str(shard), shardshuffle=False)]
    good = [s["__key__"] for s in samples]
    latent = np.frombuffer(samples[1][LATENT_MEMBER][128:], dtype=np.float16)  # header of np.save is 128 bytes
    samples[1][LATENT_MEMBER] = npy_bytes(latent.astype(np.float32).reshape(-1))  # wrong dtype (and shape)
    samples[2][LATENT_MEMBER] = samples[2][LATENT_MEMBER][: len(samples[2][LATENT_MEMBER]) // 2]  # truncated
    del samples[3][TEXT_MEMBER]  # missing T5 states
    hostile = folder / "hostile.tar"
    write_tar(hostile, [{k: v for k, v in s.items() if not k.startswith("__") or k == "__key__"} for s in samples])
    bad_keys = {good[1], good[2], good[3]}

    def read_all(ds):
        return [ds[i]["key"] for i in range(len(ds))]

    first = PrecomputedShards([str(hostile)], index_dir=tmp_path / "index")
    keys = read_all(first)
    assert len(keys) == len(samples) and not set(keys) & bad_keys and set(keys) == set(good) - bad_keys
    assert first.stats.bad == {BAD_PRECOMPUTED: 3} and first.stats.good == len(samples)
    again = PrecomputedShards([str(hostile)], index_dir=tmp_path / "index")
    assert read_all(again) == keys  # the same substitutes, in the same places

    # the shard is rewritten after it was indexed (fewer samples): rescanned, never read at stale offsets
    write_tar(hostile, [{k: v for k, v in s.items() if not k.startswith("__") or k == "__key__"}
                        for s in samples[:2]])
    os.utime(hostile, ns=(1, 1))  # even with an old mtime, the size differs
    changed = PrecomputedShards([str(hostile)], index_dir=tmp_path / "index")
    assert len(changed) == 2 and read_all(changed) == [good[0], good[0]]
    assert changed.stats.bad == {BAD_PRECOMPUTED: 1}


def per_sample_noise(monkeypatch):
    """Noise and timestep drawn from each latent's own bytes, not from the global stream: then how a batch is cut
    into micro-batches cannot change what a sample sees, and two runs can be compared weight for weight."""
    import hashlib

    import torch

    from imba.objectives import NoisedBatch, RectifiedFlow

    real_noise = RectifiedFlow.noise

    def noise(self, latents, generator=None):
        rows = []
        for row in latents:
            seed = int.from_bytes(hashlib.sha256(row.numpy().tobytes()).digest()[:8], "little")
            rows.append(real_noise(self, row[None], generator=torch.Generator().manual_seed(seed)))
        return NoisedBatch(*(torch.cat([getattr(r, f) for r in rows]) for f in ("noisy", "timesteps", "target")))

    monkeypatch.setattr(RectifiedFlow, "noise", noise)


@pytest.mark.slow
def test_gradient_accumulation_equals_the_bigger_batch_and_resumes_exactly(precomputed, tmp_path, monkeypatch,
                                                                           capsys):
    """grad_accum=2 with batch 2 is batch 4 with grad_accum=1: same samples per step, the mean of the two
    micro-batch gradients, one optimizer and schedule step; the loader hands out steps × grad_accum batches, and an
    interrupted grad_accum=2 run resumes bitwise. The literal token-level IMBA loss draws nothing at random and is a
    mean over rows, so with per-sample noise the two runs differ by float rounding only."""
    import shutil

    import torch
    from safetensors.torch import load_file

    per_sample_noise(monkeypatch)
    handed_out = []
    real_make_loader = train.make_loader

    class CountingLoader:
        def __init__(self, loader):
            self.loader = loader

        def __iter__(self):
            for batch in self.loader:
                handed_out[-1] += 1
                yield batch

        def __getattr__(self, name):  # the reader statistics
            return getattr(self.loader, name)

    def counting_make_loader(*a, **k):
        handed_out.append(0)
        return CountingLoader(real_make_loader(*a, **k))

    monkeypatch.setattr(train, "make_loader", counting_make_loader)
    common = ["loss.kind=imba", "loss.normalize=none", "loss.estimator=literal", "train.max_steps=3"]

    def run(name, *extra):
        assert run_main(args(tmp_path / name, precomputed, *common, *extra)) == 0
        digest = re.search(r"rank 0/1: parameters ([0-9a-f]{16})", capsys.readouterr().out).group(1)
        weights = load_file(tmp_path / name / "checkpoints" / "step_0000003" / "model.safetensors")
        return digest, weights

    # 12 samples: 3 batches of 4 or 6 of 2, one epoch either way
    _, big = run("big", "data.batch_size=4")
    assert handed_out == [3]
    accum_digest, accumulated = run("accum", "data.batch_size=2", "train.grad_accum=2")
    assert handed_out[-1] == 6
    assert big.keys() == accumulated.keys()
    before = load_file(tmp_path / "big" / "checkpoints" / "step_0000002" / "model.safetensors")
    moved = max((big[k] - before[k]).abs().max().item() for k in big)  # what the last step changed
    differ = max((big[k] - accumulated[k]).abs().max().item() for k in big)
    assert differ < moved / 100
    rows = [json.loads(line) for line in (tmp_path / "accum" / "metrics.jsonl").read_text().splitlines()]
    big_rows = [json.loads(line) for line in (tmp_path / "big" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in big_rows], rel=1e-5)
    assert [r["lr"] for r in rows] == [r["lr"] for r in big_rows]  # one schedule step per optimizer step

    # interrupted after step 2 (its checkpoint), resumed to 3: the same weights, bitwise
    shutil.copytree(tmp_path / "accum" / "checkpoints" / "step_0000002", tmp_path / "split" / "checkpoints" /
                    "step_0000002")
    (tmp_path / "split" / "checkpoints" / "latest").write_text("step_0000002\n")
    resumed_digest, resumed = run("split", "data.batch_size=2", "train.grad_accum=2")
    assert handed_out[-1] == 2  # only the last step's two micro-batches
    assert resumed_digest == accum_digest
    assert all(torch.equal(resumed[k], accumulated[k]) for k in accumulated)
