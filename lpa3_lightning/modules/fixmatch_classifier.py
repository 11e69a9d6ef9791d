"""A ready FixMatch classifier (semi-supervised); add ``LPA3Callback`` to train it with LP-A3."""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torchmetrics.classification import MulticlassAccuracy

from lpa3_lightning.methods.fixmatch import FixMatchLPA3Mixin
from lpa3_lightning.methods.settings import FixMatchSettings
from lpa3_lightning.modules.ready import ARCHS, ReadyModule, build_ssl_backbone, check_datamodule_agrees, ready_hparams

__all__ = ["ARCHS", "FixMatchClassifier", "build_ssl_backbone"]


class FixMatchClassifier(ReadyModule, FixMatchLPA3Mixin, pl.LightningModule):
    """FixMatch (Sohn et al., NeurIPS 2020) with its recipe; add ``LPA3Callback`` for LP-A3.

    SGD (Nesterov; no weight decay on biases and BatchNorm), the learning rate ``lr * cos(7 pi k / (16 K))`` at
    step k of K. Evaluate with :class:`~lpa3_lightning.FixMatchEMA`, which copies the BatchNorm buffers (averaged
    by Lightning's ``EMAWeightAveraging``: 0.662 against 0.873 on PneumoniaMNIST). Logs ``train/loss`` and its
    parts, ``val/acc``, ``test/acc``, each epoch ``fixmatch/pseudo_label_top_class_share``.

    Args:
        arch: ``"small_cnn"``, ``"wrn28_2"``, ``"wrn28_8"``, ``"wrn37_2"`` or ``"preact_resnet18"``.
        in_channels: image channels.
        num_classes: classes.
        lr: initial learning rate (0.03).
        momentum: SGD momentum (0.9, Nesterov).
        weight_decay: weight decay (5e-4; the paper's CIFAR-100 rows use 1e-3).
        fixmatch: the mixin's :class:`~lpa3_lightning.methods.settings.FixMatchSettings`, a mapping of their
            fields, or None: the defaults.
        twin_bn: give every BatchNorm a twin for ``x'`` (the authors' choice).
        model: this network instead of ``arch``, or its class-path config (as ``LPA3Classifier``'s).

    Raises:
        ValueError: for ``lr <= 0``, an unknown ``arch`` or bad settings, naming the argument and the fix.
    """

    def __init__(self, arch: str = "small_cnn", in_channels: int = 1, num_classes: int = 10, lr: float = 0.03,
                 momentum: float = 0.9, weight_decay: float = 5e-4, fixmatch: FixMatchSettings | None = None,
                 twin_bn: bool = True, model: nn.Module | None = None) -> None:
        super().__init__()
        self.model = self.ready_init("fixmatch", "use 0.03 (FixMatch)",
                                     lambda: build_ssl_backbone(arch, in_channels, num_classes))
        self.val_acc = MulticlassAccuracy(num_classes, average="micro")
        self.test_acc = MulticlassAccuracy(num_classes, average="micro")

    def setup(self, stage: str) -> None:
        datamodule = check_datamodule_agrees(self, ("num_classes", "in_channels"), "FixMatchClassifier")
        unlabeled = getattr(datamodule, "num_unlabeled", None)
        if isinstance(unlabeled, int):
            self.lpa3_num_samples = unlabeled

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss, parts = self.fixmatch_loss(batch)
        batch_size = int(batch["labeled"][0].shape[0]) if isinstance(batch, dict) else None
        self.log("train/loss", loss, prog_bar=True, batch_size=batch_size)
        self.log_dict({f"train/{k}": v for k, v in parts.items()}, batch_size=batch_size)
        return loss

    def on_train_epoch_end(self) -> None:
        self.log_dict(self.fixmatch_pseudo_label_report(), sync_dist=True)  # (all-reduced: the same on every rank)

    def configure_optimizers(self) -> Any:
        hp, decay, no_decay = ready_hparams(self), [], []
        for name, p in self.named_parameters():
            (no_decay if p.dim() <= 1 or name.endswith(".bias") else decay).append(p)
        optimizer = torch.optim.SGD([{"params": decay, "weight_decay": hp.weight_decay},
                                     {"params": no_decay, "weight_decay": 0.0}], lr=hp.lr, momentum=hp.momentum,
                                    nesterov=True)
        # The run's length is read at the first step: trainer.estimated_stepping_batches sets the training loader
        # up, and read here, before a resume restores the loops, the loader's position is lost (Lightning #20550).
        length: list[int] = []

        def cosine(k: int) -> float:
            if k == 0:
                return 1.0
            if not length:
                length.append(max(1, int(self.trainer.estimated_stepping_batches)))
            return math.cos(7 * math.pi * k / (16 * length[0]))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
