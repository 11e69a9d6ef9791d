"""small_cnn: shapes for 28x28 gray and 32x32 RGB, dual BN conversion, default feature stages."""

from __future__ import annotations

import pytest
import torch

from lpa3_lightning.core.dual_bn import DualBatchNorm2d, convert_dual_bn, has_dual_bn
from lpa3_lightning.core.feature_layers import default_feature_layers
from lpa3_lightning.models import SmallCNN, small_cnn


@pytest.mark.parametrize("channels, side, classes", [(1, 28, 10), (3, 32, 100)])
def test_shapes(channels, side, classes):
    net = small_cnn(in_channels=channels, num_classes=classes)
    assert tuple(net(torch.randn(3, channels, side, side)).shape) == (3, classes)
    assert 100_000 < sum(p.numel() for p in small_cnn().parameters()) < 130_000
    global_average = small_cnn(pool_size=1)  # the earlier head: one average per channel
    assert global_average.fc.in_features == 128 and small_cnn().fc.in_features == 128 * 16
    assert not any(isinstance(m, torch.nn.Dropout) for m in net.modules())


def test_convert_dual_bn_keeps_the_forward():
    torch.manual_seed(0)
    net = small_cnn().eval()
    x = torch.randn(4, 1, 28, 28)
    before = net(x)
    convert_dual_bn(net)
    assert has_dual_bn(net)
    assert sum(isinstance(m, DualBatchNorm2d) for m in net.modules()) == 3
    torch.testing.assert_close(net(x), before)


def test_default_feature_layers_are_the_three_blocks():
    net = small_cnn(width=8)
    assert default_feature_layers(net) == ["block1", "block2", "block3"]
    assert default_feature_layers(net, torch.randn(2, 1, 28, 28)) == ["block1", "block2", "block3"]


def test_bad_width_is_refused():
    with pytest.raises(ValueError, match="width"):
        SmallCNN(width=0)
