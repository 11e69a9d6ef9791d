"""FixMatch's views: the strong one against its reference's definition (kekmodel/FixMatch-pytorch at 040be3b,
dataset/randaugment.py, which the LP-A3 authors copied: RandAugmentMC lines 205-220,
fixmatch_augment_pool lines 147-163, the operations lines 20-136), computed independently with
PIL here; the weak one's padding; both for gray and RGB images."""

from __future__ import annotations

import math

import numpy as np
import PIL.ImageEnhance
import PIL.ImageOps
import pytest
import torch
from PIL import Image

from lpa3_lightning.data import SemiSupervisedDataModule
from lpa3_lightning.data.ssl_transforms import Cutout, FixMatchRandAugment, strong_transform, weak_transform


def _image(mode: str = "RGB", side: int = 32, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    shape = (side, side, 3) if mode == "RGB" else (side, side)
    return Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8))


def _same(a: Image.Image, b: Image.Image) -> bool:
    return np.array_equal(np.asarray(a), np.asarray(b))


# the reference's parameters at magnitude v: (max_v, bias) of fixmatch_augment_pool, scaled by v / 10
ENHANCERS = {"brightness": PIL.ImageEnhance.Brightness, "color": PIL.ImageEnhance.Color,
             "contrast": PIL.ImageEnhance.Contrast, "sharpness": PIL.ImageEnhance.Sharpness}


@pytest.mark.parametrize("v", [1, 5, 9])
def test_each_unsigned_operation_is_the_references(v):
    img = _image()
    for op, enhancer in ENHANCERS.items():  # factor v * 0.9 / 10 + 0.05
        assert _same(FixMatchRandAugment.apply(img, op, v), enhancer(img).enhance(v * 0.9 / 10 + 0.05)), op
    assert _same(FixMatchRandAugment.apply(img, "posterize", v), PIL.ImageOps.posterize(img, int(v * 4 / 10) + 4))
    assert _same(FixMatchRandAugment.apply(img, "solarize", v), PIL.ImageOps.solarize(img, 256 - int(v * 256 / 10)))
    assert _same(FixMatchRandAugment.apply(img, "autocontrast", v), PIL.ImageOps.autocontrast(img))
    assert _same(FixMatchRandAugment.apply(img, "equalize", v), PIL.ImageOps.equalize(img))
    assert _same(FixMatchRandAugment.apply(img, "identity", v), img)


@pytest.mark.parametrize("v", [2, 9])
def test_each_signed_operation_is_the_references_with_either_sign(v):
    img = _image()
    shear, shift, angle = v * 0.3 / 10, int(v * 0.3 / 10 * 32), int(v * 30 / 10)
    expected = {
        "rotate": [img.rotate(a) for a in (angle, -angle)],
        "shear_x": [img.transform(img.size, Image.AFFINE, (1, s, 0, 0, 1, 0)) for s in (shear, -shear)],
        "shear_y": [img.transform(img.size, Image.AFFINE, (1, 0, 0, s, 1, 0)) for s in (shear, -shear)],
        "translate_x": [img.transform(img.size, Image.AFFINE, (1, 0, s, 0, 1, 0)) for s in (shift, -shift)],
        "translate_y": [img.transform(img.size, Image.AFFINE, (1, 0, 0, 0, 1, s)) for s in (shift, -shift)],
    }
    torch.manual_seed(0)
    for op, candidates in expected.items():
        seen = set()
        for _ in range(12):  # both signs turn up
            out = FixMatchRandAugment.apply(img, op, v)
            matches = [k for k, c in enumerate(candidates) if _same(out, c)]
            assert matches, op
            seen.update(matches)
        assert seen == {0, 1}, op


