"""A ready FixMatch classifier (semi-supervised); add ``LPA3Callback`` to train it with LP-A3."""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torchmetrics.classification import MulticlassAccuracy

from lpa3_lightning.core.dual_bn import convert_dual_bn
from lpa3_lightning.methods.base import split_indexed_batch
from lpa3_lightning.methods.fixmatch import FixMatchLPA3Mixin
from lpa3_lightning.methods.settings import FixMatchSettings, settings_from, settings_hparams
from lpa3_lightning.modules.classifier import (
    check_datamodule_agrees,
    check_network_record,
    ready_hparams,
    resolve_network,
    save_network_record,
    save_ready_hparams,
)

__all__ = ["FixMatchClassifier", "build_ssl_backbone"]

ARCHS = ("small_cnn", "wrn28_2", "wrn28_8", "wrn37_2", "preact_resnet18")


def build_ssl_backbone(arch: str, in_channels: int, num_classes: int) -> nn.Module:
    """The paper's backbones (WRN-28-2, WRN-28-8, WRN-37-2 semi-supervised; PreAct ResNet-18 noisy labels) or a small
    CNN for CPU runs.

    Raises:
        ValueError: for an unknown ``arch``, listing the choices.
    """
    if arch == "small_cnn":
        from lpa3_lightning.models.small_cnn import small_cnn

        return small_cnn(in_channels=in_channels, num_classes=num_classes)
    if arch == "wrn28_2":
        from lpa3_lightning.models.wrn import wrn28_2

        return wrn28_2(num_classes, in_channels=in_channels)
    if arch == "wrn28_8":
        from lpa3_lightning.models.wrn import wrn28_8

        return wrn28_8(num_classes, in_channels=in_channels)
    if arch == "wrn37_2":
        from lpa3_lightning.models.wrn import wrn37_2

        return wrn37_2(num_classes, in_channels=in_channels)
    if arch == "preact_resnet18":
        from lpa3_lightning.models.preact_resnet import preact_resnet18

        return preact_resnet18(num_classes, in_channels=in_channels)
    raise ValueError(f"`arch` must be one of {ARCHS}, got {arch!r}. Fix: use 'wrn28_2' (CIFAR-10), 'wrn28_8' "
                     "(CIFAR-100), 'wrn37_2' (STL-10), 'preact_resnet18' (noisy labels) or 'small_cnn' (CPU runs).")


