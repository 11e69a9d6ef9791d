"""TCS scores -> which samples get LP-A3.

Pure functions: the threshold is refreshed once per pass over the data from every seen
sample's time-consistency score, and a sample is selected when its score is below it
(low time-consistency = sharp loss landscape = a hard positive is likely nearby; paper
Sec. 4 and appendix A.1).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lpa3_lightning.core.arguments import check_choice
from lpa3_lightning.core.seeds import epoch_seed

__all__ = [
    "check_criterion", "check_initial_selection", "check_ratio", "check_threshold_rule", "random_selection", "select_below_threshold",
    "selected_count", "selection_threshold",
]


def check_ratio(ratio: float) -> float:
    """Validate the selected fraction ``ratio`` (tau), returning it as a float.

    Raises:
        ValueError: if ``ratio`` is not in (0, 1].
    """
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 < float(ratio) <= 1.0:
        raise ValueError(
            f"`ratio` is the fraction of samples given LP-A3 and must be in (0, 1], got {ratio!r}. "
            "Fix: use e.g. 0.3 (the paper's MedMNIST range is 0.2 to 0.9)."
        )
    return float(ratio)


def selected_count(num_samples: int, ratio: float) -> int:
    """How many of ``num_samples`` the rule selects: ``round(ratio * N)``, at least 1.

    Example:
        >>> selected_count(546, 0.5), selected_count(10, 0.01)
        (273, 1)
    """
    return min(num_samples, max(1, int(math.floor(ratio * num_samples + 0.5))))


def check_initial_selection(initial_selection: str, name: str = "initial_selection") -> None:
    """Raise a ValueError naming ``name`` unless ``initial_selection`` is ``"random"`` or ``"all"``."""
    check_choice(initial_selection, ("random", "all"), name, "use 'random' ('all' is the authors' choice).")


def check_criterion(criterion: str, name: str = "criterion") -> None:
    """Raise a ValueError naming ``name`` unless ``criterion`` is ``"tcs"`` or ``"random"``."""
    check_choice(criterion, ("tcs", "random"), name, "use 'tcs' (LP-A3's selection; 'random' is its ablation).")


def check_threshold_rule(rule: str, name: str = "threshold_rule") -> None:
    """Raise a ValueError naming ``name`` unless ``rule`` is ``"count"`` (select round(ratio * N)) or ``"authors"``."""
    check_choice(rule, ("count", "authors"), name, "use 'count' (select round(ratio * N)).")


def selection_threshold(scores: Tensor, ratio: float, rule: str = "count") -> Tensor:
    """The TCS value below which a sample is selected: the ``k = round(ratio * N)`` lowest.

    The threshold is the ``(k + 1)``-th lowest score, so ``score < threshold`` selects exactly
    the ``k`` least consistent samples when scores are distinct (ties at the threshold are
    left out together). ``ratio == 1`` gives ``+inf``: every sample is selected.

    Departure from the authors' code (``rule="authors"`` restores theirs): they take the value
    at rank ``floor((1 - ratio) * N)`` of the scores sorted descending, and the strict
    comparison then selects ``ceil(ratio * N) - 1`` samples (one fewer than documented). With
    either rule ``ratio == 1`` selects every sample.

    Args:
        scores: ``(N,)`` TCS scores of the samples seen in the last pass (higher = more consistent).
        ratio: fraction to select, in (0, 1].
        rule: ``"count"`` (default, ``round(ratio * N)`` selected) or ``"authors"``.

    Returns:
        A 0-dim tensor with the threshold (dtype and device of ``scores``).

    Example:
        >>> float(selection_threshold(torch.tensor([0.0, -1.0, -2.0, -3.0]), 0.5))
        -1.0
    """
    ratio = check_ratio(ratio)
    if scores.dim() != 1 or scores.numel() == 0:
        raise ValueError(f"`scores` must be a non-empty 1-D tensor, got shape {tuple(scores.shape)}.")
    check_threshold_rule(rule)
    if ratio >= 1.0:
        return torch.tensor(math.inf, dtype=scores.dtype, device=scores.device)
    if rule == "authors":
        rank = int(math.floor((1.0 - ratio) * scores.numel()))
        return torch.sort(scores, descending=True).values[min(rank, scores.numel() - 1)]
    k = selected_count(scores.numel(), ratio)
    if k >= scores.numel():
        return torch.tensor(math.inf, dtype=scores.dtype, device=scores.device)
    return torch.sort(scores).values[k]


def random_selection(indices: Tensor, num_samples: int, ratio: float, seed: int, epoch: int) -> Tensor:
    """Before the first threshold: a random ``round(ratio * N)`` of the data set per epoch.

    A seeded permutation of all dataset indices, drawn from ``(seed, epoch)`` alone, so every
    rank agrees and a resumed run draws the same share; the ``k`` first of it are selected.

    Example:
        >>> int(random_selection(torch.arange(10), 10, 0.3, seed=0, epoch=0).sum())
        3
    """
    generator = torch.Generator().manual_seed(epoch_seed(seed, epoch))
    order = torch.randperm(num_samples, generator=generator)
    chosen = torch.zeros(num_samples, dtype=torch.bool)
    chosen[order[: selected_count(num_samples, ratio)]] = True
    return chosen[indices.cpu().long()].to(indices.device)


def select_below_threshold(scores: Tensor, threshold: Tensor | None) -> Tensor:
    """Boolean mask of the samples to augment; everything before the first threshold exists.

    Example:
        >>> select_below_threshold(torch.tensor([0.0, -2.0]), torch.tensor(-1.0)).tolist()
        [False, True]
    """
    if threshold is None or bool(torch.isnan(threshold)):
        return torch.ones_like(scores, dtype=torch.bool)
    return scores < threshold
