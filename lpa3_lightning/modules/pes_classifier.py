"""A ready PES classifier for noisy labels; add ``LPA3Callback`` to train it with LP-A3."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torchmetrics.classification import MulticlassAccuracy

from lpa3_lightning.methods.noisy_training import (
    anchor_twins_without_callback,
    lpa3_callbacks,
    warn_unbalanced_batches,
    whole_training_set_loader,
)
from lpa3_lightning.methods.pes import PESLPA3Mixin
from lpa3_lightning.methods.settings import PESSettings
from lpa3_lightning.modules.ready import ReadyModule, build_ssl_backbone, ready_hparams

__all__ = ["PESClassifier"]


class PESClassifier(ReadyModule, PESLPA3Mixin, pl.LightningModule):
    """PES (Bai et al., NeurIPS 2021) with the authors' recipe; add ``LPA3Callback`` for LP-A3.

    :class:`~lpa3_lightning.mixins.PESLPA3Mixin`'s phases and loss: SGD (cosine-annealed to ``lr / 100`` over the
    epochs outside the refine phase) in the early and semi phases, Adam on the re-initialised head in the
    refine phase. Batches ``(x_view1, x_view2, noisy_label, index)``, evaluation batches ``(x, y, index)``.
    Logs ``train/loss`` and its parts, ``val/acc``, ``test/acc``, each semi epoch ``pes/guess_top_class_share``.

    Args:
        arch: ``"small_cnn"``, ``"preact_resnet18"`` (the paper's), ``"wrn28_2"`` or ``"wrn28_8"``.
        in_channels: image channels.
        num_classes: classes.
        num_samples: training-set size; None: the data module's ``num_train``.
        lr: SGD learning rate (0.02).
        momentum: SGD momentum (0.9).
        weight_decay: SGD weight decay (5e-4).
        refine_lr: Adam learning rate of the head in the refine phase (1e-4).
        pes: the mixin's :class:`~lpa3_lightning.methods.settings.PESSettings`, a mapping of their fields, or
            None: the defaults. ``alpha_late_epoch=None``: half of the epochs outside the refine phase.
        freeze_head_in_semi: keep the refined head fixed in the semi phase (the authors' script).
        twin_bn: give every BatchNorm a twin for ``x'`` (the authors' choice).
        model: this network instead of ``arch``, or its class-path config (as ``LPA3Classifier``'s).

    Raises:
        ValueError: for a bad argument, or at fit start ``pes.lambda_u=0`` with ``LPA3Callback``, naming the fix.

    Example:
        >>> module = PESClassifier(num_classes=10, num_samples=4000)
        >>> module.pes_phase(0), module.pes_phase(20), module.pes_phase(25)
        ('early', 'refine', 'semi')
    """

    def __init__(self, arch: str = "small_cnn", in_channels: int = 1, num_classes: int = 10,
                 num_samples: int | None = None, lr: float = 0.02, momentum: float = 0.9, weight_decay: float = 5e-4,
                 refine_lr: float = 1e-4, pes: PESSettings | None = None, freeze_head_in_semi: bool = False,
                 twin_bn: bool = True, model: nn.Module | None = None) -> None:
        super().__init__()
        self.model = self.ready_init("pes", "use lr=0.02 and refine_lr=1e-4 (PES)",
                                     lambda: build_ssl_backbone(arch, in_channels, num_classes))
        self.automatic_optimization = False
        self.val_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")
        self.test_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")

    def configure_optimizers(self) -> Any:
        hp = ready_hparams(self)
        sgd = torch.optim.SGD(self.model.parameters(), lr=hp.lr, momentum=hp.momentum, weight_decay=hp.weight_decay)
        adam = torch.optim.Adam(self.pes_head().parameters(), lr=hp.refine_lr)
        max_epochs = self.trainer.max_epochs if self.trainer.max_epochs and self.trainer.max_epochs > 0 else 300
        cosine_epochs = max(1, max_epochs - self.lpa3_settings.refine_epochs)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(sgd, T_max=cosine_epochs, eta_min=hp.lr / 100)
        return [sgd, adam], [scheduler]

    def on_fit_start(self) -> None:
        self._pes_sizes()  # a missing training-set size is named now, not at the semi phase
        if self.lpa3_settings.lambda_u == 0 and lpa3_callbacks(self.trainer):  # (x' are weighted by lambda_u)
            raise ValueError("LPA3Callback is attached but pes.lambda_u=0, the weight of the x' term, so every "
                             "attack would train nothing. Fix: pass pes.lambda_u > 0 (e.g. 25, or PES's 150), or "
                             "drop the callback.")
        start, refine = self.lpa3_settings.alpha_late_epoch, self.lpa3_settings.refine_epochs
        counted = (self.trainer.max_epochs or 0) - refine  # the authors' refine epochs are not outer epochs
        self._alpha_late_start = (refine + counted // 2 if counted > 0 else None) if start is None \
            else (None if start < 0 else start)
        self._anchored = [self.model] if anchor_twins_without_callback(self.trainer, [self.model]) else []

    def pes_alpha_late_start(self) -> int | None:
        """The first epoch of ``alpha_late``, resolved at fit start (None: never, or before a fit)."""
        return getattr(self, "_alpha_late_start", None)

    def on_train_epoch_start(self) -> None:
        epoch = self.current_epoch
        semi = self.pes_phase(epoch) == "semi"
        if semi:
            warn_unbalanced_batches(self, self.trainer, "PES")
        self.pes_begin_epoch(epoch, whole_training_set_loader(self.trainer, self.global_rank) if semi else [])
        if epoch == self.lpa3_settings.early_epochs and self.lpa3_settings.refine_epochs > 0:
            sgd, _ = self.optimizers()  # type: ignore[misc]
            for p in self.pes_head().parameters():  # the re-initialised head starts without momentum
                sgd.optimizer.state.pop(p, None)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss, parts = self.pes_loss(batch, batch_idx)  # the ramp-up reads the trainer's batches per epoch
        sgd, adam = self.optimizers()  # type: ignore[misc]
        phase = self.pes_phase(self.current_epoch)
        sgd.zero_grad()
        adam.zero_grad()
        self.manual_backward(loss)
        if phase == "semi" and ready_hparams(self).freeze_head_in_semi:
            for p in self.pes_head().parameters():
                p.grad = None
        (adam if phase == "refine" else sgd).step()  # refine: the head only, the rest as the early phase left it
        self.log("train/loss", loss.detach(), prog_bar=True)
        self.log_dict({f"train/{name}": value.float() for name, value in parts.items()})
        return loss.detach()

    def on_train_epoch_end(self) -> None:
        phase = self.pes_phase(self.current_epoch)
        if phase == "semi":
            self.log_dict(self.pes_guess_report(), sync_dist=True)  # (all-reduced: the same on every rank)
        if phase != "refine":
            self.lr_schedulers().step()  # type: ignore[union-attr]

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["pes_split"] = self.pes_state_dict()
        super().on_save_checkpoint(checkpoint)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        if "pes_split" in checkpoint:
            self.pes_load_state_dict(checkpoint["pes_split"])
