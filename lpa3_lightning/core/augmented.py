"""The containers passed between a LightningModule and :class:`LPA3Callback`.

Data path: the module offers a :class:`LPA3Request` (inputs, labels to preserve, dataset
indices) for each training batch; the callback selects by TCS, runs the solver, and hands
back an :class:`AugmentedBatch` that the module's loss consumes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lpa3_lightning.core.attack import AttackStats
from lpa3_lightning.core.batch_statistics import BatchStatistics

__all__ = ["AugmentedBatch", "LPA3Request", "selected_positions"]


def selected_positions(mask: Tensor, count: int) -> Tensor:
    """The positions of the ``count`` True entries of ``mask``, in order, without a host read.

    ``mask.nonzero()`` (and ``x[mask]``) must read the number of True entries on the host
    (a GPU synchronisation); when the caller knows it, a stable sort puts the True positions
    first instead.

    Example:
        >>> selected_positions(torch.tensor([False, True, False, True]), 2).tolist()
        [1, 3]
    """
    return torch.sort((~mask).to(torch.uint8), stable=True).indices[:count]


@dataclass
class LPA3Request:
    """What a module offers for augmentation on one training batch.

    Attributes:
        inputs: ``(B, ...)`` inputs in the space the model takes.
        targets: ``(B,)`` labels to preserve (true labels or pseudo-labels).
        indices: ``(B,)`` dataset indices (the key of the TCS memory).
        train_mask: optional ``(B,)`` bool: the rows whose ``x'`` the module's loss will weigh
            above zero (FixMatch: pseudo-label confidence >= its second threshold, and only
            after its loss warm-up). A selected row outside it is not solved: it is counted in
            ``AugmentedBatch.skipped`` (for the loss's denominator) and its clean input still
            sets the twin statistics, so the loss is the one of solving every selected row, at
            the cost of the trained rows only, provided the module trains ``x'`` on the solver's
            normalisation (``lpa3_settings.train_forward="verified"``, the default; with ``"batch_stats"``
            the ``x'`` batch's own statistics would change, so do not pass a mask there). A hint,
            not a filter the loss may rely on: every selected row is solved with a cache
            (``regenerate_every_n_epochs > 1``: a later epoch may reuse a row that is not trained
            now). The default and the sync-free path honour it alike (the sync-free path reads
            the number of rows it keeps with its one host read). None (default): every selected
            row is solved.
    """

    inputs: Tensor
    targets: Tensor
    indices: Tensor
    train_mask: Tensor | None = None


@dataclass
class AugmentedBatch:
    """The hard positives generated for one training batch.

    Attributes:
        inputs: ``(M, ...)`` the augmented inputs ``x'`` (detached).
        targets: ``(M,)`` their labels.
        indices: ``(M,)`` their dataset indices.
        mask: ``(B,)`` which samples of the request were augmented (``M = mask.sum()``).
        stats: the solver's per-sample diagnostics of the freshly generated samples, when
            it ran (reused cached samples have none).
        reused: how many of the ``M`` came from the cache instead of the solver.
        bn_mode: the normalisation the solver checked the constraint under: ``"twin"`` (the
            twins) or ``"batch"`` (the model's BatchNorms), both on the clean selected samples'
            frozen batch statistics, or ``"eval"`` (BN on running statistics); all with ``bn_statistics``.
        bn_statistics: the statistics the solver normalised with: the frozen batch statistics
            of the clean selected samples, or a snapshot of the running statistics.
        allow_tf32: whether the solver ran with TF32 (the training forward matches it).
        reference_inputs: the clean selected samples whose batch statistics the solver froze
            (``"twin"`` and ``"batch"`` mode); the training forward recomputes the statistics from them.
        network: the network the ``x'`` were solved on, for a module with several
            (:meth:`~lpa3_lightning.mixins.LPA3ModuleMixin.lpa3_networks`); None for one.
        skipped: how many selected rows were not solved because the request's ``train_mask``
            left them out; ``M + skipped`` is the number TCS selected (after its filters), the
            denominator of a loss averaged over the selected rows as the authors average it.
        from_cache: ``(M,)`` bool, with a cache (``regenerate_every_n_epochs > 1``): which ``x'``
            were taken from it (the others were solved for this batch); None without a cache.
    """

    inputs: Tensor
    targets: Tensor
    indices: Tensor
    mask: Tensor
    stats: AttackStats | None = None
    reused: int = 0
    bn_mode: str = "eval"
    bn_statistics: BatchStatistics | None = None
    allow_tf32: bool = False
    reference_inputs: Tensor | None = None
    network: str | None = None
    skipped: int = 0
    from_cache: Tensor | None = None

    def __len__(self) -> int:
        return int(self.inputs.shape[0])

    def positions(self) -> Tensor:
        """The batch positions of the ``M`` rows (``mask``'s True entries, in order), without a host read.

        Use it to pick per-sample values of the batch for the ``x'`` (e.g.
        ``confidence.index_select(0, augmented.positions())``); ``confidence[augmented.mask]``
        gives the same values but reads the mask on the host.
        """
        return selected_positions(self.mask, len(self))
