"""A TCS memory split over the processes of a data-parallel run (no Lightning).

The replicated :class:`~lpa3_lightning.core.tcs.TimeConsistency` keeps every sample's stored
prediction on every process: ``N x C`` floats each, 5.1 GB for ImageNet-1k in float32. Here
each process keeps the rows of the samples it owns (index ``i`` on rank ``i % world_size``; see
:mod:`lpa3_lightning.core.shard_exchange`), about ``N x C / world_size``. The scores (one float
per sample), the seen flags and the threshold stay replicated, so selecting a batch's rows needs
no communication and gives what the replicated memory gives.

An update computes each divergence on the owner of the row, from its stored prediction, and sums
the owners' results over the processes (each value comes from one owner, the others add zeros:
exact), so the scores, and with them the selections, equal the replicated memory's bit for bit
in float32.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lpa3_lightning.core.shard_exchange import assemble_on_first, check_shards, owned_rows, sum_over_shards
from lpa3_lightning.core.tcs import TimeConsistency, tcs_divergence, tcs_update

__all__ = ["ShardedTimeConsistency"]


class ShardedTimeConsistency(TimeConsistency):
    """:class:`~lpa3_lightning.core.tcs.TimeConsistency` whose stored predictions are split over processes.

    Args:
        num_samples: size of the training set.
        num_classes: number of classes of the predictions.
        ratio: fraction of samples to select, in (0, 1].
        num_shards: the number of processes (``torch.distributed.get_world_size()``).
        shard: this process (``torch.distributed.get_rank()``).
        **kwargs: the other arguments of :class:`~lpa3_lightning.core.tcs.TimeConsistency`
            (``storage_dtype`` included).

    :meth:`update` and :meth:`state_dict` are collectives when ``num_shards > 1``: every process
    calls them at the same point. ``memory`` holds this shard's rows (local row ``j`` is dataset
    index ``j * num_shards + shard``). :meth:`state_dict` assembles the whole memory on shard 0
    (None on the others), so a checkpoint loads into any world size, replicated or sharded.

    Example:
        >>> tcs = ShardedTimeConsistency(10, 3, ratio=0.5, num_shards=4, shard=1)
        >>> tcs.memory.shape  # indices 1, 5 and 9
        torch.Size([3, 3])
    """

    def __init__(self, num_samples: int, num_classes: int, ratio: float, *, num_shards: int, shard: int,
                 **kwargs: Any) -> None:
        if not isinstance(num_samples, int) or num_samples < 1:
            raise ValueError(f"`num_samples` must be a positive int (the training set size), got {num_samples!r}.")
        check_shards(num_samples, num_shards, shard)
        self.num_shards, self.shard = num_shards, shard
        self.owned = owned_rows(num_samples, num_shards, shard)
        super().__init__(num_samples, num_classes, ratio, **kwargs)

    def _initial_rows(self, rows: int, device: torch.device) -> Tensor:
        return super()._initial_rows(self.owned, device)

    def update(self, indices: Tensor, probs: Tensor, targets: Tensor | None = None, keep: Tensor | None = None,
               check_values: bool = True) -> Tensor:
        """The replicated memory's update, from the same rows on every shard (e.g. after
        :func:`~lpa3_lightning.core.distributed.gather_predictions`); each shard stores its own.

        The kept rows' indices must be distinct. Returns the ``(B,)`` divergences.
        """
        indices = self._check_indices(indices, values=check_values)
        self._check_probs(indices, probs)
        keep = torch.ones_like(indices, dtype=torch.bool) if keep is None else keep.to(self.device)
        mine = keep & (torch.remainder(indices, self.num_shards) == self.shard)
        return self.update_owned(indices, keep, probs.detach().to(self.device)[mine], targets)

    def update_owned(self, indices: Tensor, keep: Tensor, owned_probs: Tensor, targets: Tensor | None = None
                     ) -> Tensor:
        """Apply the kept rows of a step that every shard knows the indices of, each shard
        passing the probabilities of the kept rows it owns.

        Args:
            indices: ``(B,)`` in-range dataset indices, the same on every shard.
            keep: ``(B,)`` the rows to apply (distinct indices), the same on every shard.
            owned_probs: ``(K, C)`` the probabilities of ``keep & (indices % num_shards == shard)``, in order
                (:func:`~lpa3_lightning.core.shard_exchange.route_to_owners` delivers them).
            targets: optional ``(B,)`` labels (``divergence="paper"`` only).

        Returns:
            ``(B,)`` divergences (zero where not kept).
        """
        indices, keep = indices.to(self.device, torch.long), keep.to(self.device)
        positions = (keep & (torch.remainder(indices, self.num_shards) == self.shard)).nonzero().squeeze(1)
        if owned_probs.shape != (positions.numel(), self.num_classes):
            raise ValueError(f"`owned_probs` must have shape ({positions.numel()}, {self.num_classes}) (the kept rows "
                             f"this shard owns), got {tuple(owned_probs.shape)}.")
        rows = torch.div(indices[positions], self.num_shards, rounding_mode="floor")
        probs = owned_probs.to(self.device, torch.float32)
        owned_targets = None if targets is None else targets.to(self.device)[positions]
        divergence = torch.zeros(indices.shape[0], device=self.device)
        divergence[positions] = tcs_divergence(self.memory[rows].float(), probs, owned_targets, self.divergence)
        divergence = sum_over_shards(divergence, self.num_shards)  # each row's value from its owner
        applied = keep.nonzero().squeeze(1)
        kept = indices[applied]
        self.scores[kept] = tcs_update(self.scores[kept], divergence[applied], self.gamma)
        self.seen[kept] = True
        self.memory[rows] = probs.to(self.storage_dtype)
        return divergence

    def full_memory(self) -> Tensor | None:
        """Every sample's stored prediction, assembled on shard 0 (collective); None on the others."""
        return assemble_on_first(self.memory, self.num_samples, self.num_shards, self.shard)

    def adopt(self, other: TimeConsistency) -> None:
        """Take over an earlier fit's memory: a shard of the same layout directly (no
        collective), a replicated one by keeping this shard's rows."""
        if not isinstance(other, ShardedTimeConsistency):
            super().adopt(other)
            return
        if (other.num_samples, other.num_classes, other.num_shards, other.shard) != (
                self.num_samples, self.num_classes, self.num_shards, self.shard):
            raise ValueError(
                f"The earlier fit's TCS memory was shard {other.shard} of {other.num_shards} for {other.num_samples} x "
                f"{other.num_classes}; this fit's is shard {self.shard} of {self.num_shards} for {self.num_samples} x "
                f"{self.num_classes}. Fix: save a checkpoint and resume from it (a checkpoint holds the whole memory "
                "and loads into any world size)."
            )
        self.memory = other.memory.to(self.device, self.storage_dtype, copy=True)
        self.scores = other.scores.to(self.device, copy=True)
        self.seen = other.seen.to(self.device, copy=True)
        self.threshold = other.threshold.to(self.device, copy=True)

    def _load_rows(self, memory: Tensor, copy: bool) -> None:
        self.memory = memory[self.shard::self.num_shards].to(self.device, self.storage_dtype, copy=True)
