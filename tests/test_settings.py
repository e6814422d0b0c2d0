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
    from data.loaders import build_loader
    from data.precompute_settings import PrecomputeSettings
    from imba.training_loss import TrainingLoss
    from models.encoders import FrozenEncoders

    cfg = Config()
    precompute_fields = {f.name for f in dataclasses.fields(PrecomputeSettings)}
    for kind in LOSS_SETTINGS.values():  # every kind's settings, and its name
        assert set(kind().kwargs()) <= set(inspect.signature(TrainingLoss).parameters)
        assert TrainingLoss(**kind().kwargs()).kind == kind.KIND
    for kind in OBJECTIVE_SETTINGS.values():  # each objective kind builds its objective from its settings
        built = kind().build()
        assert type(built) is OBJECTIVES[kind.KIND] and built.name == kind.KIND
        assert set(kind().kwargs()) == set(dataclasses.asdict(kind()))
    assert load_config(["objective=flow", "objective.shift=3"]).objective.build().shift == 3.0
    assert set(cfg.model.encoders()) <= set(inspect.signature(FrozenEncoders.load).parameters)
    assert set(cfg.model.encoders()) <= precompute_fields
    assert set(cfg.data.decoding()) <= set(inspect.signature(build_loader).parameters)
    assert set(cfg.data.decoding()) <= precompute_fields
    TrainingLoss(**cfg.loss.kwargs())
