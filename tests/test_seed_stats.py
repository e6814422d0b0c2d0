"""The benchmarks' statistics over seeds (bench/seed_stats.py): t intervals with the exact quantile at every number
of degrees of freedom, Fieller's interval of a fraction of two paired means, Pearson's r with its interval. The
quantiles asserted are the published table values of Student's t (two-sided 95 %)."""

import math
import statistics
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import seed_stats  # noqa: E402

T_975 = {1: 12.7062047, 2: 4.3026527, 4: 2.7764451, 13: 2.1603687, 21: 2.0796138, 29: 2.0452296, 120: 1.9799304}


@pytest.mark.parametrize("df", sorted(T_975))
def test_the_t_quantile_is_exact_at_every_df(df):
    # a table that stops at 20 degrees of freedom and reads 1.96 beyond gives intervals 2-6 % too narrow there
    assert seed_stats.t_quantile(df) == pytest.approx(T_975[df], abs=1e-6)


@pytest.mark.parametrize("n", [2, 5, 14, 30])
def test_the_mean_interval_is_students_t_over_the_sample_sd(n):
    values = [0.0, 1.0] * (n // 2) + [0.5] * (n % 2)
    sd = statistics.stdev(values)  # n - 1 in the denominator
    mean, half = seed_stats.mean_ci(values)
    assert mean == pytest.approx(statistics.fmean(values))
    assert half == pytest.approx(T_975[n - 1] * sd / math.sqrt(n), rel=1e-6)
    assert seed_stats.mean_ci([0.3]) == (0.3, 0.0)


def test_the_fraction_interval_inverts_the_paired_t_test_over_seeds():
    # a gap the same in every seed: the interval is the gain's t interval over the 3 seeds, divided by the gap
    lo, hi = seed_stats.fraction_interval([0.1, 0.3, 0.2], [0.5, 0.5, 0.5])
    half = 4.3026527 * 0.1 / math.sqrt(3)  # t(2) * sd of the gains / sqrt(3)
    assert (lo, hi) == pytest.approx(((0.2 - half) / 0.5, (0.2 + half) / 0.5))
    # at each end the paired t-test of gain - f * gap is exactly at its 95 % bound
    gains, gaps = [0.10, 0.35, 0.20, 0.28], [0.45, 0.60, 0.40, 0.52]
    for f in seed_stats.fraction_interval(gains, gaps):
        d = [g - f * c for g, c in zip(gains, gaps)]
        assert abs(statistics.fmean(d)) == pytest.approx(3.1824463 * statistics.stdev(d) / 2)
    # five seeds whose fractions are all positive can still give an interval that reaches 0: what varies is the seed
    assert seed_stats.fraction_interval([0.04, 0.36, 0.10, 0.02, 0.30], [0.5, 0.5, 0.5, 0.5, 0.5])[0] < 0
    assert seed_stats.fraction_interval([0.1], [0.5]) is None
    assert seed_stats.fraction_interval([0.1, 0.2, 0.1], [0.5, -0.4, 0.1]) is None  # no clear gap: unbounded


def test_pearson_r_and_its_interval():
    r, lo, hi = seed_stats.pearson([1.0, 2.0, 3.0, 4.0, 5.0], [2.0, 4.1, 5.9, 8.2, 9.9])
    assert r == pytest.approx(0.9988, abs=1e-3) and lo < r < hi <= 1
    half = 1.9599640 / math.sqrt(5 - 3)  # Fisher's z: atanh(r) ± the normal quantile / sqrt(n - 3)
    assert (lo, hi) == pytest.approx((math.tanh(math.atanh(r) - half), math.tanh(math.atanh(r) + half)), abs=1e-6)
    assert seed_stats.pearson([1.0, 2.0, 3.0], [1.0, 2.0, 3.0]) is None  # too few runs for an interval
    assert seed_stats.pearson([1.0] * 5, [1.0, 2.0, 3.0, 4.0, 5.0]) is None
