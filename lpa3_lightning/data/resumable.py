"""A training DataLoader that can resume mid-epoch exactly (Lightning's stateful-loader protocol).

Lightning saves ``state_dict()`` of every training loader that has one in each checkpoint and,
when a run restarts in the middle of an epoch, calls ``load_state_dict()`` before iterating
again. This loader shuffles with a permutation seeded by ``(seed, epoch)`` (Lightning calls
``set_epoch``), counts the batches it handed out in the current epoch, and after a restore
skips exactly those indices, without loading them. Lightning does not prefetch from sized
loaders, so the count equals the batches the training loop consumed.

Its sampler, :class:`ResumableDistributedSampler`, is a ``DistributedSampler`` that reads the
world size and rank of the process group each epoch (one process: the whole permutation). So
under DDP Lightning keeps it instead of injecting its own (whose rebuild of the loader would lose
this loader's shuffle and seed), and each epoch is sharded exactly as torch's
``DistributedSampler`` shards it (the same permutation, padding and ``rank::world_size`` slice),
however early the loader was built. Every rank consumes as many batches as the others, so rank
0's count, which the checkpoint holds, resumes every rank.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

__all__ = ["EpochPermutationSampler", "ResumableDataLoader", "ResumableDistributedSampler"]


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


class ResumableDistributedSampler(DistributedSampler):
    """torch's ``DistributedSampler`` order for ``(seed, epoch)``, with the world size and rank read
    from the process group when iterated (unless given), and ``skip`` dropping a prefix of this
    rank's indices once.

    Example:
        >>> s = ResumableDistributedSampler(list(range(5)), num_replicas=2, rank=1, seed=0)
        >>> len(s), list(s) == list(DistributedSampler(list(range(5)), num_replicas=2, rank=1, seed=0))
        (3, True)
    """

    def __init__(self, dataset: Dataset, num_replicas: int | None = None, rank: int | None = None,
                 shuffle: bool = True, seed: int = 0) -> None:
        if num_replicas is not None and (isinstance(num_replicas, bool) or not isinstance(num_replicas, int)
                                         or num_replicas < 1):
            raise ValueError(f"`num_replicas` must be a positive int (the world size) or None (the process "
                             f"group's), got {num_replicas!r}.")
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 0
                                 or (num_replicas is not None and rank >= num_replicas)):
            raise ValueError(f"`rank` must be in 0..{'num_replicas - 1' if num_replicas is None else num_replicas - 1}"
                             f" or None (the process group's), got {rank!r}.")
        # not DistributedSampler.__init__, which reads the process group now: a loader is often
        # built before Lightning starts it
        self.dataset, self.shuffle, self.seed, self.epoch, self.drop_last = dataset, shuffle, seed, 0, False
        self._replicas, self._rank = num_replicas, rank
        self.skip = 0

    @property
    def num_replicas(self) -> int:  # type: ignore[override]
        if self._replicas is not None:
            return self._replicas
        return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1

    @property
    def rank(self) -> int:  # type: ignore[override]
        if self._rank is not None:
            return self._rank
        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    @property
    def num_samples(self) -> int:  # type: ignore[override]
        return -(-len(self.dataset) // self.num_replicas)  # type: ignore[arg-type]

    @property
    def total_size(self) -> int:  # type: ignore[override]
        return self.num_samples * self.num_replicas

    def __iter__(self) -> Iterator[int]:
        order = list(super().__iter__())
        skip, self.skip = self.skip, 0
        return iter(order[skip:])


class ResumableDataLoader(DataLoader):
    """``DataLoader(dataset, batch_size, shuffle)`` that resumes mid-epoch exactly, also under DDP.

    Args:
        dataset: a map-style dataset.
        batch_size: samples per batch.
        shuffle: shuffle with a ``(seed, epoch)`` permutation.
        seed: permutation seed.
        num_replicas: processes to shard each epoch over; None: the process group's (1 without one).
        rank: this process's share; None: the process group's rank.
        **kwargs: other ``DataLoader`` arguments (not ``sampler`` / ``batch_sampler``).
    """

    def __init__(self, dataset: Dataset, batch_size: int = 1, shuffle: bool = True, seed: int = 0,
                 num_replicas: int | None = None, rank: int | None = None, **kwargs: Any) -> None:
        if kwargs.get("sampler") is not None or kwargs.get("batch_sampler") is not None:
            raise ValueError("ResumableDataLoader chooses its own sampler (a DistributedSampler that follows the "
                             "process group, so that Lightning keeps it under DDP). Fix: drop `sampler` / "
                             "`batch_sampler`, or use a plain DataLoader.")
        kwargs.pop("sampler", None)
        kwargs.pop("batch_sampler", None)
        if kwargs.get("num_workers", 0) > 0:
            warnings.warn("ResumableDataLoader with num_workers > 0 resumes the sample order exactly, but random "
                          "transforms inside workers restart their random streams: use num_workers=0 for a "
                          "bitwise-exact resume.", stacklevel=2)
        self.resume_sampler = ResumableDistributedSampler(dataset, num_replicas, rank, shuffle, seed)
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
                "seed": self.resume_sampler.seed, "num_replicas": self.resume_sampler.num_replicas}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Skip the batches the checkpointed epoch consumed (an epoch sharded another way restarts).

        Raises:
            ValueError: if the checkpoint's loader used another seed.
        """
        if state.get("seed", self.resume_sampler.seed) != self.resume_sampler.seed:
            raise ValueError(f"The checkpointed loader used seed {state['seed']}, this one {self.resume_sampler.seed}. "
                             "Fix: resume with the same data seed.")
        replicas = int(state.get("num_replicas", 1))
        if replicas != self.resume_sampler.num_replicas:
            warnings.warn(f"The checkpoint was written mid-epoch by {replicas} processes and this run has "
                          f"{self.resume_sampler.num_replicas}: their shares of the epoch differ, so the interrupted "
                          "epoch restarts from its first batch (its samples seen before the interruption are seen "
                          "again). Resume with the same world size to continue it exactly.", stacklevel=2)
            self._skip_batches = 0
            return
        self._skip_batches = int(state.get("batches_in_epoch", 0))
