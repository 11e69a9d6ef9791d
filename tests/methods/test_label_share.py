"""The watch on the classes of the labels a method makes for itself: warns on a collapse, only then."""

from __future__ import annotations

import warnings

import pytest
import torch

from lpa3_lightning.methods.label_share import LabelShareWatch, top_class_share


def _watch(**kwargs) -> LabelShareWatch:
    return LabelShareWatch(4, what="confident pseudo-labels", where="train/pseudo_label_top_class_share",
                           causes="a test.", **kwargs)


def test_top_class_share_counts_the_largest_class_and_is_nan_without_labels():
    assert float(top_class_share(torch.tensor([2, 2, 0, 2]), 4)) == 0.75
    assert torch.isnan(top_class_share(torch.tensor([], dtype=torch.long), 4))


def test_a_collapse_onto_one_class_warns_once_an_epoch_naming_the_class_and_where_to_look():
    watch = _watch(check_after=5)
    true = torch.tensor([0, 1, 2, 3])
    with pytest.warns(UserWarning, match=r"100% of the 80 confident pseudo-labels of epoch 0 .* are class 3.*"
                                         r"4 classes.*train/pseudo_label_top_class_share") as record:
        for _ in range(8):  # checked once, after 5 steps
            watch.update(0, torch.full((16,), 3), true)
    assert len(record) == 1


def test_varied_labels_a_one_class_labeled_set_or_too_few_labels_stay_silent():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        varied = _watch(check_after=3)
        for _ in range(3):
            varied.update(0, torch.tensor([0, 1, 2, 3] * 8), torch.tensor([0, 1, 2, 3]))
        one_class = _watch(check_after=3)  # the labeled data themselves hold one class
        for _ in range(3):
            one_class.update(0, torch.full((32,), 1), torch.tensor([1, 1]))
        few = _watch(check_after=3)  # 12 made labels: below the minimum of 50
        for _ in range(3):
            few.update(0, torch.full((4,), 2), torch.tensor([0, 1, 2, 3]))


def test_an_epoch_shorter_than_the_check_is_read_at_the_next_epochs_first_step():
    watch = _watch(check_after=50)
    for _ in range(4):
        watch.update(0, torch.full((20,), 0), torch.tensor([0, 1]))
    with pytest.warns(UserWarning, match="of epoch 0 \\(4 steps\\)"):
        watch.update(1, torch.tensor([0, 1, 2, 3]), torch.tensor([0, 1]))
