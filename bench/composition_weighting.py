"""The composition benchmark's weighting variants: the re-weighting baselines' loss (`HalfWeightedLoss`, with the
per-object weights of `inverse_frequency_weights` and `importance_weights`), the scene streams balanced by their
captions or by the online IMBA balance (`WeightedScenes`, and `OnlineSceneBalance`, the hook that feeds the online
one), and the IMBA weights shuffled within their noise level (`weights_shuffled_within_levels`)."""

from __future__ import annotations

from collections import Counter

import torch

from composition_scenes import COLOURS, SHAPES, TILE, pair_name
from composition_variants import BALANCE_EVERY, WEIGHTED_STREAMS, imba_rows

from data.online_balance import FACTOR_ONE
from imba.loss import token_distance


def inverse_frequency_weights(pool_pairs: list[tuple[int, int]]) -> dict[tuple[int, int], float]:
    """Per-object weight = mean over its concepts of 1 / (concept frequency), normalised to mean 1 over the pool's
    tiles; concept counts come from the project's concept statistics over the tiles' captions."""
    from data.concepts import count_concepts

    stats = count_concepts([f"a {pair_name(p)}" for p in pool_pairs])
    total = len(pool_pairs)
    raw = {p: 0.5 * (total / stats.counts[COLOURS[p[0]]] + total / stats.counts[SHAPES[p[1]]])
           for p in set(pool_pairs)}
    mean = sum(raw[p] for p in pool_pairs) / total
    return {p: w / mean for p, w in raw.items()}


def importance_weights(pool_pairs: list[tuple[int, int]]) -> dict[tuple[int, int], float]:
    """Per-object weight p_balanced(pair) / p_pool(pair) (mean 1 over the pool's tiles by construction). On each
    half's tokens it turns the long-tailed stream's expected loss of that half into the loss of a half whose object
    is pair-balanced (its partner still long-tailed); the product of the two halves' ratios is the exact ratio of
    the whole scene, whose objects the balanced stream draws independently."""
    counts = Counter(pool_pairs)
    return {p: len(pool_pairs) / (len(counts) * n) for p, n in counts.items()}


def half_weighted_loss(pred: torch.Tensor, target: torch.Tensor, left: torch.Tensor, right: torch.Tensor
                       ) -> torch.Tensor:
    """Plain MSE with each half's pixels (so each half's tokens: a token never straddles the halves at patch 4)
    weighted by its own weight, `left` and `right` (B,)."""
    err = (pred.float() - target.float()).pow(2)
    width = err.shape[-1] // 2
    weights = torch.cat([left[:, None, None, None].expand(-1, 1, 1, width),
                         right[:, None, None, None].expand(-1, 1, 1, err.shape[-1] - width)], dim=3)
    return (err * weights).mean()


class HalfWeightedLoss:
    """The re-weighting baselines' loss (`Variant.reweight`), called as the trainer's loss is
    (`loss(predict, noised, cond, null, generator=, left=, right=)`): plain MSE with the caption dropout of
    `draw_drop` (the same draws as the training loss's), each half of a scene weighted by its tile's weight, or both
    halves by their product (`joint`)."""

    def __init__(self, draw_drop, tile_weight: torch.Tensor, joint: bool) -> None:
        self.draw_drop, self.tile_weight, self.joint = draw_drop, tile_weight, joint

    def __call__(self, predict, noised, cond, null, generator, left, right):
        drop = self.draw_drop(len(left), generator=generator)
        embeds = torch.where(drop[:, None, None], null[0], cond[0])
        mask = torch.where(drop[:, None], null[1], cond[1])
        pred = predict(noised.noisy, noised.timesteps, embeds, mask)
        w_left, w_right = self.tile_weight[left], self.tile_weight[right]
        if self.joint:
            w_left = w_right = w_left * w_right
        loss = half_weighted_loss(pred, noised.target, w_left, w_right)
        return loss, {"loss": loss.detach()}


class OnlineSceneBalance:
    """The online balance of `WeightedScenes` as a hook of the trainer's step (`imba.training.hooks`): each batch's
    first rows (`scored_rows`, as the trainer's rule scores them) measured by a no-grad unconditional pass at their
    own noisy inputs, their IMBA distance (over tokens of `patch` pixels) fed to the balance, whose factors refresh
    every BALANCE_EVERY steps."""

    def __init__(self, weighted: "WeightedScenes", num_train_timesteps: int, patch: int) -> None:
        self.weighted, self.num_train_timesteps, self.patch = weighted, num_train_timesteps, patch

    def micro_batch(self, step: int, batch: dict, stats, predict, noised, null) -> None:
        k = imba_rows(len(batch["chosen"]))
        with torch.no_grad():
            uncond = predict(noised.noisy[:k], noised.timesteps[:k], null[0][:k], null[1][:k])
        distance = token_distance(noised.target[:k], uncond, self.patch).mean(dim=1)
        self.weighted.observe(batch["chosen"][:k], distance, noised.timesteps[:k].double() / self.num_train_timesteps)

    def step_end(self, step: int, accelerator) -> None:
        if step % BALANCE_EVERY == 0:
            self.weighted.refresh()


