"""IMBA numerics against an independent, loop-based reference written here (not shared with imba/loss.py)."""

import itertools

import pytest
import torch

from imba import IMBALoss, patchify, plain_loss


def reference_imba(pred_c, pred_u, tgt, gamma, lam, p, granularity="token", distance="mse",
                   reference="target", normalize="none"):
    """Explicit loops over samples and tokens, straight from the formulas in docs/method.md."""
    b, c, h, w = tgt.shape
    ref = tgt if reference == "target" else pred_c
    weights, cond_errs, dists = [], [], []
    for i in range(b):
        for y in range(0, h, p):
            for x in range(0, w, p):
                diff = (ref[i, :, y:y + p, x:x + p] - pred_u[i, :, y:y + p, x:x + p]).flatten().double()
                if distance == "mse":
                    d = (diff ** 2).mean()
                elif distance == "l1":
                    d = diff.abs().mean()
                else:
                    d = (diff ** 2).sum().sqrt()
                dists.append(d)
                err = (tgt[i, :, y:y + p, x:x + p] - pred_c[i, :, y:y + p, x:x + p]).flatten().double()
                cond_errs.append((err ** 2).mean())
    n_tok = (h // p) * (w // p)
    dists = torch.stack(dists).view(b, n_tok)
    cond_errs = torch.stack(cond_errs).view(b, n_tok)
    if granularity == "sample":
        weights = dists.mean(dim=1, keepdim=True).repeat(1, n_tok) ** gamma
    else:
        weights = dists ** gamma
    if normalize == "batch_mean":
        weights = weights / weights.mean()
    l_star = (weights * cond_errs).mean()
    l_u = ((tgt.double() - pred_u.double()) ** 2).mean()
    return lam * l_star + (1 - lam) * l_u


SHAPES = [(2, 4, 8, 8), (1, 3, 6, 10), (3, 1, 2, 2), (2, 4, 9, 6)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("granularity", ["token", "sample"])
@pytest.mark.parametrize("gamma,lam", [(0.8, 0.9), (0.0, 0.5), (2.0, 1.0), (0.3, 0.0)])
def test_matches_reference(shape, granularity, gamma, lam):
    p = 3 if shape == (2, 4, 9, 6) else 2
    g = torch.Generator().manual_seed(sum(shape))
    pc, pu, t = (torch.randn(shape, generator=g) for _ in range(3))
    loss, _ = IMBALoss(gamma=gamma, lam=lam, patch_size=p, granularity=granularity)(pc, pu, t)
    expected = reference_imba(pc, pu, t, gamma, lam, p, granularity)
    torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("distance,reference,normalize",
                         list(itertools.product(["mse", "l1", "l2"], ["target", "cond"], ["none", "batch_mean"])))
def test_switches_match_reference(distance, reference, normalize):
    g = torch.Generator().manual_seed(7)
    pc, pu, t = (torch.randn(2, 4, 4, 6, generator=g) for _ in range(3))
    fn = IMBALoss(gamma=0.8, lam=0.9, patch_size=2, distance=distance, reference=reference, normalize=normalize)
    expected = reference_imba(pc, pu, t, 0.8, 0.9, 2, "token", distance, reference, normalize)
    torch.testing.assert_close(fn(pc, pu, t)[0].double(), expected, rtol=1e-5, atol=1e-6)


def test_weight_carries_no_gradient():
    """d(L)/d(pred_u) must come only from the (1 − λ)·L_u term: D is a stop-gradient weight."""
    g = torch.Generator().manual_seed(0)
    pc = torch.randn(2, 4, 4, 4, generator=g, requires_grad=True)
    pu = torch.randn(2, 4, 4, 4, generator=g, requires_grad=True)
    t = torch.randn(2, 4, 4, 4, generator=g)
    lam = 0.9
    loss, _ = IMBALoss(gamma=0.8, lam=lam, patch_size=2)(pc, pu, t)
    loss.backward()
    expected_grad_u = (1 - lam) * 2 * (pu.detach() - t) / t.numel()
    torch.testing.assert_close(pu.grad, expected_grad_u)
    # and with lam = 1 the unconditional prediction gets no gradient at all
    pu.grad = None
    IMBALoss(gamma=0.8, lam=1.0, patch_size=2)(pc, pu, t)[0].backward()
    assert pu.grad is None or torch.count_nonzero(pu.grad) == 0


def test_reference_cond_weight_does_not_backprop_into_cond():
    """With reference=cond the weight uses p_c, still detached: the p_c gradient is D-weighted MSE only."""
    g = torch.Generator().manual_seed(1)
    pc = torch.randn(1, 1, 2, 2, generator=g, requires_grad=True)
    pu = torch.randn(1, 1, 2, 2, generator=g)
    t = torch.randn(1, 1, 2, 2, generator=g)
    loss, _ = IMBALoss(gamma=1.0, lam=1.0, patch_size=1, reference="cond")(pc, pu, t)
    loss.backward()
    d = (pc.detach() - pu) ** 2
    torch.testing.assert_close(pc.grad, d * 2 * (pc.detach() - t) / 4)


def test_gamma_zero_is_lambda_mixed_plain_mse():
    g = torch.Generator().manual_seed(3)
    pc, pu, t = (torch.randn(4, 4, 6, 6, generator=g) for _ in range(3))
    loss, _ = IMBALoss(gamma=0.0, lam=0.7, patch_size=2)(pc, pu, t)
    expected = 0.7 * plain_loss(pc, t)[0] + 0.3 * plain_loss(pu, t)[0]
    torch.testing.assert_close(loss, expected)


def test_larger_unconditional_error_gets_larger_weight():
    t = torch.zeros(1, 4, 4, 4)
    pu = torch.zeros(1, 4, 4, 4)
    pu[:, :, :2, :2] = 3.0  # token 0 (top-left patch): large unconditional error
    pu[:, :, :2, 2:] = 1.0  # token 1: small error; tokens 2, 3: none
    weight, d = IMBALoss(patch_size=2).weights(torch.zeros_like(t), pu, t)
    assert weight[0, 0] > weight[0, 1] > weight[0, 2]
    torch.testing.assert_close(d[0], torch.tensor([9.0, 1.0, 0.0, 0.0]))
    torch.testing.assert_close(weight[0, :2], torch.tensor([9.0 ** 0.8, 1.0]))


def test_patchify_follows_dit_token_order():
    x = torch.arange(2 * 4 * 6, dtype=torch.float32).view(1, 2, 4, 6)
    tokens = patchify(x, 2)
    assert tokens.shape == (1, 6, 8)
    # token 1 is the patch at rows 0-1, columns 2-3, channel-major
    assert tokens[0, 1].tolist() == [2, 3, 8, 9, 26, 27, 32, 33]


def test_defaults_match_design():
    fn = IMBALoss()
    assert (fn.gamma, fn.lam, fn.patch_size, fn.granularity, fn.distance, fn.reference, fn.normalize) == (
        0.8, 0.9, 2, "token", "mse", "target", "none")


def test_stats_hold_weight_spread_and_terms():
    g = torch.Generator().manual_seed(5)
    pc, pu, t = (torch.randn(2, 4, 4, 4, generator=g) for _ in range(3))
    loss, stats = IMBALoss()(pc, pu, t)
    for key in ("weight_mean", "weight_std", "loss_cond_weighted", "loss_uncond"):
        assert torch.isfinite(stats[f"imba/{key}"])
    torch.testing.assert_close(loss, 0.9 * stats["imba/loss_cond_weighted"] + 0.1 * stats["imba/loss_uncond"])
    assert stats["distance_per_sample"].shape == (2,)


def test_stats_are_named_so_that_they_cannot_overwrite_a_scripts_own_keys():
    """A script logs `{"loss": ...}` next to the stats: every scalar is prefixed ("imba/"), the tensors keep their
    names (they are not logged); `stats_prefix` picks another prefix, "" the bare names."""
    g = torch.Generator().manual_seed(6)
    pc, pu, t = (torch.randn(2, 4, 4, 4, generator=g) for _ in range(3))
    for drop in (None, torch.tensor([True, False])):
        loss, stats = IMBALoss()(pc, pu, t, drop=drop)
        assert stats and all(name.startswith("imba/") for name in stats), list(stats)
        assert {"loss": 1.0, **stats.floats()}["loss"] == 1.0 and stats.floats()["imba/loss"] == loss.item()
        assert set(stats.tensors) == {"distance_per_sample", "distance_per_token", "loss_cond_per_sample"}
    _, bare = IMBALoss(stats_prefix="")(pc, pu, t, drop=drop)
    _, other = IMBALoss(stats_prefix="train/imba_")(pc, pu, t, drop=drop)
    assert [f"imba/{name}" for name in bare] == list(stats) == [f"imba/{n[len('train/imba_'):]}" for n in other]


@pytest.mark.parametrize("kwargs,match", [
    (dict(granularity="pixel"), "granularity"), (dict(distance="cos"), "distance"),
    (dict(reference="uncond"), "reference"), (dict(normalize="softmax"), "normalize"),
    (dict(lam=1.5), "lam"), (dict(gamma=-1), "gamma"),
])
def test_bad_switches_fail_clearly(kwargs, match):
    with pytest.raises(ValueError, match=match):
        IMBALoss(**kwargs)


def test_bad_shapes_fail_clearly():
    with pytest.raises(ValueError, match="divisible"):
        IMBALoss(patch_size=2)(*(torch.zeros(1, 4, 5, 4) for _ in range(3)))
    with pytest.raises(ValueError, match="one shape"):
        IMBALoss()(torch.zeros(1, 4, 4, 4), torch.zeros(1, 4, 4, 4), torch.zeros(2, 4, 4, 4))


def test_timestep_mean_divides_by_the_running_mean_of_each_timestep_bin():
    """Two bins (timesteps below / above 500); hand-computed means over three batches, momentum 0.5."""
    from imba.loss import TimestepMean

    norm = TimestepMean(bins=2, momentum=0.5, num_train_timesteps=1000)
    w1 = torch.tensor([[1.0, 3.0], [10.0, 30.0], [4.0, 4.0]])  # row means 2, 20, 4
    out = norm(w1, torch.tensor([100.0, 900.0, 499.0]))
    # bin 0 sees rows 0 and 2 (mean 3), bin 1 row 1 (mean 20): first observations set the means
    torch.testing.assert_close(norm.means, torch.tensor([3.0, 20.0], dtype=torch.float64))
    torch.testing.assert_close(out, torch.tensor([[1 / 3, 1.0], [0.5, 1.5], [4 / 3, 4 / 3]]))
    out = norm(torch.tensor([[6.0, 6.0]]), torch.tensor([0.0]))  # only bin 0: 0.5·3 + 0.5·6 = 4.5
    torch.testing.assert_close(norm.means, torch.tensor([4.5, 20.0], dtype=torch.float64))
    torch.testing.assert_close(out, torch.tensor([[6 / 4.5, 6 / 4.5]]))
    # invalid rows (no weight defined) neither update the means nor matter
    out = norm(torch.tensor([[1e6, 1e6], [40.0, 40.0]]), torch.tensor([10.0, 999.0]),
               valid=torch.tensor([False, True]))
    torch.testing.assert_close(norm.means, torch.tensor([4.5, 30.0], dtype=torch.float64))
    torch.testing.assert_close(out[1], torch.tensor([40 / 30, 40 / 30]))


def test_timestep_mean_ignores_non_finite_weights():
    from imba.loss import TimestepMean

    norm = TimestepMean(bins=2, momentum=0.5)
    norm(torch.tensor([[2.0, 2.0], [8.0, 8.0]]), torch.tensor([0.0, 900.0]))
    out = norm(torch.tensor([[float("inf"), 1.0], [float("nan"), 1.0], [4.0, 4.0]]), torch.tensor([0.0, 900.0, 10.0]))
    torch.testing.assert_close(norm.means, torch.tensor([3.0, 8.0], dtype=torch.float64))  # only the finite row
    torch.testing.assert_close(out[2], torch.tensor([4 / 3, 4 / 3]))


def test_timestep_mean_removes_the_scale_of_each_noise_level():
    """Distances that differ by 1000× between noise levels give weights of the same size once normalised."""
    g = torch.Generator().manual_seed(0)
    base = torch.rand(64, 4, generator=g) + 0.1
    timesteps = torch.tensor([10.0, 990.0] * 32)
    scaled = base * torch.where(timesteps > 500, 1000.0, 1.0)[:, None]
    norm = IMBALoss(gamma=1.0, normalize="timestep_mean", timestep_bins=4).timestep_mean
    out = norm(scaled, timesteps)
    low, high = out[timesteps < 500], out[timesteps > 500]
    assert low.mean().item() == pytest.approx(1.0) and high.mean().item() == pytest.approx(1.0)
    torch.testing.assert_close(high, base[timesteps > 500] / base[timesteps > 500].mean())


def test_timestep_mean_loss_state_round_trip_continues_identically():
    g = torch.Generator().manual_seed(1)
    batches = [(tuple(torch.randn(4, 2, 4, 4, generator=g) for _ in range(3)), torch.rand(4, generator=g) * 1000)
               for _ in range(4)]
    a = IMBALoss(normalize="timestep_mean", reference="cond")
    for (pc, pu, t), steps in batches[:2]:
        a(pc, pu, t, timesteps=steps)
    b = IMBALoss(normalize="timestep_mean", reference="cond")
    b.timestep_mean.load_state_dict(a.timestep_mean.state_dict())
    for (pc, pu, t), steps in batches[2:]:
        assert torch.equal(a(pc, pu, t, timesteps=steps)[0], b(pc, pu, t, timesteps=steps)[0])
    fresh = IMBALoss(normalize="timestep_mean", reference="cond")
    (pc, pu, t), steps = batches[3]
    assert not torch.equal(fresh(pc, pu, t, timesteps=steps)[0], a(pc, pu, t, timesteps=steps)[0])
    with pytest.raises(ValueError, match="3 bins, this loss 10"):
        IMBALoss(normalize="timestep_mean").timestep_mean.load_state_dict(
            {"means": torch.ones(3, dtype=torch.float64), "seen": torch.ones(3, dtype=torch.bool)})


def test_timestep_mean_needs_the_timesteps():
    pc = pu = t = torch.zeros(1, 1, 2, 2)
    with pytest.raises(ValueError, match="needs the batch's timesteps"):
        IMBALoss(normalize="timestep_mean")(pc, pu, t)


def test_training_loss_carries_the_timestep_means_in_its_state():
    from imba.objectives import NoisedBatch
    from imba.loss_settings import ImbaLoss
    from imba.training_loss import ImbaTrainingLoss, PlainTrainingLoss

    g = torch.Generator().manual_seed(2)
    noised = NoisedBatch(noisy=torch.randn(4, 2, 4, 4, generator=g), timesteps=torch.tensor([5.0, 250, 600, 999]),
                         target=torch.randn(4, 2, 4, 4, generator=g))
    cond = (torch.randn(4, 3, 8, generator=g), torch.ones(4, 3))
    null = (torch.zeros(4, 3, 8), torch.ones(4, 3))
    weight = torch.randn(2, 2, 1, 1, generator=g)

    def predict(noisy, timesteps, embeds, mask):  # any function of its inputs will do
        return noisy * weight.squeeze(-1).squeeze(-1).sum(1).view(1, 2, 1, 1) + embeds.mean(dim=(1, 2)).view(-1, 1, 1, 1)

    loss = ImbaLoss(normalize="timestep_mean").build(patch_size=2)  # as the run builds it
    assert loss.state_dict()["timestep_mean"]["seen"].sum() == 0
    loss(predict, noised, cond, null)
    state = loss.state_dict()["timestep_mean"]
    assert state["seen"].nonzero().flatten().tolist() == [0, 2, 6, 9]
    restored = ImbaTrainingLoss(patch_size=2, normalize="timestep_mean")
    restored.load_state_dict(loss.state_dict())
    for name, saved in loss.state_dict()["timestep_mean"].items():
        assert torch.equal(restored.state_dict()["timestep_mean"][name], saved), name
    assert torch.equal(restored(predict, noised, cond, null)[0], loss(predict, noised, cond, null)[0])
    assert ImbaTrainingLoss().state_dict() == {} and PlainTrainingLoss().state_dict() == {}
    plain = PlainTrainingLoss()
    plain.load_state_dict(loss.state_dict())  # another kind's checkpoint: the plain loss has no state to take
    assert plain.state_dict() == {}


def test_weighted_plain_loss_scales_each_samples_mse():
    pred = torch.zeros(3, 1, 2, 2)
    target = torch.stack([torch.full((1, 2, 2), v) for v in (1.0, 2.0, 3.0)])  # per-sample MSE 1, 4, 9
    loss, stats = plain_loss(pred, target, sample_weights=torch.tensor([2.0, 0.5, 0.0]))
    assert loss.item() == pytest.approx((2 * 1 + 0.5 * 4 + 0) / 3)
    assert stats["loss_per_sample"].tolist() == [1.0, 4.0, 9.0]
    assert plain_loss(pred, target)[0].item() == pytest.approx(14 / 3)
    with pytest.raises(ValueError, match=r"sample_weights must have shape \(3,\)"):
        plain_loss(pred, target, sample_weights=torch.ones(2))
