"""Cached hard positives, reused between regenerations (paper appendix, "every K epochs").

Generating ``x'`` costs ``T`` forward+backward passes per sample. The authors' appendix
regenerates ``x'`` only every ``K`` epochs and trains on the stored copy in between; ``K = 10``
or ``100`` keeps the accuracy of ``K = 1`` at a fraction of the time. Here each sample's ``x'``
expires ``K`` epochs after it was written, so every sample is attacked at most once per
``K`` epochs whenever it is selected.

The store is one tensor indexed by dataset index, allocated at the first write: in memory
when it fits in ``max_bytes``, else in a memory-mapped file under ``directory`` (for large
data sets); without a directory an over-large cache is refused with the fix. The in-memory
store lives on ``device``: beside the model on a GPU, a reused ``x'`` is an index into device
memory, with no host-to-device copy of the inputs (the entries' epochs and labels stay on the
host, where the plan step reads them). When the GPU has less than twice the store free, it
stays in host memory, with a warning; at the end of a fit the callback moves it there
(:meth:`AugmentationCache.offload`). Each entry
keeps the label it was solved for and is reused only for that label (pseudo-labels change
between epochs). The store's entries are checkpointed only when asked
(``state_dict(include_inputs=True)``: a copy, from memory or from the file, as large as the
store; a restored store larger than ``max_bytes`` goes to a file). The file's name is removed as soon as it is mapped, so no run leaves it
behind, however it ends (SIGKILL included); :meth:`close` releases the mapping (the callback
calls it at the end of fit and on an exception). A store that was not saved restarts empty on
resume (its entries are regenerated). ``max_bytes`` bounds one store: the callback gives each
network of a module its share, and every process holds a whole copy.
"""

from __future__ import annotations

import contextlib
import math
import os
import uuid
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

__all__ = ["AugmentationCache"]

_STATE_VERSION = 2  # 2 added the labels the entries were solved for
DEFAULT_MAX_BYTES = 1 << 30  # 1 GiB in memory before a file is needed


