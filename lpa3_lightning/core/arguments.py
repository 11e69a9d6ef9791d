"""One check per kind of setting (a choice, a flag, an int, a number), named by the caller, and
the one way a settings dataclass is built from what a user passed (:func:`dataclass_from`).

The core constructors and the callback's settings groups validate the same settings with these,
so a value is refused with one message wherever it is given: ``lam`` to
:func:`~lpa3_lightning.core.attack.lpa3_attack`, ``solver.lam`` to
:class:`~lpa3_lightning.LPA3Callback`. No Lightning here.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import fields
from typing import Any, TypeVar

__all__ = ["check_choice", "check_flag", "check_int", "check_number", "dataclass_from"]

D = TypeVar("D")


def dataclass_from(cls: type[D], value: Any, argument: str, home: Callable[[str], str | None] | None = None) -> D:
    """``value`` as a ``cls``: an instance as it is, a mapping as its fields (the defaults for the
    others). A key ``cls`` has no field for is refused naming the group ``home(key)`` says holds it,
    or the closest field.

    Raises:
        TypeError: for an unknown key or another type, naming ``argument`` and the fix.

    Example:
        >>> from dataclasses import dataclass
        >>> @dataclass(frozen=True)
        ... class Box:
        ...     low: float = 0.0
        ...     high: float = 1.0
        >>> dataclass_from(Box, {"high": 2.0}, "box")
        Box(low=0.0, high=2.0)
    """
    if isinstance(value, cls):
        return value
    if isinstance(value, Mapping):
        known = [f.name for f in fields(cls)]  # type: ignore[arg-type]
        for key in value:
            if key not in known:
                elsewhere = home(str(key)) if home is not None else None
                close = difflib.get_close_matches(str(key), known, n=1)
                where = (f": it is a setting of the `{elsewhere}` group" if elsewhere is not None
                         else f": did you mean `{close[0]}`?" if close else "")
                raise TypeError(f"`{argument}` has no setting `{key}`{where}. Fix: use the fields of {cls.__name__}: "
                                f"{known}.")
        return cls(**dict(value))
    raise TypeError(f"`{argument}` must be a {cls.__name__}, a mapping of its fields or None, got "
                    f"{type(value).__name__}. Fix: pass {argument}={cls.__name__}(...).")


def check_choice(value: Any, choices: Sequence[Any], name: str, fix: str) -> None:
    """Refuse ``value`` unless it is one of ``choices``.

    Raises:
        ValueError: naming ``name``, the choices, the value and the fix.

    Example:
        >>> check_choice("code", ("code", "paper"), "divergence", "use 'code'.")
    """
    if value not in choices:
        listed = ", ".join(repr(c) for c in choices)
        raise ValueError(f"`{name}` must be one of {listed}, got {value!r}. Fix: {fix}")


def check_flag(value: Any, name: str, fix: str) -> None:
    """Refuse anything but ``True`` or ``False``.

    Raises:
        ValueError: naming ``name``, the value and the fix.
    """
    if not isinstance(value, bool):
        raise ValueError(f"`{name}` must be True or False, got {value!r}. Fix: {fix}")


def check_int(value: Any, name: str, low: int, fix: str) -> None:
    """Refuse anything but an int (not a bool) of at least ``low``.

    Raises:
        ValueError: naming ``name``, the value and the fix.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"`{name}` must be an int >= {low}, got {value!r}. Fix: {fix}")


def check_number(value: Any, name: str, fix: str, *, minimum: float | None = None, above: float | None = None,
                 maximum: float | None = None, below: float | None = None) -> float:
    """Refuse anything but a finite int or float (a bool is not one) within the given bounds
    (``minimum <= value`` or ``above < value``, ``value <= maximum`` or ``value < below``); return it as a float.

    Raises:
        ValueError: naming ``name``, the range, the value and the fix.

    Example:
        >>> check_number(0.5, "pes.temperature", "use 0.5.", above=0)
        0.5
        >>> check_number(0, "pes.temperature", "use 0.5.", above=0)
        Traceback (most recent call last):
        ...
        ValueError: `pes.temperature` must be a finite number > 0, got 0. Fix: use 0.5.
    """
    bounds = [f"{sign} {bound:g}" for sign, bound in ((">=", minimum), (">", above), ("<=", maximum), ("<", below))
              if bound is not None]
    number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not number or (minimum is not None and value < minimum) or (above is not None and value <= above) \
            or (maximum is not None and value > maximum) or (below is not None and value >= below):
        where = " and ".join(bounds)
        raise ValueError(f"`{name}` must be a finite number{' ' + where if where else ''}, got {value!r}. Fix: {fix}")
    return float(value)
