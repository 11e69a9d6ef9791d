"""The ``lpa3`` command (LightningCLI over any module and data module), ``lpa3 show`` and ``lpa3 compare``.

Each name loads with its module on first use; :mod:`lpa3_lightning.cli.paired` imports without Lightning."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["LPA3CLI", "build_cli", "main"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'lpa3_lightning.cli' has no attribute {name!r}")
    globals()[name] = value = getattr(importlib.import_module("lpa3_lightning.cli.command"), name)
    return value
