"""The labeled subset of a semi-supervised data module: drawn or read once, kept in checkpoints.

:class:`LabeledSubsetMixin` gives :class:`~lpa3_lightning.data.SemiSupervisedDataModule` its
subset (stratified and seeded, or read from a split file) and the ``state_dict`` that carries it
in a checkpoint, so a resumed run keeps training on the labels it started with.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from lightning.pytorch.utilities import rank_zero_warn

from lpa3_lightning.data.label_split import load_label_split, save_label_split, stratified_label_split
from lpa3_lightning.data.ssl_datasets import ImageArrays, LabeledDataset

__all__ = ["LabeledSubsetMixin"]


class LabeledSubsetMixin:
    """The labeled subset's drawing and checkpoint state (the host class provides ``source``,
    ``num_labels``, ``seed``, ``split_file``, ``num_unlabeled``, ``num_classes``, ``train_base``
    and ``weak_transform()``)."""

    source: str
    num_labels: int
    seed: int
    split_file: Path | None
    train_base: ImageArrays | None
    labeled_dataset: LabeledDataset | None
    _labeled_indices: np.ndarray | None
    _pending_state: dict[str, Any] | None

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
