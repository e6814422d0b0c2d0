"""The data stream of a run (data/stream.py): its readers behind one protocol (length, sample i, fingerprint), the
stream built from the data settings by one call, and the line a resume prints when its data changed under it."""

import contextlib
import os
import shutil

import numpy as np
import pytest
from accelerate import Accelerator
from accelerate.state import AcceleratorState

from data.indexed import IndexedShards
from data.precompute import PrecomputeSettings, precompute_shards
from data.precomputed import PrecomputedShards, load_manifest
from data.sources import Source
from data.stream import Reader, make_stream, reader_fingerprint
from data.synthetic import write_synthetic_shards
from data.weighted import WeightedOrder
from imba.training.config import load_config
from imba.training.inputs import check_data, training_sources


@pytest.fixture(autouse=True)
def fresh_state():
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("stream")
    return write_synthetic_shards(root / "a", num_samples=20, samples_per_shard=8, resolution=32, seed=3)


def test_both_readers_are_readers_and_their_fingerprint_follows_what_decides_a_sample(shards, tmp_path):
    reader = IndexedShards(shards, 32)
    assert isinstance(reader, Reader) and len(reader) == 20 and reader[3]["key"] == reader[3]["key"]
    same = IndexedShards(list(shards), 32).fingerprint()
    assert reader.fingerprint() == same  # a function of the shards and the decoding, not of the object
    for other in (IndexedShards(shards, 16), IndexedShards(shards, 32, caption_field="alt"),
                  IndexedShards(shards, 32, min_size=8), IndexedShards(shards[:2], 32)):
        assert other.fingerprint() != same
    copy = [shutil.copy(s, tmp_path / os.path.basename(s)) for s in shards]
    moved = IndexedShards(copy, 32).fingerprint()
    assert moved != same  # other files (paths and times), though the bytes are the same
    with open(copy[0], "ab") as f:
        f.write(b"\0" * 512)  # another size, the same samples: the index is made again, the fingerprint moves
    assert IndexedShards(copy, 32).fingerprint() != moved

    settings = PrecomputeSettings(vae="tiny", text_encoder="tiny-words", resolution=32)
    precompute_shards(shards, tmp_path / "features", settings, batch_size=8)
    features = sorted(str(p) for p in (tmp_path / "features").glob("*.tar"))
    precomputed = PrecomputedShards(features)
    assert isinstance(precomputed, Reader) and len(precomputed) == 20
    manifest = load_manifest(features)
    assert PrecomputedShards(features, manifest={**manifest, "text_dtype": "int8"}).fingerprint() != \
        precomputed.fingerprint()  # the features' settings decide their samples
    assert PrecomputedShards(features, manifest={**manifest, "__path__": "elsewhere"}).fingerprint() == \
        precomputed.fingerprint()  # where the manifest was read does not


def test_the_stream_is_built_from_the_data_settings_in_one_call(shards, tmp_path):
    accelerator = Accelerator(cpu=True)
    plain = load_config(["data.resolution=32", "data.batch_size=4", f"data.shards={os.path.dirname(shards[0])}",
                         f"train.output_dir={tmp_path}"])
    sources = training_sources(plain, accelerator, tmp_path)
    stream = make_stream(plain.data, accelerator, sources, seed=0, samples_done=8, manifest=None, bucket_divisor=16,
                         plan_folder=tmp_path / "data")
    assert stream.batches_done == 2 and stream.epoch is None  # the uniform order: batches of this rank
    assert len(next(iter(stream.loader))["keys"]) == 4 and not (tmp_path / "data").exists()
    balanced = load_config(["data.resolution=32", "data.batch_size=4", f"data.shards={os.path.dirname(shards[0])}",
                            "data.balance=temperature", f"train.output_dir={tmp_path}"])
    stream = make_stream(balanced.data, accelerator, sources, seed=0, samples_done=30, manifest=None,
                         bucket_divisor=16, plan_folder=tmp_path / "data")
    assert stream.epoch == pytest.approx(30 / 20)  # the weighted stream: its position in epochs of the plan
    assert (tmp_path / "data").is_dir()  # the plan, computed by the main process into its folder
    assert reader_fingerprint(stream.loader) == IndexedShards(shards, 32).fingerprint()


