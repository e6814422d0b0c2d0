"""Every range check at both of its bounds: a closed bound is accepted (optim.ema_decay=1, sample.steps=2), an open
bound and the nearest value beyond a closed one are refused with the key, the range and its note in one line."""

import math
import typing

import pytest

from imba.training.config import KIND_RANGES, KIND_SETTINGS, RANGES, ConfigError, _Range, load_config


def _ranges():
    """(key, the overrides that choose the kind whose setting it is, its range, its type) for every range check."""
    defaults = load_config([])
    for key, allowed in RANGES.items():
        yield key, [], allowed, type(_value(defaults, key))
    for key, by_kind in KIND_RANGES.items():
        owner, setting = key.rsplit(".", 1)  # a kind section (loss) or a section's kind setting (data.balance)
        for kind, allowed in by_kind.items():
            rule = KIND_SETTINGS[owner][kind]
            yield key, [f"{owner}={kind}"], allowed, typing.get_type_hints(rule)[setting]


def _value(cfg, key: str):
    for name in key.split("."):
        cfg = getattr(cfg, name)
    return cfg


def _cases():
    for key, base, allowed, kind in _ranges():
        for bound, is_open, outward in ((allowed.low, allowed.low_open, -1), (allowed.high, allowed.high_open, 1)):
            if bound is None:
                continue
            if kind is int:
                beyond = int(bound) + outward
            else:
                beyond = math.nextafter(float(bound), outward * math.inf)
            yield pytest.param(key, base, allowed, kind(bound), not is_open, id=f"{base}{key}={bound}")
            yield pytest.param(key, base, allowed, beyond, False, id=f"{base}{key}={beyond!r}")


@pytest.mark.parametrize("key,base,allowed,value,accepted", list(_cases()))
def test_each_bound_is_accepted_when_closed_and_refused_beyond(key, base, allowed, value, accepted):
    override = f"{key}={value!r}" if isinstance(value, float) else f"{key}={value}"
    if accepted:
        resolved = {("model.max_text_tokens", 0): 16}.get((key, value), value)  # 0: tiny-words' own length
        assert _value(load_config([*base, override]), key) == resolved
    else:
        with pytest.raises(ConfigError, match=f"config key '{key}' must be") as err:
            load_config([*base, override])
        assert str(allowed) in str(err.value) and "\n" not in str(err.value)


def test_the_bounds_a_reader_tries_first():
    assert load_config(["optim.ema_decay=1"]).optim.ema_decay == 1.0
    assert load_config(["optim.ema_decay=0"]).optim.ema_decay == 0.0
    assert load_config(["optim.adam_beta2=0"]).optim.adam_beta2 == 0.0
    assert load_config(["sample.steps=2"]).sample.steps == 2
    assert load_config(["train.seed=4294967295"]).train.seed == 2 ** 32 - 1
    for refused in ("optim.ema_decay=1.0001", "optim.adam_beta1=1", "optim.lr=0", "objective=ddpm objective.beta_end=1",
                    "train.seed=4294967296", "train.seed=-1", "sample.steps=1"):
        with pytest.raises(ConfigError, match="must be"):
            load_config(refused.split(" "))


def test_range_holds_and_reads_as_its_interval():
    closed, half_open, positive = _Range(0, 1), _Range(0, 1, high_open=True), _Range(0, low_open=True)
    assert [closed.holds(v) for v in (-1e-9, 0, 0.5, 1, 1 + 1e-9)] == [False, True, True, True, False]
    assert [half_open.holds(v) for v in (0, 1 - 1e-9, 1)] == [True, True, False]
    assert [positive.holds(v) for v in (0, 1e-300, 1e300)] == [False, True, True]
    assert _Range(0, 1, low_open=True, high_open=True).holds(0.5) and not _Range(0, 1, low_open=True).holds(0)
    assert _Range().holds(-1e300) and _Range(high=3).holds(-5) and not _Range(high=3).holds(4)
    assert str(closed) == "in [0, 1]" and str(half_open) == "in [0, 1)" and str(positive) == "> 0"
    assert str(_Range(0, 1, low_open=True, high_open=True)) == "in (0, 1)" and str(_Range(2)) == ">= 2"
    assert str(_Range(0, note="0 = off")) == ">= 0 (0 = off)"
    with pytest.raises(ConfigError, match=r"'train.save_every' must be >= 0 \(0 = only at the end\), got -1"):
        load_config(["train.save_every=-1"])
