"""Augmented batch -> logits: the forward that trains on ``x'``, normalised as the solver verified it.

The solver checks ``log p(y|x') >= log p(y|x) - sigma`` under one forward: the model in eval
mode, BatchNorm normalising with the frozen batch statistics of the clean selected samples,
through the twins (``bn_mode="twin"``) or the model's own BatchNorms (``"batch"``), or with the
running statistics (``"eval"``), autocast off, in the parameters' dtype. If ``x'`` were then trained under another normalisation (the
authors train it through the twins in train mode, on the ``x'`` batch's own statistics), the
constraint would no longer describe the sample the model learns from: an independent re-check
found it kept on 66% of a trained ResNet-18's BreastMNIST samples in that forward.

:func:`augmented_logits` is that training forward with the solver's normalisation
(``train_forward="verified"``, the default) or the authors' (``"batch_stats"``). The verified
forward is the solver's in every respect: the model in eval mode for it, so dropout (which the
solver's check runs without) is off for ``x'`` too; measured on a small CNN with dropout 0.2,
a train-mode forward kept the constraint on only 71% of ``x'``. Gradients flow as usual and
every module's flag is restored afterwards. Imports no Lightning.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from lpa3_lightning.core.batch_statistics import BatchStatistics, frozen_batch_statistics, reference_batch_statistics
from lpa3_lightning.core.dual_bn import has_dual_bn, use_twin_bn
from lpa3_lightning.core.model_outputs import eval_mode, output_to_logits
from lpa3_lightning.core.solver_forward import full_float32, parameter_dtype

__all__ = [
    "TrainForward", "augmented_logits", "batchnorm_with_statistics", "check_train_forward", "running_statistics",
]

TrainForward = Literal["verified", "batch_stats"]


def check_train_forward(train_forward: str) -> None:
    """Raise a ValueError naming ``train_forward`` unless it is ``"verified"`` or ``"batch_stats"``."""
    if train_forward not in ("verified", "batch_stats"):
        raise ValueError(f"`train_forward` must be 'verified' (x' trained under the normalisation the solver checked) "
                         f"or 'batch_stats' (the authors' forward), got {train_forward!r}. Fix: use 'verified'.")


def _batchnorms(model: nn.Module) -> list[_BatchNorm]:
    return [m for m in model.modules() if isinstance(m, _BatchNorm) and m.running_mean is not None]


def running_statistics(model: nn.Module) -> BatchStatistics:
    """A copy of every BatchNorm's running ``(mean, var)``: the normalisation of an eval-mode attack.

    The module's clean forward in ``training_step`` moves the running statistics after the
    solver ran, so the training forward of ``x'`` must use this snapshot, not the buffers.
    """
    return BatchStatistics([(m.running_mean.detach().clone(), m.running_var.detach().clone())  # type: ignore[union-attr]
                           for m in _batchnorms(model)])


@contextlib.contextmanager
def batchnorm_with_statistics(model: nn.Module, statistics: BatchStatistics) -> Iterator[None]:
    """Every BatchNorm of ``model`` in eval mode on the given statistics for the block.

    The buffers are swapped for the snapshot's tensors (rebound, not written in place, so a
    graph built inside the block stays valid after they are restored) and nothing updates them.
    """
    layers = _batchnorms(model)
    if len(layers) != len(statistics):
        raise ValueError(f"`statistics` holds {len(statistics)} layers but the model has {len(layers)} BatchNorms. "
                         "Fix: pass the statistics captured from this model.")
    saved = [(m, m.training, m.running_mean, m.running_var) for m in layers]
    try:
        for m, (mean, var) in zip(layers, statistics.values):
            m.eval()
            m.running_mean, m.running_var = mean, var
        yield
    finally:
        for m, training, mean, var in saved:
            m.running_mean, m.running_var = mean, var
            m.train(training)


def augmented_logits(
    model: nn.Module,
    inputs: Tensor,
    *,
    bn_mode: Literal["eval", "twin", "batch"],
    bn_statistics: BatchStatistics | None = None,
    reference_inputs: Tensor | None = None,
    logits_fn: Callable[[Any], Tensor] | None = None,
    train_forward: TrainForward = "verified",
    allow_tf32: bool = False,
) -> Tensor:
    """Logits of ``x'`` for the training loss (with autograd, unlike the solver's checks).

    Args:
        model: the network the solver attacked.
        inputs: ``(M, ...)`` the augmented inputs.
        bn_mode: the solver's BN mode (``AugmentedBatch.bn_mode``).
        bn_statistics: the statistics the solver normalised with (``AugmentedBatch.bn_statistics``):
            the frozen batch statistics (``"twin"``, ``"batch"``) or the running statistics at the
            time of the attack (``"eval"``; :func:`running_statistics`).
        reference_inputs: in ``"twin"`` and ``"batch"`` mode, the clean selected samples whose
            statistics the solver froze (``AugmentedBatch.reference_inputs``): the forward then runs on
            ``cat([reference_inputs, inputs])`` and normalises every row with the reference rows'
            batch statistics (reference-batch normalisation, Salimans et al. 2016), so ``x'`` sees
            exactly the solver's statistics while gradients flow through them as in ordinary
            batch normalisation. Without it the frozen ``bn_statistics`` are used as constants,
            which measured unstable: on BreastMNIST (ResNet-18, Adam 1e-3) the clean validation
            AUC stayed at 0.5 for five epochs (the constants let the ``x'`` loss rescale the shared
            convolutions freely).
        logits_fn: maps the model output to logits.
        train_forward: ``"verified"`` (default): the solver's forward: eval mode (no dropout),
            the solver's normalisation (``bn_mode`` with ``bn_statistics``), autocast off and the
            parameters' dtype (float32 under mixed precision), TF32 off on CUDA unless
            ``allow_tf32``. ``"batch_stats"``: the authors' forward: through the twins in the
            module's mode, normalising by the ``x'`` batch's own statistics (twins' running
            statistics updated), or, without twins, a plain forward; the run's precision.
        allow_tf32: as the solver's ``allow_tf32``.

    Returns:
        ``(M, C)`` logits, differentiable w.r.t. the model's parameters.

    Raises:
        ValueError: on a bad ``train_forward`` or ``bn_mode``, or no ``bn_statistics`` in
            ``"verified"`` mode.
    """
    check_train_forward(train_forward)
    if bn_mode not in ("eval", "twin", "batch"):
        raise ValueError(f"`bn_mode` must be 'eval', 'twin' or 'batch', got {bn_mode!r}.")
    to_logits = logits_fn or output_to_logits
    if train_forward == "batch_stats":
        with use_twin_bn(model) if bn_mode == "twin" and has_dual_bn(model) else contextlib.nullcontext():
            return to_logits(model(inputs))
    if bn_mode != "eval" and reference_inputs is not None:
        x = torch.cat([reference_inputs.detach(), inputs]).to(parameter_dtype(model, inputs.dtype))
        normalisation = reference_batch_statistics(model, bn_mode, reference_inputs.shape[0])  # type: ignore[arg-type]
        with _solver_forward(model, normalisation, x.device, allow_tf32):
            return to_logits(model(x))[reference_inputs.shape[0]:]
    if bn_statistics is None:
        raise ValueError("`bn_statistics` is needed to train x' as verified. Fix: pass AugmentedBatch.bn_statistics, "
                         "or use train_forward='batch_stats'.")
    x = inputs.to(parameter_dtype(model, inputs.dtype))
    normalisation = (batchnorm_with_statistics(model, bn_statistics) if bn_mode == "eval"
                     else frozen_batch_statistics(model, bn_mode, bn_statistics))  # type: ignore[arg-type]
    with _solver_forward(model, normalisation, x.device, allow_tf32):
        return to_logits(model(x))


@contextlib.contextmanager
def _solver_forward(model: nn.Module, normalisation: Any, device: torch.device, allow_tf32: bool) -> Iterator[None]:
    """The solver's forward conditions with autograd on: eval mode (dropout off, as in the
    solver's check), the given BN normalisation (entered first: ``"batch"`` takes the BatchNorms
    that train in train mode), autocast off, TF32 off unless allowed."""
    with normalisation, eval_mode(model), torch.autocast(device.type, enabled=False), \
            full_float32(device, enabled=not allow_tf32):
        yield