def test_every_read_setting_of_the_run_reaches_its_reader(shards, tmp_path):
    accelerator = Accelerator(cpu=True)
    cfg = load_config(["data.resolution=16", "data.batch_size=2", f"data.shards={os.path.dirname(shards[0])}",
                       "data.caption_field=alt", "data.min_size=8", "data.shard_window=2", "data.num_workers=0",
                       f"train.output_dir={tmp_path}"])
    stream = make_stream(cfg.data, accelerator, training_sources(cfg, accelerator, tmp_path), seed=7,
                         samples_done=6, manifest=None, bucket_divisor=16, plan_folder=tmp_path / "data")
    reader, order = stream.loader.dataset, stream.loader.sampler
    assert reader.decoding() == {"resolution": 16, "caption_field": "alt", "min_size": 8}
    assert (order.batch_size, order.seed, order.start_batch, order.shard_window) == (2, 7, 3, 2)

    def loader(*settings):
        cfg = load_config(["data.resolution=32", "data.batch_size=2", f"data.shards={os.path.dirname(shards[0])}",
                           f"train.output_dir={tmp_path}", *settings])
        return make_stream(cfg.data, accelerator, training_sources(cfg, accelerator, tmp_path), seed=0,
                           samples_done=0, manifest=None, bucket_divisor=16, plan_folder=tmp_path / "data").loader

    assert loader("data.bucketing=true").buckets is not None and loader().buckets is None
    assert loader("data.mode=streaming", "data.num_workers=1").num_workers == 1
    streamed = loader("data.mode=streaming", "data.shuffle_buffer=37").dataset.pipeline
    assert [stage.bufsize for stage in streamed if hasattr(stage, "bufsize")] == [37]
    assert not [s for s in loader("data.mode=streaming", "data.shuffle_buffer=0").dataset.pipeline
                if hasattr(s, "bufsize")]


def test_a_given_order_replaces_the_plans_and_the_plans_order_gets_the_seed_and_the_shard_window(shards, tmp_path):
    accelerator = Accelerator(cpu=True)
    cfg = load_config(["data.resolution=32", "data.batch_size=4", f"data.shards={os.path.dirname(shards[0])}",
                       "data.balance=temperature", "data.shard_window=2", "train.seed=9",
                       f"train.output_dir={tmp_path}"])
    sources = training_sources(cfg, accelerator, tmp_path)

    def stream(**given):
        keywords = dict(seed=9, samples_done=8, manifest=None, bucket_divisor=16, plan_folder=tmp_path / "data")
        return make_stream(cfg.data, accelerator, sources, **(keywords | given))

    planned = stream().loader.sampler.order
    assert (planned.seed, planned.window, list(planned.shard_starts)) == (9, 2, [0, 8, 16, 20])
    given = WeightedOrder(planned.units, planned.samples_per_epoch, seed=5)  # another order of the same draws
    made = stream(order=given, samples_done=30)
    assert made.loader.sampler.order is given and made.epoch == pytest.approx(30 / 20)
    assert list(next(iter(made.loader))["indices"]) == list(given.samples(range(30, 34)))


def test_precomputed_features_are_read_by_their_reader_in_threads_alike(shards, tmp_path):
    settings = PrecomputeSettings(vae="tiny", text_encoder="tiny-words", resolution=32)
    precompute_shards(shards, tmp_path / "features", settings, batch_size=8)
    features = sorted(str(p) for p in (tmp_path / "features").glob("*.tar"))
    manifest = load_manifest(features)
    accelerator = Accelerator(cpu=True)
    first = {}
    for threads in (0, 2):
        d = load_config(["data.resolution=32", "data.batch_size=4", f"data.loader_threads={threads}"]).data
        made = make_stream(d, accelerator, [Source("f", features)], seed=0, samples_done=4, manifest=manifest,
                           bucket_divisor=16, plan_folder=tmp_path)
        batch = next(iter(made.loader))
        assert made.batches_done == 1 and "latent_moments" in batch
        assert (type(made.loader._loader).__name__ == "_ThreadedBatches") == bool(threads)  # the threads asked for
        first.setdefault("keys", batch["keys"])
        assert batch["keys"] == first["keys"]
    assert isinstance(made.loader.dataset, PrecomputedShards)


def test_a_resume_whose_data_changed_says_so_in_one_line(shards, tmp_path, capsys):
    accelerator = Accelerator(cpu=True)
    loader = make_stream(load_config(["data.resolution=32", "data.batch_size=4"]).data, accelerator,
                         [Source("a", shards)], seed=0, samples_done=0, manifest=None,
                         bucket_divisor=16, plan_folder=tmp_path).loader
    recorded = check_data(accelerator, loader, None)  # a fresh run: nothing to compare with
    assert recorded == IndexedShards(shards, 32).fingerprint() and capsys.readouterr().out == ""
    assert check_data(accelerator, loader, recorded) == recorded and capsys.readouterr().out == ""
    check_data(accelerator, loader, "0123456789abcdef")  # the checkpoint's run read other samples
    out = capsys.readouterr().out
    assert out.startswith("data: the shards or how their samples are decoded changed since the checkpoint")
    assert out.count("\n") == 1


def test_the_other_ranks_wait_for_the_plan_the_main_process_writes(shards, tmp_path, monkeypatch):
    import data.stream as stream

    d = load_config(["data.resolution=32", "data.balance=temperature", "data.epoch_samples=30"]).data
    sources = [Source("a", shards)]

    class Rank:
        def __init__(self, index):
            self.process_index, self.num_processes, self.is_main_process = index, 2, index == 0
            self.waited = 0

        def main_process_first(self):
            return contextlib.nullcontext()

        def wait_for_everyone(self):
            self.waited += 1

    written = []

    def sleep(seconds):  # while rank 1 polls, the main process writes the plan
        assert seconds == stream.PLAN_POLL_S
        written.append(stream.draw_plan(d, Rank(0), sources, tmp_path / "data"))

    monkeypatch.setattr(stream.time, "sleep", sleep)
    other = Rank(1)
    plan, index, mix = stream.draw_plan(d, other, sources, tmp_path / "data")
    assert len(written) == 1 and other.waited == 1
    assert plan.report["fingerprint"] == written[0][0].report["fingerprint"] and mix.samples_per_epoch == 30
    assert len(index) == 20


