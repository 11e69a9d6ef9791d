"""Backbones of the paper's settings."""

from lpa3_lightning.models.preact_resnet import PreActResNet, preact_resnet18
from lpa3_lightning.models.resnet import medmnist_resnet, resnet18_medmnist, resnet50_medmnist
from lpa3_lightning.models.small_cnn import SmallCNN, small_cnn
from lpa3_lightning.models.wrn import WideResNet, wrn28_2, wrn28_8, wrn37_2

__all__ = ["PreActResNet", "SmallCNN", "WideResNet", "medmnist_resnet", "preact_resnet18", "resnet18_medmnist",
           "resnet50_medmnist", "small_cnn", "wrn28_2", "wrn28_8", "wrn37_2"]
