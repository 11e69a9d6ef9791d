"""FixMatch's data (Sohn et al., NeurIPS 2020): a small labeled subset, equal in every class, and the whole
training set unlabeled, written from the paper's description."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.combined_loader import CombinedLoader
from torch.utils.data import DataLoader, Dataset
from torchdata.stateful_dataloader import StatefulDataLoader
from torchvision import transforms

from lpa3_lightning.data.indexed import IndexedDataset, require_built
from lpa3_lightning.data.label_split import (check_int, check_num_labels, load_label_split, save_label_split,
                                             stratified_label_split)
from lpa3_lightning.data.medmnist import EMBEDDED_DATA_DIR
from lpa3_lightning.data.sampling import RandomStream
from lpa3_lightning.data.ssl_datasets import (MNIST5K_SPLIT_SEED, SEMI_SUPERVISED_SOURCES, TORCHVISION_SOURCES,
                                               ImageArrays, LabeledDataset, UnlabeledDataset, download_source,
                                               source_arrays, source_facts, validate_source)
from lpa3_lightning.data.ssl_transforms import STRONG_AUGMENTS, eval_transform, strong_transform, weak_transform

__all__ = ["MNIST5K_SPLIT_SEED", "SEMI_SUPERVISED_SOURCES", "SemiSupervisedDataModule"]


class SemiSupervisedDataModule(pl.LightningDataModule):
    """FixMatch-style loaders: a labeled and an unlabeled stream per training step, plus val/test.

    A training batch (``CombinedLoader``, ``"min_size"``, ``B = batch_size``)::

        {"labeled":   (x, y, idx),               # x (B, C, H, W) weak view, y and idx (B,) long
         "unlabeled": (x_weak, x_strong, idx)}   # each (mu*B, C, H, W); idx (mu*B,) long

    ``idx`` is the position in the training set, which is the unlabeled set. Without a validation split (CIFAR,
    STL-10, MNIST-5k) **validation uses the test split**. The ``state_dict`` holds the labeled subset.

    Args:
        source: one of :data:`SEMI_SUPERVISED_SOURCES`.
        root: folder of the data files; None: the embedded folder (mnist5k, breastmnist).
        num_labels: size of the labeled subset, a multiple of the number of classes.
        seed: seed of the labeled subset and of the streams' orders.
        split_file: JSON file of the labeled subset, read when it exists, else written.
        batch_size: labeled batch size ``B``.
        mu: unlabeled batch size over ``B``.
        eval_batch_size: validation / test batch size.
        num_workers: data loader worker processes.
        steps_per_epoch: training steps per epoch; None: ``ceil(num_unlabeled / (mu * B))``.
        download: download missing files into ``root``.
        flip: random horizontal flip in the weak and strong views; None: the source's default.
        strong_augment: ``"fixmatch"`` or ``"torchvision"`` (:func:`~lpa3_lightning.data.strong_transform`).

    Raises:
        ValueError: for an unknown source or an argument outside its range; at ``setup``, for a split file of
            another data set or too large a batch.
        FileNotFoundError: at ``setup``, for a missing data file, naming the path and the fix.
    """

    def __init__(self, source: str = "mnist5k", root: str | None = None, num_labels: int = 40, seed: int = 0,
                 split_file: str | None = None, batch_size: int = 64, mu: int = 7, eval_batch_size: int = 256,
                 num_workers: int = 0, steps_per_epoch: int | None = None, download: bool = False,
                 flip: bool | None = None, strong_augment: str = "fixmatch") -> None:
        super().__init__()
        validate_source(source)
        if strong_augment not in STRONG_AUGMENTS:
            raise ValueError(f"`strong_augment` must be one of {STRONG_AUGMENTS}, got {strong_augment!r}. Fix: use "
                             "'fixmatch' (FixMatch's RandAugment and 16 px Cutout, the reference) or 'torchvision'.")
        if source in TORCHVISION_SOURCES and root is None:
            raise ValueError(f"`root` is required for source={source!r}: only mnist5k and breastmnist ship with the "
                             f"package. Fix: pass root=<folder for the {source} files> (download=True fetches them).")
        if root is not None and not isinstance(root, (str, os.PathLike)):
            raise ValueError(f"`root` must be a folder path or None, got {type(root).__name__}. Fix: pass a str.")
        if split_file is not None and not isinstance(split_file, (str, os.PathLike)):
            raise ValueError(f"`split_file` must be a file path or None, got {type(split_file).__name__}. "
                             "Fix: pass a str such as 'splits/mnist5k_40_seed0.json'.")
        facts = source_facts(source)
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
        self.source, self.download, self.strong_augment = source, download, strong_augment
        self.root = Path(root).expanduser() if root is not None else EMBEDDED_DATA_DIR
        self.num_labels, self.seed = int(num_labels), int(seed)
        self.split_file = Path(split_file).expanduser() if split_file is not None else None
        self.batch_size, self.mu, self.eval_batch_size = int(batch_size), int(mu), int(eval_batch_size)
        self.num_workers, self.steps_per_epoch = int(num_workers), steps_per_epoch
        self.flip = facts["flip"] if flip is None else flip
        self._root_is_embedded, self._source_facts, self._norm = root is None, facts, (facts["mean"], facts["std"])
        self.train_base: ImageArrays | None = None
        self.labeled_dataset: LabeledDataset | None = None
        self.unlabeled_dataset: UnlabeledDataset | None = None
        self.val_dataset: IndexedDataset | None = None
        self.test_dataset: IndexedDataset | None = None
        self._labeled_indices: np.ndarray | None = None
        self._pending_state: dict[str, Any] | None = None
        self._arrays: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}

    # the source's facts, known before any file is read
    num_classes = property(lambda self: int(self._source_facts["num_classes"]))
    in_channels = property(lambda self: int(self._source_facts["in_channels"]))
    image_size = property(lambda self: int(self._source_facts["image_size"]))

    @property
    def normalization(self) -> dict[str, list[float]]:
        return {"mean": list(self._source_facts["mean"]), "std": list(self._source_facts["std"])}

    @property
    def num_unlabeled(self) -> int:
        """Size of the unlabeled set, the whole training set."""
        return len(self.train_base) if self.train_base is not None else int(self._source_facts["num_train"])

    @property
    def num_steps_per_epoch(self) -> int:
        """``steps_per_epoch`` or ``ceil(num_unlabeled / (mu * batch_size))``."""
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

    def weak_transform(self, padding_mode: str = "reflect") -> transforms.Compose:
        return weak_transform(*self._norm, self.image_size, self.flip, padding_mode)

    def strong_transform(self) -> transforms.Compose:
        return strong_transform(*self._norm, self.image_size, self.flip, augment=self.strong_augment)

    def eval_transform(self) -> transforms.Compose:
        return eval_transform(*self._norm)

    def prepare_data(self) -> None:
        if self.download:
            download_source(self.source, None if self._root_is_embedded else self.root)

    def _split_arrays(self, split: str) -> list[tuple[np.ndarray, np.ndarray]]:
        if split not in self._arrays:
            root = None if self._root_is_embedded else self.root
            self._arrays.update(source_arrays(self.source, root, split, self.download))
        return self._arrays[split]

    def setup(self, stage: str | None = None) -> None:
        """Build the datasets of ``stage`` (``fit``: train, val; ``validate``: val; ``test``/``predict``: test)."""
        valid = (None, "fit", "validate", "test", "predict")
        if stage not in valid:
            raise ValueError(f"`stage` must be one of {valid}, got {stage!r}.")
        if stage in (None, "fit") and self.unlabeled_dataset is None:
            self._setup_train()
        if stage in (None, "fit", "validate") and self.val_dataset is None:
            val_split = "test" if self.source == "mnist5k" or self.source in TORCHVISION_SOURCES else "val"
            self.val_dataset = IndexedDataset(ImageArrays(self._split_arrays(val_split), self.eval_transform()))
        if stage in (None, "test", "predict") and self.test_dataset is None:
            self.test_dataset = IndexedDataset(ImageArrays(self._split_arrays("test"), self.eval_transform()))

    def _setup_train(self) -> None:
        base = ImageArrays(self._split_arrays("train"))
        size, unlabeled_batch = len(base), self.mu * self.batch_size
        if unlabeled_batch > size:
            raise ValueError(
                f"The unlabeled batch mu * batch_size = {self.mu} * {self.batch_size} = {unlabeled_batch} exceeds the "
                f"{size} training images of {self.source}. Fix: lower `mu` or `batch_size` so that their product is "
                f"at most {size}.")
        self.train_base = base
        self._labeled_indices = self._draw_or_read_split(base.labels)
        self.unlabeled_dataset = UnlabeledDataset(base, self.weak_transform(), self.strong_transform())
        self.labeled_dataset = LabeledDataset(base, self._labeled_indices, self.weak_transform())
        if self._pending_state is not None:
            state, self._pending_state = self._pending_state, None
            self._adopt(state)

    def _loader(self, dataset: Dataset, batch_size: int, stateful: bool = False, **kwargs: Any) -> DataLoader:
        return (StatefulDataLoader if stateful else DataLoader)(dataset, batch_size=batch_size,
                                                                num_workers=self.num_workers,
                                                                persistent_workers=self.num_workers > 0, **kwargs)

    def train_dataloader(self) -> CombinedLoader:
        """The two resumable streams. ``"min_size"``: ``"max_size_cycle"`` restarts the labeled stream at a pass's
        end for a batch it drops, whose random views move torch's generator.
        """
        require_built(self.labeled_dataset if self.unlabeled_dataset is not None else None, "training data", "fit")
        steps = self.num_steps_per_epoch
        streams = {"labeled": (self.labeled_dataset, self.batch_size, True, self.seed + 1),  # (with replacement)
                   "unlabeled": (self.unlabeled_dataset, self.mu * self.batch_size, False, self.seed)}
        return CombinedLoader({name: self._loader(data, batch, drop_last=True, stateful=True,
                                                  sampler=RandomStream(len(data), steps * batch, replace, seed))
                               for name, (data, batch, replace, seed) in streams.items()}, mode="min_size")

    def _eval_loader(self, dataset: Dataset | None, split: str, stage: str) -> DataLoader:
        return self._loader(require_built(dataset, f"{split} split", stage), self.eval_batch_size, shuffle=False)

    def val_dataloader(self) -> DataLoader:
        """The validation split (the test split where the source has none)."""
        return self._eval_loader(self.val_dataset, "val", "validate")

    def test_dataloader(self) -> DataLoader:
        return self._eval_loader(self.test_dataset, "test", "test")

    def predict_dataloader(self) -> DataLoader:
        return self._eval_loader(self.test_dataset, "test", "predict")

    def _split_meta(self) -> dict[str, Any]:
        return {"source": self.source, "num_labels": self.num_labels, "seed": self.seed,
                "dataset_size": self.num_unlabeled, "num_classes": self.num_classes}

    def _draw_or_read_split(self, labels: np.ndarray) -> np.ndarray:
        meta, path = self._split_meta(), self.split_file
        if path is not None and path.is_file():
            expected = {key: meta[key] for key in ("source", "dataset_size", "num_labels")}
            indices, file_meta = load_label_split(path, expected)
            if (labels[indices] < 0).any():
                raise ValueError(f"Label split file {path} selects images without a label. Fix: pass split_file= "
                                 "another path (it is written there when missing), or delete this file.")
            if file_meta.get("seed") is not None and file_meta.get("seed") != self.seed:  # (a seed sweep on one file)
                rank_zero_warn(f"`split_file` {path} holds the labeled subset of seed {file_meta.get('seed')}, not of "
                               f"seed={self.seed}: it is used as it is. Fix: for a new subset per seed, give each "
                               "seed its own split_file (or delete this one).")
            return indices
        pool = np.flatnonzero(labels >= 0)  # (STL-10: only its train images carry labels)
        indices = pool[stratified_label_split(labels[pool], self.num_labels, self.num_classes, self.seed)]
        trainer = getattr(self, "trainer", None)
        if path is not None and (trainer is None or trainer.is_global_zero):
            save_label_split(path, indices, meta)
        return indices

    def state_dict(self) -> dict[str, Any]:
        if self._labeled_indices is None:
            return {}
        return {**self._split_meta(), "labeled_indices": [int(i) for i in self._labeled_indices]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Adopt a checkpoint's labeled subset (applied by ``setup("fit")`` when called before it).

        Raises:
            ValueError: for a state of another source, training-set size or ``num_labels``.
        """
        if not state_dict:
            return
        if "labeled_indices" not in state_dict:
            raise ValueError("The data module state has no 'labeled_indices'. Fix: load a checkpoint written with "
                             "SemiSupervisedDataModule, or resume without this data module's state.")
        for key in ("source", "num_labels"):
            if state_dict.get(key) != getattr(self, key):
                raise ValueError(f"The checkpoint's labeled subset is for {key}={state_dict.get(key)!r}, this data "
                                 f"module has {key}={getattr(self, key)!r}. Fix: pass {key}={state_dict.get(key)!r} "
                                 "(the checkpoint's) to resume that run.")
        if self._labeled_indices is None:
            self._pending_state = dict(state_dict)
            return
        self._adopt(state_dict)

    def _adopt(self, state: Mapping[str, Any]) -> None:
        if state.get("dataset_size") != self.num_unlabeled:
            raise ValueError(f"The checkpoint's labeled subset is for a training set of {state.get('dataset_size')} "
                             f"images, {self.source} here has {self.num_unlabeled}. Fix: point `root` at the data the "
                             "checkpoint was trained on.")
        indices = np.asarray(sorted(int(i) for i in state["labeled_indices"]), dtype=np.int64)
        if self._labeled_indices is not None and np.array_equal(indices, self._labeled_indices):
            return
        rank_zero_warn(f"SemiSupervisedDataModule: adopting the checkpoint's {len(indices)} labeled indices (seed "
                       f"{state.get('seed')}), which differ from those of seed={self.seed}"
                       + (f" / split_file={self.split_file}" if self.split_file is not None else "") + ".")
        self._labeled_indices = indices
        if self.train_base is None:
            raise RuntimeError("The training data is not built yet; call setup('fit') before applying a labeled split.")
        self.labeled_dataset = LabeledDataset(self.train_base, indices, self.weak_transform())
