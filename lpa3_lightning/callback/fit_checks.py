"""The checks of a fit's start, made once: the module speaks the protocol (its networks, feature layers,
twins), synced BatchNorm, the input box and the training set's size.

A module with several networks (DivideMix's two) names them in ``lpa3_networks()``; :class:`NetworkView`
presents one of them as a single-network module, so each network gets a runner of its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

from lpa3_lightning.callback.rank_agreement import same_on_every_rank
from lpa3_lightning.core.checks import unwrap_compiled
from lpa3_lightning.core.dual_bn import DualSyncBatchNorm, has_dual_bn
from lpa3_lightning.core.feature_layers import resolve_layers
from lpa3_lightning.core.input_box import InputRange
from lpa3_lightning.methods.base import REQUIRED_METHODS

__all__ = ["NetworkView", "check_module", "check_synced_batchnorm", "infer_num_samples", "input_range_of",
           "memory_shape", "module_networks"]


def module_networks(module: Any) -> tuple[str, ...] | None:
    """The network names a module declares in ``lpa3_networks()``, or None for a single network.

    Raises:
        ValueError: if the names are not distinct non-empty strings without '/'.
    """
    declare = getattr(module, "lpa3_networks", None)
    names = declare() if callable(declare) else None
    if names is None:
        return None
    names = tuple(names) if isinstance(names, (list, tuple)) else names
    if not isinstance(names, tuple) or not names or not all(isinstance(n, str) and n for n in names) \
            or len(set(names)) != len(names) or any("/" in n for n in names):
        raise ValueError(
            f"{type(module).__name__}.lpa3_networks() must return distinct non-empty names without '/', e.g. "
            f"('net1', 'net2'), got {names!r}. Fix: return one name per network, or None for a single network."
        )
    return names


class NetworkView:
    """One named network of a multi-network module, seen as a single-network LP-A3 module: the protocol
    methods forward to the module's with ``network=name``, every other attribute is the module's."""

    def __init__(self, module: Any, name: str) -> None:
        object.__setattr__(self, "_module", module)
        object.__setattr__(self, "_network", name)

    def __getattr__(self, attr: str) -> Any:
        if attr in ("_module", "_network") or (attr.startswith("__") and attr.endswith("__")):
            raise AttributeError(attr)  # (copy and pickle look these up on an empty instance)
        return getattr(self._module, attr)

    def __setattr__(self, attr: str, value: Any) -> None:
        setattr(self._module, attr, value)

    def __repr__(self) -> str:
        return f"{type(self._module).__name__}[network={self._network!r}]"

    @property
    def lpa3_network(self) -> str:
        return self._network

    def lpa3_request(self, batch: Any) -> Any:
        return self._module.lpa3_request(batch, network=self._network)

    def lpa3_model(self) -> Any:
        return self._module.lpa3_model(network=self._network)

    def lpa3_set_augmented(self, augmented: Any) -> None:
        self._module.lpa3_set_augmented(augmented, network=self._network)

    def lpa3_pop_predictions(self) -> Any:
        return self._module.lpa3_pop_predictions(network=self._network)


def check_module(module: Any, layers: Any, attack_bn: str) -> None:
    """Refuse a module without the protocol, without a network to attack, with mixin settings of another
    class, with feature layers it lacks, or without twins for ``attack_bn="twin"``.

    Raises:
        TypeError, ValueError: naming what is missing and the fix.
    """
    missing = [name for name in REQUIRED_METHODS if not callable(getattr(module, name, None))]
    if missing:
        raise TypeError(
            f"{type(module).__name__} does not implement the LP-A3 protocol (missing {missing}). Fix: inherit "
            "`lpa3_lightning.mixins.LPA3ModuleMixin` (or `SupervisedLPA3Mixin`) and implement `lpa3_request`; "
            "see the README section on your own LightningModule."
        )
    if getattr(type(module).lpa3_model, "__qualname__", "") == "LPA3ModuleMixin.lpa3_model" \
            and type(module).forward in (nn.Module.forward, pl.LightningModule.forward):
        raise TypeError(
            f"{type(module).__name__} neither overrides `lpa3_model()` nor defines `forward()`, so LP-A3 has no "
            "network to attack (the default `lpa3_model()` returns the module itself). Fix: return the network "
            "from `lpa3_model()` (e.g. `def lpa3_model(self): return self.net`), or define `forward()`."
        )
    check_settings = getattr(module, "lpa3_check_settings", None)
    if callable(check_settings):
        check_settings()
    model = unwrap_compiled(module.lpa3_model())
    resolve_layers(model, layers)  # fails early, listing the available layer names
    if attack_bn == "twin" and not has_dual_bn(model):
        raise ValueError("`solver.attack_bn='twin'` needs twin BatchNorms in the model. Fix: call "
                         "`convert_dual_bn(model)` in the module, or use solver.attack_bn='auto' (the model's own "
                         "BatchNorms on the batch's statistics, 'batch', for a model without twins).")


def check_synced_batchnorm(model: nn.Module, world_size: int) -> None:
    """After the strategy's setup (``sync_batchnorm=True`` converts BN then): refuse twins that conversion
    dropped, and under DDP a synced BN the ``x'`` forward would pass (a collective only some ranks reach).

    Raises:
        ValueError: naming the fix.
    """
    if any(isinstance(m, nn.SyncBatchNorm) and not isinstance(m, DualSyncBatchNorm) and hasattr(m, "twin")
           for m in model.modules()):
        raise ValueError(
            "SyncBatchNorm replaced the model's twin BatchNorms (Trainer(sync_batchnorm=True) converts after "
            "the module converted its BN), so x' would go through the synced main BN. Fix: drop "
            "`sync_batchnorm=True` and call `nn.SyncBatchNorm.convert_sync_batchnorm(model)` before "
            "`convert_dual_bn(model)` in the module."
        )
    if world_size > 1 and any(isinstance(m, nn.SyncBatchNorm) and not isinstance(m, DualSyncBatchNorm)
                              for m in model.modules()):
        raise ValueError(
            "Under DDP the x' forward would pass through SyncBatchNorm, whose collectives only the ranks "
            "with selected samples would reach (a deadlock). Fix: call `convert_dual_bn(model)` after "
            "`nn.SyncBatchNorm.convert_sync_batchnorm(model)` (x' then uses local twins), or drop SyncBatchNorm."
        )


def input_range_of(trainer: pl.Trainer, input_range: Any) -> InputRange:
    """The solver's input box: ``input_range`` as given, or with ``"auto"`` the data module's
    ``normalization`` (a warning when there is none)."""
    if input_range != "auto":
        return input_range
    normalization = getattr(getattr(trainer, "datamodule", None), "normalization", None)
    if isinstance(normalization, Mapping):
        return dict(normalization)
    rank_zero_warn(
        "LPA3Callback(input_range='auto') found no `normalization` on the data module, so the solver clamps "
        "x' to no input box: x' may leave the valid range of your inputs (e.g. pixels outside [0, 1]). Fix: "
        "pass input_range=(low, high) or {'mean': [...], 'std': [...]} (the normalisation of [0, 1] data), "
        "give the data module a `normalization` attribute, or pass input_range=None for unbounded inputs."
    )
    return None


def infer_num_samples(trainer: pl.Trainer, module: Any, num_samples: int | None) -> int:
    """The TCS memory's rows: the setting, else the module's ``lpa3_num_samples``, else the size of the train
    dataloader's dataset.

    Raises:
        ValueError: when none of them tells, naming the fix.
    """
    if num_samples is not None:
        return num_samples
    declared = getattr(module, "lpa3_num_samples", None)  # e.g. FixMatch: the unlabeled set's size
    if isinstance(declared, int) and not isinstance(declared, bool) and declared > 0:
        return declared
    loader = trainer.train_dataloader
    try:
        return len(getattr(loader, "dataset", None))  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(
            "LPA3Callback could not infer the training-set size from the train dataloader "
            f"({type(loader).__name__}). Fix: pass `selection={{'num_samples': ...}}` (the number of dataset indices), "
            "or set `lpa3_num_samples` on the module."
        ) from None


def memory_shape(trainer: pl.Trainer, module: Any, num_samples: int | None) -> tuple[int, int]:
    """``(rows, classes)`` of a network's TCS memory: :func:`infer_num_samples` and the module's
    ``lpa3_num_classes``, the same on every rank (a reduction under DDP).

    Raises:
        ValueError: for a missing or bad ``lpa3_num_classes``, or ranks that disagree, naming the fix.
    """
    num_classes = getattr(module, "lpa3_num_classes", None)
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 2:
        raise ValueError(f"{type(getattr(module, '_module', module)).__name__}.lpa3_num_classes must be the number of classes (int >= 2), got "
                         f"{num_classes!r}. Fix: set `self.lpa3_num_classes = num_classes` in __init__.")
    rows = infer_num_samples(trainer, module, num_samples)
    if not same_on_every_rank(trainer, [rows, num_classes]):
        raise ValueError("The processes disagree on the training-set size or the number of classes. Fix: give every "
                         "rank the same dataset with global indices (Lightning's DistributedSampler does this), not "
                         "per-rank shards.")
    return rows, num_classes
