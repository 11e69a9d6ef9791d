"""Stage 2 of a batch: which rows get a hard positive (TCS selection, then two filters)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lpa3_lightning.callback.request_checks import bad_value_counts, raise_bad_values
from lpa3_lightning.core.augmented import LPA3Request
from lpa3_lightning.core.tcs import TimeConsistency

__all__ = ["Selection", "finite_rows", "select"]


@dataclass
class Selection:
    """The rows of one batch to augment.

    Attributes:
        mask: ``(B,)`` the rows TCS selected, less non-finite inputs and a lone selection.
        count: ``mask.sum()``, read on the host.
        tcs_selected: how many TCS selected before those filters.
        num_trained: how many of the ``count`` the request's ``train_mask`` keeps (``count``
            without a mask): only these are solved.
        nonfinite: rows with a NaN or Inf input (never attacked; logged).
        finite: ``(B,)`` which rows' inputs are finite.
    """

    mask: Tensor
    count: int
    tcs_selected: int
    num_trained: int
    nonfinite: int
    finite: Tensor


def finite_rows(request: LPA3Request, like: Tensor | None = None) -> Tensor:
    """``(B,)`` which rows' inputs hold no NaN or Inf (``like`` for an empty batch's shape)."""
    if request.inputs.numel():
        return torch.isfinite(request.inputs.flatten(1)).all(dim=1)
    return torch.ones(request.inputs.shape[0], dtype=torch.bool, device=request.inputs.device) if like is None else like


def select(memory: TimeConsistency, request: LPA3Request, epoch: int, sync_free: bool,
           bad_recorded: Tensor) -> Selection:
    """TCS selection of the request's rows, the rows with non-finite inputs left out, and a
    lone selected row dropped (batch statistics need two).

    Every count comes to the host in one copy on the sync-free path, together with the request's
    value checks (out-of-range indices or labels raise the default path's named error there);
    the default path reads them as it goes.
    """
    device = request.inputs.device
    # sync-free: clamped, so an out-of-range index reaches the named error, not the lookup's
    indices = request.indices.clamp(0, memory.num_samples - 1) if sync_free else request.indices
    tcs_mask = memory.select(indices, epoch, check_values=not sync_free).to(device)
    finite = finite_rows(request, like=tcs_mask)
    mask = tcs_mask & finite  # NaN / Inf inputs are never attacked (counted in lpa3/nonfinite_inputs)
    trained = mask if request.train_mask is None else mask & request.train_mask.to(device)
    counts = [mask.sum(), tcs_mask.sum(), (~finite).sum(), trained.sum()]
    if sync_free:
        counts += [c.to(device) for c in bad_value_counts(request, memory.num_samples, memory.num_classes,
                                                          bad_recorded)]
    count, tcs_selected, nonfinite, num_trained, *bad = torch.stack(counts).tolist()  # one host read
    if sync_free:
        raise_bad_values(request, memory.num_samples, memory.num_classes, bad)
    if count == 1:
        # batch statistics (twin BN in train mode) need two samples: a lone selection is dropped
        # for this batch rather than crashing BatchNorm1d models
        mask, count, num_trained = torch.zeros_like(mask), 0, 0
    return Selection(mask, int(count), int(tcs_selected), int(num_trained), int(nonfinite), finite)
