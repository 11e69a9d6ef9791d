"""Pictures of what LP-A3 does: x, x' and |x' - x| side by side, as the paper's Fig. 3 (no Lightning)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torchvision.utils import make_grid, save_image

from lpa3_lightning.core.checks import check_int

__all__ = ["comparison_grid", "difference_peak", "save_comparison_grid", "to_unit_range"]


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


def _unit_rows(x: Tensor, x_adv: Tensor, normalization: Mapping[str, Any] | None) -> tuple[Tensor, Tensor]:
    """Both batches in [0, 1] pixel units, on one scale (checked to be image batches of one shape)."""
    if x.shape != x_adv.shape or x.dim() != 4 or x.shape[1] not in (1, 3):
        raise ValueError(f"`x` and `x_adv` must be image batches (N, 1 or 3, h, w) of one shape, got "
                         f"{tuple(x.shape)} and {tuple(x_adv.shape)}. Fix: pass images (for other inputs plot "
                         "the perceptual distance instead).")
    x, x_adv = x.detach().float().cpu(), x_adv.detach().float().cpu()
    both = torch.cat([x, x_adv])  # one scale for both rows: an unchanged pixel the same grey in both
    bounds = None if normalization is not None else (both.min(), both.max())
    return to_unit_range(x, normalization, bounds), to_unit_range(x_adv, normalization, bounds)


def difference_peak(x: Tensor, x_adv: Tensor, normalization: Mapping[str, Any] | None = None) -> float:
    """The largest ``|x' - x|`` of the batch in the grid's [0, 1] pixel units: the white of
    :func:`comparison_grid`'s difference row (0.0 when nothing changed)."""
    clean, augmented = _unit_rows(x, x_adv, normalization)
    return float((augmented - clean).abs().max()) if clean.numel() else 0.0


def comparison_grid(x: Tensor, x_adv: Tensor, normalization: Mapping[str, Any] | None = None,
                    padding: int = 2, *, peak: float | None = None, scale: int = 1,
                    labels: Sequence[str] | None = None, caption: str | None = None) -> Tensor:
    """A ``(3, H, W)`` float image in [0, 1]: a row of inputs, one of hard positives (on one grey scale),
    and one of ``|x' - x|`` with ``peak`` drawn white for every image (a brighter column: a larger change).

    Args:
        x, x_adv: ``(N, C, h, w)`` the inputs and their hard positives, C in {1, 3}.
        normalization: ``{"mean": [...], "std": [...]}`` the inputs were normalised with; None: the
            batches' joint range is black to white.
        padding: pixels between the images (before ``scale``).
        peak: the difference drawn white, in [0, 1] pixel units; None: the batch's largest (:func:`difference_peak`).
        scale: each pixel drawn as ``scale x scale`` pixels.
        labels: one text per image (lines split at ``\\n``), written under its column; cut to the column.
        caption: a text under the whole grid (wrapped to its width), e.g. which ``peak`` it was.

    Returns:
        ``(3, scale * (3 * (h + padding) + padding) + T, scale * (N * (w + padding) + padding))``, ``T`` the
        height of the text (0 without ``labels`` and ``caption``).

    Raises:
        ValueError: for batches that are not images of one shape, or a bad ``peak``, ``scale`` or ``labels``.

    Example:
        >>> tuple(comparison_grid(torch.zeros(4, 1, 28, 28), torch.ones(4, 1, 28, 28) * 0.1, scale=2).shape)
        (3, 184, 244)
    """
    check_int(scale, "scale", 1, "e.g. scale=4 for 28 px images.")
    if peak is not None and not (isinstance(peak, (int, float)) and math.isfinite(peak) and peak > 0):
        raise ValueError(f"`peak` must be a number > 0 (the difference drawn white, in [0, 1] pixel units), got "
                         f"{peak!r}. Fix: pass e.g. difference_peak(x, x_adv, normalization), or None.")
    if labels is not None and len(labels) != x.shape[0]:
        raise ValueError(f"`labels` must hold one text per image ({x.shape[0]} images), got {len(labels)}. Fix: "
                         "pass one string per image, or None.")
    clean, augmented = _unit_rows(x, x_adv, normalization)
    diff = (augmented - clean).abs()
    white = (float(diff.max()) if diff.numel() else 0.0) if peak is None else float(peak)
    diff = (diff / white).clamp(0, 1) if white > 0 else torch.zeros_like(diff)
    grid = make_grid(torch.cat([clean, augmented, diff]), nrow=x.shape[0], padding=padding, pad_value=1.0)
    if scale > 1:
        grid = grid.repeat_interleave(scale, dim=1).repeat_interleave(scale, dim=2)
    if labels is None and not caption:
        return grid
    return torch.cat([grid, _text_strip(grid.shape[2], (x.shape[3] + padding) * scale, padding * scale,
                                        list(labels or []), caption or "", scale)], dim=1)


def _text_strip(width: int, cell: int, offset: int, labels: list[str], caption: str, scale: int) -> Tensor:
    """A white ``(3, T, width)`` strip: ``labels[i]`` under column ``i`` (``cell`` pixels wide, the
    first starting at ``offset``), then ``caption`` wrapped to the width."""
    from PIL import Image, ImageDraw, ImageFont

    try:
        font = ImageFont.load_default(size=min(10 + 2 * (scale - 1), 18))
    except TypeError:  # (Pillow < 10.1: one bitmap size)
        font = ImageFont.load_default()
    draw = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    line = draw.textbbox((0, 0), "Ag|", font=font)[3] + 2

    def fit(text: str, room: int) -> str:
        while text and draw.textlength(text, font=font) > room:
            text = text[:-1]
        return text

    words, lines = caption.split(), []
    while words:  # greedy wrap
        take = 1
        while take < len(words) and draw.textlength(" ".join(words[:take + 1]), font=font) <= width - 2 * offset:
            take += 1
        lines.append(fit(" ".join(words[:take]), width - 2 * offset))
        words = words[take:]
    label_lines = max((len(text.split("\n")) for text in labels), default=0)
    image = Image.new("RGB", (width, (label_lines + len(lines)) * line + 4), "white")
    draw = ImageDraw.Draw(image)
    for i, text in enumerate(labels):
        for j, part in enumerate(text.split("\n")):
            draw.text((offset + i * cell, 2 + j * line), fit(part, cell - offset), fill="black", font=font)
    for j, part in enumerate(lines):
        draw.text((offset, 2 + (label_lines + j) * line), part, fill="black", font=font)
    return torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1).float() / 255


def save_comparison_grid(path: str | Path, x: Tensor, x_adv: Tensor,
                         normalization: Mapping[str, Any] | None = None, **options: Any) -> Path:
    """Write :func:`comparison_grid` as a PNG and return its path (``options``: its keyword arguments)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_image(comparison_grid(x, x_adv, normalization, **options), path)
    return path
