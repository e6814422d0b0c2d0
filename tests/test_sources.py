"""data.sources and data.balance: several shard sets with shares, concept weights from the captions, the stored
draw plan, the loader that draws it, and the one-line refusals."""

import dataclasses
import json
import os
import shutil
import warnings

import numpy as np
import pytest
from accelerate import Accelerator

from data.balance import (CapBalance, NoBalance, SpreadBalance, TemperatureBalance, balance_factors,
                          build_concept_table, caption_entries, effective_samples, entry_counts)
from data.concepts import default_extractor
from data.concepts.vocab import VocabExtractor
from data.settings import BALANCE_RULES
from data.draw_plan import describe_plan, load_plan, plan_draws, plan_fingerprint, plot_plan
from data.index import ShardIndex, load_or_build_index
from data.sources import Source, ShardsSource, SourceMix, check_same_kind, resolve_sources
from data.synthetic import write_synthetic_shards
from data.weighted import WeightedOrder
from imba.training.config import ConfigError, load_config
from imba.training.inputs import make_loader, training_sources
from imba.training.resume import StreamPosition


@pytest.fixture(scope="module")
def two_sets(tmp_path_factory):
    root = tmp_path_factory.mktemp("sources")
    big = write_synthetic_shards(root / "big", num_samples=90, samples_per_shard=40, resolution=32, seed=1)
    small = write_synthetic_shards(root / "small", num_samples=30, samples_per_shard=40, resolution=32, seed=2)
    return root, big, small


# ---- entries and weights ----------------------------------------------------------------------------------------


def test_a_caption_is_rare_for_its_concepts_its_bindings_and_its_pairs():
    extractor = default_extractor()
    entries = caption_entries(extractor("a red cross and a blue square"), extractor.kind)
    assert entries == ["red", "cross", "blue", "square", "red:cross", "blue:square", "cross + square"]
    assert caption_entries(extractor("a dog"), extractor.kind) == ["dog"]
    assert caption_entries([], extractor.kind) == []


def table_of(captions):
    return build_concept_table(captions, default_extractor())


def test_temperature_reaches_a_rare_combination_of_common_concepts():
    # red and cross are each in half the captions; the red cross itself is in 2 of 200
    captions = (["a red circle"] * 98 + ["a blue cross"] * 98 + ["a red cross"] * 2 + ["a blue circle"] * 2)
    table = table_of(captions)
    natural = balance_factors(table, TemperatureBalance(0.0))
    assert np.all(natural == 1)
    w = balance_factors(table, TemperatureBalance(1.0))
    # the factor of a sample is 1 / (count of its rarest entry), relative to the head: red:cross has count 2
    counts = dict(zip(table.entries, entry_counts(table)))
    assert counts["red:cross"] == 2 and counts["red"] == 100 and counts["cross"] == 100
    assert w[196] / w[0] == pytest.approx(counts["red:circle"] / counts["red:cross"])
    # alpha = 1: the samples of each rarest entry are drawn about equally often in total
    groups = {c: w[[i for i, x in enumerate(captions) if x == c]].sum() for c in set(captions)}
    assert max(groups.values()) / min(groups.values()) == pytest.approx(1.0)


def test_cap_is_metaclip_balancing_and_a_caption_without_concepts_is_weighted_like_the_head():
    captions = ["a red circle"] * 90 + ["a cyan ring"] * 10 + ["", "nothing known here"]
    table = table_of(captions)
    w = balance_factors(table, CapBalance(20))
    counts = dict(zip(table.entries, entry_counts(table)))
    # 1 - prod(1 - min(1, t / c_e)) over red, circle, red:circle (90 each)
    assert w[0] == pytest.approx(1 - (1 - 20 / 90) ** 3)
    assert w[90] == pytest.approx(1.0) and counts["cyan"] == 10  # an entry under the cap keeps the sample whole
    assert w[100] == w[101] == pytest.approx(20 / max(counts.values()))  # like a sample of the head entry alone
    t = balance_factors(table, TemperatureBalance(0.7))
    assert t[100] == t[101] == pytest.approx(1.0)  # the head's factor: never boosted, never dropped
    assert np.all(t[:90] == 1.0) and np.all(t[90:100] > 1)


def long_tail(steepness):
    """Captions of 8 colours of circles, colour k in about 200 / (k + 1) ** steepness of them."""
    colours = ("red", "blue", "green", "yellow", "purple", "orange", "black", "cyan")
    return [f"a {c} circle" for k, c in enumerate(colours) for _ in range(max(1, round(200 / (k + 1) ** steepness)))]


@pytest.mark.parametrize("keep", [0.6, 0.75, 0.9])
def test_spread_is_temperature_at_the_largest_alpha_that_keeps_its_share_of_the_effective_samples(keep):
    table = table_of(long_tail(2.0))
    rule = SpreadBalance(keep)
    factors = balance_factors(table, rule)
    assert 0 < rule.alpha < 1
    assert np.allclose(factors, balance_factors(table, TemperatureBalance(rule.alpha)), rtol=1e-12)
    natural = effective_samples(np.ones(len(table)))
    assert natural == pytest.approx(len(table))
    assert effective_samples(factors) >= keep * natural
    assert effective_samples(balance_factors(table, TemperatureBalance(rule.alpha + 1e-6))) < keep * natural
    assert f"alpha {rule.alpha:.3g}" in rule.describe() and f"keep {keep:.0%}" in rule.describe()


def test_spread_gives_a_steep_tail_a_smaller_alpha_than_a_mild_one_and_keep_1_is_natural():
    alphas = []
    for steepness in (0.5, 1.0, 2.0, 3.0):
        rule = SpreadBalance(0.6)
        balance_factors(table_of(long_tail(steepness)), rule)
        alphas.append(rule.alpha)
    assert alphas == sorted(alphas, reverse=True) and alphas[0] == 1.0 and alphas[-1] < 0.6
    natural = SpreadBalance(1.0)
    assert np.all(balance_factors(table_of(long_tail(2.0)), natural) == 1.0) and natural.alpha == 0.0
    assert SpreadBalance().describe() == "balanced by concepts (temperature, set to keep 60% of the effective samples)"
    # two sources drawn at rates 1 and 3: the effective samples are counted at those rates
    table = table_of(long_tail(2.0))
    rate = np.where(np.arange(len(table)) % 2, 3.0, 1.0)
    rated = SpreadBalance(0.6)
    factors = balance_factors(table, rated, rate)
    assert effective_samples(rate * factors) >= 0.6 * effective_samples(rate)
    assert effective_samples(rate * balance_factors(table, TemperatureBalance(rated.alpha + 1e-6), rate)) < (
        0.6 * effective_samples(rate))
    for keep in (0.0, 1.5, float("nan")):
        with pytest.raises(ValueError, match=r"data.balance.keep must be in \(0, 1\]"):
            SpreadBalance(keep).check()


def test_counts_follow_the_natural_draw_rate():
    table = table_of(["a red circle", "a red circle", "a cyan ring"])
    assert dict(zip(table.entries, entry_counts(table, np.array([1.0, 1.0, 4.0]))))["cyan"] == 4.0


