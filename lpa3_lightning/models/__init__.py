"""Backbones of the paper's settings."""

from lpa3_lightning.models.resnet import medmnist_resnet, resnet18_medmnist, resnet50_medmnist
from lpa3_lightning.models.wrn import WideResNet, wrn28_2

__all__ = ["WideResNet", "medmnist_resnet", "resnet18_medmnist", "resnet50_medmnist", "wrn28_2"]
