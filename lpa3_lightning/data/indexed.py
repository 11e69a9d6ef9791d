"""A dataset wrapper that also returns each sample's position in the dataset.

LP-A3 keeps per-sample state across epochs (for example, which training
samples are currently "hard"), so the training step must know which dataset
entry each row of a batch came from. Shuffling and augmentation make the row
order useless for that, so the index travels with the sample instead.
"""

from __future__ import annotations

import operator
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset

__all__ = ["IndexedDataset", "to_class_label"]


def to_class_label(label: Any) -> torch.Tensor:
    """Converts one single-label classification target to a 0-dim long tensor.

    Datasets disagree on how they return a class label: MedMNIST returns a
    numpy array of shape ``(1,)``, torchvision returns a python ``int``, others
    return numpy scalars or tensors. Normalising here lets the default collate
    function always produce a ``(B,)`` long tensor, which is what
    ``torch.nn.functional.cross_entropy`` expects.

    Args:
        label: A python ``int``, a numpy integer scalar, a numpy array or a
            tensor holding exactly one integer value.

    Returns:
        A 0-dim ``torch.long`` tensor.

    Raises:
        TypeError: If the label is not an integer (floating-point labels are
            refused rather than silently truncated).
        ValueError: If the label holds more than one value (multi-label
            targets are not supported).
    """
    if isinstance(label, torch.Tensor):
        tensor = label
    elif isinstance(label, (bool, np.bool_)):
        # bool is a subclass of int; a bool target is almost always a bug
        # (e.g. a comparison result), so refuse it instead of mapping to 0/1.
        raise TypeError(
            f"Class label must be an integer, got a boolean ({label!r}). "
            "Convert it to an int class index explicitly."
        )
    elif isinstance(label, (int, np.integer)):
        return torch.tensor(int(label), dtype=torch.long)
    elif isinstance(label, np.ndarray):
        tensor = torch.from_numpy(np.ascontiguousarray(label))
    else:
        raise TypeError(
            "Class label must be an int, a numpy integer/array or a torch "
            f"tensor, got {type(label).__name__}."
        )

    if tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool:
        raise TypeError(
            f"Class label must have an integer dtype, got {tensor.dtype}. "
            "Convert labels to integer class indices before wrapping the dataset."
        )
    if tensor.numel() != 1:
        raise ValueError(
            f"Class label must hold exactly one value, got shape {tuple(tensor.shape)}. "
            "Only single-label classification is supported."
        )
    return tensor.reshape(()).to(torch.long)


class IndexedDataset(Dataset):
    """Wraps a map-style ``(x, y)`` dataset so that items become ``(x, y, index)``.

    ``x`` is passed through unchanged, ``y`` is converted to a 0-dim
    ``torch.long`` tensor and ``index`` is the python ``int`` position of the
    sample in the wrapped dataset (negative indices are normalised, so the
    returned index is always in ``[0, len(dataset))``). With the default
    collate function a batch is therefore ``(x, y, index)`` with ``y`` and
    ``index`` both ``(B,)`` long tensors.

    Args:
        dataset: Any map-style dataset (it must define ``__len__`` and
            ``__getitem__``) whose items are ``(x, y)`` pairs.

    Raises:
        TypeError: If ``dataset`` does not define ``__len__`` and
            ``__getitem__``.

    Example:
        >>> base = [(torch.zeros(2), 3), (torch.ones(2), 1)]
        >>> x, y, i = IndexedDataset(base)[1]
        >>> (y.item(), i)
        (1, 1)
    """

    def __init__(self, dataset: Any) -> None:
        if isinstance(dataset, IterableDataset):
            # An IterableDataset may define __len__, but it still has no
            # random access, so the checks below would not catch it.
            raise TypeError(
                f"IndexedDataset needs a map-style dataset with __len__ and __getitem__; "
                f"{type(dataset).__name__} is an IterableDataset. Materialise it first."
            )
        missing = [name for name in ("__len__", "__getitem__") if not hasattr(dataset, name)]
        if missing:
            raise TypeError(
                "IndexedDataset needs a map-style dataset defining __len__ and "
                f"__getitem__; {type(dataset).__name__} lacks {', '.join(missing)}. "
                "Iterable-style datasets cannot be indexed; materialise them first."
            )
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: Any) -> tuple[Any, torch.Tensor, int]:
        """Returns ``(x, y, index)`` for one sample.

        Args:
            index: An integer position (python int, numpy integer or 0-dim
                integer tensor). Negative values count from the end.

        Returns:
            The input ``x`` unchanged, the label as a 0-dim long tensor, and
            the non-negative python ``int`` position of the sample.

        Raises:
            TypeError: If ``index`` is not an integer, or the wrapped item is
                not an ``(x, y)`` pair.
            IndexError: If ``index`` is out of range.
        """
        try:
            position = operator.index(index)
        except TypeError:
            raise TypeError(
                f"IndexedDataset indices must be integers, got {type(index).__name__}. "
                "Slicing and fancy indexing are not supported."
            ) from None
        size = len(self)
        if position < 0:
            position += size
        if not 0 <= position < size:
            raise IndexError(f"index {index} is out of range for a dataset of size {size}")

        item = self.dataset[position]
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise TypeError(
                "The wrapped dataset must return (x, y) pairs, got "
                f"{type(item).__name__}"
                + (f" of length {len(item)}" if isinstance(item, (tuple, list)) else "")
                + "."
            )
        x, y = item
        return x, to_class_label(y), position

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.dataset!r})"
