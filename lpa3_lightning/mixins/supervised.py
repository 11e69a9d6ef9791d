"""Supervised LP-A3 loss (the paper's Algorithm 1, its MedMNIST setting).

``loss = CE(F(x), y) + weight * CE(F(x'), y)`` over the clean batch ``B`` and the hard
positives ``A`` of its selected samples, i.e. ``grad L(B) + grad L(A)``. The forward of
``x'`` goes through the twin BatchNorms when the model has them, so augmented samples never
move the statistics used at test time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from lpa3_lightning.augmented import LPA3Request
from lpa3_lightning.distributed import is_distributed
from lpa3_lightning.dual_bn import has_dual_bn, twin_parameters, use_twin_bn
from lpa3_lightning.mixins.base import LPA3ModuleMixin

__all__ = ["SupervisedLPA3Mixin", "split_indexed_batch"]


def split_indexed_batch(batch: Any) -> tuple[Tensor, Tensor, Tensor]:
    """``(inputs, targets, indices)`` of a batch from an index-returning dataset.

    Accepts a ``(x, y, index)`` tuple/list or a mapping with keys ``input``/``target``/``index``.

    Raises:
        ValueError: if the batch carries no dataset indices, naming the fix.
    """
    if isinstance(batch, dict):
        if {"input", "target", "index"} <= set(batch):
            return batch["input"], batch["target"], batch["index"]
    elif isinstance(batch, Sequence) and len(batch) == 3:
        return batch[0], batch[1], batch[2]
    described = sorted(batch) if isinstance(batch, dict) else f"{type(batch).__name__} of length {len(batch)}" \
        if isinstance(batch, Sequence) else type(batch).__name__
    raise ValueError(
        f"LP-A3 needs the dataset index of every sample, but the batch is {described}. Fix: wrap the training "
        "dataset in `lpa3_lightning.data.IndexedDataset` so batches are (x, y, index), or return a dict with "
        "keys 'input', 'target', 'index'."
    )


class SupervisedLPA3Mixin(LPA3ModuleMixin):
    """LP-A3 for supervised classification with batches ``(x, y, index)``.

    Attributes:
        lpa3_weight: weight of the loss on the hard positives (Algorithm 1: 1).
        lpa3_twin_bn: route ``x'`` through twin BatchNorms when the model has them.
    """

    lpa3_weight: float = 1.0
    lpa3_twin_bn: bool = True

    @staticmethod
    def lpa3_twin_anchor(model: Any, like: Tensor) -> Tensor:
        """``0 * sum(twin parameters)``: add it to the loss of a step without ``x'`` under DDP."""
        return sum((0.0 * p.sum() for p in twin_parameters(model)), like.new_zeros(()))

    def lpa3_request(self, batch: Any) -> LPA3Request:
        x, y, idx = split_indexed_batch(batch)
        return LPA3Request(inputs=x, targets=y, indices=idx)

    def lpa3_supervised_loss(self, batch: Any) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        """Clean + augmented cross-entropy for one training batch.

        Returns:
            ``(loss, clean_logits, parts)`` where ``parts`` has ``loss_clean``, ``loss_aug``
            (0 when no sample was augmented) and ``num_augmented``.
        """
        x, y, idx = split_indexed_batch(batch)
        model = self.lpa3_model()
        logits = self.lpa3_logits(model(x))
        self.lpa3_record_predictions(idx, logits, y)
        loss_clean = F.cross_entropy(logits, y)
        augmented = self.lpa3_take_augmented()
        twins = self.lpa3_twin_bn and has_dual_bn(model)
        num_aug = 0
        if augmented is not None and len(augmented) > 0:
            with use_twin_bn(model) if twins else contextlib.nullcontext():
                logits_aug = self.lpa3_logits(model(augmented.inputs))
            loss_aug = F.cross_entropy(logits_aug, augmented.targets)
            num_aug = len(augmented)
        elif twins and is_distributed():
            # No x' on this rank (warm-up, nothing selected): under DDP the twin parameters still
            # join the graph with a zero gradient, so DDP needs no `find_unused_parameters` and no
            # rank waits for a gradient another rank never computes. (On one process they keep
            # a None gradient, so optimizers with momentum or weight decay leave them alone.)
            loss_aug = self.lpa3_twin_anchor(model, logits)
        else:
            loss_aug = logits.new_zeros(())
        loss = loss_clean + self.lpa3_weight * loss_aug
        parts = {"loss_clean": loss_clean.detach(), "loss_aug": loss_aug.detach(),
                 "num_augmented": torch.tensor(float(num_aug))}
        return loss, logits, parts
