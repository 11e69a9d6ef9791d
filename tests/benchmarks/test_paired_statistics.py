"""The evidence tables' statistics: paired differences with their t interval, and the flag on a
pseudo-label tally that contradicts the accuracy beside it."""

from __future__ import annotations

import math

import pytest

from benchmarks.harness import paired_difference
from benchmarks.ssl_table import contradiction


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
    assert paired_difference({0: 0.5}, {0: 0.6})["verdict"] == "one seed: no interval"


def test_a_tally_at_chance_beside_a_high_accuracy_is_flagged_and_the_reverse_too():
    assert "near chance" in contradiction({"masked_acc": 0.10, "raw_test_acc": 0.79, "masked_count": 224}, 10)
    assert "near chance" in contradiction({"masked_acc": 0.95, "raw_test_acc": 0.11, "masked_count": 224}, 10)
    assert contradiction({"masked_acc": 0.93, "raw_test_acc": 0.90, "masked_count": 224}, 10) is None
    assert contradiction({"masked_acc": 0.10, "raw_test_acc": 0.12, "masked_count": 224}, 10) is None  # both low
    assert contradiction({"masked_acc": 0.0, "raw_test_acc": 0.53, "masked_count": 3}, 10) is None  # too few counted
    assert contradiction({"masked_acc": None, "raw_test_acc": 0.9}, 10) is None


def test_a_diverged_run_gives_no_verdict():
    assert paired_difference({0: 0.9, 1: 0.8}, {0: float("nan"), 1: 0.85})["verdict"] == \
        "a run without a finite accuracy: no interval"
