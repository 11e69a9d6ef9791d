"""The collectives of the per-step exchange between processes (no Lightning).

Under data parallelism every process sees a different slice of each global batch. The TCS
memory (:mod:`lpa3_lightning.core.tcs`) keeps every rank identical by exchanging each step's
rows: :func:`exchange_sizes` tells every rank how many rows each sends (and whether a rank
withdrew from the step), :func:`gather_padded` concatenates every rank's rows in rank order.
``DistributedSampler`` pads the last global batch with duplicate indices; the first occurrence
in rank order is kept (:func:`deduplicate_first`), so every rank keeps the same rows.

Bytes per sample and step: 8 (int64 index) + 8 (finiteness) + 8 (int64 label) + 4 * C (float32
probabilities); with a cache (``regenerate_every_n_epochs > 1``) each newly generated ``x'`` adds
8 + (bytes of one input) to a second gather. Each rank receives ``world_size`` times its own share.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = [
    "PeerAborted", "batchnorm_buffers_kept", "bytes_per_sample", "communication_device", "deduplicate_first",
    "exchange_sizes", "gather_padded", "gather_rows", "is_distributed", "needs_every_rank",
]


class PeerAborted(RuntimeError):
    """Another process withdrew from the step's exchange (its own log names the reason)."""


def is_distributed() -> bool:
    """True inside an initialised process group with more than one process."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def needs_every_rank(model: nn.Module) -> bool:
    """Whether a train-mode forward of ``model`` is a collective: a SyncBatchNorm in training
    mode inside a process group of several processes all-gathers its batch statistics, so
    every rank must make that forward, also with no rows of its own (an empty batch is fine:
    SyncBatchNorm counts it as zero samples), or the others wait for it for ever."""
    return is_distributed() and any(isinstance(m, nn.SyncBatchNorm) and m.training for m in model.modules())


@contextlib.contextmanager
def batchnorm_buffers_kept(model: nn.Module) -> Iterator[None]:
    """Every BatchNorm's running buffers as they were before the block: for the empty forward a
    rank makes only to join SyncBatchNorm's collective (when every rank's batch is empty the
    gathered statistics are of no sample, and the running statistics must not move with them)."""
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


def bytes_per_sample(num_classes: int) -> int:
    """Bytes one sample adds to the per-step all-gather (index, finiteness, label, probabilities)."""
    return 8 + 8 + 8 + 4 * num_classes


def deduplicate_first(indices: Tensor) -> Tensor:
    """Boolean mask keeping the first occurrence of every index (in the given order).

    Example:
        >>> deduplicate_first(torch.tensor([3, 1, 3, 2, 1])).tolist()
        [True, True, False, True, False]
    """
    if indices.numel() == 0:
        return torch.zeros(0, dtype=torch.bool, device=indices.device)
    order = torch.argsort(indices, stable=True)
    sorted_idx = indices[order]
    first_sorted = torch.ones_like(sorted_idx, dtype=torch.bool)
    first_sorted[1:] = sorted_idx[1:] != sorted_idx[:-1]
    keep = torch.zeros_like(first_sorted)
    keep[order] = first_sorted
    return keep


def exchange_sizes(rows: int, abort: bool = False) -> list[int]:
    """Every rank's number of rows this step (one all-gather, read on the host).

    ``abort``: this rank withdraws from the step (it raises its own error after the call); every
    other rank raises :class:`PeerAborted` here, so none waits in a later collective. Outside a
    process group: ``[rows]``.

    Raises:
        PeerAborted: on a rank that did not abort, when another did.
    """
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
    """Each tensor's rows from every rank, concatenated in rank order (``sizes``: rows per rank).

    The tensors of one call are packed by dtype (one all-gather per dtype), so a step's index,
    label and finiteness columns travel together. Collective; returns the inputs outside a
    process group.
    """
    if not is_distributed():
        return list(tensors)
    device, longest = communication_device(), max(sizes)
    out: list[Tensor | None] = [None] * len(tensors)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for k, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(k)
    for dtype, members in by_dtype.items():
        widths = [math.prod(tensors[k].shape[1:]) for k in members]
        flat = [tensors[k].reshape(tensors[k].shape[0], width).to(device) for k, width in zip(members, widths)]
        packed = torch.cat(flat, dim=1) if flat else torch.empty(0, device=device, dtype=dtype)
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
    """Every rank's ``(indices, *rows)`` (e.g. freshly solved ``x'`` and their labels), the first
    occurrence of each index kept. Collective; each tensor must have the same trailing shape on
    every rank (an empty ``(0, ...)`` tensor when a rank has none)."""
    if not is_distributed():
        return (indices, *rows)
    sizes = exchange_sizes(int(indices.shape[0]))
    every = gather_padded([indices.long(), *rows], sizes)
    keep = deduplicate_first(every[0])
    return tuple(t[keep] for t in every)
