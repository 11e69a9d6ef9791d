"""PreAct ResNet-18 against the structure of the reference code, shapes, feature layers, twin BN."""

from __future__ import annotations

import torch
from torch import nn

from lpa3_lightning.core.dual_bn import convert_dual_bn, has_dual_bn
from lpa3_lightning.core.feature_layers import default_feature_layers
from lpa3_lightning.models import preact_resnet18
from tests.helpers import randomize_bn_statistics


def _reference_layers(num_classes: int, in_channels: int = 3) -> list[tuple[str, tuple[int, ...]]]:
    """The parameterised layers of the reference PreActResNet18, in the order its modules are
    registered, as (kind, weight shape); typed from tmllab/2021_NeurIPS_PES networks/ResNet.py at
    ec5290d (PreActBlock lines 41-64: bn1, conv1, bn2, conv2, then a shortcut that is an empty
    Sequential or a bias-free 1x1 conv, applied to relu(bn1(x)); ResNet lines 124-166: conv1 3x3
    bias-free, bn1, layer1..layer4, linear, with relu(bn1(conv1(x))) as the stem and 4x4 average
    pooling after layer4; PreActResNet18 line 191) and the same in LiJunnan1992/DivideMix
    PreResNet.py (PreActBlock lines 37-60, ResNet lines 120-161)."""
    layers = [("Conv2d", (64, in_channels, 3, 3)), ("BatchNorm2d", (64,))]
    in_ch = 64
    for width, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        for block in range(2):
            s = stride if block == 0 else 1
            layers += [("BatchNorm2d", (in_ch,)), ("Conv2d", (width, in_ch, 3, 3)), ("BatchNorm2d", (width,)),
                       ("Conv2d", (width, width, 3, 3))]
            if s != 1 or in_ch != width:
                layers.append(("Conv2d", (width, in_ch, 1, 1)))
            in_ch = width
    return layers + [("Linear", (num_classes, 512))]


def _reference_parameter_count(num_classes: int) -> int:
    count = 0
    for kind, shape in _reference_layers(num_classes):
        if kind == "BatchNorm2d":
            count += 2 * shape[0]  # weight and bias
        elif kind == "Linear":
            count += shape[0] * shape[1] + shape[0]  # weight and bias
        else:
            count += int(torch.tensor(shape).prod())  # bias-free convolutions
    return count


def test_layer_order_and_parameter_count_match_the_reference():
    for classes in (10, 100):
        net = preact_resnet18(num_classes=classes)
        ours = [(type(m).__name__, tuple(m.weight.shape)) for m in net.modules()
                if isinstance(m, (nn.Conv2d, nn.BatchNorm2d, nn.Linear))]
        assert ours == _reference_layers(classes)
        assert sum(p.numel() for p in net.parameters()) == _reference_parameter_count(classes)
        assert all(m.bias is None for m in net.modules() if isinstance(m, nn.Conv2d))
    assert _reference_parameter_count(10) == 11_171_274  # the count of the transcription, by hand too


def test_the_shortcut_carries_the_pre_activation_and_the_stem_is_normalised():
    torch.manual_seed(0)
    net = preact_resnet18(num_classes=10).eval()
    randomize_bn_statistics(net)
    block = net.layer1[0]  # an identity block: with its convolutions zeroed it returns relu(bn1(x))
    x = torch.randn(2, 64, 8, 8)
    with torch.no_grad():
        block.conv2.weight.zero_()
        assert torch.allclose(block(x), torch.relu(block.bn1(x)))
    # the stem, as the network's forward runs it: layer1 receives relu(bn1(conv1(x)))
    into_layer1 = {}
    hook = net.layer1.register_forward_pre_hook(lambda module, args: into_layer1.update(x=args[0]))
    image = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        net(image)
        expected = torch.relu(net.bn1(net.conv1(image)))
        assert torch.allclose(into_layer1["x"], expected)
        assert not torch.allclose(into_layer1["x"], net.conv1(image))
    hook.remove()
    # no BN-ReLU after the last stage: the head sees negative features too
    features = {}
    net.layer4.register_forward_hook(lambda module, args, out: features.update(out=out))
    net(torch.randn(2, 3, 32, 32))
    assert float(features["out"].min()) < 0


def test_shapes_and_default_layers():
    net = preact_resnet18(num_classes=10).eval()
    assert net(torch.zeros(2, 3, 32, 32)).shape == (2, 10)
    assert preact_resnet18(num_classes=3, in_channels=1)(torch.zeros(2, 1, 28, 28)).shape == (2, 3)
    assert default_feature_layers(net) == ["layer1", "layer2", "layer3", "layer4"]


def test_twin_bn_and_a_training_step():
    net = convert_dual_bn(preact_resnet18(num_classes=4, in_channels=1)).train()
    assert has_dual_bn(net)
    loss = torch.nn.functional.cross_entropy(net(torch.randn(4, 1, 28, 28)), torch.tensor([0, 1, 2, 3]))
    loss.backward()
    assert net.conv1.weight.grad is not None and float(net.conv1.weight.grad.abs().sum()) > 0
