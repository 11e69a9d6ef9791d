"""The 2D MedMNIST datasets at 28x28 pixels as ``(x, y, index)`` batches, preprocessed as the MedMNIST
benchmark (``ToTensor`` and ``Normalize(0.5, 0.5)`` per channel: [-1, 1])."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import lightning.pytorch as pl
import medmnist
import torch
from medmnist.info import INFO
from torch.utils.data import DataLoader
from torchvision import transforms

from lpa3_lightning.core.checks import check_int
from lpa3_lightning.data.indexed import IndexedDataset, require_built, to_class_label
from lpa3_lightning.data.sampling import train_loader

__all__ = ["EMBEDDED_DATA_DIR", "MedMNISTDataModule", "SUPPORTED_FLAGS", "validate_flag"]

#: Folder inside the package holding the data files that ship with it (license and provenance: its README.md).
EMBEDDED_DATA_DIR: Path = Path(__file__).resolve().parent / "embedded"
_IMAGE_SIZE = 28  # (the 28 px files are "<flag>.npz")
_OFFICIAL_SOURCE = "https://medmnist.com/ (files hosted on Zenodo)"
_MAX_RANDAUGMENT_MAGNITUDE = 30

#: Every 2D flag of the installed ``medmnist`` (multi-label ones included; refused with their own message).
_ALL_2D_FLAGS: tuple[str, ...] = tuple(sorted(
    flag for flag, cls in ((f, getattr(medmnist, INFO[f]["python_class"], None)) for f in INFO)
    if isinstance(cls, type) and issubclass(cls, medmnist.dataset.MedMNIST2D)))
#: The 2D flags this module loads: the single-label tasks (ordinal regression treated as multi-class).
SUPPORTED_FLAGS: tuple[str, ...] = tuple(flag for flag in _ALL_2D_FLAGS if "multi-label" not in INFO[flag]["task"])


def validate_flag(flag: Any) -> None:
    """Refuse an unknown, 3D or multi-label MedMNIST flag.

    Raises:
        ValueError: saying why, and listing the valid 2D flags.
    """
    valid = f"Valid 2D flags: {', '.join(SUPPORTED_FLAGS)}."
    if not isinstance(flag, str) or flag not in INFO:
        raise ValueError(f"Unknown MedMNIST flag {flag!r}. {valid}")
    if flag not in _ALL_2D_FLAGS:
        raise ValueError(f"MedMNIST flag {flag!r} is a 3D dataset; only 2D datasets are supported. {valid}")
    if "multi-label" in INFO[flag]["task"]:
        raise ValueError(f"MedMNIST flag {flag!r} is a {INFO[flag]['task']!r} task; only single-label classification "
                         f"(binary-class, multi-class, ordinal-regression) is supported. {valid}")


class MedMNISTDataModule(pl.LightningDataModule):
    """``(x, y, index)`` batches (:class:`IndexedDataset`) of one 2D MedMNIST dataset, ``x`` ``(B, C, 28, 28)``.

    Args:
        flag: a flag of :data:`SUPPORTED_FLAGS`, e.g. ``"breastmnist"``.
        root: folder of ``<flag>.npz``; None: the folder embedded in the package (breastmnist only).
        download: download a missing file into ``root``.
        batch_size: training batch size.
        eval_batch_size: validation and test batch size; None: ``batch_size``.
        num_workers: data loader worker processes.
        randaugment: apply torchvision's ``RandAugment`` to training images.
        randaugment_num_ops: RandAugment operations per image.
        randaugment_magnitude: RandAugment magnitude, in ``[0, 30]``.
        pin_memory: passed to every ``DataLoader``.
        seed: shuffle seed of the training loader (:func:`~lpa3_lightning.data.train_loader`).

    Raises:
        ValueError: for an unknown, 3D or multi-label flag, an argument outside its range, or a ``stage``.
        FileNotFoundError: at ``setup``, for a missing file (naming the path and the fix).
    """

    def __init__(self, flag: str = "breastmnist", root: str | None = None, download: bool = False,
                 batch_size: int = 128, eval_batch_size: int | None = None, num_workers: int = 0,
                 randaugment: bool = False, randaugment_num_ops: int = 3, randaugment_magnitude: int = 5,
                 pin_memory: bool = False, seed: int = 0) -> None:
        super().__init__()
        validate_flag(flag)
        check_int(batch_size, "batch_size", 1, "pass a positive batch size, e.g. batch_size=128.")
        if eval_batch_size is not None:
            check_int(eval_batch_size, "eval_batch_size", 1, "pass a positive batch size, or None to reuse batch_size.")
        check_int(num_workers, "num_workers", 0, "use 0 to load data in the main process.")
        check_int(randaugment_num_ops, "randaugment_num_ops", 0, "pass the RandAugment operations per image, e.g. 3.")
        if (isinstance(randaugment_magnitude, bool) or not isinstance(randaugment_magnitude, int)
                or not 0 <= randaugment_magnitude <= _MAX_RANDAUGMENT_MAGNITUDE):
            raise ValueError(f"`randaugment_magnitude` must be an integer in [0, {_MAX_RANDAUGMENT_MAGNITUDE}], got "
                             f"{randaugment_magnitude!r}. Fix: pick a value such as 5 (mild) to 15 (strong).")
        self.save_hyperparameters()
        self.flag, self.download, self.seed = flag, bool(download), seed
        self.root = Path(root).expanduser() if root is not None else EMBEDDED_DATA_DIR
        self._root_is_embedded = root is None
        self.batch_size, self.num_workers, self.pin_memory = batch_size, num_workers, bool(pin_memory)
        self.eval_batch_size = eval_batch_size if eval_batch_size is not None else batch_size
        self.randaugment, self.randaugment_num_ops = bool(randaugment), randaugment_num_ops
        self.randaugment_magnitude = randaugment_magnitude
        self.train_dataset: IndexedDataset | None = None
        self.val_dataset: IndexedDataset | None = None
        self.test_dataset: IndexedDataset | None = None

    # the flag's facts, from medmnist.INFO (no file read): its entry, task (e.g. "binary-class"), classes, channels
    info = property(lambda self: INFO[self.flag])
    task = property(lambda self: self.info["task"])
    num_classes = property(lambda self: len(self.info["label"]))
    in_channels = property(lambda self: int(self.info["n_channels"]))

    @property
    def normalization(self) -> dict[str, list[float]]:
        return {"mean": [0.5] * self.in_channels, "std": [0.5] * self.in_channels}

    @property
    def num_train_samples(self) -> int:
        """Size of the official training split."""
        return int(self.info["n_samples"]["train"])

    @property
    def data_file(self) -> Path:
        return self.root / f"{self.flag}.npz"

    def train_transform(self) -> Callable[[Any], torch.Tensor]:
        """The training images' transform (RandAugment on the PIL image, then tensor and normalisation)."""
        augment = [transforms.RandAugment(self.randaugment_num_ops, self.randaugment_magnitude)]
        return transforms.Compose((augment if self.randaugment else []) + self._to_normalized_tensor())

    def eval_transform(self) -> Callable[[Any], torch.Tensor]:
        return transforms.Compose(self._to_normalized_tensor())

    def _to_normalized_tensor(self) -> list[Callable[[Any], Any]]:
        return [transforms.ToTensor(), transforms.Normalize(**self.normalization)]

    def prepare_data(self) -> None:
        """Download the missing file when ``download=True`` (ValueError into the embedded folder)."""
        if not self.download or self.data_file.is_file():
            return
        if self._root_is_embedded:
            raise ValueError(f"Only breastmnist is embedded in the package, and download=True needs a folder to "
                             f"write {self.flag}.npz into. Fix: pass root=<writable folder>.")
        self.root.mkdir(parents=True, exist_ok=True)  # (medmnist refuses a root that does not exist)
        self._dataset_class()(split="train", root=str(self.root), download=True, size=_IMAGE_SIZE)

    def setup(self, stage: str | None = None) -> None:
        """Build the splits of ``stage`` (``"fit"``/``"validate"``: train, val; ``"test"``/``"predict"``: test)."""
        valid_stages = (None, "fit", "validate", "test", "predict")
        if stage not in valid_stages:
            raise ValueError(f"stage must be one of {valid_stages}, got {stage!r}.")
        self._ensure_file()
        if stage in (None, "fit", "validate"):
            if self.train_dataset is None:
                self.train_dataset = self._build_split("train", self.train_transform())
            if self.val_dataset is None:
                self.val_dataset = self._build_split("val", self.eval_transform())
        if stage in (None, "test", "predict") and self.test_dataset is None:
            self.test_dataset = self._build_split("test", self.eval_transform())

    def train_dataloader(self) -> DataLoader:
        trainer = self.trainer
        return train_loader(require_built(self.train_dataset, "train split", "fit"), self.batch_size, seed=self.seed,
                            num_replicas=trainer.world_size if trainer is not None else 1,
                            rank=trainer.global_rank if trainer is not None else 0, num_workers=self.num_workers,
                            pin_memory=self.pin_memory, persistent_workers=self.num_workers > 0)

    def val_dataloader(self) -> DataLoader:
        return self._loader(require_built(self.val_dataset, "val split", "fit"))

    def test_dataloader(self) -> DataLoader:
        return self._loader(require_built(self.test_dataset, "test split", "test"))

    def predict_dataloader(self) -> DataLoader:
        return self._loader(require_built(self.test_dataset, "test split", "predict"))

    def _dataset_class(self) -> type:
        return getattr(medmnist, INFO[self.flag]["python_class"])

    def _ensure_file(self) -> None:
        if self.data_file.is_file():
            return
        if self.download:
            self.prepare_data()
            if self.data_file.is_file():
                return
        embedded = " The folder embedded in the package only holds breastmnist.npz." if self._root_is_embedded else ""
        raise FileNotFoundError(
            f"MedMNIST file not found: {self.data_file}.{embedded} Fix: pass root= a folder containing {self.flag}.npz "
            f"(the official 28x28 file, MD5 {self.info['MD5']}), or pass download=True on a machine with internet "
            f"access. Official source: {_OFFICIAL_SOURCE}.")

    def _build_split(self, split: str, transform: Callable[[Any], torch.Tensor]) -> IndexedDataset:
        return IndexedDataset(self._dataset_class()(split=split, root=os.fspath(self.root), download=False,
                                                    transform=transform, target_transform=to_class_label,
                                                    size=_IMAGE_SIZE))

    def _loader(self, dataset: IndexedDataset) -> DataLoader:
        return DataLoader(dataset, batch_size=self.eval_batch_size, shuffle=False, drop_last=False,
                          num_workers=self.num_workers, pin_memory=self.pin_memory,
                          persistent_workers=self.num_workers > 0)
