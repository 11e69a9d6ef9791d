"""The views of FixMatch (Sohn et al., NeurIPS 2020): weak (flip and shift), strong (+ RandAugment
and Cutout), and the evaluation view (normalisation only), for 1- and 3-channel images.

The strong view is FixMatch's own RandAugment by default (:class:`FixMatchRandAugment`), as the
reference implementation the LP-A3 authors built on runs it (kekmodel/FixMatch-pytorch
``dataset/randaugment.py``, ``RandAugmentMC(n=2, m=10)`` and ``fixmatch_augment_pool``; the LP-A3
authors' copy is the same file): two operations drawn with replacement from 14, each applied
with probability 0.5 at a magnitude drawn from 1 to 9 (of 10), then a gray Cutout square of a
fixed size 16 (``CutoutAbs(img, 16)``, 17 x 17 pixels as it paints them). ``strong_augment="torchvision"`` keeps the earlier view: torchvision's
``RandAugment(2, 10)`` (always applied, one fixed magnitude) and a Cutout of random size.
Written with torchvision's operations from that description, not from the reference's code.
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

__all__ = ["Cutout", "FixMatchRandAugment", "STRONG_AUGMENTS", "eval_transform", "strong_transform",
           "weak_transform"]

# Translation of the weak view: up to 12.5% of the side (FixMatch: 4 px of 32).
_TRANSLATE_FRACTION = 0.125
_MAX_RANDAUGMENT_MAGNITUDE = 30
#: The strong views :func:`strong_transform` builds.
STRONG_AUGMENTS = ("fixmatch", "torchvision")
#: Padding of the weak view's random crop: ``reflect`` (FixMatch's reference) or ``zeros``
#: (``RandomCrop(32, padding=4)``, the PES and DivideMix references').
PADDING_MODES = {"reflect": "reflect", "zeros": "constant"}


# ----------------------------------------------------------------------------------------
# Transforms
# ----------------------------------------------------------------------------------------
class Cutout:
    """FixMatch's Cutout: one gray square on a PIL image, of a fixed ``size`` (the reference
    implementation's ``CutoutAbs(img, 16)``: with both corners painted, 17 x 17 pixels where it
    fits, clipped at the right and bottom edges, shifted inward at the left and top) or of a
    random side up to ``max_fraction`` of the image.

    Without ``size`` the side is ``ceil(u * max_fraction * min(width, height))`` with
    ``u ~ U[0, 1)`` (the FixMatch paper's description); the centre is uniform over the image and
    the square is clipped at the borders. Random numbers come from ``torch`` so that data loader
    workers are seeded by PyTorch.

    Args:
        max_fraction: largest side as a fraction of the image side, in ``(0, 1]`` (paper: 0.5).
        fill: gray level in ``[0, 255]`` written into every channel (paper: gray, 127).
        size: a fixed side in pixels (FixMatch's reference: 16 at every image size); None draws it.

    Example:
        >>> img = Image.new("L", (28, 28), color=0)
        >>> out = Cutout(0.5)(img)
        >>> out.size
        (28, 28)
    """

    def __init__(self, max_fraction: float = 0.5, fill: int = 127, size: int | None = None) -> None:
        if not 0.0 < float(max_fraction) <= 1.0:
            raise ValueError(f"`max_fraction` must be in (0, 1], got {max_fraction}. Fix: use 0.5 (FixMatch).")
        check_int("fill", fill, 0, "pass a gray level in [0, 255], e.g. 127.")
        if fill > 255:
            raise ValueError(f"`fill` must be in [0, 255], got {fill}. Fix: pass 127 (mid gray).")
        if size is not None:
            check_int("size", size, 1, "pass the side in pixels, e.g. 16 (FixMatch's reference), or None.")
        self.max_fraction = float(max_fraction)
        self.fill = int(fill)
        self.size = size

    def __call__(self, img: Image.Image) -> Image.Image:
        if not isinstance(img, Image.Image):
            raise TypeError(f"Cutout works on PIL images (before ToTensor), got {type(img).__name__}.")
        width, height = img.size
        pixels = np.array(img)
        if self.size is not None:
            # the reference's square: a centre drawn over the image, the corner (x0, y0) clamped at
            # 0 and the far corner at the side, both corners painted (PIL's rectangle includes them:
            # 17 x 17 pixels where the square fits, shifted inward at the left and top edges)
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
    """FixMatch's RandAugment on a PIL image: ``num_ops`` operations drawn with replacement from
    FixMatch's 14, each applied with probability 0.5 at a magnitude ``v`` drawn uniformly from
    ``1 .. magnitude - 1`` (of ``10``).

    The operations and their strength at magnitude ``v`` (FixMatch's augmentation pool, as the
    reference implementation scales it): AutoContrast; Brightness, Color (saturation),
    Contrast and Sharpness with the factor ``0.09 v + 0.05``; Equalize; Identity; Posterize to
    ``4 + int(0.4 v)`` bits; Rotate by ``3 v`` degrees; ShearX / ShearY by ``0.03 v`` (about
    the top-left corner); Solarize above ``256 - int(25.6 v)``; TranslateX / TranslateY by
    ``int(0.03 v * side)`` pixels. Rotations, shears and translations take a random sign and
    fill with black, with nearest-neighbour sampling. Random numbers come from ``torch``, so data
    loader workers are seeded by PyTorch.

    Args:
        num_ops: operations per image (FixMatch: 2).
        magnitude: the exclusive upper end of the magnitude draw, in ``[2, 10]`` (FixMatch: 10).

    Example:
        >>> out = FixMatchRandAugment()(Image.new("RGB", (32, 32), color=(90, 30, 200)))
        >>> out.size, out.mode
        ((32, 32), 'RGB')
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
        """One operation at magnitude ``v`` (the signed ones draw their sign here)."""
        from torchvision.transforms import InterpolationMode
        from torchvision.transforms import functional as F

        def signed(value: float) -> float:
            return -value if float(torch.rand(())) < 0.5 else value

        nearest = InterpolationMode.NEAREST
        factor = 0.09 * v + 0.05
        if op == "autocontrast":
            return F.autocontrast(img)
        if op == "brightness":
            return F.adjust_brightness(img, factor)
        if op == "color":
            return F.adjust_saturation(img, factor)
        if op == "contrast":
            return F.adjust_contrast(img, factor)
        if op == "sharpness":
            return F.adjust_sharpness(img, factor)
        if op == "equalize":
            return F.equalize(img)
        if op == "identity":
            return img
        if op == "posterize":
            return F.posterize(img, 4 + int(v * 4 / 10))
        if op == "rotate":
            return F.rotate(img, signed(float(int(v * 30 / 10))), interpolation=nearest, fill=0)
        if op in ("shear_x", "shear_y"):
            degrees = math.degrees(math.atan(signed(v * 0.3 / 10)))
            shear = [degrees, 0.0] if op == "shear_x" else [0.0, degrees]
            return F.affine(img, angle=0.0, translate=[0, 0], scale=1.0, shear=shear, interpolation=nearest, fill=0,
                            center=[0, 0])
        if op == "solarize":
            return F.solarize(img, 256 - int(v * 256 / 10))
        if op in ("translate_x", "translate_y"):
            side = img.size[0] if op == "translate_x" else img.size[1]
            pixels = int(signed(v * 0.3 / 10) * side)
            shift = [pixels, 0] if op == "translate_x" else [0, pixels]
            return F.affine(img, angle=0.0, translate=shift, scale=1.0, shear=[0.0, 0.0], interpolation=nearest,
                            fill=0)
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
    """FixMatch's weak view: random horizontal flip, random translation, then normalisation.

    The translation is a ``RandomCrop`` of the original side from the image padded by 12.5%
    of the side (4 px at 32, 4 px at 28, 12 px at 96), by reflection (FixMatch's reference) or
    with zeros (``padding_mode="zeros"``: PES's and DivideMix's ``RandomCrop(32, padding=4)``).

    Args:
        mean: per-channel mean of [0, 1] pixels (1 value for grayscale, 3 for RGB).
        std: per-channel standard deviation.
        image_size: side of the square input images.
        flip: random horizontal flip (turn off for digits and for labels that name a side).
        padding_mode: ``"reflect"`` or ``"zeros"``.

    Returns:
        A transform from a PIL image to a normalised float tensor ``(C, H, W)``.

    Example:
        >>> t = weak_transform([0.5], [0.5], 28, flip=False)
        >>> tuple(t(Image.new("L", (28, 28))).shape)
        (1, 28, 28)
    """
    return transforms.Compose([*_weak_ops(image_size, flip, padding_mode), *_normalize_ops(mean, std)])


def strong_transform(mean: Sequence[float], std: Sequence[float], image_size: int, flip: bool = True,
                     num_ops: int = 2, magnitude: int = 10, cutout: float = 0.5,
                     augment: str = "fixmatch", cutout_size: int = 16) -> transforms.Compose:
    """FixMatch's strong view: the weak view, RandAugment, Cutout, then normalisation.

    Args:
        mean: per-channel mean of [0, 1] pixels.
        std: per-channel standard deviation.
        image_size: side of the square input images.
        flip: random horizontal flip as in :func:`weak_transform`.
        num_ops: RandAugment operations per image (FixMatch: 2).
        magnitude: ``augment="fixmatch"``: the exclusive upper end of the per-operation magnitude
            draw, in ``[2, 10]`` (FixMatch: 10); ``"torchvision"``: torchvision's fixed magnitude
            in ``[0, 30]`` (10 here).
        cutout: ``"torchvision"`` only: largest Cutout side as a fraction of the image side.
        augment: ``"fixmatch"`` (default): :class:`FixMatchRandAugment` and a Cutout of a fixed
            ``cutout_size``, FixMatch's reference; ``"torchvision"``: ``RandAugment(num_ops,
            magnitude)`` and a Cutout of random side up to ``cutout`` (the earlier view).
        cutout_size: ``"fixmatch"`` only: the Cutout side in pixels (16, at every image size).

    Returns:
        A transform from a PIL image (``L`` or ``RGB``) to a normalised float tensor.

    Example:
        >>> t = strong_transform([0.5] * 3, [0.5] * 3, 32)
        >>> tuple(t(Image.new("RGB", (32, 32))).shape)
        (3, 32, 32)
    """
    if augment not in STRONG_AUGMENTS:
        raise ValueError(f"`strong_augment` must be one of {STRONG_AUGMENTS}, got {augment!r}. Fix: use 'fixmatch' "
                         "(FixMatch's RandAugment, the reference) or 'torchvision'.")
    check_int("num_ops", num_ops, 0, "pass the number of RandAugment operations, e.g. 2.")
    if augment == "fixmatch":
        return transforms.Compose([
            *_weak_ops(image_size, flip),
            FixMatchRandAugment(num_ops, magnitude),
            Cutout(fill=127, size=cutout_size),
            *_normalize_ops(mean, std),
        ])
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
