"""A TCS memory split over the processes of a data-parallel run, and its collectives (no Lightning).

Dataset index ``i`` lives on shard ``i % num_shards`` (the global rank) as local row ``i // num_shards``;
scores, seen flags and threshold stay replicated (selecting needs no communication). Each applied row's
probabilities travel to their owner only (one all-to-all), and the owners' divergences are summed (one
all-reduce, exact: selections equal the replicated memory's). A checkpoint holds the whole memory in index
order, loadable at any world size.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lpa3_lightning.core.checks import check_int
from lpa3_lightning.core.distributed import communication_device, is_distributed
from lpa3_lightning.core.tcs import StepRows, TimeConsistency, tcs_divergence

__all__ = ["ShardedTimeConsistency", "assemble_on_first", "owned_rows", "route_to_owners", "sum_over_shards"]

#: Bytes gathered per chunk when the shards are assembled for a checkpoint (bounds the transient memory).
ASSEMBLE_CHUNK_BYTES = 64 * 2**20


def owned_rows(num_samples: int, num_shards: int, shard: int) -> int:
    """How many dataset indices ``shard`` owns: those ``i < num_samples`` with ``i % num_shards == shard``."""
    return max(0, (num_samples - shard + num_shards - 1) // num_shards)


def check_shards(num_samples: int, num_shards: int, shard: int) -> None:
    """Refuse ``num_shards`` below 1 or above ``num_samples`` (a shard without rows), or ``shard`` outside
    ``0..num_shards-1`` (ValueError naming the argument and the fix)."""
    check_int(num_shards, "num_shards", 1, "pass the world size.")
    if num_shards > num_samples:
        raise ValueError(f"A sharded TCS memory of {num_samples} samples cannot be split over {num_shards} processes "
                         "(a process would own no sample). Fix: use the replicated memory "
                         "(selection.memory_layout='replicated') for a data set this small.")
    if isinstance(shard, bool) or not isinstance(shard, int) or not 0 <= shard < num_shards:
        raise ValueError(f"`shard` must be in 0..{num_shards - 1} (the global rank), got {shard!r}. Fix: pass "
                         "torch.distributed.get_rank().")


def check_group(num_shards: int) -> torch.device | None:
    """Refuse a sharded memory's collective in a process group of another size (RuntimeError naming the fix);
    the collectives' device (None for one shard)."""
    world = dist.get_world_size() if is_distributed() else 1
    if world != num_shards:
        raise RuntimeError(f"This sharded TCS memory is split over {num_shards} processes, but the process group has "
                           f"{world}. Fix: build it with num_shards=torch.distributed.get_world_size() and "
                           "shard=get_rank() after init_process_group (LPA3Callback does so itself).")
    return communication_device() if num_shards > 1 else None


def route_to_owners(probs: Tensor, every_index: Tensor, apply: Tensor, sizes: list[int], num_shards: int,
                    shard: int) -> Tensor:
    """``(K, C)`` the probabilities of the applied rows this shard owns, in the gathered (rank) order, from
    every rank's ``probs`` ``(B, C)`` (float32); ``every_index`` and ``apply`` ``(sum(sizes),)``: every rank's
    indices in rank order and which of them update the memory (the same on every rank)."""
    if every_index.shape[0] != sum(sizes) or apply.shape != every_index.shape or probs.shape[0] != sizes[shard]:
        raise ValueError(f"`every_index` and `apply` must have one entry per gathered row ({sum(sizes)}) and `probs` "
                         f"this rank's {sizes[shard]} rows; got {tuple(every_index.shape)}, {tuple(apply.shape)} and "
                         f"{tuple(probs.shape)}. Fix: pass every rank's gathered indices, with the probabilities of "
                         "the rows this rank gave.")
    if num_shards == 1:
        return probs[apply.to(probs.device)]
    device, owners = check_group(num_shards), torch.remainder(every_index, num_shards)
    start = sum(sizes[:shard])
    mine_apply, mine_owner = apply[start:start + sizes[shard]], owners[start:start + sizes[shard]]
    rows = mine_apply.nonzero().squeeze(1)
    rows = rows[torch.argsort(mine_owner[rows], stable=True)]  # grouped by owner, each group in batch order
    send_counts = torch.bincount(mine_owner[mine_apply], minlength=num_shards)
    recv_counts = torch.stack([part.sum() for part in torch.split((apply & (owners == shard)).long(), sizes)])
    send_counts, recv_counts = torch.stack([send_counts, recv_counts]).tolist()  # one host read for both
    send = probs[rows.to(probs.device)].float().to(device).contiguous()
    received = send.new_empty((sum(recv_counts), probs.shape[1]))
    dist.all_to_all_single(received, send, output_split_sizes=recv_counts, input_split_sizes=send_counts)
    return received.to(probs.device)


