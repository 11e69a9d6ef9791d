"""MixMatch pieces shared by PES and DivideMix, checked against direct computations."""

from __future__ import annotations

import doctest

import pytest
import torch
import torch.nn.functional as F

from lpa3_lightning.methods import mixmatch
from lpa3_lightning.methods.mixmatch import (
    agreement_split,
    class_balance_weights,
    linear_rampup,
    mixup,
    mixup_lambda,
    probability_mse,
    sharpen,
    soft_cross_entropy,
)


def test_docstring_examples_run():
    assert doctest.testmod(mixmatch).failed == 0


def test_sharpen_lowers_entropy_keeps_the_argmax_and_sums_to_one():
    p = torch.softmax(torch.randn(16, 5, generator=torch.Generator().manual_seed(0)), dim=1)
    q = sharpen(p, 0.5)
    assert torch.allclose(q.sum(1), torch.ones(16))
    assert torch.equal(q.argmax(1), p.argmax(1))
    entropy = lambda d: -(d * d.log()).sum(1)  # noqa: E731
    assert bool((entropy(q) < entropy(p)).all())
    assert torch.allclose(sharpen(p, 1.0), p)
    with pytest.raises(ValueError, match="temperature"):
        sharpen(p, 0.0)


def test_mixup_lambda_is_at_least_one_half_and_follows_the_beta_mean():
    torch.manual_seed(0)
    draws = torch.tensor([mixup_lambda(4.0) for _ in range(4000)])
    assert float(draws.min()) >= 0.5 and float(draws.max()) <= 1.0
    # E[max(l, 1-l)] for l ~ Beta(4, 4), by numerical integration of the density
    grid = torch.linspace(0.5, 1.0, 20001, dtype=torch.float64)
    density = (grid * (1 - grid)) ** 3 * 140.0  # 1 / B(4, 4) = 140
    expected = float(torch.trapezoid(2 * grid * density, grid))
    assert abs(float(draws.mean()) - expected) < 0.005
    with pytest.raises(ValueError, match="alpha"):
        mixup_lambda(0.0)


def test_mixup_mixes_inputs_and_targets_with_the_same_partner():
    x = torch.arange(4.0).view(4, 1)
    t = torch.eye(4)
    perm = torch.tensor([1, 0, 3, 2])
    mx, mt = mixup(x, t, 0.75, perm)
    assert torch.allclose(mx.squeeze(1), torch.tensor([0.25, 0.75, 2.25, 2.75]))
    assert torch.allclose(mt[0], torch.tensor([0.75, 0.25, 0.0, 0.0]))
    with pytest.raises(ValueError, match="one permutation entry"):
        mixup(x, t, 0.75, perm[:3])


def test_soft_cross_entropy_equals_cross_entropy_on_one_hot_targets_and_weights_classes():
    logits = torch.randn(8, 3, generator=torch.Generator().manual_seed(1))
    y = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    assert torch.allclose(soft_cross_entropy(logits, F.one_hot(y, 3).float()), F.cross_entropy(logits, y))
    w = torch.tensor([2.0, 0.0, 1.0])
    per_sample = F.cross_entropy(logits, y, reduction="none")
    expected = (per_sample * w[y]).sum() / 8  # the class-weighted batch mean (PES's Lx)
    assert torch.allclose(soft_cross_entropy(logits, F.one_hot(y, 3).float(), w), expected)
    assert float(soft_cross_entropy(logits[:0], torch.zeros(0, 3))) == 0.0


def test_probability_mse_averages_over_samples_and_classes():
    logits = torch.zeros(2, 4)  # softmax 0.25 everywhere
    targets = torch.tensor([[1.0, 0, 0, 0], [0.25, 0.25, 0.25, 0.25]])
    expected = (0.75 ** 2 + 3 * 0.25 ** 2) / 8
    assert abs(float(probability_mse(logits, targets)) - expected) < 1e-7


def test_linear_rampup_starts_at_the_start_epoch_and_saturates_after_its_length():
    assert linear_rampup(10.0, 20) == 0.0
    assert linear_rampup(28.0, 20) == 0.5
    assert linear_rampup(40.0, 20) == 1.0
    with pytest.raises(ValueError, match="length"):
        linear_rampup(1.0, 0, 0)


def test_agreement_split_and_class_balance_weights():
    probs = torch.tensor([[0.9, 0.1], [0.2, 0.8], [0.6, 0.4]])
    assert agreement_split(probs, torch.tensor([0, 0, 0])).tolist() == [True, False, True]
    with pytest.raises(ValueError, match="noisy_labels"):
        agreement_split(probs, torch.tensor([0, 0]))
    w = class_balance_weights(torch.tensor([0] * 9 + [1]), 2, cap=3.0)
    assert torch.allclose(w, torch.tensor([5.0 / 9.0, 3.0]))  # 5 / 1 = 5 capped at 3
