"""The semi-supervised images: MNIST-5k embedded with its fixed split, the torchvision files, the labeled and
unlabeled datasets."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch
from PIL import Image

from lpa3_lightning.data import (
    EMBEDDED_DATA_DIR,
    LabeledDataset,
    SemiSupervisedDataModule,
    UnlabeledDataset,
    load_mnist5k,
    strong_transform,
    weak_transform,
)

MNIST5K_MD5 = "11def57eb666ead6d8efa9a9ff9c2218"


def test_embedded_mnist5k_file_license_and_fixed_split():
    path = EMBEDDED_DATA_DIR / "mnist5k.npz"
    assert hashlib.md5(path.read_bytes()).hexdigest() == MNIST5K_MD5
    assert "CC BY-SA 3.0" in (EMBEDDED_DATA_DIR / "LICENSE-mnist").read_text()
    assert "mnist5k.npz" in (EMBEDDED_DATA_DIR / "README.md").read_text()
    data = load_mnist5k()
    assert data["train_images"].shape == (4000, 28, 28) and data["test_images"].shape == (1000, 28, 28)
    assert np.bincount(data["test_labels"]).tolist() == [100] * 10
    assert np.bincount(data["train_labels"]).tolist() == [400] * 10
    assert not np.intersect1d(data["train_file_indices"], data["test_file_indices"]).size
    np.testing.assert_array_equal(load_mnist5k()["test_file_indices"], data["test_file_indices"])  # fixed


def test_missing_mnist5k_names_path_and_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="mnist5k.npz") as info:
        SemiSupervisedDataModule("mnist5k", root=str(tmp_path)).setup("fit")
    assert str(tmp_path) in str(info.value) and "root=None" in str(info.value)


def test_missing_cifar_file_offline_names_the_path(tmp_path):
    dm = SemiSupervisedDataModule("cifar10", root=str(tmp_path), num_labels=40)
    with pytest.raises(FileNotFoundError) as info:
        dm.setup("fit")
    message = str(info.value)
    assert str(tmp_path / "cifar-10-batches-py" / "data_batch_1") in message
    assert "download=True" in message and "cifar-10-python.tar.gz" in message


def test_labeled_and_unlabeled_datasets_return_whole_set_indices():
    base = [(Image.new("L", (28, 28), color=k), k % 3) for k in range(9)]
    norm = ([0.5], [0.5])
    labeled = LabeledDataset(base, [2, 7], weak_transform(*norm, 28, flip=False))
    x, y, i = labeled[1]
    assert x.shape == (1, 28, 28) and y.dtype == torch.long and int(y) == 1 and i == 7
    xw, xs, j = UnlabeledDataset(base, weak_transform(*norm, 28), strong_transform(*norm, 28))[4]
    assert xw.shape == xs.shape == (1, 28, 28) and j == 4
    with pytest.raises(ValueError, match="indices"):
        LabeledDataset(base, [9], None)
