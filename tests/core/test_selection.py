"""Tests for lpa3_lightning.core.selection: the authors' TCS threshold and the selection mask."""

from __future__ import annotations

import math

import pytest
import torch

from lpa3_lightning.core.selection import check_ratio, select_below_threshold, selection_threshold


def _ref_threshold(scores: list[float], ratio: float) -> float:
    """Sorted-descending value at rank floor((1 - ratio) * N), as in the authors' code."""
    ordered = sorted(scores, reverse=True)
    return ordered[int(math.floor((1 - ratio) * len(ordered)))]


@pytest.mark.parametrize("n", [1, 2, 3, 7, 10, 64, 101])
@pytest.mark.parametrize("ratio", [0.01, 0.2, 0.3, 0.5, 0.7, 0.9, 0.99])
def test_threshold_matches_reference(n: int, ratio: float) -> None:
    g = torch.Generator().manual_seed(1000 * n + int(ratio * 100))
    scores = torch.randn(n, generator=g, dtype=torch.float64)
    thr = selection_threshold(scores, ratio, rule="authors")
    assert thr.dim() == 0 and thr.dtype == torch.float64
    ref = _ref_threshold(scores.tolist(), ratio)
    assert float(thr) == ref
    mask = select_below_threshold(scores, thr)
    assert mask.tolist() == [s < ref for s in scores.tolist()]


def test_threshold_with_ties_and_float32() -> None:
    scores = torch.tensor([-1.0, -1.0, -1.0, 0.0, -2.0, -2.0], dtype=torch.float32)
    for ratio in (0.2, 0.5, 0.8):
        thr = selection_threshold(scores, ratio, rule="authors")
        assert thr.dtype == torch.float32
        assert float(thr) == _ref_threshold(scores.tolist(), ratio)
    # rank floor(0.5*6)=3 of [0,-1,-1,-1,-2,-2] is -1: only the -2s are strictly below
    assert select_below_threshold(scores, selection_threshold(scores, 0.5, rule="authors")).tolist() == [
        False, False, False, False, True, True,
    ]


def test_threshold_docstring_example() -> None:
    assert float(selection_threshold(torch.tensor([0.0, -1.0, -2.0, -3.0]), 0.5)) == -1.0
    assert float(selection_threshold(torch.tensor([0.0, -1.0, -2.0, -3.0]), 0.5, rule="authors")) == -2.0


@pytest.mark.parametrize("n", [1, 2, 3, 7, 10, 64, 101])
@pytest.mark.parametrize("ratio", [0.01, 0.2, 0.3, 0.5, 0.7, 0.9, 0.99, 1.0])
def test_count_rule_selects_round_ratio_times_n_lowest(n: int, ratio: float) -> None:
    g = torch.Generator().manual_seed(1000 * n + int(ratio * 100))
    scores = torch.randn(n, generator=g, dtype=torch.float64)
    mask = select_below_threshold(scores, selection_threshold(scores, ratio))
    k = max(1, min(n, int(math.floor(ratio * n + 0.5))))  # computed here, not by selected_count
    assert int(mask.sum()) == k
    lowest = set(torch.argsort(scores)[:k].tolist())
    assert set(mask.nonzero().flatten().tolist()) == lowest


def test_authors_rule_selects_one_fewer_than_ceil() -> None:
    scores = torch.randn(64, generator=torch.Generator().manual_seed(0))
    for ratio in (0.25, 0.5, 0.9):
        mask = select_below_threshold(scores, selection_threshold(scores, ratio, rule="authors"))
        assert int(mask.sum()) == math.ceil(ratio * 64) - 1


def test_random_initial_share_is_seeded_exact_and_rank_independent() -> None:
    from lpa3_lightning.core.selection import random_selection

    everyone = torch.arange(100)
    a = random_selection(everyone, 100, 0.3, seed=1, epoch=0)
    assert int(a.sum()) == 30
    # any split of the indices (e.g. two ranks' batches) agrees with the whole
    halves = torch.cat([random_selection(everyone[:50], 100, 0.3, 1, 0), random_selection(everyone[50:], 100, 0.3, 1, 0)])
    assert torch.equal(a, halves)
    assert not torch.equal(a, random_selection(everyone, 100, 0.3, seed=1, epoch=1))  # a new draw per epoch
    for seed in (2**62 - 1, 2**63 + 5):  # seeds fixed from torch.initial_seed() use up to 64 bits
        assert int(random_selection(everyone, 100, 0.3, seed=seed, epoch=7).sum()) == 30


@pytest.mark.parametrize("ratio", [1, 1.0])
def test_ratio_one_selects_everything(ratio: float) -> None:
    scores = torch.tensor([3.0, -1.0, 0.5, 1e30, -1e30])
    thr = selection_threshold(scores, ratio)
    assert math.isinf(float(thr)) and float(thr) > 0
    assert select_below_threshold(scores, thr).all()


def test_select_without_threshold_selects_all() -> None:
    scores = torch.tensor([1.0, -1.0, 0.0])
    assert select_below_threshold(scores, None).tolist() == [True, True, True]
    assert select_below_threshold(scores, torch.tensor(float("nan"))).tolist() == [True, True, True]
    mask = select_below_threshold(scores, torch.tensor(0.0))
    assert mask.dtype == torch.bool
    assert mask.tolist() == [False, True, False]  # strict comparison


@pytest.mark.parametrize("bad", [0, 0.0, -0.5, -1, 1.0001, 2, float("nan"), True, False, "0.5", None])
def test_check_ratio_rejects(bad) -> None:
    with pytest.raises(ValueError, match=r"`ratio`.*must be in \(0, 1\]"):
        check_ratio(bad)
    with pytest.raises(ValueError, match="`ratio`"):
        selection_threshold(torch.tensor([0.0, 1.0]), bad)


@pytest.mark.parametrize(("ratio", "expected"), [(0.3, 0.3), (1, 1.0), (1e-6, 1e-6)])
def test_check_ratio_accepts_and_returns_float(ratio, expected: float) -> None:
    out = check_ratio(ratio)
    assert type(out) is float and out == expected


@pytest.mark.parametrize("shape", [(), (2, 3), (4, 1), (0,)])
def test_non_1d_or_empty_scores_rejected(shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="non-empty 1-D tensor"):
        selection_threshold(torch.zeros(shape), 0.5)
