"""Data for semi-supervised training in the FixMatch setting (few labels, many unlabeled images).

FixMatch (Sohn et al., NeurIPS 2020) trains on two streams at once: a small labeled subset,
drawn equally from every class, seen through a *weak* augmentation (flip and translation),
and the whole training set without its labels, seen through a weak and a *strong* view
(weak + RandAugment + Cutout). The model's confident prediction on the weak view becomes the
pseudo-label of the strong one. This module provides the pieces:

* :mod:`lpa3_lightning.data.label_split` draws the labeled subset (equal per class, seeded)
  and keeps it in a small JSON file;
* :mod:`lpa3_lightning.data.ssl_transforms` builds the weak, strong and evaluation views;
* :class:`LabeledDataset` and :class:`UnlabeledDataset` return ``(x, y, index)`` and
  ``(x_weak, x_strong, index)``, ``index`` being the position in the whole training set
  (LP-A3 keeps per-sample state keyed by it);
* :class:`SemiSupervisedDataModule` puts them together for MNIST-5k (embedded in the
  package), the 2D MedMNIST data sets, CIFAR-10/100 and STL-10.

Written from the FixMatch paper's description, not from its code.
"""

from __future__ import annotations

import math
import operator
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.combined_loader import CombinedLoader
from medmnist.info import INFO
from PIL import Image
from torch.utils.data import DataLoader, Dataset, RandomSampler, Sampler
from torchvision import transforms

from lpa3_lightning.data.indexed import IndexedDataset, to_class_label
from lpa3_lightning.data.label_split import (
    check_int,
    check_num_labels,
    load_label_split,
    save_label_split,
    stratified_label_split,
)
from lpa3_lightning.data.ssl_transforms import (
    STRONG_AUGMENTS, Cutout, FixMatchRandAugment, eval_transform, strong_transform, weak_transform,
)
from lpa3_lightning.data.medmnist import EMBEDDED_DATA_DIR, SUPPORTED_FLAGS, MedMNISTDataModule

__all__ = [
    "Cutout",
    "FixMatchRandAugment",
    "LabeledDataset",
    "MNIST5K_SPLIT_SEED",
    "SEMI_SUPERVISED_SOURCES",
    "SemiSupervisedDataModule",
    "UnlabeledDataset",
    "eval_transform",
    "load_label_split",
    "load_mnist5k",
    "save_label_split",
    "stratified_label_split",
    "strong_transform",
    "weak_transform",
]

#: Seed of the fixed stratified 4,000 / 1,000 train / test split of MNIST-5k (it has no
#: official split). Independent of the label-split seed, so every run tests on the same images.
MNIST5K_SPLIT_SEED = 0
_MNIST5K_FILE = "mnist5k.npz"
_MNIST5K_MD5 = "11def57eb666ead6d8efa9a9ff9c2218"
_MNIST5K_TEST_PER_CLASS = 100

_TORCHVISION_SOURCES = ("cifar10", "cifar100", "stl10")

#: Every ``source`` :class:`SemiSupervisedDataModule` accepts.
SEMI_SUPERVISED_SOURCES: tuple[str, ...] = ("mnist5k", *_TORCHVISION_SOURCES, *SUPPORTED_FLAGS)