def test_extraction_in_worker_processes_gives_the_same_table():
    captions = [f"a {c} {s} and a blue ring" for c in ("red", "green", "cyan") for s in ("circle", "star")] * 7
    one, two = build_concept_table(captions, default_extractor()), None
    import data.balance as balance

    chunk = balance.CHUNK
    balance.CHUNK = 5  # several chunks, merged in order
    try:
        two = build_concept_table(captions, default_extractor(), workers=2)
    finally:
        balance.CHUNK = chunk
    assert [one.sample_entries(i) for i in range(len(one))] == [two.sample_entries(i) for i in range(len(two))]


def test_no_caption_gives_an_empty_table_and_captions_without_entries_the_same_factor():
    empty = table_of([])
    assert (len(empty), empty.entries, empty.ptr.tolist(), empty.ids.size) == (0, [], [0], 0)
    assert empty.ptr.dtype == np.int64 and empty.ids.dtype == np.int32
    assert entry_counts(empty).shape == (0,)
    blank = table_of(["", "nothing known here"])
    assert blank.ptr.tolist() == [0, 0, 0]
    for settings in (TemperatureBalance(1.0), CapBalance(3)):
        assert balance_factors(empty, settings).shape == (0,)
        factors = balance_factors(blank, settings)
        assert np.all(np.isfinite(factors)) and factors[0] == factors[1] > 0


def test_a_cap_above_every_count_keeps_every_sample_whole():
    # cap 50 over counts of at most 3: every p_e = 1, so every factor is 1, a caption without concepts included
    table = table_of(["a red circle", "a red circle", "a red circle", "a cyan ring", ""])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no division warning for the certain p = 1
        assert balance_factors(table, CapBalance(50)).tolist() == [1.0] * 5


def test_a_caption_of_one_concept_is_weighted_by_its_count_and_a_plain_function_extracts_objects():
    table = table_of(["a red circle"] * 8 + ["a dog"] * 2)
    assert table.sample_entries(8) == ["dog"]
    w = balance_factors(table, TemperatureBalance(1.0))
    assert w[8] == w[9] == pytest.approx(8 / 2)  # dog: 2 samples against the head's 8
    # an extractor without `kind` or `mentions` (a plain function): every concept is an object, so pairs and no
    # bindings
    plain = build_concept_table(["red circle star", "star"], lambda caption: caption.split())
    assert plain.sample_entries(0) == ["red", "circle", "star", "circle + red", "circle + star", "red + star"]
    assert plain.sample_entries(1) == ["star"]


def test_extraction_counts_its_captions_on_a_progress_bar(capsys, monkeypatch):
    import tqdm

    # no monitor thread left behind: a later test's forked worker pool must not copy a running thread
    monkeypatch.setattr(tqdm.tqdm, "monitor_interval", 0)
    table = build_concept_table(["a red circle", "", "a cyan ring"], default_extractor(), progress=True)
    assert len(table) == 3
    err = capsys.readouterr().err
    assert "concepts: 3.00 captions" in err


# ---- sources and the draw plan ----------------------------------------------------------------------------------


def mix_of(configs, epoch_samples=0):
    sources = resolve_sources(configs)
    index = load_or_build_index([u for s in sources for u in s.urls])
    return index, SourceMix(sources, index.nsamples, epoch_samples)


def test_shares_and_repeats_set_each_sources_draws(two_sets):
    root, big, small = two_sets
    index, mix = mix_of([ShardsSource(shards=str(root / "big"), share=0.7), ShardsSource(shards=str(root / "small"), share=0.3)])
    assert list(mix.sizes) == [90, 30] and mix.samples_per_epoch == 120
    assert list(mix.draws) == pytest.approx([84, 36]) and list(mix.repeats) == pytest.approx([84 / 90, 36 / 30])
    _, mix = mix_of([ShardsSource(shards=str(root / "big")), ShardsSource(shards=str(root / "small"), repeat=3)])
    assert mix.samples_per_epoch == 180 and list(mix.repeats) == pytest.approx([1, 3])
    _, mix = mix_of([ShardsSource(shards=str(root / "big"), repeat=1), ShardsSource(shards=str(root / "small"), repeat=3)], 90)
    assert mix.samples_per_epoch == 90 and list(mix.repeats) == pytest.approx([0.5, 1.5])  # scaled to fill 90
    _, mix = mix_of([ShardsSource(shards=str(root / "big"), repeat=0.5), ShardsSource(shards=str(root / "small"), choose=60)])
    assert mix.samples_per_epoch == 105 and list(mix.draws) == pytest.approx([45, 60])  # absolute kinds mix
    assert list(mix.source_of([0, 89, 90, 119])) == [0, 0, 1, 1]


def test_the_plan_keeps_the_shares_balances_within_them_and_is_reused_while_its_fingerprint_holds(two_sets, tmp_path):
    root, big, small = two_sets
    index, mix = mix_of([ShardsSource(shards=str(root / "big"), share=0.7, name="big"),
                         ShardsSource(shards=str(root / "small"), share=0.3, name="small")])
    captions = ["a red circle"] * 80 + ["a cyan ring"] * 10 + ["a red circle"] * 10 + ["a cyan ring"] * 20
    plan = plan_draws(index, mix, TemperatureBalance(1.0), tmp_path, captions=lambda: iter(captions))
    e = plan.expected
    assert e[:90].sum() == pytest.approx(84, abs=1e-5) and e[90:].sum() == pytest.approx(36, abs=1e-5)
    # By hand: the sources' rates are 84 / 90 and 36 / 30, so each of red, circle, red:circle counts
    # 80 * 84/90 + 10 * 36/30 = 260/3 and each cyan ring entry 10 * 84/90 + 20 * 36/30 = 100/3; alpha = 1 gives a
    # cyan ring the factor 2.6 against the head's 1. Big: 84 draws over 80 + 10 * 2.6 = 106 factor units; small: 36
    # draws over 10 + 20 * 2.6 = 62.
    assert e[:80] == pytest.approx(np.full(80, 84 / 106), abs=1e-5)
    assert e[80:90] == pytest.approx(np.full(10, 84 * 2.6 / 106), abs=1e-5)
    assert e[90:100] == pytest.approx(np.full(10, 36 / 62), abs=1e-5)
    assert e[100:] == pytest.approx(np.full(20, 36 * 2.6 / 62), abs=1e-5)
    r = plan.report
    assert r["largest_repeat"]["draws_per_epoch"] == pytest.approx(e.max())
    assert r["distinct_share"] == pytest.approx(np.minimum(e, 1).sum() / 120)
    assert {row[0] for row in r["concepts"]} >= {"circle", "ring", "red", "cyan"}
    assert os.path.isfile(tmp_path / "draws.npy") and json.loads((tmp_path / "draws.json").read_text()) == r
    text = "\n".join(describe_plan(plan))
    assert "an epoch is 120 draws from 120 samples" in text and "small: 30 samples, 30.0% of the draws" in text

    def unread():
        raise AssertionError("the stored plan should have been reused")

    again = plan_draws(index, mix, TemperatureBalance(1.0), tmp_path, captions=unread)
    assert np.array_equal(again.units, plan.units)
    other = plan_draws(index, mix, TemperatureBalance(0.5), tmp_path,
                       captions=lambda: iter(captions))  # settings changed
    assert not np.array_equal(other.units, plan.units) and load_plan(tmp_path).report["balance"]["alpha"] == 0.5
    # what the data gave a rule (spread's alpha) comes back with the stored plan: a resumed run's card says it
    spread = plan_draws(index, mix, SpreadBalance(0.9), tmp_path / "spread", captions=lambda: iter(captions))
    reread = SpreadBalance(0.9)
    assert plan_draws(index, mix, reread, tmp_path / "spread", captions=unread).report == spread.report
    assert 0 < reread.alpha < 1 and reread.describe() == spread.report["balance_line"]


