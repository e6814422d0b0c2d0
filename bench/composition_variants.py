"""The composition benchmark's variants as data and the plan of its runs.

A variant (`Variant`, one entry of `VARIANTS`) is the trainer's own loss section (a kind of
`imba.loss_settings.LOSS_SETTINGS` with its settings), the objective, the stream and the levers, checked when it is
made: `variant(kind=..., **keys)` refuses a key nobody reads and a value outside its choices. The plan: the default
variants, seeds, worlds and lengths of each mode (the benchmark, --quick, --levers), the stream controls each
objective's gap is measured between, and each variant's compute per step and the lengths it trains to.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from composition_scenes import STREAMS

from data.online_balance import ImbaBalance
from imba.loss_settings import LOSS_SETTINGS, LossConfig, PlainLoss
from imba.objectives import OBJECTIVES
from imba.training.balancing import scored_rows


# A variant is data (`Variant`): the loss (the trainer's `loss` section, imba.loss_settings: its kind and that kind's
# settings: reference, normalize, estimator, ...), the objective (flow or ddpm, ε), the stream: which objects are drawn
# (composition_scenes.STREAMS), or, in fixed-scene mode, which scenes, in proportion to a factor per scene from its
# caption alone, without the pair labels (WEIGHTED_STREAMS: "caption" = data.balance temperature with exponent `alpha`,
# what a user of the data layer gets with data.balance=temperature, or with `keep` the exponent data.balance=spread
# sets from the captions' statistics; "image" the same rules over k-means clusters of the scenes' pooled pixels
# (data.image_clusters: no caption read), "caption_image" over both entries at once; "imba_online" = the weights of
# data.online_balance.OnlineBalance, set from the model's own IMBA distance per caption entry); reweight: plain MSE
# weighted per object half, each half's tokens by its own object's weight: the inverse frequency of its concepts
# (offline re-weighting as a user would do it) or the importance ratio p_balanced(pair) / p_pool(pair) of the pair-
# balanced stream ("importance"); "importance_joint" weighs both halves by the product of the two ratios, the exact
# ratio of the whole scene; hues / bursty / jitter: the data levers of composition_scenes (colour diversity: HUES-
# coloured tiles, half as many as the pool's; burstiness: the share of scenes whose second object takes the first one's
# colour; latent intervention: the largest hue rotation of a training tile, in turns).
WEIGHTED_STREAMS = ("caption", "image", "caption_image", "imba_online")
CAPTION_STREAMS = ("caption", "caption_image", "imba_online")  # the weighted streams that read captions
REWEIGHTS = ("inverse_freq", "importance", "importance_joint")


@dataclass(frozen=True)
class Variant:
    """One benchmark variant. Build it with `variant(**keys)`: a key it does not know is an error, never ignored."""

    loss: LossConfig = field(default_factory=PlainLoss)
    objective: str = "flow"
    stream: str = "long_tailed"
    alpha: float | None = None  # a weighted stream's temperature exponent
    keep: float | None = None  # or the share of effective samples its exponent is set to keep (data.balance=spread)
    reweight: str | None = None
    # the concept-specificity control: each row's token weights given to another row of the same noise-level bin
    shuffle_weights: bool = False
    hues: float = 0.0
    bursty: float = 0.0
    jitter: float = 0.0

    def __post_init__(self):
        for name, value, allowed in (("objective", self.objective, tuple(OBJECTIVES)),
                                     ("stream", self.stream, STREAMS + WEIGHTED_STREAMS),
                                     ("reweight", self.reweight, (None, *REWEIGHTS)),
                                     *((f"loss.{k}", getattr(self.loss, k), v) for k, v in self.loss.CHOICES.items())):
            if value not in allowed:
                raise ValueError(f"variant {name} must be one of {', '.join(map(str, allowed))}, got {value!r}")
        if ((self.alpha is not None) + (self.keep is not None) == 1) != (self.stream in WEIGHTED_STREAMS):
            raise ValueError(f"alpha or keep (one of them) sets the exponent of a weighted stream "
                             f"({', '.join(WEIGHTED_STREAMS)}): give it with one of them and only then (stream "
                             f"{self.stream}, alpha {self.alpha}, keep {self.keep})")
        if self.stream == "imba_online" and self.alpha is None:
            raise ValueError("the online balance starts from a temperature prior: give it alpha")
        if self.shuffle_weights and isinstance(self.loss, PlainLoss):
            raise ValueError("shuffle_weights permutes the IMBA loss's weights: the plain loss has none")
        self.loss.check()


def variant(kind: str = "plain", **keys) -> Variant:
    """A Variant from flat keys: the loss `kind` and that kind's settings, and the variant's own; any other key
    (a setting the loss kind does not read included) is a TypeError that names it."""
    if kind not in LOSS_SETTINGS:
        raise ValueError(f"variant loss kind must be one of {', '.join(LOSS_SETTINGS)}, got {kind!r}")
    loss = LOSS_SETTINGS[kind]
    settings = {f.name for f in fields(loss)}
    loss_keys = {k: keys.pop(k) for k in [k for k in keys if k in settings]}
    return Variant(loss=loss(**loss_keys), **keys)
VARIANTS = {
    "plain": variant(kind="plain"),
    "plain_balanced": variant(kind="plain", stream="pair_balanced"),
    "plain_concept_balanced": variant(kind="plain", stream="concept_balanced"),
    "inverse_freq": variant(kind="plain", reweight="inverse_freq"),
    "importance": variant(kind="plain", reweight="importance"),
    "importance_joint": variant(kind="plain", reweight="importance_joint"),
    "imba_target": variant(kind="imba", reference="target"),
    "imba_sample": variant(kind="imba_sample", reference="target"),
    "imba_target_tnorm": variant(kind="imba", reference="target", normalize="timestep_mean"),
    "imba_cond": variant(kind="imba", reference="cond"),
    "imba_cond_bnorm": variant(kind="imba", reference="cond", normalize="batch_mean"),
    "imba_cond_tnorm": variant(kind="imba", reference="cond", normalize="timestep_mean"),
    "imba_target_efficient": variant(kind="imba", reference="target", estimator="efficient"),
    "imba_target_tnorm_efficient": variant(kind="imba", reference="target", normalize="timestep_mean",
                                        estimator="efficient"),
    "imba_cond_tnorm_efficient": variant(kind="imba", reference="cond", normalize="timestep_mean",
                                      estimator="efficient"),
    # the concept-specificity control of the form above: each row's token weights given to another row of the same
    # noise-level bin (the weights' distribution per level kept, their link to the row they were measured on cut)
    "imba_target_tnorm_efficient_shuffled": variant(kind="imba", reference="target", normalize="timestep_mean",
                                                 estimator="efficient", shuffle_weights=True),
    "plain_eps": variant(kind="plain", objective="ddpm"),
    "plain_balanced_eps": variant(kind="plain", stream="pair_balanced", objective="ddpm"),
    "imba_target_eps": variant(kind="imba", reference="target", objective="ddpm"),
    "imba_target_tnorm_eps": variant(kind="imba", reference="target", normalize="timestep_mean", objective="ddpm"),
    "imba_cond_tnorm_eps": variant(kind="imba", reference="cond", normalize="timestep_mean", objective="ddpm"),
    "plain_hues": variant(kind="plain", hues=0.5),
    "plain_bursty": variant(kind="plain", bursty=0.5),
    "plain_jitter": variant(kind="plain", jitter=0.05),
    # data.balance=temperature at the shipped default exponent, and at full balancing
    "caption_balanced": variant(kind="plain", stream="caption", alpha=0.5),
    "caption_balanced_a1": variant(kind="plain", stream="caption", alpha=1.0),
    # data.balance=imba (data.online_balance.OnlineBalance) with its defaults: the temperature prior of
    # caption_balanced (alpha 0.5), four rarity groups, each moved by its IMBA distance beyond 4 standard errors
    "imba_grouped": variant(kind="plain", stream="imba_online", alpha=0.5),
    # the population's levers (composition_worlds.py): the exponent set by data.balance=spread at the share chosen on
    # the development worlds (SPREAD_KEEP), over the captions, over image clusters, over both; and the IMBA loss on
    # the caption-spread stream
    "caption_spread": variant(kind="plain", stream="caption", keep=0.6),
    "image_spread": variant(kind="plain", stream="image", keep=0.6),
    "caption_image_spread": variant(kind="plain", stream="caption_image", keep=0.6),
    "imba_caption_spread": variant(kind="imba", reference="target", normalize="timestep_mean", estimator="efficient",
                                   stream="caption", keep=0.6),
}
# the population study's variants: the two stream controls and the levers
POPULATION_VARIANTS = ["plain", "plain_balanced", "caption_spread", "image_spread", "caption_image_spread",
                       "imba_caption_spread"]
BALANCE_EVERY = 50  # steps between refreshes of the online balance's weights
# the default: the three streams and the IMBA form that loses least to plain at equal compute (bench/README.md)
DEFAULT_VARIANTS = ["plain", "plain_balanced", "plain_concept_balanced", "imba_target_tnorm_efficient"]
DEFAULT_SEEDS = [0, 1, 2, 3, 4]
DEFAULT_WORLDS = ("concept_tail", "pair_tail")  # "captioned" differs from pair_tail only for caption-reading streams
DEFAULT_STEPS = [1000, 1500]  # equal-step lengths; the plain-cost streams also run on to 1.3× the longest
# samples per pair in the default: 12 fits two worlds × 5 seeds in the benchmark's time budget
DEFAULT_PER_PAIR = 12
# the quick run: the default's variants and the label-free stream that closes most of the gap (bench/README.md)
QUICK_VARIANTS = ["plain", "plain_balanced", "plain_concept_balanced", "imba_target_tnorm_efficient",
                  "caption_balanced"]
QUICK_STEPS = [400]
# the data-levers experiment (`--levers`, online scenes, concept_tail world): the controls, the IMBA form to
# compare at equal compute, the three levers
LEVER_VARIANTS = ["plain", "plain_balanced", "imba_target_tnorm_efficient", "plain_hues", "plain_bursty",
                  "plain_jitter"]
LEVERS = ("hues", "bursty", "jitter")
# the long-tailed plain run and its pair-balanced control per objective: the balance gap is their difference
CONTROLS = {"flow": ("plain", "plain_balanced"), "ddpm": ("plain_eps", "plain_balanced_eps")}


def objective_of(variant: str) -> str:
    return VARIANTS[variant].objective


def imba_rows(batch_size: int) -> int:
    """Rows of each batch the online balance scores with a no-grad unconditional pass: the trainer's rule at
    data.balance's default fraction (an eighth of the batch)."""
    return scored_rows(ImbaBalance().fraction, batch_size)


