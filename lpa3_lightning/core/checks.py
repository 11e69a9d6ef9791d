"""Checks of the per-sample tensors every stage receives: dataset indices and class labels (and a class prior);
and of one field of a settings group (a bool, an int, a number in a range).

One definition each, so the TCS memory, the callback and the mixins refuse the same input
with the same message, and the callback's and the mixins' settings name a bad field the same way
(``group.field``). No Lightning here: a plain PyTorch loop gets the same errors.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["check_class_labels", "check_class_prior", "check_dataset_indices", "check_split_loader_covered",
           "count_out_of_range"]


def _is_integer_tensor(t: object) -> bool:
    return isinstance(t, Tensor) and not (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool)


def check_dataset_indices(indices: Tensor, num_samples: int, name: str = "indices", values: bool = True) -> None:
    """Refuse anything but a 1-D integer tensor of positions in a data set of ``num_samples``.

    ``values=False`` checks the type and shape only (no host read of the values; pair it with
    :func:`count_out_of_range`).

    Raises:
        ValueError: naming ``name``, what was received and the fix.

    Example:
        >>> import torch
        >>> check_dataset_indices(torch.tensor([0, 3]), num_samples=4)
        >>> check_dataset_indices(torch.tensor([4]), num_samples=4)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: `indices` out of range: got values in [4, 4] for a training set of 4 samples. ...
    """
    if not _is_integer_tensor(indices) or indices.dim() != 1:
        got = f"{indices.dtype} of shape {tuple(indices.shape)}" if isinstance(indices, Tensor) else type(indices).__name__
        raise ValueError(
            f"`{name}` must be a 1-D integer tensor of dataset indices, got {got}. Fix: make the dataset return "
            "its index with each item (e.g. wrap it in `lpa3_lightning.data.IndexedDataset`)."
        )
    if values and indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= num_samples):
        raise ValueError(
            f"`{name}` out of range: got values in [{int(indices.min())}, {int(indices.max())}] for a training set "
            f"of {num_samples} samples. Fix: pass indices of the training set itself (not of a subset or a "
            "concatenation), and `num_samples` equal to its length."
        )


def check_class_labels(labels: Tensor, num_classes: int, name: str = "labels", values: bool = True) -> None:
    """Refuse anything but a 1-D integer tensor of class indices in ``[0, num_classes)``.

    ``values=False`` checks the type and shape only, as in :func:`check_dataset_indices`.

    Raises:
        ValueError: naming ``name``, what was received and the fix ("Labels out of range" for
        values outside the classes).

    Example:
        >>> import torch
        >>> check_class_labels(torch.tensor([0, 2]), num_classes=3)
    """
    if not _is_integer_tensor(labels) or labels.dim() != 1:
        got = f"{labels.dtype} of shape {tuple(labels.shape)}" if isinstance(labels, Tensor) else type(labels).__name__
        raise ValueError(f"`{name}` must be a 1-D integer tensor of class indices, got {got}. Fix: pass labels as a "
                         "long tensor (not one-hot or float).")
    if values and labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= num_classes):
        raise ValueError(
            f"Labels out of range: `{name}` holds values in [{int(labels.min())}, {int(labels.max())}] for "
            f"{num_classes} classes (lpa3_num_classes). Fix: use class indices 0..{num_classes - 1}, or set "
            "lpa3_num_classes to the number of classes."
        )


def count_out_of_range(values: Tensor, high: int) -> Tensor:
    """How many of ``values`` lie outside ``[0, high)``, as a 0-dim tensor on their device (no host read).

    Example:
        >>> import torch
        >>> int(count_out_of_range(torch.tensor([-1, 0, 3, 4]), high=4))
        2
    """
    return ((values < 0) | (values >= high)).sum()


def check_class_prior(prior: object, num_classes: int, name: str = "class_prior") -> tuple[float, ...]:
    """Refuse anything but ``num_classes`` positive, finite class frequencies summing to 1.

    Takes a sequence of numbers or a host tensor (read on the host: a prior is a setting, checked
    once, not a device value read every step) and returns the frequencies as a tuple of floats.
    Each must be at least float32's smallest normal number, so none rounds to 0 in the penalty.
    """
    items = prior.tolist() if isinstance(prior, Tensor) else prior
    values: tuple[float, ...] | None = None
    if not isinstance(items, (str, bytes)):
        try:
            if not any(isinstance(v, (str, bytes)) for v in items):  # type: ignore[union-attr]
                values = tuple(float(v) for v in items)  # type: ignore[union-attr]
        except (TypeError, ValueError):
            values = None
    tiny = torch.finfo(torch.float32).tiny
    if (values is None or len(values) != num_classes or not all(v >= tiny for v in values)
            or abs(sum(values) - 1.0) > 1e-4):
        raise ValueError(f"`{name}` must hold num_classes={num_classes} positive frequencies summing to 1, got "
                         f"{prior!r}. Fix: e.g. the training set's class shares, or None (uniform).")
    return values


def check_split_loader_covered(visits: Tensor, begin_method: str) -> None:
    """Refuse a split whose loader left training samples out (``visits``: times each sample was
    seen); an unseen sample would silently land on the unlabeled side. ``begin_method`` names the
    method the user passes the loader to."""
    missing = int((visits == 0).sum())
    if missing:
        raise ValueError(f"The split loader left {missing} training samples out. Fix: pass a loader over the whole "
                         f"training set (no drop_last) to `{begin_method}`.")
