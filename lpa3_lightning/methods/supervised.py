"""Supervised LP-A3 loss (the paper's Algorithm 1, its MedMNIST setting).

``loss = CE(F(x), y) + weight * CE(F(x'), y)`` over the clean batch ``B`` and the hard
positives ``A`` of its selected samples, i.e. ``grad L(B) + grad L(A)`` (``weight``:
:class:`~lpa3_lightning.methods.settings.SupervisedSettings`). The forward of
``x'`` is :meth:`~lpa3_lightning.mixins.LPA3ModuleMixin.lpa3_forward_augmented`: through the
twin BatchNorms with the statistics the solver verified the label under (or BN on its
running statistics without twins), so augmented samples never move the statistics used at
test time and each ``x'`` keeps its label in the forward that trains on it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from lpa3_lightning.methods.base import LPA3ModuleMixin, split_indexed_batch
from lpa3_lightning.methods.settings import SupervisedSettings

__all__ = ["SupervisedLPA3Mixin", "split_indexed_batch"]


class SupervisedLPA3Mixin(LPA3ModuleMixin):
    """LP-A3 for supervised classification with batches ``(x, y, index)``.

    Attributes:
        lpa3_settings: a :class:`~lpa3_lightning.methods.settings.SupervisedSettings` (``weight``:
            the hard positives' loss weight, and the base's ``train_forward``).
    """

    lpa3_settings_class = SupervisedSettings
    lpa3_settings: SupervisedSettings = SupervisedSettings()

    def lpa3_supervised_loss(self, batch: Any) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        """Clean + augmented cross-entropy for one training batch.

        Returns:
            ``(loss, clean_logits, parts)`` where ``parts`` has ``loss_clean``, ``loss_aug``
            (0 when no sample was augmented) and ``num_augmented``.
        """
        self.lpa3_check_settings()
        x, y, idx = self.lpa3_split_batch(batch)
        model = self.lpa3_model()
        logits = self.lpa3_logits(model(x))
        self.lpa3_record_predictions(idx, logits, y)
        loss_clean = F.cross_entropy(logits, y)
        augmented = self.lpa3_take_augmented()
        num_aug = 0
        if augmented is not None and len(augmented) > 0:
            loss_aug = F.cross_entropy(self.lpa3_forward_augmented(augmented), augmented.targets)
            num_aug = len(augmented)
        else:
            # Under DDP the twins still get a (zero) gradient: the callback anchors them in
            # every main-BN forward (dual_bn.anchor_twin_parameters).
            loss_aug = logits.new_zeros(())
        loss = loss_clean + self.lpa3_settings.weight * loss_aug
        parts = {"loss_clean": loss_clean.detach(), "loss_aug": loss_aug.detach(),
                 "num_augmented": torch.tensor(float(num_aug))}
        return loss, logits, parts
