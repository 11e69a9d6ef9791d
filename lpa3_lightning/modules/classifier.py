"""A ready MedMNIST classifier trained with LP-A3 (or without, as the baseline)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torchmetrics import MetricCollection
from torchmetrics.classification import MulticlassAccuracy, MulticlassAUROC

from lpa3_lightning.methods.settings import SupervisedSettings
from lpa3_lightning.methods.supervised import SupervisedLPA3Mixin
from lpa3_lightning.models.resnet import medmnist_resnet
from lpa3_lightning.modules.ready import (  # (all but ReadyModule are imported from here too)
    NETWORK_RECORD,
    NetworkNotSavedError,
    ReadyModule,
    build_network,
    check_datamodule_agrees,
    ready_hparams,
)

__all__ = ["NETWORK_RECORD", "LPA3Classifier", "NetworkNotSavedError", "build_network", "check_datamodule_agrees",
           "ready_hparams"]


class LPA3Classifier(ReadyModule, SupervisedLPA3Mixin, pl.LightningModule):
    """ResNet classifier with the MedMNIST recipe; add ``LPA3Callback`` to train with LP-A3.

    Without the callback it is the baseline (the same module and recipe). Logs ``train/loss`` and its parts,
    and the MedMNIST benchmark's ``val/acc``, ``val/auc``, ``test/acc``, ``test/auc`` (AUC macro one-vs-rest).

    Args:
        arch: ``"resnet18"`` or ``"resnet50"`` (MedMNIST 28 px stem).
        in_channels: image channels.
        num_classes: classes.
        lr: Adam learning rate (MedMNIST recipe: 1e-3).
        milestones: epochs at which the learning rate is multiplied by ``lr_gamma`` (recipe: 50 and 75 of 100).
        lr_gamma: learning-rate decay factor.
        weight_decay: Adam weight decay.
        twin_bn: give every BatchNorm a twin for the augmented samples (authors' choice).
        supervised: the mixin's :class:`~lpa3_lightning.methods.settings.SupervisedSettings`, a mapping of
            their fields (``supervised:`` with the fields under it in a YAML config), or None: the defaults.
        model: this network (BatchNorms converted in place under ``twin_bn``) instead of ``arch``, or its
            class-path config, ``{"class_path": "torchvision.models.resnet18", "init_args": {...}}``, which the
            checkpoint keeps; an object is not kept (Lightning's rule): ``load_from_checkpoint(path, model=...)``.

    Raises:
        ValueError: for ``lr <= 0``, an unknown ``arch`` or bad settings, naming the argument and the fix.
    """

    def __init__(self, arch: str = "resnet18", in_channels: int = 1, num_classes: int = 2, lr: float = 1e-3,
                 milestones: Sequence[int] = (50, 75), lr_gamma: float = 0.1, weight_decay: float = 0.0,
                 twin_bn: bool = True, supervised: SupervisedSettings | None = None,
                 model: nn.Module | None = None) -> None:
        super().__init__()
        self.model = self.ready_init("supervised", "use 1e-3 (the MedMNIST recipe)",
                                     lambda: medmnist_resnet(arch, in_channels, num_classes))
        metrics = MetricCollection({"acc": MulticlassAccuracy(num_classes, average="micro"),
                                    "auc": MulticlassAUROC(num_classes)})
        self.val_metrics = metrics.clone(prefix="val/")
        self.test_metrics = metrics.clone(prefix="test/")

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss, _, parts = self.lpa3_supervised_loss(batch)
        batch_size = int(batch[0].shape[0]) if isinstance(batch, (list, tuple)) else None
        self.log("train/loss", loss, prog_bar=True, batch_size=batch_size)
        self.log_dict({f"train/{key}": parts[key] for key in ("loss_clean", "loss_aug")}, batch_size=batch_size)
        return loss

    def configure_optimizers(self) -> Any:
        hp = ready_hparams(self)
        optimizer = torch.optim.Adam(self.parameters(), lr=hp.lr, weight_decay=hp.weight_decay)
        scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=list(hp.milestones), gamma=hp.lr_gamma)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "epoch"}}
