"""The benchmarks' statistics over repetitions (seeds, runs): means with their 95 % Student t interval, the 95 %
interval of a ratio of two paired means (Fieller's), and Pearson's r with its 95 % interval, from `scipy.stats`
(the t quantile exact at every number of degrees of freedom)."""

from __future__ import annotations

import math
import statistics

from scipy import stats

LEVEL = 0.95


def t_quantile(df: int) -> float:
    """The two-sided 95 % quantile of Student's t with `df` degrees of freedom (2.776 at 4, 2.045 at 29)."""
    return float(stats.t.ppf(0.5 + LEVEL / 2, df))


def mean_ci(values: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95 % t confidence interval (0 for a single value)."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, 0.0
    return mean, t_quantile(len(values) - 1) * float(stats.sem(values))


def fraction_interval(gains: list[float], gaps: list[float]) -> tuple[float, float] | None:
    """95 % interval of the fraction mean(gain) / mean(gap) over seeds (Fieller's: the fractions f whose per-seed
    differences gain_s - f * gap_s a paired t-test over the seeds does not reject as mean 0). gains[s], gaps[s]:
    seed s's mean over the pairs of one bucket. The seeds are what varies between repetitions: the pairs are the
    same ones in every seed and their spread is not a source of repetition error. None with fewer than 2 seeds, or
    where the gap is not clearly above 0 over the seeds (the set of fractions is then unbounded)."""
    n = len(gains)
    if n < 2:
        return None
    mean_a, mean_b = statistics.fmean(gains), statistics.fmean(gaps)
    var_a, var_b, cov = statistics.variance(gains), statistics.variance(gaps), statistics.covariance(gains, gaps)
    q = t_quantile(n - 1) ** 2 / n
    # (mean_a - f mean_b)^2 <= q (var_a - 2 f cov + f^2 var_b), a quadratic A f^2 - 2 B f + C <= 0
    A, B, C = mean_b ** 2 - q * var_b, mean_a * mean_b - q * cov, mean_a ** 2 - q * var_a
    if A <= 0:
        return None
    root = math.sqrt(max(B * B - A * C, 0.0))
    return (B - root) / A, (B + root) / A


def pearson(x: list[float], y: list[float]) -> tuple[float, float, float] | None:
    """Pearson r of paired values with its 95 % interval (Fisher z), or None for fewer than 4 pairs or a constant
    side."""
    if len(x) < 4 or len(set(x)) < 2 or len(set(y)) < 2:
        return None
    result = stats.pearsonr(x, y)
    interval = result.confidence_interval(LEVEL)
    return float(result.statistic), float(interval.low), float(interval.high)
