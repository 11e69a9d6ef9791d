"""BatchNorm on the clean selected rows' batch statistics: the normalisation of LP-A3's solver
and of the training forward of ``x'`` (no Lightning).

A BatchNorm in train mode normalises each row with the statistics of its whole batch, so one
row's output depends on the others: a per-sample constraint checked in one batch would not hold
in another. The solver therefore normalises with the batch statistics of clean reference rows,
*frozen* for the call (captured by its first forward), and the training forward of ``x'``
normalises with the same statistics, recomputed from those rows (reference-batch normalisation,
Salimans et al., NeurIPS 2016): ``model(cat([x_reference, x']))`` with every row normalised by
the reference rows' statistics, gradients flowing through them as in ordinary batch
normalisation. No running buffer moves in either.

Which BatchNorms (``mode``), and the reference rows :class:`~lpa3_lightning.LPA3Callback` gives:

* ``"twin"``: the twin of every BatchNorm converted by
  :func:`~lpa3_lightning.core.dual_bn.convert_dual_bn` (the authors' choice: ``x'`` never share
  the clean samples' normalisation parameters), on the clean selected rows' statistics (the
  authors' twins normalise the selected batch);
* ``"batch"``: the model's own BatchNorms that train in train mode (a model without twins, e.g.
  a torchvision network as it comes), on the whole clean batch's statistics, as the model
  normalises the batch it trains on. (On the selected rows alone, two or three rows of a small
  selection gave degenerate statistics and a log p so steep that the bisection pulled most ``x'``
  of a torchvision ResNet-18 back to ``x``.) A BatchNorm the user keeps in eval mode (frozen)
  keeps its running statistics.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from lpa3_lightning.core.dual_bn import dual_layers, has_dual_bn

__all__ = ["BatchStatistics", "NormMode", "batch_norms", "capture_kept", "frozen_batch_statistics",
           "reference_batch_statistics", "resolve_bn_mode"]

NormMode = Literal["twin", "batch"]


@dataclass
class BatchStatistics:
    """Frozen per-layer batch statistics (one ``(mean, var)`` per BatchNorm of a mode, in model order).

    Captured from the clean selected samples of a batch (:func:`frozen_batch_statistics`) and used
    by the solver's forwards; the training forward of ``x'`` recomputes the same values from
    those samples (:func:`reference_batch_statistics`). A layer that never ran holds None.
    """

    values: list[tuple[Tensor, Tensor] | None] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.values)


def batch_norms(model: nn.Module, mode: NormMode) -> list[tuple[nn.Module, _BatchNorm]]:
    """``(module whose forward the mode replaces, BatchNorm whose affine parameters normalise)`` per layer.

    ``"twin"``: each converted layer and its twin; ``"batch"``: each BatchNorm in train mode (the
    main BatchNorm of a converted layer included, never a twin).

    Raises:
        ValueError: for another mode, or ``"twin"`` on a model without twins (naming the fix).
    """
    if mode == "twin":
        layers = dual_layers(model)
        if not layers:
            raise ValueError(f"{type(model).__name__} has no twin BatchNorm. Fix: call `convert_dual_bn(model)` first, "
                             "or use bn_mode='batch'.")
        return [(layer, layer.twin) for layer in layers]
    if mode == "batch":
        twins = {id(layer.twin) for layer in dual_layers(model)}
        return [(m, m) for m in model.modules() if isinstance(m, _BatchNorm) and m.training and id(m) not in twins]
    raise ValueError(f"`mode` must be 'twin' or 'batch', got {mode!r}.")


class _FrozenForward:
    """A BatchNorm forward on frozen statistics: the first call captures its batch's (when the
    slot says ``"capture"``), every call normalises with them, so each sample's output depends on
    that sample alone (the solver's per-sample check)."""

    def __init__(self, norm: _BatchNorm, slot: Any) -> None:
        self.norm, self.slot = norm, slot

    def __call__(self, x: Tensor) -> Tensor:
        norm = self.norm
        norm._check_input_dim(x)
        if isinstance(self.slot, str):  # "capture"
            dims = [0, *range(2, x.dim())]
            self.slot = (x.detach().mean(dims), x.detach().var(dims, unbiased=False))
        mean, var = self.slot
        return F.batch_norm(x, mean, var, norm.weight, norm.bias, False, 0.0, norm.eps)


@contextlib.contextmanager
def capture_kept(model: nn.Module) -> Iterator[None]:
    """Forwards inside the block do not capture frozen statistics (a probe of the model's layers
    with a few rows must leave the capture to the first real forward)."""
    frozen = [m.__dict__["forward"] for m in model.modules() if isinstance(m.__dict__.get("forward"), _FrozenForward)]
    slots = [f.slot for f in frozen]
    try:
        yield
    finally:
        for forward, slot in zip(frozen, slots):
            forward.slot = slot


def _reference_forward(norm: _BatchNorm, num_reference: int, x: Tensor) -> Tensor:
    # the first ``num_reference`` rows set the statistics for all rows, with gradients through
    # them (the scale invariance that keeps batch-normalised training stable); the values equal
    # the frozen statistics of those rows
    norm._check_input_dim(x)
    dims = [0, *range(2, x.dim())]
    reference = x[:num_reference]
    mean = reference.mean(dims, keepdim=True)
    var = reference.var(dims, unbiased=False, keepdim=True)
    out = (x - mean) * torch.rsqrt(var + norm.eps)
    if norm.affine:
        shape = [1, -1] + [1] * (x.dim() - 2)
        out = out * norm.weight.view(shape) + norm.bias.view(shape)
    return out


@contextlib.contextmanager
def _forwards_replaced(modules: list[nn.Module], forwards: list[Any]) -> Iterator[None]:
    """Each module's forward replaced for the block (an instance attribute), then restored."""
    saved = [module.__dict__.get("forward") for module in modules]
    try:
        for module, forward in zip(modules, forwards):
            object.__setattr__(module, "forward", forward)
        yield
    finally:
        for module, previous in zip(modules, saved):
            if previous is None:
                module.__dict__.pop("forward", None)
            else:
                object.__setattr__(module, "forward", previous)


@contextlib.contextmanager
def frozen_batch_statistics(model: nn.Module, mode: NormMode,
                            statistics: BatchStatistics | None = None) -> Iterator[BatchStatistics]:
    """The mode's BatchNorms normalise with frozen batch statistics for the block.

    With ``statistics`` they normalise with them; without, the first forward inside the block
    captures its own batch statistics (into the yielded object, filled when the block exits) and
    every later forward reuses them. Running buffers never move, whatever the train/eval flags.

    Raises:
        ValueError: for a mode the model lacks, or ``statistics`` of another number of layers.
    """
    pairs = batch_norms(model, mode)
    if statistics is not None and len(statistics) != len(pairs):
        raise ValueError(f"`statistics` holds {len(statistics)} layers but the model has {len(pairs)} BatchNorms in "
                         f"mode {mode!r}. Fix: pass statistics captured from this model in this mode.")
    captured = BatchStatistics() if statistics is None else statistics
    # a layer that never runs in this forward (e.g. an auxiliary head skipped in eval mode) keeps
    # None: given back, it captures again, which no forward of this model reaches either
    forwards = [_FrozenForward(norm, "capture" if statistics is None or statistics.values[k] is None
                               else statistics.values[k]) for k, (_, norm) in enumerate(pairs)]
    with _forwards_replaced([module for module, _ in pairs], forwards):
        yield captured
    if statistics is None:
        captured.values = [f.slot if isinstance(f.slot, tuple) else None for f in forwards]


@contextlib.contextmanager
def reference_batch_statistics(model: nn.Module, mode: NormMode, num_reference: int) -> Iterator[nn.Module]:
    """The mode's BatchNorms normalise every row with the first ``num_reference`` rows' statistics.

    The training forward of ``x'``: ``model(cat([x_reference, x_adv]))`` normalises ``x'`` with
    exactly the statistics the solver froze (those of the clean selected samples, computed the
    same way), gradients flowing through them. Running buffers never move.

    Raises:
        ValueError: for a mode the model lacks, or ``num_reference`` < 1.
    """
    if isinstance(num_reference, bool) or not isinstance(num_reference, int) or num_reference < 1:
        raise ValueError(f"`num_reference` must be an int >= 1, got {num_reference!r}.")
    pairs = batch_norms(model, mode)
    forwards = [functools.partial(_reference_forward, norm, num_reference) for _, norm in pairs]
    with _forwards_replaced([module for module, _ in pairs], forwards):
        yield model


def resolve_bn_mode(model: nn.Module, attack_bn: str) -> str:
    """The BatchNorm mode ``attack_bn`` means for ``model``: ``"auto"`` is ``"twin"`` with twins,
    else ``"batch"`` with BatchNorms that train in train mode, else ``"eval"``; any other value as given."""
    if attack_bn != "auto":
        return attack_bn
    if has_dual_bn(model):
        return "twin"
    return "batch" if any(isinstance(m, _BatchNorm) and m.training for m in model.modules()) else "eval"
