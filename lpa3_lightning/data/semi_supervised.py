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
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
from lightning.pytorch.utilities.combined_loader import CombinedLoader
from torch.utils.data import DataLoader, Dataset
from torchdata.stateful_dataloader import StatefulDataLoader
from torchvision import transforms

from lpa3_lightning.data.indexed import IndexedDataset
from lpa3_lightning.data.label_split import check_int, check_num_labels
from lpa3_lightning.data.labeled_subset import LabeledSubsetMixin
from lpa3_lightning.data.medmnist import EMBEDDED_DATA_DIR
from lpa3_lightning.data.ssl_datasets import (
    MNIST5K_SPLIT_SEED,
    ImageArrays,
    LabeledDataset,
    RandomStream,
    UnlabeledDataset,
)
from lpa3_lightning.data.ssl_sources import (
    SEMI_SUPERVISED_SOURCES,
    TORCHVISION_SOURCES,
    download_source,
    source_arrays,
    source_facts,
    validate_source,
)
from lpa3_lightning.data.ssl_transforms import (
    STRONG_AUGMENTS,
    eval_transform,
    strong_transform,
    weak_transform,
)

__all__ = ["MNIST5K_SPLIT_SEED", "SEMI_SUPERVISED_SOURCES", "SemiSupervisedDataModule"]




class SemiSupervisedDataModule(LabeledSubsetMixin, pl.LightningDataModule):
    """FixMatch-style loaders: a labeled and an unlabeled stream per training step, plus val/test.

    **Training batch** (``train_dataloader`` returns a ``CombinedLoader`` in
    ``"min_size"`` mode, its two streams of one length; the ``training_step`` receives)::

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

        self.train_base: ImageArrays | None = None
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
    def prepare_data(self) -> None:
        """Downloads missing files when ``download=True`` (one process per node, before ``setup``)."""
        if self.download:
            download_source(self.source, None if self._root_is_embedded else self.root)

    def _split_arrays(self, split: str) -> list[tuple[np.ndarray, np.ndarray]]:
        """``(images, labels)`` parts of ``split`` ("train", "val" or "test"), read once."""
        if split not in self._arrays:
            self._arrays.update(source_arrays(self.source, None if self._root_is_embedded else self.root, split,
                                              self.download))
        return self._arrays[split]

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
            val_split = "test" if self.source == "mnist5k" or self.source in TORCHVISION_SOURCES else "val"
            self.val_dataset = IndexedDataset(ImageArrays(self._split_arrays(val_split), self.eval_transform()))
        if stage in (None, "test", "predict") and self.test_dataset is None:
            self.test_dataset = IndexedDataset(ImageArrays(self._split_arrays("test"), self.eval_transform()))

    def _setup_train(self) -> None:
        base = ImageArrays(self._split_arrays("train"))
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

    def _loader(self, dataset: Dataset, batch_size: int, stateful: bool = False, **kwargs: Any) -> DataLoader:
        return (StatefulDataLoader if stateful else DataLoader)(dataset, batch_size=batch_size,
                                                                num_workers=self.num_workers,
                                                                persistent_workers=self.num_workers > 0, **kwargs)

    def train_dataloader(self) -> CombinedLoader:
        """``CombinedLoader({"labeled": ..., "unlabeled": ...}, mode="min_size")``, both streams exactly
        :attr:`num_steps_per_epoch` batches long (see the class docstring). ``"min_size"``, not
        ``"max_size_cycle"``: with streams of one length they give the same batches, but at a pass's end
        ``"max_size_cycle"`` starts the labeled stream again and draws one batch it then drops, whose
        random views move torch's generator; a run resumed into that epoch's end drew it once more and
        trained the next epoch on other views."""
        if self.unlabeled_dataset is None or self.labeled_dataset is None:
            raise RuntimeError("The training data is not built yet; call setup('fit') first "
                               "(a Lightning Trainer does this automatically).")
        steps, unlabeled_batch = self.num_steps_per_epoch, self.mu * self.batch_size
        # Without replacement but num_samples may exceed the set: back-to-back permutations. Stateful
        # loaders over orders fixed by (seed, epoch): Lightning checkpoints their position.
        unlabeled = self._loader(self.unlabeled_dataset, unlabeled_batch, drop_last=True, stateful=True,
                                 sampler=RandomStream(len(self.unlabeled_dataset), steps * unlabeled_batch,
                                                      seed=self.seed))
        labeled = self._loader(self.labeled_dataset, self.batch_size, drop_last=True, stateful=True,
                               sampler=RandomStream(len(self.labeled_dataset), steps * self.batch_size,
                                                    replacement=True, seed=self.seed + 1))
        return CombinedLoader({"labeled": labeled, "unlabeled": unlabeled}, mode="min_size")

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
