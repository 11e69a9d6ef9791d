"""The forward every solver pass runs: the attack's BatchNorm mode, autocast off, full float32
(TF32 off on CUDA), every module's train/eval flag restored; and the reference ``log p(y|x)``."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lpa3_lightning.core.dual_bn import TwinStatistics, frozen_twin_bn
from lpa3_lightning.core.model_outputs import eval_mode, output_to_logits, unwrap_compiled

__all__ = ["full_float32", "label_log_prob", "parameter_dtype"]


@contextlib.contextmanager
def attack_mode(model: nn.Module, bn_mode: str,
                 twin_statistics: TwinStatistics | None = None) -> Iterator[TwinStatistics | None]:
    """Put ``model`` in the attack's forward mode and restore every module's flag afterwards.

    Yields the frozen twin statistics in twin mode (filled when the block exits if they were
    captured by its first forward), else None.
    """
    # eval: BN uses running statistics (nothing moves) and dropout is off, so each
    # sample's output depends on that sample only and the constraint is exact per sample.
    with eval_mode(model):
        if bn_mode == "twin":
            # The twins normalise with the batch statistics of the clean batch (given, or
            # captured by the first forward), frozen for the rest of the call: the authors'
            # twin-BN attack, but with samples that do not influence each other through the
            # statistics, and the same normalisation the training forward of x' uses
            # (lpa3_lightning.core.augmented_forward).
            with frozen_twin_bn(model, twin_statistics) as statistics:
                yield statistics
        else:
            yield None


def label_log_prob(
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    *,
    bn_mode: Literal["eval", "twin"] = "eval",
    twin_statistics: TwinStatistics | None = None,
    logits_fn: Callable[[Any], Tensor] | None = None,
    temperature: float = 1.0,
    allow_tf32: bool = False,
) -> tuple[Tensor, TwinStatistics | None]:
    """``log p(y|x)`` under the solver's forward (no gradient, nothing updated).

    The reference the constraint is measured against: eval mode, autocast off, the
    parameters' dtype; ``bn_mode="twin"`` normalises with ``twin_statistics`` or, when None,
    captures the batch statistics of ``x`` and returns them; ``"eval"`` uses the main BN on
    its running statistics (the deployed model).

    Returns:
        ``((N,) log-probabilities in float32, the twin statistics used or None)``.
    """
    model = unwrap_compiled(model)
    to_logits = logits_fn or output_to_logits
    x = x.detach().to(parameter_dtype(model, x.dtype))
    with attack_mode(model, bn_mode, twin_statistics) as statistics, torch.no_grad(), \
            torch.autocast(x.device.type, enabled=False), full_float32(x.device, enabled=not allow_tf32):
        logp = label_logp(to_logits(model(x)), y.long(), temperature)
    return logp, statistics


def parameter_dtype(model: nn.Module, default: torch.dtype) -> torch.dtype:
    """The dtype of the model's first floating parameter (``default`` when it has none)."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), default)


def label_logp(logits: Tensor, y: Tensor, temperature: float) -> Tensor:
    return F.log_softmax(logits.float() / temperature, dim=1).gather(1, y[:, None]).squeeze(1)


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
def solver_context(model: nn.Module, bn_mode: str, twin_statistics: TwinStatistics | None, device: torch.device,
                    allow_tf32: bool) -> Iterator[None]:
    """The forward mode every solver pass runs in: attack BN mode, gradients on, autocast off, full float32."""
    with attack_mode(model, bn_mode, twin_statistics), torch.enable_grad(), torch.autocast(device.type, enabled=False), \
            full_float32(device, enabled=not allow_tf32):
        yield
