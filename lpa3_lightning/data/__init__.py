"""Data loading for LP-A3: index-returning datasets and the MedMNIST data module."""

from lpa3_lightning.data.indexed import IndexedDataset
from lpa3_lightning.data.medmnist import EMBEDDED_DATA_DIR, MedMNISTDataModule
from lpa3_lightning.data.resumable import EpochPermutationSampler, ResumableDataLoader

__all__ = [
    "EMBEDDED_DATA_DIR", "EpochPermutationSampler", "IndexedDataset", "MedMNISTDataModule", "ResumableDataLoader",
]