def test_a_position_inside_a_global_batch_starts_the_uniform_order_at_that_batch(shards, tmp_path):
    d = load_config(["data.resolution=32", "data.batch_size=4"]).data
    made = make_stream(d, Accelerator(cpu=True), [Source("a", shards)], seed=0, samples_done=10, manifest=None,
                       bucket_divisor=16, plan_folder=tmp_path)
    assert made.batches_done == 2 and isinstance(made.batches_done, int)


def test_a_streamed_loader_has_no_reader_to_fingerprint(shards, tmp_path):
    d = load_config(["data.resolution=32", "data.batch_size=4", "data.mode=streaming"]).data
    made = make_stream(d, Accelerator(cpu=True), [Source("a", shards)], seed=0, samples_done=0, manifest=None,
                       bucket_divisor=16, plan_folder=tmp_path)
    assert reader_fingerprint(made.loader) is None and made.epoch is None


def test_captions_are_read_by_several_processes_only_for_a_large_set():
    from data.stream import caption_workers

    sized = lambda n: type("Index", (), {"__len__": lambda self: n})()  # noqa: E731
    assert caption_workers(sized(200_000)) == 1
    assert caption_workers(sized(200_001)) == min(8, os.cpu_count() or 1)


def test_the_runs_online_balancer_reads_its_entries_once_and_the_loader_draws_its_order(shards, tmp_path, capsys):
    from imba.training.inputs import make_loader, online_balancer
    from imba.training.resume import StreamPosition

    accelerator = Accelerator(cpu=True)
    cfg = load_config(["data.resolution=32", "data.batch_size=4", f"data.shards={os.path.dirname(shards[0])}",
                       "data.balance=imba", "data.balance.every=2", f"train.output_dir={tmp_path}", "train.seed=3"])
    sources = training_sources(cfg, accelerator, tmp_path)
    assert online_balancer(load_config(["data.resolution=32"]), accelerator, sources, 4, 1000) is None  # offline
    balancer = online_balancer(cfg, accelerator, sources, patch_size=4, num_train_timesteps=1000)
    assert (tmp_path / "data" / "entries.npz").is_file() and balancer.every == 2
    assert "concepts and combinations (weights in effect" in capsys.readouterr().out
    loader = make_loader(cfg, accelerator, sources, StreamPosition(3, 12), None, bucket_divisor=16, balancer=balancer)
    assert loader.sampler.order is balancer.order and loader.sampler.samples_done == 12
    assert "the stream continues after 12 samples" in capsys.readouterr().out
    first = next(iter(loader))["indices"]
    assert list(first) == list(balancer.order.samples(range(12, 16)))
    uniform = load_config(["data.resolution=32", "data.batch_size=4", f"data.shards={os.path.dirname(shards[0])}"])
    make_loader(uniform, accelerator, sources, StreamPosition(2, 8), None, bucket_divisor=16)
    assert "each rank continues after 2 batches of 4" in capsys.readouterr().out


def test_a_run_balanced_by_image_clusters_clusters_its_precomputed_latents_and_image_shards_say_what_it_needs(
        shards, tmp_path, capsys):
    from data.image_clusters import latent_features

    settings = PrecomputeSettings(vae="tiny", text_encoder="tiny-words", resolution=32)
    precompute_shards(shards, tmp_path / "features", settings, batch_size=8)
    features = sorted(str(p) for p in (tmp_path / "features").glob("*.tar"))
    manifest = load_manifest(features)
    accelerator = Accelerator(cpu=True)
    d = load_config(["data.resolution=32", "data.batch_size=4", "data.balance=temperature", "data.balance.alpha=1",
                     "data.balance.by=images"]).data
    made = make_stream(d, accelerator, [Source("f", features)], seed=0, samples_done=0, manifest=manifest,
                       bucket_divisor=16, plan_folder=tmp_path / "plan")
    out = capsys.readouterr().out
    assert "balanced by image clusters (temperature, alpha 1)" in out and "  image clusters: 4 (k-means of " in out
    plan = made.loader.sampler.order
    assert isinstance(plan, WeightedOrder)
    reader = PrecomputedShards(features)
    rows = latent_features(reader.index, manifest)
    assert rows.shape == (20, 4 * 4 * 4)  # the tiny VAE's 4 channels, each over a 4 x 4 grid of cells
    mean = reader[7]["latent_mean"].numpy()  # (4, 4, 4): each cell one latent pixel here
    assert np.allclose(rows[7], mean.reshape(-1)) and not np.allclose(rows[7], rows[8])
    with pytest.raises(ValueError, match="data.balance.by=images clusters the samples' VAE latents"):
        make_stream(d, accelerator, [Source("a", shards)], seed=0, samples_done=0, manifest=None, bucket_divisor=16,
                    plan_folder=tmp_path / "images")
