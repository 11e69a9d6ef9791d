"""A ready MedMNIST classifier trained with LP-A3 (or without, as the baseline)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torchmetrics import MetricCollection
from torchmetrics.classification import MulticlassAccuracy, MulticlassAUROC

from lpa3_lightning.core.dual_bn import convert_dual_bn
from lpa3_lightning.methods.settings import SupervisedSettings, settings_from, settings_hparams
from lpa3_lightning.methods.supervised import SupervisedLPA3Mixin, split_indexed_batch
from lpa3_lightning.models.resnet import medmnist_resnet

__all__ = ["LPA3Classifier", "check_datamodule_agrees"]


def check_datamodule_agrees(module: pl.LightningModule, names: Sequence[str], class_name: str) -> Any:
    """Refuse a data module whose ``names`` (e.g. ``num_classes``) differ from the module's hyper-parameters.

    The CLI takes model and data arguments separately; a mismatch would otherwise surface deep
    inside the first step (a channel error or a label out of bounds). Returns the data module.

    Raises:
        ValueError: naming the argument and the fix.
    """
    datamodule = getattr(module.trainer, "datamodule", None) if module._trainer is not None else None
    for name in names:
        expected = getattr(datamodule, name, None)
        if isinstance(expected, int) and expected != module.hparams[name]:
            raise ValueError(
                f"The data module has {name}={expected} but the model was built with {name}={module.hparams[name]}. "
                f"Fix: pass `--model.init_args.{name} {expected}` (or {class_name}({name}={expected}))."
            )
    return datamodule


class LPA3Classifier(SupervisedLPA3Mixin, pl.LightningModule):
    """ResNet classifier with the MedMNIST recipe; add ``LPA3Callback`` to train with LP-A3.

    Without the callback it is the plain baseline (the same module, the same recipe).
    Metrics are the MedMNIST benchmark's: accuracy and AUC (macro one-vs-rest; for two
    classes this equals the binary AUC), from torchmetrics, logged as ``val/acc``,
    ``val/auc``, ``test/acc``, ``test/auc``.

    Args:
        arch: ``"resnet18"`` or ``"resnet50"`` (MedMNIST 28 px stem).
        in_channels: image channels.
        num_classes: classes.
        lr: Adam learning rate (MedMNIST recipe: 1e-3).
        milestones: epochs at which the learning rate is multiplied by ``lr_gamma``
            (recipe: 50 and 75 of 100).
        lr_gamma: learning-rate decay factor.
        weight_decay: Adam weight decay.
        twin_bn: give every BatchNorm a twin for the augmented samples (authors' choice).
        supervised: the mixin's settings (:class:`~lpa3_lightning.methods.settings.SupervisedSettings`:
            ``weight`` of the loss on the hard positives, ``train_forward``), or a mapping of its
            fields; None: the defaults. In a YAML config, ``supervised:`` with the fields under it.
        model: use this network instead of building ``arch`` (any ``nn.Module`` returning logits);
            with ``twin_bn`` its BatchNorms are converted in place.

    Example:
        >>> module = LPA3Classifier(in_channels=1, num_classes=2)
        >>> module.lpa3_num_classes
        2
    """

    def __init__(
        self,
        arch: str = "resnet18",
        in_channels: int = 1,
        num_classes: int = 2,
        lr: float = 1e-3,
        milestones: Sequence[int] = (50, 75),
        lr_gamma: float = 0.1,
        weight_decay: float = 0.0,
        twin_bn: bool = True,
        supervised: SupervisedSettings | None = None,
        model: nn.Module | None = None,
    ) -> None:
        super().__init__()
        if lr <= 0:
            raise ValueError(f"`lr` must be > 0, got {lr}. Fix: use 1e-3 (the MedMNIST recipe).")
        self.lpa3_settings = settings_from(SupervisedSettings, supervised, "supervised")
        self.save_hyperparameters(ignore=["model"])
        # the effective settings as a mapping of their fields (None: the defaults), for hparams.yaml,
        # TensorBoard and load_from_checkpoint (which rebuilds the dataclass from it)
        self.save_hyperparameters({"supervised": settings_hparams(self.lpa3_settings)})
        self.model = model if model is not None else medmnist_resnet(arch, in_channels, num_classes)
        if twin_bn:
            convert_dual_bn(self.model)
        self.lpa3_num_classes = num_classes
        metrics = MetricCollection(
            {"acc": MulticlassAccuracy(num_classes, average="micro"), "auc": MulticlassAUROC(num_classes)}
        )
        self.val_metrics = metrics.clone(prefix="val/")
        self.test_metrics = metrics.clone(prefix="test/")

    def setup(self, stage: str) -> None:
        check_datamodule_agrees(self, ("num_classes", "in_channels"), "LPA3Classifier")

    def lpa3_model(self) -> nn.Module:
        return self.model

    def forward(self, x: Tensor) -> Tensor:
        return self.model(x)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss, _, parts = self.lpa3_supervised_loss(batch)
        batch_size = int(batch[0].shape[0]) if isinstance(batch, (list, tuple)) else None
        self.log("train/loss", loss, prog_bar=True, batch_size=batch_size)
        self.log("train/loss_clean", parts["loss_clean"], batch_size=batch_size)
        self.log("train/loss_aug", parts["loss_aug"], batch_size=batch_size)
        return loss

    def _evaluate(self, batch: Any, metrics: MetricCollection) -> None:
        x, y, _ = split_indexed_batch(batch)
        probs = self.model(x).softmax(dim=1)
        metrics.update(probs, y)
        self.log_dict(metrics, prog_bar=True, batch_size=int(x.shape[0]))

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._evaluate(batch, self.val_metrics)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self._evaluate(batch, self.test_metrics)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adam(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)
        scheduler = torch.optim.lr_scheduler.MultiStepLR(
            optimizer, milestones=list(self.hparams.milestones), gamma=self.hparams.lr_gamma
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "epoch"}}