def test_balance_counts_each_sample_at_its_sources_rate(tmp_path):
    """A source drawn 10 times per epoch and one drawn once (5 samples each). The tenfold source shows 2 red
    circles and 3 blue squares, the other 5 red circles: at the natural rates the stream shows each red circle
    entry (red, circle, red:circle) 2 * 10 + 5 = 25 times and each blue square entry 3 * 10 = 30 times, so within
    the tenfold source the red circles are the rarer ones."""
    sources = [Source("tenfold", ["/shards/tenfold-0.tar"], repeat=10.0), Source("once", ["/shards/once-0.tar"])]
    index = ShardIndex([{"url": "/shards/tenfold-0.tar", "nsamples": 5}, {"url": "/shards/once-0.tar", "nsamples": 5}])
    mix = SourceMix(sources, index.nsamples)
    assert mix.samples_per_epoch == 55 and list(mix.draws) == pytest.approx([50, 5])
    captions = ["a red circle"] * 2 + ["a blue square"] * 3 + ["a red circle"] * 5

    def plan(settings, folder):
        return plan_draws(index, mix, settings, tmp_path / folder, captions=lambda: iter(captions))

    # temperature, alpha = 1: factor = head / c_min = 30 / 25 for a red circle, 1 for a blue square; the tenfold
    # source's 50 draws go over 2 * 1.2 + 3 * 1 = 5.4 factor units, the other source's 5 over its 5 equal samples
    temperature = plan(TemperatureBalance(1.0), "temperature")
    assert temperature.expected == pytest.approx([50 * 1.2 / 5.4] * 2 + [50 / 5.4] * 3 + [1.0] * 5, abs=1e-5)
    natural = {row[0]: row[1:] for row in temperature.report["concepts"]}
    assert natural["circle"] == pytest.approx([25, 2 * 50 * 1.2 / 5.4 + 5], abs=1e-4)
    assert natural["square"] == pytest.approx([30, 3 * 50 / 5.4], abs=1e-4)
    # cap, t = 20: p_e = min(1, 20 / c_e) over each sample's three entries, factor = 1 - prod(1 - p_e)
    red, blue = 1 - (1 - 20 / 25) ** 3, 1 - (1 - 20 / 30) ** 3
    cap = plan(CapBalance(20), "cap")
    units = 2 * red + 3 * blue
    assert cap.expected == pytest.approx([50 * red / units] * 2 + [50 * blue / units] * 3 + [1.0] * 5, abs=1e-5)


def test_balancing_by_image_clusters_draws_a_rare_looking_sample_more_and_reads_features_not_words(tmp_path):
    """Ten samples, the last with a rare caption: 6 whose latents look alike (the last among them), 3 alike in
    another way, 1 on its own. By captions the last is the rare one; by images each look is a cluster
    (k = round(sqrt(10)) = 3), and alpha 1 draws each cluster about equally often; by both, the rarest of a
    sample's caption entries and its cluster decides."""
    index = ShardIndex([{"url": "/shards/a-0.tar", "nsamples": 10}])
    mix = SourceMix([Source("a", ["/shards/a-0.tar"])], index.nsamples)
    captions = ["a red circle"] * 9 + ["a cyan ring"]
    looks = np.array([0] * 5 + [1] * 3 + [2] + [0])
    rows = 10.0 * np.eye(3)[looks] + np.linspace(0, 0.1, 10)[:, None]

    def plan(rule, folder, features=lambda: rows):
        return plan_draws(index, mix, rule, tmp_path / folder, captions=lambda: iter(captions), features=features)

    words = plan(TemperatureBalance(1.0), "words").expected
    assert words[:9] == pytest.approx([words[0]] * 9, abs=1e-5) and words[9] > words[0]
    images = plan(TemperatureBalance(1.0, by="images"), "images")
    totals = [images.expected[looks == j].sum() for j in range(3)]
    assert totals == pytest.approx([10 / 3] * 3, abs=0.01)  # each cluster a third of the epoch's 10 draws
    assert images.report["image_clusters"] == {"clusters": 3, "largest": 6, "smallest": 1, "features": 3}
    assert images.report["balance_line"] == "balanced by image clusters (temperature, alpha 1)"
    assert "  image clusters: 3 (k-means of 3 latent features per sample), 1 to 6 samples each" in describe_plan(images)
    assert images.report["concepts"]  # the captions are still read for the report: what the images moved
    both = plan(TemperatureBalance(1.0, by="both"), "both")
    assert images.expected[9] == images.expected[0]  # by images alone its rare words count for nothing
    assert both.expected[9] > both.expected[0]  # a common look, rare words
    assert both.expected[8] > both.expected[0]  # common words, a rare look
    assert "by concepts and image clusters" in both.report["balance_line"]
    with pytest.raises(ValueError, match=r"data.balance.by=images clusters the samples' VAE latents: it needs "
                                         r"precomputed features \(data.precompute=true"):
        plan(TemperatureBalance(1.0, by="images"), "none", features=None)


# what each data.balance setting is read under: two offline rules that differ in that setting alone and draw
# differently (an online rule's plan is the natural one)
BALANCE_CHANGES = {
    "kind": [(NoBalance(), TemperatureBalance()), (TemperatureBalance(5.0), CapBalance(5))],
    "temperature alpha": [(TemperatureBalance(0.5), TemperatureBalance(1.0))],
    "cap cap": [(CapBalance(5), CapBalance(10))],
    "spread keep": [(SpreadBalance(0.3), SpreadBalance(0.9))],
    "temperature by": [(TemperatureBalance(), TemperatureBalance(by="images"))],
    "spread by": [(SpreadBalance(), SpreadBalance(by="both"))],
    "cap by": [(CapBalance(5), CapBalance(5, by="images"))],
}


def test_the_fingerprint_test_varies_every_balance_setting():
    # a setting added to an offline rule must be given its pair above, so that the next test sees whether it counts
    offline = {f"{kind} {f.name}" for kind, rule in BALANCE_RULES.items() if not rule.ONLINE
               for f in dataclasses.fields(rule)}
    assert set(BALANCE_CHANGES) == {"kind"} | offline
    assert all(isinstance(rule().plan_rule(), NoBalance) for rule in BALANCE_RULES.values() if rule.ONLINE)


class Described:
    """The default extractor under another description (the plan's vocabulary as `describe()` tells it)."""

    def __init__(self, description):
        self.description = description

    def __call__(self, caption):
        return default_extractor()(caption)

    def describe(self):
        return self.description


