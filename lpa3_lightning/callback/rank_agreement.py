"""The step's one reduction over the processes: every rank's failure and every network's
``lpa3_consumes_augmented`` answer, agreed before any of the step's collectives; and, at a fit's
start, the check that every rank has the same data set sizes, any rank's failure to start and
rank 0's seed."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist

from lpa3_lightning.callback.runner import Prepared
from lpa3_lightning.core.distributed import communication_device

__all__ = ["agree", "agreed_seed", "consumes_of", "fail_together", "same_on_every_rank"]


def _max_over_ranks(values: list[float]) -> list[float]:
    """Each value's maximum over the ranks: one all-reduce, on the device the memory's collectives
    use too. (Not ``trainer.strategy.reduce``: Lightning's DDP reduce puts a barrier before every
    all-reduce, a second collective a step.)"""
    flags = torch.tensor(values, dtype=torch.float64, device=communication_device())
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return flags.tolist()


def agree(trainer: pl.Trainer, pl_module: pl.LightningModule, prepared: list[Prepared],
          networks: list[str | None]) -> None:
    """The step's one reduction: every rank's failure and every network's consumes answer.

    Raises:
        The rank's own error; RuntimeError when another rank failed; ValueError when the
        ranks answered ``lpa3_consumes_augmented`` differently.
    """
    flags = [float(any(p.error is not None for p in prepared))]
    for p in prepared:
        flags += [float(p.consumes), float(not p.consumes)]
    if trainer.world_size > 1:
        flags = _max_over_ranks(flags)
    own = next((p.error for p in prepared if p.error is not None), None)
    if own is not None:
        raise own
    if flags[0] > 0:
        raise RuntimeError("LPA3Callback stopped because another process failed in this step; that process's log "
                           "has the reason and the fix.")
    for k, name in enumerate(networks):
        if flags[1 + 2 * k] > 0 and flags[2 + 2 * k] > 0:
            network = "" if name is None else f" (network {name!r})"
            raise ValueError(
                f"{type(pl_module).__name__}.lpa3_consumes_augmented({trainer.current_epoch}){network} answered "
                "True on some processes and False on others. It decides whether the step solves x' (and joins "
                "the x' cache's exchange), so it must answer the same on every rank. Fix: decide from the epoch "
                "(or another value every rank shares), not from the rank or the batch."
            )


def fail_together(trainer: pl.Trainer, error: Exception | None) -> None:
    """Outside the steps (the fit's start): raise on every rank when any rank failed (one reduction).

    Raises:
        This rank's ``error``; RuntimeError when another rank failed.
    """
    failed = error is not None
    if trainer.world_size > 1:
        failed = _max_over_ranks([float(failed)])[0] > 0
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


def consumes_of(module: Any) -> Any:
    """The module's word on whether its loss trains ``x'`` in an epoch (a module without
    :meth:`~lpa3_lightning.mixins.LPA3ModuleMixin.lpa3_consumes_augmented` always does)."""
    consumes = getattr(module, "lpa3_consumes_augmented", None)
    return consumes if callable(consumes) else (lambda epoch: True)


def same_on_every_rank(trainer: pl.Trainer, pl_module: pl.LightningModule, values: list[int]) -> bool:
    """Whether every rank passed the same integers (one reduction at fit start)."""
    if trainer.world_size <= 1:
        return True
    reduced = _max_over_ranks([float(v) for v in values] + [-float(v) for v in values])
    n = len(values)
    return all(reduced[k] == values[k] and -reduced[n + k] == values[k] for k in range(n))
