"""The config sections that live beside their components (models/settings.py, data/settings.py,
imba/loss_settings.py, imba/objective_settings.py): reading a config imports none of the training stack, every
choice and range names a field of its section, and what a section names or hands over as keywords is what its
component takes."""

from __future__ import annotations

import dataclasses
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

from data.read_spec import ReadSpec
from imba.loss_settings import LOSS_SETTINGS
from imba.objective_settings import OBJECTIVE_SETTINGS
from imba.objectives import OBJECTIVES
from imba.training.config import CHOICES, KIND_RANGES, KIND_SETTINGS, RANGES, Config, load_config

REPO = Path(__file__).resolve().parents[1]


def test_the_config_module_imports_none_of_the_training_stack():
    code = ("import sys, imba.training.config; "
            "print(sorted({'accelerate', 'diffusers', 'transformers', 'deepspeed'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def test_every_choice_and_range_names_a_field_of_its_section():
    sections = {f.name: {g.name for g in dataclasses.fields(getattr(Config(), f.name))}
                for f in dataclasses.fields(Config)}
    for key in (*CHOICES, *RANGES):
        if key in KIND_SETTINGS:  # the kinds of a kind setting
            continue
        section, name = key.split(".")
        assert name in sections[section], key
    for key, by_kind in KIND_RANGES.items():  # a kind's range names a setting of that kind
        owner, name = key.rsplit(".", 1)
        assert all(name in {f.name for f in dataclasses.fields(KIND_SETTINGS[owner][k])} for k in by_kind), key


def test_what_the_sections_name_is_what_the_components_build():
    from models.dit import ATTENTION_BACKENDS, PRESETS
    from models.encoders import DTYPES
    from models.pipeline import PIPELINES

    assert CHOICES["model.preset"] == tuple(PRESETS)
    assert CHOICES["model.encoder_dtype"] == tuple(DTYPES)
    assert CHOICES["model.pipeline"] == ("auto", *PIPELINES)
    assert CHOICES["speed.attention"] == tuple(ATTENTION_BACKENDS)
    assert [cls.__name__ for cls in PIPELINES.values()] == ["PixArtAlphaPipeline", "PixArtSigmaPipeline"]


def test_the_beta_schedules_are_those_both_diffusers_schedulers_build():
    from imba.choices import BETA_SCHEDULES
    from imba.objectives import DDPMEpsilon

    for name in BETA_SCHEDULES:
        DDPMEpsilon(beta_schedule=name).sampling_scheduler()
    with pytest.raises(NotImplementedError):
        DDPMEpsilon(beta_schedule="sigmoid").sampling_scheduler()


def test_the_keywords_a_section_hands_over_are_its_components_parameters():
    from data.precompute_settings import PrecomputeSettings
    from models.encoders import FrozenEncoders

    cfg = Config()
    precompute_fields = {f.name for f in dataclasses.fields(PrecomputeSettings)}
    for kind in OBJECTIVE_SETTINGS.values():  # each objective kind builds its objective from its settings
        built = kind().build()
        assert type(built) is OBJECTIVES[kind.KIND] and built.name == kind.KIND
        assert set(kind().kwargs()) == set(dataclasses.asdict(kind()))
    assert load_config(["objective=flow", "objective.shift=3"]).objective.build().shift == 3.0
    assert set(cfg.model.encoders()) <= set(inspect.signature(FrozenEncoders.load).parameters)
    assert set(cfg.model.encoders()) <= precompute_fields
    assert set(cfg.data.decoding()) <= {f.name for f in dataclasses.fields(ReadSpec)}
    assert set(cfg.data.decoding()) <= precompute_fields


def test_each_loss_kind_builds_its_own_loss_with_every_setting_it_reads():
    import torch

    from imba.loss import IMBALoss
    from imba.loss_settings import LossConfig
    from imba.training_loss import ImbaTrainingLoss, PlainTrainingLoss, TrainingLoss

    for kind in LOSS_SETTINGS.values():  # every kind builds a loss the trainer can call
        assert isinstance(kind().build(), TrainingLoss)
    with pytest.raises(TypeError, match="abstract method build"):  # a kind that does not say which loss it is
        type("NewLoss", (LossConfig,), {"KIND": "new", "describe": lambda self: "new"})()
    plain = load_config(["loss=plain", "loss.lam=0.7", "objective=ddpm", "loss.min_snr_gamma=3"]).loss.build()
    assert type(plain) is PlainTrainingLoss
    assert (plain.lam, plain.min_snr_gamma, plain.drop_rate, plain.state_dict()) == (0.7, 3.0, pytest.approx(0.3), {})
    for kind, granularity in (("imba", "token"), ("imba_sample", "sample")):
        cfg = load_config([f"loss={kind}", "loss.gamma=0.5", "loss.lam=0.7", "loss.distance=l1", "loss.reference=cond",
                           "loss.normalize=timestep_mean", "loss.estimator=efficient", "objective=ddpm",
                           "loss.min_snr_gamma=2"])
        loss = cfg.loss.build(patch_size=4, same_passes_on_every_rank=True)
        assert type(loss) is ImbaTrainingLoss
        assert loss.imba == IMBALoss(gamma=0.5, lam=0.7, patch_size=4, granularity=granularity, distance="l1",
                                     reference="cond", normalize="timestep_mean")
        assert (loss.estimator, loss.min_snr_gamma, loss.same_passes_on_every_rank) == ("efficient", 2.0, True)
        assert loss.drop_rate == pytest.approx(0.3) and "timestep_mean" in loss.state_dict()
        # the running means are summed over the processes of a run of several only
        assert loss.imba.timestep_reduce is None
        assert cfg.loss.build(num_processes=2).imba.timestep_reduce is torch.distributed.all_reduce
    assert LOSS_SETTINGS["imba"]().build().drop_rate == 0.0  # literal: every row sees both captions
