"""A network without BatchNorm or dropout for the multi-node tests: data parallelism over 2 x 8 rows
then computes what one process computes over the 16 (up to float rounding)."""

from __future__ import annotations

from torch import nn


class NoBatchNormNet(nn.Sequential):
    def __init__(self, in_channels: int = 1, num_classes: int = 2) -> None:
        super().__init__(nn.Conv2d(in_channels, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(8, num_classes))
