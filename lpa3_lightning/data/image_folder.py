"""Your own images: a folder of class sub-folders (``ImageFolder``'s layout) as ``(x, y, index)`` batches."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from PIL import Image
from torch import Tensor
from torch.utils.data import DataLoader, Subset
from torchvision.datasets import ImageFolder
from torchvision.datasets.folder import IMG_EXTENSIONS, has_file_allowed_extension
from torchvision.transforms import functional as TF

from lpa3_lightning.core.checks import check_int
from lpa3_lightning.data.indexed import IndexedDataset
from lpa3_lightning.data.sampling import train_loader

__all__ = ["NORMALIZATIONS", "ImageFolderDataModule", "is_single_channel", "load_image"]

#: ``symmetric`` (0.5 and 0.5 per channel: [-1, 1]), ``unit`` (0 and 1), ``imagenet`` (3 channels).
NORMALIZATIONS: dict[str, dict[str, list[float]] | None] = {
    "symmetric": None, "unit": None, "imagenet": {"mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}}
#: PIL modes of one channel (8-bit, 1-bit, with alpha, 16-bit, 32-bit).
SINGLE_CHANNEL_MODES = frozenset({"1", "L", "LA", "La", "I", "F", "I;16", "I;16B", "I;16L", "I;16N"})
_SIXTEEN_BIT = frozenset({"I;16", "I;16B", "I;16L", "I;16N"})
SPLITS = ("train", "val", "test")


def is_single_channel(image: Image.Image) -> bool:
    """Whether a PIL image's mode holds one channel (:data:`SINGLE_CHANNEL_MODES`, or a palette of greys only)."""
    if image.mode in SINGLE_CHANNEL_MODES:
        return True
    if image.mode == "P":
        palette = image.getpalette() or []
        return all(palette[i] == palette[i + 1] == palette[i + 2] for i in range(0, len(palette) - 2, 3))
    return False


def load_image(path: str, channels: int) -> Tensor:
    """One image file as a float ``(channels, h, w)`` tensor in [0, 1] (16-bit grey divided by 65535).

    Raises:
        ValueError: for a 32-bit image, whose range is unknown, naming the file and the fix.
    """
    with Image.open(path) as image:
        if image.mode in _SIXTEEN_BIT:
            x = torch.from_numpy(np.asarray(image).astype(np.float32) / 65535.0)[None]
            return x.repeat(3, 1, 1) if channels == 3 else x
        if image.mode in ("I", "F"):
            raise ValueError(f"{path} is a 32-bit {image.mode!r} image, whose pixel range is unknown. Fix: save it as "
                             "an 8-bit or 16-bit PNG (e.g. scaled to 0..65535).")
        return TF.to_tensor(image.convert("L" if channels == 1 else "RGB"))


class _Folder(ImageFolder):
    def __init__(self, root: Path, classes: Sequence[str] | None, loader: Callable[[str], Any],
                 transform: Callable[[Any], Any] | None) -> None:
        self._given = list(classes) if classes is not None else None
        super().__init__(str(root), transform=transform, loader=loader, allow_empty=classes is not None)

    def find_classes(self, directory: str) -> tuple[list[str], dict[str, int]]:
        if self._given is None:
            return super().find_classes(directory)
        found = sorted(entry.name for entry in Path(directory).iterdir() if entry.is_dir())
        unknown = [name for name in found if name not in self._given]
        if unknown:
            raise ValueError(f"{directory} holds {unknown}, not a class of the training folder ({self._given}): its "
                             "labels would have no index. Fix: name its class folders as the training folder's, or "
                             "move those images into a training class.")
        return self._given, {name: i for i, name in enumerate(self._given)}


