"""FixMatch's views (Sohn et al., NeurIPS 2020) of PIL images, their random numbers from ``torch`` (so data
loader workers are seeded by PyTorch); the strong one by default as kekmodel/FixMatch-pytorch's."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image
from torchvision import transforms

from lpa3_lightning.data.label_split import check_int

__all__ = ["Cutout", "FixMatchRandAugment", "STRONG_AUGMENTS", "eval_transform", "strong_transform",
           "weak_transform"]

_TRANSLATE_FRACTION = 0.125  # the weak view's shift: up to 12.5% of the side (FixMatch: 4 px of 32)
_MAX_RANDAUGMENT_MAGNITUDE = 30
STRONG_AUGMENTS = ("fixmatch", "torchvision")  #: the strong views :func:`strong_transform` builds
#: Padding of the weak view's crop: ``reflect`` (FixMatch's) or ``zeros`` (PES's and DivideMix's).
PADDING_MODES = {"reflect": "reflect", "zeros": "constant"}


class Cutout:
    """FixMatch's Cutout: one gray square on a PIL image, its centre uniform over the image.

    Args:
        max_fraction: without ``size``, the side is ``ceil(u * max_fraction * min(w, h))``, ``u ~ U[0, 1)``.
        fill: gray level in ``[0, 255]``.
        size: a fixed side, as the reference's ``CutoutAbs`` (both corners painted); None: drawn.

    Raises:
        ValueError: for an argument out of its range.
        TypeError: at the call, for an image that is not a PIL image.
    """

    def __init__(self, max_fraction: float = 0.5, fill: int = 127, size: int | None = None) -> None:
        if not 0.0 < float(max_fraction) <= 1.0:
            raise ValueError(f"`max_fraction` must be in (0, 1], got {max_fraction}. Fix: use 0.5 (FixMatch).")
        check_int("fill", fill, 0, "pass a gray level in [0, 255], e.g. 127.")
        if fill > 255:
            raise ValueError(f"`fill` must be in [0, 255], got {fill}. Fix: pass 127 (mid gray).")
        if size is not None:
            check_int("size", size, 1, "pass the side in pixels, e.g. 16 (FixMatch's reference), or None.")
        self.max_fraction, self.fill, self.size = float(max_fraction), int(fill), size

    def __call__(self, img: Image.Image) -> Image.Image:
        if not isinstance(img, Image.Image):
            raise TypeError(f"Cutout works on PIL images (before ToTensor), got {type(img).__name__}.")
        width, height = img.size
        pixels = np.array(img)
        if self.size is not None:
            # the reference's square: (x0, y0) clamped at 0, the far corner at the side, both painted
            side = self.size
            cx, cy = float(torch.rand(())) * width, float(torch.rand(())) * height
            x0, y0 = int(max(0.0, cx - side / 2)), int(max(0.0, cy - side / 2))
            x1, y1 = int(min(width, x0 + side)), int(min(height, y0 + side))
            pixels[y0:y1 + 1, x0:x1 + 1] = self.fill
            return Image.fromarray(pixels)
        side = math.ceil(float(torch.rand(())) * self.max_fraction * min(width, height))
        if side <= 0:
            return img
        cx, cy = int(torch.randint(width, ())), int(torch.randint(height, ()))
        x0, y0 = max(cx - side // 2, 0), max(cy - side // 2, 0)
        x1, y1 = min(cx - side // 2 + side, width), min(cy - side // 2 + side, height)
        pixels[y0:y1, x0:x1] = self.fill
        return Image.fromarray(pixels)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(max_fraction={self.max_fraction}, fill={self.fill})"


class FixMatchRandAugment:
    """FixMatch's RandAugment: ``num_ops`` of :attr:`OPS` drawn with replacement, each applied with probability
    0.5 at a magnitude drawn from ``1 .. magnitude - 1`` (of 10, ``magnitude`` in ``[2, 10]``; see :meth:`apply`).

    Raises:
        ValueError: for an argument out of its range.
        TypeError: at the call, for an image that is not a PIL image.
    """

    OPS = ("autocontrast", "brightness", "color", "contrast", "equalize", "identity", "posterize", "rotate",
           "sharpness", "shear_x", "shear_y", "solarize", "translate_x", "translate_y")

    def __init__(self, num_ops: int = 2, magnitude: int = 10) -> None:
        check_int("num_ops", num_ops, 1, "pass the number of operations per image, e.g. 2 (FixMatch).")
        check_int("magnitude", magnitude, 2, "pass the magnitude bound, e.g. 10 (FixMatch).")
        if magnitude > 10:
            raise ValueError(f"`magnitude` must be in [2, 10], got {magnitude}. Fix: use 10 (FixMatch).")
        self.num_ops, self.magnitude = int(num_ops), int(magnitude)

    def __call__(self, img: Image.Image) -> Image.Image:
        if not isinstance(img, Image.Image):
            raise TypeError(f"FixMatchRandAugment works on PIL images (before ToTensor), got {type(img).__name__}.")
        for _ in range(self.num_ops):
            op = self.OPS[int(torch.randint(len(self.OPS), ()))]
            v = int(torch.randint(1, self.magnitude, ()))
            if float(torch.rand(())) < 0.5:
                img = self.apply(img, op, v)
        return img

    @staticmethod
    def apply(img: Image.Image, op: str, v: int) -> Image.Image:
        """One operation at magnitude ``v``, scaled as the reference (the signed ones draw their sign here)."""
        from torchvision.transforms import InterpolationMode
        from torchvision.transforms import functional as F

        def signed(value: float) -> float:
            return -value if float(torch.rand(())) < 0.5 else value
        nearest = InterpolationMode.NEAREST
        unsigned = {"autocontrast": lambda: F.autocontrast(img), "equalize": lambda: F.equalize(img),
                    "brightness": lambda: F.adjust_brightness(img, 0.09 * v + 0.05),
                    "color": lambda: F.adjust_saturation(img, 0.09 * v + 0.05),
                    "contrast": lambda: F.adjust_contrast(img, 0.09 * v + 0.05),
                    "sharpness": lambda: F.adjust_sharpness(img, 0.09 * v + 0.05), "identity": lambda: img}
        if op in unsigned:
            return unsigned[op]()
        if op == "posterize":
            return F.posterize(img, 4 + int(v * 4 / 10))
        if op == "rotate":
            return F.rotate(img, signed(float(int(v * 30 / 10))), interpolation=nearest, fill=0)
        if op in ("shear_x", "shear_y"):
            degrees = math.degrees(math.atan(signed(v * 0.3 / 10)))
            return F.affine(img, angle=0.0, translate=[0, 0], scale=1.0, shear=[degrees, 0.0] if op == "shear_x" else
                            [0.0, degrees], interpolation=nearest, fill=0, center=[0, 0])
        if op == "solarize":
            return F.solarize(img, 256 - int(v * 256 / 10))
        if op in ("translate_x", "translate_y"):
            pixels = int(signed(v * 0.3 / 10) * img.size[0 if op == "translate_x" else 1])
            return F.affine(img, angle=0.0, translate=[pixels, 0] if op == "translate_x" else [0, pixels], scale=1.0,
                            shear=[0.0, 0.0], interpolation=nearest, fill=0)
        raise ValueError(f"Unknown operation {op!r}. Fix: use one of {FixMatchRandAugment.OPS}.")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(num_ops={self.num_ops}, magnitude={self.magnitude})"


def _weak_ops(image_size: int, flip: bool, padding_mode: str = "reflect") -> list[Callable[[Any], Any]]:
    check_int("image_size", image_size, 1, "pass the side of the (square) images, e.g. 28 or 32.")
    if padding_mode not in PADDING_MODES:
        raise ValueError(f"`padding_mode` must be one of {sorted(PADDING_MODES)}, got {padding_mode!r}. Fix: use "
                         "'reflect' (FixMatch's reference) or 'zeros' (PES's and DivideMix's).")
    padding = int(image_size * _TRANSLATE_FRACTION + 0.5)
    ops: list[Callable[[Any], Any]] = [transforms.RandomHorizontalFlip()] if flip else []
    ops.append(transforms.RandomCrop(image_size, padding=padding, padding_mode=PADDING_MODES[padding_mode]))
    return ops


def _normalize_ops(mean: Sequence[float], std: Sequence[float]) -> list[Callable[[Any], Any]]:
    if len(mean) != len(std) or not len(mean) or any(s <= 0 for s in std):
        raise ValueError(f"`mean` and `std` must be per-channel sequences of the same length with std > 0, got "
                         f"mean={list(mean)}, std={list(std)}. Fix: pass e.g. mean=[0.5], std=[0.5].")
    return [transforms.ToTensor(), transforms.Normalize(mean=list(mean), std=list(std))]


def weak_transform(mean: Sequence[float], std: Sequence[float], image_size: int,
                   flip: bool = True, padding_mode: str = "reflect") -> transforms.Compose:
    """FixMatch's weak view: random flip, random shift (a crop of the image padded by 12.5%), normalisation.

    Args:
        mean: per-channel mean of [0, 1] pixels.
        std: per-channel standard deviation.
        image_size: side of the square images.
        flip: random horizontal flip.
        padding_mode: ``"reflect"`` (FixMatch's) or ``"zeros"`` (PES's and DivideMix's).

    Raises:
        ValueError: for an argument out of its range.
    """
    return transforms.Compose([*_weak_ops(image_size, flip, padding_mode), *_normalize_ops(mean, std)])


def strong_transform(mean: Sequence[float], std: Sequence[float], image_size: int, flip: bool = True,
                     num_ops: int = 2, magnitude: int = 10, cutout: float = 0.5,
                     augment: str = "fixmatch", cutout_size: int = 16) -> transforms.Compose:
    """FixMatch's strong view: the weak view, RandAugment, Cutout, normalisation.

    Args:
        mean: per-channel mean of [0, 1] pixels.
        std: per-channel standard deviation.
        image_size: side of the square images.
        flip: random horizontal flip.
        num_ops: RandAugment operations per image.
        magnitude: ``"fixmatch"``: the magnitude draw's exclusive end, in ``[2, 10]``; else in ``[0, 30]``.
        cutout: ``"torchvision"`` only: largest Cutout side as a fraction of the image side.
        augment: ``"fixmatch"`` (:class:`FixMatchRandAugment`, a Cutout of side ``cutout_size``) or
            ``"torchvision"`` (``RandAugment``, a Cutout of random side).
        cutout_size: ``"fixmatch"`` only: the Cutout side in pixels.

    Raises:
        ValueError: for an argument out of its range.
    """
    if augment not in STRONG_AUGMENTS:
        raise ValueError(f"`strong_augment` must be one of {STRONG_AUGMENTS}, got {augment!r}. Fix: use 'fixmatch' "
                         "(FixMatch's RandAugment, the reference) or 'torchvision'.")
    check_int("num_ops", num_ops, 0, "pass the number of RandAugment operations, e.g. 2.")
    if augment == "fixmatch":
        return transforms.Compose([*_weak_ops(image_size, flip), FixMatchRandAugment(num_ops, magnitude),
                                   Cutout(fill=127, size=cutout_size), *_normalize_ops(mean, std)])
    check_int("magnitude", magnitude, 0, "pass a RandAugment magnitude in [0, 30], e.g. 10.")
    if magnitude > _MAX_RANDAUGMENT_MAGNITUDE:
        raise ValueError(f"`magnitude` must be in [0, {_MAX_RANDAUGMENT_MAGNITUDE}], got {magnitude}. Fix: use 10.")
    augment_ops = [transforms.RandAugment(num_ops=num_ops, magnitude=magnitude), Cutout(cutout)]
    return transforms.Compose([*_weak_ops(image_size, flip), *augment_ops, *_normalize_ops(mean, std)])


def eval_transform(mean: Sequence[float], std: Sequence[float]) -> transforms.Compose:
    """Evaluation view: ``ToTensor`` and ``Normalize`` only."""
    return transforms.Compose(_normalize_ops(mean, std))
