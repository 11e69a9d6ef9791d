"""The labeled subset of a semi-supervised run: equal in every class, drawn from a seed, kept in a JSON file."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["check_int", "check_num_labels", "load_label_split", "save_label_split", "stratified_label_split",
           "write_json_atomically"]

_SPLIT_FORMAT, _SPLIT_VERSION = "lpa3-label-split", 1


def check_int(name: str, value: Any, minimum: int, fix: str) -> None:
    """Refuse anything but an integer (numpy's too; not a bool) >= ``minimum`` (ValueError naming ``fix``)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"`{name}` must be an integer >= {minimum}, got {value!r}. Fix: {fix}")


def check_num_labels(num_labels: Any, num_classes: int) -> None:
    """Refuse a ``num_labels`` that is not a positive multiple of ``num_classes`` (ValueError naming the nearest)."""
    check_int("num_labels", num_labels, 1, f"pass a positive multiple of the {num_classes} classes, e.g. "
              f"num_labels={4 * num_classes} (4 labels per class).")
    if num_labels < num_classes or num_labels % num_classes:
        lower = (num_labels // num_classes) * num_classes
        options = [n for n in (lower, lower + num_classes) if n >= num_classes]
        raise ValueError(
            f"`num_labels` must be a multiple of the number of classes ({num_classes}) and at least "
            f"{num_classes}: the labeled subset takes num_labels / num_classes images of every class "
            f"(FixMatch's convention), got num_labels={num_labels}. "
            f"Fix: pass num_labels={' or '.join(str(n) for n in options)}.")


def stratified_label_split(labels: np.ndarray | torch.Tensor, num_labels: int, num_classes: int,
                           seed: int) -> np.ndarray:
    """Sorted ``int64`` positions of ``num_labels // num_classes`` samples of every class, drawn without
    replacement by ``numpy.random.default_rng(seed)``, classes in order.

    Args:
        labels: ``(N,)`` integer class labels in ``[0, num_classes)``.
        num_labels: size of the subset, a multiple of ``num_classes``.
        num_classes: number of classes.
        seed: non-negative seed.

    Raises:
        ValueError: for ``num_labels`` not a multiple of ``num_classes``, a class with fewer samples than its
            share, labels that are not 1-D integers in range, or a negative seed.
    """
    y = labels.detach().cpu().numpy() if isinstance(labels, torch.Tensor) else np.asarray(labels)
    if y.ndim != 1 or not (np.issubdtype(y.dtype, np.integer) or y.size == 0):
        raise ValueError(f"`labels` must be a 1-D array of integer class labels, got shape {y.shape} and dtype "
                         f"{y.dtype}. Fix: pass the training set's labels as integers, e.g. labels.reshape(-1).")
    check_int("num_classes", num_classes, 1, "pass the number of classes of the data set, e.g. 10.")
    check_num_labels(num_labels, int(num_classes))
    check_int("seed", seed, 0, "pass a non-negative integer seed, e.g. 0.")
    if y.size and (y.min() < 0 or y.max() >= num_classes):
        raise ValueError(f"`labels` must lie in [0, num_classes={num_classes}), got values in [{y.min()}, {y.max()}]. "
                         "Fix: pass the matching num_classes, or leave unlabeled samples (-1) out of `labels`.")
    per_class = num_labels // num_classes
    counts = np.bincount(y, minlength=num_classes)
    if counts.min() < per_class:
        poorest = int(counts.argmin())
        raise ValueError(f"`num_labels`={num_labels} needs {per_class} samples of every class, but class {poorest} has "
                         f"only {counts[poorest]}. Fix: pass num_labels <= {int(counts.min()) * num_classes}.")
    rng = np.random.default_rng(seed)
    chosen = [rng.choice(np.flatnonzero(y == c), size=per_class, replace=False) for c in range(num_classes)]
    return np.sort(np.concatenate(chosen)).astype(np.int64)


def write_json_atomically(path: str | os.PathLike, payload: Mapping[str, Any], indent: int | None = None) -> Path:
    """Write ``payload`` as JSON by a temporary file and a rename, creating missing folders; returns the path.

    Raises:
        ValueError: if the payload's ``meta`` holds values JSON cannot store.
    """
    try:
        text = json.dumps(payload, indent=indent)
    except TypeError as err:
        raise ValueError(f"`meta` must hold JSON values (str, int, float, bool, lists): {err}. "
                         "Fix: convert numpy scalars with int()/float().") from None
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path


def save_label_split(path: str | os.PathLike, indices: np.ndarray | Sequence[int], meta: Mapping[str, Any]) -> Path:
    """Write the ``indices`` of a labeled subset and its ``meta`` to a JSON file (atomically); returns the path.

    Raises:
        ValueError: if ``indices`` are not non-negative integers, or ``meta`` does not serialise.
    """
    idx = np.asarray(indices)
    if idx.ndim != 1 or (idx.size and (not np.issubdtype(idx.dtype, np.integer) or idx.min() < 0)):
        raise ValueError(f"`indices` must be a 1-D sequence of non-negative integers, got {idx.dtype} of shape "
                         f"{idx.shape}. Fix: pass the positions returned by stratified_label_split.")
    payload = {"format": _SPLIT_FORMAT, "version": _SPLIT_VERSION, "meta": dict(meta),
               "indices": sorted(int(i) for i in idx)}
    return write_json_atomically(path, payload, indent=1)


def load_label_split(path: str | os.PathLike,
                     expected: Mapping[str, Any] | None = None) -> tuple[np.ndarray, dict[str, Any]]:
    """Read a labeled subset written by :func:`save_label_split`, its meta matching ``expected``.

    Returns:
        ``(indices, meta)``: the sorted ``int64`` positions and the file's meta dict.

    Raises:
        FileNotFoundError: if the file does not exist.
        ValueError: for another kind of file, another meta, or indices past ``dataset_size``, naming the fix.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"Label split file not found: {path}. Fix: pass the path of a file written by "
                                "save_label_split (SemiSupervisedDataModule writes it when split_file is missing).")
    fix_other = "Fix: pass split_file= another path (it is written there when missing), or delete this file."
    try:
        payload = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path} is not a readable label split file ({err}). {fix_other}") from None
    if (not isinstance(payload, dict) or payload.get("format") != _SPLIT_FORMAT
            or not isinstance(payload.get("indices"), list) or not isinstance(payload.get("meta"), dict)):
        raise ValueError(f"{path} is not a label split file (no '{_SPLIT_FORMAT}' format with 'indices' and "
                         f"'meta'). {fix_other}")
    if payload.get("version") != _SPLIT_VERSION:
        raise ValueError(f"{path} has label-split format version {payload.get('version')!r}; this version reads "
                         f"{_SPLIT_VERSION}. {fix_other}")
    meta: dict[str, Any] = payload["meta"]
    for key, want in (expected or {}).items():
        if meta.get(key) != want:
            raise ValueError(f"Label split file {path} was written for {key}={meta.get(key)!r}, not {key}={want!r} "
                             f"(file: source={meta.get('source')!r}, dataset_size={meta.get('dataset_size')!r}, "
                             f"num_labels={meta.get('num_labels')!r}). {fix_other}")
    raw = payload["indices"]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in raw):
        raise ValueError(f"{path}: 'indices' must be non-negative integers. {fix_other}")
    indices = np.asarray(sorted(raw), dtype=np.int64)
    if len(np.unique(indices)) != len(indices):
        raise ValueError(f"{path}: 'indices' holds duplicates. {fix_other}")
    size = meta.get("dataset_size")
    if isinstance(size, int) and indices.size and indices[-1] >= size:
        raise ValueError(f"{path}: index {int(indices[-1])} is out of range for dataset_size={size}. {fix_other}")
    return indices, meta

