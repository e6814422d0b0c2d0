"""The run's hooks (imba/training/hooks.py): each point calls the hooks that have it, in order; a hook's state joins
the checkpoint map under its own name; the online balancer, the draw log and the IMBA monitor are hooks."""

import pytest
import torch

from imba.training.balancing import OnlineBalancer
from imba.training.hooks import Hooks
from imba.training.metrics import ConceptBuckets, DrawLog


class Recorder:
    def __init__(self, name, calls, line=None):
        self.name, self.calls, self.line = name, calls, line

    def micro_batch(self, step, batch, stats, predict, noised, null):
        self.calls.append((self.name, "micro_batch", step, batch["i"], stats, predict, noised, null))

    def step_end(self, step, accelerator):
        self.calls.append((self.name, "step_end", step, accelerator))
        return self.line


class Saver:
    CHECKPOINT = "saver"
    CHECKPOINT_PER_RANK = True

    def __init__(self, calls):
        self.calls = calls

    def before_save(self, accelerator):
        self.calls.append(("saver", "before_save", accelerator))

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


def test_each_point_calls_the_hooks_that_have_it_in_order():
    calls = []
    hooks = Hooks("acc", [Recorder("a", calls, "a's line"), None, Saver(calls)])
    hooks.add(Recorder("b", calls))
    hooks.micro_batch(3, {"i": 7}, {"loss": 1}, "predict", "noised", "null")
    assert hooks.step_end(3) == ["a's line"]  # b has no line to print
    hooks.before_save()
    seen = (3, 7, {"loss": 1}, "predict", "noised", "null")  # each hook gets every argument, in place
    assert calls == [("a", "micro_batch", *seen), ("b", "micro_batch", *seen), ("a", "step_end", 3, "acc"),
                     ("b", "step_end", 3, "acc"), ("saver", "before_save", "acc")]


def test_hooks_with_state_are_the_checkpoint_map_and_a_name_is_taken_once():
    calls = []
    saver = Saver(calls)
    shared = type("Shared", (), {"CHECKPOINT": "shared", "before_save": lambda self, accelerator: None})()
    hooks = Hooks("acc", [Recorder("a", calls), saver, shared])
    assert hooks.checkpointed() == {"saver": (saver, True), "shared": (shared, False)}  # rank-equal unless it says
    # a hook with state added once the map is made would never be saved: refused; one without state is welcome
    with pytest.raises(ValueError, match="Saver has state \\(saver\\) but comes after the run's checkpoint map"):
        hooks.add(Saver(calls))
    hooks.add(Recorder("late", calls))
    with pytest.raises(ValueError, match="two hooks name the checkpoint part 'saver'"):
        Hooks("acc", [saver, Saver(calls)]).checkpointed()
    with pytest.raises(TypeError, match="object has none of the hook points micro_batch, step_end, evaluate, means, "
                                        "before_save, between_steps"):
        Hooks("acc", [object()])


class Measurer:
    """A hook of the points that read the model: metrics on a schedule, window means, work between steps."""

    def __init__(self, name, calls, every):
        self.name, self.calls, self.every = name, calls, every

    def evaluate(self, step, model, ema):
        self.calls.append((self.name, "evaluate", step, model, ema))
        return {f"{self.name}/loss": float(step)} if step % self.every == 0 else {}

    def means(self):
        return {f"{self.name}/mean": 0.5}

    def between_steps(self, step, model, ema):
        self.calls.append((self.name, "between_steps", step, model, ema))


def test_the_measuring_points_merge_each_hooks_metrics_and_pass_the_model():
    calls = []
    hooks = Hooks("acc", [Measurer("val", calls, 2), Recorder("r", calls), Measurer("probe", calls, 3)])
    assert hooks.evaluate(2, "dit", "ema") == {"val/loss": 2.0}
    assert hooks.evaluate(6, "dit", "ema") == {"val/loss": 6.0, "probe/loss": 6.0}
    assert hooks.evaluate(7, "dit", "ema") == {}  # nothing measured: the loop logs on its own schedule
    assert hooks.means() == {"val/mean": 0.5, "probe/mean": 0.5}
    hooks.between_steps(4, "dit", "ema")
    assert calls[-2:] == [("val", "between_steps", 4, "dit", "ema"), ("probe", "between_steps", 4, "dit", "ema")]
    assert calls[:2] == [("val", "evaluate", 2, "dit", "ema"), ("probe", "evaluate", 2, "dit", "ema")]


def test_the_online_balancer_and_the_draw_log_are_hooks(tmp_path):
    assert OnlineBalancer.CHECKPOINT == "online_balance"
    for point in ("micro_batch", "step_end", "before_save", "state_dict", "load_state_dict"):
        assert callable(getattr(OnlineBalancer, point))
    log = DrawLog(tmp_path / "draws.jsonl", keep_until=0)
    hooks = Hooks(None, [log])
    hooks.micro_batch(1, {"indices": [4, 2]}, {}, None, None, None)
    assert hooks.checkpointed() == {}
    assert (tmp_path / "draws.jsonl").read_text().strip() == '{"step": 1, "indices": [4, 2]}'


def test_the_imba_monitor_is_a_hook_that_reads_the_batchs_captions():
    stats = {"distance_per_sample": torch.tensor([1.0, 3.0, 5.0])}
    monitor = ConceptBuckets(lambda captions: ["tail" if "ring" in c else "head" for c in captions])
    Hooks(None, [monitor]).micro_batch(1, {"captions": ["a ring", "a red circle", "a cyan ring"]}, stats, None, None,
                                       None)
    means = monitor.means()
    assert means["monitor/distance_tail"] == 3.0 and means["monitor/distance_head"] == 3.0
    off = ConceptBuckets()  # train.concept_stats=none: nothing is bucketed
    off.micro_batch(1, {"captions": ["a ring"]}, stats, None, None, None)
    assert off.means() == {}
