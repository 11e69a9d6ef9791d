"""Batches with a fixed labeled share, for the semi-supervised phase of PES and DivideMix.

Once PES or DivideMix has split a noisy training set into labeled (trusted) and unlabeled
samples, their authors do not draw batches from the whole set: each step takes a labeled and an
unlabeled part of set sizes, so a small labeled set is revisited many times an epoch. PES's code
(Bai et al., NeurIPS 2021, as released with LP-A3) gives the unlabeled part half of each batch
when unlabeled samples outnumber labeled ones, else its share of the set; DivideMix's code (Li
et al., ICLR 2020) takes a labeled and an unlabeled batch of equal size every step. At 80% noise
the labeled set is a seventh of the data or less, so a batch drawn from the whole set holds a
handful of labeled samples and the labeled loss sees each of them once an epoch.

:class:`SplitBalancedSampler` reproduces the composition with an ordinary index sampler: each
epoch it asks for the current split, then yields batch after batch of ``labeled_per_batch``
labeled and ``batch_size - labeled_per_batch`` unlabeled indices (each part in shuffled passes
over its pool, no index twice in a batch). An epoch has as many batches as a pass over the
whole set (``num_samples // batch_size``), whatever the split; before a split exists it is a
plain shuffled pass. Under DDP the stream is laid out for the round-robin dealing of Lightning's
sampler wrapper, so each process's batch has the share too.

The split is read when the epoch's data iterator is made. Lightning makes it after
``on_train_epoch_start`` (where PES and DivideMix refresh the split) in every epoch but the first
of a fit: a run resumed from a checkpoint draws its first epoch's batches with the checkpoint's
split (the epoch before's); the loss still uses the refreshed one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.data import Sampler

from lpa3_lightning.core.seeds import epoch_seed

__all__ = ["SplitBalancedSampler", "labeled_per_batch"]

BatchRule = Literal["pes", "half"]


def labeled_per_batch(num_labeled: int, num_samples: int, batch_size: int, rule: BatchRule) -> int:
    """The labeled part of a batch of ``batch_size`` under ``rule``.

    ``"pes"``: the unlabeled part is ``batch_size // 2`` when the unlabeled samples outnumber the
    labeled, else its share of the set, ``int(num_unlabeled / num_samples * batch_size)``.
    ``"half"`` (DivideMix): ``batch_size // 2``. Never more than there are labeled samples, never
    fewer than the batch's unlabeled part leaves when there are few unlabeled ones.

    Example:
        >>> labeled_per_batch(550, 4000, 64, "pes"), labeled_per_batch(3000, 4000, 64, "pes")
        (32, 48)
    """
    if rule not in ("pes", "half"):
        raise ValueError(f"`rule` must be 'pes' or 'half', got {rule!r}.")
    num_unlabeled = num_samples - num_labeled
    if rule == "pes":
        unlabeled = batch_size // 2 if num_unlabeled > num_labeled else int(num_unlabeled / num_samples * batch_size)
    else:
        unlabeled = batch_size // 2
    labeled = batch_size - unlabeled
    labeled = min(labeled, num_labeled)  # no sample twice in one batch from a tiny labeled set
    return max(labeled, batch_size - num_unlabeled)


def _distinct_batches(pool: Tensor, num_batches: int, per_batch: int, generator: torch.Generator) -> Tensor:
    """``(num_batches, per_batch)`` indices of ``pool``, taken in shuffled passes over it, no index twice
    in a batch (where a batch spans two passes, an index already in it waits for the next batch)."""
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
    """Indices for batches of ``batch_size`` with a fixed labeled share (see the module docstring).

    Args:
        num_samples: size of the training set.
        batch_size: the loader's batch size per process (the loader must use it, with
            ``drop_last=True``).
        split: called when an epoch's iterator is made; returns ``(labeled_mask, epoch)``: the
            current split, a ``(num_samples,)`` bool tensor or None before there is one, and
            the epoch (with ``seed``, it seeds the epoch's balanced draws, identically on every
            process).
        rule: ``"pes"`` or ``"half"`` (:func:`labeled_per_batch`).
        seed: base seed of the balanced draws (the data module passes Lightning's global seed).
        num_replicas: processes the indices are dealt to; None: the ``torch.distributed`` world
            size when initialised, else 1.

    Before there is a split, a plain shuffled pass, in the order of the seeded generator (every
    process deals from the same order; a resumed run draws the same). Under DDP Lightning wraps the sampler in a
    ``DistributedSamplerWrapper`` that deals the indices round robin, ``stream[rank::W]``; the
    stream is laid out for that dealing (each block of ``W`` batches interleaved), so every
    process's batch has the labeled share exactly.

    Example:
        >>> labeled = torch.zeros(100, dtype=torch.bool); labeled[:10] = True
        >>> sampler = SplitBalancedSampler(100, 20, lambda: (labeled, 3), rule="pes")
        >>> batches = torch.tensor(list(sampler)).view(-1, 20)
        >>> batches.shape[0], int(labeled[batches].sum(1).min()), int(labeled[batches].sum(1).max())
        (5, 10, 10)
    """

    def __init__(self, num_samples: int, batch_size: int, split: Callable[[], tuple[Tensor | None, int]],
                 rule: BatchRule = "pes", seed: int = 0, num_replicas: int | None = None) -> None:
        if not isinstance(num_samples, int) or not isinstance(batch_size, int) or not 1 <= batch_size <= num_samples:
            raise ValueError(f"`batch_size` must be an int in [1, num_samples={num_samples}], got {batch_size!r}. "
                             "Fix: use a batch no larger than the training set.")
        if num_replicas is not None and (not isinstance(num_replicas, int) or num_replicas < 1):
            raise ValueError(f"`num_replicas` must be a positive int or None, got {num_replicas!r}.")
        labeled_per_batch(0, num_samples, batch_size, rule)  # checks `rule`
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.split = split
        self.rule: BatchRule = rule
        self.seed = int(seed)
        self.num_replicas = num_replicas

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
        if mask is None:  # a plain shuffled pass, in the (seed, epoch) order (nothing drawn from the global generator)
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
        # round-robin dealing gives process r the positions r, r + W, ...: interleave each block
        # of W batches so that those positions are one whole batch
        blocks = batches[:whole].view(-1, world, self.batch_size).transpose(1, 2).flatten()
        yield from torch.cat([blocks, batches[whole:].flatten()]).tolist()


def draws_split_balanced(loader: Any) -> bool:
    """Whether ``loader`` draws its batches with a :class:`SplitBalancedSampler` (also once
    Lightning has wrapped it for DDP in a ``DistributedSamplerWrapper``)."""
    sampler = getattr(loader, "sampler", None)
    wrapped = getattr(getattr(sampler, "dataset", None), "_sampler", None)  # (Lightning's wrapper's source)
    return isinstance(sampler, SplitBalancedSampler) or isinstance(wrapped, SplitBalancedSampler)
