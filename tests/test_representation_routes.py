"""The representation diagnostics against independent routes to the same numbers: mutual k-NN by explicit
neighbour sets, the ridge probe by the SVD form of ridge regression; every input's NaN and inf refused; the bounds
of k, of the group size for CKA and of fit_fraction at their edges."""

import math

import numpy as np
import pytest
import torch

from imba.eval.representations import (attribute_nmi, diagnose, linear_cka, mutual_knn, mutual_knn_scores,
                                       probe_gap, ridge_probe)


def _brute_force_knn(x, y, k, metric):
    """|knn_x(i) ∩ knn_y(i)| / k with each neighbour set found by sorting the other samples one by one."""
    def neighbours(f, i):
        others = [j for j in range(len(f)) if j != i]
        if metric == "cosine":
            key = lambda j: -float(np.dot(f[i], f[j]) / (np.linalg.norm(f[i]) * np.linalg.norm(f[j])))  # noqa: E731
        else:
            key = lambda j: float(np.linalg.norm(f[i] - f[j]))  # noqa: E731
        return set(sorted(others, key=key)[:k])
    x, y = x.numpy(), y.numpy()
    return [len(neighbours(x, i) & neighbours(y, i)) / k for i in range(len(x))]


@pytest.mark.parametrize("metric", ["cosine", "euclidean"])
@pytest.mark.parametrize("k", [1, 3, 11])  # 11 = n - 1: every other sample, the closed upper bound
def test_mutual_knn_scores_equal_explicit_neighbour_sets(metric, k):
    g = torch.Generator().manual_seed(k)
    x = torch.randn(12, 4, generator=g, dtype=torch.float64)
    y = x[:, :2] @ torch.randn(2, 5, generator=g, dtype=torch.float64) + torch.randn(12, 5, generator=g,
                                                                                   dtype=torch.float64)
    want = _brute_force_knn(x, y, k, metric)
    assert mutual_knn_scores(x, y, k, metric).tolist() == pytest.approx(want, abs=1e-12)
    assert mutual_knn(x, y, k, metric) == pytest.approx(sum(want) / len(want), abs=1e-12)
    if k == 11:
        assert want == [1.0] * 12
    else:
        assert 0 < sum(want) / len(want) < 1  # the sets are neither identical nor disjoint: the test can tell


def test_k_outside_one_to_n_minus_one_is_refused():
    x = torch.randn(5, 3, dtype=torch.float64)
    assert mutual_knn(x, x, k=4) == 1.0
    for k in (0, 5):
        with pytest.raises(ValueError, match="k must be in"):
            mutual_knn(x, x, k=k)


def _reference_probe_scores(x, labels, ridge, features):
    """Ridge regression onto centred one-hot targets through the SVD of the centred features, plus the targets'
    mean as the bias: scores per class, columns in sorted-label order."""
    x, features = x.numpy(), features.numpy()
    classes = np.unique(labels.numpy())
    targets = (labels.numpy()[:, None] == classes[None, :]).astype(np.float64)
    mean = x.mean(axis=0)
    centred = x - mean
    u, s, vt = np.linalg.svd(centred, full_matrices=False)
    strength = ridge * (centred ** 2).sum() / x.shape[1]  # the trace of the Gram matrix over its size
    weights = vt.T @ np.diag(s / (s ** 2 + strength)) @ u.T @ (targets - targets.mean(axis=0))
    return classes, (features - mean) @ weights + targets.mean(axis=0)


