"""Stage 1 of a batch: the module's request, checked (a refusal on one rank reaches every rank
through the step's one reduction, in :mod:`lpa3_lightning.callback.lpa3_callback`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from lpa3_lightning.core.augmented import LPA3Request
from lpa3_lightning.core.checks import check_class_labels, check_dataset_indices, count_out_of_range

__all__ = ["bad_value_counts", "check_request", "raise_bad_values"]


def check_request(request: LPA3Request, num_classes: int, num_samples: int, values: bool = True) -> None:
    """Refuse a request of the wrong type or shapes, and (``values``) out-of-range indices or labels.

    Raises:
        TypeError, ValueError: naming the field and the fix.
    """
    if not isinstance(request, LPA3Request):
        raise TypeError(f"`lpa3_request` must return an LPA3Request, got {type(request).__name__}.")
    n = request.inputs.shape[0]
    if request.targets.shape != (n,) or request.indices.shape != (n,):
        raise ValueError(
            f"LPA3Request needs targets and indices of shape ({n},) for {n} inputs, got "
            f"{tuple(request.targets.shape)} and {tuple(request.indices.shape)}. Fix: return one label and one "
            "dataset index per sample."
        )
    check_dataset_indices(request.indices, num_samples, name="LPA3Request.indices", values=values)
    train_mask = request.train_mask
    if train_mask is not None and (not isinstance(train_mask, Tensor) or train_mask.dtype != torch.bool
                                   or train_mask.shape != (n,)):
        what = (f"dtype {train_mask.dtype} and shape {tuple(train_mask.shape)}" if isinstance(train_mask, Tensor)
                else type(train_mask).__name__)
        raise ValueError(f"LPA3Request.train_mask must be a bool tensor of shape ({n},) (one flag per input), got "
                         f"{what}. Fix: pass e.g. `confidence >= threshold`, or None to solve every selected row.")
    check_class_labels(request.targets, num_classes, name="LPA3Request.targets", values=values)


def bad_value_counts(request: LPA3Request, num_samples: int, num_classes: int, bad_recorded: Tensor) -> list[Tensor]:
    """Device counts of the request's out-of-range indices and labels, and of the out-of-range
    indices recorded with earlier steps' predictions (the sync-free path reads them in its one copy)."""
    device = request.indices.device
    return [count_out_of_range(request.indices, num_samples),
            count_out_of_range(request.targets, num_classes).to(device), bad_recorded.to(device)]


def raise_bad_values(request: LPA3Request | None, num_samples: int, num_classes: int, bad: Sequence[int]) -> None:
    """The named errors of the default path, for the counts of :func:`bad_value_counts` read on the host."""
    bad_indices, bad_labels, bad_recorded = bad
    if (bad_indices or bad_labels) and request is not None:
        check_request(request, num_classes, num_samples, values=True)
    if bad_recorded:
        raise ValueError(
            f"{int(bad_recorded)} dataset indices recorded with `lpa3_record_predictions` were outside the "
            f"training set [0, {num_samples}). Fix: record the batch's indices of the training set itself "
            "(the ones the dataset returns), not positions in the batch or in a subset."
        )
