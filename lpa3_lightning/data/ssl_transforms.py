"""The views of FixMatch (Sohn et al., NeurIPS 2020): weak (flip and shift), strong (+ RandAugment
and Cutout), and the evaluation view (normalisation only), for 1- and 3-channel images.

Written from the FixMatch paper's description, not from its code.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image
from torchvision import transforms

from lpa3_lightning.data.label_split import check_int

__all__ = ["Cutout", "eval_transform", "strong_transform", "weak_transform"]

# Translation of the weak view: up to 12.5% of the side (FixMatch: 4 px of 32).
_TRANSLATE_FRACTION = 0.125
_MAX_RANDAUGMENT_MAGNITUDE = 30


# ----------------------------------------------------------------------------------------
# Transforms
# ----------------------------------------------------------------------------------------
class Cutout:
    """FixMatch's Cutout: one gray square of side up to ``max_fraction`` of the image, on a PIL image.

    The side is ``ceil(u * max_fraction * min(width, height))`` with ``u ~ U[0, 1)``; the
    centre is uniform over the image and the square is clipped at the borders. Random numbers
    come from ``torch`` so that data loader workers are seeded by PyTorch.

    Args:
        max_fraction: largest side as a fraction of the image side, in ``(0, 1]`` (paper: 0.5).
        fill: gray level in ``[0, 255]`` written into every channel (paper: gray, 127).

    Example:
        >>> img = Image.new("L", (28, 28), color=0)
        >>> out = Cutout(0.5)(img)
        >>> out.size
        (28, 28)
    """

    def __init__(self, max_fraction: float = 0.5, fill: int = 127) -> None:
        if not 0.0 < float(max_fraction) <= 1.0:
            raise ValueError(f"`max_fraction` must be in (0, 1], got {max_fraction}. Fix: use 0.5 (FixMatch).")
        check_int("fill", fill, 0, "pass a gray level in [0, 255], e.g. 127.")
        if fill > 255:
            raise ValueError(f"`fill` must be in [0, 255], got {fill}. Fix: pass 127 (mid gray).")
        self.max_fraction = float(max_fraction)
        self.fill = int(fill)

    def __call__(self, img: Image.Image) -> Image.Image:
        if not isinstance(img, Image.Image):
            raise TypeError(f"Cutout works on PIL images (before ToTensor), got {type(img).__name__}.")
        width, height = img.size
        side = math.ceil(float(torch.rand(())) * self.max_fraction * min(width, height))
        if side <= 0:
            return img
        cx, cy = int(torch.randint(width, ())), int(torch.randint(height, ()))
        x0, y0 = max(cx - side // 2, 0), max(cy - side // 2, 0)
        x1, y1 = min(cx - side // 2 + side, width), min(cy - side // 2 + side, height)
        pixels = np.array(img)
        pixels[y0:y1, x0:x1] = self.fill
        return Image.fromarray(pixels)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(max_fraction={self.max_fraction}, fill={self.fill})"


def _weak_ops(image_size: int, flip: bool) -> list[Callable[[Any], Any]]:
    check_int("image_size", image_size, 1, "pass the side of the (square) images, e.g. 28 or 32.")
    padding = int(image_size * _TRANSLATE_FRACTION + 0.5)
    ops: list[Callable[[Any], Any]] = [transforms.RandomHorizontalFlip()] if flip else []
    ops.append(transforms.RandomCrop(image_size, padding=padding, padding_mode="reflect"))
    return ops


def _normalize_ops(mean: Sequence[float], std: Sequence[float]) -> list[Callable[[Any], Any]]:
    if len(mean) != len(std) or not len(mean) or any(s <= 0 for s in std):
        raise ValueError(f"`mean` and `std` must be per-channel sequences of the same length with std > 0, got "
                         f"mean={list(mean)}, std={list(std)}. Fix: pass e.g. mean=[0.5], std=[0.5].")
    return [transforms.ToTensor(), transforms.Normalize(mean=list(mean), std=list(std))]


def weak_transform(mean: Sequence[float], std: Sequence[float], image_size: int,
                   flip: bool = True) -> transforms.Compose:
    """FixMatch's weak view: random horizontal flip, random translation, then normalisation.

    The translation is a ``RandomCrop`` of the original side from the image padded by 12.5%
    of the side with reflection (4 px at 32, 4 px at 28, 12 px at 96).

    Args:
        mean: per-channel mean of [0, 1] pixels (1 value for grayscale, 3 for RGB).
        std: per-channel standard deviation.
        image_size: side of the square input images.
        flip: random horizontal flip (turn off for digits and for labels that name a side).

    Returns:
        A transform from a PIL image to a normalised float tensor ``(C, H, W)``.

    Example:
        >>> t = weak_transform([0.5], [0.5], 28, flip=False)
        >>> tuple(t(Image.new("L", (28, 28))).shape)
        (1, 28, 28)
    """
    return transforms.Compose([*_weak_ops(image_size, flip), *_normalize_ops(mean, std)])


def strong_transform(mean: Sequence[float], std: Sequence[float], image_size: int, flip: bool = True,
                     num_ops: int = 2, magnitude: int = 10, cutout: float = 0.5) -> transforms.Compose:
    """FixMatch's strong view: the weak view, ``RandAugment``, ``Cutout``, then normalisation.

    Args:
        mean: per-channel mean of [0, 1] pixels.
        std: per-channel standard deviation.
        image_size: side of the square input images.
        flip: random horizontal flip as in :func:`weak_transform`.
        num_ops: RandAugment operations per image (FixMatch: 2).
        magnitude: RandAugment magnitude in ``[0, 30]`` (10 here, torchvision's scale).
        cutout: largest Cutout side as a fraction of the image side (FixMatch: 0.5).

    Returns:
        A transform from a PIL image (``L`` or ``RGB``) to a normalised float tensor.

    Example:
        >>> t = strong_transform([0.5] * 3, [0.5] * 3, 32)
        >>> tuple(t(Image.new("RGB", (32, 32))).shape)
        (3, 32, 32)
    """
    check_int("num_ops", num_ops, 0, "pass the number of RandAugment operations, e.g. 2.")
    check_int("magnitude", magnitude, 0, "pass a RandAugment magnitude in [0, 30], e.g. 10.")
    if magnitude > _MAX_RANDAUGMENT_MAGNITUDE:
        raise ValueError(f"`magnitude` must be in [0, {_MAX_RANDAUGMENT_MAGNITUDE}], got {magnitude}. Fix: use 10.")
    return transforms.Compose([
        *_weak_ops(image_size, flip),
        transforms.RandAugment(num_ops=num_ops, magnitude=magnitude),
        Cutout(cutout),
        *_normalize_ops(mean, std),
    ])


def eval_transform(mean: Sequence[float], std: Sequence[float]) -> transforms.Compose:
    """Evaluation view: ``ToTensor`` and ``Normalize`` only.

    Example:
        >>> float(eval_transform([0.5], [0.5])(Image.new("L", (2, 2), color=255)).max())
        1.0
    """
    return transforms.Compose(_normalize_ops(mean, std))
