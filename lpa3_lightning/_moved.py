"""The import paths of modules that moved into folders keep working, with a DeprecationWarning
that names the new place: code written against ``lpa3_lightning.attack``,
``lpa3_lightning.mixins.pes`` or ``lpa3_lightning.classifier`` still runs while it is updated.

An old path of a module that was split (``attack``, ``features``) gives every public name of its
parts. Nothing is imported until an old path is (the Lightning-free core stays Lightning-free).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings
from typing import Any

_CORE = ("checks", "tcs", "selection", "dual_bn", "solver_graphs", "augmented", "augmented_forward", "batch_plan",
         "cache", "distributed", "host_reads", "visualize")
_MODULES = ("classifier", "fixmatch_classifier", "pes_classifier", "dividemix_classifier")
_METHODS = ("base", "supervised", "fixmatch", "pes", "dividemix", "mixmatch_lpa3")

#: old module -> the modules that now hold its names, in order
MOVED: dict[str, tuple[str, ...]] = {
    "lpa3_lightning.attack": ("lpa3_lightning.core.attack", "lpa3_lightning.core.solver_forward",
                              "lpa3_lightning.core.input_box", "lpa3_lightning.core.solver_loop"),
    "lpa3_lightning.features": ("lpa3_lightning.core.features", "lpa3_lightning.core.feature_layers",
                                "lpa3_lightning.core.model_outputs"),
    **{f"lpa3_lightning.{name}": (f"lpa3_lightning.core.{name}",) for name in _CORE},
    **{f"lpa3_lightning.{name}": (f"lpa3_lightning.modules.{name}",) for name in _MODULES},
    **{f"lpa3_lightning.mixins.{name}": (f"lpa3_lightning.methods.{name}",) for name in _METHODS},
    "lpa3_lightning.dividemix": ("lpa3_lightning.methods.dividemix_parts",),
    "lpa3_lightning.mixmatch": ("lpa3_lightning.methods.mixmatch",),
    "lpa3_lightning.ema": ("lpa3_lightning.methods.fixmatch_ema",),
    "lpa3_lightning.noisy_training": ("lpa3_lightning.methods.noisy_training",),
    "lpa3_lightning.networks": ("lpa3_lightning.callback.networks",),
    "lpa3_lightning.metrics": ("lpa3_lightning.callback.epoch_mean",),
    "lpa3_lightning.show": ("lpa3_lightning.cli.show",),
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old path and builds it from the modules that hold its names now."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        return importlib.machinery.ModuleSpec(name, self) if name in MOVED else None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        targets = MOVED[spec.name]
        warnings.warn(f"`{spec.name}` moved: import from {' / '.join(f'`{t}`' for t in targets)} (or from "
                      "`lpa3_lightning`); the old path will be removed.", DeprecationWarning, stacklevel=2)
        module = types.ModuleType(spec.name, f"Moved to {', '.join(targets)}.")
        for target in reversed(targets):  # the first module wins a name that several hold
            for name, value in vars(importlib.import_module(target)).items():
                if not name.startswith("__"):
                    setattr(module, name, value)
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def install() -> None:
    """Let the old paths import (once per process)."""
    if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
        sys.meta_path.append(_MovedModules())
