"""Backbones of the paper's settings."""

from lpa3_lightning.models.resnet import medmnist_resnet, resnet18_medmnist, resnet50_medmnist

__all__ = ["medmnist_resnet", "resnet18_medmnist", "resnet50_medmnist"]
