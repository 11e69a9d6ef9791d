"""The images of the semi-supervised and noisy-label modules: each source's facts, its files, and the
datasets over them, whose ``index`` is the position in the whole training set."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from medmnist.info import INFO
from PIL import Image
from torch.utils.data import Dataset

from lpa3_lightning.data.indexed import dataset_position, to_class_label
from lpa3_lightning.data.label_split import stratified_label_split
from lpa3_lightning.data.medmnist import EMBEDDED_DATA_DIR, SUPPORTED_FLAGS, MedMNISTDataModule, validate_flag

__all__ = ["MNIST5K_SPLIT_SEED", "SEMI_SUPERVISED_SOURCES", "SOURCE_FACTS", "TORCHVISION_SOURCES", "ImageArrays",
           "LabeledDataset", "UnlabeledDataset", "download_source", "load_mnist5k", "source_arrays", "source_facts",
           "validate_source"]

TORCHVISION_SOURCES = ("cifar10", "cifar100", "stl10")

#: Every ``source`` :class:`~lpa3_lightning.data.SemiSupervisedDataModule` accepts.
SEMI_SUPERVISED_SOURCES: tuple[str, ...] = ("mnist5k", *TORCHVISION_SOURCES, *SUPPORTED_FLAGS)

#: Seed of MNIST-5k's fixed 4,000 / 1,000 train / test split (it has no official one): every run tests alike.
MNIST5K_SPLIT_SEED = 0
_MNIST5K_FILE, _MNIST5K_MD5 = "mnist5k.npz", "11def57eb666ead6d8efa9a9ff9c2218"

_FACTS = ("num_classes", "in_channels", "image_size", "num_train", "mean", "std", "flip")
#: Per source: classes, channels, side, training-set (= unlabeled-set) size, mean/std of [0, 1] pixels, flip.
#: MNIST-5k's mean/std are its 5,000 images'; CIFAR's the LP-A3 authors' constants (CIFAR-10's std is the widely
#: copied one, not the data's): the model sees the inputs of their runs.
SOURCE_FACTS: dict[str, dict[str, Any]] = {name: dict(zip(_FACTS, facts)) for name, facts in {
    "mnist5k": (10, 1, 28, 4000, (0.1313,), (0.3086,), False),
    "cifar10": (10, 3, 32, 50000, (0.4914, 0.4822, 0.4465), (0.2023, 0.1994, 0.2010), True),
    "cifar100": (100, 3, 32, 50000, (0.5071, 0.4867, 0.4408), (0.2675, 0.2565, 0.2761), True),
    "stl10": (10, 3, 96, 105000, (0.4408, 0.4279, 0.3867), (0.2682, 0.2610, 0.2686), True),
}.items()}


def validate_source(source: Any) -> None:
    """Refuse a source not of :data:`SEMI_SUPERVISED_SOURCES` (ValueError naming them, or why a flag is refused)."""
    if isinstance(source, str) and source in INFO and source not in SUPPORTED_FLAGS:
        validate_flag(source)
    if not isinstance(source, str) or source not in SEMI_SUPERVISED_SOURCES:
        raise ValueError(f"Unknown `source` {source!r}. Fix: pass one of {', '.join(SEMI_SUPERVISED_SOURCES)}.")


def source_facts(source: str) -> dict[str, Any]:
    """Classes, channels, side, training-set size, mean/std of [0, 1] pixels and flip (not if a class has a side)."""
    if source in SOURCE_FACTS:
        return SOURCE_FACTS[source]
    info = INFO[source]
    channels = int(info["n_channels"])
    sided = any(side in name for name in info["label"].values() for side in ("left", "right"))
    return dict(zip(_FACTS, (len(info["label"]), channels, 28, int(info["n_samples"]["train"]), (0.5,) * channels,
                             (0.5,) * channels, not sided)))


def load_mnist5k(root: str | os.PathLike | None = None) -> dict[str, np.ndarray]:
    """MNIST-5k (500 digits per class) from ``root`` (None: embedded), split as :data:`MNIST5K_SPLIT_SEED` draws.

    Returns:
        ``train_images`` ``(4000, 28, 28)`` uint8, ``train_labels`` int64, ``test_images``, ``test_labels``, and
        ``train_file_indices`` / ``test_file_indices`` (the positions in the file).

    Raises:
        FileNotFoundError: for a missing file (naming the path and the fix).
        ValueError: for a file of other arrays.
    """
    path = (Path(root).expanduser() if root is not None else EMBEDDED_DATA_DIR) / _MNIST5K_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"MNIST-5k file not found: {path}. It cannot be downloaded. Fix: pass root=None to use the copy "
            f"embedded in the package, or root= a folder holding {_MNIST5K_FILE} (MD5 {_MNIST5K_MD5}).")
    with np.load(path) as data:
        if "images" not in data.files or "labels" not in data.files:
            raise ValueError(f"{path} lacks the arrays 'images' and 'labels' (has {data.files}). Fix: use the "
                             f"original {_MNIST5K_FILE} (MD5 {_MNIST5K_MD5}).")
        images, labels = data["images"], data["labels"].astype(np.int64).reshape(-1)
    if images.shape[1:] != (28, 28) or images.dtype != np.uint8 or len(images) != len(labels):
        raise ValueError(f"{path} must hold uint8 images (N, 28, 28) and N labels, got {images.dtype} "
                         f"{images.shape} and {labels.shape}. Fix: use the original {_MNIST5K_FILE}.")
    test = stratified_label_split(labels, 1000, 10, MNIST5K_SPLIT_SEED)
    train = np.setdiff1d(np.arange(len(labels)), test)
    return {"train_images": images[train], "train_labels": labels[train], "test_images": images[test],
            "test_labels": labels[test], "train_file_indices": train, "test_file_indices": test}


def _torchvision_files(source: str, root: Path) -> tuple[Any, list[Path]]:
    from torchvision import datasets
    cls = {"cifar10": datasets.CIFAR10, "cifar100": datasets.CIFAR100, "stl10": datasets.STL10}[source]
    folder = root / cls.base_folder
    return cls, [folder / name for name, _ in (*cls.train_list, *cls.test_list) if not (folder / name).is_file()]


def _download_torchvision(source: str, root: Path) -> None:
    cls, missing = _torchvision_files(source, root)
    if not missing:
        return
    root.mkdir(parents=True, exist_ok=True)
    try:
        cls(os.fspath(root), **({"split": "train"} if source == "stl10" else {"train": True}), download=True)
    except Exception as err:  # network errors come in many types
        raise RuntimeError(
            f"Downloading {source} from {cls.url} into {root} failed ({type(err).__name__}: {err}). Fix: on a machine "
            f"without internet access, download {cls.filename} elsewhere and extract it into {root}, then pass "
            "download=False.") from err


def _torchvision_arrays(source: str, root: Path, split: str, download: bool) -> list[tuple[np.ndarray, np.ndarray]]:
    cls, missing = _torchvision_files(source, root)
    if missing and download:
        _download_torchvision(source, root)
        missing = _torchvision_files(source, root)[1]
    if missing:
        more = f" (and {len(missing) - 1} more file(s) there)" if len(missing) > 1 else ""
        raise FileNotFoundError(
            f"{source} file not found: {missing[0]}{more}. Fix: pass download=True on a machine with internet access "
            f"(it fetches {cls.url} into {root}), or extract {cls.filename} into {root} so that "
            f"{root / cls.base_folder} holds the files.")
    try:
        if source == "stl10":  # the training split: its labeled and unlabeled parts
            parts = [cls(os.fspath(root), split=name, download=False)
                     for name in (("train", "unlabeled") if split == "train" else ("test",))]
            return [(ds.data.transpose(0, 2, 3, 1), np.asarray(ds.labels, dtype=np.int64)) for ds in parts]
        ds = cls(os.fspath(root), train=split == "train", download=False)
    except RuntimeError as err:
        raise FileNotFoundError(f"{source} files in {root / cls.base_folder} are damaged ({err}). Fix: delete that "
                                f"folder and pass download=True, or extract a fresh {cls.filename} into {root}."
                                ) from err
    return [(ds.data, np.asarray(ds.targets, dtype=np.int64))]


def download_source(source: str, root: Path | None) -> None:
    """Download the missing files of ``source`` into ``root`` (mnist5k ships with the package).

    Raises:
        RuntimeError: for a failed download, naming the way offline.
    """
    if source in TORCHVISION_SOURCES:
        _download_torchvision(source, root)  # type: ignore[arg-type]
    elif source != "mnist5k":
        MedMNISTDataModule(source, root=None if root is None else os.fspath(root), download=True).prepare_data()


def source_arrays(source: str, root: Path | None, split: str, download: bool = False
                  ) -> dict[str, list[tuple[np.ndarray, np.ndarray]]]:
    """``{split: [(images, labels), ...]}`` of ``split`` (for mnist5k both splits); ``root`` None: embedded.

    Raises:
        FileNotFoundError: for a missing or damaged file, naming the path and the fix.
    """
    if source == "mnist5k":
        data = load_mnist5k(root)
        return {"train": [(data["train_images"], data["train_labels"])],
                "test": [(data["test_images"], data["test_labels"])]}
    if source in TORCHVISION_SOURCES:
        return {split: _torchvision_arrays(source, root, split, download)}  # type: ignore[arg-type]
    module = MedMNISTDataModule(source, root=None if root is None else os.fspath(root), download=download)
    module._ensure_file()  # names the path and the fix when the file is missing
    with np.load(module.data_file) as data:
        return {split: [(data[f"{split}_images"], data[f"{split}_labels"].reshape(-1))]}


class ImageArrays(Dataset):
    """``(PIL image, label)`` pairs of uint8 ``(N, H, W)`` or ``(N, H, W, C)`` images and ``(N,)`` labels (-1: none),
    ``parts`` concatenated, ``transform`` applied to the image.

    Raises:
        ValueError: for a part with other numbers of images and labels.
    """

    def __init__(self, parts: Sequence[tuple[np.ndarray, np.ndarray]],
                 transform: Callable[[Any], Any] | None = None) -> None:
        self.parts = [(images, np.asarray(labels, dtype=np.int64).reshape(-1)) for images, labels in parts]
        for images, labels in self.parts:
            if len(images) != len(labels):
                raise ValueError(f"{len(images)} images but {len(labels)} labels.")
        self.offsets = np.cumsum([0] + [len(labels) for _, labels in self.parts])
        self.transform = transform

    def __len__(self) -> int:
        return int(self.offsets[-1])

    @property
    def labels(self) -> np.ndarray:
        return np.concatenate([labels for _, labels in self.parts])

    def __getitem__(self, index: Any) -> tuple[Any, int]:
        position = dataset_position(index, len(self), "ImageArrays")
        part = int(np.searchsorted(self.offsets, position, side="right")) - 1
        images, labels = self.parts[part]
        pixels = np.ascontiguousarray(images[position - self.offsets[part]])
        if pixels.ndim == 3 and pixels.shape[-1] == 1:
            pixels = pixels[..., 0]
        img = Image.fromarray(pixels)
        return (self.transform(img) if self.transform is not None else img), int(labels[position - self.offsets[part]])


class LabeledDataset(Dataset):
    """The labeled subset: ``(transform(image), label, index)`` of the ``indices`` of ``base``.

    Raises:
        ValueError: for indices outside ``base``.
    """

    def __init__(self, base: Any, indices: np.ndarray | Sequence[int],
                 transform: Callable[[Any], Any] | None = None) -> None:
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if idx.size and (idx.min() < 0 or idx.max() >= len(base)):
            raise ValueError(f"`indices` must lie in [0, {len(base)}) (the size of `base`), got values in "
                             f"[{idx.min()}, {idx.max()}]. Fix: pass positions in the training set.")
        self.base, self.indices, self.transform = base, idx, transform

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: Any) -> tuple[Any, torch.Tensor, int]:
        j = int(self.indices[dataset_position(index, len(self), "LabeledDataset")])
        image, label = self.base[j]
        return (self.transform(image) if self.transform is not None else image), to_class_label(label), j


class UnlabeledDataset(Dataset):
    """The unlabeled stream: ``(weak(image), strong(image), index)`` of ``base``'s ``(image, label)`` pairs."""

    def __init__(self, base: Any, weak: Callable[[Any], Any], strong: Callable[[Any], Any]) -> None:
        self.base, self.weak, self.strong = base, weak, strong

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: Any) -> tuple[Any, Any, int]:
        position = dataset_position(index, len(self), "UnlabeledDataset")
        image, _ = self.base[position]
        return self.weak(image), self.strong(image), position
