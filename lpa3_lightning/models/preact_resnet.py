"""PreAct ResNet-18 (He et al., ECCV 2016), the noisy-label backbone of DivideMix, PES and LP-A3's
noisy-label rows (32x32 and 28x28 images), as in those methods' code (tmllab/2021_NeurIPS_PES
``networks/ResNet.py``, LiJunnan1992/DivideMix ``PreResNet.py``), which departs from the paper's: a 3x3 stem
with BN and ReLU; blocks ``conv2(relu(bn2(conv1(pre)))) + shortcut(pre)``, ``pre = relu(bn1(x))`` (the
shortcut a bias-free 1x1 convolution when the shape changes); no BN-ReLU after the last stage, then global
average pooling and a linear head. The stages ``layer1`` ... ``layer4`` are LP-A3's default feature layers.
"""

from __future__ import annotations

from torch import Tensor, nn

__all__ = ["PreActResNet", "preact_resnet18"]


class _PreActBlock(nn.Module):
    def __init__(self, in_ch: int, out_ch: int, stride: int) -> None:
        super().__init__()
        self.bn1 = nn.BatchNorm2d(in_ch)
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_ch)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, 1, 1, bias=False)
        same = in_ch == out_ch and stride == 1
        self.shortcut = nn.Identity() if same else nn.Conv2d(in_ch, out_ch, 1, stride, bias=False)
        self.relu = nn.ReLU()

    def forward(self, x: Tensor) -> Tensor:
        pre = self.relu(self.bn1(x))
        return self.conv2(self.relu(self.bn2(self.conv1(pre)))) + self.shortcut(pre)


class PreActResNet(nn.Module):
    """PreAct ResNet with basic blocks (widths 64, 128, 256, 512; strides 1, 2, 2, 2).

    Args:
        blocks: blocks per stage (``(2, 2, 2, 2)`` for ResNet-18).
        num_classes: output classes.
        in_channels: input channels.

    Raises:
        ValueError: if ``blocks`` is not four positive ints.

    Example:
        >>> import torch
        >>> tuple(preact_resnet18(num_classes=10)(torch.zeros(2, 3, 32, 32)).shape)
        (2, 10)
    """

    def __init__(self, blocks: tuple[int, ...] = (2, 2, 2, 2), num_classes: int = 10, in_channels: int = 3) -> None:
        super().__init__()
        if len(blocks) != 4 or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in blocks):
            raise ValueError(f"`blocks` must be four positive ints, got {blocks!r}. Fix: (2, 2, 2, 2) for ResNet-18.")
        self.conv1 = nn.Conv2d(in_channels, 64, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU()
        in_ch = 64
        for stage, (width, count) in enumerate(zip((64, 128, 256, 512), blocks), start=1):
            layers = []
            for i in range(count):
                layers.append(_PreActBlock(in_ch, width, 2 if (i == 0 and stage > 1) else 1))
                in_ch = width
            setattr(self, f"layer{stage}", nn.Sequential(*layers))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.linear = nn.Linear(512, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.layer4(self.layer3(self.layer2(self.layer1(out))))
        return self.linear(self.pool(out).flatten(1))


def preact_resnet18(num_classes: int = 10, in_channels: int = 3) -> PreActResNet:
    """PreAct ResNet-18 of DivideMix's and PES's code (11,171,274 parameters at 10 classes)."""
    return PreActResNet((2, 2, 2, 2), num_classes, in_channels)
