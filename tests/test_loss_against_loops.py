"""The IMBA loss where mutation testing found it unpinned: the efficient form (`drop=`) and its statistics against
explicit loops over rows and tokens, each setting's error naming its setting (config.py reports it under that key),
the timestep bins at their edges, LossStats' mapping, and the unwrapping of wrapped transformers."""

import math

import pytest
import torch

from imba.loss import IMBALoss, LossSettingError, LossStats, TimestepMean, plain_loss, transformer_patch_size

B, C, H, P = 4, 2, 4, 2  # 4 tokens of 2 x 2 patches per sample


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, C, H, H, generator=g, dtype=torch.float64) for _ in range(3)]


def _token_mse(a, b):
    """(B, N): mean square over each 2 x 2 patch's C·4 values, patches in row-major order."""
    out = torch.zeros(a.shape[0], (H // P) ** 2, dtype=torch.float64)
    for row in range(a.shape[0]):
        for i in range(H // P):
            for j in range(H // P):
                patch = (a - b)[row, :, i * P:(i + 1) * P, j * P:(j + 1) * P]
                out[row, i * (H // P) + j] = patch.pow(2).mean()
    return out


def _explicit(pred_cond, pred_uncond, target, drop, reference, normalize, gamma, sample_weights=None):
    keep = [not bool(x) for x in drop]
    valid = keep if reference == "cond" else [True] * B
    d = _token_mse(target if reference == "target" else pred_cond, pred_uncond)
    weight = d ** gamma
    if normalize == "batch_mean":
        weight = weight / weight[torch.tensor(valid)].mean()
    cond_err = _token_mse(target, pred_cond)
    rows = []
    for b in range(B):
        cond_term = sum(float(weight[b, n] * cond_err[b, n]) for n in range(4)) / 4
        uncond_term = float((pred_uncond[b] - target[b]).pow(2).mean())
        rows.append((cond_term, uncond_term))
    per_row = [u if drop[b] else c for b, (c, u) in enumerate(rows)]
    sw = [1.0] * B if sample_weights is None else sample_weights.tolist()
    kept_rows = [b for b in range(B) if keep[b]]
    valid_rows = [b for b in range(B) if valid[b]]
    return {"imba/loss": sum(w * r for w, r in zip(sw, per_row)) / B,
            "imba/loss_cond_weighted": sum(rows[b][0] for b in kept_rows) / len(kept_rows),
            "imba/loss_uncond": sum(u for _, u in rows) / B,
            "imba/loss_cond_plain": float(cond_err[kept_rows].mean()),
            "imba/weight_mean": float(weight[valid_rows].mean()),
            "imba/weight_std": float(weight[valid_rows].std(unbiased=False)),
            "imba/weight_max": float(weight[valid_rows].max()),
            "imba/distance_mean": float(d[valid_rows].mean()),
            "imba/caption_dropout_rate": sum(map(bool, drop)) / B}, d, cond_err, valid


@pytest.mark.parametrize("reference", ["target", "cond"])
@pytest.mark.parametrize("normalize", ["none", "batch_mean"])
@pytest.mark.parametrize("weighted", [False, True])
def test_the_efficient_form_and_its_stats_equal_explicit_loops(reference, normalize, weighted):
    pred_cond, pred_uncond, target = _inputs()
    drop = torch.tensor([False, True, False, True])  # the first and the last row differ
    sample_weights = torch.tensor([0.5, 2.0, 1.0, 3.0], dtype=torch.float64) if weighted else None
    loss_fn = IMBALoss(gamma=0.7, lam=0.5, patch_size=P, reference=reference, normalize=normalize)
    loss, stats = loss_fn(pred_cond, pred_uncond, target, drop=drop, sample_weights=sample_weights)
    want, d, cond_err, valid = _explicit(pred_cond, pred_uncond, target, drop, reference, normalize, 0.7,
                                         sample_weights)
    assert float(loss) == pytest.approx(want["imba/loss"], rel=1e-12)
    assert stats.floats() == pytest.approx(want, rel=1e-12)
    invalid = torch.tensor([not v for v in valid])
    per_sample, per_token = stats["distance_per_sample"], stats["distance_per_token"]
    assert per_sample.isnan().tolist() == invalid.tolist() and per_token.isnan().all(dim=1).tolist() == invalid.tolist()
    assert torch.allclose(per_sample[~invalid], d.mean(dim=1)[~invalid], rtol=1e-12)
    assert torch.allclose(per_token[~invalid], d[~invalid], rtol=1e-12)
    cond_per_sample = stats["loss_cond_per_sample"]
    assert cond_per_sample.isnan().tolist() == drop.tolist()
    assert torch.allclose(cond_per_sample[~drop], cond_err.mean(dim=1)[~drop], rtol=1e-12)


def test_the_literal_form_per_sample_stats_have_no_gaps():
    pred_cond, pred_uncond, target = _inputs(1)
    _, stats = IMBALoss(patch_size=P)(pred_cond, pred_uncond, target)
    for name in ("distance_per_sample", "distance_per_token", "loss_cond_per_sample"):
        assert not stats[name].isnan().any()
    assert torch.allclose(stats["distance_per_sample"], _token_mse(target, pred_uncond).mean(dim=1), rtol=1e-12)
    assert "imba/caption_dropout_rate" not in stats


def test_every_row_dropped_with_the_cond_reference_leaves_the_weight_stats_undefined():
    pred_cond, pred_uncond, target = _inputs(2)
    drop = torch.ones(B, dtype=torch.bool)
    loss, stats = IMBALoss(patch_size=P, reference="cond")(pred_cond, pred_uncond, target, drop=drop)
    floats = stats.floats()
    for name in ("weight_mean", "weight_std", "weight_max", "distance_mean"):
        assert math.isnan(floats[f"imba/{name}"]), name
    assert floats["imba/caption_dropout_rate"] == 1.0 and floats["imba/loss_cond_weighted"] == 0.0
    assert float(loss) == pytest.approx(float((pred_uncond - target).pow(2).mean()), rel=1e-12)


def test_batch_mean_with_timestep_mean_normalises_over_the_valid_rows_only():
    pred_cond, pred_uncond, target = _inputs(3)
    drop = torch.tensor([True, False, False, False])
    pred_uncond[0] += 100  # the dropped row's distance is huge; with the cond reference it must not count
    loss_fn = IMBALoss(patch_size=P, reference="cond", normalize="timestep_mean", gamma=1.0)
    loss_fn(pred_cond, pred_uncond, target, drop=drop, timesteps=torch.full((B,), 500))
    d = _token_mse(pred_cond, pred_uncond)
    assert float(loss_fn.timestep_mean.means[5]) == pytest.approx(float(d[1:].mean()), rel=1e-12)


@pytest.mark.parametrize("settings,setting", [
    ({"granularity": "pixel"}, "granularity"), ({"distance": "cos"}, "distance"),
    ({"reference": "uncond"}, "reference"), ({"normalize": "max"}, "normalize"),
    ({"lam": 1.01}, "lam"), ({"lam": -0.01}, "lam"), ({"gamma": -0.1}, "gamma"), ({"patch_size": 0}, "patch_size"),
    ({"timestep_reduce": "mean"}, "timestep_reduce"),
    ({"normalize": "timestep_mean", "timestep_bins": 0}, "timestep_mean"),
    ({"normalize": "timestep_mean", "timestep_momentum": 1.0}, "timestep_mean"),
    ({"normalize": "timestep_mean", "timestep_momentum": -0.01}, "timestep_mean"),
    ({"normalize": "timestep_mean", "num_train_timesteps": 0}, "timestep_mean"),
])
def test_each_refused_setting_names_itself_and_what_it_must_be(settings, setting):
    with pytest.raises(LossSettingError) as err:
        IMBALoss(**settings)
    assert err.value.setting == setting
    problem = err.value.problem
    assert isinstance(problem, str) and problem.startswith(("must", "needs"))
    assert str(err.value) == f"IMBALoss: {setting} {problem}"
    value = next(iter(settings.values())) if len(settings) == 1 else None
    if isinstance(value, str):
        assert repr(value) in problem  # what was given
    if setting in ("granularity", "distance", "reference", "normalize"):
        assert "must be one of " in problem and ", " in problem  # the choices, listed


def test_the_closed_edges_of_each_setting_are_accepted():
    IMBALoss(lam=0.0), IMBALoss(lam=1.0), IMBALoss(gamma=0.0), IMBALoss(patch_size=1)
    mean = TimestepMean(bins=1, momentum=0.0, num_train_timesteps=1)
    assert (mean.bins, mean.momentum, mean.num_train_timesteps) == (1, 0.0, 1)
    default = TimestepMean()
    assert (default.bins, default.momentum, default.num_train_timesteps) == (10, 0.99, 1000)
    assert default.means.dtype == torch.float64 and default.means.tolist() == [1.0] * 10
    with pytest.raises(LossSettingError) as err:
        TimestepMean(reduce="sum")
    assert err.value.setting == "timestep_reduce" and "'sum'" in err.value.problem


def test_timestep_bins_at_their_edges():
    mean = TimestepMean(bins=4, num_train_timesteps=1000)
    t = torch.tensor([-300, -3, 0, 249, 250, 999, 1000, 1500])
    assert mean.bin_of(t).tolist() == [0, 0, 0, 0, 1, 3, 3, 3]  # out of range: the first or the last bin
    assert TimestepMean(bins=1).bin_of(torch.tensor([0, 999])).tolist() == [0, 0]


def test_a_token_distance_name_is_checked():
    from imba.loss import token_distance

    x = torch.zeros(1, 1, 2, 2)
    assert token_distance(x, x + 1, 2).tolist() == [[1.0]]  # the default is the mean square
    with pytest.raises(LossSettingError) as err:
        token_distance(x, x, 2, "cos")
    assert err.value.setting == "distance"


def test_loss_stats_keep_scalars_in_the_mapping_and_tensors_apart():
    stats = LossStats({"loss": torch.tensor(2.0), "rate": 0.25}, {"per_sample": torch.ones(3)})
    assert list(stats) == ["loss", "rate"] and dict(stats) == {"loss": torch.tensor(2.0), "rate": 0.25}
    assert "loss" in stats and "rate" in stats and "absent" not in stats
    assert "per_sample" in stats and torch.equal(stats["per_sample"], torch.ones(3))
    assert stats.get("per_sample") is stats.tensors["per_sample"] and stats.get("absent", 7) == 7
    with pytest.raises(KeyError, match="absent"):
        stats["absent"]
    stats["loss"] = torch.arange(3.0)  # a tensor with dimensions moves out of the mapping
    assert list(stats) == ["rate"] and torch.equal(stats.tensors["loss"], torch.arange(3.0))
    stats["zero_d"] = torch.tensor(1.5)
    assert list(stats) == ["rate", "zero_d"] and "zero_d" not in stats.tensors
    floats = stats.floats()
    assert floats == {"rate": 0.25, "zero_d": 1.5} and all(type(v) is float for v in floats.values())
    assert LossStats().floats() == {}
    assert LossStats({"a": 1, "b": 2.5}).floats() == {"a": 1.0, "b": 2.5}  # no tensor at all
    assert repr(LossStats({"a": 1}, {"t": torch.ones(2, 3)})) == "LossStats({'a': 1}, tensors={t: (2, 3)})"


def test_floats_keep_float64_precision():
    stats = LossStats({"x": torch.tensor(1 + 2 ** -40, dtype=torch.float64), "y": 1 + 2 ** -40})
    assert stats.floats() == {"x": 1 + 2 ** -40, "y": 1 + 2 ** -40}


class _Config(dict):
    pass


class _Model(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config


def test_the_patch_size_is_read_through_every_wrapper_and_a_cycle_ends():
    class Attrs:
        patch_size = 4

    bare = _Model(_Config(patch_size=2))
    assert transformer_patch_size(bare) == 2
    assert transformer_patch_size(_Model(Attrs())) == 4  # a config object rather than a dict

    class Wrapper(torch.nn.Module):
        def __init__(self, inner, attribute):
            super().__init__()
            object.__setattr__(self, attribute, inner)

    compiled = Wrapper(bare, "_orig_mod")
    ddp = Wrapper(compiled, "module")
    assert transformer_patch_size(compiled) == 2 and transformer_patch_size(ddp) == 2

    class Loop:
        config = _Config(patch_size=8)

    loop = Loop()
    loop.module = loop  # a wrapper that names itself: unwrapping stops
    assert transformer_patch_size(loop) == 8
    with pytest.raises(LossSettingError) as err:
        transformer_patch_size(_Model(_Config(patch_size="2")))
    assert err.value.setting == "patch_size" and "_Model" in err.value.problem


def test_drop_masks_follow_the_generator_and_lam():
    loss_fn = IMBALoss(lam=0.5)
    a = loss_fn.draw_drop_mask(64, torch.Generator().manual_seed(3))
    b = loss_fn.draw_drop_mask(64, torch.Generator().manual_seed(3))
    assert torch.equal(a, b) and a.dtype == torch.bool and 0 < int(a.sum()) < 64
    assert not IMBALoss(lam=1.0).draw_drop_mask(256).any() and IMBALoss(lam=0.0).draw_drop_mask(256).all()


def test_efficient_uncond_refuses_a_drop_mask_of_the_wrong_dtype_or_shape():
    pred, uncond = torch.zeros(3, 2, 2, 2), torch.ones(3, 2, 2, 2)
    for drop in (torch.tensor([1, 0, 1]), torch.tensor([True, False])):
        with pytest.raises(ValueError, match=r"drop must be a bool tensor of shape \(3,\)"):
            IMBALoss.efficient_uncond(pred, uncond, drop)
    with pytest.raises(ValueError, match=r"each of shape \(2, 2, 2\); got \(1, 2, 2, 2\)"):
        IMBALoss.efficient_uncond(pred, uncond[:1], torch.tensor([True, False, False]))
    mixed = IMBALoss.efficient_uncond(pred.half(), uncond, torch.tensor([True, False, False]))
    assert mixed.dtype == torch.float16 and mixed[:, 0, 0, 0].tolist() == [0.0, 1.0, 1.0]


def test_a_call_with_a_wrongly_shaped_drop_or_uncond_is_refused():
    pred_cond, pred_uncond, target = _inputs(4)
    loss_fn = IMBALoss(patch_size=P)
    for drop in (torch.tensor([1, 0, 1, 0]), torch.tensor([True, False, True])):
        with pytest.raises(ValueError, match="drop must be a bool tensor"):
            loss_fn(pred_cond, pred_uncond, target, drop=drop)
    with pytest.raises(ValueError, match="pred_uncond has 4 channels and target 2"):
        loss_fn(pred_cond, torch.cat([pred_uncond, pred_uncond], dim=1), target)
    with pytest.raises(ValueError, match="pred_cond has 3 channels and target 2: they must be the same"):
        loss_fn(torch.zeros(B, 3, H, H, dtype=torch.float64), pred_uncond, target)
    with pytest.raises(ValueError, match="one shape"):
        loss_fn(pred_cond[:, :, 0], pred_uncond[:, :, 0], target)  # 3-D prediction, 4-D target
    with pytest.raises(ValueError, match="one shape"):  # not a channel count mismatch: the ranks differ
        loss_fn(pred_cond[:, :1, 0], pred_uncond, target)


def test_one_kept_row_is_the_conditional_loss_by_itself():
    pred_cond, pred_uncond, target = _inputs(6)
    drop = torch.tensor([True, True, False, True])
    _, stats = IMBALoss(patch_size=P, gamma=0.0)(pred_cond, pred_uncond, target, drop=drop)
    assert float(stats["imba/loss_cond_weighted"]) == pytest.approx(float((pred_cond[2] - target[2]).pow(2).mean()),
                                                               rel=1e-12)


def test_half_precision_inputs_are_computed_in_float32():
    pred_cond, pred_uncond, target = (x.bfloat16() for x in _inputs(7))
    loss, _ = IMBALoss(patch_size=P)(pred_cond, pred_uncond, target)
    plain, _ = plain_loss(pred_cond, target)
    assert loss.dtype == torch.float32 and plain.dtype == torch.float32
    want = (pred_cond.float() - target.float()).pow(2).mean()
    assert float(plain) == pytest.approx(float(want), rel=1e-6)  # bfloat16 arithmetic would be off by ~1e-3


def test_plain_loss_reports_its_loss_as_a_scalar_stat():
    pred, target = _inputs(5)[:2]
    weights = torch.tensor([1.0, 0.0, 2.0, 1.0])
    loss, stats = plain_loss(pred.float(), target.float(), weights)
    per_sample = (pred.float() - target.float()).pow(2).flatten(1).mean(dim=1)
    assert list(stats) == ["loss"] and float(stats["loss"]) == pytest.approx(float((weights * per_sample).mean()))
    assert loss.dtype == torch.float32 and torch.equal(stats["loss_per_sample"], per_sample)
