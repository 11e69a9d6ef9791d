"""Synthetic label noise: the rates and conventions, the mappings, seeds and the noise file."""

from __future__ import annotations

import doctest

import numpy as np
import pytest
import torch

from lpa3_lightning.data import label_noise
from lpa3_lightning.data.label_noise import load_noisy_labels, noisy_labels, save_noisy_labels

CLEAN = np.repeat(np.arange(10), 1000)  # 10 classes x 1000


def test_docstring_examples_run():
    assert doctest.testmod(label_noise).failed == 0


@pytest.mark.parametrize("rate", [0.0, 0.5, 0.8, 1.0])
def test_symmetric_other_flips_exactly_the_rate_to_uniformly_drawn_other_classes(rate):
    noisy = noisy_labels(CLEAN, rate, 10, seed=0)
    wrong = noisy != CLEAN
    assert int(wrong.sum()) == round(rate * CLEAN.size)
    if rate >= 0.5:
        # each wrong label is one of the 9 other classes, about equally often: offsets 1..9
        offsets = (noisy[wrong] - CLEAN[wrong]) % 10
        counts = np.bincount(offsets, minlength=10)
        assert counts[0] == 0
        expected = wrong.sum() / 9
        assert np.all(np.abs(counts[1:] - expected) < 5 * np.sqrt(expected))


def test_symmetric_any_is_dividemix_uniform_redraw_so_fewer_labels_are_wrong():
    noisy = noisy_labels(CLEAN, 0.8, 10, seed=0, convention="any")
    share_wrong = float((noisy != CLEAN).mean())
    # 8,000 drawn, each wrong with probability 9/10: 0.72 +- a few binomial std (0.0027)
    assert abs(share_wrong - 0.72) < 0.015
    assert noisy.dtype == np.int64


def test_asymmetric_digits_flips_the_rate_of_each_mapped_class_to_its_target_only():
    noisy = noisy_labels(CLEAN, 0.4, 10, seed=1, mode="asymmetric", mapping="digits")
    for c in range(10):
        members = CLEAN == c
        target = label_noise.ASYMMETRIC_MAPPINGS["digits"].get(c)
        if target is None:
            assert np.array_equal(noisy[members], CLEAN[members])
        else:
            changed = noisy[members] != c
            assert int(changed.sum()) == 400  # round(0.4 * 1000)
            assert set(noisy[members][changed].tolist()) == {target}  # 5 -> 6 never chains on to 5


def test_asymmetric_cifar10_and_binary_and_a_custom_mapping():
    cifar = noisy_labels(CLEAN, 0.4, 10, seed=0, mode="asymmetric", mapping="cifar10")
    assert set(np.unique(cifar[CLEAN == 9])) == {1, 9} and np.array_equal(cifar[CLEAN == 6], CLEAN[CLEAN == 6])
    binary = np.array([0] * 50 + [1] * 50)
    flipped = noisy_labels(binary, 0.4, 2, seed=0, mode="asymmetric", mapping="binary")
    assert int((flipped[50:] == 0).sum()) == 20 and np.array_equal(flipped[:50], binary[:50])
    custom = noisy_labels(torch.tensor([0, 0, 1, 1]), 1.0, 3, seed=0, mode="asymmetric", mapping={0: 2})
    assert custom.tolist() == [2, 2, 1, 1]


def test_same_seed_same_noise_other_seed_other_noise_and_input_unchanged():
    clean = CLEAN.copy()
    a, b = noisy_labels(clean, 0.5, 10, seed=3), noisy_labels(clean, 0.5, 10, seed=3)
    assert np.array_equal(a, b) and not np.array_equal(a, noisy_labels(clean, 0.5, 10, seed=4))
    assert np.array_equal(clean, CLEAN)


@pytest.mark.parametrize("kwargs, match", [
    ({"rate": 1.5}, "`rate` must be a number in \\[0, 1\\]"),
    ({"rate": True}, "`rate`"),
    ({"num_classes": 1}, "`num_classes` must be an int >= 2"),
    ({"mode": "pair"}, "`mode`"),
    ({"convention": "uniform"}, "`convention`"),
    ({"mode": "asymmetric", "mapping": "cifar100"}, "`mapping` must be one of"),
    ({"mode": "asymmetric", "mapping": {3: 3}}, "maps a class to itself"),
    ({"num_classes": 5}, "num_classes=5"),  # labels up to 9
])
def test_bad_arguments_are_refused_with_the_fix(kwargs, match):
    args = {"labels": CLEAN, "rate": 0.5, "num_classes": 10, "seed": 0, **kwargs}
    with pytest.raises(ValueError, match=match):
        noisy_labels(**args)


def test_noise_file_round_trip_and_refusals(tmp_path):
    noisy = noisy_labels(CLEAN, 0.5, 10, seed=0)
    path = save_noisy_labels(tmp_path / "n" / "noise.json", noisy, CLEAN, {"mode": "symmetric", "rate": 0.5})
    back, meta = load_noisy_labels(path, CLEAN, expected={"rate": 0.5})
    assert np.array_equal(back, noisy) and meta["mode"] == "symmetric"
    with pytest.raises(ValueError, match="other clean labels"):
        load_noisy_labels(path, np.roll(CLEAN, 1))
    with pytest.raises(ValueError, match="rate=0.5, not rate=0.8"):
        load_noisy_labels(path, CLEAN, expected={"rate": 0.8})
    with pytest.raises(FileNotFoundError, match="missing.json"):
        load_noisy_labels(tmp_path / "missing.json", CLEAN)
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="not a noisy-label file"):
        load_noisy_labels(tmp_path / "bad.json", CLEAN)
    with pytest.raises(ValueError, match="one length"):
        save_noisy_labels(tmp_path / "x.json", noisy[:5], CLEAN, {})
