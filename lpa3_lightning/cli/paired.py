"""Paired statistics of two arms over seeds (``lpa3 compare``, the benchmarks' tables): the mean difference,
its Student-t interval ``d +- t(1 - a/2, n - 1) s / sqrt(n)``, the verdict, and the seeds a difference of a
given size needs. A seed fixes what both arms share, so their difference on it cancels what it changes. Plain
Python (``math``): no SciPy, no torch.

Example:
    >>> row = paired_difference({1: 0.80, 2: 0.82, 3: 0.81}, {1: 0.85, 2: 0.86, 3: 0.87})
    >>> round(row["mean"], 3), row["verdict"]
    (0.05, 'helps')
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping

__all__ = ["MIN_SEEDS", "MOST_SEEDS", "paired_difference", "seeds_needed", "seeds_needed_text", "t_quantile"]

#: fewer seeds than this give no verdict (an interval from two seeds spans almost anything)
MIN_SEEDS = 3
#: the most seeds :func:`seeds_needed` tries, and the cap :func:`seeds_needed_text` prints when they fall short
MOST_SEEDS = 1000


def _beta_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of the regularized incomplete beta function (modified Lentz's method)."""
    tiny, eps = 1e-300, 1e-15
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 400):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < eps:
            break
    return h


def _incomplete_beta(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function ``I_x(a, b)``."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(a * math.log(x) + b * math.log1p(-x) - (math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b)))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _beta_fraction(a, b, x) / a
    return 1.0 - front * _beta_fraction(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """Student's t distribution function with ``df`` degrees of freedom."""
    tail = 0.5 * _incomplete_beta(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t with ``df`` degrees of freedom (bisection on :func:`t_cdf`); a
    ``ValueError`` for ``p`` outside (0, 1) or ``df <= 0``."""
    if not 0.0 < p < 1.0 or not df > 0:
        raise ValueError(f"`p` must be in (0, 1) and `df` > 0, got p={p!r}, df={df!r}.")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    low, high = 0.0, 1.0
    while t_cdf(high, df) < p:
        high *= 2.0
    for _ in range(200):
        middle = 0.5 * (low + high)
        low, high = (middle, high) if t_cdf(middle, df) < p else (low, middle)
        if high - low < 1e-12 * max(1.0, high):
            break
    return 0.5 * (low + high)


def _power(effect: float, std: float, n: int, confidence: float) -> float:
    """The power of the two-sided paired t test of ``n`` seeds to find ``effect`` at spread ``std``: the
    noncentral t's tails beyond the critical value, integrated over the chi-square of the spread
    (``v = u^2``, which removes the chi-square's pole at 0 for one degree of freedom; Simpson's rule)."""
    df = n - 1
    critical = t_quantile(0.5 + confidence / 2.0, df)
    shift = abs(effect) / std * math.sqrt(n)
    top = math.sqrt(df + 12.0 * math.sqrt(2.0 * df) + 30.0)  # sqrt of a chi-square far in its tail
    steps = 2000
    width = top / steps
    log_norm = math.log(2.0) - 0.5 * df * math.log(2.0) - math.lgamma(0.5 * df)  # of 2 u f(u^2)
    total = 0.0
    for k in range(steps + 1):
        u = k * width
        density = 0.0 if u == 0.0 and df > 1 else math.exp(log_norm + (df - 1.0) * math.log(u) - 0.5 * u * u) \
            if u > 0.0 else math.exp(log_norm)
        scale = critical * u / math.sqrt(df)
        tail = 0.5 * math.erfc(-(shift - scale) / math.sqrt(2.0)) + 0.5 * math.erfc(-(-shift - scale) / math.sqrt(2.0))
        total += (1 if k in (0, steps) else 4 if k % 2 else 2) * density * tail
    return total * width / 3.0


def seeds_needed(effect: float, std: float, power: float = 0.8, confidence: float = 0.95,
                 most: int = MOST_SEEDS) -> int | None:
    """The fewest seeds whose paired t test (two-sided, at ``confidence``) finds a mean difference of
    ``effect`` with probability ``power`` when the differences spread by ``std`` (None: none up to ``most``;
    a spread of 0 needs :data:`MIN_SEEDS`).

    Example:
        >>> seeds_needed(0.01, 0.012), seeds_needed(0.02, 0.012)
        (14, 6)
    """
    if not (std >= 0 and math.isfinite(std)) or effect == 0:
        return None
    if std == 0:
        return MIN_SEEDS
    for n in range(2, most + 1):
        if _power(effect, std, n, confidence) >= power:
            return max(n, MIN_SEEDS)
    return None


def seeds_needed_text(needed: int | None, std: float, most: int = MOST_SEEDS) -> str:
    """How a table prints :func:`seeds_needed`'s answer ``needed`` for differences that spread by ``std``:
    ``"n/a"`` where there is no spread to size from (one seed, a non-finite value), ``"> most"`` where even
    ``most`` seeds fall short (its None), else the count.

    Example:
        >>> seeds_needed_text(seeds_needed(0.01, 0.2), 0.2), seeds_needed_text(14, 0.012)
        ('> 1000', '14')
        >>> seeds_needed_text(None, math.nan)
        'n/a'
    """
    if not math.isfinite(std):
        return "n/a"
    return f"> {most}" if needed is None else str(needed)


def paired_difference(base: Mapping[int, float], other: Mapping[int, float], confidence: float = 0.95) -> dict:
    """Paired statistics of ``other - base`` over the seeds both have: a dict of ``seeds``, ``diffs``, ``mean``,
    ``std``, ``ci`` (the two-sided Student-t interval of the mean at ``confidence``), ``confidence``, ``above``
    and ``below`` (seeds where ``other`` is higher, lower), ``n`` and ``verdict``: ``"helps"`` (the interval above 0), ``"hurts"``
    (below), ``"no difference found"`` (it holds 0), or no verdict, saying why, for fewer than
    :data:`MIN_SEEDS` seeds, differences without spread or a non-finite value.

    Raises:
        ValueError: for a ``confidence`` outside (0, 1).
    """
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"`confidence` must be in (0, 1), got {confidence!r}. Fix: use 0.95.")
    seeds = sorted(set(base) & set(other))
    diffs = [float(other[s]) - float(base[s]) for s in seeds]
    n = len(diffs)
    row = {"seeds": seeds, "diffs": diffs, "mean": math.nan, "std": math.nan, "ci": (math.nan, math.nan),
           "confidence": confidence, "above": sum(d > 0 for d in diffs), "below": sum(d < 0 for d in diffs),
           "n": n}
    if not all(math.isfinite(d) for d in diffs):  # a diverged run (NaN accuracy) is no evidence either way
        return {**row, "verdict": "a run without a finite value: no interval"}
    if n:
        row["mean"] = statistics.mean(diffs)
    if n < 2:
        return {**row, "verdict": f"{n} seed{'s' if n != 1 else ''}: no interval"}
    row["std"] = statistics.stdev(diffs)
    half = t_quantile(0.5 + confidence / 2.0, n - 1) * row["std"] / math.sqrt(n)
    row["ci"] = (row["mean"] - half, row["mean"] + half)
    if n < MIN_SEEDS:
        return {**row, "verdict": f"{n} seeds: no verdict (at least {MIN_SEEDS})"}
    if row["std"] == 0:
        return {**row, "verdict": "every seed the same difference: no spread, no verdict"}
    low, high = row["ci"]
    return {**row, "verdict": "helps" if low > 0 else "hurts" if high < 0 else "no difference found"}
