"""The forward every solver pass runs: the attack's BatchNorm mode, autocast off, full float32
(TF32 off on CUDA), every module's train/eval flag restored; and the reference ``log p(y|x)``.

BatchNorm modes (``bn_mode``): ``"eval"`` (the running statistics: the deployed model),
``"twin"`` (the twins, on frozen batch statistics) and ``"batch"`` (the model's own BatchNorms on
frozen batch statistics; see :mod:`lpa3_lightning.core.batch_statistics`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lpa3_lightning.core.batch_statistics import BatchStatistics, frozen_batch_statistics
from lpa3_lightning.core.model_outputs import eval_mode, output_to_logits, unwrap_compiled

__all__ = ["BN_MODES", "full_float32", "label_log_prob", "parameter_dtype"]

#: The BatchNorm modes of the solver and of the training forward of ``x'``.
BN_MODES = ("eval", "twin", "batch")


@contextlib.contextmanager
def attack_mode(model: nn.Module, bn_mode: str,
                statistics: BatchStatistics | None = None) -> Iterator[BatchStatistics | None]:
    """Put ``model`` in the attack's forward mode and restore every module's flag afterwards.

    Yields the frozen batch statistics in ``"twin"`` and ``"batch"`` mode (filled when the block
    exits if they were captured by its first forward), else None.
    """
    if bn_mode in ("twin", "batch"):
        # The BatchNorms normalise with the batch statistics of the clean batch (given, or
        # captured by the first forward), frozen for the rest of the call: samples that do not
        # influence each other through the statistics, and the normalisation the training forward
        # of x' uses (lpa3_lightning.core.augmented_forward). Chosen before eval mode: "batch"
        # takes the BatchNorms that train in train mode.
        with frozen_batch_statistics(model, bn_mode, statistics) as frozen, eval_mode(model):
            yield frozen
    else:
        # eval: BN uses running statistics (nothing moves) and dropout is off, so each
        # sample's output depends on that sample only and the constraint is exact per sample.
        with eval_mode(model):
            yield None


def label_log_prob(
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    *,
    bn_mode: Literal["eval", "twin", "batch"] = "eval",
    statistics: BatchStatistics | None = None,
    logits_fn: Callable[[Any], Tensor] | None = None,
    temperature: float = 1.0,
    allow_tf32: bool = False,
) -> tuple[Tensor, BatchStatistics | None]:
    """``log p(y|x)`` under the solver's forward (no gradient, nothing updated).

    The reference the constraint is measured against: eval mode, autocast off, the
    parameters' dtype; ``bn_mode="twin"`` or ``"batch"`` normalises with ``statistics`` or, when
    None, captures the batch statistics of ``x`` and returns them; ``"eval"`` uses the main BN
    on its running statistics (the deployed model).

    Returns:
        ``((N,) log-probabilities (float32, or float64 for a float64 model), the batch statistics
        used or None)``.
    """
    model = unwrap_compiled(model)
    to_logits = logits_fn or output_to_logits
    x = x.detach().to(parameter_dtype(model, x.dtype))
    with attack_mode(model, bn_mode, statistics) as used, torch.no_grad(), \
            torch.autocast(x.device.type, enabled=False), full_float32(x.device, enabled=not allow_tf32):
        logp = label_logp(to_logits(model(x)), y.long(), temperature)
    return logp, used


def parameter_dtype(model: nn.Module, default: torch.dtype) -> torch.dtype:
    """The dtype of the model's first floating parameter (``default`` when it has none)."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), default)


def label_logp(logits: Tensor, y: Tensor, temperature: float) -> Tensor:
    """``log p(y|x)`` at least in float32 (half-precision logits are promoted; float64 stays: the
    margin sigma is far below what half precision resolves, and a float64 run checks in float64)."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.log_softmax(logits / temperature, dim=1).gather(1, y[:, None]).squeeze(1)


def per_sample(v: Tensor, x: Tensor) -> Tensor:
    return v.reshape([-1] + [1] * (x.dim() - 1))


@contextlib.contextmanager
def full_float32(device: torch.device, enabled: bool = True) -> Iterator[None]:
    """TF32 off for cuDNN convolutions and cuBLAS matrix products on CUDA, restored after.

    Uses the precision settings a user is most likely to have touched: torch >= 2.9's
    ``fp32_precision`` (which refuses to be mixed with the older ``allow_tf32`` flags, and
    which ``torch.set_float32_matmul_precision`` also sets), else the ``allow_tf32`` flags.
    """
    if device.type != "cuda" or not enabled:
        yield
        return
    conv = getattr(torch.backends.cudnn, "conv", None)
    matmul = torch.backends.cuda.matmul
    if conv is not None and hasattr(conv, "fp32_precision") and hasattr(matmul, "fp32_precision"):
        saved = (conv.fp32_precision, matmul.fp32_precision)
        conv.fp32_precision = matmul.fp32_precision = "ieee"
        try:
            yield
        finally:
            conv.fp32_precision, matmul.fp32_precision = saved
        return
    saved_flags = (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved_flags


@contextlib.contextmanager
def solver_context(model: nn.Module, bn_mode: str, statistics: BatchStatistics | None, device: torch.device,
                   allow_tf32: bool) -> Iterator[None]:
    """The forward mode every solver pass runs in: attack BN mode, gradients on, autocast off, full float32."""
    with attack_mode(model, bn_mode, statistics), torch.enable_grad(), torch.autocast(device.type, enabled=False), \
            full_float32(device, enabled=not allow_tf32):
        yield