class AugmentationCache:
    """Per-sample store of ``x'`` with the epoch it was generated in.

    Args:
        num_samples: training-set size (dataset indices ``0..num_samples-1``).
        every_n_epochs: ``K``; an entry written in epoch ``e`` is reused until epoch ``e + K - 1``.
        max_bytes: largest in-memory store; beyond it a file under ``directory`` is used.
        directory: folder for the memory-mapped store (created when needed).
        device: where an in-memory store lives (a file store is always in host memory).

    Raises:
        ValueError: on a bad argument, or (at the first write) a store larger than
            ``max_bytes`` with no ``directory``.

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
            raise ValueError(f"`num_samples` must be a positive int, got {num_samples!r}.")
        if isinstance(every_n_epochs, bool) or not isinstance(every_n_epochs, int) or every_n_epochs < 1:
            raise ValueError(f"`every_n_epochs` must be an int >= 1, got {every_n_epochs!r}. "
                             "Fix: use 1 (no reuse) or e.g. 10 (the paper's appendix).")
        if not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"`max_bytes` must be an int >= 0, got {max_bytes!r}. Fix: use e.g. 2**30 (1 GiB).")
        self.num_samples = num_samples
        self.every_n_epochs = every_n_epochs
        self.max_bytes = max_bytes
        self.directory = None if directory is None else Path(directory)
        self.device = torch.device(device)
        self.storage: Tensor | None = None
        self.file: Path | None = None
        self.written = torch.full((num_samples,), -1, dtype=torch.long)  # epoch of the entry, -1: none
        self.labels = torch.full((num_samples,), -1, dtype=torch.long)  # label each entry was solved for

    @property
    def nbytes(self) -> int:
        return 0 if self.storage is None else self.storage.numel() * self.storage.element_size()

    def _allocate(self, sample_shape: tuple[int, ...], dtype: torch.dtype) -> None:
        numel = self.num_samples * math.prod(sample_shape)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if nbytes <= self.max_bytes:
            self.storage = torch.zeros((self.num_samples, *sample_shape), dtype=dtype, device=self._place(nbytes))
            return
        if self.directory is None:
            raise ValueError(
                f"Caching x' for {self.num_samples} samples of shape {sample_shape} needs {nbytes / 2**20:.1f} MiB, "
                f"more than cache.max_bytes={self.max_bytes}. Fix: set `cache.dir` for a memory-mapped file, or "
                "raise `cache.max_bytes`."
            )
        self.storage = self._mapped_file(numel, dtype).view(self.num_samples, *sample_shape)

    def _mapped_file(self, numel: int, dtype: torch.dtype) -> Tensor:
        """A new memory-mapped file of ``numel`` zeros under ``directory``, its name already removed."""
        assert self.directory is not None
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
        # The mapping outlives the name (POSIX): with the name gone at once, a run that ends any way,
        # SIGKILL included, leaves no file behind. (Where the name cannot go while mapped, as on
        # Windows, close() deletes it.)
        with contextlib.suppress(OSError):
            self.file.unlink()
        return flat

    @staticmethod
    def check_directory(directory: str | Path, setting: str = "directory") -> None:
        """Refuse a folder the store could not make its file in, naming ``setting``; creates nothing.

        Raises:
            ValueError: when ``directory``, or the nearest part of its path that exists, is not a
                folder or not writable.
        """
        path = Path(directory)
        existing = path
        while not existing.exists() and existing.parent != existing:
            existing = existing.parent
        if not existing.is_dir():
            raise ValueError(f"`{setting}`={str(path)!r} cannot hold the x' cache's file: {str(existing)!r} is not a "
                             f"folder. Fix: point {setting} to a folder, or to a path where one can be created.")
        if not os.access(existing, os.W_OK | os.X_OK):
            raise ValueError(f"`{setting}`={str(path)!r} cannot hold the x' cache's file: {str(existing)!r} is not "
                             f"writable. Fix: point {setting} to a writable folder.")

    def _place(self, nbytes: int) -> torch.device:
        """Where an in-memory store of ``nbytes`` goes: ``device``, unless that is a GPU with less
        than twice the store free. Free counts the driver's free memory and the blocks torch has
        reserved but not used. The check runs at the first write, before the training step has
        allocated its activations (and, at the start of a fit, the optimizer its state): the
        factor two is the margin for them."""
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
        """Move an in-memory store to host memory (the callback does it at the end of a fit, so the
        GPU memory is free for what follows; a checkpoint written then still holds the entries)."""
        if self.storage is not None and self.file is None:
            self.storage = self.storage.cpu()

    def _check_indices(self, indices: Tensor) -> Tensor:
        if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= self.num_samples):
            raise ValueError(f"Cache indices out of range [0, {self.num_samples}).")
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
            raise RuntimeError("The augmentation cache is empty.")
        self._check_indices(indices)
        return self.storage[indices.to(self.storage.device).long()]

    def put(self, indices: Tensor, inputs: Tensor, labels: Tensor | None = None, *, epoch: int) -> None:
        """Store ``x'`` for ``indices`` as generated in ``epoch`` (for ``labels``, when given)."""
        if indices.numel() == 0:
            return
        idx = self._check_indices(indices)
        if self.storage is None:
            self._allocate(tuple(inputs.shape[1:]), inputs.dtype)
        store = self.storage  # type: ignore[union-attr]
        store[idx.to(store.device)] = inputs.detach().to(store.device, store.dtype)  # type: ignore[index]
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
        """With ``include_inputs`` the store's entries travel in the checkpoint, copied out of
        memory or out of the file (a snapshot: the run keeps writing the file), for an exact
        resume; otherwise the resumed cache starts empty."""
        saved = include_inputs and self.storage is not None
        return {
            "version": _STATE_VERSION,
            "num_samples": self.num_samples,
            "written": self.written.clone() if saved else torch.full_like(self.written, -1),
            "labels": self.labels.clone() if saved else torch.full_like(self.labels, -1),
            "storage": self.storage.to("cpu", copy=True) if saved else None,  # a checkpoint loads on any machine
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` of this version.

        Raises:
            ValueError: for a state of another version or data set size, naming the fix.
        """
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"This x' cache state is of version {state.get('version')!r}; this package reads version "
                             f"{_STATE_VERSION}. Fix: resume with the lpa3-lightning version that wrote it, or start a "
                             "new run.")
        if state.get("num_samples") != self.num_samples:
            raise ValueError(
                f"The checkpointed augmentation cache is for {state.get('num_samples')} samples, this training set "
                f"has {self.num_samples}. Fix: resume with the same training data."
            )
        self.written = state["written"].clone()
        self.labels = state["labels"].clone()
        self.storage, self.file = None, None
        if state.get("storage") is not None:
            stored = state["storage"]
            nbytes = stored.numel() * stored.element_size()
            if nbytes > self.max_bytes:  # the bound holds for a restored store too: a file, as a new one would be
                if self.directory is None:
                    raise ValueError(
                        f"The checkpoint's x' cache holds {nbytes} bytes, more than cache.max_bytes={self.max_bytes}. "
                        "Fix: set `cache.dir` for a memory-mapped file, or raise `cache.max_bytes`."
                    )
                self.storage = self._mapped_file(stored.numel(), stored.dtype).view(stored.shape)
                self.storage.copy_(stored)
            else:
                self.storage = stored.to(self._place(nbytes), copy=True)
