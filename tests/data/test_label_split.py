"""The labeled subset: drawn equally from every class from a seed, kept in a JSON file."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from lpa3_lightning.data import load_label_split, stratified_label_split


def test_split_is_equal_per_class_sorted_and_seeded():
    labels = np.repeat(np.arange(10), 50)[np.random.default_rng(3).permutation(500)]
    idx = stratified_label_split(labels, 40, 10, seed=0)
    assert idx.dtype == np.int64 and len(idx) == 40 and len(np.unique(idx)) == 40
    assert np.all(np.diff(idx) > 0)
    assert np.bincount(labels[idx], minlength=10).tolist() == [4] * 10
    np.testing.assert_array_equal(idx, stratified_label_split(torch.from_numpy(labels), 40, 10, seed=0))
    assert not np.array_equal(idx, stratified_label_split(labels, 40, 10, seed=1))


@pytest.mark.parametrize("num_labels, fix", [(5, "num_labels=10"), (25, "num_labels=20 or 30"), (0, "num_labels")])
def test_split_refuses_fewer_labels_than_classes_or_a_non_multiple(num_labels, fix):
    with pytest.raises(ValueError, match="num_labels") as info:
        stratified_label_split(np.repeat(np.arange(10), 5), num_labels, 10, seed=0)
    assert fix in str(info.value) and "Fix" in str(info.value)


def test_split_refuses_a_class_with_too_few_samples():
    labels = np.array([0] * 10 + [1] * 2)
    with pytest.raises(ValueError, match="class 1 has only 2.*num_labels <= 4"):
        stratified_label_split(labels, 6, 2, seed=0)


def test_a_damaged_split_file_is_refused_with_its_path(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"indices": [1, 2]}))
    with pytest.raises(ValueError, match="not a label split file") as info:
        load_label_split(path)
    assert str(path) in str(info.value)
