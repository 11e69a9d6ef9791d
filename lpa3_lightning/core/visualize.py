"""Pictures of what LP-A3 does: x, x' and |x' - x| side by side (no Lightning).

The paper shows hard positives next to the clean images (Fig. 3); this module builds the same
kind of grid for any image batch: row 1 the inputs, row 2 the augmented inputs, row 3 the
absolute difference, each difference stretched to its own [0, 1] so that small changes are
visible (the caption of a logged grid says so).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torchvision.utils import make_grid, save_image

__all__ = ["comparison_grid", "save_comparison_grid", "to_unit_range"]


def to_unit_range(x: Tensor, normalization: Mapping[str, Sequence[float]] | None = None,
                  bounds: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """Undo a ``{"mean", "std"}`` normalisation into [0, 1], or map ``bounds = (low, high)`` to [0, 1]."""
    if normalization is not None:
        shape = [1, -1] + [1] * (x.dim() - 2)
        mean = torch.as_tensor(normalization["mean"], dtype=x.dtype, device=x.device).view(shape)
        std = torch.as_tensor(normalization["std"], dtype=x.dtype, device=x.device).view(shape)
        return (x * std + mean).clamp(0, 1)
    low, high = (x.min(), x.max()) if bounds is None else bounds
    return ((x - low) / (high - low + 1e-12)).clamp(0, 1)


def comparison_grid(x: Tensor, x_adv: Tensor, normalization: Mapping[str, Any] | None = None,
                    padding: int = 2) -> Tensor:
    """A ``(3, H, W)`` float image in [0, 1]: inputs, hard positives and stretched differences.

    Shape:
        - x, x_adv: ``(N, C, h, w)`` with C in {1, 3}.
        - output: ``(3, 3 * (h + padding) + padding, N * (w + padding) + padding)``.

    Example:
        >>> grid = comparison_grid(torch.zeros(4, 1, 28, 28), torch.ones(4, 1, 28, 28) * 0.1)
        >>> tuple(grid.shape)
        (3, 92, 122)
    """
    if x.shape != x_adv.shape or x.dim() != 4 or x.shape[1] not in (1, 3):
        raise ValueError(f"`x` and `x_adv` must be image batches (N, 1 or 3, h, w) of one shape, got "
                         f"{tuple(x.shape)} and {tuple(x_adv.shape)}. Fix: pass images (for other inputs plot "
                         "the perceptual distance instead).")
    x, x_adv = x.detach().float().cpu(), x_adv.detach().float().cpu()
    # One common scale for both rows (without a normalisation: the joint min and max), so an
    # unchanged pixel shows the same grey in both and a zero difference.
    both = torch.cat([x, x_adv])
    bounds = None if normalization is not None else (both.min(), both.max())
    clean = to_unit_range(x, normalization, bounds)
    augmented = to_unit_range(x_adv, normalization, bounds)
    diff = (augmented - clean).abs()
    peak = diff.flatten(1).amax(dim=1).clamp_min(1e-12).view(-1, 1, 1, 1)
    rows = torch.cat([clean, augmented, diff / peak])
    return make_grid(rows, nrow=x.shape[0], padding=padding, pad_value=1.0)


def save_comparison_grid(path: str | Path, x: Tensor, x_adv: Tensor,
                         normalization: Mapping[str, Any] | None = None) -> Path:
    """Write :func:`comparison_grid` as a PNG and return its path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_image(comparison_grid(x, x_adv, normalization), path)
    return path
