"""Where the semi-supervised data sets come from: the facts of each source known before any file
is read (classes, channels, side, training-set size, normalisation), and the torchvision sources
(CIFAR-10/100, STL-10) found on disk, downloaded when asked, or refused with the path and the fix.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
from medmnist.info import INFO

from lpa3_lightning.data.medmnist import SUPPORTED_FLAGS, validate_flag

__all__ = ["SEMI_SUPERVISED_SOURCES", "SOURCE_FACTS", "TORCHVISION_SOURCES", "download_source", "download_torchvision",
           "missing_torchvision_files", "source_arrays", "source_facts", "torchvision_arrays", "torchvision_class",
           "torchvision_not_found", "validate_source"]

TORCHVISION_SOURCES = ("cifar10", "cifar100", "stl10")

#: Every ``source`` :class:`~lpa3_lightning.data.SemiSupervisedDataModule` accepts.
SEMI_SUPERVISED_SOURCES: tuple[str, ...] = ("mnist5k", *TORCHVISION_SOURCES, *SUPPORTED_FLAGS)

# Static facts per source, known before any file is read: classes, channels, side, size of
# the training set (= the unlabeled set), per-channel mean/std of [0, 1] pixels.
SOURCE_FACTS: dict[str, dict[str, Any]] = {
    # mean/std measured on the 5,000 images of mnist5k.npz.
    "mnist5k": {"num_classes": 10, "in_channels": 1, "image_size": 28, "num_train": 4000,
                "mean": (0.1313,), "std": (0.3086,), "flip": False},
    # The LP-A3 authors' constants, the same in their FixMatch, PES and DivideMix code
    # (CausalLearning/LPA3 FixMatch/dataset/make_data.py lines 16-21; PES/PES_LPA3.py line 368;
    # LiJunnan1992/DivideMix dataloader_cifar.py line 149). CIFAR-10's std is the widely copied
    # (0.2023, 0.1994, 0.2010), not the data's (0.2470, 0.2435, 0.2616): the model sees the
    # same inputs as in their runs, and LP-A3's input box follows.
    "cifar10": {"num_classes": 10, "in_channels": 3, "image_size": 32, "num_train": 50000,
                "mean": (0.4914, 0.4822, 0.4465), "std": (0.2023, 0.1994, 0.2010), "flip": True},
    "cifar100": {"num_classes": 100, "in_channels": 3, "image_size": 32, "num_train": 50000,
                 "mean": (0.5071, 0.4867, 0.4408), "std": (0.2675, 0.2565, 0.2761), "flip": True},
    # train (5,000 labeled) + unlabeled (100,000) images, as in FixMatch.
    "stl10": {"num_classes": 10, "in_channels": 3, "image_size": 96, "num_train": 105000,
              "mean": (0.4408, 0.4279, 0.3867), "std": (0.2682, 0.2610, 0.2686), "flip": True},
}


def validate_source(source: Any) -> None:
    """Refuse a source that is not one of :data:`SEMI_SUPERVISED_SOURCES`, naming them."""
    if isinstance(source, str) and source in INFO and source not in SUPPORTED_FLAGS:
        validate_flag(source)  # its message says why (3D / multi-label)
    if not isinstance(source, str) or source not in SEMI_SUPERVISED_SOURCES:
        raise ValueError(f"Unknown `source` {source!r}. Fix: pass one of {', '.join(SEMI_SUPERVISED_SOURCES)}.")


def source_facts(source: str) -> dict[str, Any]:
    """Classes, channels, side, training-set size, mean/std of [0, 1] pixels, and whether to flip."""
    if source in SOURCE_FACTS:
        return SOURCE_FACTS[source]
    info = INFO[source]
    channels = int(info["n_channels"])
    sided = any(side in name for name in info["label"].values() for side in ("left", "right"))
    return {"num_classes": len(info["label"]), "in_channels": channels, "image_size": 28,
            "num_train": int(info["n_samples"]["train"]), "mean": (0.5,) * channels, "std": (0.5,) * channels,
            "flip": not sided}


def torchvision_class(source: str) -> type:
    from torchvision import datasets
    return {"cifar10": datasets.CIFAR10, "cifar100": datasets.CIFAR100, "stl10": datasets.STL10}[source]


def missing_torchvision_files(source: str, root: Path) -> list[Path]:
    cls = torchvision_class(source)
    folder = root / cls.base_folder
    return [folder / name for name, _ in (*cls.train_list, *cls.test_list) if not (folder / name).is_file()]


def torchvision_not_found(source: str, root: Path, missing: list[Path]) -> FileNotFoundError:
    cls = torchvision_class(source)
    more = f" (and {len(missing) - 1} more file(s) there)" if len(missing) > 1 else ""
    return FileNotFoundError(
        f"{source} file not found: {missing[0]}{more}. Fix: pass download=True on a machine with internet access "
        f"(it fetches {cls.url} into {root}), or extract {cls.filename} into {root} so that "
        f"{root / cls.base_folder} holds the files."
    )


def download_torchvision(source: str, root: Path) -> None:
    """Fetch a torchvision source's training files into ``root`` unless they are there."""
    if not missing_torchvision_files(source, root):
        return
    cls = torchvision_class(source)
    root.mkdir(parents=True, exist_ok=True)
    try:
        if source == "stl10":
            cls(os.fspath(root), split="train", download=True)
        else:
            cls(os.fspath(root), train=True, download=True)
    except Exception as err:  # network errors come in many types
        raise RuntimeError(
            f"Downloading {source} from {cls.url} into {root} failed ({type(err).__name__}: {err}). "
            f"Fix: on a machine without internet access, download {cls.filename} elsewhere and extract it into "
            f"{root}, then pass download=False."
        ) from err


