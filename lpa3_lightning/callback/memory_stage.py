"""Stage 5 of a batch: every rank's clean predictions applied to the TCS memory (after the step)."""

from __future__ import annotations

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from lpa3_lightning.core.checks import check_dataset_indices
from lpa3_lightning.core.distributed import deduplicate_first, gather_predictions
from lpa3_lightning.core.shard_exchange import gather_row_facts, route_to_owners
from lpa3_lightning.core.tcs import TimeConsistency
from lpa3_lightning.core.tcs_shards import ShardedTimeConsistency

__all__ = ["MemoryFeed"]


class MemoryFeed:
    """Feeds one network's TCS memory: each sample at most once an epoch, finite predictions only;
    on the sync-free path with ``torch.where`` and device counters (no host read).

    Args:
        memory: the network's memory.
        sync_free: whether the step reads nothing on the host.
        last_update_epoch: per sample, the epoch of its last update (-1: never).
    """

    def __init__(self, memory: TimeConsistency, sync_free: bool, last_update_epoch: Tensor) -> None:
        self.memory, self.sync_free, self.last_update_epoch = memory, sync_free, last_update_epoch
        device = memory.device
        self.bad_recorded = torch.zeros((), dtype=torch.long, device=device)  # refused at the next host read
        self.nonfinite: Tensor | int = 0  # non-finite predictions this epoch (a device count when sync-free)
        self.rows_recorded = 0  # rows applied or not, for the coverage check
        self._coverage_checked = False

    def feed(self, indices: Tensor, logits: Tensor, targets: Tensor | None, temperature: float, epoch: int) -> None:
        """Apply every process's predictions of this step (gathered: the memory stays identical on every rank)."""
        probs = torch.softmax(logits.float() / temperature, dim=1)
        if isinstance(self.memory, ShardedTimeConsistency):
            self._feed_shards(self.memory, indices.to(probs.device), probs, targets, epoch)
            return
        indices, probs, targets = gather_predictions(indices.to(probs.device), probs,
                                                     None if targets is None else targets.to(probs.device))
        self.rows_recorded += int(indices.shape[0])  # (a shape: no host read)
        memory, indices = self.memory, indices.to(self.memory.device)
        # Non-finite predictions would poison a sample's score for good; DistributedSampler's
        # padding repeats samples in a later step of the epoch: apply each sample once an epoch.
        finite = torch.isfinite(probs).all(dim=1).to(memory.device)
        if self.sync_free:  # the same update, selected with torch.where: no host read
            self.nonfinite = self.nonfinite + (~finite).sum()
            # out-of-range indices are counted (refused with the next host read) and never applied
            in_range = (indices >= 0) & (indices < memory.num_samples)
            self.bad_recorded = self.bad_recorded + (~in_range).sum()
            indices = indices.clamp(0, memory.num_samples - 1)
            keep = finite & in_range & (self.last_update_epoch[indices] != epoch)
            self.last_update_epoch[indices] = torch.where(keep, epoch, self.last_update_epoch[indices])
            memory.update(indices, probs, targets, keep=keep, check_values=False)
            return
        keep = finite & (self.last_update_epoch[indices] != epoch)
        self.nonfinite += int((~finite).sum())
        self.last_update_epoch[indices[keep]] = epoch
        keep_dev = keep.to(probs.device)
        memory.update(indices[keep], probs[keep_dev], None if targets is None else targets[keep_dev])

    def _feed_shards(self, memory: ShardedTimeConsistency, indices: Tensor, probs: Tensor, targets: Tensor | None,
                     epoch: int) -> None:
        """The same rows applied as :meth:`feed` applies to a replicated memory, each row's
        probabilities sent to its owner only (this path reads counts on the host either way)."""
        finite = torch.isfinite(probs).all(dim=1)
        every, every_finite, every_targets, sizes = gather_row_facts(
            indices, finite, None if targets is None else targets.to(probs.device))
        every, every_finite = every.to(memory.device), every_finite.to(memory.device)
        first = deduplicate_first(every)  # DistributedSampler's padding: the first occurrence in rank order
        in_range = (every >= 0) & (every < memory.num_samples)
        if self.sync_free:
            self.bad_recorded = self.bad_recorded + (first & ~in_range).sum()
        else:
            check_dataset_indices(every[first], memory.num_samples)
        self.rows_recorded += int(first.sum())
        nonfinite = (first & ~every_finite).sum()
        self.nonfinite = self.nonfinite + (nonfinite if self.sync_free else int(nonfinite))
        every = every.clamp(0, memory.num_samples - 1)
        keep = first & every_finite & in_range & (self.last_update_epoch[every] != epoch)
        owned = route_to_owners(probs, every, keep, sizes, memory.num_shards, memory.shard)
        memory.update_owned(every, keep, owned, every_targets)
        self.last_update_epoch[every[keep]] = epoch

    def check_coverage(self) -> None:
        """Once the memory was fed three times its size in rows, warn once when it saw far fewer
        distinct indices than it has rows (``num_samples`` / ``lpa3_num_samples`` larger than the
        set the indices come from): the rows never seen keep their first score, and the threshold
        ranks them with the rest. (Three times: drawn with replacement, a set of N rows shows 95%
        of its indices by then.)"""
        total = self.memory.num_samples
        if self._coverage_checked or self.rows_recorded < 3 * total:
            return
        self._coverage_checked = True
        seen = int(self.memory.seen.sum())  # one host read, once a fit
        if seen < 0.8 * total:
            rank_zero_warn(
                f"LPA3Callback's TCS memory has {total} rows, but {self.rows_recorded} recorded predictions named only "
                f"{seen} distinct dataset indices: the rows never seen keep their first score and take part in the "
                "selection threshold. Fix: set `selection.num_samples` (or the module's `lpa3_num_samples`) to the "
                "size of the set the recorded indices come from."
            )
