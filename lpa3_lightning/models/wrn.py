"""Wide-ResNet-28-k (Zagoruyko & Komodakis, BMVC 2016), FixMatch's and LP-A3's CIFAR backbone, and its
four-stage variant WRN-37-2 (LP-A3's STL-10 row), as in the FixMatch code the LP-A3 authors built on
(kekmodel/FixMatch-pytorch ``models/wideresnet.py``).

A 3x3 stem; stages ``block1``, ``block2``, ... (the default LP-A3 feature layers) of ``(depth - 4) / 6``
pre-activation blocks (BN-LeakyReLU(0.1)-conv3x3, twice), widths ``16k, 32k, 64k`` (``128k``), strides 1, 2,
2 (2); BN-LeakyReLU, global average pooling, a linear head. The first stage's first block pre-activates
its input for its convolution and 1x1 shortcut; the later stages' first blocks take the raw input (the
reference computes their ``bn1`` and discards it: left out, as an unused BN breaks DDP). BN momentum 0.001.
"""

from __future__ import annotations

from torch import Tensor, nn

__all__ = ["WideResNet", "wrn28_2", "wrn28_8", "wrn37_2"]

BN_MOMENTUM = 0.001


class _Block(nn.Module):
    """A basic block; a width change takes the pre-activated input (``first_of_stage="preactivated"``) or the raw."""

    def __init__(self, in_ch: int, out_ch: int, stride: int, dropout: float, first_of_stage: str | None) -> None:
        super().__init__()
        changes_width = in_ch != out_ch
        self.bn1 = None if changes_width and first_of_stage == "raw" else nn.BatchNorm2d(in_ch, momentum=BN_MOMENTUM)
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_ch, momentum=BN_MOMENTUM)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, 1, 1, bias=False)
        self.drop = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.shortcut = nn.Conv2d(in_ch, out_ch, 1, stride, bias=False) if changes_width else None
        self.act = nn.LeakyReLU(0.1)

    def forward(self, x: Tensor) -> Tensor:
        source = x if self.bn1 is None else self.act(self.bn1(x))
        out = self.conv2(self.drop(self.act(self.bn2(self.conv1(source)))))
        return out + (x if self.shortcut is None else self.shortcut(source))


class WideResNet(nn.Module):
    """WRN-depth-width for small images (32x32 CIFAR, STL-10 at any size).

    Args:
        num_classes: output classes.
        depth: 6n + 4 (28 in FixMatch): n blocks per stage.
        width: widening factor k (2 for CIFAR-10).
        in_channels: input channels.
        dropout: dropout inside blocks (0 in FixMatch).
        stages: 3 (WRN-28-k) or 4 (the four-stage variant: WRN-37-2 at depth 28, width 2).

    Raises:
        ValueError: for a ``depth`` that is not 6n + 4 or ``stages`` other than 3 or 4.

    Example:
        >>> import torch
        >>> tuple(wrn28_2(num_classes=10)(torch.zeros(2, 3, 32, 32)).shape)
        (2, 10)
    """

    def __init__(self, num_classes: int = 10, depth: int = 28, width: int = 2, in_channels: int = 3,
                 dropout: float = 0.0, stages: int = 3) -> None:
        super().__init__()
        if (depth - 4) % 6 or depth < 10:
            raise ValueError(f"`depth` must be 6n + 4 (e.g. 28), got {depth}.")
        if stages not in (3, 4):
            raise ValueError(f"`stages` must be 3 (WRN-28-k) or 4 (WRN-37-2), got {stages!r}.")
        n = (depth - 4) // 6
        widths = [16] + [16 * width * 2**s for s in range(stages)]
        self.conv = nn.Conv2d(in_channels, widths[0], 3, 1, 1, bias=False)
        for s in range(stages):
            first = "preactivated" if s == 0 else "raw"
            blocks = [_Block(widths[s], widths[s + 1], 1 if s == 0 else 2, dropout, first)]
            blocks += [_Block(widths[s + 1], widths[s + 1], 1, dropout, None) for _ in range(n - 1)]
            setattr(self, f"block{s + 1}", nn.Sequential(*blocks))
        self.stages = stages
        self.bn = nn.BatchNorm2d(widths[-1], momentum=BN_MOMENTUM)
        self.act = nn.LeakyReLU(0.1)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(widths[-1], num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="leaky_relu")
            elif isinstance(m, (nn.BatchNorm2d, nn.Linear)):  # BN (1, 0); the head Xavier-normal, zero bias
                nn.init.ones_(m.weight) if isinstance(m, nn.BatchNorm2d) else nn.init.xavier_normal_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, x: Tensor) -> Tensor:
        out = self.conv(x)
        for s in range(1, self.stages + 1):
            out = getattr(self, f"block{s}")(out)
        return self.fc(self.pool(self.act(self.bn(out))).flatten(1))


def wrn28_2(num_classes: int = 10, in_channels: int = 3) -> WideResNet:
    """WRN-28-2 (1.5 M parameters), FixMatch's CIFAR-10 backbone."""
    return WideResNet(num_classes, 28, 2, in_channels)


def wrn28_8(num_classes: int = 100, in_channels: int = 3) -> WideResNet:
    """WRN-28-8 (23.4 M parameters), FixMatch's and LP-A3's CIFAR-100 backbone."""
    return WideResNet(num_classes, 28, 8, in_channels)


def wrn37_2(num_classes: int = 10, in_channels: int = 3) -> WideResNet:
    """WRN-37-2: four stages of four blocks (widths 32, 64, 128, 256), LP-A3's STL-10 backbone."""
    return WideResNet(num_classes, 28, 2, in_channels, stages=4)