def torchvision_arrays(source: str, root: Path, split: str, download: bool) -> list[tuple[np.ndarray, np.ndarray]]:
    """``(images HWC uint8, labels)`` parts of ``split`` of a torchvision source (STL-10's training
    split: its labeled and unlabeled parts)."""
    missing = missing_torchvision_files(source, root)
    if missing and download:
        download_torchvision(source, root)
        missing = missing_torchvision_files(source, root)
    if missing:
        raise torchvision_not_found(source, root, missing)
    cls = torchvision_class(source)
    try:
        if source == "stl10":
            names = ("train", "unlabeled") if split == "train" else ("test",)
            parts = []
            for name in names:
                ds = cls(os.fspath(root), split=name, download=False)
                parts.append((ds.data.transpose(0, 2, 3, 1), np.asarray(ds.labels, dtype=np.int64)))
            return parts
        ds = cls(os.fspath(root), train=split == "train", download=False)
    except RuntimeError as err:
        raise FileNotFoundError(
            f"{source} files in {root / cls.base_folder} are damaged ({err}). Fix: delete that folder "
            f"and pass download=True, or extract a fresh {cls.filename} into {root}."
        ) from err
    return [(ds.data, np.asarray(ds.targets, dtype=np.int64))]


def download_source(source: str, root: Path | None) -> None:
    """Download the missing files of ``source`` into ``root`` (mnist5k ships with the package)."""
    if source == "mnist5k":
        return
    if source in TORCHVISION_SOURCES:
        download_torchvision(source, root)  # type: ignore[arg-type]
    else:
        from lpa3_lightning.data.medmnist import MedMNISTDataModule

        MedMNISTDataModule(source, root=None if root is None else os.fspath(root), download=True).prepare_data()


def source_arrays(source: str, root: Path | None, split: str, download: bool = False
                  ) -> dict[str, list[tuple[np.ndarray, np.ndarray]]]:
    """``{split: [(images, labels), ...]}`` of a source's files (images HW or HWC uint8): the split
    asked for, and for mnist5k both of its splits (one file holds them). ``root`` None: the
    folder embedded in the package.

    Raises:
        FileNotFoundError: naming the path and the fix, when a file is missing.
    """
    if source == "mnist5k":
        from lpa3_lightning.data.ssl_datasets import load_mnist5k

        data = load_mnist5k(root)
        return {"train": [(data["train_images"], data["train_labels"])],
                "test": [(data["test_images"], data["test_labels"])]}
    if source in TORCHVISION_SOURCES:
        return {split: torchvision_arrays(source, root, split, download)}  # type: ignore[arg-type]
    from lpa3_lightning.data.medmnist import MedMNISTDataModule

    module = MedMNISTDataModule(source, root=None if root is None else os.fspath(root), download=download)
    module._ensure_file()  # names the path and the fix when the file is missing
    with np.load(module.data_file) as data:
        return {split: [(data[f"{split}_images"], data[f"{split}_labels"].reshape(-1))]}
