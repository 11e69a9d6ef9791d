"""Wide-ResNets against the structure of the reference code, shapes, feature stages."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lpa3_lightning.core.feature_layers import default_feature_layers
from lpa3_lightning.models import WideResNet, wrn28_2, wrn28_8, wrn37_2
from tests.helpers import randomize_bn_statistics


def _reference_layers(num_classes: int, width: int, stages: int) -> list[tuple[str, tuple[int, ...]]]:
    """The parameterised layers of the reference WRN in registration order, as (kind, weight
    shape), typed from CausalLearning/LPA3 FixMatch/models/wideresnet.py at 7059ca3 (BasicBlock
    lines 45-84: bn1, conv1, bn2, conv2, then convShortcut when the widths differ; WideResNet
    lines 105-163 and WideResNetVar lines 166-228: conv1, the 3 or 4 stages of (depth - 4) / 6
    blocks, bn1, linear), without the twin BNs of its adversarial flag. ("unused" marks the bn1 of
    the later stages' first blocks, whose output the forward discards: lines 76-80.)"""
    widths = [16] + [16 * width * 2**s for s in range(stages)]
    layers = [("Conv2d", (16, 3, 3, 3))]
    for s in range(stages):
        for block in range(4):
            in_ch = widths[s] if block == 0 else widths[s + 1]
            out_ch = widths[s + 1]
            kind = "unused" if block == 0 and s > 0 else "BatchNorm2d"
            layers += [(kind, (in_ch,)), ("Conv2d", (out_ch, in_ch, 3, 3)), ("BatchNorm2d", (out_ch,)),
                       ("Conv2d", (out_ch, out_ch, 3, 3))]
            if in_ch != out_ch:
                layers.append(("Conv2d", (out_ch, in_ch, 1, 1)))
    return layers + [("BatchNorm2d", (widths[-1],)), ("Linear", (num_classes, widths[-1]))]


def _count(layers) -> int:
    total = 0
    for kind, shape in layers:
        if kind in ("BatchNorm2d", "unused"):
            total += 2 * shape[0]
        elif kind == "Linear":
            total += shape[0] * shape[1] + shape[0]
        else:
            total += int(torch.tensor(shape).prod())
    return total


@pytest.mark.parametrize("build, width, stages", [(wrn28_2, 2, 3), (wrn37_2, 2, 4)])
def test_layer_order_and_parameter_count_match_the_reference(build, width, stages):
    net = build(num_classes=10)
    reference = _reference_layers(10, width, stages)
    ours = [(type(m).__name__, tuple(m.weight.shape)) for m in net.modules()
            if isinstance(m, (nn.Conv2d, nn.BatchNorm2d, nn.Linear))]
    assert ours == [layer for layer in reference if layer[0] != "unused"]
    unused = _count([layer for layer in reference if layer[0] == "unused"])
    assert sum(p.numel() for p in net.parameters()) == _count(reference) - unused
    if stages == 3:
        assert _count(reference) == 1_467_610  # FixMatch's WRN-28-2, as its papers and code report


def test_the_first_blocks_take_their_input_as_the_reference_does():
    torch.manual_seed(0)
    net = wrn28_2(num_classes=10).eval()
    randomize_bn_statistics(net)
    with torch.no_grad():
        # first stage's first block: conv and shortcut on act(bn1(x))
        first = net.block1[0]
        first.conv2.weight.zero_()
        x = torch.randn(2, 16, 8, 8)
        pre = nn.functional.leaky_relu(first.bn1(x), 0.1)
        assert torch.allclose(first(x), first.shortcut(pre))
        # a later stage's first block: conv and shortcut on the raw input
        later = net.block2[0]
        later.conv2.weight.zero_()
        x = torch.randn(2, 32, 8, 8)
        assert torch.allclose(later(x), later.shortcut(x))
        # a block of equal widths: identity shortcut of the raw input
        inner = net.block2[1]
        inner.conv2.weight.zero_()
        x = torch.randn(2, 64, 4, 4)
        assert torch.allclose(inner(x), x)


def test_shapes_and_default_feature_stages():
    net = wrn28_2(num_classes=10)
    assert tuple(net(torch.zeros(2, 3, 32, 32)).shape) == (2, 10)
    assert default_feature_layers(net) == ["block1", "block2", "block3"]
    assert len(net.block1) == 4
    stl = wrn37_2(num_classes=10).eval()
    with torch.no_grad():
        assert tuple(stl(torch.zeros(1, 3, 96, 96)).shape) == (1, 10)
    assert default_feature_layers(stl) == ["block1", "block2", "block3", "block4"]


def test_bad_depth_and_stages_are_refused():
    with pytest.raises(ValueError, match="6n \\+ 4"):
        WideResNet(depth=27)
    with pytest.raises(ValueError, match="`stages`"):
        WideResNet(stages=5)


def test_wrn28_8_shape_and_size():
    net = wrn28_8(num_classes=100).eval()
    assert 23.0e6 < sum(p.numel() for p in net.parameters()) < 23.8e6  # "23.4M" (FixMatch's CIFAR-100 WRN)
    with torch.no_grad():
        assert tuple(net(torch.zeros(1, 3, 16, 16)).shape) == (1, 100)  # any size works; 16 px keeps it cheap
    assert default_feature_layers(net) == ["block1", "block2", "block3"]
