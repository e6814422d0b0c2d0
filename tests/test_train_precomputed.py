"""Training on precomputed shards: no VAE or T5 is loaded for the steps, the config is checked against the features,
and the run resumes and exports like an image run."""

import json
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
            f"model.max_text_tokens={TOKENS}", "data.batch_size=2", "train.log_every=1", "train.save_every=2",
            "train.sample_every=0", "sample.steps=2", "sample.prompts=[a red circle]", "train.trackers=none",
            "optim.warmup_steps=1", *extra]


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


def test_bucketing_is_refused_on_precomputed_features(precomputed, tmp_path):
    with pytest.raises(ConfigError, match="precomputed latents have one fixed size"):
        run_main(args(tmp_path / "run", precomputed, "data.bucketing=true", "train.max_steps=1"))
