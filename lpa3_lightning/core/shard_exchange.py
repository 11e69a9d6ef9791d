"""The collectives of a sharded TCS memory (no Lightning): who owns a row, and how rows reach it.

Owner rule: the sample with dataset index ``i`` lives on shard ``i % num_shards`` (shard =
global rank), as local row ``i // num_shards``. Round-robin needs no divisibility (any world
size and data set size), spreads any contiguous range of indices evenly, and every rank can
compute any row's owner without asking.

Per training step (``S`` processes, ``B`` rows per process, ``C`` classes):

1. :func:`~lpa3_lightning.core.distributed.gather_padded`: one all-gather of each row's index,
   finiteness and label (24 bytes a row, every rank receives ``S * B`` rows), after the usual
   8-byte size exchange. Every rank now knows which rows are applied (first occurrence, finite,
   not yet this epoch).
2. :func:`route_to_owners`: one all-to-all sends each applied row's ``C`` float32
   probabilities to its owner only, so a rank receives about ``B * 4C`` bytes whatever ``S`` is
   (the replicated memory's all-gather makes it ``S * B * 4C``).
3. :func:`sum_over_shards`: each owner's divergences, zeros elsewhere, summed over the ranks
   (one all-reduce of ``S * B`` floats), so that every rank updates the replicated scores alike.

A checkpoint holds the whole memory in index order: :func:`assemble_on_first` gathers the shards
to rank 0 in chunks, so the state does not depend on the world size that wrote it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from lpa3_lightning.core.distributed import communication_device, is_distributed

__all__ = ["assemble_on_first", "check_group", "check_shards", "owned_rows", "route_to_owners", "sum_over_shards"]

#: Rows per chunk when the shards are gathered for a checkpoint (bounds the transient memory).
ASSEMBLE_CHUNK_BYTES = 64 * 2**20


def owned_rows(num_samples: int, num_shards: int, shard: int) -> int:
    """How many dataset indices ``shard`` owns: those ``i < num_samples`` with ``i % num_shards == shard``.

    Example:
        >>> [owned_rows(10, 4, s) for s in range(4)]
        [3, 3, 2, 2]
    """
    return max(0, (num_samples - shard + num_shards - 1) // num_shards)


def check_shards(num_samples: int, num_shards: int, shard: int) -> None:
    """Refuse a layout that cannot hold the data set, naming the argument and the fix.

    Raises:
        ValueError: ``num_shards`` below 1 or above ``num_samples`` (a shard without rows), or
            ``shard`` outside ``0..num_shards-1``.
    """
    if isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1:
        raise ValueError(f"`num_shards` must be a positive int (the world size), got {num_shards!r}.")
    if num_shards > num_samples:
        raise ValueError(f"A sharded TCS memory of {num_samples} samples cannot be split over {num_shards} processes "
                         "(a process would own no sample). Fix: use the replicated memory "
                         "(selection.memory_layout='replicated') for a data set this small.")
    if isinstance(shard, bool) or not isinstance(shard, int) or not 0 <= shard < num_shards:
        raise ValueError(f"`shard` must be in 0..{num_shards - 1} (the global rank), got {shard!r}.")


def check_group(num_shards: int) -> None:
    """Refuse a sharded memory's collective in a process group of another size, naming the fix."""
    world = dist.get_world_size() if is_distributed() else 1
    if world != num_shards:
        raise RuntimeError(
            f"This sharded TCS memory is split over {num_shards} processes, but the process group has {world}. "
            "Fix: build it with num_shards=torch.distributed.get_world_size() and shard=get_rank() after "
            "init_process_group (LPA3Callback does so itself)."
        )


def route_to_owners(probs: Tensor, every_index: Tensor, apply: Tensor, sizes: list[int], num_shards: int,
                    shard: int) -> Tensor:
    """The probabilities of the applied rows this shard owns, in the gathered (rank) order.

    Args:
        probs: ``(B, C)`` this rank's rows (float32).
        every_index: ``(sum(sizes),)`` every rank's indices, in rank order.
        apply: ``(sum(sizes),)`` which gathered rows update the memory (the same on every rank).
        sizes: rows per rank.
        num_shards: the world size.
        shard: this rank.

    Returns:
        ``(K, C)``: the rows with ``apply & (every_index % num_shards == shard)``, in that order.
    """
    if every_index.shape[0] != sum(sizes) or apply.shape != every_index.shape or probs.shape[0] != sizes[shard]:
        raise ValueError(
            f"`every_index` and `apply` must have one entry per gathered row ({sum(sizes)}) and `probs` this rank's "
            f"{sizes[shard]} rows; got {tuple(every_index.shape)}, {tuple(apply.shape)} and {tuple(probs.shape)}. Fix: "
            "pass every rank's gathered indices, with the probabilities of the rows this rank gave."
        )
    if num_shards == 1:
        return probs[apply.to(probs.device)]
    check_group(num_shards)
    owners = torch.remainder(every_index, num_shards)
    start = sum(sizes[:shard])
    mine_apply, mine_owner = apply[start:start + sizes[shard]], owners[start:start + sizes[shard]]
    rows = mine_apply.nonzero().squeeze(1)
    rows = rows[torch.argsort(mine_owner[rows], stable=True)]  # grouped by owner, each group in batch order
    send_counts = torch.bincount(mine_owner[mine_apply], minlength=num_shards)
    to_me = (apply & (owners == shard)).long()
    recv_counts = torch.stack([part.sum() for part in torch.split(to_me, sizes)])
    send_counts, recv_counts = torch.stack([send_counts, recv_counts]).tolist()  # one host read for both
    device = communication_device()
    send = probs[rows.to(probs.device)].float().to(device).contiguous()
    received = send.new_empty((sum(recv_counts), probs.shape[1]))
    dist.all_to_all_single(received, send, output_split_sizes=recv_counts, input_split_sizes=send_counts)
    return received.to(probs.device)


def sum_over_shards(t: Tensor, num_shards: int) -> Tensor:
    """``t`` summed over the processes (each position non-zero on its owner alone: exact)."""
    if num_shards == 1:
        return t
    check_group(num_shards)
    device = communication_device()
    total = t.to(device).clone()
    dist.all_reduce(total)
    return total.to(t.device)


def assemble_on_first(local_rows: Tensor, num_samples: int, num_shards: int, shard: int) -> Tensor | None:
    """The whole memory ``(num_samples, C)`` on the CPU of rank 0, from every shard's rows; None elsewhere.

    Collective (every rank must call it, as LPA3Callback does inside Lightning's checkpointing); gathered in
    chunks of about :data:`ASSEMBLE_CHUNK_BYTES` over all ranks together, so the transient memory
    on rank 0 (and its GPU, with NCCL) stays bounded whatever the world size.
    """
    if num_shards == 1:
        return local_rows.cpu()
    check_group(num_shards)
    device = communication_device()
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
