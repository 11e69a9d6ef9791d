"""NanIgnoringMean: MeanMetric(nan_strategy="ignore")'s value without its host read."""

from __future__ import annotations

import math

import torch
from torchmetrics import MeanMetric

from lpa3_lightning.callback.epoch_mean import NanIgnoringMean
from lpa3_lightning.core.host_reads import HostReadCounter


def test_equals_torchmetrics_ignore_strategy_with_weights_and_nans() -> None:
    g = torch.Generator().manual_seed(0)
    ours, reference = NanIgnoringMean(), MeanMetric(nan_strategy="ignore")
    for _ in range(5):
        value = torch.randn(7, generator=g)
        value[torch.rand(7, generator=g) < 0.3] = float("nan")
        weight = torch.rand(7, generator=g)
        ours.update(value, weight)
        reference.update(value, weight)
    ours.update(torch.tensor(2.5), 3)  # a scalar with an int weight, as the callback logs
    reference.update(torch.tensor(2.5), 3)
    torch.testing.assert_close(ours.compute(), reference.compute())


def test_update_reads_nothing_on_the_host_and_all_nan_is_nan() -> None:
    mean = NanIgnoringMean()
    with HostReadCounter() as reads:
        mean.update(torch.tensor([float("nan"), float("nan")]), torch.tensor([1.0, 2.0]))
    assert reads.total == 0
    assert math.isnan(float(mean.compute()))
