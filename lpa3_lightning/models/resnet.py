"""ResNet-18 / ResNet-50 for 28x28 MedMNIST images, built on torchvision.

The MedMNIST v2 benchmark (Yang et al., Scientific Data 2023) trains ResNets at 28 px with a CIFAR-style
stem (a 3x3 stride-1 first convolution, no max-pooling: the input is not shrunk to 7x7 before the first
stage); the rest is torchvision's ResNet, whose stages ``layer1`` ... ``layer4`` are LP-A3's feature layers.
"""

from __future__ import annotations

from torch import nn
from torchvision.models import resnet18, resnet50
from torchvision.models.resnet import ResNet

__all__ = ["medmnist_resnet", "resnet18_medmnist", "resnet50_medmnist"]

_BUILDERS = {"resnet18": resnet18, "resnet50": resnet50}


def medmnist_resnet(arch: str = "resnet18", in_channels: int = 1, num_classes: int = 2) -> ResNet:
    """A torchvision ResNet with the MedMNIST 28 px stem.

    Args:
        arch: ``"resnet18"`` or ``"resnet50"``.
        in_channels: image channels (1 for grey-scale MedMNIST sets, 3 for colour ones).
        num_classes: output classes.

    Raises:
        ValueError: on an unknown ``arch`` or non-positive sizes.

    Example:
        >>> import torch
        >>> net = medmnist_resnet("resnet18", in_channels=1, num_classes=2)
        >>> tuple(net(torch.zeros(2, 1, 28, 28)).shape)
        (2, 2)
    """
    if arch not in _BUILDERS:
        raise ValueError(f"`arch` must be one of {sorted(_BUILDERS)}, got {arch!r}.")
    if in_channels < 1 or num_classes < 2:
        raise ValueError(f"`in_channels` must be >= 1 and `num_classes` >= 2, got {in_channels} and {num_classes}.")
    net = _BUILDERS[arch](weights=None, num_classes=num_classes)
    net.conv1 = nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
    net.maxpool = nn.Identity()
    return net


def resnet18_medmnist(in_channels: int = 1, num_classes: int = 2) -> ResNet:
    """ResNet-18 with the MedMNIST 28 px stem (:func:`medmnist_resnet`)."""
    return medmnist_resnet("resnet18", in_channels, num_classes)


def resnet50_medmnist(in_channels: int = 1, num_classes: int = 2) -> ResNet:
    """ResNet-50 with the MedMNIST 28 px stem (:func:`medmnist_resnet`)."""
    return medmnist_resnet("resnet50", in_channels, num_classes)
