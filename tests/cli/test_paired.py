"""The paired statistics (lpa3_lightning.cli.paired) against SciPy's, an independent implementation: the
t quantile, the interval, the power of the paired t test, the seeds a difference needs; and the verdicts."""

from __future__ import annotations

import math

import pytest

from lpa3_lightning.cli.paired import paired_difference, seeds_needed, seeds_needed_text


def test_a_paired_difference_gives_the_t_interval_of_the_mean_and_its_verdict():
    base = {0: 0.80, 1: 0.70, 2: 0.90, 3: 0.75, 4: 0.85}
    shifted = {s: v + d for (s, v), d in zip(base.items(), (0.02, 0.03, 0.01, 0.02, 0.02))}
    d = paired_difference(base, shifted)
    assert d["diffs"] == pytest.approx([0.02, 0.03, 0.01, 0.02, 0.02])
    assert d["mean"] == pytest.approx(0.02) and d["std"] == pytest.approx(math.sqrt(0.0002 / 4))
    # t(0.975, 4) = 2.776: half width 2.776 * std / sqrt(5)
    assert d["ci"][1] - d["mean"] == pytest.approx(2.7764 * d["std"] / math.sqrt(5), rel=1e-3)
    assert d["verdict"] == "helps" and d["above"] == 5
    # the unpaired spread (0.07 across seeds) would hide it; the pairing does not
    assert paired_difference(shifted, base)["verdict"] == "hurts"
    mixed = {s: v + d for (s, v), d in zip(base.items(), (0.02, -0.03, 0.01, -0.02, 0.01))}
    assert paired_difference(base, mixed)["verdict"] == "no difference found"


def test_only_the_seeds_both_rows_have_are_paired():
    d = paired_difference({0: 0.5, 1: 0.6, 2: 0.7}, {1: 0.65, 2: 0.72, 3: 0.9})
    assert d["seeds"] == [1, 2] and d["n"] == 2
    assert paired_difference({0: 0.5}, {0: 0.6})["verdict"] == "1 seed: no interval"


def test_a_diverged_run_gives_no_verdict():
    assert paired_difference({0: 0.9, 1: 0.8}, {0: float("nan"), 1: 0.85})["verdict"] == \
        "a run without a finite value: no interval"


def test_the_t_quantile_and_the_interval_are_scipys():
    import numpy as np
    from scipy import stats

    from lpa3_lightning.cli.paired import t_quantile

    for df in (1, 2, 3, 4, 7, 12, 30, 120):
        for p in (0.6, 0.9, 0.975, 0.995):
            assert t_quantile(p, df) == pytest.approx(stats.t.ppf(p, df), rel=1e-9)
            assert t_quantile(1 - p, df) == pytest.approx(stats.t.ppf(1 - p, df), rel=1e-9)
    rng = np.random.default_rng(0)
    for n in (3, 5, 8, 14):
        base, other = rng.normal(0.8, 0.05, n), rng.normal(0.81, 0.05, n)
        row = paired_difference(dict(enumerate(base)), dict(enumerate(other)))
        diffs = other - base
        low, high = stats.t.interval(0.95, n - 1, loc=diffs.mean(), scale=stats.sem(diffs))
        assert row["ci"] == pytest.approx((low, high), rel=1e-9)
        # the interval holds 0 exactly when the paired t test does not reject at 5%
        assert (row["verdict"] == "no difference found") == (stats.ttest_rel(other, base).pvalue >= 0.05)


def test_the_seeds_needed_follow_the_noncentral_t_power_of_scipy():
    from scipy import stats

    from lpa3_lightning.cli.paired import seeds_needed

    def power(effect, std, n):  # two-sided paired t at 5%
        critical, shift = stats.t.ppf(0.975, n - 1), effect / std * n ** 0.5
        return stats.nct.sf(critical, n - 1, shift) + stats.nct.cdf(-critical, n - 1, shift)

    for effect, std in ((0.01, 0.012), (0.02, 0.012), (0.01, 0.03), (0.005, 0.004)):
        expected = next(n for n in range(2, 2000) if power(effect, std, n) >= 0.8)
        assert seeds_needed(effect, std) == max(expected, 3)
    assert seeds_needed(0.01, 0.012) == 14 and seeds_needed(0.02, 0.012) == 6  # (the spread measured on 0.3.0)


@pytest.mark.parametrize("base, other, verdict", [
    # two seeds, each one image of 156 better: an interval of no width, and no verdict (it said "helps")
    ({0: 0.5, 1: 0.6}, {0: 0.5 + 1 / 156, 1: 0.6 + 1 / 156}, "2 seeds: no verdict (at least 3)"),
    ({0: 0.5, 1: 0.6, 2: 0.7}, {0: 0.51, 1: 0.61, 2: 0.71}, "every seed the same difference: no spread, no verdict"),
    ({0: 0.5, 1: 0.6, 2: 0.7}, {0: 0.52, 1: 0.621, 2: 0.722}, "helps"),
])
def test_too_few_seeds_or_no_spread_give_no_verdict(base, other, verdict):
    assert paired_difference(base, other)["verdict"] == verdict


def test_a_bad_confidence_is_refused_by_name():
    with pytest.raises(ValueError, match="`confidence` must be in"):
        paired_difference({0: 0.5}, {0: 0.6}, confidence=95)


def test_the_printed_seeds_needed_say_why_there_is_no_count():
    """One text for both tables (`lpa3 compare`, benchmarks/paired_curves.py): the count, the cap when even
    1,000 seeds fall short, and "n/a" when there is no spread to size from."""
    assert seeds_needed_text(seeds_needed(0.01, 0.012), 0.012) == str(seeds_needed(0.01, 0.012))
    assert seeds_needed(0.01, 0.5) is None and seeds_needed_text(seeds_needed(0.01, 0.5), 0.5) == "> 1000"
    assert seeds_needed_text(None, math.nan) == "n/a" and seeds_needed_text(None, math.inf) == "n/a"
