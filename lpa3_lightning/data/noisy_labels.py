"""Training data with synthetic label noise for PES and DivideMix: two views, the noisy label, the index."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import DataLoader, Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

from lpa3_lightning.data.indexed import dataset_position, require_built
from lpa3_lightning.data.label_noise import ASYMMETRIC_MAPPINGS, load_noisy_labels, noisy_labels, save_noisy_labels
from lpa3_lightning.data.label_split import check_int
from lpa3_lightning.data.sampling import SplitBalancedSampler, train_loader
from lpa3_lightning.data.semi_supervised import SemiSupervisedDataModule
from lpa3_lightning.data.ssl_datasets import SEMI_SUPERVISED_SOURCES, ImageArrays, source_facts, validate_source
from lpa3_lightning.data.ssl_transforms import PADDING_MODES

__all__ = ["NOISY_LABEL_SOURCES", "NoisyLabelDataModule", "TwoViewNoisyDataset"]

#: Sources with labels on every training image (STL-10's unlabeled part has none).
NOISY_LABEL_SOURCES: tuple[str, ...] = tuple(s for s in SEMI_SUPERVISED_SOURCES if s != "stl10")


class TwoViewNoisyDataset(Dataset):
    """``(view1, view2, noisy_label, index)``: two draws of ``transform`` of each image (ValueError for other sizes)."""

    def __init__(self, base: ImageArrays, labels: np.ndarray, transform: Callable[[Any], Any]) -> None:
        if len(labels) != len(base):
            raise ValueError(f"{len(labels)} noisy labels for {len(base)} images.")
        self.base, self.labels = base, torch.as_tensor(np.asarray(labels, dtype=np.int64))
        self.transform = transform

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: Any) -> tuple[Any, Any, torch.Tensor, int]:
        position = dataset_position(index, len(self), "TwoViewNoisyDataset")
        image, _ = self.base[position]  # the clean label is dropped here
        return self.transform(image), self.transform(image), self.labels[position], position


class NoisyLabelDataModule(pl.LightningDataModule):
    """Noisy-label training batches ``(x_view1, x_view2, noisy_label, index)`` of
    :class:`~lpa3_lightning.data.SemiSupervisedDataModule`'s sources, and clean val/test batches.

    Args:
        source: ``"mnist5k"``, a 2D MedMNIST flag, ``"cifar10"`` or ``"cifar100"``.
        root: folder of the data files; None: the embedded folder.
        noise_mode: ``"symmetric"`` or ``"asymmetric"`` (:func:`~lpa3_lightning.data.noisy_labels`).
        noise_rate: share of the training set drawn for noise, in ``[0, 1]``.
        noise_convention: symmetric: ``"other"`` or ``"any"``.
        noise_mapping: asymmetric: a name in ``ASYMMETRIC_MAPPINGS`` or ``{source: target}``; None: the source's.
        seed: seed of the noise.
        noise_file: JSON file of the noisy labels, read when it exists, else written.
        batch_size: training batch size.
        eval_batch_size: validation / test batch size.
        num_workers: data loader worker processes.
        download: download missing files into ``root``.
        flip: random horizontal flip in the training views; None: the source's default.
        balance_split: once the module splits the set (``noisy_split_mask()``), batches of its labeled share.
        crop_padding: the training views' crop padding, ``"zeros"`` or ``"reflect"``.

    Raises:
        ValueError: for an argument outside its range; at ``setup``, for a ``noise_file`` of other labels or noise.
    """

    def __init__(self, source: str = "mnist5k", root: str | None = None,
                 noise_mode: Literal["symmetric", "asymmetric"] = "symmetric", noise_rate: float = 0.5,
                 noise_convention: Literal["other", "any"] = "other",
                 noise_mapping: str | Mapping[int, int] | None = None, seed: int = 0, noise_file: str | None = None,
                 batch_size: int = 64, eval_batch_size: int = 256, num_workers: int = 0, download: bool = False,
                 flip: bool | None = None, balance_split: bool = True, crop_padding: str = "zeros") -> None:
        super().__init__()
        if crop_padding not in PADDING_MODES:
            raise ValueError(f"`crop_padding` must be one of {sorted(PADDING_MODES)}, got {crop_padding!r}. Fix: use "
                             "'zeros' (PES's and DivideMix's RandomCrop(32, padding=4)) or 'reflect'.")
        if source == "stl10":
            raise ValueError("`source='stl10'` has no labels on most of its training images, so label noise does not "
                             "apply. Fix: use 'cifar10', 'cifar100', 'mnist5k' or a MedMNIST flag.")
        validate_source(source)  # (the image source: files, facts, views; its labeled split is never drawn)
        self._images = SemiSupervisedDataModule(source, root=root, num_labels=source_facts(source)["num_classes"],
                                                eval_batch_size=eval_batch_size, num_workers=num_workers,
                                                download=download, flip=flip)
        check_int("seed", seed, 0, "pass a non-negative integer seed, e.g. 0.")
        check_int("batch_size", batch_size, 1, "pass a positive batch size, e.g. 64.")
        if noise_file is not None and not isinstance(noise_file, (str, os.PathLike)):
            raise ValueError(f"`noise_file` must be a file path or None, got {type(noise_file).__name__}.")
        if noise_mapping is None:
            noise_mapping = {"cifar10": "cifar10", "mnist5k": "digits"}.get(
                source, "binary" if self._images.num_classes == 2 else None)
        if noise_mode == "asymmetric" and noise_mapping is None:
            raise ValueError(f"`noise_mapping` is needed for asymmetric noise on {source!r} (no built-in mapping for "
                             f"its classes). Fix: pass noise_mapping={{source_class: target_class, ...}}, or one of "
                             f"{sorted(ASYMMETRIC_MAPPINGS)}.")
        noisy_labels(np.zeros(1, dtype=np.int64), noise_rate, self._images.num_classes, seed, noise_mode,  # (checks)
                     noise_convention, noise_mapping or "binary")
        self.save_hyperparameters()
        self.source, self.noise_mode, self.noise_rate = source, noise_mode, float(noise_rate)
        self.noise_convention, self.noise_mapping, self.seed = noise_convention, noise_mapping, int(seed)
        self.noise_file = Path(noise_file).expanduser() if noise_file is not None else None
        self.batch_size, self.num_workers = int(batch_size), int(num_workers)
        if not isinstance(balance_split, bool):
            raise ValueError(f"`balance_split` must be True or False, got {balance_split!r}.")
        self.balance_split, self.crop_padding = balance_split, crop_padding
        self.train_dataset: TwoViewNoisyDataset | None = None
        self.train_eval_dataset: TwoViewNoisyDataset | None = None  # the training set in the evaluation view
        self.clean_train_labels: np.ndarray | None = None
        self.noisy_train_labels: np.ndarray | None = None

    # the image source's facts; num_train: the training set's size
    num_classes = property(lambda self: self._images.num_classes)
    in_channels = property(lambda self: self._images.in_channels)
    normalization = property(lambda self: self._images.normalization)
    num_train = property(lambda self: self._images.num_unlabeled)

    def _noise_meta(self) -> dict[str, Any]:
        mapping = self.noise_mapping if isinstance(self.noise_mapping, (str, type(None))) else \
            {str(k): int(v) for k, v in dict(self.noise_mapping).items()}
        return {"source": self.source, "mode": self.noise_mode, "rate": self.noise_rate, "seed": self.seed,
                "convention": self.noise_convention if self.noise_mode == "symmetric" else None,
                "mapping": mapping if self.noise_mode == "asymmetric" else None}

    def prepare_data(self) -> None:
        self._images.prepare_data()

    def setup(self, stage: str | None = None) -> None:
        """Build the noisy training set (``"fit"``/None) and the clean val/test splits."""
        if stage in (None, "fit") and self.train_dataset is None:
            base = ImageArrays(self._images._split_arrays("train"))
            self.clean_train_labels = clean = base.labels
            self.noisy_train_labels = self._draw_or_read(clean)
            self.train_dataset = TwoViewNoisyDataset(base, self.noisy_train_labels,
                                                     self._images.weak_transform(self.crop_padding))
            # the same images and noisy labels in the evaluation view (DivideMix's per-sample losses)
            self.train_eval_dataset = TwoViewNoisyDataset(base, self.noisy_train_labels, self._images.eval_transform())
        if stage in (None, "fit", "validate"):
            self._images.setup("validate")
        if stage in (None, "test", "predict"):
            self._images.setup("test")

    def _draw_or_read(self, clean: np.ndarray) -> np.ndarray:
        meta = self._noise_meta()
        if self.noise_file is not None and self.noise_file.is_file():
            labels, file_meta = load_noisy_labels(self.noise_file, clean, expected={
                k: meta[k] for k in ("source", "mode", "rate", "convention", "mapping")})
            file_seed = file_meta.get("seed")
            if file_seed is not None and file_seed != self.seed:  # (a seed sweep on one file would not vary)
                rank_zero_warn(f"`noise_file` {self.noise_file} holds the noise of seed {file_seed}, not of "
                               f"seed={self.seed}: its labels are used as they are. Fix: for new noise per seed, "
                               "give each seed its own noise_file (or delete this one).")
            self._labels_seed = file_seed  # what the checkpoint records: the seed of the labels in use
            return labels
        self._labels_seed = self.seed
        labels = noisy_labels(clean, self.noise_rate, self.num_classes, self.seed, self.noise_mode,
                              self.noise_convention, self.noise_mapping or "binary")
        trainer = getattr(self, "trainer", None)
        if self.noise_file is not None and (trainer is None or trainer.is_global_zero):
            save_noisy_labels(self.noise_file, labels, clean, meta)
        return labels

    def train_dataloader(self) -> DataLoader:
        """Shuffled training batches (the last partial one dropped), of the method's labeled share once it splits."""
        require_built(self.train_dataset, "training data", "fit")
        trainer = getattr(self, "trainer", None)
        module = getattr(trainer, "lightning_module", None) if trainer is not None else None
        split_mask, seed = getattr(module, "noisy_split_mask", None), int(os.environ.get("PL_GLOBAL_SEED", 0))
        workers = dict(num_workers=self.num_workers, persistent_workers=self.num_workers > 0, drop_last=True)
        if self.balance_split and callable(split_mask):
            sampler = SplitBalancedSampler(len(self.train_dataset), self.batch_size,
                                           lambda: (split_mask(), trainer.current_epoch),  # type: ignore[union-attr]
                                           rule=getattr(module, "noisy_batch_rule", "pes"), seed=seed)
            return StatefulDataLoader(self.train_dataset, batch_size=self.batch_size, sampler=sampler, **workers)
        return train_loader(self.train_dataset, self.batch_size, seed=seed,
                            num_replicas=trainer.world_size if trainer is not None else 1,
                            rank=trainer.global_rank if trainer is not None else 0, **workers)

    def val_dataloader(self) -> DataLoader:
        return self._images.val_dataloader()

    def test_dataloader(self) -> DataLoader:
        return self._images.test_dataloader()

    def state_dict(self) -> dict[str, Any]:
        if self.noisy_train_labels is None:
            return {}
        return {**self._noise_meta(), "seed": getattr(self, "_labels_seed", self.seed),
                "noisy_labels": [int(v) for v in self.noisy_train_labels]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Adopt a checkpoint's noisy labels (ValueError for another source, size or noise)."""
        if not state_dict:
            return
        if state_dict.get("source") != self.source:
            raise ValueError(f"The checkpoint's noisy labels are for source={state_dict.get('source')!r}, not "
                             f"{self.source!r}. Fix: pass the checkpoint's source to resume that run.")
        # the noise asked for must be the checkpoint's: a resumed run trains on the checkpoint's labels
        asked = self._noise_meta()
        differ = [key for key in ("mode", "rate", "convention", "mapping")
                  if key in state_dict and state_dict[key] != asked[key]]
        if differ:
            saved = ", ".join(f"{key}={state_dict[key]!r}" for key in differ)
            now = ", ".join(f"{key}={asked[key]!r}" for key in differ)
            raise ValueError(f"The checkpoint's noisy labels were drawn with {saved}; this data module asks for {now}. "
                             "A resumed run continues on the checkpoint's labels. Fix: resume with the checkpoint's "
                             "noise settings (noise_mode, noise_rate, noise_convention, noise_mapping), or start a "
                             "new run (no ckpt_path) for the new noise.")
        if state_dict.get("seed") is not None and state_dict.get("seed") != self.seed:
            rank_zero_warn(f"NoisyLabelDataModule: resuming on the checkpoint's noisy labels (seed "
                           f"{state_dict.get('seed')}), not those of seed={self.seed}.")
        labels = np.asarray(state_dict["noisy_labels"], dtype=np.int64)
        if self.train_dataset is not None:
            if len(labels) != len(self.train_dataset):
                raise ValueError(f"The checkpoint has {len(labels)} noisy labels, the training set "
                                 f"{len(self.train_dataset)} images. Fix: point `root` at the data the checkpoint was "
                                 "trained on.")
            self.noisy_train_labels = labels
            self._labels_seed = state_dict.get("seed")  # the labels in use are the checkpoint's
            self.train_dataset.labels = torch.as_tensor(labels)
            if self.train_eval_dataset is not None:
                self.train_eval_dataset.labels = torch.as_tensor(labels)
