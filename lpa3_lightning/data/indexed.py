"""Datasets that also return each sample's position, the key of LP-A3's per-sample state."""

from __future__ import annotations

import operator
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset

__all__ = ["IndexedDataset", "dataset_position", "require_built", "to_class_label"]


def to_class_label(label: Any) -> torch.Tensor:
    """One single-label class target (``int``, numpy integer or array, tensor) as a 0-dim long tensor.

    Raises:
        TypeError: for a bool, a non-integer dtype or another type.
        ValueError: for more than one value.
    """
    if isinstance(label, torch.Tensor):
        tensor = label
    elif isinstance(label, (bool, np.bool_)):  # (an int subclass; a bool target is almost always a bug)
        raise TypeError(f"Class label must be an integer, got a boolean ({label!r}). Convert it to an int explicitly.")
    elif isinstance(label, (int, np.integer)):
        return torch.tensor(int(label), dtype=torch.long)
    elif isinstance(label, np.ndarray):
        tensor = torch.from_numpy(np.ascontiguousarray(label))
    else:
        raise TypeError(f"Class label must be an int, a numpy integer/array or a tensor, got {type(label).__name__}.")
    if tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool:
        raise TypeError(f"Class label must have an integer dtype, got {tensor.dtype}. "
                        "Convert labels to integer class indices before wrapping the dataset.")
    if tensor.numel() != 1:
        raise ValueError(f"Class label must hold exactly one value, got shape {tuple(tensor.shape)}. "
                         "Only single-label classification is supported.")
    return tensor.reshape(()).to(torch.long)


def dataset_position(index: Any, size: int, owner: str, note: str = "") -> int:
    """``index`` (an integer, negative from the end) as a position in ``[0, size)``.

    Raises:
        TypeError: for a non-integer index, naming ``owner`` (``note`` appended).
        IndexError: for an index out of range.
    """
    try:
        position = operator.index(index)
    except TypeError:
        raise TypeError(f"{owner} indices must be integers, got {type(index).__name__}.{note}") from None
    if position < 0:
        position += size
    if not 0 <= position < size:
        raise IndexError(f"index {index} is out of range for {owner} (size {size})")
    return position


def require_built(dataset: Any, what: str, stage: str) -> Any:
    """``dataset``, unless None (RuntimeError: ``what`` is not built yet, call ``setup(stage)``)."""
    if dataset is None:
        raise RuntimeError(f"The {what} is not built yet; call setup({stage!r}) first (a Lightning Trainer does this "
                           "automatically).")
    return dataset


class IndexedDataset(Dataset):
    """A map-style dataset of ``(x, y)`` pairs as ``(x, y, index)`` items: ``y`` a 0-dim long tensor, ``index``
    the ``int`` position in ``[0, len(dataset))``.

    Raises:
        TypeError: for a dataset without ``__len__`` and ``__getitem__``, a non-integer index or another item.
        IndexError: for an index out of range.

    Example:
        >>> x, y, i = IndexedDataset([(torch.zeros(2), 3), (torch.ones(2), 1)])[-1]
        >>> (y.item(), i)
        (1, 1)
    """

    def __init__(self, dataset: Any) -> None:
        if isinstance(dataset, IterableDataset):  # (it may define __len__, but has no random access)
            raise TypeError(f"IndexedDataset needs a map-style dataset with __len__ and __getitem__; "
                            f"{type(dataset).__name__} is an IterableDataset. Materialise it first.")
        missing = [name for name in ("__len__", "__getitem__") if not hasattr(dataset, name)]
        if missing:
            raise TypeError(f"IndexedDataset needs a map-style dataset defining __len__ and __getitem__; "
                            f"{type(dataset).__name__} lacks {', '.join(missing)}. Materialise it first.")
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: Any) -> tuple[Any, torch.Tensor, int]:
        position = dataset_position(index, len(self), "IndexedDataset",
                                    " Slicing and fancy indexing are not supported.")
        item = self.dataset[position]
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            length = f" of length {len(item)}" if isinstance(item, (tuple, list)) else ""
            raise TypeError(f"The wrapped dataset must return (x, y) pairs, got {type(item).__name__}{length}.")
        x, y = item
        return x, to_class_label(y), position

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.dataset!r})"
