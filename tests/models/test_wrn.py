"""WRN-28-2: shape, size, the feature stages the attack hooks by default."""

from __future__ import annotations

import pytest
import torch

from lpa3_lightning.features import default_feature_layers
from lpa3_lightning.models import WideResNet, wrn28_2


def test_wrn28_2_shape_parameters_and_default_feature_stages():
    net = wrn28_2(num_classes=10)
    assert tuple(net(torch.zeros(2, 3, 32, 32)).shape) == (2, 10)
    assert 1.4e6 < sum(p.numel() for p in net.parameters()) < 1.6e6  # "1.5M parameters" (FixMatch)
    assert default_feature_layers(net) == ["block1", "block2", "block3"]
    assert len(net.block1) == 4


def test_bad_depth_is_refused():
    with pytest.raises(ValueError, match="6n \\+ 4"):
        WideResNet(depth=27)


def test_wrn28_8_shape_and_size():
    from lpa3_lightning.models import wrn28_8

    net = wrn28_8(num_classes=100).eval()
    assert 23.0e6 < sum(p.numel() for p in net.parameters()) < 23.8e6  # "23.4M" (FixMatch's CIFAR-100 WRN)
    with torch.no_grad():
        assert tuple(net(torch.zeros(1, 3, 16, 16)).shape) == (1, 100)  # any size works; 16 px keeps it cheap
    assert default_feature_layers(net) == ["block1", "block2", "block3"]
