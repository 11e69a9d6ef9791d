"""Lightning data module for the 2D MedMNIST datasets at 28x28 pixels.

Batches are ``(x, y, index)`` triples (see :class:`IndexedDataset`) so that
LP-A3 can track per-sample state. Preprocessing follows the MedMNIST
benchmark: ``ToTensor`` followed by ``Normalize(mean=0.5, std=0.5)`` per
channel, which maps pixel values to ``[-1, 1]``.
"""

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

from lpa3_lightning.data.indexed import IndexedDataset, to_class_label
from lpa3_lightning.data.train_loader import train_loader

__all__ = ["EMBEDDED_DATA_DIR", "MedMNISTDataModule", "SUPPORTED_FLAGS"]

#: Folder inside the package holding data files that ship with it (only
#: ``breastmnist.npz``); see the README.md there for license and provenance.
EMBEDDED_DATA_DIR: Path = Path(__file__).resolve().parent / "embedded"

# Only the 28 px files are used: the package's file naming puts no size suffix
# on them ("<flag>.npz"), whereas other sizes are "<flag>_<size>.npz".
_IMAGE_SIZE = 28

# The official download location, quoted in error messages because the
# machines this runs on frequently have no internet access.
_OFFICIAL_SOURCE = "https://medmnist.com/ (files hosted on Zenodo)"

# RandAugment's default number of magnitude bins is 31, so valid magnitudes
# are 0..30.
_MAX_RANDAUGMENT_MAGNITUDE = 30


def _is_2d_flag(flag: str) -> bool:
    dataset_class = getattr(medmnist, INFO[flag]["python_class"], None)
    return isinstance(dataset_class, type) and issubclass(dataset_class, medmnist.dataset.MedMNIST2D)


#: Every 2D MedMNIST flag known to the installed ``medmnist`` package
#: (multi-label ones included; they are refused with their own message).
_ALL_2D_FLAGS: tuple[str, ...] = tuple(sorted(flag for flag in INFO if _is_2d_flag(flag)))

#: 2D flags this module can load: all single-label tasks (binary-class,
#: multi-class and ordinal-regression, the latter treated as multi-class).
SUPPORTED_FLAGS: tuple[str, ...] = tuple(
    flag for flag in _ALL_2D_FLAGS if "multi-label" not in INFO[flag]["task"]
)


def _expected_file(root: Path, flag: str) -> Path:
    """Path the ``medmnist`` package reads for ``flag`` at 28 px."""
    return root / f"{flag}.npz"


def _check_positive_int(name: str, value: Any, minimum: int, fix: str) -> None:
    # bool is an int subclass; True as a batch size is a bug, not a 1.
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}. {fix}")


def validate_flag(flag: Any) -> None:
    """Refuse an unknown, 3D or multi-label MedMNIST flag, listing the valid 2D flags."""
    if not isinstance(flag, str) or flag not in INFO:
        raise ValueError(
            f"Unknown MedMNIST flag {flag!r}. Valid 2D flags: {', '.join(SUPPORTED_FLAGS)}."
        )
    if flag not in _ALL_2D_FLAGS:
        raise ValueError(
            f"MedMNIST flag {flag!r} is a 3D dataset; only 2D datasets are supported. "
            f"Valid 2D flags: {', '.join(SUPPORTED_FLAGS)}."
        )
    if "multi-label" in INFO[flag]["task"]:
        raise ValueError(
            f"MedMNIST flag {flag!r} is a {INFO[flag]['task']!r} task; only single-label "
            "classification (binary-class, multi-class, ordinal-regression) is supported. "
            f"Valid 2D flags: {', '.join(SUPPORTED_FLAGS)}."
        )


