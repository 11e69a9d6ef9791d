"""Synthetic label noise, seeded and kept in a file with the clean labels' fingerprint. Symmetric: a share
``rate`` of the samples gets a random label of the other classes (``convention="other"``) or of all of them
(``"any"``, DivideMix's). Asymmetric: that share of each source class of ``mapping`` takes its target."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from lpa3_lightning.data.label_split import write_json_atomically

__all__ = ["ASYMMETRIC_MAPPINGS", "clean_labels_fingerprint", "load_noisy_labels", "noisy_labels", "save_noisy_labels"]

NoiseMode = Literal["symmetric", "asymmetric"]

#: truck -> automobile, bird -> airplane, deer -> horse, cat <-> dog; 2 -> 7, 3 -> 8, 5 <-> 6, 7 -> 1; 1 -> 0
ASYMMETRIC_MAPPINGS: dict[str, dict[int, int]] = {"cifar10": {9: 1, 2: 0, 4: 7, 3: 5, 5: 3},
                                                  "digits": {2: 7, 3: 8, 5: 6, 6: 5, 7: 1}, "binary": {1: 0}}
_FORMAT, _VERSION = "lpa3-noisy-labels", 1


def noisy_labels(labels: np.ndarray | torch.Tensor, rate: float, num_classes: int, seed: int,
                 mode: NoiseMode = "symmetric", convention: Literal["other", "any"] = "other",
                 mapping: str | Mapping[int, int] = "digits") -> np.ndarray:
    """Noisy copy of ``labels`` (``(N,)`` ``int64``), drawn by ``numpy.random.default_rng(seed)``.

    Args:
        labels: ``(N,)`` clean class indices.
        rate: share of samples drawn for noise, in ``[0, 1]``.
        num_classes: number of classes.
        seed: the generator's seed.
        mode: ``"symmetric"`` or ``"asymmetric"``.
        convention: symmetric only: ``"other"`` or ``"any"``.
        mapping: asymmetric only: a name in :data:`ASYMMETRIC_MAPPINGS` or ``{source: target}``.

    Raises:
        ValueError: on a bad argument, naming it and the fix.

    Example:
        >>> clean = np.repeat(np.arange(10), 100)
        >>> float((noisy_labels(clean, rate=0.8, num_classes=10, seed=0) != clean).mean())
        0.8
    """
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0.0 <= float(rate) <= 1.0:
        raise ValueError(f"`rate` must be a number in [0, 1], got {rate!r}. Fix: e.g. rate=0.5 for 50% noise.")
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 2:
        raise ValueError(f"`num_classes` must be an int >= 2, got {num_classes!r}. Fix: pass the number of classes.")
    if mode not in ("symmetric", "asymmetric"):
        raise ValueError(f"`mode` must be 'symmetric' or 'asymmetric', got {mode!r}.")
    if convention not in ("other", "any"):
        raise ValueError(f"`convention` must be 'other' (always a wrong label) or 'any' (DivideMix's uniform "
                         f"re-draw), got {convention!r}.")
    arr = labels.detach().cpu().numpy() if isinstance(labels, torch.Tensor) else np.asarray(labels)
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise ValueError(f"`labels` must be a 1-D integer array of class indices, got {arr.dtype} of shape "
                         f"{arr.shape}. Fix: pass the training set's labels, e.g. dataset.targets.")
    if arr.size and (arr.min() < 0 or arr.max() >= num_classes):
        raise ValueError(f"`labels` holds values in [{arr.min()}, {arr.max()}] for num_classes={num_classes}. "
                         f"Fix: pass class indices 0..{num_classes - 1} and the data set's number of classes.")
    clean, rng = arr.astype(np.int64), np.random.default_rng(seed)
    noisy = clean.copy()
    if mode == "symmetric":
        chosen = rng.permutation(clean.size)[: int(round(float(rate) * clean.size))]
        if convention == "any":
            noisy[chosen] = rng.integers(0, num_classes, size=chosen.size)
        else:
            # an offset in 1..C-1 added modulo C is a uniform draw among the other classes
            noisy[chosen] = (clean[chosen] + rng.integers(1, num_classes, size=chosen.size)) % num_classes
        return noisy
    if isinstance(mapping, str):
        if mapping not in ASYMMETRIC_MAPPINGS:
            raise ValueError(f"`mapping` must be one of {sorted(ASYMMETRIC_MAPPINGS)} or a dict {{source: target}}, "
                             f"got {mapping!r}. Fix: e.g. mapping='digits' for MNIST, 'binary' for two classes.")
        mapping = ASYMMETRIC_MAPPINGS[mapping]
    pairs = {int(k): int(v) for k, v in dict(mapping).items()}
    for source, target in pairs.items():
        if not (0 <= source < num_classes and 0 <= target < num_classes) or source == target:
            raise ValueError(f"`mapping` {source} -> {target} does not fit {num_classes} classes (or maps a class "
                             "to itself). Fix: use a mapping made for this data set's classes.")
    for source, target in sorted(pairs.items()):
        members = np.flatnonzero(clean == source)
        chosen = rng.permutation(members)[: int(round(float(rate) * members.size))]
        noisy[chosen] = target  # drawn from the clean labels, so 5 <-> 6 swaps do not chain
    return noisy


def clean_labels_fingerprint(labels: np.ndarray | torch.Tensor) -> str:
    """SHA-256 of the clean labels (``int64``, in order): ties a noise file to its data set."""
    arr = labels.detach().cpu().numpy() if isinstance(labels, torch.Tensor) else np.asarray(labels)
    return hashlib.sha256(np.ascontiguousarray(arr.astype(np.int64)).tobytes()).hexdigest()


def save_noisy_labels(path: str | os.PathLike, noisy: np.ndarray | torch.Tensor, clean: np.ndarray | torch.Tensor,
                      meta: Mapping[str, Any]) -> Path:
    """Write ``noisy`` labels and the fingerprint of their ``clean`` ones to a JSON file; returns the path.

    Raises:
        ValueError: for label arrays of other shapes, or a ``meta`` JSON cannot store.
    """
    noisy_arr = np.asarray(noisy.detach().cpu() if isinstance(noisy, torch.Tensor) else noisy)
    clean_arr = np.asarray(clean.detach().cpu() if isinstance(clean, torch.Tensor) else clean)
    if noisy_arr.shape != clean_arr.shape or noisy_arr.ndim != 1:
        raise ValueError(f"`noisy` and `clean` must be 1-D label arrays of one length, got {noisy_arr.shape} and "
                         f"{clean_arr.shape}. Fix: pass the output of noisy_labels and its input.")
    payload = {"format": _FORMAT, "version": _VERSION, "meta": dict(meta),
               "clean_sha256": clean_labels_fingerprint(clean_arr), "labels": [int(v) for v in noisy_arr]}
    return write_json_atomically(path, payload)


def load_noisy_labels(path: str | os.PathLike, clean: np.ndarray | torch.Tensor,
                      expected: Mapping[str, Any] | None = None) -> tuple[np.ndarray, dict[str, Any]]:
    """Read noisy labels written by :func:`save_noisy_labels` for these ``clean`` labels.

    Returns:
        ``(noisy, meta)``: ``(N,)`` ``int64`` labels and the file's meta dict.

    Raises:
        FileNotFoundError: if the file does not exist.
        ValueError: for another kind of file, other clean labels, or a meta unlike ``expected``, naming the fix.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"Noisy label file not found: {path}. Fix: pass the path of a file written by "
                                "save_noisy_labels (the noisy-label data module writes it when it is missing).")
    fix_other = "Fix: pass noise_file= another path (it is written there when missing), or delete this file."
    try:
        payload = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path} is not a readable noisy-label file ({err}). {fix_other}") from None
    if (not isinstance(payload, dict) or payload.get("format") != _FORMAT or payload.get("version") != _VERSION
            or not isinstance(payload.get("labels"), list) or not isinstance(payload.get("meta"), dict)):
        raise ValueError(f"{path} is not a noisy-label file of format '{_FORMAT}' version {_VERSION}. {fix_other}")
    if payload.get("clean_sha256") != clean_labels_fingerprint(clean):
        raise ValueError(f"{path} was made from other clean labels than this training set's (fingerprint "
                         f"mismatch: another data set, split or order). {fix_other}")
    meta: dict[str, Any] = payload["meta"]
    for key, want in (expected or {}).items():
        if meta.get(key) != want:
            raise ValueError(f"Noisy label file {path} was written for {key}={meta.get(key)!r}, not {key}={want!r}. "
                             f"{fix_other}")
    return np.asarray(payload["labels"], dtype=np.int64), meta
