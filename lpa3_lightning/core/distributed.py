"""The collectives of the per-step exchange between processes (no Lightning).

Every process sees a different slice of each global batch; the TCS memory keeps every rank identical by
exchanging each step's rows: :func:`exchange_sizes` (how many rows each rank sends, or that one withdrew),
then :func:`gather_padded` (every rank's rows in rank order). The first occurrence of an index in rank order is
kept (:func:`deduplicate_first`; ``DistributedSampler`` pads the last batch with repeats).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = ["PeerAborted", "batchnorm_buffers_kept", "bytes_per_sample", "communication_device", "deduplicate_first",
           "exchange_sizes", "gather_padded", "gather_rows", "is_distributed", "max_over_ranks", "needs_every_rank"]


class PeerAborted(RuntimeError):
    """Another process withdrew from the step's exchange (its own log names the reason)."""


def is_distributed() -> bool:
    """True inside an initialised process group with more than one process."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def needs_every_rank(model: nn.Module) -> bool:
    """Whether a train-mode forward of ``model`` is a collective (a SyncBatchNorm in training mode, in a group of
    several processes): every rank must then make it, with an empty batch when it has no rows."""
    return is_distributed() and any(isinstance(m, nn.SyncBatchNorm) and m.training for m in model.modules())


@contextlib.contextmanager
def batchnorm_buffers_kept(model: nn.Module) -> Iterator[None]:
    """Every BatchNorm's running buffers as they were before the block (for the empty forward a rank makes
    only to join SyncBatchNorm's collective: statistics of no sample must not move them)."""
    norms = [m for m in model.modules() if isinstance(m, _BatchNorm) and m.track_running_stats]
    saved = [(m.running_mean.clone(), m.running_var.clone(),
              None if m.num_batches_tracked is None else m.num_batches_tracked.clone()) for m in norms]
    try:
        yield
    finally:
        with torch.no_grad():
            for m, (mean, var, tracked) in zip(norms, saved):
                m.running_mean.copy_(mean)
                m.running_var.copy_(var)
                if tracked is not None:
                    m.num_batches_tracked.copy_(tracked)


def communication_device() -> torch.device:
    """Where the process group's collectives take their tensors (nccl: this rank's GPU)."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def max_over_ranks(values: list[float]) -> list[float]:
    """Each value's maximum over the ranks: one all-reduce (not ``trainer.strategy.reduce``, which adds a
    barrier: a second collective a step)."""
    flags = torch.tensor(values, dtype=torch.float64, device=communication_device())
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return flags.tolist()


def bytes_per_sample(num_classes: int) -> int:
    """Bytes one sample adds to the per-step all-gather: int64 index, finiteness and label, float32 probabilities."""
    return 8 + 8 + 8 + 4 * num_classes


def deduplicate_first(indices: Tensor) -> Tensor:
    """Boolean mask keeping the first occurrence of every index (in the given order)."""
    order = torch.argsort(indices, stable=True)
    sorted_idx = indices[order]
    first_sorted = torch.ones_like(sorted_idx, dtype=torch.bool)
    first_sorted[1:] = sorted_idx[1:] != sorted_idx[:-1]
    keep = torch.zeros_like(first_sorted)
    keep[order] = first_sorted
    return keep


def exchange_sizes(rows: int, abort: bool = False) -> list[int]:
    """Every rank's number of rows this step (one all-gather; ``[rows]`` outside a group). ``abort``: this rank
    withdraws (its own error follows); every other rank raises :class:`PeerAborted`, waiting in no later
    collective."""
    if not is_distributed():
        return [rows]
    size = torch.tensor([-1 if abort else rows], device=communication_device())
    sizes = [torch.zeros_like(size) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, size)
    counts = [int(s) for s in torch.cat(sizes).tolist()]
    if not abort and min(counts) < 0:
        raise PeerAborted("LPA3Callback stopped because another process failed in this step; that process's log has "
                          "the reason and the fix.")
    return counts


def gather_padded(tensors: Sequence[Tensor], sizes: list[int]) -> list[Tensor]:
    """Each tensor's rows from every rank, concatenated in rank order (``sizes``: rows per rank); collective,
    one all-gather per dtype (the inputs as they are outside a process group)."""
    if not is_distributed():
        return list(tensors)
    device, longest = communication_device(), max(sizes)
    out: list[Tensor | None] = [None] * len(tensors)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for k, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(k)
    for members in by_dtype.values():
        widths = [math.prod(tensors[k].shape[1:]) for k in members]
        flat = [tensors[k].reshape(tensors[k].shape[0], width).to(device) for k, width in zip(members, widths)]
        packed = torch.cat(flat, dim=1)
        padded = packed.new_zeros((longest, packed.shape[1]))
        padded[: packed.shape[0]] = packed
        parts = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(parts, padded.contiguous())
        every = torch.cat([part[:n] for part, n in zip(parts, sizes)])
        start = 0
        for k, width in zip(members, widths):
            column = every[:, start:start + width].reshape(every.shape[0], *tensors[k].shape[1:])
            out[k] = column.to(tensors[k].device)
            start += width
    return out  # type: ignore[return-value]


def gather_rows(indices: Tensor, *rows: Tensor) -> tuple[Tensor, ...]:
    """Every rank's ``(indices, *rows)`` (e.g. freshly solved ``x'`` and their labels), the first occurrence of
    each index kept. Collective; each tensor has the same trailing shape on every rank (``(0, ...)``: none)."""
    if not is_distributed():
        return (indices, *rows)
    sizes = exchange_sizes(int(indices.shape[0]))
    every = gather_padded([indices.long(), *rows], sizes)
    keep = deduplicate_first(every[0])
    return tuple(t[keep] for t in every)
