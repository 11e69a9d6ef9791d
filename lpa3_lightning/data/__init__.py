"""Data for LP-A3: index-returning datasets, resumable samplers, data modules, label splits and noise. Each name
loads with its module on first use: ``IndexedDataset``, ``train_loader`` and ``noisy_labels`` without Lightning."""

from __future__ import annotations

import importlib
from typing import Any

#: every public name and the module that holds it
_WHERE = {name: module for module, names in {
    "image_folder": "ImageFolderDataModule", "indexed": "IndexedDataset",
    "label_noise": "ASYMMETRIC_MAPPINGS load_noisy_labels noisy_labels save_noisy_labels",
    "label_split": "load_label_split save_label_split stratified_label_split",
    "medmnist": "EMBEDDED_DATA_DIR MedMNISTDataModule",
    "noisy_labels": "NOISY_LABEL_SOURCES NoisyLabelDataModule TwoViewNoisyDataset",
    "sampling": "EpochSampler SplitBalancedSampler train_loader", "semi_supervised": "SemiSupervisedDataModule",
    "ssl_datasets": "LabeledDataset SEMI_SUPERVISED_SOURCES UnlabeledDataset load_mnist5k",
    "ssl_transforms": "Cutout FixMatchRandAugment eval_transform strong_transform weak_transform",
}.items() for name in names.split()}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'lpa3_lightning.data' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"lpa3_lightning.data.{_WHERE[name]}"), name)
    globals()[name] = value  # (the next lookup finds it directly)
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