class MedMNISTDataModule(pl.LightningDataModule):
    """Train/val/test loaders for one 2D MedMNIST dataset at 28x28 pixels.

    Each split is wrapped in :class:`IndexedDataset`, so every batch is
    ``(x, y, index)`` with ``x`` a float tensor of shape ``(B, C, 28, 28)`` in
    ``[-1, 1]``, ``y`` a ``(B,)`` long tensor of class indices and ``index``
    a ``(B,)`` long tensor of positions in the split.

    Args:
        flag: MedMNIST dataset name, e.g. ``"breastmnist"`` or
            ``"pneumoniamnist"``. Any single-label 2D flag is accepted
            (see ``SUPPORTED_FLAGS``); ordinal regression is treated as
            multi-class classification.
        root: Folder containing ``<flag>.npz``. ``None`` means the folder
            embedded in this package, which only holds ``breastmnist.npz``.
        download: Download the file into ``root`` if it is missing (needs
            internet access; ``root`` must then be given unless the file is
            already embedded).
        batch_size: Training batch size.
        eval_batch_size: Batch size for validation and test; ``None`` means
            ``batch_size``.
        num_workers: Data loader worker processes (0 loads in the main process).
        randaugment: Apply ``torchvision.transforms.RandAugment`` to training
            images (before tensor conversion). Validation and test images are
            never augmented.
        randaugment_num_ops: Number of RandAugment operations per image.
        randaugment_magnitude: RandAugment magnitude, in ``[0, 30]``.
        pin_memory: Passed to every ``DataLoader``.
        seed: Shuffle seed of the training loader (a ``(seed, epoch)`` permutation; under DDP
            sharded as ``DistributedSampler`` shards it). The training loader is torchdata's
            ``StatefulDataLoader`` (:func:`~lpa3_lightning.data.train_loader.train_loader`):
            Lightning checkpoints its position, so a run resumes exactly, mid-epoch included.

    Raises:
        ValueError: For an unknown, 3D or multi-label flag, or an argument
            outside its valid range.

    Example:
        >>> dm = MedMNISTDataModule("breastmnist", batch_size=64)
        >>> dm.num_classes, dm.in_channels
        (2, 1)
    """

    def __init__(
        self,
        flag: str = "breastmnist",
        root: str | None = None,
        download: bool = False,
        batch_size: int = 128,
        eval_batch_size: int | None = None,
        num_workers: int = 0,
        randaugment: bool = False,
        randaugment_num_ops: int = 3,
        randaugment_magnitude: int = 5,
        pin_memory: bool = False,
        seed: int = 0,
    ) -> None:
        super().__init__()
        validate_flag(flag)
        _check_positive_int("batch_size", batch_size, 1, "Pass a positive batch size, e.g. batch_size=128.")
        if eval_batch_size is not None:
            _check_positive_int(
                "eval_batch_size",
                eval_batch_size,
                1,
                "Pass a positive batch size, or None to reuse batch_size.",
            )
        _check_positive_int(
            "num_workers", num_workers, 0, "Use 0 to load data in the main process."
        )
        _check_positive_int(
            "randaugment_num_ops",
            randaugment_num_ops,
            0,
            "Pass the number of RandAugment operations per image, e.g. 3.",
        )
        if (
            isinstance(randaugment_magnitude, bool)
            or not isinstance(randaugment_magnitude, int)
            or not 0 <= randaugment_magnitude <= _MAX_RANDAUGMENT_MAGNITUDE
        ):
            raise ValueError(
                f"randaugment_magnitude must be an integer in [0, {_MAX_RANDAUGMENT_MAGNITUDE}], "
                f"got {randaugment_magnitude!r}. Pick a value such as 5 (mild) to 15 (strong)."
            )
        self.save_hyperparameters()

        self.flag = flag
        self.root = Path(root).expanduser() if root is not None else EMBEDDED_DATA_DIR
        self.download = bool(download)
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size if eval_batch_size is not None else batch_size
        self.num_workers = num_workers
        self.randaugment = bool(randaugment)
        self.randaugment_num_ops = randaugment_num_ops
        self.randaugment_magnitude = randaugment_magnitude
        self.pin_memory = bool(pin_memory)
        self.seed = seed
        self._root_is_embedded = root is None

        self.train_dataset: IndexedDataset | None = None
        self.val_dataset: IndexedDataset | None = None
        self.test_dataset: IndexedDataset | None = None

    # ------------------------------------------------------------------
    # Metadata available before setup (read from medmnist.INFO only).
    # ------------------------------------------------------------------
    @property
    def info(self) -> dict[str, Any]:
        """The ``medmnist.INFO`` entry for this flag."""
        return INFO[self.flag]

    @property
    def task(self) -> str:
        """MedMNIST task string, e.g. ``"binary-class"``."""
        return self.info["task"]

    @property
    def num_classes(self) -> int:
        """Number of classes (binary tasks count as 2 classes)."""
        return len(self.info["label"])

    @property
    def in_channels(self) -> int:
        """Image channels (1 for grayscale datasets, 3 for colour ones)."""
        return int(self.info["n_channels"])

    @property
    def normalization(self) -> dict[str, list[float]]:
        """Per-channel ``{"mean": [...], "std": [...]}`` used by ``Normalize``."""
        return {"mean": [0.5] * self.in_channels, "std": [0.5] * self.in_channels}

    @property
    def num_train_samples(self) -> int:
        """Size of the official training split."""
        return int(self.info["n_samples"]["train"])

    @property
    def data_file(self) -> Path:
        """Full path of the ``.npz`` file this module reads."""
        return _expected_file(self.root, self.flag)

    # ------------------------------------------------------------------
    # Transforms
    # ------------------------------------------------------------------
    def train_transform(self) -> Callable[[Any], torch.Tensor]:
        """Transform for training images (PIL in, normalised tensor out)."""
        steps: list[Callable[[Any], Any]] = []
        if self.randaugment:
            # RandAugment works on the uint8 PIL image, so it must run before
            # ToTensor/Normalize, as in torchvision's reference recipes.
            steps.append(
                transforms.RandAugment(
                    num_ops=self.randaugment_num_ops, magnitude=self.randaugment_magnitude
                )
            )
        steps += self._to_normalized_tensor()
        return transforms.Compose(steps)

    def eval_transform(self) -> Callable[[Any], torch.Tensor]:
        """Transform for validation and test images (no augmentation)."""
        return transforms.Compose(self._to_normalized_tensor())

    def _to_normalized_tensor(self) -> list[Callable[[Any], Any]]:
        norm = self.normalization
        return [transforms.ToTensor(), transforms.Normalize(mean=norm["mean"], std=norm["std"])]

    # ------------------------------------------------------------------
    # Lightning hooks
    # ------------------------------------------------------------------
    def prepare_data(self) -> None:
        """Downloads the file if ``download=True`` and it is missing.

        Lightning runs this on one process per node, before ``setup``, so
        concurrent ranks do not download the same file.
        """
        if not self.download or self.data_file.is_file():
            return
        if self._root_is_embedded:
            # Writing into the installed package is surprising and often not
            # permitted; make the user choose a data folder.
            raise ValueError(
                f"Only breastmnist is embedded in the package, and download=True needs a "
                f"folder to write {self.flag}.npz into. Pass root=<writable folder>."
            )
        # medmnist refuses a root that does not exist yet.
        self.root.mkdir(parents=True, exist_ok=True)
        self._dataset_class()(
            split="train", root=str(self.root), download=True, size=_IMAGE_SIZE
        )

    def setup(self, stage: str | None = None) -> None:
        """Builds the datasets needed for ``stage``.

        ``"fit"`` and ``"validate"`` build the train and val splits, ``"test"``
        and ``"predict"`` build the test split, and ``None`` builds all three.
        Already-built splits are reused.

        Raises:
            FileNotFoundError: If ``<root>/<flag>.npz`` does not exist (and
                ``download=False``).
            ValueError: For an unknown ``stage``.
        """
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
        dataset = self._require(self.train_dataset, "train", "fit")
        trainer = self.trainer
        return train_loader(dataset, self.batch_size, seed=self.seed,
                            num_replicas=trainer.world_size if trainer is not None else 1,
                            rank=trainer.global_rank if trainer is not None else 0, num_workers=self.num_workers,
                            pin_memory=self.pin_memory, persistent_workers=self.num_workers > 0)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self._require(self.val_dataset, "val", "fit"), self.eval_batch_size, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self._require(self.test_dataset, "test", "test"), self.eval_batch_size, shuffle=False)

    def predict_dataloader(self) -> DataLoader:
        return self._loader(
            self._require(self.test_dataset, "test", "predict"), self.eval_batch_size, shuffle=False
        )

    # ------------------------------------------------------------------
    # Helpers
    # ------------------------------------------------------------------
    def _dataset_class(self) -> type:
        return getattr(medmnist, INFO[self.flag]["python_class"])

    def _ensure_file(self) -> None:
        # medmnist's own error ("Dataset not found. You can set download=True")
        # neither names the path nor helps offline users, so check first.
        if self.data_file.is_file():
            return
        if self.download:
            self.prepare_data()
            if self.data_file.is_file():
                return
        embedded_note = (
            " The folder embedded in the package only holds breastmnist.npz."
            if self._root_is_embedded
            else ""
        )
        raise FileNotFoundError(
            f"MedMNIST file not found: {self.data_file}.{embedded_note} Fix: pass root= a "
            f"folder containing {self.flag}.npz (the official 28x28 file, MD5 "
            f"{self.info['MD5']}), or pass download=True on a machine with internet "
            f"access. Official source: {_OFFICIAL_SOURCE}."
        )

    def _build_split(self, split: str, transform: Callable[[Any], torch.Tensor]) -> IndexedDataset:
        dataset = self._dataset_class()(
            split=split,
            root=os.fspath(self.root),
            download=False,
            transform=transform,
            target_transform=to_class_label,
            size=_IMAGE_SIZE,
        )
        return IndexedDataset(dataset)

    @staticmethod
    def _require(dataset: IndexedDataset | None, split: str, stage: str) -> IndexedDataset:
        if dataset is None:
            raise RuntimeError(
                f"The {split} split is not built yet; call setup({stage!r}) first "
                "(a Lightning Trainer does this automatically)."
            )
        return dataset

    def _loader(self, dataset: IndexedDataset, batch_size: int, *, shuffle: bool) -> DataLoader:
        return DataLoader(
            dataset,
            batch_size=batch_size,
            shuffle=shuffle,
            drop_last=False,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            # Re-spawning workers every epoch dominates run time on these
            # small datasets.
            persistent_workers=self.num_workers > 0,
        )
