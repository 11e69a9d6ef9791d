"""A training DataLoader that can resume mid-epoch exactly (Lightning's stateful-loader protocol).

Lightning saves ``state_dict()`` of every training loader that has one in each checkpoint and,
when a run restarts in the middle of an epoch, calls ``load_state_dict()`` before iterating
again. This loader shuffles with a permutation seeded by ``(seed, epoch)`` (Lightning calls
``set_epoch``), counts the batches it handed out in the current epoch, and after a restore
skips exactly those indices, without loading them. Lightning does not prefetch from sized
loaders, so the count equals the batches the training loop consumed.

For one process; under DDP keep Lightning's DistributedSampler (a plain DataLoader).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

__all__ = ["EpochPermutationSampler", "ResumableDataLoader"]


class EpochPermutationSampler(Sampler[int]):
    """Indices ``0..n-1`` in an order fixed by ``(seed, epoch)``; ``skip`` drops a prefix once.

    Example:
        >>> s = EpochPermutationSampler(5, seed=0)
        >>> s.set_epoch(1)
        >>> a = list(s)
        >>> s.skip = 2
        >>> list(s) == a[2:]
        True
    """

    def __init__(self, num_samples: int, seed: int = 0, shuffle: bool = True) -> None:
        self.num_samples = num_samples
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.skip = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.num_samples, generator=generator).tolist()
        else:
            order = list(range(self.num_samples))
        skip, self.skip = self.skip, 0
        return iter(order[skip:])

    def __len__(self) -> int:
        return self.num_samples


class ResumableDataLoader(DataLoader):
    """``DataLoader(dataset, batch_size, shuffle)`` that resumes mid-epoch exactly.

    Args:
        dataset: a map-style dataset.
        batch_size: samples per batch.
        shuffle: shuffle with a ``(seed, epoch)`` permutation.
        seed: permutation seed.
        **kwargs: other ``DataLoader`` arguments (not ``sampler`` / ``batch_sampler``).
    """

    def __init__(self, dataset: Dataset, batch_size: int = 1, shuffle: bool = True, seed: int = 0,
                 **kwargs: Any) -> None:
        if "sampler" in kwargs or "batch_sampler" in kwargs:
            raise ValueError("ResumableDataLoader chooses its own sampler (under DDP Lightning tries to inject a "
                             "DistributedSampler). Fix: use a plain DataLoader there "
                             "(MedMNISTDataModule(resumable=False)).")
        if kwargs.get("num_workers", 0) > 0:
            warnings.warn("ResumableDataLoader with num_workers > 0 resumes the sample order exactly, but random "
                          "transforms inside workers restart their random streams: use num_workers=0 for a "
                          "bitwise-exact resume.", stacklevel=2)
        self.resume_sampler = EpochPermutationSampler(len(dataset), seed, shuffle)  # type: ignore[arg-type]
        # Its own generator for the per-iterator base seed: creating an iterator after a
        # restore must not draw from torch's global generator (that would shift dropout etc.).
        kwargs.setdefault("generator", torch.Generator())
        super().__init__(dataset, batch_size=batch_size, sampler=self.resume_sampler, **kwargs)
        self.batches_in_epoch = 0
        self._skip_batches = 0

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        skip, self._skip_batches = self._skip_batches, 0
        self.resume_sampler.skip = skip * int(self.batch_size or 1)
        if self.generator is not None:
            self.generator.manual_seed(self.resume_sampler.seed + self.resume_sampler.epoch)
        self.batches_in_epoch = skip
        for batch in super().__iter__():
            self.batches_in_epoch += 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.resume_sampler.epoch, "batches_in_epoch": self.batches_in_epoch,
                "seed": self.resume_sampler.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state.get("seed", self.resume_sampler.seed) != self.resume_sampler.seed:
            raise ValueError(f"The checkpointed loader used seed {state['seed']}, this one {self.resume_sampler.seed}. "
                             "Fix: resume with the same data seed.")
        self._skip_batches = int(state.get("batches_in_epoch", 0))
