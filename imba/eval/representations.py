"""Representation diagnostics on plain tensors: how alike two feature sets are, and whether a linear read-out of a
concept carries over from seen to unseen concept combinations. Features are (n, d) tensors of the same n samples
(rows); everything runs in float64 on the CPU and returns Python numbers.

- `linear_cka(x, y)`: centred kernel alignment with linear kernels (Kornblith et al., 2019),
  ||Ycᵀ Xc||²_F / (||Xcᵀ Xc||_F · ||Ycᵀ Yc||_F) with column-centred Xc, Yc. 1 for sets that differ by an orthogonal
  transform, an isotropic scaling or a translation; 0 when the centred features are orthogonal across the sets.
- `mutual_knn(x, y, k)`: the mutual k-nearest-neighbour alignment of the platonic-representation work (Huh et
  al., 2024): the mean over samples i of |knn_x(i) ∩ knn_y(i)| / k, neighbours taken among the other samples by
  cosine similarity (or Euclidean distance). 1 for a set with itself; about k / (n − 1) for unrelated sets.
- `probe_gap(features, labels, seen)`: a ridge-regression linear probe for `labels`, fitted on part of the seen
  samples (e.g. images of concept pairs in the training data) and scored on the other seen samples (in
  distribution) and on the unseen ones (held-out pairs): the ID/OOD accuracy gap of feature-contamination work.
- `diagnose(blocks, text, labels, groups, seen)`: all of the above for each block of a network, overall and per
  group of samples (head / torso / tail / held-out concept buckets).
- `attribute_nmi(joint)`: the normalised mutual information of two attributes (e.g. colour and shape) from
  their joint counts in a training set, 2 I(A; B) / (H(A) + H(B)): 0 when independent, 1 when each determines
  the other; the data-side predictor of held-out composition in the work on data distributional properties.
"""

from __future__ import annotations

import math

import torch

__all__ = ["linear_cka", "mutual_knn", "mutual_knn_scores", "ridge_probe", "probe_gap", "diagnose",
           "attribute_nmi"]


def _matrix(name: str, x: torch.Tensor, rows: int | None = None, min_rows: int = 2) -> torch.Tensor:
    x = torch.as_tensor(x).detach().to("cpu", torch.float64)
    if x.ndim != 2 or x.shape[0] < min_rows:
        raise ValueError(f"{name} must be (n, d) with n >= {min_rows} samples, got shape {tuple(x.shape)}")
    if rows is not None and x.shape[0] != rows:
        raise ValueError(f"{name} has {x.shape[0]} rows, the other set {rows}: both must hold the same samples")
    if not torch.isfinite(x).all():
        raise ValueError(f"{name} holds non-finite values")
    return x


def linear_cka(x: torch.Tensor, y: torch.Tensor) -> float:
    """Linear CKA of two feature sets of the same n samples, (n, d1) and (n, d2); in [0, 1]."""
    x = _matrix("x", x)
    y = _matrix("y", y, x.shape[0])
    x = x - x.mean(dim=0)
    y = y - y.mean(dim=0)
    cross = torch.linalg.matrix_norm(y.T @ x) ** 2
    norms = torch.linalg.matrix_norm(x.T @ x) * torch.linalg.matrix_norm(y.T @ y)
    if norms == 0:
        raise ValueError("linear CKA is undefined when a feature set is constant over the samples")
    return float(cross / norms)


def _neighbours(x: torch.Tensor, k: int, metric: str) -> torch.Tensor:
    if metric == "cosine":
        x = torch.nn.functional.normalize(x, dim=1)
        score = x @ x.T
    elif metric == "euclidean":
        score = -torch.cdist(x, x)
    else:
        raise ValueError(f"metric must be 'cosine' or 'euclidean' (got {metric!r})")
    score.fill_diagonal_(-math.inf)  # a sample is not its own neighbour
    return score.topk(k, dim=1).indices


def mutual_knn_scores(x: torch.Tensor, y: torch.Tensor, k: int = 10, metric: str = "cosine") -> torch.Tensor:
    """Per sample i, |knn_x(i) ∩ knn_y(i)| / k over the whole set: (n,) float64. Averaging it over a subset gives
    that subset's alignment with neighbours still drawn from every sample (same k, same chance level)."""
    x = _matrix("x", x)
    y = _matrix("y", y, x.shape[0])
    n = x.shape[0]
    if not 1 <= k <= n - 1:
        raise ValueError(f"k must be in [1, n - 1] = [1, {n - 1}] (got {k})")
    nx, ny = _neighbours(x, k, metric), _neighbours(y, k, metric)
    in_x = torch.zeros(n, n, dtype=torch.bool).scatter_(1, nx, True)
    return in_x.gather(1, ny).sum(dim=1).double() / k