def test_every_setting_that_decides_the_plan_changes_its_fingerprint(two_sets, tmp_path):
    """The fingerprint covers the shards (paths, sizes, times), the sources' weights, the epoch size, the balance
    settings and the extractor: two plans that differ in one of them, the rest as the baseline, are not mixed up."""
    root, big, small = two_sets
    copy = tmp_path / "copy" / os.path.basename(small[0])
    copy.parent.mkdir()
    shutil.copy(small[0], copy)
    shares = ({"share": 0.7}, {"share": 0.3})

    def fingerprint(shards=str(root / "small"), weights=shares, epoch=0, balance=TemperatureBalance(),
                    extractor=None, mtime_ns=None, padding=0):
        if padding:  # another size, same samples: zero blocks after the tar's end
            with open(copy, "ab") as f:
                f.write(b"\0" * padding)
        if mtime_ns is not None:
            os.utime(copy, ns=(mtime_ns, mtime_ns))
        index, mix = mix_of([ShardsSource(shards=str(root / "big"), **weights[0]), ShardsSource(shards=shards, **weights[1])],
                            epoch)
        return plan_fingerprint(index, mix, balance, extractor)

    t = 1_700_000_000 * 10**9
    changes = {  # setting: the keyword pairs of two plans that differ in it alone
        "shard path": [(dict(), dict(shards=str(copy), mtime_ns=os.stat(small[0]).st_mtime_ns))],
        "shard time": [(dict(shards=str(copy), mtime_ns=t), dict(shards=str(copy), mtime_ns=t + 10**9))],
        "shard size": [(dict(shards=str(copy), mtime_ns=t), dict(shards=str(copy), mtime_ns=t, padding=512))],
        "share": [(dict(), dict(weights=({"share": 0.6}, {"share": 0.4})))],
        # with the epoch size fixed, so that only the sources' draws differ
        "repeat": [(dict(weights=({"repeat": 1}, {"repeat": 3}), epoch=120),
                    dict(weights=({"repeat": 1}, {"repeat": 2}), epoch=120))],
        "choose": [(dict(weights=({"choose": 50}, {"choose": 20}), epoch=120),
                    dict(weights=({"choose": 50}, {"choose": 30}), epoch=120))],
        "epoch_samples": [(dict(), dict(epoch=200))],
        **{f"balance {field}": [(dict(balance=a), dict(balance=b)) for a, b in pairs]
           for field, pairs in BALANCE_CHANGES.items()},
    }
    described = default_extractor().describe()
    for key, value in described.items():
        changes[f"extractor {key}"] = [(dict(extractor=Described(described)),
                                        dict(extractor=Described({**described, key: f"other {value}"})))]
    # the rule that reads a caption's entries is the extractor's: a plan made under another rule is not reused
    other_rule = type("OtherRule", (VocabExtractor,), {"rule": "concepts-once-each"})(default_extractor().vocabulary)
    changes["extractor rule"] = [(dict(extractor=default_extractor()), dict(extractor=other_rule))]
    unchanged = []
    for setting, pairs in changes.items():
        for a, b in pairs:
            if fingerprint(**a) == fingerprint(**b):
                unchanged.append(setting)
    assert not unchanged, f"the plan's fingerprint ignores {unchanged}"
    assert fingerprint() == fingerprint()  # and it is a function of the settings


def test_drawn_shares_match_the_plan_within_the_bound_of_the_sample_count(two_sets, tmp_path):
    root, big, small = two_sets
    index, mix = mix_of([ShardsSource(shards=str(root / "big"), share=0.7), ShardsSource(shards=str(root / "small"), share=0.3)])
    plan = plan_draws(index, mix, CapBalance(5), tmp_path)
    order = WeightedOrder(plan.units, plan.samples_per_epoch, seed=0)
    draws = order.samples(np.arange(50 * 120))  # 50 epochs
    from_small = np.count_nonzero(draws >= 90)
    # per epoch each sample is drawn floor or ceil of its expected draws: a source's total is a sum of
    # independent roundings, whose standard deviation is at most sqrt(n_samples / 4) per epoch
    e = plan.expected[90:]
    sd = np.sqrt(50 * np.sum((e - np.floor(e)) * (np.ceil(e) - e)))
    assert abs(from_small - 50 * 36) <= 4 * sd + 1
    mean = np.bincount(draws, minlength=120) / 50
    f = plan.expected - np.floor(plan.expected)
    assert np.all(np.abs(mean - plan.expected) <= 5 * np.sqrt(f * (1 - f) / 50) + 1e-6)


# ---- the run's loader -------------------------------------------------------------------------------------------


RUN = ["data.resolution=32", "data.batch_size=4", "model.vae=tiny", "model.text_encoder=tiny-words",
       "data.precompute=false"]


def loader_keys(cfg, sources, step, saved_world, rank, world, batches):
    accelerator = Accelerator(cpu=True)
    accelerator.state.process_index, accelerator.state.num_processes = rank, world  # this rank's view of the run
    try:
        # `step` steps of `saved_world` processes
        position = StreamPosition(step, step * cfg.train.grad_accum * saved_world * cfg.data.batch_size)
        loader = make_loader(cfg, accelerator, sources, position, None, bucket_divisor=16)
        it = iter(loader)
        return [key for _ in range(batches) for key in next(it)["keys"]]
    finally:
        accelerator.state.process_index, accelerator.state.num_processes = 0, 1


def test_the_run_loader_draws_the_plan_and_continues_on_another_process_count(two_sets, tmp_path):
    root, big, small = two_sets
    cfg = load_config([*RUN, f"train.output_dir={tmp_path}", "data.balance=temperature", "data.balance.alpha=1",
                       f"data.sources=[{{shards: {root / 'big'}, share: 0.7}}, {{shards: {root / 'small'}, "
                       f"share: 0.3}}]"])
    sources = training_sources(cfg, Accelerator(cpu=True), tmp_path)
    assert [s.name for s in sources] == ["source0", "source1"]
    one = loader_keys(cfg, sources, 0, 1, 0, 1, 12)  # 12 batches of 4 from one process
    plan = load_plan(tmp_path / "data")
    assert plan is not None and (tmp_path / "data" / "draws.png").is_file()
    # the keys are the plan's stream, read from the sources' shards one after the other
    index = load_or_build_index([u for s in sources for u in s.urls])
    stream = WeightedOrder(plan.units, plan.samples_per_epoch, seed=cfg.train.seed).samples(range(48))
    assert one == [index_key(index, i) for i in stream]
    # 2 processes from scratch: their batches interleave into the same stream
    r0 = loader_keys(cfg, sources, 0, 2, 0, 2, 6)
    r1 = loader_keys(cfg, sources, 0, 2, 1, 2, 6)
    assert sum(([*r0[4 * t:4 * t + 4], *r1[4 * t:4 * t + 4]] for t in range(6)), []) == one
    # 2 -> 1: after 3 steps of 2 processes (24 samples) one process continues with the 25th
    assert loader_keys(cfg, sources, 3, 2, 0, 1, 6) == one[24:48]
    # 1 -> 2: after 4 steps of 1 process (16 samples) rank 0 and 1 continue with the 17th
    assert loader_keys(cfg, sources, 4, 1, 0, 2, 2)[:4] == one[16:20]
    assert loader_keys(cfg, sources, 4, 1, 1, 2, 2)[:4] == one[20:24]
    # gradient accumulation: 2 optimizer steps of 2 micro-batches consumed 16 samples
    cfg.train.grad_accum = 2
    assert loader_keys(cfg, sources, 2, 1, 0, 1, 2) == one[16:24]


def index_key(index, i):
    from data.index import parse_sample

    shard, start, end = index.locate(int(i))
    with open(index.urls[shard], "rb") as f:
        f.seek(start)
        return parse_sample(f.read(end - start))["__key__"]


