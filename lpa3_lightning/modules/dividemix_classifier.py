"""A ready DivideMix classifier (two networks, noisy labels); add ``LPA3Callback`` to train it with LP-A3."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn
from torchmetrics.classification import MulticlassAccuracy

from lpa3_lightning.core.dual_bn import convert_dual_bn
from lpa3_lightning.methods.dividemix import DivideMixLPA3Mixin
from lpa3_lightning.methods.noisy_training import (
    anchor_twins_without_callback,
    lpa3_callbacks,
    warn_unbalanced_batches,
    whole_training_set_loader,
)
from lpa3_lightning.methods.settings import DivideMixSettings
from lpa3_lightning.modules.ready import ReadyModule, build_ssl_backbone, ready_hparams

__all__ = ["DivideMixClassifier"]


class DivideMixClassifier(DivideMixLPA3Mixin, ReadyModule, pl.LightningModule):
    """DivideMix (Li et al., ICLR 2020) with the authors' recipe; add ``LPA3Callback`` for LP-A3.

    Two networks ``net1`` and ``net2`` trained by :class:`~lpa3_lightning.mixins.DivideMixLPA3Mixin`'s phases and
    loss in one backward under one SGD; predictions add their logits. Batches ``(x_view1, x_view2,
    noisy_label, index)``, evaluation batches ``(x, y, index)``. Logs ``train/loss``, each network's parts
    (``train/net1/...``), ``val/acc``, ``test/acc``, each semi epoch ``dividemix/guess_top_class_share``.

    Args:
        arch: ``"small_cnn"`` or ``"preact_resnet18"`` (the paper's), ``"wrn28_2"``, ``"wrn28_8"``.
        in_channels: image channels.
        num_classes: classes.
        num_samples: training-set size; None: the data module's ``num_train``.
        lr: SGD learning rate (0.02).
        momentum: SGD momentum (0.9).
        weight_decay: SGD weight decay (5e-4).
        lr_drop_epoch: epoch of the tenfold learning-rate drop; None: half of ``max_epochs``; negative: never.
        dividemix: the mixin's :class:`~lpa3_lightning.methods.settings.DivideMixSettings`, a mapping of their
            fields, or None: the defaults.
        twin_bn: give every BatchNorm of both networks a twin for ``x'``.

    Raises:
        ValueError: for a bad argument, or at fit start an ``x'`` weight of 0 with ``LPA3Callback``, naming the fix.

    Example:
        >>> module = DivideMixClassifier(num_classes=10, num_samples=5000)
        >>> module.lpa3_networks(), module.dividemix_phase(9), module.dividemix_phase(10)
        (('net1', 'net2'), 'warmup', 'semi')
    """

    def __init__(self, arch: str = "small_cnn", in_channels: int = 1, num_classes: int = 10,
                 num_samples: int | None = None, lr: float = 0.02, momentum: float = 0.9, weight_decay: float = 5e-4,
                 lr_drop_epoch: int | None = None, dividemix: DivideMixSettings | None = None,
                 twin_bn: bool = True) -> None:
        super().__init__()
        self.ready_init("dividemix", "use 0.02 (DivideMix)")
        prior = self.lpa3_settings.class_prior
        if prior is not None and len(prior) != num_classes:
            raise ValueError(f"`dividemix.class_prior` holds {len(prior)} class frequencies for num_classes="
                             f"{num_classes}. Fix: one frequency per class, or None (uniform).")
        self.net1 = build_ssl_backbone(arch, in_channels, num_classes)
        self.net2 = build_ssl_backbone(arch, in_channels, num_classes)
        for network in (self.net1, self.net2) if twin_bn else ():
            convert_dual_bn(network)
        self.val_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")
        self.test_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")

    def dividemix_model(self, network: str) -> nn.Module:
        self._dm_check_name(network)
        return self.net1 if network == self.lpa3_networks()[0] else self.net2

    def forward(self, x: Tensor) -> Tensor:
        """Both networks' logits added (the authors' prediction)."""
        return self.net1(x) + self.net2(x)

    def configure_optimizers(self) -> Any:
        hp = ready_hparams(self)
        sgd = torch.optim.SGD(self.parameters(), lr=hp.lr, momentum=hp.momentum, weight_decay=hp.weight_decay)
        max_epochs = self.trainer.max_epochs if self.trainer.max_epochs and self.trainer.max_epochs > 0 else 300
        drop = max_epochs // 2 if hp.lr_drop_epoch is None else hp.lr_drop_epoch
        scheduler = torch.optim.lr_scheduler.MultiStepLR(sgd, milestones=[drop] if drop >= 0 else [], gamma=0.1)
        return {"optimizer": sgd, "lr_scheduler": {"scheduler": scheduler, "interval": "epoch"}}

    def on_fit_start(self) -> None:
        self._dm_sizes()  # a missing training-set size is named now, not at the semi phase
        settings = self.lpa3_settings
        weight = settings.lambda_u if settings.lpa3_weight is None else settings.lpa3_weight
        if weight == 0 and lpa3_callbacks(self.trainer):
            why = "dividemix.lpa3_weight=0" if settings.lpa3_weight is not None else \
                "dividemix.lambda_u=0 and dividemix.lpa3_weight=None"
            raise ValueError(f"LPA3Callback is attached but the x' term's weight is 0 ({why}), so every attack would "
                             "train nothing. Fix: pass dividemix.lpa3_weight=<weight> (e.g. 25), or drop the "
                             "callback.")
        self._anchored = [self.net1, self.net2] if anchor_twins_without_callback(self.trainer, [self.net1, self.net2]) \
            else []

    def on_train_epoch_start(self) -> None:
        epoch = self.current_epoch
        # the split's losses in the evaluation view when the data module offers it (the authors': no augmentation)
        dataset = getattr(getattr(self.trainer, "datamodule", None), "train_eval_dataset", None)
        semi = self.dividemix_phase(epoch) == "semi"
        if semi:
            warn_unbalanced_batches(self, self.trainer, "DivideMix")
        if semi and dataset is None and not getattr(self, "_warned_eval_view", False):
            self._warned_eval_view = True
            rank_zero_warn("DivideMix's split losses are taken on the training loader's dataset, so with its "
                           "augmentation (the authors take them without). Fix: give the data module a "
                           "`train_eval_dataset` (the same samples and noisy labels in the evaluation view), as "
                           "NoisyLabelDataModule does.")
        self.dividemix_begin_epoch(epoch, whole_training_set_loader(self.trainer, self.global_rank, dataset)
                                   if semi else [])

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        total = None
        for name, (loss, parts) in self.dividemix_losses(batch, batch_idx).items():  # (ramp: trainer's batches)
            total = loss if total is None else total + loss
            self.log_dict({f"train/{name}/{key}": value.float() for key, value in parts.items()})
        self.log("train/loss", total.detach(), prog_bar=True)  # type: ignore[union-attr]
        return total  # type: ignore[return-value]

    def on_train_epoch_end(self) -> None:
        if self.dividemix_phase(self.current_epoch) == "semi":
            self.log_dict(self.dividemix_guess_report(), sync_dist=True)  # (all-reduced: the same on every rank)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["dividemix_split"] = self.dividemix_state_dict()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if "dividemix_split" in checkpoint:
            self.dividemix_load_state_dict(checkpoint["dividemix_split"])