def mutual_knn(x: torch.Tensor, y: torch.Tensor, k: int = 10, metric: str = "cosine") -> float:
    """Mutual k-NN alignment of two feature sets of the same n samples; in [0, 1]."""
    return float(mutual_knn_scores(x, y, k, metric).mean())


def ridge_probe(x: torch.Tensor, labels: torch.Tensor, ridge: float = 1e-3):
    """A linear classifier fitted by ridge regression onto one-hot labels (with a bias; `ridge` relative to the
    features' mean squared norm, so the fit does not depend on their scale). Returns predict(features) -> labels."""
    x = _matrix("features", x)
    labels = torch.as_tensor(labels).long().cpu()
    if labels.shape != (x.shape[0],):
        raise ValueError(f"labels must be ({x.shape[0]},), got {tuple(labels.shape)}")
    classes = torch.unique(labels)
    mean = x.mean(dim=0)
    centred = x - mean
    targets = (labels[:, None] == classes[None, :]).double()
    gram = centred.T @ centred
    strength = ridge * float(gram.trace()) / gram.shape[0]
    weights = torch.linalg.solve(gram + strength * torch.eye(gram.shape[0], dtype=gram.dtype),
                                 centred.T @ (targets - targets.mean(dim=0)))
    bias = targets.mean(dim=0)

    def predict(features: torch.Tensor) -> torch.Tensor:
        f = _matrix("features", features, min_rows=1)
        if f.shape[1] != mean.shape[0]:
            raise ValueError(f"the probe was fitted on {mean.shape[0]}-wide features, got {f.shape[1]}")
        return classes[((f - mean) @ weights + bias).argmax(dim=1)]

    return predict


def probe_gap(features: torch.Tensor, labels: torch.Tensor, seen: torch.Tensor, fit_fraction: float = 0.5,
              seed: int = 0, ridge: float = 1e-3, groups: list[str] | None = None) -> dict:
    """Fit `ridge_probe` on a `fit_fraction` of the seen samples (drawn with `seed`), then score it on the rest of
    the seen samples ("id_accuracy") and on all unseen ones ("ood_accuracy"); "gap" = id − ood. With `groups` (a
    name per sample, e.g. its concept bucket), "by_group" holds the accuracy over each group's scored samples
    (the ones not fitted on)."""
    features = _matrix("features", features)
    labels = torch.as_tensor(labels).long().cpu()
    seen = torch.as_tensor(seen).bool().cpu()
    if labels.shape != seen.shape or labels.shape != (features.shape[0],):
        raise ValueError(f"labels and seen must both be ({features.shape[0]},), got {tuple(labels.shape)} and "
                         f"{tuple(seen.shape)}")
    if not 0 < fit_fraction < 1:
        raise ValueError(f"fit_fraction must be in (0, 1) (got {fit_fraction})")
    seen_idx = torch.nonzero(seen).flatten()
    unseen_idx = torch.nonzero(~seen).flatten()
    order = seen_idx[torch.randperm(len(seen_idx), generator=torch.Generator().manual_seed(seed))]
    n_fit = int(round(fit_fraction * len(order)))
    if n_fit < 2 or n_fit == len(order) or len(unseen_idx) == 0:
        raise ValueError(f"need >= 2 seen samples to fit, >= 1 to score and >= 1 unseen (got {len(order)} seen, "
                         f"{len(unseen_idx)} unseen, fit_fraction {fit_fraction})")
    fit, held = order[:n_fit], order[n_fit:]
    predict = ridge_probe(features[fit], labels[fit], ridge)
    id_acc = float((predict(features[held]) == labels[held]).double().mean())
    ood_acc = float((predict(features[unseen_idx]) == labels[unseen_idx]).double().mean())
    out = {"id_accuracy": id_acc, "ood_accuracy": ood_acc, "gap": id_acc - ood_acc, "fit_samples": len(fit),
           "id_samples": len(held), "ood_samples": len(unseen_idx)}
    if groups is not None:
        if len(groups) != features.shape[0]:
            raise ValueError(f"groups names {len(groups)} samples, features hold {features.shape[0]}")
        scored = torch.cat([held, unseen_idx])
        right = predict(features[scored]) == labels[scored]
        by_group: dict[str, list[bool]] = {}
        for i, ok in zip(scored.tolist(), right.tolist()):
            by_group.setdefault(groups[i], []).append(ok)
        out["by_group"] = {g: sum(v) / len(v) for g, v in by_group.items()}
    return out


