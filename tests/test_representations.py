"""Representation diagnostics: linear CKA, mutual k-NN alignment and the linear-probe ID/OOD gap, against values
worked out by hand and the invariances they are defined to have."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from imba.eval.representations import (attribute_nmi, diagnose, linear_cka, mutual_knn, mutual_knn_scores,
                                       probe_gap, ridge_probe)


def kernel_cka(x: torch.Tensor, y: torch.Tensor) -> float:
    """CKA in its kernel form, HSIC(K, L) / sqrt(HSIC(K, K) HSIC(L, L)) with K = XXᵀ, L = YYᵀ and the centring
    matrix H: an independent route to the value `linear_cka` computes in feature space."""
    n = x.shape[0]
    h = torch.eye(n, dtype=torch.float64) - 1.0 / n
    k, l = h @ (x @ x.T) @ h, h @ (y @ y.T) @ h
    return float((k * l).sum() / torch.sqrt((k * k).sum() * (l * l).sum()))


def test_linear_cka_by_hand():
    x = torch.tensor([[0.0], [1.0], [2.0]])
    # centred x = (-1, 0, 1); centred x² = (-5/3, -2/3, 7/3): (yᵀx)² = 16, xᵀx = 2, yᵀy = 78/9 → 16 / (2 · 78/9)
    assert linear_cka(x, x ** 2) == pytest.approx(12 / 13, rel=1e-12)
    assert linear_cka(x, 3 * x + 5) == pytest.approx(1.0, rel=1e-12)
    # both already centred: ||YᵀX||² = ||(2, 0)||² = 4, ||XᵀX||_F = ||diag(2, 2)||_F = √8, ||YᵀY|| = 2
    assert linear_cka(torch.tensor([[1.0, 0], [-1, 0], [0, 1], [0, -1]]),
                      torch.tensor([[1.0], [-1], [0], [0]])) == pytest.approx(1 / math.sqrt(2), rel=1e-12)


def test_linear_cka_matches_the_kernel_form_and_has_its_invariances():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 6, generator=g, dtype=torch.float64)
    y = x @ torch.randn(6, 9, generator=g, dtype=torch.float64) + 0.5 * torch.randn(40, 9, generator=g,
                                                                                     dtype=torch.float64)
    value = linear_cka(x, y)
    assert 0 < value < 1 and value == pytest.approx(kernel_cka(x, y), rel=1e-10)
    q, _ = torch.linalg.qr(torch.randn(9, 9, generator=g, dtype=torch.float64))
    assert linear_cka(x, y @ q) == pytest.approx(value, rel=1e-10)  # orthogonal transform
    assert linear_cka(x, 7.5 * y + 3.0) == pytest.approx(value, rel=1e-10)  # isotropic scaling, translation
    assert linear_cka(y, x) == pytest.approx(value, rel=1e-12)
    stretch = torch.ones(9, dtype=torch.float64)
    stretch[0] = 50.0
    assert abs(linear_cka(x, y * stretch) - value) > 1e-3  # not invariant to anisotropic scaling
    with pytest.raises(ValueError, match="same samples"):
        linear_cka(x, y[:-1])
    with pytest.raises(ValueError, match="constant"):
        linear_cka(x, torch.ones(40, 3))


def test_mutual_knn_by_hand():
    x = torch.tensor([[0.0], [1.0], [3.0], [7.0]])  # nearest other sample: 1, 0, 1, 2
    y = torch.tensor([[0.0], [5.0], [6.0], [8.0]])  # nearest other sample: 1, 2, 1, 2 → agree on samples 0, 2, 3
    assert mutual_knn(x, y, k=1, metric="euclidean") == pytest.approx(0.75)
    # k = 2: x's sets {1,2}, {0,2}, {1,0}, {2,1}; y's {2,1}... sample 0: y {1,2}; 1: {2,3}; 2: {1,3}; 3: {2,1}
    # overlaps 2, 1, 1, 2 → (2 + 1 + 1 + 2) / (4 · 2)
    assert mutual_knn(x, y, k=2, metric="euclidean") == pytest.approx(6 / 8)
    with pytest.raises(ValueError, match=r"k must be in \[1, n - 1\]"):
        mutual_knn(x, y, k=4)
    with pytest.raises(ValueError, match="metric"):
        mutual_knn(x, y, k=1, metric="manhattan")


@settings(max_examples=25, deadline=None)
@given(st.integers(8, 40), st.integers(1, 7), st.integers(0, 2**31 - 1))
def test_mutual_knn_of_a_set_with_itself_or_a_rotation_of_it_is_one(n, k, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 5, generator=g, dtype=torch.float64)
    q, _ = torch.linalg.qr(torch.randn(5, 5, generator=g, dtype=torch.float64))
    assert mutual_knn(x, x, k=min(k, n - 1)) == 1.0
    assert mutual_knn(x, 3 * x @ q, k=min(k, n - 1)) == 1.0  # cosine neighbours survive rotation and scaling


def test_mutual_knn_of_unrelated_sets_is_near_chance():
    g = torch.Generator().manual_seed(1)
    n, k = 400, 20
    value = mutual_knn(torch.randn(n, 8, generator=g), torch.randn(n, 8, generator=g), k=k)
    # chance is k / (n - 1) = 0.050; a sample's overlap is hypergeometric (sd 0.95 of 20 neighbours), so the mean
    # over 400 samples scatters by about 0.0035 from seed to seed: 0.0125 is 3.5 of those, a quarter of chance.
    # Counting the sample itself as a neighbour (+1/k = +0.05) or taking the farthest samples is far outside
    assert value == pytest.approx(k / (n - 1), abs=0.0125)


def test_probe_measures_the_gap_a_shape_feature_opens_on_unseen_combinations():
    """Two colours (the label) × two shapes; the seen pairs are (colour 0, shape 0) and (colour 1, shape 1). When
    the features also carry the shape, more strongly than the colour, the probe leans on it and reads the held-out
    pairs by their shape: OOD accuracy near 0. Without the shape feature the probe carries over: no gap."""
    g = torch.Generator().manual_seed(2)
    per_pair = 50
    colour = torch.tensor([0, 0, 1, 1]).repeat_interleave(per_pair)
    shape = torch.tensor([0, 1, 0, 1]).repeat_interleave(per_pair)
    seen = colour == shape
    noise = 0.2 * torch.randn(len(colour), 2, generator=g)
    signs = torch.stack([2.0 * colour - 1, 2.0 * shape - 1], dim=1)
    clean = signs * torch.tensor([1.0, 0.0]) + noise
    contaminated = signs * torch.tensor([1.0, 2.0]) + noise
    ok = probe_gap(clean, colour, seen)
    bad = probe_gap(contaminated, colour, seen)
    assert ok["id_accuracy"] == 1.0 and ok["ood_accuracy"] == 1.0 and ok["gap"] == 0.0
    # the least-squares weights follow the two features' sizes: b² - a² = 3 > 0 sends each unseen pair to its shape
    assert bad["id_accuracy"] == 1.0 and bad["ood_accuracy"] < 0.05 and bad["gap"] > 0.95
    assert ok["fit_samples"] + ok["id_samples"] == int(seen.sum()) and ok["ood_samples"] == int((~seen).sum())
    assert probe_gap(clean, colour, seen, seed=5)["id_samples"] == ok["id_samples"]
    with pytest.raises(ValueError, match="unseen"):
        probe_gap(clean, colour, torch.ones_like(seen))


def test_probe_accuracy_by_group_counts_only_the_samples_it_scored():
    colour = torch.tensor([0, 1] * 20)
    features = torch.nn.functional.one_hot(colour, 2).double()
    features[-4:] = features[-4:].flip(1)  # the last 4 (unseen) read as the other colour
    seen = torch.arange(40) < 32
    groups = ["head"] * 16 + ["tail"] * 16 + ["held_out"] * 8
    out = probe_gap(features, colour, seen, groups=groups)
    assert out["ood_accuracy"] == 0.5 and out["by_group"]["held_out"] == 0.5
    assert out["by_group"]["head"] == out["by_group"]["tail"] == 1.0
    with pytest.raises(ValueError, match="groups"):
        probe_gap(features, colour, seen, groups=groups[:-1])


def test_mutual_knn_scores_average_to_mutual_knn_and_keep_neighbours_from_the_whole_set():
    x = torch.tensor([[0.0], [1.0], [3.0], [7.0]])
    y = torch.tensor([[0.0], [5.0], [6.0], [8.0]])
    scores = mutual_knn_scores(x, y, k=1, metric="euclidean")
    assert scores.tolist() == [1.0, 0.0, 1.0, 1.0]  # from the worked example above: samples 0, 2, 3 agree
    assert float(scores.mean()) == mutual_knn(x, y, k=1, metric="euclidean")


def test_diagnose_aligns_prompts_probes_rows_and_splits_both_by_group():
    g = torch.Generator().manual_seed(0)
    prompts, draws = 30, 3
    colour = torch.arange(prompts) % 3
    text = torch.randn(prompts, 6, generator=g, dtype=torch.float64)
    rows = lambda t: t.repeat_interleave(draws, dim=0)  # noqa: E731
    q, _ = torch.linalg.qr(torch.randn(6, 6, generator=g, dtype=torch.float64))
    aligned = rows(text @ q) + 0.001 * torch.randn(prompts * draws, 6, generator=g, dtype=torch.float64)
    unrelated = torch.randn(prompts * draws, 8, generator=g, dtype=torch.float64)
    groups = [("head", "tail", "held_out")[i // 10] for i in range(prompts) for _ in range(draws)]
    seen = torch.tensor([grp != "held_out" for grp in groups])
    labels = {"colour": rows(colour)}
    result = diagnose([aligned, unrelated], rows(text), labels, groups, seen, k=5, draws=draws)
    assert result["prompts"] == 30 and result["rows"] == 90 and result["groups"] == {"head": 10, "tail": 10,
                                                                                    "held_out": 10}
    first, second = result["blocks"]
    # over prompts: the draw-averaged features of a rotation of the text align with it, noise does not
    per_prompt = aligned.reshape(prompts, draws, -1).mean(dim=1)
    assert first["cka"]["tail"] == pytest.approx(linear_cka(per_prompt[10:20], text[10:20]), rel=1e-12)
    assert first["cka"]["all"] > 0.99 and second["cka"]["all"] < 0.5
    assert first["mutual_knn"]["all"] > 0.95 and second["mutual_knn"]["all"] < 0.4
    scores = mutual_knn_scores(per_prompt, text, k=5)
    assert first["mutual_knn"]["head"] == pytest.approx(float(scores[:10].mean()), rel=1e-12)
    probe = first["probe"]["colour"]
    assert probe["ood_samples"] == 30 and set(probe["by_group"]) == {"head", "tail", "held_out"}
    with pytest.raises(ValueError, match="whole number"):
        diagnose([aligned[:-1]], rows(text)[:-1], {}, groups[:-1], seen[:-1], draws=draws)
    with pytest.raises(ValueError, match="group"):
        diagnose([aligned], rows(text), {}, ["tail"] + groups[1:], seen, draws=draws)


def test_ridge_probe_is_scale_free_and_exact_on_separable_points():
    x = torch.tensor([[0.0, 0.0], [0.0, 1.0], [4.0, 0.0], [4.0, 1.0]])
    labels = torch.tensor([7, 7, 9, 9])
    for scale in (1e-3, 1.0, 1e3):
        predict = ridge_probe(scale * x, labels)
        assert predict(scale * x).tolist() == [7, 7, 9, 9]
        assert predict(scale * torch.tensor([[1.0, 0.5], [3.0, 0.5]])).tolist() == [7, 9]
    assert not math.isnan(float(ridge_probe(x, labels)(x[:1]).double()))
    with pytest.raises(ValueError, match="fitted on 2-wide features"):
        ridge_probe(x, labels)(torch.ones(1, 3))


# ---------------------------------------------------------------------------------------------------------------
# features of a real (tiny) DiT
# ---------------------------------------------------------------------------------------------------------------


def test_block_features_pool_each_blocks_image_tokens_in_order_and_leave_the_model_as_it_was():
    from models.dit_features import block_features, caption_features
    from models.dit import PRESETS, build_transformer, predict

    torch.manual_seed(0)
    dit = build_transformer("micro", sample_size=8, caption_channels=16).eval()
    noisy = torch.randn(3, 4, 8, 8)
    t = torch.full((3,), 500)
    embeds = torch.randn(3, 5, 16)
    embeds[2] = embeds[0]  # captions 0 and 2 are the same
    mask = torch.ones(3, 5, dtype=torch.long)
    noisy[2] = noisy[0]
    with torch.no_grad():  # the model's output and weights before: after block_features they must be the same
        before = predict(dit, noisy, t, embeds, mask)
    weights = {name: p.clone() for name, p in dit.state_dict().items()}
    outputs = []
    watch = [b.register_forward_hook(lambda m, i, o: outputs.append(o)) for b in dit.transformer_blocks]
    feats = block_features(dit, noisy, t, embeds, mask)
    for handle in watch:
        handle.remove()
    hidden = PRESETS["micro"].hidden_size
    assert len(feats) == PRESETS["micro"].num_layers and all(f.shape == (3, hidden) for f in feats)
    assert all(torch.equal(f, o.mean(dim=1)) for f, o in zip(feats, outputs))  # image tokens (16 of them) pooled
    assert all(o.shape[1] == 16 for o in outputs)
    assert all(len(b._forward_hooks) == 0 for b in dit.transformer_blocks)
    assert torch.equal(feats[-1][0], feats[-1][2]) and not torch.allclose(feats[-1][0], feats[-1][1])
    with torch.no_grad():
        assert torch.equal(predict(dit, noisy, t, embeds, mask), before)
    assert not dit.training and all(torch.equal(p, weights[name]) for name, p in dit.state_dict().items())

    states = torch.tensor([[[1.0, 2.0], [3.0, 4.0], [100.0, 100.0]]])
    assert caption_features(states, torch.tensor([[1, 1, 0]])).tolist() == [[2.0, 3.0]]  # padding left out


def test_attribute_nmi_by_hand():
    assert attribute_nmi(torch.ones(3, 4)) == pytest.approx(0.0, abs=1e-12)  # independent
    assert attribute_nmi(torch.eye(5) * 7) == pytest.approx(1.0, rel=1e-12)  # each determines the other
    # p = [[1/2, 0], [1/4, 1/4]]: H(A) = ln 2, H(B) = H(3/4, 1/4), I = H(B) - H(B | A) = H(B) - ln 2 / 2
    h_b = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))
    want = 2 * (h_b - math.log(2) / 2) / (math.log(2) + h_b)
    assert attribute_nmi(torch.tensor([[2.0, 0.0], [1.0, 1.0]])) == pytest.approx(want, rel=1e-12)
    assert attribute_nmi(torch.tensor([[3.0, 0.0]])) == 0.0  # a constant attribute
    with pytest.raises(ValueError, match="non-negative"):
        attribute_nmi(torch.tensor([[1.0, -1.0]]))
