"""PreAct ResNet-18: shapes, parameter count, default feature layers, twin BN."""

from __future__ import annotations

import torch

from lpa3_lightning.dual_bn import convert_dual_bn, has_dual_bn
from lpa3_lightning.features import default_feature_layers
from lpa3_lightning.models import preact_resnet18


def test_shapes_parameters_and_default_layers():
    net = preact_resnet18(num_classes=10).eval()
    assert net(torch.zeros(2, 3, 32, 32)).shape == (2, 10)
    assert preact_resnet18(num_classes=3, in_channels=1)(torch.zeros(2, 1, 28, 28)).shape == (2, 3)
    # the usual CIFAR PreAct ResNet-18 size: 11.17 M parameters at 10 classes
    assert abs(sum(p.numel() for p in net.parameters()) / 1e6 - 11.17) < 0.02
    assert default_feature_layers(net) == ["layer1", "layer2", "layer3", "layer4"]


def test_twin_bn_and_a_training_step():
    net = convert_dual_bn(preact_resnet18(num_classes=4, in_channels=1)).train()
    assert has_dual_bn(net)
    loss = torch.nn.functional.cross_entropy(net(torch.randn(4, 1, 28, 28)), torch.tensor([0, 1, 2, 3]))
    loss.backward()
    assert net.conv1.weight.grad is not None and float(net.conv1.weight.grad.abs().sum()) > 0
