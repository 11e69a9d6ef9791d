"""Tests for lpa3_lightning.models.resnet: MedMNIST 28 px stems on torchvision ResNets."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lpa3_lightning.core.feature_layers import default_feature_layers
from lpa3_lightning.models import medmnist_resnet, resnet18_medmnist, resnet50_medmnist


@pytest.mark.parametrize(("arch", "width"), [("resnet18", 512), ("resnet50", 2048)])
@pytest.mark.parametrize("in_channels", [1, 3])
def test_medmnist_resnet_28px_output_and_stem(arch: str, width: int, in_channels: int) -> None:
    torch.manual_seed(0)
    net = medmnist_resnet(arch, in_channels=in_channels, num_classes=5).eval()
    conv1 = net.conv1
    assert isinstance(conv1, nn.Conv2d)
    assert conv1.in_channels == in_channels and conv1.out_channels == 64
    assert conv1.kernel_size == (3, 3) and conv1.stride == (1, 1) and conv1.padding == (1, 1)
    assert conv1.bias is None
    assert isinstance(net.maxpool, nn.Identity)
    assert net.fc.in_features == width and net.fc.out_features == 5
    children = dict(net.named_children())
    for stage in ("layer1", "layer2", "layer3", "layer4"):
        assert stage in children
    assert default_feature_layers(net) == ["layer1", "layer2", "layer3", "layer4"]

    x = torch.randn(2, in_channels, 28, 28)
    spatial = {}
    hooks = [
        getattr(net, s).register_forward_hook(lambda _m, _i, o, s=s: spatial.__setitem__(s, tuple(o.shape[2:])))
        for s in ("layer1", "layer4")
    ]
    try:
        with torch.no_grad():
            out = net(x)
    finally:
        for h in hooks:
            h.remove()
    assert out.shape == (2, 5)
    assert torch.isfinite(out).all()
    # the stem does not shrink 28x28 (torchvision's stem would give 7x7 at layer1)
    assert spatial == {"layer1": (28, 28), "layer4": (4, 4)}


def test_named_builders() -> None:
    assert resnet18_medmnist(in_channels=3, num_classes=7)(torch.zeros(2, 3, 28, 28)).shape == (2, 7)
    net50 = resnet50_medmnist(in_channels=1, num_classes=2)
    assert net50.conv1.in_channels == 1 and net50.fc.in_features == 2048
    assert medmnist_resnet().conv1.in_channels == 1 and medmnist_resnet().fc.out_features == 2


def test_medmnist_resnet_is_trainable_in_train_mode() -> None:
    net = resnet18_medmnist(in_channels=1, num_classes=3).train()
    loss = nn.functional.cross_entropy(net(torch.randn(2, 1, 28, 28)), torch.tensor([0, 2]))
    loss.backward()
    assert net.conv1.weight.grad is not None and net.conv1.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("arch", ["resnet34", "vgg16", "ResNet18", ""])
def test_unknown_arch_raises(arch: str) -> None:
    with pytest.raises(ValueError, match=r"`arch` must be one of \['resnet18', 'resnet50'\]"):
        medmnist_resnet(arch)


@pytest.mark.parametrize(("in_channels", "num_classes"), [(0, 2), (1, 1), (-3, 4)])
def test_bad_sizes_raise(in_channels: int, num_classes: int) -> None:
    with pytest.raises(ValueError, match="`in_channels` must be >= 1 and `num_classes` >= 2"):
        medmnist_resnet("resnet18", in_channels=in_channels, num_classes=num_classes)
