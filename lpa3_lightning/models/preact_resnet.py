"""PreAct ResNet-18 (He et al., ECCV 2016, "Identity mappings in deep residual networks"), the
noisy-label backbone of DivideMix, PES and LP-A3's noisy-label rows, for 32x32 (and 28x28) images.

The structure is the one of those methods' reference code (PES: tmllab/2021_NeurIPS_PES
``networks/ResNet.py``; DivideMix: LiJunnan1992/DivideMix ``PreResNet.py``), which departs from
the paper's pre-activation network in three places that change the parameters or the function:

* the stem is a 3x3 convolution followed by BN and ReLU (no pooling);
* every block pre-activates its input, ``pre = relu(bn1(x))``, and its shortcut starts from
  ``pre`` (the identity shortcut carries ``pre``, not ``x``; a 1x1 convolution without BN when the
  shape changes), then ``conv2(relu(bn2(conv1(pre)))) + shortcut(pre)``;
* there is no BN-ReLU after the last stage: average pooling and a linear head follow it.

Four stages of two blocks with widths 64, 128, 256, 512 and strides 1, 2, 2, 2. At 32x32 (and
28x28) the last stage is 4x4, so the global average pooling used here equals the reference's
4x4 average pooling. Written from that description; ``tests/models/test_preact_resnet.py``
checks the layer order and the parameter count against a transcription of the reference's
structure. The stages are named ``layer1`` ... ``layer4`` (the default LP-A3 feature layers, as
the authors' PES code uses the four stage outputs); every BatchNorm is an ``nn.BatchNorm2d``, so
:func:`lpa3_lightning.core.dual_bn.convert_dual_bn` gives each a twin.
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
        self.shortcut = nn.Identity() if in_ch == out_ch and stride == 1 else \
            nn.Conv2d(in_ch, out_ch, 1, stride, bias=False)
        self.relu = nn.ReLU()

    def forward(self, x: Tensor) -> Tensor:
        pre = self.relu(self.bn1(x))
        return self.conv2(self.relu(self.bn2(self.conv1(pre)))) + self.shortcut(pre)


class PreActResNet(nn.Module):
    """PreAct ResNet with basic blocks, as in DivideMix's and PES's reference code.

    Args:
        blocks: blocks per stage (``(2, 2, 2, 2)`` for ResNet-18).
        num_classes: output classes.
        in_channels: input channels.

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
        widths, in_ch = (64, 128, 256, 512), 64
        for stage, (width, count) in enumerate(zip(widths, blocks), start=1):
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
