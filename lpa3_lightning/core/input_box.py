"""The valid input box of the solver's clamp, and the default bound on one solver step
(``max_step="auto"``: 2% of the box's L2 diagonal)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal, Union

import torch
from torch import Tensor

__all__ = ["InputRange", "MaxStep", "auto_max_step", "auto_max_step_tensor", "check_max_step", "resolve_input_range"]


#: Bounds as ``(low, high)`` (floats or per-channel sequences) or a normalisation
#: ``{"mean": [...], "std": [...]}`` of inputs that lived in ``[0, 1]`` before it.
InputRange = Union[tuple[Any, Any], Mapping[str, Any], None]


def resolve_input_range(input_range: InputRange, x: Tensor, check_values: bool = True) -> tuple[Tensor, Tensor] | None:
    """Turn ``input_range`` into ``(low, high)`` tensors broadcastable to ``x``.

    Per-channel sequences apply along dim 1. A mapping ``{"mean", "std"}`` describes a
    normalisation ``(v - mean) / std`` of values that were in ``[0, 1]`` (override with a
    ``"pixel_range": (lo, hi)`` key). ``check_values=False`` skips the checks that read the
    values on the host (positive std, low <= high): for a range checked once before.

    Raises:
        ValueError: on a malformed range, naming the argument and the fix.
    """
    if input_range is None:
        return None
    shape = [1] * x.dim()

    def as_tensor(value: Any, what: str) -> Tensor:
        t = torch.as_tensor(value, dtype=x.dtype, device=x.device).flatten()
        if t.numel() == 1:
            return t.reshape([1] * x.dim())
        if x.dim() < 2 or t.numel() != x.shape[1]:
            raise ValueError(
                f"`input_range` {what} has {t.numel()} values but the input has "
                f"{x.shape[1] if x.dim() > 1 else 'no'} channels (dim 1). Fix: give one value, or one per channel."
            )
        channel_shape = list(shape)
        channel_shape[1] = t.numel()
        return t.reshape(channel_shape)

    if isinstance(input_range, Mapping):
        if not {"mean", "std"} <= set(input_range):
            raise ValueError(
                "`input_range` as a mapping needs 'mean' and 'std' (the normalisation applied to [0, 1] "
                f"inputs), got keys {sorted(input_range)}. Fix: pass {{'mean': [...], 'std': [...]}} or (low, high)."
            )
        mean, std = as_tensor(input_range["mean"], "mean"), as_tensor(input_range["std"], "std")
        if check_values and bool((std <= 0).any()):
            raise ValueError("`input_range` std must be positive. Fix: pass the std of the normalisation.")
        lo, hi = input_range.get("pixel_range", (0.0, 1.0))
        low, high = (lo - mean) / std, (hi - mean) / std
    elif isinstance(input_range, Sequence) and len(input_range) == 2:
        low, high = as_tensor(input_range[0], "low"), as_tensor(input_range[1], "high")
    else:
        raise ValueError(
            f"`input_range` must be None, (low, high) or {{'mean': ..., 'std': ...}}, got {input_range!r}."
        )
    # low == high pins an element (a feature constant over the data, e.g. a border pixel of
    # sklearn's digits); a box with no room anywhere, or inverted, is a mistake
    if check_values and bool((low > high).any()):
        raise ValueError(f"`input_range` needs low <= high everywhere, got low={low.flatten().tolist()}, "
                         f"high={high.flatten().tolist()}. Fix: pass (low, high) in that order.")
    if check_values and not bool((low < high).any()):
        raise ValueError(f"`input_range` needs low < high somewhere (x' could not move), got "
                         f"low={low.flatten().tolist()}, high={high.flatten().tolist()}. Fix: pass the range of "
                         "the inputs as the model receives them, or None for unbounded inputs.")
    return low, high


#: ``max_step="auto"``: each step at most this fraction of the input box's L2 diagonal.
AUTO_MAX_STEP_FRACTION = 0.02

#: Without a box, the box is estimated as +-2 batch standard deviations per input element.
AUTO_BOX_STDS = 4.0

MaxStep = Union[float, Literal["auto"], None]


def check_max_step(max_step: MaxStep, name: str = "max_step") -> None:
    """Raise a ValueError naming ``name`` unless ``max_step`` is None, ``"auto"`` or a positive finite number."""
    if max_step is None or max_step == "auto":
        return
    if isinstance(max_step, bool) or not isinstance(max_step, (int, float)) or not math.isfinite(max_step) \
            or max_step <= 0:
        raise ValueError(f"`{name}` must be 'auto' (default), None (unbounded, the authors' step) or a positive "
                         f"finite number, got {max_step!r}. Fix: use 'auto', or e.g. max_step=1.0.")


def auto_max_step(x: Tensor, bounds: tuple[Tensor, Tensor] | None) -> float:
    """The default step bound: 2% of the L2 diagonal of the valid input box.

    With a box ``(low, high)`` the diagonal is ``sqrt(sum over input elements of (high - low)^2)``
    (56 for 1x28x28 inputs in [-1, 1], so the bound is 1.12). Without one it is estimated from
    the batch as ``4 * sqrt(sum of per-element batch variances)`` (a box of +-2 standard
    deviations), falling back to the samples' mean L2 norm for a single or constant batch.
    Five steps then move ``x`` by at most about a tenth of the box diagonal: far enough for the
    solver to find hard positives, not enough to turn a saturated sample into noise.

    Example:
        >>> x = torch.zeros(2, 1, 28, 28)
        >>> round(auto_max_step(x, (torch.tensor(-1.0), torch.tensor(1.0))), 2)
        1.12
    """
    sample, dtype = x[:1], torch.promote_types(x.dtype, torch.float32)  # (a float64 solve stays float64)
    if bounds is not None:
        width = (bounds[1] - bounds[0]).expand_as(sample)
        diagonal = float(width.to(dtype).pow(2).sum().sqrt())
    else:
        flat = x.detach().to(dtype).flatten(1)
        diagonal = AUTO_BOX_STDS * float(flat.var(dim=0, unbiased=False).sum().sqrt()) if flat.shape[0] > 1 else 0.0
        if diagonal <= 0.0:
            diagonal = float(flat.norm(dim=1).mean())
        if diagonal <= 0.0:
            diagonal = math.sqrt(flat.shape[1])
    return AUTO_MAX_STEP_FRACTION * diagonal


def auto_max_step_tensor(x: Tensor, bounds: tuple[Tensor, Tensor] | None) -> Tensor:
    """:func:`auto_max_step` as a 0-dim tensor on ``x``'s device, computed without a host read.

    Example:
        >>> x = torch.zeros(2, 1, 28, 28)
        >>> round(float(auto_max_step_tensor(x, (torch.tensor(-1.0), torch.tensor(1.0)))), 2)
        1.12
    """
    sample, dtype = x[:1], torch.promote_types(x.dtype, torch.float32)
    if bounds is not None:
        width = (bounds[1] - bounds[0]).expand_as(sample)
        return AUTO_MAX_STEP_FRACTION * width.to(dtype).pow(2).sum().sqrt()
    flat = x.detach().to(dtype).flatten(1)
    spread = AUTO_BOX_STDS * flat.var(dim=0, unbiased=False).sum().sqrt() if flat.shape[0] > 1 \
        else flat.new_zeros(())
    # the same fallbacks as auto_max_step, chosen on the device
    norm = flat.norm(dim=1).mean()
    diagonal = torch.where(spread > 0, spread, torch.where(norm > 0, norm, torch.full_like(norm, math.sqrt(flat.shape[1]))))
    return AUTO_MAX_STEP_FRACTION * diagonal