class ImageFolderDataModule(pl.LightningDataModule):
    """Your images in class sub-folders as ``(x, y, index)`` batches, and the facts LP-A3 and ``lpa3 show`` read.

    Layouts: ``root/train/<class>/*.png`` with, when present, ``root/val/...`` and ``root/test/...`` (which may
    lack a class, not add one); or ``root/<class>/*.png``. A split without a folder is drawn from the training
    images, its fraction of every class, seeded by ``split_seed``.

    Args:
        root: the folder.
        channels: 1, 3, or None: 1 when every training file holds one channel (:func:`is_single_channel`).
        image_size: resize to an int side or ``[h, w]``; None: all the images must have one size.
        normalization: a name of :data:`NORMALIZATIONS` or ``{"mean": [...], "std": [...]}`` per channel.
        val_fraction: the validation split's share of each class without a ``val`` folder (0: none).
        test_fraction: the test split's share of each class without a ``test`` folder (0: none).
        split_seed: the seed of those draws.
        batch_size: training batch size.
        eval_batch_size: validation and test batch size; None: ``batch_size``.
        num_workers: loader worker processes.
        pin_memory: passed to every loader.
        seed: the training loader's shuffle seed.

    Raises:
        FileNotFoundError: for a ``root`` that is not a folder, or holds no images.
        ValueError: for an argument outside its range, images of several sizes, or an unknown class folder.
    """

    def __init__(self, root: str, channels: int | None = None, image_size: int | list[int] | None = None,
                 normalization: str | dict[str, list[float]] = "symmetric", val_fraction: float = 0.1,
                 test_fraction: float = 0.0, split_seed: int = 0, batch_size: int = 64,
                 eval_batch_size: int | None = None, num_workers: int = 0, pin_memory: bool = False,
                 seed: int = 0) -> None:
        super().__init__()
        self.root = Path(root).expanduser()
        if not self.root.is_dir():
            raise FileNotFoundError(f"ImageFolderDataModule: `root` {self.root} is not a folder. Fix: pass root= a "
                                    "folder of one sub-folder of images per class (root/<class>/*.png), or train/ (and "
                                    "val/, test/) sub-folders of that layout.")
        if channels is not None and (isinstance(channels, bool) or channels not in (1, 3)):
            raise ValueError(f"`channels` must be None (from the images), 1 or 3, got {channels!r}. Fix: pass 1 "
                             "(grey), 3 (colour) or None.")
        pair = [image_size] * 2 if isinstance(image_size, int) and not isinstance(image_size, bool) else image_size
        if pair is not None and (not isinstance(pair, (list, tuple)) or len(pair) != 2 or any(
                isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in pair)):
            raise ValueError(f"`image_size` must be an int >= 1 or [h, w], got {image_size!r}. Fix: e.g. 64.")
        self._size = (int(pair[0]), int(pair[1])) if pair is not None else None
        if isinstance(normalization, str) and normalization not in NORMALIZATIONS:
            raise ValueError(f"`normalization` must be one of {sorted(NORMALIZATIONS)} or {{'mean': [...], 'std': "
                             f"[...]}}, got {normalization!r}. Fix: use 'symmetric' ([-1, 1]).")
        if not isinstance(normalization, (str, Mapping)):
            raise ValueError(f"`normalization` must be a name or a mapping, got {type(normalization).__name__}. Fix: "
                             "use 'symmetric' or {'mean': [...], 'std': [...]}.")
        for name, value in (("val_fraction", val_fraction), ("test_fraction", test_fraction)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
                raise ValueError(f"`{name}` must be a number in [0, 1), got {value!r}. Fix: e.g. 0.1, or 0 for none.")
        if val_fraction + test_fraction >= 1:
            raise ValueError(f"`val_fraction` + `test_fraction` must be below 1 (the rest trains), got "
                             f"{val_fraction} + {test_fraction}. Fix: e.g. 0.1 and 0.1.")
        check_int(batch_size, "batch_size", 1, "pass e.g. 64.")
        if eval_batch_size is not None:
            check_int(eval_batch_size, "eval_batch_size", 1, "pass e.g. 256, or None (batch_size).")
        check_int(num_workers, "num_workers", 0, "use 0 (load in the main process) or e.g. 4.")
        self.save_hyperparameters()
        self.channels, self.normalization_setting = channels, normalization
        self.val_fraction, self.test_fraction, self.split_seed = float(val_fraction), float(test_fraction), split_seed
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size if eval_batch_size is not None else batch_size
        self.num_workers, self.pin_memory, self.seed = num_workers, bool(pin_memory), seed
        self.train_dataset: IndexedDataset | None = None
        self.val_dataset: IndexedDataset | None = None
        self.test_dataset: IndexedDataset | None = None
        self._classes: list[str] | None = None
        self._in_channels: int | None = None
        self._checked = False

    @property
    def split_folders(self) -> dict[str, Path | None]:
        """Each split's own folder (None: drawn from the training images)."""
        if not (self.root / "train").is_dir():
            return {"train": self.root, "val": None, "test": None}
        return {split: (self.root / split if (self.root / split).is_dir() else None) for split in SPLITS}

    @property
    def class_names(self) -> list[str]:
        """The training folder's class folders, sorted (class ``i`` is ``class_names[i]``)."""
        if self._classes is None:
            folder = self.split_folders["train"]
            self._classes = sorted(entry.name for entry in folder.iterdir() if entry.is_dir())  # type: ignore
            if len(self._classes) < 2:
                raise FileNotFoundError(f"{folder} holds {len(self._classes)} class folder(s) ({self._classes}); "
                                        "classification needs 2 or more. Fix: put each class's images in a sub-folder "
                                        "of its own (root/<class>/*.png).")
        return self._classes

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    @property
    def in_channels(self) -> int:
        if self._in_channels is None:
            self._in_channels = self.channels if self.channels is not None else \
                1 if all(_single_channel_file(path) for path in self._files("train")) else 3
        return self._in_channels

    @property
    def normalization(self) -> dict[str, list[float]]:
        setting, c = self.normalization_setting, self.in_channels
        if setting in ("symmetric", "unit"):
            mean, std = (0.5, 0.5) if setting == "symmetric" else (0.0, 1.0)
            return {"mean": [mean] * c, "std": [std] * c}
        if setting == "imagenet":
            if c != 3:
                raise ValueError(f"`normalization='imagenet'` is for 3 channels, and the images have {c}. Fix: pass "
                                 "channels=3 (grey images repeated, as pretrained weights expect), or "
                                 "normalization='symmetric'.")
            return {key: list(values) for key, values in NORMALIZATIONS["imagenet"].items()}  # type: ignore
        mean, std = list(setting.get("mean", [])), list(setting.get("std", []))  # type: ignore[union-attr]
        if len(mean) != c or len(std) != c or any(not s > 0 for s in std):
            raise ValueError(f"`normalization` {dict(setting)!r} must give one mean and one std > 0 "  # type: ignore
                             f"per channel ({c} channels). Fix: e.g. {{'mean': {[0.5] * c}, 'std': {[0.5] * c}}}, or "
                             "'symmetric'.")
        return {"mean": [float(m) for m in mean], "std": [float(s) for s in std]}

    @property
    def num_train(self) -> int:
        """Training images (after the draws of val and test)."""
        if self.train_dataset is None:
            self.setup("fit")
        return len(self.train_dataset)  # type: ignore[arg-type]

    def train_transform(self) -> Callable[[Tensor], Tensor]:
        """The training images' transform, on a ``(C, h, w)`` tensor (override it to augment)."""
        return self.eval_transform()

    def eval_transform(self) -> Callable[[Tensor], Tensor]:
        """The validation and test images' transform: resize (with ``image_size``) and normalise."""
        norm = self.normalization
        return functools.partial(_resize_normalize, size=self._size, mean=norm["mean"], std=norm["std"])

    def setup(self, stage: str | None = None) -> None:
        """Build the splits ``stage`` needs (``fit``/``validate``: train and val; ``test``/``predict``: test)."""
        if stage not in (None, "fit", "validate", "test", "predict"):
            raise ValueError(f"stage must be None, 'fit', 'validate', 'test' or 'predict', got {stage!r}.")
        self._check_files()
        if stage in (None, "fit", "validate") and self.train_dataset is None:
            self.train_dataset = self._build("train", self.train_transform())
            self.val_dataset = self._build("val", self.eval_transform())
        if stage in (None, "test", "predict") and self.test_dataset is None:
            self.test_dataset = self._build("test", self.eval_transform())

    def train_dataloader(self) -> DataLoader:
        trainer = self.trainer
        return train_loader(self._require("train"), self.batch_size, seed=self.seed,
                            num_replicas=trainer.world_size if trainer is not None else 1,
                            rank=trainer.global_rank if trainer is not None else 0, num_workers=self.num_workers,
                            pin_memory=self.pin_memory, persistent_workers=self.num_workers > 0)

    def val_dataloader(self) -> DataLoader | list:
        dataset = self._require("val")
        return self._loader(dataset) if len(dataset) else []  # (no validation split: Lightning skips it)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self._require("test"))

    def predict_dataloader(self) -> DataLoader:
        return self._loader(self._require("test"))

    def _files(self, split: str) -> list[str]:
        folder = self.split_folders[split]
        if folder is None:
            return []
        return [path for name in self.class_names if (folder / name).is_dir()
                for path in sorted(str(p) for p in (folder / name).rglob("*")
                                   if p.is_file() and has_file_allowed_extension(p.name, IMG_EXTENSIONS))]

    def _check_files(self) -> None:
        if self._checked:
            return
        train = self.split_folders["train"]
        empty = [name for name in self.class_names if not any(
            has_file_allowed_extension(p.name, IMG_EXTENSIONS) for p in (train / name).rglob("*"))]  # type: ignore
        if empty:
            raise FileNotFoundError(f"No images in the class folder(s) {empty} of {train} (extensions "
                                    f"{', '.join(IMG_EXTENSIONS)}). Fix: add images there, or remove those folders.")
        if self._size is None:
            sizes: dict[tuple[int, int], str] = {}
            for split in SPLITS:
                for path in self._files(split):
                    with Image.open(path) as image:
                        sizes.setdefault(image.size, path)
                    if len(sizes) > 1:
                        (a, first), (b, other) = list(sizes.items())[:2]
                        raise ValueError(f"The images have several sizes ({a[0]}x{a[1]}: {first}; {b[0]}x{b[1]}: "
                                         f"{other}), which one batch cannot hold. Fix: pass image_size=<side> (or "
                                         "[h, w]) to resize them all.")
        self._checked = True

    def _build(self, split: str, transform: Callable[[Tensor], Tensor]) -> IndexedDataset:
        folders = self.split_folders
        loader = functools.partial(load_image, channels=self.in_channels)
        drawn_from_train = (folders["val"] is None and self.val_fraction > 0) or \
            (folders["test"] is None and self.test_fraction > 0)
        if split != "train" and folders[split] is not None:
            return IndexedDataset(_Folder(folders[split], self.class_names, loader, transform))  # type: ignore
        whole = _Folder(folders["train"], None, loader, transform)  # type: ignore[arg-type]
        if split == "train" and not drawn_from_train:
            return IndexedDataset(whole)
        return IndexedDataset(Subset(whole, self._drawn(whole.targets)[split]))

    def _drawn(self, targets: Sequence[int]) -> dict[str, list[int]]:
        """Per class a seeded permutation's first ``round(val * n)`` for val, next ``round(test * n)`` for test."""
        folders = self.split_folders
        val = self.val_fraction if folders["val"] is None else 0.0
        test = self.test_fraction if folders["test"] is None else 0.0
        generator = torch.Generator().manual_seed(self.split_seed)
        labels = np.asarray(targets)
        drawn: dict[str, list[int]] = {split: [] for split in SPLITS}
        for c in range(self.num_classes):
            members = np.flatnonzero(labels == c)
            order = members[torch.randperm(len(members), generator=generator).numpy()]
            n_val, n_test = round(val * len(order)), round(test * len(order))
            drawn["val"] += order[:n_val].tolist()
            drawn["test"] += order[n_val:n_val + n_test].tolist()
            drawn["train"] += order[n_val + n_test:].tolist()
        return {split: sorted(positions) for split, positions in drawn.items()}

    def _require(self, split: str) -> IndexedDataset:
        dataset = {"train": self.train_dataset, "val": self.val_dataset, "test": self.test_dataset}[split]
        if dataset is None:
            stage = "test" if split == "test" else "fit"
            raise RuntimeError(f"The {split} split is not built yet; call setup({stage!r}) first (a Lightning Trainer "
                               "does this).")
        if split == "test" and len(dataset) == 0:
            raise RuntimeError(f"ImageFolderDataModule has no test split: {self.root / 'test'} does not exist and "
                               "test_fraction=0. Fix: add a test/ folder of class folders beside train/, or pass "
                               "test_fraction=0.1 (a seeded share of the training images); in lpa3 show, --split val.")
        return dataset

    def _loader(self, dataset: IndexedDataset) -> DataLoader:
        return DataLoader(dataset, batch_size=self.eval_batch_size, shuffle=False, num_workers=self.num_workers,
                          pin_memory=self.pin_memory, persistent_workers=self.num_workers > 0)


def _single_channel_file(path: str) -> bool:
    with Image.open(path) as image:
        return is_single_channel(image)


def _resize_normalize(x: Tensor, size: tuple[int, int] | None, mean: list[float], std: list[float]) -> Tensor:
    if size is not None and tuple(x.shape[-2:]) != size:
        x = TF.resize(x, list(size), antialias=True).clamp(0, 1)
    return TF.normalize(x, mean, std)

