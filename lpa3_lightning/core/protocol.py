"""What the callback and the modules agree on, in one neutral place both import (no Lightning).

A module speaks LP-A3 by the methods :data:`REQUIRED_METHODS` names (the mixins in
:mod:`lpa3_lightning.methods` provide them); the callback marks itself with
:data:`CALLBACK_MARKER`, so a module (or its helpers) finds the LP-A3 callbacks of a Trainer
without importing the callback.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["CALLBACK_MARKER", "REQUIRED_METHODS", "lpa3_callbacks"]

#: Methods the callback calls on a module; checked when the callback sets up.
REQUIRED_METHODS = ("lpa3_request", "lpa3_model", "lpa3_logits", "lpa3_set_augmented", "lpa3_pop_predictions")

#: The attribute (set to True) that marks an LP-A3 callback.
CALLBACK_MARKER = "is_lpa3_callback"


def lpa3_callbacks(callbacks: Iterable[Any]) -> list[Any]:
    """The LP-A3 callbacks among ``callbacks`` (e.g. ``trainer.callbacks``)."""
    return [c for c in callbacks if getattr(c, CALLBACK_MARKER, False) is True]
