"""callback/runner.py: what a request and a selection rule must return, refused by name with the fix."""

from __future__ import annotations

import pytest
import torch

from lpa3_lightning import LPA3Request
from lpa3_lightning.callback.runner import check_request, check_selection


def _request(**changes):
    fields = {"inputs": torch.randn(4, 3), "targets": torch.tensor([0, 1, 0, 1]), "indices": torch.arange(4)}
    fields.update(changes)
    return LPA3Request(**fields)


def test_a_good_request_passes():
    check_request(_request(), num_classes=2, num_samples=10)


@pytest.mark.parametrize("inputs", [torch.zeros(4, 3, dtype=torch.long), torch.randn(4), [[0.0]] * 4])
def test_inputs_that_are_not_a_floating_batch_are_refused_by_name(inputs):
    with pytest.raises(ValueError, match=r"LPA3Request.inputs must be a floating tensor.*Fix:"):
        check_request(_request(inputs=inputs), num_classes=2, num_samples=10)


def test_something_else_than_a_request_is_refused_with_the_fix():
    with pytest.raises(TypeError, match=r"must return an LPA3Request, got tuple\. Fix: return LPA3Request"):
        check_request((torch.randn(4, 3), torch.zeros(4)), num_classes=2, num_samples=10)


def test_a_selection_rule_returning_bool_masks_of_the_batch_passes():
    mask = torch.tensor([True, False, True, False])
    check_selection(mask, mask.clone(), 4, torch.device("cpu"))


@pytest.mark.parametrize("by_memory, rows, what", [
    (torch.ones(4), torch.ones(4, dtype=torch.bool), "the memory's mask"),  # float, not bool
    (torch.ones(4, dtype=torch.bool), torch.ones(3, dtype=torch.bool), "the rows to solve"),  # wrong length
    (torch.ones(4, dtype=torch.bool), torch.tensor([0, 2]), "the rows to solve"),  # positions, not a mask
    (None, torch.ones(4, dtype=torch.bool), "the memory's mask")])
def test_an_overridden_selection_returning_something_else_is_refused_by_name(by_memory, rows, what):
    with pytest.raises(ValueError, match=rf"LPA3Callback.select returned {what} .*Fix: return \(by_memory, mask\)"):
        check_selection(by_memory, rows, 4, torch.device("cpu"))