class FixMatchClassifier(FixMatchLPA3Mixin, pl.LightningModule):
    """FixMatch (Sohn et al., NeurIPS 2020) with its recipe; add ``LPA3Callback`` for LP-A3.

    Without the callback it is plain FixMatch (the same module, the same recipe). The recipe:
    SGD with Nesterov momentum 0.9, learning rate 0.03, weight decay 5e-4 (not on biases and
    BatchNorm), cosine decay ``lr * cos(7 pi k / (16 K))`` over the run's K optimizer steps,
    threshold 0.95, lambda_u 1 (:class:`~lpa3_lightning.methods.settings.FixMatchSettings`' defaults).
    Evaluate with EMA weights (decay 0.999) by adding
    :class:`~lpa3_lightning.FixMatchEMA` to the Trainer (the configs in ``configs/ssl/`` do): FixMatch's
    EMA, parameters averaged and BatchNorm buffers copied (Lightning's ``EMAWeightAveraging`` averages
    the buffers too, which measured 0.662 against 0.873 on PneumoniaMNIST). Logs
    ``train/loss``, ``train/mask_rate`` and the parts of the loss, ``val/acc`` and ``test/acc``
    (torchmetrics), and at each epoch's end ``fixmatch/pseudo_label_top_class_share`` (a warning
    when the confident pseudo-labels collapse onto one class).

    Args:
        arch: ``"small_cnn"``, ``"wrn28_2"``, ``"wrn28_8"``, ``"wrn37_2"`` or ``"preact_resnet18"``.
        in_channels: image channels.
        num_classes: classes.
        lr: initial learning rate (0.03).
        momentum: SGD momentum (0.9, Nesterov).
        weight_decay: weight decay (5e-4; the paper's CIFAR-100 rows use 1e-3).
        fixmatch: the mixin's settings (:class:`~lpa3_lightning.methods.settings.FixMatchSettings`:
            ``threshold`` 0.95, ``lambda_u`` 1, ``temperature`` 1, the LP-A3 term's
            ``lpa3_confidence_threshold`` 0.9, ``lpa3_weight`` 1 and ``lpa3_loss_warmup_epochs`` 5
            (passes over the unlabeled set; see ``configs/ssl/make_configs.py``),
            ``solve_trained_only`` True, ``train_forward``), or a mapping of its fields; None: the
            defaults. In a YAML config, ``fixmatch:`` with the fields under it.
        twin_bn: give every BatchNorm a twin for ``x'`` (the authors' choice).
        model: use this network instead of building ``arch``, or its class-path config (kept in the
            checkpoint, as :class:`~lpa3_lightning.LPA3Classifier`'s ``model``).

    Example:
        >>> module = FixMatchClassifier(arch="small_cnn", in_channels=1, num_classes=10)
        >>> module.lpa3_num_classes, module.lpa3_settings.threshold
        (10, 0.95)
    """

    def __init__(
        self,
        arch: str = "small_cnn",
        in_channels: int = 1,
        num_classes: int = 10,
        lr: float = 0.03,
        momentum: float = 0.9,
        weight_decay: float = 5e-4,
        fixmatch: FixMatchSettings | None = None,
        twin_bn: bool = True,
        model: nn.Module | None = None,
    ) -> None:
        super().__init__()
        if lr <= 0:
            raise ValueError(f"`lr` must be > 0, got {lr}. Fix: use 0.03 (FixMatch).")
        self.lpa3_settings = settings_from(FixMatchSettings, fixmatch, "fixmatch")
        self.model, given = resolve_network(model, lambda: build_ssl_backbone(arch, in_channels, num_classes))
        # the effective settings as a mapping of their fields (None: the defaults), for hparams.yaml,
        # TensorBoard and load_from_checkpoint (which rebuilds the dataclass from it)
        save_ready_hparams(self, {"arch": arch, "in_channels": in_channels, "num_classes": num_classes, "lr": lr,
                                  "momentum": momentum, "weight_decay": weight_decay, "twin_bn": twin_bn,
                                  "model": model}, ("fixmatch", settings_hparams(self.lpa3_settings)), given)
        if twin_bn:
            convert_dual_bn(self.model)
        self.lpa3_num_classes = num_classes
        self.val_acc = MulticlassAccuracy(num_classes, average="micro")
        self.test_acc = MulticlassAccuracy(num_classes, average="micro")

    def setup(self, stage: str) -> None:
        datamodule = check_datamodule_agrees(self, ("num_classes", "in_channels"), "FixMatchClassifier")
        unlabeled = getattr(datamodule, "num_unlabeled", None)
        if isinstance(unlabeled, int):
            self.lpa3_num_samples = unlabeled  # the TCS memory runs over the unlabeled set

    def lpa3_model(self) -> nn.Module:
        return self.model

    def forward(self, x: Tensor) -> Tensor:
        return self.model(x)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss, parts = self.fixmatch_loss(batch)
        batch_size = int(batch["labeled"][0].shape[0]) if isinstance(batch, dict) else None
        self.log("train/loss", loss, prog_bar=True, batch_size=batch_size)
        self.log_dict({f"train/{k}": v for k, v in parts.items()}, batch_size=batch_size)
        return loss

    def on_train_epoch_end(self) -> None:
        # the largest class's share of the epoch's confident pseudo-labels (a warning if they collapse)
        for name, value in self.fixmatch_pseudo_label_report().items():
            self.log(name, value, sync_dist=True)  # (the same on every rank: the counts are all-reduced)

    def _evaluate(self, batch: Any, metric: MulticlassAccuracy, name: str) -> None:
        x, y, _ = split_indexed_batch(batch)
        metric.update(self.model(x), y)
        self.log(name, metric, prog_bar=True, batch_size=int(x.shape[0]))

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._evaluate(batch, self.val_acc, "val/acc")

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self._evaluate(batch, self.test_acc, "test/acc")

    def configure_optimizers(self) -> Any:
        # no weight decay on biases and BatchNorm parameters (FixMatch's reference setting)
        decay, no_decay = [], []
        for name, p in self.named_parameters():
            (no_decay if p.dim() <= 1 or name.endswith(".bias") else decay).append(p)
        hp = ready_hparams(self)
        optimizer = torch.optim.SGD([{"params": decay, "weight_decay": hp.weight_decay},
                                     {"params": no_decay, "weight_decay": 0.0}],
                                    lr=hp.lr, momentum=hp.momentum, nesterov=True)
        # The run's length is read at the first scheduler step, not here: trainer.estimated_stepping_batches
        # sets the training loader up, and read here (before a checkpoint's loops are restored) Lightning
        # never loads the loader's saved position, so a mid-epoch resume trained other batches
        # (Lightning issue #20550). At step 0 the factor is 1 whatever the length.
        length: list[int] = []

        def cosine(k: int) -> float:
            if k == 0:
                return 1.0
            if not length:
                length.append(max(1, int(self.trainer.estimated_stepping_batches)))
            return math.cos(7 * math.pi * k / (16 * length[0]))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        save_network_record(self, checkpoint, self.model)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        check_network_record(self, checkpoint, self.model)