@pytest.mark.parametrize("ridge", [1e-3, 0.5, 20.0])
def test_ridge_probe_predicts_the_argmax_of_the_reference_ridge_fit(ridge):
    g = torch.Generator().manual_seed(3)
    centres = 2 * torch.randn(3, 6, generator=g, dtype=torch.float64)
    which = torch.tensor([0] * 36 + [1] * 18 + [2] * 6)  # unequal classes: the bias (class shares) matters
    labels = torch.tensor([5, 1, 9])[which]
    x = centres[which] + 1.5 * torch.randn(60, 6, generator=g, dtype=torch.float64) + 4.0
    test = 3 * torch.randn(200, 6, generator=g, dtype=torch.float64) + 4.0
    classes, scores = _reference_probe_scores(x, labels, ridge, test)
    want = classes[scores.argmax(axis=1)]
    top2 = np.sort(scores, axis=1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 1e-9  # points the two solvers' rounding cannot split
    got = ridge_probe(x, labels, ridge)(test).numpy()
    assert clear.sum() > 190 and (got[clear] == want[clear]).all()
    assert len(set(got.tolist())) >= 2  # more than one class predicted: the test sees the labels' order


def test_probe_gap_reports_its_split_and_the_gap_exactly():
    labels = torch.tensor([0, 1] * 10)
    features = torch.nn.functional.one_hot(labels, 2).double()
    features[-2:] = features[-2:].flip(1)  # the last 2 (unseen) read as the other label
    seen = torch.arange(20) < 16
    out = probe_gap(features, labels, seen, fit_fraction=0.25)
    assert (out["fit_samples"], out["id_samples"], out["ood_samples"]) == (4, 12, 4)
    assert out["id_accuracy"] == 1.0 and out["ood_accuracy"] == 0.5 and out["gap"] == 0.5
    for fraction in (0.0, 1.0):
        with pytest.raises(ValueError, match="fit_fraction"):
            probe_gap(features, labels, seen, fit_fraction=fraction)
    with pytest.raises(ValueError, match="need >= 2 seen samples"):
        probe_gap(features, labels, seen, fit_fraction=0.05)  # one sample to fit on
    with pytest.raises(ValueError, match="need >= 2 seen samples"):
        probe_gap(features, labels, seen, fit_fraction=0.99)  # nothing seen left to score


BAD = [float("nan"), float("inf"), float("-inf")]


@pytest.mark.parametrize("bad", BAD)
def test_a_non_finite_value_in_any_feature_input_is_refused(bad):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(12, 3, generator=g, dtype=torch.float64)
    poisoned = x.clone()
    poisoned[-1, -1] = bad  # the last value of the last sample
    labels, seen = torch.arange(12) % 2, torch.arange(12) < 8
    calls = [lambda: linear_cka(poisoned, x), lambda: linear_cka(x, poisoned),
             lambda: mutual_knn(poisoned, x, k=2), lambda: mutual_knn(x, poisoned, k=2),
             lambda: ridge_probe(poisoned, labels), lambda: ridge_probe(x, labels)(poisoned[-1:]),
             lambda: probe_gap(poisoned, labels, seen),
             lambda: diagnose([x], poisoned, {}, ["g"] * 12, seen, k=2),
             lambda: diagnose([poisoned], x, {}, ["g"] * 12, seen, k=2)]
    for call in calls:
        with pytest.raises(ValueError, match="non-finite"):
            call()
    table = torch.ones(2, 2)
    table[1, 1] = bad
    with pytest.raises(ValueError, match="non-negative, finite"):
        attribute_nmi(table)


def test_shapes_and_sample_counts_at_their_edges():
    one, two = torch.ones(1, 3), torch.tensor([[0.0, 1.0], [1.0, 0.0]])
    with pytest.raises(ValueError, match="n >= 2"):
        linear_cka(one, one)
    assert linear_cka(two, two) == pytest.approx(1.0)  # two samples: the fewest CKA is defined on
    with pytest.raises(ValueError, match="constant"):
        linear_cka(two, torch.tensor([[0.0, 1], [0, 1]]))  # the same features for both samples
    # centred sets that are orthogonal across the sets: CKA 0
    assert linear_cka(torch.tensor([[1.0], [-1.0], [0.0], [0.0]]),
                      torch.tensor([[0.0], [0.0], [1.0], [-1.0]])) == 0.0
    with pytest.raises(ValueError, match=r"\(n, d\)"):
        linear_cka(torch.ones(4), torch.ones(4))
    predict = ridge_probe(two, torch.tensor([3, 4]))
    assert predict(two[:1]).tolist() == [3]  # one row to predict is fine
    with pytest.raises(ValueError, match="labels must be"):
        ridge_probe(two, torch.tensor([3, 4, 5]))
    assert attribute_nmi(torch.tensor([[5.0]])) == 0.0
    with pytest.raises(ValueError):
        attribute_nmi(torch.zeros(2, 2))


def test_diagnose_gives_cka_from_three_prompts_and_knn_from_k_plus_one():
    g = torch.Generator().manual_seed(1)
    text = torch.randn(6, 4, generator=g, dtype=torch.float64)
    block = text @ torch.randn(4, 4, generator=g, dtype=torch.float64)
    groups = ["three"] * 3 + ["two"] * 2 + ["one"]
    seen = torch.tensor([True, True, True, True, False, False])
    out = diagnose([block], text, {}, groups, seen, k=5)  # 6 prompts = k + 1: mutual k-NN is defined
    first = out["blocks"][0]
    assert first["cka"]["three"] == pytest.approx(linear_cka(block[:3], text[:3]), rel=1e-12)
    assert first["cka"]["two"] is None and first["cka"]["one"] is None
    assert first["mutual_knn"]["all"] == 1.0  # k = n - 1: every other prompt is a neighbour in both
    assert diagnose([block], text, {}, groups, seen, k=6)["blocks"][0]["mutual_knn"]["all"] is None
    assert out["groups"] == {"three": 3, "two": 2, "one": 1} and out["prompts"] == 6
    assert math.isclose(first["cka"]["all"], linear_cka(block, text), rel_tol=1e-12)
