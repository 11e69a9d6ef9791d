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

from lpa3_lightning.core.distributed import exchange_sizes, gather_padded
from lpa3_lightning.core.shard_exchange import (
    assemble_on_first,
    check_group,
    check_shards,
    owned_rows,
    route_to_owners,
    sum_over_shards,
)
from lpa3_lightning.core.tcs import StepRows, TimeConsistency, tcs_divergence

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

    :meth:`update`, :meth:`full_memory` and :meth:`state_dict` are collectives when
    ``num_shards > 1``: every process calls them at the same point. :attr:`local_rows` holds this
    shard's stored predictions (local row ``j`` is dataset index ``j * num_shards + shard``); there
    is no ``memory`` attribute, whose rows would mean other samples than a replicated memory's.
    :meth:`state_dict` assembles the whole memory on shard 0 (None on the others), so a checkpoint
    loads into any world size, replicated or sharded.

    Example:
        >>> tcs = ShardedTimeConsistency(10, 3, ratio=0.5, num_shards=4, shard=1)
        >>> tcs.local_rows.shape  # indices 1, 5 and 9
        torch.Size([3, 3])
    """

    def __init__(self, num_samples: int, num_classes: int, ratio: float, *, num_shards: int, shard: int,
                 **kwargs: Any) -> None:
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
            raise ValueError(f"`num_samples` must be a positive int (the training set size), got {num_samples!r}.")
        check_shards(num_samples, num_shards, shard)
        self.num_shards, self.shard = num_shards, shard
        self.owned = owned_rows(num_samples, num_shards, shard)
        super().__init__(num_samples, num_classes, ratio, **kwargs)

    def _stored_rows(self) -> int:
        return self.owned

    @property
    def memory(self) -> Tensor:  # type: ignore[override]
        raise AttributeError(
            f"A sharded TCS memory keeps on each process only the rows it owns: `local_rows` (row j = dataset index "
            f"j * {self.num_shards} + {self.shard}). The whole memory in index order: `full_memory()` (a collective, "
            "assembled on shard 0)."
        )

    @property
    def local_rows(self) -> Tensor:
        """``(owned, C)`` this shard's stored predictions (local row ``j`` = dataset index ``j * num_shards + shard``)."""
        return self._rows[: self.owned]

    def _gather(self, indices: Tensor, probs: Tensor, targets: Tensor | None, abort: bool) -> StepRows | None:
        """Every process's indices, finiteness and labels; the probabilities stay here (they travel
        to their owners only, in :meth:`_score_rows`)."""
        check_group(self.num_shards)
        finite = torch.isfinite(probs).all(dim=1)
        sizes = exchange_sizes(int(indices.numel()), abort)
        if abort:
            return None
        every = gather_padded([indices, finite.long()] + ([] if targets is None else [targets]), sizes)
        return StepRows(every[0], every[1].bool(), None if targets is None else every[2], probs, sizes)

    def _score_rows(self, every: StepRows, index: Tensor, keep: Tensor) -> Tensor:
        """Each kept row scored on its owner, from its stored prediction, and summed over the shards
        (each value comes from one owner, the others add zeros: exact)."""
        owned = route_to_owners(every.probs, index, keep, every.sizes, self.num_shards, self.shard)
        positions = (keep & (torch.remainder(index, self.num_shards) == self.shard)).nonzero().squeeze(1)
        rows = torch.div(index[positions], self.num_shards, rounding_mode="floor")
        targets = None if every.targets is None else every.targets[positions]
        divergence = torch.zeros(index.shape[0], device=self.device)
        divergence[positions] = tcs_divergence(self._rows[rows].float(), owned, targets, self.divergence)
        self._rows[rows] = owned.to(self.storage_dtype)
        return sum_over_shards(divergence, self.num_shards)

    def full_memory(self) -> Tensor | None:
        """Every sample's stored prediction, assembled on shard 0 (collective); None on the others."""
        return assemble_on_first(self.local_rows, self.num_samples, self.num_shards, self.shard)

    def local_state_dict(self) -> dict[str, Any]:
        """:meth:`state_dict` without the stored predictions (``memory`` None): no collective."""
        return self._state(None)

    def _load_rows(self, memory: Tensor) -> None:
        self._rows[: self.owned] = memory[self.shard::self.num_shards].to(self.device, self.storage_dtype)
