"""A ready DivideMix classifier (two networks, noisy labels); add ``LPA3Callback`` to train it with LP-A3."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn
from torchmetrics.classification import MulticlassAccuracy

from lpa3_lightning.core.checks import check_class_prior
from lpa3_lightning.core.dual_bn import convert_dual_bn
from lpa3_lightning.methods.base import split_indexed_batch
from lpa3_lightning.methods.dividemix import DivideMixLPA3Mixin
from lpa3_lightning.methods.noisy_training import (
    adopt_training_set_size,
    anchor_twins_without_callback,
    lpa3_callbacks,
    release_twins,
    whole_training_set_loader,
)
from lpa3_lightning.modules.classifier import check_datamodule_agrees
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
    ``val/acc`` and ``test/acc`` (torchmetrics). ``LPA3Callback`` needs no warm-up: it solves
    ``x'`` from the semi-supervised phase on, where they are trained, and its memory learns before.

    Args:
        arch: ``"small_cnn"`` or ``"preact_resnet18"`` (the paper's), ``"wrn28_2"``, ``"wrn28_8"``.
        in_channels: image channels.
        num_classes: classes.
        num_samples: training-set size; None: the data module's ``num_train``.
        lr: SGD learning rate (0.02).
        momentum: SGD momentum (0.9).
        weight_decay: SGD weight decay (5e-4).
        warmup_epochs: cross-entropy epochs (authors: 10 on CIFAR-10, 30 on CIFAR-100).
        lambda_u: unlabeled weight (authors, CIFAR-10: 0 at 20% and 40% asymmetric, 25 at 50% and
            80%, 50 at 90%; CIFAR-100: 25 at 20%, 150 above).
        threshold: clean-probability threshold (0.5; authors 0.6 at 90%).
        temperature: sharpening temperature (0.5).
        alpha: mixup Beta parameter (4).
        rampup_epochs: ramp of the unlabeled weight (16).
        loss_history: epochs of losses averaged for the GMM (1; authors 5 at 90%).
        negative_entropy: warm-up confidence penalty (authors: asymmetric noise).
        lr_drop_epoch: epoch of the tenfold learning-rate drop; None: half of ``max_epochs``;
            negative: never.
        lpa3_mixup: mix the ``x'`` up with the labeled views (as PES's LP-A3) or train them unmixed.
        lpa3_weight: weight of the ``x'`` term after the ramp; None: ``lambda_u`` (as PES's LP-A3).
            With the callback, a total weight of 0 is refused (the attacks would train nothing).
        split_per_class: fit the split's Gaussian mixture per noisy class (ours; see
            :func:`~lpa3_lightning.methods.dividemix_parts.clean_probability_per_class`); False: the authors' one
            mixture.
        stratified_split: label as clean the first split's number of rows, shared out over the
            noisy classes by size, each class's lowest-loss rows (ours; see
            ``DivideMixLPA3Mixin.dividemix_stratified_split``); with ``split_per_class`` each class
            keeps its own first mixture's count instead. False: the GMM's posterior, as the authors.
        prior_weight: weight of the prior penalty ``KL(prior || mean prediction)`` (1, the
            authors'; 0 turns it off).
        class_prior: the penalty's class frequencies (``num_classes`` numbers summing to 1); None:
            uniform, as the authors. Their uniform prior suits balanced classes; on an imbalanced
            set (PneumoniaMNIST: 26% / 74%) it pulls the predictions towards balance.
        guess_bn_updates: let the guessing and refinement forwards move the BatchNorm running
            statistics, as the authors' code does.
        twin_bn: give every BatchNorm of both networks a twin for ``x'``.
        seed: seed of the GMM's initialisation.

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
        warmup_epochs: int = 10,
        lambda_u: float = 25.0,
        threshold: float = 0.5,
        temperature: float = 0.5,
        alpha: float = 4.0,
        rampup_epochs: float = 16.0,
        loss_history: int = 1,
        negative_entropy: bool = False,
        lr_drop_epoch: int | None = None,
        lpa3_mixup: bool = True,
        lpa3_weight: float | None = None,
        split_per_class: bool = False,
        stratified_split: bool = False,
        prior_weight: float = 1.0,
        class_prior: list[float] | None = None,
        guess_bn_updates: bool = False,
        twin_bn: bool = True,
        seed: int = 0,
    ) -> None:
        super().__init__()
        checks = [("warmup_epochs", warmup_epochs, 0), ("num_classes", num_classes, 2), ("loss_history", loss_history, 1),
                  ("seed", seed, 0)]  # seed: the Gaussian mixture's random_state
        for name, value, low in checks + ([("num_samples", num_samples, 2)] if num_samples is not None else []):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"`{name}` must be an int >= {low}, got {value!r}. Fix: e.g. warmup_epochs=10, "
                                 "loss_history=1, seed=0, num_samples=<training set size>.")
        for name, value in (("lr", lr), ("temperature", temperature), ("alpha", alpha), ("rampup_epochs", rampup_epochs)):
            if not value > 0:
                raise ValueError(f"`{name}` must be > 0, got {value!r}.")
        if lambda_u < 0 or (lpa3_weight is not None and lpa3_weight < 0):
            raise ValueError(f"`lambda_u` and `lpa3_weight` must be >= 0, got {lambda_u!r} and {lpa3_weight!r}. Fix: "
                             "use lambda_u=25 (DivideMix, 50% noise) and lpa3_weight=None.")
        if not prior_weight >= 0:
            raise ValueError(f"`prior_weight` must be >= 0, got {prior_weight!r}. Fix: 1 (the authors') or 0 (off).")
        prior = None if class_prior is None else check_class_prior(class_prior, num_classes)
        if not 0.0 < threshold < 1.0:
            raise ValueError(f"`threshold` must be in (0, 1), got {threshold!r}. Fix: use 0.5 (0.6 at 90% noise).")
        self.save_hyperparameters()
        self.net1 = build_ssl_backbone(arch, in_channels, num_classes)
        self.net2 = build_ssl_backbone(arch, in_channels, num_classes)
        if twin_bn:
            convert_dual_bn(self.net1)
            convert_dual_bn(self.net2)
        self.lpa3_num_classes = num_classes
        self.lpa3_num_samples = num_samples
        self.dividemix_warmup_epochs = warmup_epochs
        self.dividemix_lambda_u = lambda_u
        self.dividemix_threshold = threshold
        self.dividemix_temperature = temperature
        self.dividemix_alpha = alpha
        self.dividemix_rampup_epochs = rampup_epochs
        self.dividemix_loss_history = loss_history
        self.dividemix_negative_entropy = negative_entropy
        self.dividemix_lpa3_mixup = lpa3_mixup
        self.dividemix_lpa3_weight = lpa3_weight
        self.dividemix_seed = seed
        self.dividemix_split_per_class = split_per_class
        self.dividemix_stratified_split = stratified_split
        self.dividemix_prior_weight = prior_weight
        self.dividemix_class_prior = prior
        self.dividemix_guess_bn_updates = guess_bn_updates
        self.val_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")
        self.test_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")

    def setup(self, stage: str) -> None:
        adopt_training_set_size(self, check_datamodule_agrees(self, ("num_classes", "in_channels"),
                                                              "DivideMixClassifier"))

    def dividemix_model(self, network: str) -> nn.Module:
        self._dm_check_name(network)
        return self.net1 if network == self.dividemix_networks[0] else self.net2

    def forward(self, x: Tensor) -> Tensor:
        """Both networks' logits added (the authors' prediction)."""
        return self.net1(x) + self.net2(x)

    # ------------------------------------------------------------------ optimisation
    def configure_optimizers(self) -> Any:
        hp = self.hparams
        sgd = torch.optim.SGD(self.parameters(), lr=hp.lr, momentum=hp.momentum, weight_decay=hp.weight_decay)
        max_epochs = self.trainer.max_epochs if self.trainer.max_epochs and self.trainer.max_epochs > 0 else 300
        drop = max_epochs // 2 if hp.lr_drop_epoch is None else hp.lr_drop_epoch
        milestones = [drop] if drop >= 0 else []
        scheduler = torch.optim.lr_scheduler.MultiStepLR(sgd, milestones=milestones, gamma=0.1)
        return {"optimizer": sgd, "lr_scheduler": {"scheduler": scheduler, "interval": "epoch"}}

    def on_fit_start(self) -> None:
        self._dm_sizes()  # a missing training-set size is named now, not at the semi phase
        weight = self.dividemix_lambda_u if self.dividemix_lpa3_weight is None else self.dividemix_lpa3_weight
        if weight == 0 and lpa3_callbacks(self.trainer):
            why = "lpa3_weight=0" if self.dividemix_lpa3_weight is not None else "lambda_u=0 and lpa3_weight=None"
            raise ValueError(f"LPA3Callback is attached but the x' term's weight is 0 ({why}), so every attack would "
                             "train nothing. Fix: pass lpa3_weight=<weight> (e.g. 25), or drop the callback.")
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