def test_the_draw_two_operations_each_half_the_time_at_magnitudes_one_to_nine(monkeypatch):
    calls: list[tuple[str, int]] = []
    monkeypatch.setattr(FixMatchRandAugment, "apply", staticmethod(lambda img, op, v: calls.append((op, v)) or img))
    torch.manual_seed(0)
    augment, images = FixMatchRandAugment(2, 10), 4000
    for _ in range(images):
        augment(_image(side=4))
    ops, magnitudes = {op for op, _ in calls}, {v for _, v in calls}
    assert ops == set(FixMatchRandAugment.OPS) and len(ops) == 14
    assert magnitudes == set(range(1, 10))  # np.random.randint(1, m): 1 .. m - 1
    # 2 draws, each applied with probability 0.5: 1 application per image on average
    assert abs(len(calls) / images - 1.0) < 0.05


def test_the_fixmatch_view_ends_with_the_references_cutout_and_the_torchvision_view_stays_available():
    """CutoutAbs(img, 16) (lines 47-60): a centre drawn uniformly over the image, x0 = int(max(0,
    x - 8)), x1 = int(min(w, x0 + 16)), painted by PIL's rectangle, which includes both corners."""
    import PIL.ImageDraw

    black = Image.new("L", (32, 32))
    for seed in range(200):
        torch.manual_seed(seed)  # the same two draws for the expected square
        x, y = float(torch.rand(())) * 32, float(torch.rand(())) * 32
        x0, y0 = int(max(0, x - 8)), int(max(0, y - 8))
        expected = black.copy()
        PIL.ImageDraw.Draw(expected).rectangle((x0, y0, int(min(32, x0 + 16)), int(min(32, y0 + 16))), 127)
        torch.manual_seed(seed)
        assert _same(Cutout(size=16)(black), expected), seed
    assert int((np.asarray(expected) == 127).sum()) <= 17 * 17
    view = strong_transform([0.5], [0.5], 32, flip=False)
    names = [type(t).__name__ for t in view.transforms]
    assert names[1:3] == ["FixMatchRandAugment", "Cutout"] and view.transforms[2].size == 16
    legacy = strong_transform([0.5], [0.5], 32, flip=False, augment="torchvision")
    assert [type(t).__name__ for t in legacy.transforms][1] == "RandAugment"
    assert math.isclose(legacy.transforms[2].max_fraction, 0.5) and legacy.transforms[2].size is None
    with pytest.raises(ValueError, match="strong_augment"):
        strong_transform([0.5], [0.5], 32, augment="autoaugment")
    with pytest.raises(ValueError, match="strong_augment"):
        SemiSupervisedDataModule("mnist5k", strong_augment="rand")


def test_the_weak_view_pads_by_reflection_or_with_zeros():
    white = Image.new("L", (32, 32), color=255)
    torch.manual_seed(0)
    zeros = [float(weak_transform([0.0], [1.0], 32, flip=False, padding_mode="zeros")(white).min()) for _ in range(20)]
    reflect = [float(weak_transform([0.0], [1.0], 32, flip=False)(white).min()) for _ in range(20)]
    assert min(zeros) == 0.0 and min(reflect) == 1.0  # zero padding shows as black borders
    with pytest.raises(ValueError, match="padding_mode"):
        weak_transform([0.5], [0.5], 32, padding_mode="edge")


@pytest.mark.parametrize("mode, channels, side", [("L", 1, 28), ("RGB", 3, 32)])
def test_weak_and_strong_views_for_gray_and_rgb(mode, channels, side):
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    shape = (side, side) if channels == 1 else (side, side, channels)
    img = Image.fromarray(rng.integers(0, 256, size=shape, dtype=np.uint8))
    norm = ([0.5] * channels, [0.5] * channels)
    weak, strong = weak_transform(*norm, side), strong_transform(*norm, side)
    assert weak(img).shape == strong(img).shape == (channels, side, side)
    assert not torch.equal(weak(img), strong(img))


def test_cutout_paints_one_gray_square_of_at_most_half_the_side():
    torch.manual_seed(0)
    for _ in range(20):
        out = np.array(Cutout(0.5, fill=127)(Image.new("L", (28, 28), color=0)))
        rows, cols = np.nonzero(out == 127)
        if rows.size:
            assert rows.max() - rows.min() < 14 and cols.max() - cols.min() < 14
            assert rows.size == (rows.max() - rows.min() + 1) * (cols.max() - cols.min() + 1)
