"""The training loader of the shipped data modules: torchdata's ``StatefulDataLoader`` over a
``(seed, epoch)`` shuffle, which Lightning checkpoints and restores, mid-epoch included.

Lightning saves the ``state_dict()`` of a stateful training loader in every checkpoint and
restores it before iterating again, so a run resumed from a checkpoint written in the middle of
an epoch continues that epoch exactly where it stopped (torchdata's loader saves its workers'
state too). The sampler, :class:`EpochSampler`, is torchdata's ``StatefulDistributedSampler``:
a ``DistributedSampler`` (so Lightning keeps it under DDP instead of replacing it) whose order is
fixed by ``(seed, epoch)`` and whose state counts the indices it handed out. One addition: its
state names the world size it was written at, and a mid-epoch state is refused at another world
size (Lightning counts an interrupted epoch's batches per process, so the rest of that epoch
cannot be continued there: a restart would see samples twice, and at a larger world size the
loop would end the epoch before the loader; a skip would never see some samples). An epoch-end
state loads at any world size.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Dataset, DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

from lpa3_lightning.core.arguments import check_int

__all__ = ["EpochSampler", "train_loader"]


class EpochSampler(StatefulDistributedSampler):
    """torch's ``DistributedSampler`` order for ``(seed, epoch)`` (one process: the whole
    permutation), resumable mid-epoch (torchdata's state) at the world size that wrote the state.

    Args:
        dataset: a map-style dataset.
        num_replicas: the world size.
        rank: this process.
        shuffle: shuffle with a ``(seed, epoch)`` permutation.
        seed: the permutation's seed.

    Raises:
        ValueError: for a world size below 1 or a rank outside it, naming the argument.

    Example:
        >>> from torch.utils.data import DistributedSampler
        >>> s = EpochSampler(list(range(5)), num_replicas=2, rank=1, seed=0)
        >>> list(s) == list(DistributedSampler(list(range(5)), num_replicas=2, rank=1, seed=0))
        True
    """

    def __init__(self, dataset: Dataset, num_replicas: int = 1, rank: int = 0, shuffle: bool = True,
                 seed: int = 0) -> None:
        check_int(num_replicas, "num_replicas", 1, "pass the world size (trainer.world_size).")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < num_replicas:
            raise ValueError(f"`rank` must be in 0..{num_replicas - 1} (the global rank), got {rank!r}. Fix: pass "
                             "trainer.global_rank.")
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed)
        self._written_at: tuple[int, int] | None = None  # (world size, yielded) of a state to load

    def __iter__(self) -> Iterator[int]:
        if self._written_at is not None:
            written_at, self._written_at = self._written_at, None
            world, yielded = written_at
            if world != self.num_replicas and 0 < yielded < self.num_samples_at(world):
                raise ValueError(
                    f"The checkpoint was written mid-epoch by {world} processes and this run has {self.num_replicas}: "
                    "Lightning counts the interrupted epoch's batches per process, so its rest cannot be continued at "
                    f"another world size. Fix: resume with {world} processes, or from a checkpoint written at the end "
                    "of an epoch (ModelCheckpoint(save_on_train_epoch_end=True)), which loads at any world size."
                )
            if world != self.num_replicas:
                self.next_yielded = None  # an epoch-end state: the next epoch starts whole
        # A restored position belongs to the iterator made from the restored state (torchdata makes it
        # at once): taken now, not at this pass's first index. Lightning may never draw from that
        # iterator (a checkpoint of an epoch's last batch resumes into the epoch's end) and makes the
        # next epoch's: a position still pending would then skip the next epoch whole.
        start, self.next_yielded = self.next_yielded or 0, None
        self.yielded = start
        return self._pass(start)

    def _pass(self, start: int) -> Iterator[int]:
        # the order is drawn at the first index, after Lightning set the epoch (set_sampler_epoch
        # follows the restore)
        self.yielded = start
        for index in itertools.islice(DistributedSampler.__iter__(self), start, None):
            self.yielded += 1
            yield index

    def num_samples_at(self, world: int) -> int:
        """How many indices each of ``world`` processes takes in an epoch."""
        return -(-len(self.dataset) // world)  # type: ignore[arg-type]

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "num_replicas": self.num_replicas}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._written_at = (int(state_dict.get("num_replicas", self.num_replicas)), int(state_dict[self._YIELDED]))


def train_loader(dataset: Dataset, batch_size: int, *, seed: int = 0, num_replicas: int = 1, rank: int = 0,
                 shuffle: bool = True, **kwargs: Any) -> StatefulDataLoader:
    """A resumable training loader: ``StatefulDataLoader`` with an :class:`EpochSampler`.

    Args:
        dataset: a map-style dataset.
        batch_size: samples per batch.
        seed: the shuffle's seed.
        num_replicas: the world size (``trainer.world_size``).
        rank: this process (``trainer.global_rank``).
        shuffle: shuffle each epoch.
        **kwargs: other ``StatefulDataLoader`` arguments (``num_workers``, ``pin_memory``, ...).

    Raises:
        ValueError: for a batch size below 1, naming it.
    """
    check_int(batch_size, "batch_size", 1, "pass a positive batch size, e.g. 128.")
    sampler = EpochSampler(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed)
    # its own generator for the workers' base seed: creating an iterator must not draw from
    # torch's global generator (a resumed run would shift dropout and the user's draws)
    kwargs.setdefault("generator", torch.Generator().manual_seed(seed))
    return StatefulDataLoader(dataset, batch_size=batch_size, sampler=sampler, **kwargs)
