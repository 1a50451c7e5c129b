"""Is a difference between two seed groups more than seed noise? Intervals and tests over seeds.

Each seed of a configuration is one draw of its final validation loss; with the few seeds a
night affords (2-5), the questions are (1) where the group's mean lies (a 95% confidence
interval, Student's t over the seeds) and (2) whether two groups differ beyond what their seeds
scatter. For (2) this module uses **Welch's t-test** (``scipy.stats.ttest_ind(equal_var=False)``):
it does not assume the two groups scatter alike (a higher learning rate often scatters more) and
it is exact for normal draws at any n >= 2. A permutation test was considered and rejected for
these sizes: with 2 + 2 or 3 + 3 runs there are only 6 or 20 arrangements, so its p-value can
never go below 1/3 or 1/10, and no difference, however large, would be called real. The
interval of the difference uses Welch's degrees of freedom, consistent with the test.

When the test finds nothing, :func:`seeds_needed` says how many seeds per group would detect a
difference of the observed size with 80% power at the 5% level, from the observed spread (the
normal approximation ``n = 2 (z_0.975 + z_0.8)^2 s^2 / d^2``, plus one seed per group for the
t distribution's heavier tails). It is a planning figure, not a promise: the spread of 2-3 seeds
is itself uncertain.

scipy (a core dependency) does the distributions.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from scipy import stats as scipy_stats

LEVEL = 0.95
ALPHA = 0.05
POWER = 0.80


@dataclass(frozen=True)
class MeanCI:
    """A group's mean with the half-width of its 95% interval (None for a single seed)."""

    mean: float
    half_width: float | None
    n: int

    def text(self, fmt: str = ".4f") -> str:
        if self.half_width is None:
            return f"{self.mean:{fmt}} (1 seed: no interval)"
        return f"{self.mean:{fmt}} ± {self.half_width:{fmt}} (95% CI, n={self.n})"


def mean_ci(values: list[float], level: float = LEVEL) -> MeanCI:
    """Mean and Student-t interval over ``values`` (one value per seed)."""
    n = len(values)
    if n == 0:
        raise ValueError("no values")
    mean = statistics.fmean(values)
    if n < 2:
        return MeanCI(mean, None, n)
    t = float(scipy_stats.t.ppf((1 + level) / 2, n - 1))
    return MeanCI(mean, t * statistics.stdev(values) / math.sqrt(n), n)


@dataclass(frozen=True)
class Difference:
    """Group A minus group B: the difference of means, its 95% interval, Welch's p-value."""

    difference: float
    half_width: float
    p_value: float
    dof: float
    n_a: int
    n_b: int
    seeds_needed: int | None  # per group, for 80% power at this size (None: not computable)

    @property
    def significant(self) -> bool:
        return self.p_value < ALPHA


def welch(a: list[float], b: list[float], level: float = LEVEL) -> Difference:
    """Welch's t-test of mean(a) != mean(b) and the interval of mean(a) - mean(b)."""
    if len(a) < 2 or len(b) < 2:
        raise ValueError("each group needs at least 2 seeds")
    stats = scipy_stats
    va, vb = statistics.variance(a), statistics.variance(b)
    se2 = va / len(a) + vb / len(b)
    diff = statistics.fmean(a) - statistics.fmean(b)
    if se2 == 0:  # every seed of both groups the same: no spread to judge by, no test
        return Difference(diff, 0.0, math.nan, math.nan, len(a), len(b), None)
    dof = se2**2 / ((va / len(a)) ** 2 / (len(a) - 1) + (vb / len(b)) ** 2 / (len(b) - 1))
    half = float(stats.t.ppf((1 + level) / 2, dof)) * math.sqrt(se2)
    # Welch's two-sided p from t and dof (ttest_ind(equal_var=False) gives the same number,
    # but warns of "catastrophic cancellation" for seeds that agree to many digits).
    p = float(2 * stats.t.sf(abs(diff) / math.sqrt(se2), dof))
    return Difference(diff, half, p, dof, len(a), len(b), seeds_needed(a, b))


def seeds_needed(a: list[float], b: list[float]) -> int | None:
    """Seeds per group for 80% power to detect the observed difference at the 5% level."""
    stats = scipy_stats
    d = abs(statistics.fmean(a) - statistics.fmean(b))
    s2 = (statistics.variance(a) + statistics.variance(b)) / 2
    if d == 0 or s2 == 0:
        return None
    z = float(stats.norm.ppf(1 - ALPHA / 2) + stats.norm.ppf(POWER))
    return math.ceil(2 * z * z * s2 / (d * d)) + 1


def sentence(name_a: str, name_b: str, d: Difference, what: str = "val loss") -> str:
    """One plain sentence: which is lower and by how much, or that seeds cannot tell."""
    each = f"{d.n_a} seeds each" if d.n_a == d.n_b else f"{d.n_a} and {d.n_b} seeds"
    if math.isnan(d.p_value):
        return (
            f"{name_a} vs {name_b}: {d.difference:+.3f} {what}, but the seeds of each group "
            f"gave identical values ({each}): no spread, so no test (are the seeds applied?)"
        )
    if d.significant:
        lower, higher = (name_a, name_b) if d.difference < 0 else (name_b, name_a)
        if d.difference >= 0 and d.n_a != d.n_b:  # the seed counts in the names' order
            each = f"{d.n_b} and {d.n_a} seeds"
        return (
            f"{lower} is lower than {higher} by {abs(d.difference):.3f} ± {d.half_width:.3f} "
            f"{what} ({each}, Welch p = {d.p_value:.2g})"
        )
    more = (
        f"; about {d.seeds_needed} seeds each would resolve a difference of this size"
        if d.seeds_needed is not None
        else ""
    )
    return (
        f"{name_a} vs {name_b}: {d.difference:+.3f} ± {d.half_width:.3f} {what}, not "
        f"distinguishable from seed noise at {each} (Welch p = {d.p_value:.2g}){more}"
    )
