"""The x / x' / |x' - x| grid: one scale for the whole difference row, its size, and its text."""

from __future__ import annotations

import pytest
import torch

from lpa3_lightning.core.visualize import comparison_grid, difference_peak

HALF = {"mean": [0.5], "std": [0.5]}  # x = 0 is grey 0.5; a change of 0.2 in x is 0.1 in the picture


def _pair() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.zeros(2, 1, 4, 4)
    x_adv = x.clone()
    x_adv[0, 0, 1, 1] = 0.2  # 0.1 in [0, 1] pixel units
    x_adv[1, 0, 2, 2] = 0.8  # 0.4
    return x, x_adv


def test_the_difference_row_has_one_scale_for_all_images():
    """A four times larger change is four times brighter (each image was stretched to its own peak:
    both were white, and brightness said nothing about size)."""
    x, x_adv = _pair()
    assert difference_peak(x, x_adv, HALF) == pytest.approx(0.4)
    grid = comparison_grid(x, x_adv, HALF, padding=0)
    diff = grid[0, 8:12]
    assert float(diff[:, 0:4].max()) == pytest.approx(0.25)
    assert float(diff[:, 4:8].max()) == pytest.approx(1.0)


def test_a_given_peak_fixes_the_white_of_the_difference_row():
    x, x_adv = _pair()
    grid = comparison_grid(x, x_adv, HALF, padding=0, peak=0.2)
    assert float(grid[0, 8 + 1, 1]) == pytest.approx(0.5) and float(grid[0, 8 + 2, 4 + 2]) == 1.0  # (clipped)
    unchanged = comparison_grid(x, x, HALF, padding=0)
    assert float(unchanged[:, 8:12].max()) == 0.0  # no change: a black row, not a division by zero


def test_scale_enlarges_every_pixel():
    x, x_adv = _pair()
    small = comparison_grid(x, x_adv, HALF, padding=1)
    large = comparison_grid(x, x_adv, HALF, padding=1, scale=3)
    assert tuple(large.shape) == (3, 3 * small.shape[1], 3 * small.shape[2])
    assert torch.equal(large[:, ::3, ::3], small)


def test_labels_and_caption_are_written_under_the_rows():
    x, x_adv = torch.zeros(2, 1, 28, 28), torch.full((2, 1, 28, 28), 0.1)
    plain = comparison_grid(x, x_adv, HALF, scale=2)
    named = comparison_grid(x, x_adv, HALF, scale=2, labels=["d 0.12", "d 3.40"], caption="white = 0.05")
    assert named.shape[2] == plain.shape[2] and named.shape[1] > plain.shape[1]
    assert torch.equal(named[:, :plain.shape[1]], plain)  # the images are untouched
    text = named[:, plain.shape[1]:]
    width = plain.shape[2] // 2
    assert float(text[:, :, :width].min()) < 0.5 and float(text[:, :, width:].min()) < 0.5  # ink in both columns
    with pytest.raises(ValueError, match="`labels`.*2 images.*3"):
        comparison_grid(x, x_adv, labels=["a", "b", "c"])
    with pytest.raises(ValueError, match="`scale`"):
        comparison_grid(x, x_adv, scale=0)
