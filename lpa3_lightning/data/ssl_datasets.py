"""The data sets of the semi-supervised setting: image arrays indexed by their position in the
training set, the labeled subset and the unlabeled stream (``(x, y, index)`` and
``(x_weak, x_strong, index)``), MNIST-5k and the torchvision sources (found on disk or
a clear error naming the path), and the endless random stream of indices."""

from __future__ import annotations

import operator
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset, RandomSampler, Sampler

from lpa3_lightning.core.seeds import epoch_seed
from lpa3_lightning.data.indexed import to_class_label
from lpa3_lightning.data.label_split import (
    stratified_label_split,
)
from lpa3_lightning.data.medmnist import EMBEDDED_DATA_DIR

__all__ = ["MNIST5K_SPLIT_SEED", "LabeledDataset", "RandomStream", "UnlabeledDataset", "load_mnist5k"]

#: Seed of the fixed stratified 4,000 / 1,000 train / test split of MNIST-5k (it has no
#: official split). Independent of the label-split seed, so every run tests on the same images.
MNIST5K_SPLIT_SEED = 0

_MNIST5K_FILE = "mnist5k.npz"

_MNIST5K_MD5 = "11def57eb666ead6d8efa9a9ff9c2218"

_MNIST5K_TEST_PER_CLASS = 100




# ----------------------------------------------------------------------------------------
# Data sets
# ----------------------------------------------------------------------------------------
def dataset_position(index: Any, size: int, owner: str) -> int:
    try:
        position = operator.index(index)
    except TypeError:
        raise TypeError(f"{owner} indices must be integers, got {type(index).__name__}.") from None
    if position < 0:
        position += size
    if not 0 <= position < size:
        raise IndexError(f"index {index} is out of range for a {owner} of size {size}")
    return position


class ImageArrays(Dataset):
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
        position = dataset_position(index, len(self), "data set")
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
        j = int(self.indices[dataset_position(index, len(self), "LabeledDataset")])
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
        position = dataset_position(index, len(self), "UnlabeledDataset")
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


class RandomStream(Sampler[int]):
    """``num_samples`` random indices of a data set of ``size`` items (back-to-back
    permutations, or draws with replacement), in an order fixed by ``(seed, epoch)``.

    A plain ``Sampler`` on purpose: under DDP Lightning replaces a ``RandomSampler`` with a
    ``DistributedSampler`` over the data set (dropping ``num_samples`` and ``replacement``, so
    a few labels would give a rank no labeled batch at all), but splits any other sampler's
    stream across the processes (``DistributedSamplerWrapper``), which keeps both streams of
    equal length on every rank. Lightning sets the epoch of a loader's sampler each epoch (one
    process); without it each pass counts its own epoch. Its order draws nothing from torch's
    global generator.

    Resumable mid-epoch (torchdata's ``Stateful``: :meth:`state_dict` holds the indices yielded),
    and the order is drawn at a pass's first index, not when the pass is made: Lightning makes the
    training loader's iterator (and torchdata restores its position) before it sets the resumed
    epoch, and an order drawn then was the wrong epoch's (a resumed FixMatch fit trained epoch 0's
    batches in epoch 1). Without the state torchdata would fast-forward by drawing the pass anew.

    Example:
        >>> stream = RandomStream(5, 3, seed=0)
        >>> stream.set_epoch(2)
        >>> first = list(stream)
        >>> stream.load_state_dict({"yielded": 1})
        >>> list(stream) == first[1:]
        True
    """

    def __init__(self, size: int, num_samples: int, replacement: bool = False, seed: int = 0) -> None:
        self.size, self.num_samples, self.replacement, self.seed = size, num_samples, replacement, seed
        self.epoch, self._epoch_given = 0, False
        self.yielded, self.next_yielded = 0, None

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self._epoch_given = epoch, True

    def state_dict(self) -> dict[str, int]:
        """The indices yielded of the current pass (torchdata saves it with the loader's position)."""
        return {"yielded": self.yielded}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        """The next pass starts after the saved number of indices (the epoch comes from ``set_epoch``)."""
        yielded = state_dict.get("yielded")
        if isinstance(yielded, bool) or not isinstance(yielded, int) or not 0 <= yielded <= self.num_samples:
            raise ValueError(f"A RandomStream state must hold 'yielded' in 0..{self.num_samples}, got {state_dict!r}. "
                             "Fix: resume with the data module (batch_size, mu, steps_per_epoch) that wrote it.")
        self.next_yielded = yielded

    def __iter__(self) -> Iterator[int]:
        # the restored position belongs to the pass made now (torchdata makes it at once on restore)
        start, self.next_yielded = self.next_yielded or 0, None
        self.yielded = start
        return self._pass(start)

    def _pass(self, start: int) -> Iterator[int]:
        generator = torch.Generator().manual_seed(epoch_seed(self.seed, self.epoch))  # drawn at the first index
        if not self._epoch_given:
            self.epoch += 1
        inner = RandomSampler(range(self.size), replacement=self.replacement, num_samples=self.num_samples,
                              generator=generator)
        for index in list(inner)[start:]:
            self.yielded += 1
            yield index

    def __len__(self) -> int:
        return self.num_samples