# Static facts per source, known before any file is read: classes, channels, side, size of
# the training set (= the unlabeled set), per-channel mean/std of [0, 1] pixels.
_SOURCE_FACTS: dict[str, dict[str, Any]] = {
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





# ----------------------------------------------------------------------------------------
# Data sets
# ----------------------------------------------------------------------------------------
def _position(index: Any, size: int, owner: str) -> int:
    try:
        position = operator.index(index)
    except TypeError:
        raise TypeError(f"{owner} indices must be integers, got {type(index).__name__}.") from None
    if position < 0:
        position += size
    if not 0 <= position < size:
        raise IndexError(f"index {index} is out of range for a {owner} of size {size}")
    return position


class _ImageArrays(Dataset):
    """``(image, label)`` pairs from uint8 image arrays, as PIL images (``L`` or ``RGB``).

    ``parts`` are ``(images, labels)`` pairs concatenated in order (STL-10's train and
    unlabeled splits); images are ``(N, H, W)`` or ``(N, H, W, C)``, labels ``(N,)`` with -1
    for an image without a label. ``transform`` (optional) is applied to the PIL image.
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
        """All labels in order (-1 for unlabeled images)."""
        return np.concatenate([labels for _, labels in self.parts])

    def __getitem__(self, index: Any) -> tuple[Any, int]:
        position = _position(index, len(self), "data set")
        part = int(np.searchsorted(self.offsets, position, side="right")) - 1
        images, labels = self.parts[part]
        pixels = np.ascontiguousarray(images[position - self.offsets[part]])
        if pixels.ndim == 3 and pixels.shape[-1] == 1:
            pixels = pixels[..., 0]
        img = Image.fromarray(pixels)
        return (self.transform(img) if self.transform is not None else img), int(labels[position - self.offsets[part]])


class LabeledDataset(Dataset):
    """The labeled subset: ``(x, y, index)`` with ``x = transform(image)`` and ``index`` in the whole set.

    Args:
        base: map-style data set of ``(image, label)`` pairs, the whole training set (PIL
            images when ``transform`` is one of this module's).
        indices: positions in ``base`` of the labeled samples.
        transform: view of the image; FixMatch's labeled batch uses the weak view.

    Example:
        >>> base = [(Image.new("L", (28, 28)), k % 2) for k in range(6)]
        >>> ds = LabeledDataset(base, [1, 4], eval_transform([0.5], [0.5]))
        >>> x, y, i = ds[1]
        >>> tuple(x.shape), int(y), i
        ((1, 28, 28), 0, 4)
    """

    def __init__(self, base: Any, indices: np.ndarray | Sequence[int],
                 transform: Callable[[Any], Any] | None = None) -> None:
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if idx.size and (idx.min() < 0 or idx.max() >= len(base)):
            raise ValueError(f"`indices` must lie in [0, {len(base)}) (the size of `base`), got values in "
                             f"[{idx.min()}, {idx.max()}]. Fix: pass positions in the training set.")
        self.base = base
        self.indices = idx
        self.transform = transform

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: Any) -> tuple[Any, torch.Tensor, int]:
        j = int(self.indices[_position(index, len(self), "LabeledDataset")])
        image, label = self.base[j]
        return (self.transform(image) if self.transform is not None else image), to_class_label(label), j


class UnlabeledDataset(Dataset):
    """The unlabeled stream: ``(x_weak, x_strong, index)``, two views of one image, its label dropped.

    Args:
        base: map-style data set of ``(image, label)`` pairs (the label is ignored).
        weak: weak view (:func:`weak_transform`).
        strong: strong view (:func:`strong_transform`).

    Example:
        >>> base = [(Image.new("L", (28, 28)), -1)] * 3
        >>> norm = ([0.5], [0.5])
        >>> xw, xs, i = UnlabeledDataset(base, weak_transform(*norm, 28), strong_transform(*norm, 28))[2]
        >>> tuple(xw.shape), tuple(xs.shape), i
        ((1, 28, 28), (1, 28, 28), 2)
    """

    def __init__(self, base: Any, weak: Callable[[Any], Any], strong: Callable[[Any], Any]) -> None:
        self.base = base
        self.weak = weak
        self.strong = strong

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: Any) -> tuple[Any, Any, int]:
        position = _position(index, len(self), "UnlabeledDataset")
        image, _ = self.base[position]
        return self.weak(image), self.strong(image), position


# ----------------------------------------------------------------------------------------
# Sources
# ----------------------------------------------------------------------------------------
def load_mnist5k(root: str | os.PathLike | None = None) -> dict[str, np.ndarray]:
    """MNIST-5k with its fixed stratified train / test split (4,000 / 1,000 images).

    ``mnist5k.npz`` (embedded in the package; see ``data/embedded/README.md``) holds 5,000
    MNIST digits, 500 per class, without an official split. The test set is 100 images of
    every class drawn by :func:`stratified_label_split` with seed :data:`MNIST5K_SPLIT_SEED`;
    the training set is the other 4,000 in file order.

    Args:
        root: folder holding ``mnist5k.npz``; None for the embedded copy.

    Returns:
        ``train_images`` ``(4000, 28, 28)`` uint8, ``train_labels`` ``(4000,)`` int64,
        ``test_images``, ``test_labels`` (1,000), and ``train_file_indices`` /
        ``test_file_indices``: the positions of each split's images in the file.

    Raises:
        FileNotFoundError: if the file is missing (the message names the path and the fix).

    Example:
        >>> d = load_mnist5k()
        >>> d["train_images"].shape, d["test_images"].shape
        ((4000, 28, 28), (1000, 28, 28))
    """
    path = (Path(root).expanduser() if root is not None else EMBEDDED_DATA_DIR) / _MNIST5K_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"MNIST-5k file not found: {path}. It cannot be downloaded. Fix: pass root=None to use the copy "
            f"embedded in the package, or root= a folder holding {_MNIST5K_FILE} (MD5 {_MNIST5K_MD5})."
        )
    with np.load(path) as data:
        if "images" not in data.files or "labels" not in data.files:
            raise ValueError(f"{path} lacks the arrays 'images' and 'labels' (has {data.files}). Fix: use the "
                             f"original {_MNIST5K_FILE} (MD5 {_MNIST5K_MD5}).")
        images, labels = data["images"], data["labels"].astype(np.int64).reshape(-1)
    if images.shape[1:] != (28, 28) or images.dtype != np.uint8 or len(images) != len(labels):
        raise ValueError(f"{path} must hold uint8 images (N, 28, 28) and N labels, got {images.dtype} "
                         f"{images.shape} and {labels.shape}. Fix: use the original {_MNIST5K_FILE}.")
    test = stratified_label_split(labels, _MNIST5K_TEST_PER_CLASS * 10, 10, MNIST5K_SPLIT_SEED)
    train = np.setdiff1d(np.arange(len(labels)), test)
    return {"train_images": images[train], "train_labels": labels[train], "test_images": images[test],
            "test_labels": labels[test], "train_file_indices": train, "test_file_indices": test}


def _torchvision_class(source: str) -> type:
    from torchvision import datasets
    return {"cifar10": datasets.CIFAR10, "cifar100": datasets.CIFAR100, "stl10": datasets.STL10}[source]


def _torchvision_missing(source: str, root: Path) -> list[Path]:
    cls = _torchvision_class(source)
    folder = root / cls.base_folder
    return [folder / name for name, _ in (*cls.train_list, *cls.test_list) if not (folder / name).is_file()]


def _torchvision_not_found(source: str, root: Path, missing: list[Path]) -> FileNotFoundError:
    cls = _torchvision_class(source)
    more = f" (and {len(missing) - 1} more file(s) there)" if len(missing) > 1 else ""
    return FileNotFoundError(
        f"{source} file not found: {missing[0]}{more}. Fix: pass download=True on a machine with internet access "
        f"(it fetches {cls.url} into {root}), or extract {cls.filename} into {root} so that "
        f"{root / cls.base_folder} holds the files."
    )


class RandomStream(Sampler[int]):
    """``num_samples`` random indices of a data set of ``size`` items (back-to-back
    permutations, or draws with replacement).

    A plain ``Sampler`` on purpose: under DDP Lightning replaces a ``RandomSampler`` with a
    ``DistributedSampler`` over the data set (dropping ``num_samples`` and ``replacement``, so
    a few labels would give a rank no labeled batch at all), but splits any other sampler's
    stream across the processes (``DistributedSamplerWrapper``), which keeps both streams of
    equal length on every rank.
    """

    def __init__(self, size: int, num_samples: int, replacement: bool = False) -> None:
        self.inner = RandomSampler(range(size), replacement=replacement, num_samples=num_samples)

    def __iter__(self) -> Iterator[int]:
        return iter(self.inner)

    def __len__(self) -> int:
        return len(self.inner)


class SemiSupervisedDataModule(pl.LightningDataModule):
    """FixMatch-style loaders: a labeled and an unlabeled stream per training step, plus val/test.

    **Training batch** (``train_dataloader`` returns a ``CombinedLoader`` in
    ``"max_size_cycle"`` mode; the ``training_step`` receives)::

        {"labeled":   (x, y, idx),                  # x (B, C, H, W) weak view, y (B,) long,
                                                    # idx (B,) long: positions in the training set
         "unlabeled": (x_weak, x_strong, idx)}      # each (mu*B, C, H, W); idx (mu*B,) long

    with ``B = batch_size``. The unlabeled set is the **whole training set** (labeled images
    included, labels hidden), FixMatch's convention, so both ``idx`` index the same set of
    :attr:`num_unlabeled` images. An epoch has :attr:`num_steps_per_epoch` steps: the
    unlabeled stream draws ``steps * mu * B`` images from back-to-back random permutations
    of the set (one pass by default), and the labeled stream draws ``steps * B`` labeled
    images uniformly with replacement. Neither stream runs out before the other.

    **Validation / test batches** are ``(x, y, idx)`` with the evaluation view (normalisation
    only), ``idx`` the position in the split. Validation uses the source's validation split
    when it has one (MedMNIST). CIFAR-10/100, STL-10 and MNIST-5k have none, and no images
    are held out of the training set for it: **validation uses the test split**, so
    validation metrics are test metrics (use them for monitoring, not for model selection).

    Sources:

    * ``"mnist5k"``: 5,000 MNIST digits embedded in the package, split once (seeded,
      stratified, :func:`load_mnist5k`) into 4,000 train / 1,000 test; no flip by default.
    * a 2D single-label MedMNIST flag (``"breastmnist"``, ``"pneumoniamnist"``, ...): the
      28 px ``<flag>.npz`` in ``root`` (None: the embedded folder, which holds breastmnist);
      normalised with mean = std = 0.5 like :class:`MedMNISTDataModule`; no flip by default
      when class names mention a side (OrganMNIST: "kidney-left").
    * ``"cifar10"``, ``"cifar100"``: torchvision's files in ``root``.
    * ``"stl10"``: torchvision's files in ``root``; the training (= unlabeled) set is the
      5,000 labeled ``train`` images followed by the 100,000 ``unlabeled`` ones (as
      FixMatch), the labeled subset is drawn from the first 5,000.

    The labeled subset has ``num_labels / num_classes`` images of every class
    (:func:`stratified_label_split` with ``seed``), or is read from ``split_file``. It is
    part of the data module's ``state_dict``, so a checkpoint restores it.

    Args:
        source: data set, one of :data:`SEMI_SUPERVISED_SOURCES`.
        root: folder of the data files; None for the embedded folder (mnist5k, breastmnist).
            Required for CIFAR and STL-10.
        num_labels: size of the labeled subset, a multiple of the number of classes.
        seed: seed of the labeled subset.
        split_file: JSON file of the labeled subset. Exists: read it (it must be for this
            source, training-set size and ``num_labels``; ``seed`` is then ignored). Missing:
            the subset drawn from ``seed`` is written there. None: drawn from ``seed``.
        batch_size: labeled batch size ``B``.
        mu: ratio of unlabeled to labeled batch size (unlabeled batch = ``mu * B``; FixMatch: 7).
        eval_batch_size: validation / test batch size.
        num_workers: data loader worker processes (0 loads in the main process).
        steps_per_epoch: training steps per epoch; None: one pass over the unlabeled set,
            ``ceil(num_unlabeled / (mu * B))``.
        download: download missing torchvision / MedMNIST files into ``root`` (needs internet).
        flip: random horizontal flip in the weak and strong views; None: the source's default.
        strong_augment: the strong view's augmentation: ``"fixmatch"`` (default; FixMatch's
            RandAugment, each of 2 operations applied with probability 0.5 at a random magnitude,
            and a 16 px Cutout, as its reference implementation) or ``"torchvision"``
            (torchvision's ``RandAugment(2, 10)`` and a Cutout of random size; see
            :func:`~lpa3_lightning.data.ssl_transforms.strong_transform`).

    Raises:
        ValueError: for an unknown source or an argument outside its range (the message names
            the argument and the fix).
        FileNotFoundError: at ``setup`` when a data file is missing (names the path and the fix).

    Example:
        >>> dm = SemiSupervisedDataModule("mnist5k", num_labels=40, batch_size=8, steps_per_epoch=2)
        >>> dm.setup("fit")
        >>> batch, _, _ = next(iter(dm.train_dataloader()))
        >>> tuple(batch["labeled"][0].shape), tuple(batch["unlabeled"][1].shape)
        ((8, 1, 28, 28), (56, 1, 28, 28))
    """

    def __init__(
        self,
        source: str = "mnist5k",
        root: str | None = None,
        num_labels: int = 40,
        seed: int = 0,
        split_file: str | None = None,
        batch_size: int = 64,
        mu: int = 7,
        eval_batch_size: int = 256,
        num_workers: int = 0,
        steps_per_epoch: int | None = None,
        download: bool = False,
        flip: bool | None = None,
        strong_augment: str = "fixmatch",
    ) -> None:
        super().__init__()
        self._validate_source(source)
        if strong_augment not in STRONG_AUGMENTS:
            raise ValueError(f"`strong_augment` must be one of {STRONG_AUGMENTS}, got {strong_augment!r}. Fix: use "
                             "'fixmatch' (FixMatch's RandAugment and 16 px Cutout, the reference) or 'torchvision'.")
        if source in _TORCHVISION_SOURCES and root is None:
            raise ValueError(f"`root` is required for source={source!r}: only mnist5k and breastmnist ship with the "
                             f"package. Fix: pass root=<folder for the {source} files> (download=True fetches them).")
        if root is not None and not isinstance(root, (str, os.PathLike)):
            raise ValueError(f"`root` must be a folder path or None, got {type(root).__name__}. Fix: pass a str.")
        if split_file is not None and not isinstance(split_file, (str, os.PathLike)):
            raise ValueError(f"`split_file` must be a file path or None, got {type(split_file).__name__}. "
                             "Fix: pass a str such as 'splits/mnist5k_40_seed0.json'.")
        facts = self._facts(source)
        check_num_labels(num_labels, facts["num_classes"])
        check_int("seed", seed, 0, "pass a non-negative integer seed, e.g. 0.")
        check_int("batch_size", batch_size, 1, "pass the labeled batch size, e.g. batch_size=64.")
        check_int("mu", mu, 1, "pass the unlabeled-to-labeled batch ratio, e.g. mu=7 (FixMatch).")
        check_int("eval_batch_size", eval_batch_size, 1, "pass a positive batch size, e.g. 256.")
        check_int("num_workers", num_workers, 0, "use 0 to load data in the main process.")
        if steps_per_epoch is not None:
            check_int("steps_per_epoch", steps_per_epoch, 1,
                       "pass a positive number of steps, or None for one pass over the unlabeled set.")
        if not isinstance(download, bool):
            raise ValueError(f"`download` must be a bool, got {download!r}. Fix: pass True or False.")
        if flip is not None and not isinstance(flip, bool):
            raise ValueError(f"`flip` must be a bool or None, got {flip!r}. Fix: pass True, False or None.")
        self.save_hyperparameters()

        self.source = source
        self.root = Path(root).expanduser() if root is not None else EMBEDDED_DATA_DIR
        self.num_labels = int(num_labels)
        self.seed = int(seed)
        self.split_file = Path(split_file).expanduser() if split_file is not None else None
        self.batch_size = int(batch_size)
        self.mu = int(mu)
        self.eval_batch_size = int(eval_batch_size)
        self.num_workers = int(num_workers)
        self.steps_per_epoch = steps_per_epoch
        self.download = download
        self.flip = facts["flip"] if flip is None else flip
        self.strong_augment = strong_augment
        self._root_is_embedded = root is None
        self._source_facts = facts

        self.train_base: _ImageArrays | None = None
        self.labeled_dataset: LabeledDataset | None = None
        self.unlabeled_dataset: UnlabeledDataset | None = None
        self.val_dataset: IndexedDataset | None = None
        self.test_dataset: IndexedDataset | None = None
        self._labeled_indices: np.ndarray | None = None
        self._pending_state: dict[str, Any] | None = None
        self._arrays: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}

    # ------------------------------------------------------------------
    # Metadata (available before setup)
    # ------------------------------------------------------------------
    @staticmethod
    def _validate_source(source: Any) -> None:
        if isinstance(source, str) and source in INFO and source not in SUPPORTED_FLAGS:
            MedMNISTDataModule._validate_flag(source)  # its message says why (3D / multi-label)
        if not isinstance(source, str) or source not in SEMI_SUPERVISED_SOURCES:
            raise ValueError(f"Unknown `source` {source!r}. Fix: pass one of {', '.join(SEMI_SUPERVISED_SOURCES)}.")

    @staticmethod
    def _facts(source: str) -> dict[str, Any]:
        if source in _SOURCE_FACTS:
            return _SOURCE_FACTS[source]
        info = INFO[source]
        channels = int(info["n_channels"])
        sided = any(side in name for name in info["label"].values() for side in ("left", "right"))
        return {"num_classes": len(info["label"]), "in_channels": channels, "image_size": 28,
                "num_train": int(info["n_samples"]["train"]), "mean": (0.5,) * channels, "std": (0.5,) * channels,
                "flip": not sided}

    @property
    def num_classes(self) -> int:
        """Number of classes."""
        return int(self._source_facts["num_classes"])

    @property
    def in_channels(self) -> int:
        """Image channels (1 for digits and grayscale MedMNIST, 3 for colour images)."""
        return int(self._source_facts["in_channels"])

    @property
    def image_size(self) -> int:
        """Side of the square images."""
        return int(self._source_facts["image_size"])

    @property
    def normalization(self) -> dict[str, list[float]]:
        """Per-channel ``{"mean": [...], "std": [...]}`` of [0, 1] pixels used by ``Normalize``.

        LP-A3's callback reads it for the box of valid inputs.
        """
        return {"mean": list(self._source_facts["mean"]), "std": list(self._source_facts["std"])}

    @property
    def num_unlabeled(self) -> int:
        """Size of the unlabeled set, which is the whole training set."""
        return len(self.train_base) if self.train_base is not None else int(self._source_facts["num_train"])

    @property
    def num_steps_per_epoch(self) -> int:
        """Training steps per epoch: ``steps_per_epoch`` or ``ceil(num_unlabeled / (mu * batch_size))``."""
        if self.steps_per_epoch is not None:
            return int(self.steps_per_epoch)
        return math.ceil(self.num_unlabeled / (self.mu * self.batch_size))

    @property
    def labeled_indices(self) -> np.ndarray:
        """Sorted positions of the labeled images in the training set (after ``setup("fit")``)."""
        if self._labeled_indices is None:
            raise RuntimeError("The labeled subset is not drawn yet; call setup('fit') first "
                               "(a Lightning Trainer does this automatically).")
        return self._labeled_indices.copy()

    # ------------------------------------------------------------------
    # Transforms
    # ------------------------------------------------------------------
    def weak_transform(self, padding_mode: str = "reflect") -> transforms.Compose:
        """The weak view of this source (:func:`weak_transform`; FixMatch pads by reflection)."""
        return weak_transform(self._source_facts["mean"], self._source_facts["std"], self.image_size, self.flip,
                              padding_mode)

    def strong_transform(self) -> transforms.Compose:
        """The strong view of this source (:func:`strong_transform` with ``strong_augment``)."""
        return strong_transform(self._source_facts["mean"], self._source_facts["std"], self.image_size, self.flip,
                                augment=self.strong_augment)

    def eval_transform(self) -> transforms.Compose:
        """The evaluation view of this source (:func:`eval_transform`)."""
        return eval_transform(self._source_facts["mean"], self._source_facts["std"])

    # ------------------------------------------------------------------
    # Files
    # ------------------------------------------------------------------
    def _medmnist(self) -> MedMNISTDataModule:
        return MedMNISTDataModule(self.source, root=None if self._root_is_embedded else os.fspath(self.root),
                                  download=self.download)

    def prepare_data(self) -> None:
        """Downloads missing files when ``download=True`` (one process per node, before ``setup``)."""
        if not self.download or self.source == "mnist5k":
            return
        if self.source not in _TORCHVISION_SOURCES:
            self._medmnist().prepare_data()
            return
        if not _torchvision_missing(self.source, self.root):
            return
        cls = _torchvision_class(self.source)
        self.root.mkdir(parents=True, exist_ok=True)
        try:
            if self.source == "stl10":
                cls(os.fspath(self.root), split="train", download=True)
            else:
                cls(os.fspath(self.root), train=True, download=True)
        except Exception as err:  # network errors come in many types
            raise RuntimeError(
                f"Downloading {self.source} from {cls.url} into {self.root} failed ({type(err).__name__}: {err}). "
                f"Fix: on a machine without internet access, download {cls.filename} elsewhere and extract it into "
                f"{self.root}, then pass download=False."
            ) from err

    def _split_arrays(self, split: str) -> list[tuple[np.ndarray, np.ndarray]]:
        """``(images, labels)`` parts of ``split`` ("train", "val" or "test"), images HW or HWC uint8."""
        if split in self._arrays:
            return self._arrays[split]
        if self.source == "mnist5k":
            data = load_mnist5k(None if self._root_is_embedded else self.root)
            self._arrays["train"] = [(data["train_images"], data["train_labels"])]
            self._arrays["test"] = [(data["test_images"], data["test_labels"])]
        elif self.source in _TORCHVISION_SOURCES:
            self._arrays[split] = self._torchvision_arrays(split)
        else:
            dm = self._medmnist()
            dm._ensure_file()  # names the path and the fix when the file is missing
            with np.load(dm.data_file) as data:
                self._arrays[split] = [(data[f"{split}_images"], data[f"{split}_labels"].reshape(-1))]
        return self._arrays[split]

    def _torchvision_arrays(self, split: str) -> list[tuple[np.ndarray, np.ndarray]]:
        missing = _torchvision_missing(self.source, self.root)
        if missing and self.download:
            self.prepare_data()
            missing = _torchvision_missing(self.source, self.root)
        if missing:
            raise _torchvision_not_found(self.source, self.root, missing)
        cls = _torchvision_class(self.source)
        try:
            if self.source == "stl10":
                names = ("train", "unlabeled") if split == "train" else ("test",)
                parts = []
                for name in names:
                    ds = cls(os.fspath(self.root), split=name, download=False)
                    parts.append((ds.data.transpose(0, 2, 3, 1), np.asarray(ds.labels, dtype=np.int64)))
                return parts
            ds = cls(os.fspath(self.root), train=split == "train", download=False)
        except RuntimeError as err:
            raise FileNotFoundError(
                f"{self.source} files in {self.root / cls.base_folder} are damaged ({err}). Fix: delete that folder "
                f"and pass download=True, or extract a fresh {cls.filename} into {self.root}."
            ) from err
        return [(ds.data, np.asarray(ds.targets, dtype=np.int64))]

    # ------------------------------------------------------------------
    # Lightning hooks
    # ------------------------------------------------------------------
    def setup(self, stage: str | None = None) -> None:
        """Builds the data sets of ``stage`` (``"fit"``: train + val, ``"validate"``: val,
        ``"test"``/``"predict"``: test, None: all), drawing or reading the labeled subset.

        Raises:
            FileNotFoundError: if a data file is missing.
            ValueError: for an unknown ``stage``, a split file of another data set, or an
                unlabeled batch larger than the training set.
        """
        valid = (None, "fit", "validate", "test", "predict")
        if stage not in valid:
            raise ValueError(f"`stage` must be one of {valid}, got {stage!r}.")
        if stage in (None, "fit") and self.unlabeled_dataset is None:
            self._setup_train()
        if stage in (None, "fit", "validate") and self.val_dataset is None:
            val_split = "test" if self.source == "mnist5k" or self.source in _TORCHVISION_SOURCES else "val"
            self.val_dataset = IndexedDataset(_ImageArrays(self._split_arrays(val_split), self.eval_transform()))
        if stage in (None, "test", "predict") and self.test_dataset is None:
            self.test_dataset = IndexedDataset(_ImageArrays(self._split_arrays("test"), self.eval_transform()))

    def _setup_train(self) -> None:
        base = _ImageArrays(self._split_arrays("train"))
        size = len(base)
        unlabeled_batch = self.mu * self.batch_size
        if unlabeled_batch > size:
            raise ValueError(
                f"The unlabeled batch mu * batch_size = {self.mu} * {self.batch_size} = {unlabeled_batch} exceeds the "
                f"{size} training images of {self.source}. Fix: lower `mu` or `batch_size` so that their product is "
                f"at most {size}."
            )
        self.train_base = base
        self._labeled_indices = self._draw_or_read_split(base.labels)
        self.unlabeled_dataset = UnlabeledDataset(base, self.weak_transform(), self.strong_transform())
        self.labeled_dataset = LabeledDataset(base, self._labeled_indices, self.weak_transform())
        if self._pending_state is not None:
            state, self._pending_state = self._pending_state, None
            self._adopt(state)

    def _split_meta(self) -> dict[str, Any]:
        return {"source": self.source, "num_labels": self.num_labels, "seed": self.seed,
                "dataset_size": self.num_unlabeled, "num_classes": self.num_classes}

    def _draw_or_read_split(self, labels: np.ndarray) -> np.ndarray:
        meta = self._split_meta()
        if self.split_file is not None and self.split_file.is_file():
            expected = {key: meta[key] for key in ("source", "dataset_size", "num_labels")}
            indices, file_meta = load_label_split(self.split_file, expected)
            if (labels[indices] < 0).any():
                raise ValueError(f"Label split file {self.split_file} selects images without a label. Fix: pass "
                                 "split_file= another path (it is written there when missing), or delete this file.")
            file_seed = file_meta.get("seed")
            if file_seed is not None and file_seed != self.seed:
                # a seed sweep that keeps one split_file path would train every seed on the same labels
                rank_zero_warn(f"`split_file` {self.split_file} holds the labeled subset of seed {file_seed}, not of "
                               f"seed={self.seed}: it is used as it is. Fix: for a new subset per seed, give each "
                               "seed its own split_file (or delete this one).")
            return indices
        pool = np.flatnonzero(labels >= 0)  # STL-10: only its train images carry labels
        indices = pool[stratified_label_split(labels[pool], self.num_labels, self.num_classes, self.seed)]
        trainer = getattr(self, "trainer", None)
        if self.split_file is not None and (trainer is None or trainer.is_global_zero):
            save_label_split(self.split_file, indices, meta)
        return indices

    def _loader(self, dataset: Dataset, batch_size: int, **kwargs: Any) -> DataLoader:
        return DataLoader(dataset, batch_size=batch_size, num_workers=self.num_workers,
                          persistent_workers=self.num_workers > 0, **kwargs)

    def train_dataloader(self) -> CombinedLoader:
        """``CombinedLoader({"labeled": ..., "unlabeled": ...}, mode="max_size_cycle")``, both
        streams exactly :attr:`num_steps_per_epoch` batches long (see the class docstring)."""
        if self.unlabeled_dataset is None or self.labeled_dataset is None:
            raise RuntimeError("The training data is not built yet; call setup('fit') first "
                               "(a Lightning Trainer does this automatically).")
        steps, unlabeled_batch = self.num_steps_per_epoch, self.mu * self.batch_size
        # Without replacement but num_samples may exceed the set: back-to-back permutations.
        unlabeled = self._loader(self.unlabeled_dataset, unlabeled_batch, drop_last=True,
                                 sampler=RandomStream(len(self.unlabeled_dataset), steps * unlabeled_batch))
        labeled = self._loader(self.labeled_dataset, self.batch_size, drop_last=True,
                               sampler=RandomStream(len(self.labeled_dataset), steps * self.batch_size,
                                                    replacement=True))
        return CombinedLoader({"labeled": labeled, "unlabeled": unlabeled}, mode="max_size_cycle")

    def val_dataloader(self) -> DataLoader:
        """``(x, y, idx)`` batches of the validation split (the test split where the source has none)."""
        return self._loader(self._require(self.val_dataset, "val", "validate"), self.eval_batch_size, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        """``(x, y, idx)`` batches of the test split."""
        return self._loader(self._require(self.test_dataset, "test", "test"), self.eval_batch_size, shuffle=False)

    def predict_dataloader(self) -> DataLoader:
        """The test split, as :meth:`test_dataloader`."""
        return self._loader(self._require(self.test_dataset, "test", "predict"), self.eval_batch_size, shuffle=False)

    @staticmethod
    def _require(dataset: Dataset | None, split: str, stage: str) -> Dataset:
        if dataset is None:
            raise RuntimeError(f"The {split} split is not built yet; call setup({stage!r}) first "
                               "(a Lightning Trainer does this automatically).")
        return dataset

    # ------------------------------------------------------------------
    # Checkpoint state
    # ------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The labeled subset and what it was drawn for; Lightning stores it in checkpoints.

        Empty before ``setup("fit")``.
        """
        if self._labeled_indices is None:
            return {}
        return {**self._split_meta(), "labeled_indices": [int(i) for i in self._labeled_indices]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores the labeled subset of a checkpoint (Lightning calls it after ``setup``).

        The checkpoint's subset is adopted (with a warning when it differs from the one drawn
        from ``seed`` / read from ``split_file``), so a resumed run keeps training on the labels
        it started with. Called before ``setup``, it is applied when ``setup("fit")`` runs.

        Raises:
            ValueError: if the state is for another source, training-set size or ``num_labels``.
        """
        if not state_dict:
            return
        if "labeled_indices" not in state_dict:
            raise ValueError("The data module state has no 'labeled_indices'. Fix: load a checkpoint written with "
                             "SemiSupervisedDataModule, or resume without this data module's state.")
        for key in ("source", "num_labels"):
            if state_dict.get(key) != getattr(self, key):
                raise ValueError(
                    f"The checkpoint's labeled subset is for {key}={state_dict.get(key)!r}, this data module has "
                    f"{key}={getattr(self, key)!r}. Fix: pass {key}={state_dict.get(key)!r} (the checkpoint's) "
                    "to resume that run."
                )
        if self._labeled_indices is None:
            self._pending_state = dict(state_dict)
            return
        self._adopt(state_dict)

    def _adopt(self, state: Mapping[str, Any]) -> None:
        if state.get("dataset_size") != self.num_unlabeled:
            raise ValueError(
                f"The checkpoint's labeled subset is for a training set of {state.get('dataset_size')} images, "
                f"{self.source} here has {self.num_unlabeled}. Fix: point `root` at the data the checkpoint was "
                "trained on."
            )
        indices = np.asarray(sorted(int(i) for i in state["labeled_indices"]), dtype=np.int64)
        if self._labeled_indices is not None and np.array_equal(indices, self._labeled_indices):
            return
        rank_zero_warn(
            f"SemiSupervisedDataModule: adopting the checkpoint's {len(indices)} labeled indices (seed "
            f"{state.get('seed')}), which differ from those of seed={self.seed}"
            + (f" / split_file={self.split_file}" if self.split_file is not None else "") + "."
        )
        self._labeled_indices = indices
        if self.train_base is None:
            raise RuntimeError("The training data is not built yet; call setup('fit') before applying a labeled split.")
        self.labeled_dataset = LabeledDataset(self.train_base, indices, self.weak_transform())
