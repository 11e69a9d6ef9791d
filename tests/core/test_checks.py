"""The shared checks of dataset indices and class labels, and that each stage uses them."""

from __future__ import annotations

import doctest

import pytest
import torch

from lpa3_lightning.core import checks
from lpa3_lightning.core.checks import (
    check_class_labels,
    check_class_prior,
    check_dataset_indices,
    check_split_loader_covered,
)
from lpa3_lightning.core.tcs import TimeConsistency


def test_docstring_examples_run():
    assert doctest.testmod(checks).failed == 0


@pytest.mark.parametrize("bad", [torch.tensor([0.0, 1.0]), torch.tensor([True, False]), torch.zeros(2, 2).long(), [0, 1]])
def test_indices_that_are_not_a_1d_integer_tensor_are_refused_by_name(bad):
    with pytest.raises(ValueError, match="`idx` must be a 1-D integer tensor.*IndexedDataset"):
        check_dataset_indices(bad, 4, name="idx")


def test_indices_out_of_range_name_the_range_and_the_size():
    check_dataset_indices(torch.tensor([0, 3], dtype=torch.int32), 4)
    check_dataset_indices(torch.zeros(0, dtype=torch.long), 4)
    for bad in ([4], [-1, 2]):
        with pytest.raises(ValueError, match=r"out of range: got values in \[.*\] for a training set of 4"):
            check_dataset_indices(torch.tensor(bad), 4)


def test_labels_out_of_range_or_not_class_indices_are_refused():
    check_class_labels(torch.tensor([0, 2]), 3)
    with pytest.raises(ValueError, match=r"Labels out of range: `y` holds values in \[0, 3\] for 3 classes"):
        check_class_labels(torch.tensor([0, 3]), 3, name="y")
    with pytest.raises(ValueError, match="class indices.*not one-hot"):
        check_class_labels(torch.eye(3), 3)


def test_the_tcs_memory_refuses_with_the_shared_message():
    memory = TimeConsistency(num_samples=4, num_classes=2, ratio=0.5)
    with pytest.raises(ValueError, match="`indices` out of range: got values in \\[4, 4\\]"):
        memory.update(torch.tensor([4]), torch.full((1, 2), 0.5))


def test_a_class_prior_is_returned_as_floats_and_a_bad_one_is_refused_by_name():
    assert check_class_prior([0.25, 0.75], 2) == (0.25, 0.75)
    assert check_class_prior(torch.tensor([0.5, 0.5]), 2) == (0.5, 0.5)
    bad = [[0.3, 0.3], [0.2, 0.3, 0.5], [1.0, 0.0], [1.5, -0.5], [float("nan"), 1.0], [1e-300, 1.0],
           ["0.5", "0.5"], "ab", 3, torch.tensor(0.5)]
    for prior in bad:
        with pytest.raises(ValueError, match="`my_prior` must hold num_classes=2 positive frequencies summing to 1"):
            check_class_prior(prior, 2, name="my_prior")


def test_a_split_loader_that_missed_samples_is_refused_naming_the_count_and_the_method():
    check_split_loader_covered(torch.tensor([1.0, 2.0, 1.0]), "pes_begin_epoch")  # every sample seen: accepted
    with pytest.raises(ValueError, match="left 2 training samples out.*to `dividemix_begin_epoch`"):
        check_split_loader_covered(torch.tensor([0.0, 1.0, 0.0]), "dividemix_begin_epoch")
