"""The ranks' agreements at a fit's start: the same data set sizes, any rank's failure to start, rank 0's
seed. (The step's one reduction is :func:`lpa3_lightning.callback.runner.agree`.)"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.distributed as dist

from lpa3_lightning.core.distributed import communication_device, max_over_ranks

__all__ = ["agreed_seed", "fail_together", "same_on_every_rank"]


def fail_together(trainer: pl.Trainer, error: Exception | None) -> None:
    """Outside the steps (the fit's start): raise on every rank when any rank failed (one reduction).

    Raises:
        This rank's ``error``; RuntimeError when another rank failed.
    """
    failed = error is not None
    if trainer.world_size > 1:
        failed = max_over_ranks([float(failed)])[0] > 0
    if error is not None:
        raise error
    if failed:
        raise RuntimeError("LPA3Callback stopped because another process failed when the fit started; that "
                           "process's log has the reason and the fix.")


def agreed_seed(seed: int) -> int:
    """Rank 0's seed, on every rank (a broadcast from rank 0: a collective every rank joins)."""
    value = torch.tensor([seed], dtype=torch.int64, device=communication_device())
    dist.broadcast(value, src=0)
    return int(value.item())


def same_on_every_rank(trainer: pl.Trainer, values: list[int]) -> bool:
    """Whether every rank passed the same integers (one reduction at fit start)."""
    if trainer.world_size <= 1:
        return True
    reduced = max_over_ranks([float(v) for v in values] + [-float(v) for v in values])
    n = len(values)
    return all(reduced[k] == values[k] and -reduced[n + k] == values[k] for k in range(n))
