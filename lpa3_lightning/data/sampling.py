"""Resumable sampling: orders fixed by ``(seed, epoch)``, nothing drawn from torch's global generator, the
position kept in the loader's ``state_dict()`` (which Lightning checkpoints), so a run resumes mid-epoch."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.data import Dataset, DistributedSampler, RandomSampler, Sampler
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

from lpa3_lightning.core.checks import check_int, epoch_seed

__all__ = ["EpochSampler", "RandomStream", "SplitBalancedSampler", "draws_split_balanced", "labeled_per_batch",
           "train_loader"]

BatchRule = Literal["pes", "half"]


class EpochSampler(StatefulDistributedSampler):
    """``DistributedSampler``'s order for ``(seed, epoch)`` (and its arguments), resumable mid-epoch at the world
    size that wrote the state (Lightning counts an interrupted epoch's batches per process), or any after an epoch.

    Raises:
        ValueError: for a world size below 1, a rank outside it, or a mid-epoch state of another world size.
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
            (world, yielded), self._written_at = self._written_at, None
            if world != self.num_replicas and 0 < yielded < self.num_samples_at(world):
                raise ValueError(
                    f"The checkpoint was written mid-epoch by {world} processes and this run has {self.num_replicas}: "
                    "Lightning counts the interrupted epoch's batches per process, so its rest cannot be continued at "
                    f"another world size. Fix: resume with {world} processes, or from a checkpoint written at the end "
                    "of an epoch (ModelCheckpoint(save_on_train_epoch_end=True)), which loads at any world size.")
            if world != self.num_replicas:
                self.next_yielded = None  # an epoch-end state: the next epoch starts whole
        # a restored position is the iterator's made now (torchdata makes it at once), never the next epoch's
        start, self.next_yielded = self.next_yielded or 0, None
        self.yielded = start
        return self._pass(start)

    def _pass(self, start: int) -> Iterator[int]:
        # (the order is drawn at the first index, after Lightning set the epoch)
        self.yielded = start
        for index in itertools.islice(DistributedSampler.__iter__(self), start, None):
            self.yielded += 1
            yield index

    def num_samples_at(self, world: int) -> int:
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
        seed: the shuffle's seed (and the workers' base seed's).
        num_replicas: the world size (``trainer.world_size``).
        rank: this process (``trainer.global_rank``).
        shuffle: shuffle each epoch.
        **kwargs: other ``StatefulDataLoader`` arguments.

    Raises:
        ValueError: for a batch size below 1.
    """
    check_int(batch_size, "batch_size", 1, "pass a positive batch size, e.g. 128.")
    sampler = EpochSampler(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed)
    # (the workers' base seed from a generator of its own, not torch's global one)
    kwargs.setdefault("generator", torch.Generator().manual_seed(seed))
    return StatefulDataLoader(dataset, batch_size=batch_size, sampler=sampler, **kwargs)


class RandomStream(Sampler[int]):
    """``num_samples`` random indices of ``size`` items (back-to-back permutations, or with ``replacement``) in
    an order fixed by ``(seed, epoch)``, drawn at a pass's first index (Lightning sets a resumed epoch after it
    makes the iterator). Not a ``RandomSampler``, which Lightning replaces under DDP (dropping ``num_samples``).
    """

    def __init__(self, size: int, num_samples: int, replacement: bool = False, seed: int = 0) -> None:
        self.size, self.num_samples, self.replacement, self.seed = size, num_samples, replacement, seed
        self.epoch, self._epoch_given = 0, False
        self.yielded, self.next_yielded = 0, None

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self._epoch_given = epoch, True

    def state_dict(self) -> dict[str, int]:
        return {"yielded": self.yielded}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        """The next pass starts after ``state_dict["yielded"]`` indices.

        Raises:
            ValueError: for a state without ``yielded`` in ``0..num_samples``.
        """
        yielded = state_dict.get("yielded")
        if isinstance(yielded, bool) or not isinstance(yielded, int) or not 0 <= yielded <= self.num_samples:
            raise ValueError(f"A RandomStream state must hold 'yielded' in 0..{self.num_samples}, got {state_dict!r}. "
                             "Fix: resume with the data module (batch_size, mu, steps_per_epoch) that wrote it.")
        self.next_yielded = yielded

    def __iter__(self) -> Iterator[int]:
        start, self.next_yielded = self.next_yielded or 0, None  # (the pass made now owns a restored position)
        self.yielded = start
        return self._pass(start)

    def _pass(self, start: int) -> Iterator[int]:
        generator = torch.Generator().manual_seed(epoch_seed(self.seed, self.epoch))  # drawn at the first index
        if not self._epoch_given:
            self.epoch += 1
        inner = RandomSampler(range(self.size), replacement=self.replacement, num_samples=self.num_samples,
                              generator=generator)
        for index in list(inner)[start:]:
            self.yielded += 1
            yield index

    def __len__(self) -> int:
        return self.num_samples


def labeled_per_batch(num_labeled: int, num_samples: int, batch_size: int, rule: BatchRule) -> int:
    """The labeled part of a batch: ``batch_size`` less the unlabeled part, ``batch_size // 2`` (``"half"``,
    DivideMix's; ``"pes"``, PES's, when unlabeled samples outnumber labeled ones) or else the unlabeled share of
    the set; at most the labeled samples, at least what the unlabeled ones leave (ValueError for another rule).

    Example:
        >>> labeled_per_batch(550, 4000, 64, "pes"), labeled_per_batch(3000, 4000, 64, "pes")
        (32, 48)
    """
    if rule not in ("pes", "half"):
        raise ValueError(f"`rule` must be 'pes' or 'half', got {rule!r}.")
    num_unlabeled = num_samples - num_labeled
    if rule == "pes" and num_unlabeled <= num_labeled:
        unlabeled = int(num_unlabeled / num_samples * batch_size)
    else:
        unlabeled = batch_size // 2
    labeled = min(batch_size - unlabeled, num_labeled)  # no sample twice in one batch from a tiny labeled set
    return max(labeled, batch_size - num_unlabeled)


def _distinct_batches(pool: Tensor, num_batches: int, per_batch: int, generator: torch.Generator) -> Tensor:
    if per_batch == 0 or pool.numel() == 0:
        return pool.new_zeros((num_batches, 0))
    queue: list[int] = []
    batches = []
    for _ in range(num_batches):
        batch: list[int] = []
        while len(batch) < per_batch:
            taken = next((j for j, item in enumerate(queue) if item not in batch), None)
            if taken is None:  # the rest of this pass is in the batch already: start the next pass
                queue.extend(pool[torch.randperm(pool.numel(), generator=generator)].tolist())
                continue
            batch.append(queue.pop(taken))
        batches.append(batch)
    return torch.tensor(batches, dtype=torch.long)


class SplitBalancedSampler(Sampler[int]):
    """Batches with a fixed labeled share (PES's and DivideMix's semi-supervised phase): each epoch
    ``num_samples // batch_size`` batches of :func:`labeled_per_batch` labeled and the rest unlabeled indices,
    each part in shuffled passes over its pool (without a split, a shuffled pass), laid out for the round-robin
    dealing of Lightning's DDP wrapper.

    Args:
        num_samples: size of the training set.
        batch_size: the loader's batch size per process (with ``drop_last=True``).
        split: returns ``(labeled_mask, epoch)`` when an epoch's iterator is made: a ``(num_samples,)`` bool
            tensor or None, and the epoch, which with ``seed`` seeds the epoch's draws on every process.
        rule: ``"pes"`` or ``"half"`` (:func:`labeled_per_batch`).
        seed: base seed (the data module passes Lightning's global seed).
        num_replicas: processes the indices are dealt to; None: ``torch.distributed``'s world size, or 1.

    Raises:
        ValueError: for an argument out of range; at iteration, for a split of another size.
    """

    def __init__(self, num_samples: int, batch_size: int, split: Callable[[], tuple[Tensor | None, int]],
                 rule: BatchRule = "pes", seed: int = 0, num_replicas: int | None = None) -> None:
        if not isinstance(num_samples, int) or not isinstance(batch_size, int) or not 1 <= batch_size <= num_samples:
            raise ValueError(f"`batch_size` must be an int in [1, num_samples={num_samples}], got {batch_size!r}. "
                             "Fix: use a batch no larger than the training set.")
        if num_replicas is not None and (not isinstance(num_replicas, int) or num_replicas < 1):
            raise ValueError(f"`num_replicas` must be a positive int or None, got {num_replicas!r}.")
        labeled_per_batch(0, num_samples, batch_size, rule)  # checks `rule`
        self.num_samples, self.batch_size, self.split = num_samples, batch_size, split
        self.rule: BatchRule = rule
        self.seed, self.num_replicas = int(seed), num_replicas

    @property
    def num_batches(self) -> int:
        return self.num_samples // self.batch_size

    def __len__(self) -> int:
        return self.num_batches * self.batch_size

    def _world_size(self) -> int:
        if self.num_replicas is not None:
            return self.num_replicas
        return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1

    def __iter__(self) -> Iterator[int]:
        mask, epoch = self.split()
        world = self._world_size()
        generator = torch.Generator().manual_seed(epoch_seed(self.seed, epoch))
        if mask is None:
            yield from torch.randperm(self.num_samples, generator=generator)[: len(self)].tolist()
            return
        mask = torch.as_tensor(mask, dtype=torch.bool).cpu()
        if mask.shape != (self.num_samples,):
            raise ValueError(f"The split has shape {tuple(mask.shape)}, the training set {self.num_samples} samples. "
                             "Fix: return one labeled flag per training sample.")
        labeled_pool, unlabeled_pool = mask.nonzero().flatten(), (~mask).nonzero().flatten()
        per_batch = labeled_per_batch(labeled_pool.numel(), self.num_samples, self.batch_size, self.rule)
        labeled = _distinct_batches(labeled_pool, self.num_batches, per_batch, generator)
        unlabeled = _distinct_batches(unlabeled_pool, self.num_batches, self.batch_size - per_batch, generator)
        batches = torch.cat([labeled, unlabeled], dim=1)
        # mixed within each batch, so a loader that cuts the stream anywhere sees no ordering
        batches = batches.gather(1, torch.argsort(torch.rand(batches.shape, generator=generator), dim=1))
        whole = self.num_batches - self.num_batches % world
        # round-robin dealing gives process r the positions r, r + W, ...: interleave each block of W batches
        blocks = batches[:whole].view(-1, world, self.batch_size).transpose(1, 2).flatten()
        yield from torch.cat([blocks, batches[whole:].flatten()]).tolist()


def draws_split_balanced(loader: Any) -> bool:
    """Whether ``loader`` draws with a :class:`SplitBalancedSampler` (also inside Lightning's DDP wrapper)."""
    sampler = getattr(loader, "sampler", None)
    wrapped = getattr(getattr(sampler, "dataset", None), "_sampler", None)  # (Lightning's wrapper's source)
    return isinstance(sampler, SplitBalancedSampler) or isinstance(wrapped, SplitBalancedSampler)
