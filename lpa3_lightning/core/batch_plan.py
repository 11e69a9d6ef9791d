"""The plan step of the per-batch path: which selected samples reuse a cached x', which are solved now, which wait.

The callback's per-batch path reads select -> plan -> solve -> assemble -> log. Selection
(:mod:`lpa3_lightning.core.selection`, :class:`~lpa3_lightning.core.tcs.TimeConsistency`) says which
samples of a batch should get an ``x'``; with an x' cache (``regenerate_every_n_epochs > 1``,
:class:`~lpa3_lightning.core.cache.AugmentationCache`) some of them have a fresh ``x'`` already.
:func:`plan_rows` decides, for the selected rows, what this step does with each, and
:func:`assemble_inputs` puts the step's ``x'`` together. Neither imports Lightning.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["RowPlan", "assemble_inputs", "plan_rows"]


@dataclass(frozen=True)
class RowPlan:
    """What one step does with each selected row (``(n,)`` bool masks over the selected rows).

    Attributes:
        keep: the row gets an ``x'`` this step (``reuse | solve``).
        reuse: its cached ``x'`` is used.
        solve: the solver makes its ``x'`` now.
    """

    keep: Tensor
    reuse: Tensor
    solve: Tensor


def plan_rows(cached: Tensor, solver_runs: bool = True) -> RowPlan:
    """Plan the selected rows of one step.

    Args:
        cached: ``(n,)`` bool, the rows with a fresh cached ``x'`` for their current label.
        solver_runs: whether the solver may run this step (False between the regeneration
            epochs of ``attack_new_selections=False``: only cached rows get an ``x'``).

    Two rules keep BatchNorm working: the solver's batch statistics (twin BN in train mode) need
    two samples, so a lone row to solve waits for a later step; nor may a lone ``x'`` meet a
    module's train-mode BatchNorm, so a step left with one ``x'`` uses none. These read two
    counts on the host (the cache path is not the sync-free one).

    Example:
        >>> plan = plan_rows(torch.tensor([True, False, True]))  # one row to solve: it waits
        >>> plan.keep.tolist(), plan.solve.tolist()
        ([True, False, True], [False, False, False])
    """
    if cached.dtype != torch.bool or cached.dim() != 1:
        raise ValueError(f"`cached` must be a 1-D bool mask over the selected rows, got {cached.dtype} of shape "
                         f"{tuple(cached.shape)}.")
    keep = torch.ones_like(cached)
    if not solver_runs or int((~cached).sum()) == 1:
        keep = cached
    if int(keep.sum()) == 1:
        keep = torch.zeros_like(keep)
    return RowPlan(keep=keep, reuse=cached & keep, solve=~cached & keep)


def assemble_inputs(inputs: Tensor, solve: Tensor, solved: Tensor, reuse: Tensor, cached: Tensor | None) -> Tensor:
    """The step's ``x'``: ``solved`` in the rows to ``solve``, ``cached`` in the rows to ``reuse``,
    a detached copy of ``inputs`` elsewhere (rows neither solved nor reused are never trained on)."""
    out = inputs.detach().clone()
    if solved.shape[0]:
        out[solve] = solved.to(out.dtype)
    if cached is not None and cached.shape[0]:
        out[reuse] = cached.to(out.device, out.dtype)
    return out