@pytest.mark.parametrize("overrides,message", [
    (["data.sources=[{shards: a, share: 0}, {shards: b, share: 1}]"], "every source needs a share > 0"),
    (["data.sources=[{shards: a, share: -1}]"], "source0 has share=-1.0; a share must be > 0"),
    (["data.sources=[{shards: a, share: 0.5}, {shards: b, repeat: 2}]"], "not both kinds"),
    (["data.sources=[{shards: a, share: 0.5}, {shards: b, choose: 20}]"], "not both kinds"),
    (["data.sources=[{shards: a, share: 0.5, repeat: 2}]"], "source0 gives share and repeat; give one"),
    (["data.sources=[{shards: a, choose: -5}]"], "source0 has choose=-5; a choose must be > 0"),
    (["data.sources=[{name: x}]"], "x has no shards"),
    (["data.sources=[{shards: a, name: x}, {shards: b, name: x}]"], "the names ['x', 'x'] repeat"),
    (["data.sources=[{shards: a, weight: 2}]"], "unknown config key 'data.sources[0].weight'"),
    (["data.sources=[a/*.tar]"], "expects a mapping of a kind's settings (shards: name, share, repeat, choose, "
                                 "shards; or kind: one of shards, synthetic)"),
    (["data.sources=[{kind: parquet, shards: a}]"], "'data.sources[0]' must be one of shards, synthetic (its kind)"),
    (["data.sources=[{shards: a, samples: 3}]"], "'data.sources[0].samples' (data.sources[0] kind shards reads"),
    (["data.sources=[{kind: synthetic, samples: 0}]"], "'data.sources[0].samples' must be >= 1, got 0"),
    (["data.sources=[{kind: synthetic}, {shards: ''}]"], "data.sources: source1 has no shards"),
    (["data.shards=a", "data.sources=[{shards: b}]"], "give data.shards or data.sources, not both"),
    (["data.balance=cap"], "'data.balance.cap' must be >= 1 (MetaCLIP: 20000 for 400M captions), got 0"),
    (["data.balance=inverse"], "'data.balance' must be one of none, temperature, spread, cap, imba (its kind)"),
    (["data.balance=temperature", "data.balance.alpha=-1"], "'data.balance.alpha' must be >= 0"),
    (["data.balance.alpha=-1", "data.balance=temperature"], "'data.balance.alpha' must be >= 0"),
    (["data.balance=temperature", "data.balance_alpha=-1"], "'data.balance.alpha' must be >= 0"),  # the old key
    # a setting the chosen rule does not read is refused, not ignored
    (["data.balance=temperature", "data.balance.every=50"], "'data.balance.every' (data.balance kind temperature "
                                                            "reads by, alpha)"),
    (["data.balance.alpha=1"], "'data.balance.alpha' (data.balance kind none reads no settings)"),
    (["data.balance=cap", "data.balance.cap=5", "data.balance=none"], "kind none reads no settings"),
    (["data.balance=temperature", "data.mode=streaming"], "need indexed reading"),
])
def test_bad_source_and_balance_settings_are_one_line_errors(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(overrides)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_sources_that_cannot_be_read_as_one_are_refused_in_one_line(two_sets, tmp_path):
    root, big, small = two_sets
    with pytest.raises(FileNotFoundError, match="data.sources: source1: no shards found"):
        resolve_sources([ShardsSource(shards=str(root / "big")), ShardsSource(shards=str(tmp_path / "missing"))])
    with pytest.raises(ValueError, match="is in both source0 and source1"):
        resolve_sources([ShardsSource(shards=str(root / "big")), ShardsSource(shards=big[0])])
    with pytest.raises(ValueError, match="source0 is a pipe: command .* sources are read indexed"):
        resolve_sources([ShardsSource(shards="pipe:curl -s https://example.org/{0..3}.tar")])
    remote = resolve_sources([ShardsSource(shards="https://example.org/{0..1}.tar"), ShardsSource(shards="s3://bucket/a.tar")])
    assert [s.urls for s in remote] == [["https://example.org/0.tar", "https://example.org/1.tar"],
                                        ["s3://bucket/a.tar"]]
    with pytest.raises(ValueError, match="is in both source0 and source1"):
        resolve_sources([ShardsSource(shards="s3://bucket/{a,b}.tar"), ShardsSource(shards="s3://bucket/b.tar")])
    empty = tmp_path / "empty.tar"
    import tarfile

    tarfile.open(empty, "w").close()
    with pytest.raises(ValueError, match="source1 has no readable samples"):
        SourceMix(resolve_sources([ShardsSource(shards=big[0]), ShardsSource(shards=str(empty))]), [40, 0])


PRECOMPUTE = dict(resolution=32, vae="tiny", text_encoder="tiny-words", max_text_tokens=12)


@pytest.fixture(scope="module")
def precomputed(two_sets, tmp_path_factory):
    """The small set precomputed with PRECOMPUTE: its output folder."""
    from data.precompute import PrecomputeSettings, precompute_shards

    out = tmp_path_factory.mktemp("precomputed") / "small"
    precompute_shards(two_sets[2], out, PrecomputeSettings(**PRECOMPUTE))
    return out


def test_image_shards_mixed_with_precomputed_ones_are_refused(two_sets, precomputed, tmp_path):
    from data.precompute import PrecomputeSettings, precompute_shards

    root, big, small = two_sets
    precompute_shards(small, tmp_path / "b", PrecomputeSettings(**{**PRECOMPUTE, "max_text_tokens": 10}))
    with pytest.raises(ValueError, match="source0 hold precomputed features, source1 image shards"):
        check_same_kind(resolve_sources([ShardsSource(shards=str(precomputed)), ShardsSource(shards=str(root / "big"))]))
    with pytest.raises(ValueError, match=r"source1's features were made with other settings .*max_text_tokens=10"):
        check_same_kind(resolve_sources([ShardsSource(shards=str(precomputed)), ShardsSource(shards=str(tmp_path / "b"))]))
    assert check_same_kind(resolve_sources([ShardsSource(shards=str(precomputed))]))["max_text_tokens"] == 12


# How a precomputed sample reads, as its manifest records it: a value other than PRECOMPUTE's for each. The
# derived latent_channels, latent_size and vae_downsample are parts of latent_shape and resolution.
FEATURE_SETTINGS = {
    "resolution": 64, "vae": "stabilityai/sd-vae-ft-ema", "vae_subfolder": "vae", "text_encoder": "google/t5-v1_1-xxl",
    "text_encoder_subfolder": "text_encoder", "tokenizer_subfolder": "tokenizer", "encoder_dtype": "bfloat16",
    "max_text_tokens": 120, "text_dtype": "bfloat16", "latent_shape": [2, 16, 4, 4], "vae_scaling_factor": 0.3611,
    "text_hidden_size": 4096,
}
# which samples were encoded, not how they read: sources may differ in them
SAMPLE_CHOICES = {"caption_field": "alt_text", "min_size": 256}


def test_precomputed_sources_that_read_differently_are_refused(precomputed, tmp_path):
    from data.precompute import PrecomputeSettings
    from data.precomputed import MANIFEST_NAME, format_version

    # a setting added to the precompute must be classified above
    fields = {f.name for f in dataclasses.fields(PrecomputeSettings)}
    assert fields <= set(FEATURE_SETTINGS) | set(SAMPLE_CHOICES) and not set(FEATURE_SETTINGS) & set(SAMPLE_CHOICES)
    manifest = json.loads((precomputed / MANIFEST_NAME).read_text())
    assert {k: manifest[k] for k in PRECOMPUTE} == PRECOMPUTE

    def other(key, value):
        """A copy of the precompute whose manifest records `value` for `key`."""
        folder = tmp_path / key
        shutil.copytree(precomputed, folder, ignore=shutil.ignore_patterns("imba-index-*"))
        changed = {**manifest, key: value}
        if key in changed["settings"]:
            changed["settings"] = {**changed["settings"], key: value}
        changed["version"] = format_version(changed["text_dtype"])
        (folder / MANIFEST_NAME).write_text(json.dumps(changed))
        return resolve_sources([ShardsSource(shards=str(precomputed)), ShardsSource(shards=str(folder))])

    for key, value in FEATURE_SETTINGS.items():
        with pytest.raises(ValueError, match=rf"source1's features were made with other settings .*\b{key}="):
            check_same_kind(other(key, value))
    for key, value in SAMPLE_CHOICES.items():
        assert check_same_kind(other(key, value))["__path__"] == str(precomputed / MANIFEST_NAME)


def test_weights_computed_in_blocks_of_rows_equal_the_whole(monkeypatch):
    import data.balance as balance

    table = table_of(["a red circle", "", "a blue cross and a red ring", "nothing known"] * 10)
    rate = np.repeat([1.0, 3.0], 20)  # two sources' rates
    for settings in (TemperatureBalance(0.7), CapBalance(3)):
        whole = balance_factors(table, settings, rate)
        monkeypatch.setattr(balance, "ROWS_AT_ONCE", 3)  # blocks that start and end on captionless rows
        assert np.array_equal(balance_factors(table, settings, rate), whole)
        monkeypatch.undo()
    assert entry_counts(table, rate)[table.entries.index("cross")] == 5 * 1.0 + 5 * 3.0  # 5 crosses per source


def test_captions_that_do_not_match_the_shards_are_refused_and_a_damaged_plan_is_recomputed(two_sets, tmp_path):
    root, big, small = two_sets
    index, mix = mix_of([ShardsSource(shards=str(root / "big")), ShardsSource(shards=str(root / "small"))])
    settings = TemperatureBalance(1.0)
    with pytest.raises(ValueError, match="cover 119 captions, the shards 120 samples"):
        plan_draws(index, mix, settings, tmp_path, captions=lambda: iter(["a red circle"] * 119))
    plan = plan_draws(index, mix, settings, tmp_path)
    np.save(tmp_path / "draws.npy", plan.units[:-1])  # a draws file that does not hold every sample
    assert load_plan(tmp_path) is None
    again = plan_draws(index, mix, settings, tmp_path)
    assert np.array_equal(again.units, plan.units) and load_plan(tmp_path) is not None


# ---- the survivors of mutation testing: what the tests above left unstated ----------------------------------------


def test_shares_are_relative_whatever_they_sum_to():
    sources = [Source("a", ["/shards/a-0.tar"], share=2.0), Source("b", ["/shards/b-0.tar"], share=1.0)]
    mix = SourceMix(sources, [90, 30])
    assert mix.samples_per_epoch == 120 and list(mix.draws) == pytest.approx([80, 40])  # 2 : 1 of 120


def test_an_epoch_of_repeats_is_their_draws_summed_and_rounded():
    # two samples drawn 0.7 times each: 1.4 draws, an epoch of 1
    mix = SourceMix([Source("a", ["/shards/a-0.tar"], repeat=0.7)], [2])
    assert mix.samples_per_epoch == 1 and list(mix.draws) == pytest.approx([1.0])


def test_shard_sizes_that_do_not_match_the_sources_shards_are_refused():
    sources = [Source("a", ["/shards/a-0.tar", "/shards/a-1.tar"])]
    with pytest.raises(ValueError, match="1 shard sizes for 2 shards"):
        SourceMix(sources, [5])


def test_a_missing_share_names_the_source_without_one():
    from data.sources import check_source_configs

    with pytest.raises(ValueError, match=r"\(plain has none\)"):
        check_source_configs([ShardsSource(shards="a", share=1.0, name="shared"), ShardsSource(shards="b", name="plain")])


def test_precomputed_sources_that_differ_are_named_with_both_values(monkeypatch):
    import data.precomputed

    same = {"resolution": 32, "max_text_tokens": 12}
    manifests = {"/a.tar": same, "/b.tar": dict(same), "/c.tar": {"resolution": 64, "max_text_tokens": 10}}
    monkeypatch.setattr(data.precomputed, "find_manifest", lambda urls: manifests[urls[0]])
    sources = [Source(name, [f"/{name}.tar"]) for name in "abc"]
    with pytest.raises(ValueError) as err:
        check_same_kind(sources)
    message = str(err.value)
    assert "c's features were made with other settings than a's" in message
    assert "resolution=64 vs 32" in message and "max_text_tokens=10 vs 12" in message
    assert check_same_kind(sources[:2]) == manifests["/a.tar"]


# ---- the draw plan's report, storage and captions ------------------------------------------------------------------

# natural counts: red 5, circle 4, square 3, green = ring = blue 2 (green first in caption order); alpha = 1 gives
# each sample head / (count of its rarest entry): a red circle 5/4, a green ring or blue square 5/2, the red square 5;
# 9 draws over 20 factor units: 9/16, 9/8 and 9/4 draws (exact in units, so equal samples get equal units)
PLAN_CAPTIONS = ["a red circle"] * 4 + ["a green ring"] * 2 + ["a blue square"] * 2 + ["a red square"]


def one_source(n, name="only"):
    url = f"/shards/{name}-0.tar"
    return ShardIndex([{"url": url, "nsamples": n}]), SourceMix([Source(name, [url])], [n])


def test_the_report_lists_concepts_by_natural_draws_and_combinations_by_boost(tmp_path):
    index, mix = one_source(len(PLAN_CAPTIONS))
    plan = plan_draws(index, mix, TemperatureBalance(1.0), tmp_path / "run" / "data",
                      captions=lambda: iter(PLAN_CAPTIONS))
    assert plan.expected == pytest.approx([9 / 16] * 4 + [9 / 8] * 4 + [9 / 4])
    # most drawn first, ties by name
    assert [row[0] for row in plan.report["concepts"]] == ["red", "circle", "square", "blue", "green", "ring"]
    assert [row[1] for row in plan.report["concepts"]] == pytest.approx([5, 4, 3, 2, 2, 2])
    # most boosted (planned / natural draws) first, ties by name; a combination of one sample is listed too
    combos = plan.report["most_boosted_combinations"]
    assert [row[0] for row in combos] == ["red:square", "blue:square", "green:ring", "red:circle"]
    assert [row[2] / row[1] for row in combos] == pytest.approx([9 / 4, 9 / 8, 9 / 8, 9 / 16])
    assert load_plan(tmp_path / "run" / "data") is not None  # the run's folder made with its parents
    lines = describe_plan(plan)
    assert lines[0] == "data: an epoch is 9 draws from 9 samples, balanced by concepts (temperature, alpha 1)"
    assert lines[-1].startswith("  rarest concept 'ring': 2.0 -> 2.")
    assert "0 captions name no known concept" in lines[-1]


def test_a_natural_plan_reads_no_caption_and_reports_no_concept(tmp_path):
    index, mix = one_source(4)

    def unread():
        raise AssertionError("data.balance=none needs no caption")

    plan = plan_draws(index, mix, NoBalance(), tmp_path, captions=unread)
    assert plan.expected == pytest.approx([1.0] * 4) and "concepts" not in plan.report
    assert "captions_without_entries" not in plan.report
    assert describe_plan(plan)[0] == "data: an epoch is 4 draws from 4 samples"
    assert not any("rarest concept" in line for line in describe_plan(plan))
    assert plot_plan(plan, tmp_path) is None


def test_the_report_counts_captionless_samples_and_the_natural_distinct_share(tmp_path):
    urls = ["/shards/twice-0.tar", "/shards/half-0.tar"]
    index = ShardIndex([{"url": url, "nsamples": 2} for url in urls])
    mix = SourceMix([Source("twice", urls[:1], repeat=2.0), Source("half", urls[1:], repeat=0.5)], [2, 2])
    captions = ["a red circle", "", "nothing known here", ""]
    plan = plan_draws(index, mix, TemperatureBalance(1.0), tmp_path, captions=lambda: iter(captions))
    assert plan.report["captions_without_entries"] == 3
    # an epoch shows min(1, rate) of each sample: both of "twice", half of each of "half"
    assert plan.report["natural_distinct_share"] == pytest.approx((1 + 1 + 0.5 + 0.5) / 4)


def test_the_plan_reads_concepts_with_the_extractor_it_is_given(tmp_path):
    index, mix = one_source(3)

    def zebras(caption):
        return ["zebra"]

    settings = TemperatureBalance(1.0)
    plan = plan_draws(index, mix, settings, tmp_path, extractor=zebras, captions=lambda: iter(["a red circle"] * 3))
    assert [row[0] for row in plan.report["concepts"]] == ["zebra"]
    assert plan.report["fingerprint"] == plan_fingerprint(index, mix, settings, zebras)
    assert plan.report["fingerprint"] != plan_fingerprint(index, mix, settings)
    with pytest.raises(ValueError, match="the sources hold 3 samples, the index 4"):
        plan_draws(one_source(4)[0], mix, settings, tmp_path / "other", captions=lambda: iter(["a red circle"] * 4))


def test_extractors_without_a_description_are_told_apart_by_their_type():
    index, mix = one_source(3)

    class Zebras:
        def __call__(self, caption):
            return ["zebra"]

    class Lions(Zebras):
        pass

    settings = TemperatureBalance(1.0)
    assert plan_fingerprint(index, mix, settings, Zebras()) == plan_fingerprint(index, mix, settings, Zebras())
    assert plan_fingerprint(index, mix, settings, Zebras()) != plan_fingerprint(index, mix, settings, Lions())


@pytest.mark.parametrize("damage", ["int32", "column", "one unit more"])
def test_a_stored_plan_whose_units_are_not_one_int64_per_sample_summing_to_the_epoch_is_not_reused(tmp_path, damage):
    index, mix = one_source(4)
    plan = plan_draws(index, mix, NoBalance(), tmp_path)
    units = {"int32": plan.units.astype(np.int32), "column": plan.units[:, None],
             "one unit more": plan.units + np.eye(1, 4, dtype=np.int64)[0]}[damage]
    np.save(tmp_path / "draws.npy", units)
    assert load_plan(tmp_path) is None


def test_the_plot_shows_the_reports_combinations_and_a_plot_as_new_as_the_report_is_kept(tmp_path, monkeypatch):
    import data.concepts.plot

    index, mix = one_source(len(PLAN_CAPTIONS))
    plan = plan_draws(index, mix, TemperatureBalance(1.0), tmp_path,
                      captions=lambda: iter(PLAN_CAPTIONS))
    drawn = []

    def plot(rows, path, **kwargs):
        drawn.append((rows, kwargs))
        path.write_bytes(b"png")
        return path

    monkeypatch.setattr(data.concepts.plot, "plot_drawn_vs_natural", plot)
    png = plot_plan(plan, tmp_path)
    assert png == tmp_path / "draws.png" and len(drawn) == 1
    rows, kwargs = drawn[0]
    assert rows == plan.report["concepts"] and kwargs["combinations"] == plan.report["most_boosted_combinations"]
    assert "natural vs temperature" in kwargs["title"]
    mtime = (tmp_path / "draws.json").stat().st_mtime_ns
    os.utime(png, ns=(mtime, mtime))  # written in the same clock tick as the report
    assert plot_plan(plan, tmp_path) == png and len(drawn) == 1


def caption_shard(path, captions, field="caption"):
    from shard_helpers import write_tar

    return write_tar(path, [{"__key__": f"{i:04d}", "json": json.dumps({field: c, "alt": f"alt {c}"}).encode()}
                            for i, c in enumerate(captions)])


def test_index_captions_read_the_caption_field_and_line_up_with_the_indexed_count(tmp_path, caplog):
    import logging

    from data.draw_plan import index_captions

    shard = caption_shard(tmp_path / "part-000000.tar", ["a red circle", "a cyan ring", "a blue square"])
    assert list(index_captions(ShardIndex([{"url": shard, "nsamples": 3}]))) == [
        "a red circle", "a cyan ring", "a blue square"]
    assert list(index_captions(ShardIndex([{"url": shard, "nsamples": 3}]), "alt"))[0] == "alt a red circle"
    with caplog.at_level(logging.WARNING, logger="data.draw_plan"):
        assert list(index_captions(ShardIndex([{"url": shard, "nsamples": 2}]))) == ["a red circle", "a cyan ring"]
        assert list(index_captions(ShardIndex([{"url": shard, "nsamples": 5}]))) == [
            "a red circle", "a cyan ring", "a blue square", "", ""]
    messages = [r.getMessage() for r in caplog.records]
    assert messages[0].startswith(f"shard {shard}: 3 captions for 2 indexed samples;")
    assert messages[1].startswith(f"shard {shard}: 3 captions for 5 indexed samples;")


def test_the_entry_table_is_stored_reused_and_read_back_whole(tmp_path, monkeypatch):
    import data.draw_plan
    from data.draw_plan import entry_table, load_entry_table

    shard = caption_shard(tmp_path / "part-000000.tar", ["a red circle", "", "a blue square"], field="alt_text")
    index = ShardIndex([{"url": shard, "nsamples": 3}])
    folder = tmp_path / "run" / "data"
    table = entry_table(index, folder, "key", caption_field="alt_text")
    assert [table.sample_entries(i) for i in range(3)] == [["red", "circle", "red:circle"], [],
                                                         ["blue", "square", "blue:square"]]
    stored = load_entry_table(folder, "key")
    assert stored.entries == table.entries and stored.entries[0] == "red"
    assert stored.ptr.dtype == np.int64 and np.array_equal(stored.ptr, table.ptr)
    assert stored.ids.dtype == np.int32 and np.array_equal(stored.ids, table.ids)
    monkeypatch.setattr(data.draw_plan, "build_concept_table", lambda *a, **k: pytest.fail("the table was reread"))
    again = entry_table(index, folder, "key")
    assert again.entries == table.entries and np.array_equal(again.ids, table.ids)
    assert load_entry_table(folder, "other key") is None
    monkeypatch.undo()
    zebras = entry_table(index, tmp_path / "zebras", "key", lambda caption: ["zebra"], caption_field="alt_text")
    assert zebras.entries == ["zebra"]


def test_the_plan_and_the_entry_table_read_the_caption_field_they_are_given(tmp_path):
    from data.draw_plan import entry_table

    captions = ["a red circle", "a cyan ring", "a blue square"]
    settings = TemperatureBalance(1.0)
    for field in ("caption", "alt_text"):
        shard = caption_shard(tmp_path / f"{field}.tar", captions, field=field)
        index, mix = ShardIndex([{"url": shard, "nsamples": 3}]), SourceMix([Source(field, [shard])], [3])
        by_default = plan_draws(index, mix, settings, tmp_path / field / "default")
        named = plan_draws(index, mix, settings, tmp_path / field / "named", caption_field=field)
        assert by_default.report["captions_without_entries"] == (0 if field == "caption" else 3)
        assert named.report["captions_without_entries"] == 0
        table = entry_table(index, tmp_path / field / "entries", "key")
        assert sum(map(len, (table.sample_entries(i) for i in range(3)))) == (9 if field == "caption" else 0)


def test_balance_rules_refuse_what_cannot_be_used_and_record_every_setting():
    for bad, message in [(TemperatureBalance(-0.5), "data.balance.alpha must be >= 0"),
                         (TemperatureBalance(float("nan")), "data.balance.alpha must be >= 0"),
                         (CapBalance(0), "data.balance kind cap needs data.balance.cap=T >= 1")]:
        with pytest.raises(ValueError, match=message):
            bad.check()
    for good in (CapBalance(1), TemperatureBalance(0.0), NoBalance()):
        good.check()
    assert CapBalance(5).settings() == {"kind": "cap", "cap": 5}
    # balancing by images is recorded; by captions, the default, is not, so the plans of runs from before `by`
    # existed keep their fingerprints
    assert CapBalance(5, by="images").settings() == {"kind": "cap", "cap": 5, "by": "images"}
    assert TemperatureBalance(0.7).settings() == {"kind": "temperature", "alpha": 0.7}
    assert NoBalance().settings() == {"kind": "none"}
    for kind, rule in BALANCE_RULES.items():  # the kind each rule is registered under is its own
        assert rule.KIND == kind and rule().settings()["kind"] == kind


def test_the_most_boosted_combinations_come_first_whatever_their_count(tmp_path):
    # each red square shares its sample with a combination of one sample: boosted as much as they are (4x the
    # head, the yellow triangles), though it is in 3 samples and the blue circle, boosted 2x, in 2
    captions = (["a red square and a green star", "a red square and a cyan ring", "a red square and a black cross"]
                + ["a blue circle"] * 2 + ["a yellow triangle"] * 4)
    index, mix = one_source(len(captions))
    plan = plan_draws(index, mix, TemperatureBalance(1.0), tmp_path, captions=lambda: iter(captions))
    assert [row[0] for row in plan.report["most_boosted_combinations"]] == [
        "black:cross", "cross + square", "cyan:ring", "green:star", "ring + square", "square + star",  # 1 sample each
        "red:square", "blue:circle", "yellow:triangle"]


def _other(value, hint: str):
    """A value of the setting's type that differs from `value`."""
    if "int" in hint:
        return (value or 0) + 7
    if "float" in hint:
        return (value or 0.0) + 0.5
    return f"{value or ''}other"


def test_every_setting_of_every_source_kind_changes_the_plans_fingerprint(two_sets):
    """The sources' settings enter the fingerprint as data: a kind registered later, with settings of its own, cannot
    leave one out. The shards and the draws are held equal, so only the setting differs."""
    from data.settings import SOURCE_KINDS

    root, big, small = two_sets
    index = load_or_build_index(big + small)

    def fingerprint(kind):
        sources = [Source("a", big, share=0.5, kind=kind), Source("b", small, share=0.5, kind=ShardsSource(shards="b"))]
        return plan_fingerprint(index, SourceMix(sources, index.nsamples), TemperatureBalance())

    ignored = []
    for name, kind in SOURCE_KINDS.items():
        base = kind(share=0.5)
        for f in dataclasses.fields(kind):
            if f.name in ("share", "repeat", "choose"):  # weights: held equal here (the draws test above varies them)
                continue
            changed = dataclasses.replace(base, **{f.name: _other(getattr(base, f.name), str(f.type))})
            if fingerprint(changed) == fingerprint(base):
                ignored.append(f"{name}.{f.name}")
    assert not ignored, f"the plan's fingerprint ignores {ignored}"


def test_a_synthetic_source_mixes_with_shards_and_is_named_on_the_card(two_sets, tmp_path, capsys):
    """data.sources of two kinds: the synthetic set written once into the run folder (its own seed), mixed with
    tar shards by share; the start-up log and the model card name each source by its kind's words."""
    from imba.training.model_card import model_card

    root, big, small = two_sets
    cfg = load_config([*RUN, f"train.output_dir={tmp_path}",
                       f"data.sources=[{{kind: synthetic, name: shapes, samples: 24, seed: 5, share: 0.25}}, "
                       f"{{shards: {root / 'big'}, share: 0.75}}]"])
    sources = training_sources(cfg, Accelerator(cpu=True), tmp_path)
    assert [s.name for s in sources] == ["shapes", "source1"]
    assert sources[0].urls == write_synthetic_shards(tmp_path / "sources" / "0-shapes", num_samples=24, resolution=32,
                                                     seed=5)
    assert sources[1].urls == big
    log = capsys.readouterr().out
    assert "data: shapes: the project's synthetic shapes (24 images) (share 0.25), 1 shards" in log
    assert f"data: source1: `{root / 'big'}` (img2dataset-layout tar shards) (share 0.75), {len(big)} shards" in log
    card = model_card(cfg, 10)
    assert (f"the project's synthetic shapes (24 images) (share 0.25); `{root / 'big'}` (img2dataset-layout tar "
            f"shards) (share 0.75)") in card
    # the same run resolves the same shards without writing them again
    mtime = os.stat(sources[0].urls[0]).st_mtime_ns
    assert training_sources(cfg, Accelerator(cpu=True), tmp_path)[0].urls == sources[0].urls
    assert os.stat(sources[0].urls[0]).st_mtime_ns == mtime


def test_a_sources_weight_and_name_in_words():
    from data.sources import SyntheticSource, safe_name

    assert ShardsSource(shards="a/").weight() == ""
    assert ShardsSource(shards="a/", share=0.25).weight() == " (share 0.25)"
    assert SyntheticSource(repeat=3).weight() == " (repeat 3)"
    assert ShardsSource(shards="a/", choose=5000).weight() == " (5000 draws per epoch)"
    assert safe_name("Web/curated 2.v1-x") == "Web_curated_2.v1-x"


def test_a_synthetic_source_draws_from_the_runs_seed_unless_it_names_its_own(tmp_path):
    from data.sources import SourcePlace, SyntheticSource

    def written(folder):  # what the folder's complete set was written with
        return {k: v for k, v in json.loads((folder / "synthetic.json").read_text()).items()
                if k in ("num_samples", "resolution", "seed")}

    place = SourcePlace(tmp_path / "default", resolution=32, seed=7)
    SyntheticSource(samples=6).resolve(place)
    assert written(tmp_path / "default") == {"num_samples": 6, "resolution": 32, "seed": 7}
    SyntheticSource(samples=6, seed=2, folder=str(tmp_path / "own")).resolve(place)
    assert written(tmp_path / "own") == {"num_samples": 6, "resolution": 32, "seed": 2}


def test_a_shard_named_by_a_relative_and_an_absolute_path_is_one_shard(two_sets, monkeypatch):
    root, big, small = two_sets
    monkeypatch.chdir(root)
    with pytest.raises(ValueError, match="is in both source0 and source1"):
        resolve_sources([ShardsSource(shards=os.path.relpath(big[0], root)), ShardsSource(shards=big[0])])