def diagnose(blocks: list[torch.Tensor], text: torch.Tensor, labels: dict[str, torch.Tensor], groups: list[str],
             seen: torch.Tensor, k: int = 10, seed: int = 0, draws: int = 1) -> dict:
    """Alignment and probes per block of a network, overall and per group of prompts (e.g. concept buckets).

    Rows are prompt × draws + draw (several noise draws per prompt, as `models.dit_features.prompt_features`
    returns them): `blocks` holds one (rows, d) feature set per block, `text` the (rows, D) features to align them
    with (the caption embeddings, the same for every draw of a prompt), `labels` one (rows,) integer label per
    probe (e.g. {"colour": ..., "shape": ...}), `groups` a name per row and `seen` (rows,) which rows' concepts the
    training data showed together.
    - Alignment is over prompts: each block's features are averaged over a prompt's draws. Linear CKA is computed
      within each group (None under 3 prompts); mutual k-NN takes neighbours among all prompts and averages the
      per-prompt scores over each group (`mutual_knn_scores`).
    - Probes are over rows: `probe_gap` with the groups, so "by_group" holds each group's scored accuracy.
    Returns {"blocks": [{"cka": {"all", <group>...}, "mutual_knn": {...}, "probe": {name: probe_gap(...)}}],
    "prompts", "rows", "groups": {name: prompts}}."""
    rows = text.shape[0]
    if draws < 1 or rows % draws:
        raise ValueError(f"{rows} rows are not a whole number of prompts × {draws} draws")
    if len(groups) != rows:
        raise ValueError(f"groups names {len(groups)} rows, text features hold {rows}")
    n = rows // draws
    prompt_groups = groups[::draws]
    if any(groups[i] != prompt_groups[i // draws] for i in range(rows)):
        raise ValueError("every draw of a prompt must be in the prompt's group")
    prompt_text = _matrix("text", text, rows)[::draws]
    members = {"all": torch.arange(n)}
    for name in dict.fromkeys(prompt_groups):
        members[name] = torch.tensor([i for i, g in enumerate(prompt_groups) if g == name])
    out = []
    for features in blocks:
        features = _matrix("block features", features, rows)
        per_prompt = features.reshape(n, draws, -1).mean(dim=1)
        scores = mutual_knn_scores(per_prompt, prompt_text, k) if n >= k + 1 else None
        cka, knn = {}, {}
        for name, idx in members.items():
            x, y = per_prompt[idx], prompt_text[idx]
            constant = len(idx) < 3 or bool((x == x[0]).all()) or bool((y == y[0]).all())
            cka[name] = None if constant else linear_cka(x, y)
            knn[name] = None if scores is None else float(scores[idx].mean())
        probes = {label: probe_gap(features, values, seen, seed=seed, groups=groups)
                  for label, values in labels.items()}
        out.append({"cka": cka, "mutual_knn": knn, "probe": probes})
    return {"blocks": out, "prompts": n, "rows": rows,
            "groups": {g: len(idx) for g, idx in members.items() if g != "all"}}


def attribute_nmi(joint: torch.Tensor) -> float:
    """NMI of two attributes from their joint counts or probabilities, an (A, B) non-negative table."""
    p = torch.as_tensor(joint).detach().to("cpu", torch.float64)
    if p.ndim != 2 or (p < 0).any() or not torch.isfinite(p).all() or p.sum() <= 0:
        raise ValueError(f"joint must be a non-negative, finite (A, B) table with a positive sum, got shape "
                         f"{tuple(p.shape)}")
    p = p / p.sum()
    pa, pb = p.sum(dim=1), p.sum(dim=0)

    def entropy(q: torch.Tensor) -> float:
        q = q[q > 0]
        return float(-(q * q.log()).sum())

    ha, hb = entropy(pa), entropy(pb)
    if ha + hb == 0:
        return 0.0  # both attributes constant: nothing to share
    nz = p > 0
    mutual = float((p[nz] * (p[nz] / (pa[:, None] * pb[None, :])[nz]).log()).sum())
    return max(0.0, 2 * mutual / (ha + hb))
