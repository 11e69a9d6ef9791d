"""The checks of a fit's start: the module speaks the LP-A3 protocol, has a network to attack,
its settings are its mixin's; the input box; the training set's size."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

from lpa3_lightning.core.dual_bn import DualSyncBatchNorm, has_dual_bn
from lpa3_lightning.core.feature_layers import resolve_layers
from lpa3_lightning.core.input_box import InputRange
from lpa3_lightning.core.model_outputs import unwrap_compiled
from lpa3_lightning.core.protocol import REQUIRED_METHODS

__all__ = ["check_module", "check_synced_batchnorm", "infer_num_samples", "input_range_of"]


def check_module(module: Any, layers: Any, attack_bn: str) -> None:
    """Refuse a module without the protocol, without a network to attack, with mixin settings of
    another class, with feature layers it does not have, or without twins for ``attack_bn="twin"``.

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
        check_settings()  # settings of another class (or a dict) fail here, not at the first step
    model = unwrap_compiled(module.lpa3_model())
    resolve_layers(model, layers)  # fails early, listing the available layer names
    if attack_bn == "twin" and not has_dual_bn(model):
        raise ValueError("`solver.attack_bn='twin'` needs twin BatchNorms in the model. Fix: call "
                         "`convert_dual_bn(model)` in the module, or use solver.attack_bn='auto' (the model's own "
                         "BatchNorms on the batch's statistics, 'batch', for a model without twins).")


def check_synced_batchnorm(model: nn.Module, world_size: int) -> None:
    """After the strategy's setup (``Trainer(sync_batchnorm=True)`` converts BN only then): refuse
    twins dropped by that conversion, and, under DDP, a synced BN the ``x'`` forward would pass.

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
            "`nn.SyncBatchNorm.convert_sync_batchnorm(model)` (x' then uses local twins), or drop "
            "SyncBatchNorm."
        )


def input_range_of(trainer: pl.Trainer, input_range: Any, warned: list[bool]) -> InputRange:
    """The solver's input box: ``input_range`` as given, or with ``"auto"`` the data module's
    ``normalization`` (warning once, in ``warned``, when there is none)."""
    if input_range != "auto":
        return input_range
    normalization = getattr(getattr(trainer, "datamodule", None), "normalization", None)
    if isinstance(normalization, Mapping):
        return dict(normalization)
    if not warned[0]:
        rank_zero_warn(
            "LPA3Callback(input_range='auto') found no `normalization` on the data module, so the solver clamps "
            "x' to no input box: x' may leave the valid range of your inputs (e.g. pixels outside [0, 1]). Fix: "
            "pass input_range=(low, high) or {'mean': [...], 'std': [...]} (the normalisation of [0, 1] data), "
            "give the data module a `normalization` attribute, or pass input_range=None for unbounded inputs."
        )
        warned[0] = True
    return None


def infer_num_samples(trainer: pl.Trainer, module: Any, num_samples: int | None) -> int:
    """The TCS memory's rows: the setting, else the module's ``lpa3_num_samples``, else the size
    of the train dataloader's dataset.

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
