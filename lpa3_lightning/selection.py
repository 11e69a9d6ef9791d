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

__all__ = ["check_ratio", "select_below_threshold", "selection_threshold"]


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


def selection_threshold(scores: Tensor, ratio: float) -> Tensor:
    """The TCS value below which a sample is selected, as in the authors' code.

    Scores are sorted in descending order and the threshold is the value at rank
    ``floor((1 - ratio) * N)``; selecting ``score < threshold`` then picks about the
    ``ratio`` least consistent samples. For ``ratio == 1`` the threshold is ``+inf`` so that
    every sample is selected (the authors' strict comparison would leave out the most
    consistent one).

    Args:
        scores: ``(N,)`` TCS scores of the samples seen in the last pass (higher = more consistent).
        ratio: fraction to select, in (0, 1].

    Returns:
        A 0-dim tensor with the threshold (dtype and device of ``scores``).

    Example:
        >>> float(selection_threshold(torch.tensor([0.0, -1.0, -2.0, -3.0]), 0.5))
        -2.0
    """
    ratio = check_ratio(ratio)
    if scores.dim() != 1 or scores.numel() == 0:
        raise ValueError(f"`scores` must be a non-empty 1-D tensor, got shape {tuple(scores.shape)}.")
    if ratio >= 1.0:
        return torch.tensor(math.inf, dtype=scores.dtype, device=scores.device)
    rank = int(math.floor((1.0 - ratio) * scores.numel()))
    ordered = torch.sort(scores, descending=True).values
    return ordered[min(rank, scores.numel() - 1)]


def select_below_threshold(scores: Tensor, threshold: Tensor | None) -> Tensor:
    """Boolean mask of the samples to augment; everything before the first threshold exists.

    Example:
        >>> select_below_threshold(torch.tensor([0.0, -2.0]), torch.tensor(-1.0)).tolist()
        [False, True]
    """
    if threshold is None or bool(torch.isnan(threshold)):
        return torch.ones_like(scores, dtype=torch.bool)
    return scores < threshold
