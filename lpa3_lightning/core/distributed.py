"""Cross-process sync of the per-sample predictions that feed the TCS memory (no Lightning).

Under data parallelism every process sees a different slice of each global batch. To keep
the time-consistency memory identical on every rank (as the authors' code does), each step
all-gathers the dataset indices, predicted probabilities and labels of every rank, and every
rank applies the same update. ``DistributedSampler`` pads the last global batch with
duplicate indices; the first occurrence in rank order is kept, so every rank drops the same
rows; a padded duplicate in a later step of the same epoch is dropped by the callback's
per-epoch record of updated indices.

Bytes per sample and step: 8 (int64 index) + 4 * C (float32 probabilities) + 8 (int64 label);
with a cache (``regenerate_every_n_epochs > 1``) each newly generated ``x'`` adds
8 + (bytes of one input) to a second all-gather;
each rank receives ``world_size`` times its own share, so the traffic per rank grows linearly
with the world size (an all-gather).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = [
    "all_equal", "any_rank_failed", "bytes_per_sample", "communication_device", "deduplicate_first",
    "batchnorm_buffers_kept", "gather_predictions", "gather_rows", "gathered_sizes", "is_distributed",
    "needs_every_rank",
]


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


def any_rank_failed(failed: bool) -> bool:
    """True on every rank when any rank reports a failure (False outside a process group).

    Lets a rank that found bad input make all ranks raise together instead of leaving the
    others waiting in the next collective.
    """
    if not is_distributed():
        return failed
    flag = torch.tensor([1.0 if failed else 0.0], device=communication_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item() > 0)


def all_equal(value: int) -> bool:
    """Whether every rank passed the same integer (True outside a process group)."""
    if not is_distributed():
        return True
    t = torch.tensor([value, -value], dtype=torch.float64, device=communication_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t[0].item()) == value and int(-t[1].item()) == value


def bytes_per_sample(num_classes: int) -> int:
    """Bytes one sample adds to the per-step all-gather (index, probabilities, label)."""
    return 8 + 4 * num_classes + 8


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


def gathered_sizes(rows: int, device: torch.device) -> list[int]:
    """Every rank's number of rows (one all-gather; read on the host)."""
    size = torch.tensor([rows], device=device)
    sizes = [torch.zeros_like(size) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, size)
    return [int(s) for s in torch.cat(sizes).tolist()]


def _all_gather_padded(t: Tensor, sizes: list[int]) -> Tensor:
    """All-gather a tensor whose first dimension differs across ranks."""
    longest = max(sizes)
    padded = t.new_zeros((longest, *t.shape[1:]))
    padded[: t.shape[0]] = t
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded.contiguous())
    return torch.cat([part[:n] for part, n in zip(parts, sizes)])


def _gather_by_index(indices: Tensor, *tensors: Tensor | None) -> tuple[Tensor | None, ...]:
    """All-gather ``indices`` and row-aligned ``tensors`` from every rank, first index occurrence kept.

    One size exchange serves every tensor; ``None`` entries pass through as ``None``.
    """
    home, device = indices.device, communication_device()  # gloo: CPU tensors; nccl: this rank's GPU
    sizes = gathered_sizes(indices.shape[0], device)
    all_indices = _all_gather_padded(indices.to(device, torch.long), sizes)
    keep = deduplicate_first(all_indices)
    gathered = [None if t is None else _all_gather_padded(t.to(device), sizes)[keep].to(home) for t in tensors]
    return (all_indices[keep].to(home), *gathered)


def gather_predictions(
    indices: Tensor, probs: Tensor, targets: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Every rank's ``(indices, probs, targets)`` of this step, deduplicated, in rank order.

    Outside a multi-process group the inputs come back unchanged. Collective: every rank
    must call it at the same step, also with an empty batch.

    Args:
        indices: ``(B,)`` dataset indices of this rank's batch.
        probs: ``(B, C)`` probabilities.
        targets: optional ``(B,)`` labels (every rank must pass them, or none).

    Returns:
        The concatenation over ranks (rank 0 first) with duplicate indices removed.
    """
    if not is_distributed():
        return indices, probs, targets
    return _gather_by_index(indices.to(probs.device), probs.float(),  # type: ignore[return-value]
                            None if targets is None else targets.to(probs.device, torch.long))


def gather_rows(indices: Tensor, rows: Tensor, *more: Tensor) -> tuple[Tensor, ...]:
    """Every rank's ``(indices, rows, *more)`` (e.g. freshly generated ``x'`` and their labels), deduplicated.

    Collective like :func:`gather_predictions`; each tensor must have the same trailing shape
    on every rank (an empty ``(0, ...)`` tensor when a rank has none).
    """
    if not is_distributed():
        return (indices, rows, *more)
    return _gather_by_index(indices.to(rows.device), rows, *more)  # type: ignore[return-value]