class WeightedScenes:
    """The scene stream of a weighted variant (WEIGHTED_STREAMS): scenes drawn with replacement in proportion to a
    factor per scene, the natural stream being uniform over the scene pool. The factors come without labels, as a
    real data set's sampler would set them: from the entries `data.balance` extracts from the scenes' captions
    (concepts, attribute:object bindings, object pairs), from k-means clusters of the `scenes`' pooled pixels
    (`data.image_clusters`, "image"), or from both ("caption_image"). Fixed once by temperature with exponent `alpha`,
    or with the exponent data.balance=spread sets to `keep` that share of the effective samples; for "imba_online"
    the factors of `data.online_balance.OnlineBalance`, which move with the distances `observe` feeds it at every
    `refresh` (`online`: its rate and max_factor)."""

    def __init__(self, stream: str, captions: list[str], alpha: float | None = None, keep: float | None = None,
                 scenes: torch.Tensor | None = None, seed: int = 0, **online):
        from data.balance import SpreadBalance, TemperatureBalance, balance_factors, build_concept_table
        from data.concepts import default_extractor
        from data.image_clusters import cluster_table, default_clusters, join_tables, kmeans, pooled_features

        if stream not in WEIGHTED_STREAMS:
            raise ValueError(f"unknown weighted stream {stream!r}; choose one of {', '.join(WEIGHTED_STREAMS)}")
        self.stream = stream
        self.online, self.rule = None, TemperatureBalance(alpha) if keep is None else SpreadBalance(keep)
        tables = []
        if stream != "image":
            tables.append(build_concept_table(captions, default_extractor()))
        if stream in ("image", "caption_image"):  # the scenes' 4 x 4-pixel cells: their coarse layout of colour
            features = pooled_features(scenes.numpy(), (TILE // 4, 2 * TILE // 4))
            tables.append(cluster_table(kmeans(features, default_clusters(len(scenes)), seed=seed)))
        self.table = join_tables(*tables) if len(tables) == 2 else tables[0]
        if stream == "imba_online":
            from data.online_balance import OnlineBalance

            self.online = OnlineBalance(self.table, alpha=alpha, **online)
            self.factors = self._online_factors()
        else:
            self.factors = torch.from_numpy(balance_factors(self.table, self.rule))

    def _online_factors(self) -> torch.Tensor:
        return torch.from_numpy(self.online.sample_factors().astype("float64"))

    def draw(self, n: int, generator: torch.Generator) -> torch.Tensor:
        """n scene indices, each scene ∝ its factor."""
        return torch.multinomial(self.factors, n, replacement=True, generator=generator)

    def observe(self, scenes: torch.Tensor, distance: torch.Tensor, level: torch.Tensor) -> None:
        """Rows of these scenes: their IMBA distance (mean over the row's tokens) at noise level `level` in [0, 1)."""
        self.online.observe(scenes.numpy(), distance.double().numpy(), level.double().numpy())

    def refresh(self) -> None:
        self.online.refresh()
        self.factors = self._online_factors()

    def log(self) -> dict:
        """What the factors are now: the largest relative to a scene of the most frequent entry only, and how much
        more often than the uniform rate the most boosted scene is drawn; for the online balance also each rarity
        group's multiplier of its prior, its distance ratio and that ratio's standard error, and the refreshes."""
        scale = FACTOR_ONE if self.online is not None else 1.0
        out = {"max_rate_over_uniform": float(self.factors.max() / self.factors.mean()),
               "max_factor": float(self.factors.max()) / scale, "alpha": self.rule.alpha}
        if self.online is not None:
            ratio, se, _ = self.online.evidence()
            out.update(multipliers=[float(w) / FACTOR_ONE for w in self.online.weights], ratios=ratio.tolist(),
                       standard_errors=se.tolist(), refreshes=self.online.refreshes)
        return out


def weights_shuffled_within_levels(weights, level_of, generator: torch.Generator):
    """`IMBALoss.weights` with the rows' weights (all tokens of a row together) permuted among the rows of each
    timestep bin (`level_of(timesteps)`, the loss's own `TimestepMean.bin_of`), a fresh permutation per bin and call:
    every level keeps its weights' distribution, and which row gets which weights no longer depends on what the row
    shows."""

    def shuffled(pred_cond, pred_uncond, target, valid=None, timesteps=None):
        weight, d = weights(pred_cond, pred_uncond, target, valid, timesteps)
        level = level_of(timesteps)
        source = torch.arange(weight.shape[0])
        for b in level.unique().tolist():
            rows = torch.nonzero(level == b).flatten()
            source[rows] = rows[torch.randperm(rows.numel(), generator=generator)]
        return weight[source], d

    return shuffled
