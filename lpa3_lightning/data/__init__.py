"""Data loading for LP-A3: index-returning datasets, the image-folder, MedMNIST and semi-supervised data
modules, synthetic label noise."""

from lpa3_lightning.data.image_folder import ImageFolderDataModule
from lpa3_lightning.data.indexed import IndexedDataset
from lpa3_lightning.data.label_noise import ASYMMETRIC_MAPPINGS, load_noisy_labels, noisy_labels, save_noisy_labels
from lpa3_lightning.data.label_split import load_label_split, save_label_split, stratified_label_split
from lpa3_lightning.data.medmnist import EMBEDDED_DATA_DIR, MedMNISTDataModule
from lpa3_lightning.data.noisy_labels import NOISY_LABEL_SOURCES, NoisyLabelDataModule, TwoViewNoisyDataset
from lpa3_lightning.data.semi_supervised import SEMI_SUPERVISED_SOURCES, SemiSupervisedDataModule
from lpa3_lightning.data.split_batches import SplitBalancedSampler
from lpa3_lightning.data.ssl_datasets import LabeledDataset, UnlabeledDataset, load_mnist5k
from lpa3_lightning.data.ssl_transforms import (
    Cutout,
    FixMatchRandAugment,
    eval_transform,
    strong_transform,
    weak_transform,
)
from lpa3_lightning.data.train_loader import EpochSampler, train_loader

__all__ = [
    "ASYMMETRIC_MAPPINGS", "NOISY_LABEL_SOURCES", "NoisyLabelDataModule", "TwoViewNoisyDataset", "load_noisy_labels",
    "noisy_labels", "save_noisy_labels",
    "Cutout", "EMBEDDED_DATA_DIR", "EpochSampler", "FixMatchRandAugment", "ImageFolderDataModule", "IndexedDataset",
    "LabeledDataset",
    "MedMNISTDataModule", "SEMI_SUPERVISED_SOURCES", "SemiSupervisedDataModule", "SplitBalancedSampler",
    "UnlabeledDataset", "eval_transform",
    "load_label_split", "load_mnist5k", "save_label_split", "stratified_label_split", "strong_transform",
    "train_loader", "weak_transform",
]
