"""Twin BatchNorm: a second set of BN statistics and affine parameters for augmented samples.

Adversarial augmentations have other activation statistics than clean data, and pooling them in one BatchNorm
corrupts the statistics used at test time; following the authors (and AdvProp, Xie et al. 2020), every
BatchNorm gets a twin that only augmented samples go through. :func:`convert_dual_bn` keeps the original
module's parameters and buffers under the same state-dict keys (a plain checkpoint loads and evaluates with
the main BN) and adds the twin under ``<name>.twin``; :func:`use_twin_bn` routes forwards through the twins.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = ["DualBatchNorm1d", "DualBatchNorm2d", "DualBatchNorm3d", "DualSyncBatchNorm", "LocalBatchNorm",
           "anchor_twin_parameters", "convert_dual_bn", "dual_layers", "has_dual_bn", "use_twin_bn"]

#: The authors' momentum for the twin BN's running statistics.
TWIN_MOMENTUM = 0.01


class _DualBatchNormMixin:
    """Adds a routed twin to a BatchNorm class. ``self`` *is* the main BN."""

    def _init_twin(self, twin: _BatchNorm) -> None:
        self.twin, self._route_twin, self._twin_track_stats, self._anchor_twin = twin, False, True, False

    def forward(self, x: Tensor) -> Tensor:  # type: ignore[override]
        if not self._route_twin:
            out = super().forward(x)  # type: ignore[misc]
            if self._anchor_twin and torch.is_grad_enabled():  # an exact zero (see anchor_twin_parameters)
                out = out + sum(0.0 * p.sum() for p in self.twin.parameters())
            return out
        twin = self.twin
        if self._twin_track_stats or not twin.training:
            return twin(x)
        twin._check_input_dim(x)  # batch statistics, the twin's running buffers untouched
        return F.batch_norm(x, None, None, twin.weight, twin.bias, True, 0.0, twin.eps)

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        # a plain checkpoint has no twin keys: the twin starts as a copy of the main BN (each module
        # gets a private copy of the dict, and the twin is loaded after its parent)
        twin_prefix = prefix + "twin."
        if not any(k.startswith(twin_prefix) for k in state_dict):
            for name in list(self.twin.state_dict()):
                if prefix + name in state_dict:
                    # a copy: with load_state_dict(assign=True) the twin must not share storage
                    state_dict[twin_prefix + name] = state_dict[prefix + name].clone()
        super()._load_from_state_dict(state_dict, prefix, *args)  # type: ignore[misc]


class DualBatchNorm1d(_DualBatchNormMixin, nn.BatchNorm1d):
    """BatchNorm1d with a twin for augmented samples."""


class DualBatchNorm2d(_DualBatchNormMixin, nn.BatchNorm2d):
    """BatchNorm2d with a twin for augmented samples."""


class DualBatchNorm3d(_DualBatchNormMixin, nn.BatchNorm3d):
    """BatchNorm3d with a twin for augmented samples."""


class LocalBatchNorm(_BatchNorm):
    """A plain (per-process) BatchNorm for inputs of any rank >= 2: the twin of a SyncBatchNorm."""

    def _check_input_dim(self, x: Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {x.dim()}D input)")


class DualSyncBatchNorm(_DualBatchNormMixin, nn.SyncBatchNorm):
    """SyncBatchNorm (main, synced across processes) with a local twin for augmented samples (ranks hold
    different numbers of them, some none: a collective in the twin's forward would deadlock)."""


_DUAL_OF = {nn.BatchNorm1d: DualBatchNorm1d, nn.BatchNorm2d: DualBatchNorm2d, nn.BatchNorm3d: DualBatchNorm3d,
            nn.SyncBatchNorm: DualSyncBatchNorm}
_DUAL_TYPES = tuple(_DUAL_OF.values())


def _make_dual(bn: _BatchNorm, twin_momentum: float) -> _DualBatchNormMixin:
    cls = _DUAL_OF[type(bn)]
    if isinstance(bn, nn.SyncBatchNorm):
        dual = cls(bn.num_features, bn.eps, bn.momentum, bn.affine, bn.track_running_stats, bn.process_group)
        twin = LocalBatchNorm(bn.num_features, bn.eps, twin_momentum, bn.affine, bn.track_running_stats)
        twin.load_state_dict(bn.state_dict())
    else:
        dual = cls(bn.num_features, bn.eps, bn.momentum, bn.affine, bn.track_running_stats)
        twin = copy.deepcopy(bn)  # same start as the main BN (fresh when training from scratch)
    twin.momentum = twin_momentum
    dual._init_twin(twin)
    dual.load_state_dict(bn.state_dict())  # the main BN keeps its state exactly
    dual.train(bn.training)
    floats = [t for t in list(bn.parameters()) + list(bn.buffers()) if t.is_floating_point()]
    if floats:
        dual.to(device=floats[0].device, dtype=floats[0].dtype)
    return dual


def convert_dual_bn(model: nn.Module, twin_momentum: float = TWIN_MOMENTUM) -> nn.Module:
    """Give every BatchNorm1d/2d/3d and SyncBatchNorm of ``model`` a twin for augmented samples, in place.

    ``SyncBatchNorm`` layers become :class:`DualSyncBatchNorm` (call ``convert_sync_batchnorm`` *before*, not
    ``Trainer(sync_batchnorm=True)``, which drops the twins); other BatchNorm subclasses and converted layers
    are left alone. Convert before the optimizer is created: the new layers have new Parameters.

    Args:
        model: any network.
        twin_momentum: running-statistics momentum of the twins (authors: 0.01).

    Returns:
        ``model`` itself, converted (a root BatchNorm: the new module, to be used instead).

    Raises:
        ValueError: if ``twin_momentum`` is not in (0, 1].

    Example:
        >>> net = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4))
        >>> _ = convert_dual_bn(net)
        >>> type(net[1]).__name__, has_dual_bn(net)
        ('DualBatchNorm2d', True)
    """
    if not 0.0 < twin_momentum <= 1.0:
        raise ValueError(f"`twin_momentum` must be in (0, 1], got {twin_momentum}. Fix: use e.g. 0.01 (the authors').")
    if type(model) in _DUAL_OF:
        return _make_dual(model, twin_momentum)  # type: ignore[arg-type,return-value]
    for name, child in model.named_children():
        if type(child) in _DUAL_OF:
            setattr(model, name, _make_dual(child, twin_momentum))
        elif not isinstance(child, _DUAL_TYPES):  # an already converted layer's twin stays plain
            convert_dual_bn(child, twin_momentum)
    return model


def dual_layers(model: nn.Module) -> list[_DualBatchNormMixin]:
    """Every layer of ``model`` converted by :func:`convert_dual_bn`, in model order."""
    return [m for m in model.modules() if isinstance(m, _DUAL_TYPES)]


def has_dual_bn(model: nn.Module) -> bool:
    """Whether ``model`` has at least one twin BatchNorm (see :func:`convert_dual_bn`)."""
    return bool(dual_layers(model))


def anchor_twin_parameters(model: nn.Module, enabled: bool = True) -> None:
    """Make every main-BN forward of ``model`` add ``0 * sum(twin parameters)`` (or stop it): under DDP a
    parameter outside a step's loss stalls the reducer, and the twins are outside every step without ``x'``;
    anchored, they get an exact zero gradient there, the output unchanged."""
    for layer in dual_layers(model):
        layer._anchor_twin = bool(enabled)


@contextlib.contextmanager
def use_twin_bn(model: nn.Module, track_running_stats: bool = True) -> Iterator[nn.Module]:
    """Route every forward of ``model`` inside the block through the twin BatchNorms, in the module's mode
    (the authors' forward of ``x'``); ``track_running_stats=False``: batch statistics in train mode without
    updating the twins' running buffers. ValueError if ``model`` has no twin BatchNorm."""
    layers = dual_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no twin BatchNorm. Fix: call `convert_dual_bn(model)` first.")
    saved = [(layer._route_twin, layer._twin_track_stats) for layer in layers]
    try:
        for layer in layers:
            layer._route_twin, layer._twin_track_stats = True, track_running_stats
        yield model
    finally:
        for layer, (route, track) in zip(layers, saved):
            layer._route_twin, layer._twin_track_stats = route, track
