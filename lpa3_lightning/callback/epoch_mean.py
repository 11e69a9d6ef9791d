"""The callback's per-epoch mean, without the host read torchmetrics makes to drop NaN values."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torchmetrics import MeanMetric

__all__ = ["NanIgnoringMean"]


class NanIgnoringMean(MeanMetric):
    """A weighted :class:`~torchmetrics.MeanMetric` that leaves NaN values out without a host read.

    ``MeanMetric(nan_strategy="ignore")`` drops NaN values by asking ``nans.any()`` on the host
    (a GPU synchronisation at every update), and ``nan_strategy="disable"`` also discards the
    weights (torchmetrics 1.9). Here a NaN value or weight gets weight 0 instead, selected on
    the device, so the epoch mean is that of the finite values, as with ``"ignore"``; the state
    and its cross-process sync are MeanMetric's.

    Example:
        >>> mean = NanIgnoringMean()
        >>> mean.update(torch.tensor([1.0, float("nan"), 3.0]), torch.tensor([1.0, 5.0, 1.0]))
        >>> float(mean.compute())
        2.0
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(nan_strategy="disable", **kwargs)

    def update(self, value: float | Tensor, weight: float | Tensor | None = None) -> None:
        # Python numbers become device tensors by a fill, not a host-to-device copy (a GPU sync)
        value = value.to(self.device, self.dtype) if isinstance(value, Tensor) else \
            torch.full((), float(value), dtype=self.dtype, device=self.device)
        if weight is None:
            weight = torch.ones_like(value)
        elif isinstance(weight, Tensor):
            weight = weight.to(self.device, self.dtype)
        else:
            weight = torch.full_like(value, float(weight))
        weight = torch.broadcast_to(weight, value.shape)
        bad = torch.isnan(value) | torch.isnan(weight)
        value = torch.where(bad, torch.zeros_like(value), value)
        weight = torch.where(bad, torch.zeros_like(weight), weight)
        self.mean_value += (value * weight).sum()
        self.weight += weight.sum()
