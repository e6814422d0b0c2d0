"""A store that dies during a run: the loop reads each optimizer step's micro-batches before the step
(`imba.training.step_batches.StepBatches`), so a rank that cannot read them says so at the step boundary, every
rank agrees through the pre-emption's collective, the run checkpoints what it trained and exits for a requeue with
the store's one line; the checkpoint resumes where the stream stopped. The real store dying under a real run is
tests/test_remote_runs.py (slow)."""

import pytest
from accelerate import Accelerator

import train
from data.remote import StoreUnreachable
from imba.training.checkpoints import list_checkpoints
from imba.training.preemption import REQUEUE_EXIT_CODE, REQUEUE_FILE_ENV, PreemptionHandler
from imba.training.step_batches import StepBatches
from test_train_precomputed import run_main

LINE = "s3://bucket/shards/000003.tar: store unreachable for 3 s (connection refused)"


def dying(batches, readable):
    """The loader's batches, then the dead store's error after `readable` of them."""
    for i, batch in enumerate(batches):
        if i == readable:
            raise StoreUnreachable(LINE)
        yield batch


def test_a_step_is_read_whole_or_not_at_all():
    batches = StepBatches(dying(iter(range(100)), readable=5), micro_batches=2)
    batches.fetch()
    assert list(batches) == [0, 1] and list(batches) == []  # yielded once
    batches.fetch()
    assert list(batches) == [2, 3] and batches.failure is None
    batches.fetch()  # 4 is read, 5 is not: the step is not trained in part
    assert list(batches) == [] and batches.failure == LINE


def test_a_rank_that_cannot_read_stops_every_rank_with_its_line_and_the_requeue_status(capsys, tmp_path,
                                                                                        monkeypatch):
    marker = tmp_path / "requeue"  # the file launch/slurm/node_launch.sh names: accelerate reports the exit as 1
    monkeypatch.setenv(REQUEUE_FILE_ENV, str(marker))
    accelerator, handler = Accelerator(cpu=True), PreemptionHandler(signals=())
    assert not handler.should_stop(accelerator)
    assert handler.should_stop(accelerator, cannot_read=True)
    assert handler.requeue(accelerator, LINE, 7, saved=True) == REQUEUE_EXIT_CODE
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"error: {LINE}"
    assert "checkpoint at step 7 saved" in out[1] and "pre-empted" not in out[1]
    assert [line for line in out if line.startswith("error: ")] == [f"error: {LINE}"]
    assert marker.read_text() == f"{REQUEUE_EXIT_CODE}\n"


TINY = ["data.resolution=32", "model.vae=tiny", "data.precompute=false", "data.batch_size=2", "train.grad_accum=2",
        "data.synthetic_samples=24", "train.log_every=1", "train.save_every=100", "train.sample_every=0",
        "train.val_every=0", "train.trackers=none", "sample.steps=2", "sample.prompts=[a red circle]"]


@pytest.mark.slow
def test_train_checkpoints_the_steps_it_trained_and_exits_for_a_requeue(tmp_path, monkeypatch, capsys):
    real_make_loader = train.make_loader
    read = {"batches": 0}

    def make_loader(*args, **kwargs):  # the run's real loader, whose store dies after 5 micro-batches
        loader = real_make_loader(*args, **kwargs)

        class Dying:
            def __iter__(self):
                for batch in dying(iter(loader), readable=5):
                    read["batches"] += 1
                    yield batch

            def __getattr__(self, name):
                return getattr(loader, name)

        return Dying()

    monkeypatch.setattr(train, "make_loader", make_loader)
    out = tmp_path / "run"
    assert run_main([*TINY, f"train.output_dir={out}", "train.max_steps=6"]) == REQUEUE_EXIT_CODE
    said = capsys.readouterr().out
    # micro-batches 0-3 trained steps 1 and 2; step 3's second micro-batch could not be read: step 3 never ran
    assert read["batches"] == 5
    assert [p.name for p in list_checkpoints(out / "checkpoints")] == ["step_0000002"]
    assert [line for line in said.splitlines() if line.startswith("error: ")] == [f"error: {LINE}"]
    assert "checkpoint at step 2 saved; exiting with 75" in said
    monkeypatch.setattr(train, "make_loader", real_make_loader)  # the store is back
    assert run_main([*TINY, f"train.output_dir={out}", "train.max_steps=3"]) == 0
    resumed = capsys.readouterr().out
    assert "resumed from" in resumed and "at 8 samples (the position the checkpoint recorded)" in resumed
