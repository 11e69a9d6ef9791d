"""The valid input box of the solver's clamp: the forms it is given in, and the tensors they resolve to."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Union

import torch
from torch import Tensor

__all__ = ["InputRange", "is_input_range_form", "resolve_input_range"]


#: Bounds as ``(low, high)`` (floats or per-channel sequences) or a normalisation
#: ``{"mean": [...], "std": [...]}`` of inputs that lived in ``[0, 1]`` before it.
InputRange = Union[tuple[Any, Any], Mapping[str, Any], None]


def resolve_input_range(input_range: InputRange, x: Tensor) -> tuple[Tensor, Tensor] | None:
    """Turn ``input_range`` into ``(low, high)`` tensors broadcastable to ``x`` (per-channel sequences along
    dim 1; ``{"mean", "std"}``: a normalisation ``(v - mean) / std`` of values in ``[0, 1]``, or in a
    ``"pixel_range": (lo, hi)``).

    Raises:
        ValueError: on a malformed range, naming the argument and the fix.
    """
    if input_range is None:
        return None

    def as_tensor(value: Any, what: str) -> Tensor:
        t = torch.as_tensor(value, dtype=x.dtype, device=x.device).flatten()
        if t.numel() == 1:
            return t.reshape([1] * x.dim())
        if x.dim() < 2 or t.numel() != x.shape[1]:
            raise ValueError(f"`input_range` {what} has {t.numel()} values but the input has "
                             f"{x.shape[1] if x.dim() > 1 else 'no'} channels (dim 1). Fix: give one value, or one "
                             "per channel.")
        return t.reshape([1, t.numel()] + [1] * (x.dim() - 2))

    if isinstance(input_range, Mapping):
        if not {"mean", "std"} <= set(input_range):
            raise ValueError("`input_range` as a mapping needs 'mean' and 'std' (the normalisation applied to [0, 1] "
                             f"inputs), got keys {sorted(input_range)}. Fix: pass {{'mean': [...], 'std': [...]}} or "
                             "(low, high).")
        mean, std = as_tensor(input_range["mean"], "mean"), as_tensor(input_range["std"], "std")
        if bool((std <= 0).any()):
            raise ValueError("`input_range` std must be positive. Fix: pass the std of the normalisation.")
        lo, hi = input_range.get("pixel_range", (0.0, 1.0))
        low, high = (lo - mean) / std, (hi - mean) / std
    elif isinstance(input_range, Sequence) and len(input_range) == 2:
        low, high = as_tensor(input_range[0], "low"), as_tensor(input_range[1], "high")
    else:
        raise ValueError(f"`input_range` must be None, (low, high) or {{'mean': ..., 'std': ...}}, got "
                         f"{input_range!r}. Fix: e.g. (0.0, 1.0) for pixels in [0, 1].")
    # low == high pins an element (a feature constant over the data, e.g. a border pixel of
    # sklearn's digits); a box with no room anywhere, or inverted, is a mistake
    if bool((low > high).any()):
        raise ValueError(f"`input_range` needs low <= high everywhere, got low={low.flatten().tolist()}, "
                         f"high={high.flatten().tolist()}. Fix: pass (low, high) in that order.")
    if not bool((low < high).any()):
        raise ValueError(f"`input_range` needs low < high somewhere (x' could not move), got "
                         f"low={low.flatten().tolist()}, high={high.flatten().tolist()}. Fix: pass the range of "
                         "the inputs as the model receives them, or None for unbounded inputs.")
    return low, high


def is_input_range_form(input_range: Any) -> bool:
    """Whether ``input_range`` has an accepted form (``"auto"``, None, ``(low, high)`` or a mapping with
    ``mean`` and ``std``); its values are checked when it is resolved against an input."""
    if isinstance(input_range, str) or input_range is None:
        return input_range in ("auto", None)
    if isinstance(input_range, Mapping):
        return {"mean", "std"} <= set(input_range)
    return isinstance(input_range, Sequence) and not isinstance(input_range, bytes) and len(input_range) == 2