def sum_over_shards(t: Tensor, num_shards: int) -> Tensor:
    """``t`` summed over the processes (each position non-zero on its owner alone: exact)."""
    if num_shards == 1:
        return t
    total = t.to(check_group(num_shards)).clone()
    dist.all_reduce(total)
    return total.to(t.device)


def assemble_on_first(local_rows: Tensor, num_samples: int, num_shards: int, shard: int) -> Tensor | None:
    """The whole memory ``(num_samples, C)`` on the CPU of rank 0, from every shard's rows; None elsewhere.
    Collective, in chunks of about :data:`ASSEMBLE_CHUNK_BYTES` over all ranks (bounded transient memory)."""
    if num_shards == 1:
        return local_rows.cpu()
    device = check_group(num_shards)
    longest, classes = owned_rows(num_samples, num_shards, 0), local_rows.shape[1]
    chunk = max(1, ASSEMBLE_CHUNK_BYTES // max(1, num_shards * classes * local_rows.element_size()))
    full = local_rows.new_empty((num_samples, classes), device="cpu") if shard == 0 else None
    for first in range(0, longest, chunk):
        last = min(longest, first + chunk)
        piece = local_rows.new_zeros((last - first, classes), device=device)  # (a shard with fewer rows pads)
        mine = local_rows[first:min(last, local_rows.shape[0])]
        piece[:mine.shape[0]] = mine.to(device)
        parts = [torch.empty_like(piece) for _ in range(num_shards)] if shard == 0 else None
        dist.gather(piece, parts, dst=0)
        if full is not None and parts is not None:
            for owner, part in enumerate(parts):  # local row j of shard s is dataset index j * num_shards + s
                index = torch.arange(first, last) * num_shards + owner
                valid = index < num_samples
                full[index[valid]] = part[:int(valid.sum())].cpu()
    return full


class ShardedTimeConsistency(TimeConsistency):
    """:class:`~lpa3_lightning.core.tcs.TimeConsistency` whose stored predictions are split over processes.

    Args:
        num_samples, num_classes, ratio, **kwargs: as :class:`~lpa3_lightning.core.tcs.TimeConsistency`'s.
        num_shards: the number of processes (``torch.distributed.get_world_size()``).
        shard: this process (``torch.distributed.get_rank()``).

    :meth:`update`, :meth:`full_memory` and :meth:`state_dict` are collectives when ``num_shards > 1``.
    :attr:`local_rows` holds this shard's stored predictions; there is no ``memory`` (its rows would mean
    other samples than a replicated memory's). :meth:`state_dict` assembles the whole memory on shard 0
    (None on the others), so a checkpoint loads into any world size, replicated or sharded.

    Example:
        >>> tcs = ShardedTimeConsistency(10, 3, ratio=0.5, num_shards=4, shard=1)
        >>> tcs.local_rows.shape  # indices 1, 5 and 9
        torch.Size([3, 3])
    """

    _gathers_probs = False  # they travel to their owners only, in _score_rows

    def __init__(self, num_samples: int, num_classes: int, ratio: float, *, num_shards: int, shard: int,
                 **kwargs: Any) -> None:
        self.num_shards, self.shard = num_shards, shard
        super().__init__(num_samples, num_classes, ratio, **kwargs)

    def _stored_rows(self) -> int:
        check_shards(self.num_samples, self.num_shards, self.shard)
        self.owned = owned_rows(self.num_samples, self.num_shards, self.shard)
        return self.owned

    @property
    def memory(self) -> Tensor:  # type: ignore[override]
        raise AttributeError(f"A sharded TCS memory keeps on each process only the rows it owns: `local_rows` (row j "
                             f"= dataset index j * {self.num_shards} + {self.shard}). The whole memory in index order: "
                             "`full_memory()` (a collective, assembled on shard 0).")

    @property
    def local_rows(self) -> Tensor:
        """``(owned, C)`` this shard's stored predictions (row ``j`` = dataset index ``j * num_shards + shard``)."""
        return self._rows[: self.owned]

    def _gather(self, indices: Tensor, probs: Tensor, targets: Tensor | None, abort: bool) -> StepRows | None:
        check_group(self.num_shards)
        return super()._gather(indices, probs, targets, abort)

    def _score_rows(self, every: StepRows, keep: Tensor) -> Tensor:
        """Each kept row scored on its owner, from its stored prediction, and summed over the shards."""
        index = every.indices
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
