"""Cached hard positives, reused between regenerations (paper appendix, "every K epochs").

Each sample's ``x'`` expires ``K`` epochs after it was written and is reused only for the label it was solved
for. The store, indexed by dataset index, is allocated at the first write: on ``device`` up to ``max_bytes``,
else in a memory-mapped file under ``directory`` whose name is removed once mapped (no run leaves it behind).
"""

from __future__ import annotations

import contextlib
import math
import os
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lpa3_lightning.core.checks import check_int

__all__ = ["AugmentationCache", "RowPlan", "assemble_inputs", "plan_rows"]

_STATE_VERSION = 2  # 2 added the labels the entries were solved for
DEFAULT_MAX_BYTES = 1 << 30  # 1 GiB in memory before a file is needed


class AugmentationCache:
    """Per-sample store of ``x'`` with the epoch it was generated in.

    Args:
        num_samples: training-set size (dataset indices ``0..num_samples-1``).
        every_n_epochs: ``K``; an entry written in epoch ``e`` is reused until epoch ``e + K - 1``.
        max_bytes: largest in-memory store; beyond it a file under ``directory`` is used.
        directory: folder for the memory-mapped store (created when needed).
        device: where an in-memory store lives (host memory, with a warning, if a GPU has under twice it free).

    Raises:
        ValueError: on a bad argument, or (at the first write) a store over ``max_bytes`` with no ``directory``.

    Example:
        >>> cache = AugmentationCache(num_samples=4, every_n_epochs=2)
        >>> cache.put(torch.tensor([1, 3]), torch.ones(2, 5), epoch=0)
        >>> cache.fresh(torch.tensor([0, 1, 3]), epoch=1).tolist()
        [False, True, True]
        >>> cache.fresh(torch.tensor([1]), epoch=2).tolist()
        [False]
    """

    def __init__(self, num_samples: int, every_n_epochs: int, max_bytes: int = DEFAULT_MAX_BYTES,
                 directory: str | Path | None = None, device: torch.device | str = "cpu") -> None:
        if not isinstance(num_samples, int) or num_samples < 1:
            raise ValueError(f"`num_samples` must be a positive int, got {num_samples!r}. Fix: pass the training set's "
                             "size.")
        check_int(every_n_epochs, "every_n_epochs", 1, "use 1 (no reuse) or e.g. 10 (the paper's appendix).")
        if not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"`max_bytes` must be an int >= 0, got {max_bytes!r}. Fix: use e.g. 2**30 (1 GiB).")
        self.num_samples, self.every_n_epochs, self.max_bytes = num_samples, every_n_epochs, max_bytes
        self.directory = None if directory is None else Path(directory)
        self.device = torch.device(device)
        self.storage: Tensor | None = None
        self.file: Path | None = None
        self.written = torch.full((num_samples,), -1, dtype=torch.long)  # epoch of the entry, -1: none
        self.labels = torch.full((num_samples,), -1, dtype=torch.long)  # label each entry was solved for

    @property
    def nbytes(self) -> int:
        return 0 if self.storage is None else self.storage.numel() * self.storage.element_size()

    def _new_storage(self, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        """A zero store: in memory up to ``max_bytes`` (a restored one too), else in a file under ``directory``."""
        numel = math.prod(shape)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if nbytes <= self.max_bytes:
            return torch.zeros(shape, dtype=dtype, device=self._place(nbytes))
        if self.directory is None:
            raise ValueError(
                f"Caching x' for {self.num_samples} samples of shape {tuple(shape[1:])} needs {nbytes / 2**20:.1f} "
                f"MiB, more than cache.max_bytes={self.max_bytes}. Fix: set `cache.dir` for a memory-mapped file, or "
                "raise `cache.max_bytes`.")
        self.check_directory(self.directory, "cache.dir")
        # one file per run: concurrent runs (or nodes sharing a file system) never write the same one
        self.file = self.directory / f"lpa3_augmentation_cache_{os.getpid()}_{uuid.uuid4().hex[:8]}.bin"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            flat = torch.from_file(str(self.file), shared=True, size=numel, dtype=dtype)
        except (OSError, RuntimeError) as exc:
            raise OSError(f"The x' cache could not create its file in `cache.dir`={str(self.directory)!r} ({exc}). "
                          "Fix: point cache.dir to a writable folder with room for the cache, or raise "
                          "cache.max_bytes to keep it in memory.") from exc
        # the mapping outlives the name (POSIX); where the name cannot go while mapped (Windows), close() deletes it
        with contextlib.suppress(OSError):
            self.file.unlink()
        return flat.view(shape)

    @staticmethod
    def check_directory(directory: str | Path, setting: str = "directory") -> None:
        """Refuse (ValueError naming ``setting``) a ``directory`` whose nearest existing part is not a writable
        folder; creates nothing."""
        path = existing = Path(directory)
        while not existing.exists() and existing.parent != existing:
            existing = existing.parent
        if not existing.is_dir():
            raise ValueError(f"`{setting}`={str(path)!r} cannot hold the x' cache's file: {str(existing)!r} is not a "
                             f"folder. Fix: point {setting} to a folder, or to a path where one can be created.")
        if not os.access(existing, os.W_OK | os.X_OK):
            raise ValueError(f"`{setting}`={str(path)!r} cannot hold the x' cache's file: {str(existing)!r} is not "
                             f"writable. Fix: point {setting} to a writable folder.")

    def _place(self, nbytes: int) -> torch.device:
        """``device``, unless that is a GPU with less than twice ``nbytes`` free (free and reserved-but-unused:
        the margin is for the step's activations and the optimizer's state, which come after the first write)."""
        device = self.device
        if device.type != "cuda":
            return device
        free = torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) \
            - torch.cuda.memory_allocated(device)
        if 2 * nbytes > free:
            warnings.warn(f"The x' cache ({nbytes / 2**20:.1f} MiB) would take more than half of the free memory "
                          f"of {device}; it is kept in host memory instead (reuse then copies x' to the GPU).",
                          stacklevel=4)
            return torch.device("cpu")
        return device

    def offload(self) -> None:
        """Move an in-memory store to host memory (the callback does it at the end of a fit)."""
        if self.storage is not None and self.file is None:
            self.storage = self.storage.cpu()

    def _check_indices(self, indices: Tensor) -> Tensor:
        if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= self.num_samples):
            raise ValueError(f"Cache indices out of range [0, {self.num_samples}). Fix: pass dataset indices of the "
                             "training set the cache was made for.")
        return indices.cpu().long()

    def _young(self, written: Tensor, epoch: int) -> Tensor:
        return (written >= 0) & (epoch - written < self.every_n_epochs)

    def fresh(self, indices: Tensor, epoch: int, labels: Tensor | None = None) -> Tensor:
        """Which of ``indices`` have an entry young enough to reuse in ``epoch`` (and, with
        ``labels``, solved for that label)."""
        idx = self._check_indices(indices)
        young = self._young(self.written[idx], epoch)
        if labels is not None:
            young &= self.labels[idx] == labels.detach().cpu().long()
        return young.to(indices.device)

    def reusable_from_before(self, epoch: int) -> bool:
        """Whether any entry written before ``epoch`` is still fresh in it."""
        return bool((self._young(self.written, epoch) & (self.written < epoch)).any())

    def get(self, indices: Tensor) -> Tensor:
        """The stored ``x'`` of ``indices``, on the store's device; only valid for entries reported fresh."""
        if self.storage is None:
            raise RuntimeError("The augmentation cache is empty. Fix: put rows before reading them (check `fresh` first).")
        self._check_indices(indices)
        return self.storage[indices.to(self.storage.device).long()]

    def put(self, indices: Tensor, inputs: Tensor, labels: Tensor | None = None, *, epoch: int) -> None:
        """Store ``x'`` for ``indices`` as generated in ``epoch`` (for ``labels``, when given)."""
        if indices.numel() == 0:
            return
        idx = self._check_indices(indices)
        if self.storage is None:
            self.storage = self._new_storage((self.num_samples, *inputs.shape[1:]), inputs.dtype)
        store = self.storage
        store[idx.to(store.device)] = inputs.detach().to(store.device, store.dtype)
        self.written[idx] = epoch
        self.labels[idx] = -1 if labels is None else labels.detach().cpu().long()

    def close(self) -> None:
        """Delete the memory-mapped file, if any (its entries are gone: the cache starts empty)."""
        if self.file is not None:
            self.storage = None
            self.written.fill_(-1)
            self.file.unlink(missing_ok=True)
            self.file = None

    def state_dict(self, include_inputs: bool = False) -> dict[str, Any]:
        """With ``include_inputs`` the entries travel in the checkpoint (a copy, from memory or the file, as
        large as the store) for an exact resume; otherwise the resumed cache starts empty."""
        saved = include_inputs and self.storage is not None
        return {
            "version": _STATE_VERSION,
            "num_samples": self.num_samples,
            "written": self.written.clone() if saved else torch.full_like(self.written, -1),
            "labels": self.labels.clone() if saved else torch.full_like(self.labels, -1),
            "storage": self.storage.to("cpu", copy=True) if saved else None,  # a checkpoint loads on any machine
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` of this version (a store over ``max_bytes`` goes to a file); ValueError
        naming the fix for a state of another version or data set size."""
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"This x' cache state is of version {state.get('version')!r}; this package reads version "
                             f"{_STATE_VERSION}. Fix: resume with the lpa3-lightning version that wrote it, or start a "
                             "new run.")
        if state.get("num_samples") != self.num_samples:
            raise ValueError(f"The checkpointed augmentation cache is for {state.get('num_samples')} samples, this "
                             f"training set has {self.num_samples}. Fix: resume with the same training data.")
        self.written, self.labels = state["written"].clone(), state["labels"].clone()
        self.storage, self.file = None, None
        if state.get("storage") is not None:
            self.storage = self._new_storage(tuple(state["storage"].shape), state["storage"].dtype)
            self.storage.copy_(state["storage"])


@dataclass(frozen=True)
class RowPlan:
    """What one step does with each selected row (``(n,)`` bool masks): ``keep`` (the row gets an ``x'``
    this step: ``reuse | solve``), ``reuse`` (its cached ``x'``), ``solve`` (the solver makes it now)."""

    keep: Tensor
    reuse: Tensor
    solve: Tensor


def plan_rows(cached: Tensor, solver_runs: bool = True) -> RowPlan:
    """Plan the selected rows of one step: a lone row to solve waits for a later step, and a step left with one
    ``x'`` uses none (batch statistics need two rows).

    Args:
        cached: ``(n,)`` bool, the rows with a fresh cached ``x'`` for their current label.
        solver_runs: whether the solver may run this step (else only cached rows get an ``x'``).
    """
    if cached.dtype != torch.bool or cached.dim() != 1:
        raise ValueError(f"`cached` must be a 1-D bool mask over the selected rows, got {cached.dtype} of shape "
                         f"{tuple(cached.shape)}. Fix: pass AugmentationCache.fresh(...)'s mask.")
    keep = cached if not solver_runs or int((~cached).sum()) == 1 else torch.ones_like(cached)
    if int(keep.sum()) == 1:
        keep = torch.zeros_like(keep)
    return RowPlan(keep=keep, reuse=cached & keep, solve=~cached & keep)


def assemble_inputs(inputs: Tensor, solve: Tensor, solved: Tensor, reuse: Tensor, cached: Tensor | None) -> Tensor:
    """The step's ``x'``: ``solved`` in the rows to ``solve``, ``cached`` in the rows to ``reuse``,
    a detached copy of ``inputs`` elsewhere (rows neither solved nor reused are never trained on)."""
    out = inputs.detach().clone()
    if solved.shape[0]:
        out[solve] = solved.to(out.dtype)
    if cached is not None and cached.shape[0]:
        out[reuse] = cached.to(out.device, out.dtype)
    return out
