"""How the model normalises in LP-A3's forwards: the solver's, and the training forward of ``x'`` (no Lightning).

A BatchNorm in train mode normalises each row with its batch's statistics, so a per-sample constraint checked
in one batch would not hold in another. The solver normalises with ``bn_mode``: ``"eval"`` (the running
statistics), ``"twin"`` (the twin BatchNorms, the authors' choice) or ``"batch"`` (the model's own that train in
train mode), the last two on batch statistics of clean reference rows frozen for the call; always in eval mode,
autocast and TF32 off, in the parameters' dtype, no running buffer moving. :func:`augmented_logits` trains
``x'`` in that very forward (``train_forward="verified"``, the reference rows' statistics recomputed inside
``model(cat([x_reference, x']))``) or in the authors' (``"batch_stats"``: the ``x'`` batch's own statistics).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from lpa3_lightning.core.checks import check_choice, check_int, eval_mode, output_to_logits, unwrap_compiled
from lpa3_lightning.core.dual_bn import dual_layers, has_dual_bn, use_twin_bn

__all__ = ["BN_MODES", "BatchStatistics", "TrainForward", "augmented_logits", "batchnorm_with_statistics",
           "capture_kept", "frozen_batch_statistics", "full_float32", "label_log_prob", "label_logp",
           "parameter_dtype", "reference_batch_statistics", "resolve_bn_mode", "running_statistics",
           "solver_precision"]

#: The BatchNorm modes of the solver and of the training forward of ``x'``.
BN_MODES = ("eval", "twin", "batch")
NormMode = Literal["twin", "batch"]
TrainForward = Literal["verified", "batch_stats"]


@dataclass
class BatchStatistics:
    """One frozen ``(mean, var)`` per BatchNorm of a mode, in model order (None: the layer never ran)."""

    values: list[tuple[Tensor, Tensor] | None] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.values)


def batch_norms(model: nn.Module, mode: NormMode) -> list[tuple[nn.Module, _BatchNorm]]:
    """``(module whose forward the mode replaces, BatchNorm whose affine parameters normalise)`` per layer:
    ``"twin"``, each converted layer and its twin; ``"batch"``, each BatchNorm in train mode (never a twin).
    ValueError for another mode, or ``"twin"`` without twins."""
    if mode == "twin":
        layers = dual_layers(model)
        if not layers:
            raise ValueError(f"{type(model).__name__} has no twin BatchNorm. Fix: call `convert_dual_bn(model)` first, "
                             "or use bn_mode='batch'.")
        return [(layer, layer.twin) for layer in layers]
    if mode == "batch":
        twins = {id(layer.twin) for layer in dual_layers(model)}
        return [(m, m) for m in model.modules() if isinstance(m, _BatchNorm) and m.training and id(m) not in twins]
    raise ValueError(f"`mode` must be 'twin' or 'batch', got {mode!r}. Fix: use 'twin' for a model with twin "
                     "BatchNorms, 'batch' otherwise.")


class _FrozenForward:
    """A BatchNorm forward on frozen statistics (captured by the first call when the slot says ``"capture"``)."""

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
    """Forwards inside the block capture no frozen statistics (a probe leaves that to the first real forward)."""
    frozen = [m.__dict__["forward"] for m in model.modules() if isinstance(m.__dict__.get("forward"), _FrozenForward)]
    slots = [f.slot for f in frozen]
    try:
        yield
    finally:
        for forward, slot in zip(frozen, slots):
            forward.slot = slot


def _reference_forward(norm: _BatchNorm, num_reference: int, x: Tensor) -> Tensor:
    # the first rows set every row's statistics, gradients through them; the values equal the frozen ones
    norm._check_input_dim(x)
    dims = [0, *range(2, x.dim())]
    reference = x[:num_reference]
    mean, var = reference.mean(dims, keepdim=True), reference.var(dims, unbiased=False, keepdim=True)
    out = (x - mean) * torch.rsqrt(var + norm.eps)
    if norm.affine:
        shape = [1, -1] + [1] * (x.dim() - 2)
        out = out * norm.weight.view(shape) + norm.bias.view(shape)
    return out


@contextlib.contextmanager
def _forwards_replaced(pairs: list[tuple[nn.Module, _BatchNorm]], forwards: list[Any]) -> Iterator[None]:
    """Each pair's module's forward replaced for the block (an instance attribute), then restored."""
    modules = [module for module, _ in pairs]
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
    """The mode's BatchNorms normalise with ``statistics`` for the block, or with those its first forward
    captures (yielded, filled when the block exits); running buffers never move. ValueError for a mode the
    model lacks, or ``statistics`` of another number of layers."""
    pairs = batch_norms(model, mode)
    if statistics is not None and len(statistics) != len(pairs):
        raise ValueError(f"`statistics` holds {len(statistics)} layers but the model has {len(pairs)} BatchNorms in "
                         f"mode {mode!r}. Fix: pass statistics captured from this model in this mode.")
    captured = BatchStatistics() if statistics is None else statistics
    # a layer that never runs in this forward (e.g. an auxiliary head skipped in eval mode) keeps
    # None: given back, it captures again, which no forward of this model reaches either
    forwards = [_FrozenForward(norm, "capture" if statistics is None or statistics.values[k] is None
                               else statistics.values[k]) for k, (_, norm) in enumerate(pairs)]
    with _forwards_replaced(pairs, forwards):
        yield captured
    if statistics is None:
        captured.values = [f.slot if isinstance(f.slot, tuple) else None for f in forwards]


@contextlib.contextmanager
def reference_batch_statistics(model: nn.Module, mode: NormMode, num_reference: int) -> Iterator[nn.Module]:
    """The mode's BatchNorms normalise every row with the first ``num_reference`` rows' statistics, gradients
    flowing through them (``model(cat([x_reference, x']))``); running buffers never move."""
    check_int(num_reference, "num_reference", 1, "pass the number of clean reference rows.")
    pairs = batch_norms(model, mode)
    with _forwards_replaced(pairs, [functools.partial(_reference_forward, norm, num_reference) for _, norm in pairs]):
        yield model


def resolve_bn_mode(model: nn.Module, attack_bn: str) -> str:
    """The BatchNorm mode ``attack_bn`` means for ``model``: ``"auto"`` is ``"twin"`` with twins,
    else ``"batch"`` with BatchNorms that train in train mode, else ``"eval"``; any other value as given."""
    if attack_bn != "auto":
        return attack_bn
    if has_dual_bn(model):
        return "twin"
    return "batch" if any(isinstance(m, _BatchNorm) and m.training for m in model.modules()) else "eval"


@contextlib.contextmanager
def attack_mode(model: nn.Module, bn_mode: str,
                statistics: BatchStatistics | None = None) -> Iterator[BatchStatistics | None]:
    """``model`` in the attack's forward mode, every flag restored after; yields the frozen batch statistics
    in ``"twin"`` and ``"batch"`` mode (filled when the block exits if its first forward captured them)."""
    # chosen before eval mode: "batch" takes the BatchNorms that train in train mode
    frozen = frozen_batch_statistics(model, bn_mode, statistics) if bn_mode in ("twin", "batch") \
        else contextlib.nullcontext()
    with frozen as used, eval_mode(model):
        yield used


@contextlib.contextmanager
def solver_precision(device: torch.device, allow_tf32: bool = False) -> Iterator[None]:
    """Autocast off and, unless ``allow_tf32``, TF32 off (:func:`full_float32`): the solver's arithmetic."""
    with torch.autocast(device.type, enabled=False), full_float32(device, enabled=not allow_tf32):
        yield


def label_log_prob(model: nn.Module, x: Tensor, y: Tensor, *, bn_mode: Literal["eval", "twin", "batch"] = "eval",
                   statistics: BatchStatistics | None = None, logits_fn: Callable[[Any], Tensor] | None = None,
                   temperature: float = 1.0, allow_tf32: bool = False) -> tuple[Tensor, BatchStatistics | None]:
    """``(log p(y|x), batch statistics or None)`` under the solver's forward, without gradient (``"twin"`` /
    ``"batch"``: on ``statistics``, or capturing those of ``x``)."""
    model = unwrap_compiled(model)
    x = x.detach().to(parameter_dtype(model, x.dtype))
    with attack_mode(model, bn_mode, statistics) as used, torch.no_grad(), solver_precision(x.device, allow_tf32):
        logp = label_logp((logits_fn or output_to_logits)(model(x)), y.long(), temperature)
    return logp, used


def parameter_dtype(model: nn.Module, default: torch.dtype) -> torch.dtype:
    """The dtype of the model's first floating parameter (``default`` when it has none)."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), default)


def label_logp(logits: Tensor, y: Tensor, temperature: float) -> Tensor:
    """``log p(y|x)`` at least in float32 (half-precision logits are promoted; float64 stays)."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.log_softmax(logits / temperature, dim=1).gather(1, y[:, None]).squeeze(1)


def per_sample(v: Tensor, x: Tensor) -> Tensor:
    return v.reshape([-1] + [1] * (x.dim() - 1))


@contextlib.contextmanager
def full_float32(device: torch.device, enabled: bool = True) -> Iterator[None]:
    """TF32 off for cuDNN convolutions and cuBLAS matrix products on CUDA, restored after (torch >= 2.9's
    ``fp32_precision``, which must not be mixed with the older ``allow_tf32`` flags, else those)."""
    if device.type != "cuda" or not enabled:
        yield
        return
    conv, matmul = getattr(torch.backends.cudnn, "conv", None), torch.backends.cuda.matmul
    new_api = conv is not None and hasattr(conv, "fp32_precision") and hasattr(matmul, "fp32_precision")
    flags = ((conv, "fp32_precision"), (matmul, "fp32_precision")) if new_api \
        else ((torch.backends.cudnn, "allow_tf32"), (matmul, "allow_tf32"))
    saved = [getattr(owner, name) for owner, name in flags]
    for owner, name in flags:
        setattr(owner, name, "ieee" if new_api else False)
    try:
        yield
    finally:
        for (owner, name), value in zip(flags, saved):
            setattr(owner, name, value)


def check_train_forward(train_forward: str) -> None:
    """Raise a ValueError naming ``train_forward`` unless it is ``"verified"`` or ``"batch_stats"``."""
    if train_forward not in ("verified", "batch_stats"):
        raise ValueError(f"`train_forward` must be 'verified' (x' trained under the normalisation the solver checked) "
                         f"or 'batch_stats' (the authors' forward), got {train_forward!r}. Fix: use 'verified'.")


def _batchnorms(model: nn.Module) -> list[_BatchNorm]:
    return [m for m in model.modules() if isinstance(m, _BatchNorm) and m.running_mean is not None]


def running_statistics(model: nn.Module) -> BatchStatistics:
    """A copy of every BatchNorm's running ``(mean, var)``: an eval-mode attack's normalisation, for ``x'`` to
    train on after the clean forward moved the buffers."""
    return BatchStatistics([(m.running_mean.detach().clone(), m.running_var.detach().clone())  # type: ignore[union-attr]
                           for m in _batchnorms(model)])


@contextlib.contextmanager
def batchnorm_with_statistics(model: nn.Module, statistics: BatchStatistics) -> Iterator[None]:
    """Every BatchNorm in eval mode on the given statistics for the block (the buffers rebound, not written in
    place, so a graph built inside stays valid after they are restored)."""
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


def augmented_logits(model: nn.Module, inputs: Tensor, *, bn_mode: Literal["eval", "twin", "batch"],
                     bn_statistics: BatchStatistics | None = None, reference_inputs: Tensor | None = None,
                     logits_fn: Callable[[Any], Tensor] | None = None, train_forward: TrainForward = "verified",
                     allow_tf32: bool = False) -> Tensor:
    """Logits of ``x'`` for the training loss (with autograd, unlike the solver's checks).

    Args:
        model: the network the solver attacked.
        inputs: ``(M, ...)`` the augmented inputs.
        bn_mode: the solver's BN mode.
        bn_statistics: what the solver normalised with: frozen batch statistics (``"twin"``, ``"batch"``; as
            constants) or the running statistics at the attack (``"eval"``: :func:`running_statistics`).
        reference_inputs: in ``"twin"`` and ``"batch"`` mode the clean rows whose statistics the solver froze:
            every row is normalised by theirs inside ``cat([reference_inputs, inputs])``, gradients through them.
        logits_fn: maps the model output to logits.
        train_forward: ``"verified"`` (the solver's forward) or ``"batch_stats"`` (the authors', with twins).
        allow_tf32: as the solver's ``allow_tf32``.

    Returns:
        ``(M, C)`` logits, differentiable w.r.t. the model's parameters.

    Raises:
        ValueError: on a bad ``train_forward`` or ``bn_mode``, or no ``bn_statistics`` when they are needed.
    """
    check_train_forward(train_forward)
    check_choice(bn_mode, BN_MODES, "bn_mode", "use the solver's bn_mode.")
    to_logits = logits_fn or output_to_logits
    if train_forward == "batch_stats":
        with use_twin_bn(model) if bn_mode == "twin" and has_dual_bn(model) else contextlib.nullcontext():
            return to_logits(model(inputs))
    referenced = bn_mode != "eval" and reference_inputs is not None
    if referenced:
        x = torch.cat([reference_inputs.detach(), inputs]).to(parameter_dtype(model, inputs.dtype))  # type: ignore
        normalisation = reference_batch_statistics(model, bn_mode, reference_inputs.shape[0])  # type: ignore
    elif bn_statistics is None:
        raise ValueError("`bn_statistics` is needed to train x' as verified. Fix: pass running_statistics(model) "
                         "(or train through augmented.forward()), or use train_forward='batch_stats'.")
    else:
        x = inputs.to(parameter_dtype(model, inputs.dtype))
        normalisation = (batchnorm_with_statistics(model, bn_statistics) if bn_mode == "eval"
                         else frozen_batch_statistics(model, bn_mode, bn_statistics))  # type: ignore[arg-type]
    # the normalisation before eval mode: "batch" takes the BatchNorms that train in train mode
    with normalisation, eval_mode(model), solver_precision(x.device, allow_tf32):
        logits = to_logits(model(x))
    return logits[reference_inputs.shape[0]:] if referenced else logits  # type: ignore[union-attr]
