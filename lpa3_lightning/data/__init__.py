"""Data loading for LP-A3: index-returning datasets, the image-folder, MedMNIST and semi-supervised data
modules, synthetic label noise.

Each name loads with its module on first use, so the datasets, samplers and noise helpers a plain
PyTorch loop needs (``IndexedDataset``, ``train_loader``, ``noisy_labels``) import without Lightning;
the data modules import it.
"""

from __future__ import annotations

import importlib
from typing import Any

# the function, bound here once: the submodule of the same name (imported by the data modules) would
# otherwise take the name when it is first imported
from lpa3_lightning.data.train_loader import EpochSampler, train_loader

#: every public name and the module that holds it
_WHERE = {
    "ImageFolderDataModule": "image_folder",
    "IndexedDataset": "indexed",
    "ASYMMETRIC_MAPPINGS": "label_noise", "load_noisy_labels": "label_noise", "noisy_labels": "label_noise",
    "save_noisy_labels": "label_noise",
    "load_label_split": "label_split", "save_label_split": "label_split", "stratified_label_split": "label_split",
    "EMBEDDED_DATA_DIR": "medmnist", "MedMNISTDataModule": "medmnist",
    "NOISY_LABEL_SOURCES": "noisy_labels", "NoisyLabelDataModule": "noisy_labels",
    "TwoViewNoisyDataset": "noisy_labels",
    "SEMI_SUPERVISED_SOURCES": "semi_supervised", "SemiSupervisedDataModule": "semi_supervised",
    "SplitBalancedSampler": "split_batches",
    "LabeledDataset": "ssl_datasets", "UnlabeledDataset": "ssl_datasets", "load_mnist5k": "ssl_datasets",
    "Cutout": "ssl_transforms", "FixMatchRandAugment": "ssl_transforms", "eval_transform": "ssl_transforms",
    "strong_transform": "ssl_transforms", "weak_transform": "ssl_transforms",
}

__all__ = sorted([*_WHERE, "EpochSampler", "train_loader"])


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'lpa3_lightning.data' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"lpa3_lightning.data.{_WHERE[name]}"), name)
    globals()[name] = value  # (the next lookup finds it directly)
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
