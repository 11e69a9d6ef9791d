"""Wide-ResNet-28-k (Zagoruyko & Komodakis, BMVC 2016), the backbone family of FixMatch and
LP-A3's CIFAR rows.

Pre-activation basic blocks (BN-LeakyReLU-conv3x3), three stages of ``(depth - 4) / 6`` blocks
with widths ``16k, 32k, 64k``. Written from the paper, not a copy of FixMatch's network: its
first blocks of stages 2 and 3 and its weight initialisation differ in details. The stages
are named ``block1``, ``block2``, ``block3``: the default LP-A3 feature layers
(:func:`lpa3_lightning.features.default_feature_layers`), as the authors use the outputs of
the three WRN blocks. BatchNorm momentum 0.001 as in the
FixMatch / LP-A3 WRN (docs/method.md).
"""

from __future__ import annotations

from torch import Tensor, nn

__all__ = ["WideResNet", "wrn28_2", "wrn28_8"]

BN_MOMENTUM = 0.001


class _Block(nn.Module):
    def __init__(self, in_ch: int, out_ch: int, stride: int, dropout: float) -> None:
        super().__init__()
        self.bn1 = nn.BatchNorm2d(in_ch, momentum=BN_MOMENTUM)
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_ch, momentum=BN_MOMENTUM)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, 1, 1, bias=False)
        self.drop = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.shortcut = None if in_ch == out_ch and stride == 1 else nn.Conv2d(in_ch, out_ch, 1, stride, bias=False)
        self.act = nn.LeakyReLU(0.1)

    def forward(self, x: Tensor) -> Tensor:
        pre = self.act(self.bn1(x))
        out = self.conv1(pre)
        out = self.conv2(self.drop(self.act(self.bn2(out))))
        return out + (x if self.shortcut is None else self.shortcut(pre))


class WideResNet(nn.Module):
    """WRN-depth-width for small images (32x32 CIFAR / STL crops, any size works).

    Args:
        num_classes: output classes.
        depth: 6n + 4 (28 in FixMatch).
        width: widening factor k (2 for CIFAR-10).
        in_channels: input channels.
        dropout: dropout inside blocks (0 in FixMatch).

    Example:
        >>> import torch
        >>> tuple(wrn28_2(num_classes=10)(torch.zeros(2, 3, 32, 32)).shape)
        (2, 10)
    """

    def __init__(self, num_classes: int = 10, depth: int = 28, width: int = 2, in_channels: int = 3,
                 dropout: float = 0.0) -> None:
        super().__init__()
        if (depth - 4) % 6 or depth < 10:
            raise ValueError(f"`depth` must be 6n + 4 (e.g. 28), got {depth}.")
        n = (depth - 4) // 6
        widths = [16, 16 * width, 32 * width, 64 * width]
        self.conv = nn.Conv2d(in_channels, widths[0], 3, 1, 1, bias=False)
        self.block1 = self._stage(widths[0], widths[1], n, 1, dropout)
        self.block2 = self._stage(widths[1], widths[2], n, 2, dropout)
        self.block3 = self._stage(widths[2], widths[3], n, 2, dropout)
        self.bn = nn.BatchNorm2d(widths[3], momentum=BN_MOMENTUM)
        self.act = nn.LeakyReLU(0.1)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(widths[3], num_classes)

    @staticmethod
    def _stage(in_ch: int, out_ch: int, n: int, stride: int, dropout: float) -> nn.Sequential:
        return nn.Sequential(*[_Block(in_ch if i == 0 else out_ch, out_ch, stride if i == 0 else 1, dropout)
                               for i in range(n)])

    def forward(self, x: Tensor) -> Tensor:
        out = self.block3(self.block2(self.block1(self.conv(x))))
        return self.fc(self.pool(self.act(self.bn(out))).flatten(1))


def wrn28_2(num_classes: int = 10, in_channels: int = 3) -> WideResNet:
    """WRN-28-2 (1.5 M parameters), FixMatch's CIFAR-10 backbone."""
    return WideResNet(num_classes, 28, 2, in_channels)


def wrn28_8(num_classes: int = 100, in_channels: int = 3) -> WideResNet:
    """WRN-28-8 (23.4 M parameters), FixMatch's and LP-A3's CIFAR-100 backbone."""
    return WideResNet(num_classes, 28, 8, in_channels)