def relative_cost(variant: str, batch_size: int = 32) -> float:
    """Nominal step cost relative to plain, from the passes it runs (a forward row with gradient = 3 units, without
    = 1; plain = 3B): literal IMBA 2B rows with gradient = 2.0; efficient B with gradient + λ·B without = 1.3;
    the online balance's plain step + `imba_rows(B)` rows without = 1 + imba_rows(B) / 3B (1.042 at B = 32).
    It places the controls' evaluation lengths; the comparisons use each run's counted compute."""
    spec = VARIANTS[variant]
    if spec.stream == "imba_online":
        return 1.0 + imba_rows(batch_size) / (3 * batch_size)
    if isinstance(spec.loss, PlainLoss):
        return 1.0
    return 1.3 if spec.loss.estimator == "efficient" else 2.0


def equal_compute_steps(length: int, cost: float) -> int:
    return round(length * cost)


def is_lever(variant: str) -> bool:
    return any(getattr(VARIANTS[variant], lever) for lever in LEVERS)


def is_stream_control(variant: str) -> bool:
    """The plain-cost runs the others are compared with at equal compute: plain on each stream of
    composition_scenes.STREAMS, and the levers. The caption- and IMBA-weighted streams are compared with them."""
    spec = VARIANTS[variant]
    return ((isinstance(spec.loss, PlainLoss) and not spec.reweight and spec.stream not in WEIGHTED_STREAMS)
            or is_lever(variant))


def train_lengths(variant: str, lengths: list[int], equal_compute: bool = True,
                  factors: tuple[float, ...] = (1.0, 1.3, 2.0), reach: bool = False, batch_size: int = 32) -> list[int]:
    """Where a run is evaluated: at each length, and for the stream controls and the data levers also at the
    longest length times the largest of `factors` (the nominal step costs of the benchmark's variants), so their
    success can be read at any other variant's compute, which lies between the shortest length and that point,
    by interpolation. Only the largest: a variant of another cost added to a study leaves the controls' lengths,
    and so their finished runs, as they were unless it is the costliest. With `reach`, a variant cheaper than the
    costliest also runs on to the controls' last point: evaluated at its length (equal steps) and where its own
    compute reaches the controls' there (equal compute), where the balance gap is widest."""
    if not equal_compute or not factors:
        return sorted(lengths)
    end = equal_compute_steps(max(lengths), max(factors))
    if is_stream_control(variant):
        return sorted({*lengths, end})
    cost = relative_cost(variant, batch_size)
    if reach and cost < max(factors):
        return sorted({*lengths, end, round(end / cost)})
    return sorted(lengths)

