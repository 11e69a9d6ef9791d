"""A ready DivideMix classifier (two networks, noisy labels); add ``LPA3Callback`` to train it with LP-A3."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn
from torchmetrics.classification import MulticlassAccuracy

from lpa3_lightning.core.dual_bn import convert_dual_bn
from lpa3_lightning.methods.base import split_indexed_batch
from lpa3_lightning.methods.dividemix import DivideMixLPA3Mixin
from lpa3_lightning.methods.noisy_training import (
    adopt_training_set_size,
    anchor_twins_without_callback,
    lpa3_callbacks,
    release_twins,
    warn_unbalanced_batches,
    whole_training_set_loader,
)
from lpa3_lightning.methods.settings import DivideMixSettings, settings_from, settings_hparams
from lpa3_lightning.modules.classifier import check_datamodule_agrees, ready_hparams, save_ready_hparams
from lpa3_lightning.modules.fixmatch_classifier import build_ssl_backbone

__all__ = ["DivideMixClassifier"]


class DivideMixClassifier(DivideMixLPA3Mixin, pl.LightningModule):
    """DivideMix (Li et al., ICLR 2020) with the authors' recipe; add ``LPA3Callback`` for LP-A3.

    Two networks of one architecture (different random initialisations) trained by
    :class:`~lpa3_lightning.mixins.DivideMixLPA3Mixin`'s phases and loss, the two losses summed into
    one backward. Optimisation: one SGD over both networks (lr 0.02, momentum 0.9, weight decay
    5e-4; per parameter the same as the authors' two optimizers) with the learning rate divided by
    10 from ``lr_drop_epoch`` (the authors: 150 of 300). Predictions (validation, test,
    ``forward``) add both networks' logits, as the authors' test. Training batches are
    ``(x_view1, x_view2, noisy_label, index)``; validation and test batches ``(x, y, index)``
    with clean labels. Logs ``train/loss``, each network's parts (``train/net1/...``),
    ``val/acc``, ``test/acc`` (torchmetrics) and, each semi-supervised epoch,
    ``dividemix/guess_top_class_share`` (and per network, ``dividemix/net1/...``): the largest
    class's share of the epoch's guessed labels, with a warning when most are of one class while
    the labeled set holds several. ``LPA3Callback`` needs no warm-up: it solves
    ``x'`` from the semi-supervised phase on, where they are trained, and its memory learns before.

    Args:
        arch: ``"small_cnn"`` or ``"preact_resnet18"`` (the paper's), ``"wrn28_2"``, ``"wrn28_8"``.
        in_channels: image channels.
        num_classes: classes.
        num_samples: training-set size; None: the data module's ``num_train``.
        lr: SGD learning rate (0.02).
        momentum: SGD momentum (0.9).
        weight_decay: SGD weight decay (5e-4).
        lr_drop_epoch: epoch of the tenfold learning-rate drop; None: half of ``max_epochs``;
            negative: never.
        dividemix: the mixin's settings (:class:`~lpa3_lightning.methods.settings.DivideMixSettings`:
            ``warmup_epochs`` 10 (30 on CIFAR-100), ``lambda_u`` 25 (the authors, CIFAR-10: 0 at
            20% and 40% asymmetric, 25 at 50% and 80%, 50 at 90%; CIFAR-100: 25 at 20%, 150
            above), ``threshold`` 0.5 (0.6 at 90%), ``temperature`` 0.5, ``alpha`` 4,
            ``rampup_epochs`` 16, ``loss_history`` 1 (5 at 90%), ``negative_entropy``, the ``x'``
            term's ``lpa3_mixup`` and ``lpa3_weight`` (None: ``lambda_u``; with the callback a total
            weight of 0 is refused, the attacks would train nothing), the split's
            ``split_per_class`` and ``stratified_split`` (ours), ``prior_weight`` 1 and
            ``class_prior`` (None: uniform, the authors'; ``num_classes`` numbers summing to 1 on an
            imbalanced set such as PneumoniaMNIST's 26% / 74%), ``guess_bn_updates`` (False, True or
            ``"reference"``), the GMM's
            ``seed``, the networks' names and ``train_forward``), or a mapping of its fields; None:
            the defaults. In a YAML config, ``dividemix:`` with the fields under it.
        twin_bn: give every BatchNorm of both networks a twin for ``x'``.

    Example:
        >>> module = DivideMixClassifier(num_classes=10, num_samples=5000)
        >>> module.lpa3_networks(), module.dividemix_phase(9), module.dividemix_phase(10)
        (('net1', 'net2'), 'warmup', 'semi')
    """

    def __init__(
        self,
        arch: str = "small_cnn",
        in_channels: int = 1,
        num_classes: int = 10,
        num_samples: int | None = None,
        lr: float = 0.02,
        momentum: float = 0.9,
        weight_decay: float = 5e-4,
        lr_drop_epoch: int | None = None,
        dividemix: DivideMixSettings | None = None,
        twin_bn: bool = True,
    ) -> None:
        super().__init__()
        for name, value, low in [("num_classes", num_classes, 2)] + ([("num_samples", num_samples, 2)]
                                                                      if num_samples is not None else []):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"`{name}` must be an int >= {low}, got {value!r}. Fix: e.g. num_classes=10, "
                                 "num_samples=<training set size>.")
        if not lr > 0:
            raise ValueError(f"`lr` must be > 0, got {lr!r}. Fix: use 0.02 (DivideMix).")
        self.lpa3_settings = settings_from(DivideMixSettings, dividemix, "dividemix")
        prior = self.lpa3_settings.class_prior
        if prior is not None and len(prior) != num_classes:
            raise ValueError(f"`dividemix.class_prior` holds {len(prior)} class frequencies for num_classes="
                             f"{num_classes}. Fix: one frequency per class, or None (uniform).")
        # the effective settings as a mapping of their fields (None: the defaults), for hparams.yaml,
        # TensorBoard and load_from_checkpoint (which rebuilds the dataclass from it); a subclass that
        # LightningCLI builds saves its own arguments, and the recipe reads these (ready_hparams)
        save_ready_hparams(self, {"arch": arch, "in_channels": in_channels, "num_classes": num_classes,
                                  "num_samples": num_samples, "lr": lr, "momentum": momentum,
                                  "weight_decay": weight_decay, "lr_drop_epoch": lr_drop_epoch, "twin_bn": twin_bn},
                           ("dividemix", settings_hparams(self.lpa3_settings)))
        self.net1 = build_ssl_backbone(arch, in_channels, num_classes)
        self.net2 = build_ssl_backbone(arch, in_channels, num_classes)
        if twin_bn:
            convert_dual_bn(self.net1)
            convert_dual_bn(self.net2)
        self.lpa3_num_classes = num_classes
        self.lpa3_num_samples = num_samples
        self.val_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")
        self.test_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")

    def setup(self, stage: str) -> None:
        adopt_training_set_size(self, check_datamodule_agrees(self, ("num_classes", "in_channels"),
                                                              "DivideMixClassifier"))

    def dividemix_model(self, network: str) -> nn.Module:
        self._dm_check_name(network)
        return self.net1 if network == self.lpa3_networks()[0] else self.net2

    def forward(self, x: Tensor) -> Tensor:
        """Both networks' logits added (the authors' prediction)."""
        return self.net1(x) + self.net2(x)

    # ------------------------------------------------------------------ optimisation
    def configure_optimizers(self) -> Any:
        hp = ready_hparams(self)
        sgd = torch.optim.SGD(self.parameters(), lr=hp.lr, momentum=hp.momentum, weight_decay=hp.weight_decay)
        max_epochs = self.trainer.max_epochs if self.trainer.max_epochs and self.trainer.max_epochs > 0 else 300
        drop = max_epochs // 2 if hp.lr_drop_epoch is None else hp.lr_drop_epoch
        milestones = [drop] if drop >= 0 else []
        scheduler = torch.optim.lr_scheduler.MultiStepLR(sgd, milestones=milestones, gamma=0.1)
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
        self._anchored = anchor_twins_without_callback(self.trainer, [self.net1, self.net2])

    def on_fit_end(self) -> None:
        if getattr(self, "_anchored", False):
            release_twins([self.net1, self.net2])

    def on_train_epoch_start(self) -> None:
        epoch = self.current_epoch
        # the per-sample losses in the evaluation view when the data module offers it (DivideMix's are
        # without augmentation)
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
        loader = whole_training_set_loader(self.trainer, self.global_rank, dataset) if semi else []
        self.dividemix_begin_epoch(epoch, loader)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        total = None
        for name, (loss, parts) in self.dividemix_losses(batch, batch_idx).items():  # (ramp: trainer's batches)
            total = loss if total is None else total + loss
            for key, value in parts.items():
                self.log(f"train/{name}/{key}", value.float())
        self.log("train/loss", total.detach(), prog_bar=True)  # type: ignore[union-attr]
        return total  # type: ignore[return-value]

    def on_train_epoch_end(self) -> None:
        if self.dividemix_phase(self.current_epoch) == "semi":  # each network's guessed labels: their top share
            for name, value in self.dividemix_guess_report().items():
                self.log(name, value, sync_dist=True)  # (the same on every rank: the counts are all-reduced)

    # ------------------------------------------------------------------ evaluation
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y, _ = split_indexed_batch(batch)
        self.val_acc(self(x), y)
        self.log("val/acc", self.val_acc, prog_bar=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y, _ = split_indexed_batch(batch)
        self.test_acc(self(x), y)
        self.log("test/acc", self.test_acc)

    # ------------------------------------------------------------------ checkpoint
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["dividemix_split"] = self.dividemix_state_dict()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if "dividemix_split" in checkpoint:
            self.dividemix_load_state_dict(checkpoint["dividemix_split"])
