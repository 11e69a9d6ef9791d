"""A ready PES classifier for noisy labels; add ``LPA3Callback`` to train it with LP-A3."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torchmetrics.classification import MulticlassAccuracy

from lpa3_lightning.core.dual_bn import convert_dual_bn
from lpa3_lightning.methods.base import split_indexed_batch
from lpa3_lightning.methods.noisy_training import (
    adopt_training_set_size,
    anchor_twins_without_callback,
    lpa3_callbacks,
    release_twins,
    warn_unbalanced_batches,
    whole_training_set_loader,
)
from lpa3_lightning.methods.pes import PESLPA3Mixin
from lpa3_lightning.methods.settings import PESSettings, settings_from, settings_hparams
from lpa3_lightning.modules.classifier import (
    check_datamodule_agrees,
    check_network_record,
    ready_hparams,
    resolve_network,
    save_network_record,
    save_ready_hparams,
)
from lpa3_lightning.modules.fixmatch_classifier import build_ssl_backbone

__all__ = ["PESClassifier"]


class PESClassifier(PESLPA3Mixin, pl.LightningModule):
    """PES (Bai et al., NeurIPS 2021) with the authors' recipe; add ``LPA3Callback`` for LP-A3.

    The phases and the loss are :class:`~lpa3_lightning.mixins.PESLPA3Mixin`'s. Optimisation
    (manual, two optimizers): SGD (lr 0.02, momentum 0.9, weight decay 5e-4) with cosine
    annealing to ``lr / 100`` over the epochs outside the refine phase, stepped once an epoch,
    for the early and semi-supervised phases; Adam (lr 1e-4) on the re-initialised head alone in
    the refine phase (the other weights stay; the forward runs in train mode, so BatchNorm running
    statistics keep following the batches). The head is re-initialised in place, so SGD trains it
    in the semi-supervised phase, from fresh momentum (the authors' script builds its SGD before
    swapping in a new head, which is then never updated; ``freeze_head_in_semi=True`` reproduces
    that). In the refine phase every parameter gets its gradient (so DDP needs no unused-parameter
    search) and Adam applies the head's; the other weights stay as the early phase left them. Training
    batches are ``(x_view1, x_view2, noisy_label, index)``; validation and test batches
    ``(x, y, index)`` with clean labels. Logs ``train/loss``, its parts, ``train/labeled_share``,
    ``val/acc``, ``test/acc`` (torchmetrics) and, each semi-supervised epoch,
    ``pes/guess_top_class_share`` (the largest class's share of the epoch's guessed labels; a
    warning when most are of one class while the labeled set holds several). ``LPA3Callback`` needs no warm-up: it solves
    ``x'`` from the semi phase on, where they are trained, and its memory learns before.

    Args:
        arch: ``"small_cnn"``, ``"preact_resnet18"`` (the paper's noisy-label backbone), ``"wrn28_2"``
            or ``"wrn28_8"`` (see ``build_ssl_backbone``).
        in_channels: image channels.
        num_classes: classes.
        num_samples: training set size (the split and the TCS memory are over it); None: the data
            module's ``num_train`` (needed without a data module).
        lr: SGD learning rate (0.02).
        momentum: SGD momentum (0.9).
        weight_decay: SGD weight decay (5e-4).
        refine_lr: Adam learning rate of the head in the refine phase (1e-4).
        pes: the mixin's settings (:class:`~lpa3_lightning.methods.settings.PESSettings`: T1
            ``early_epochs`` 20 (35 on CIFAR-100), T2 ``refine_epochs`` 5, ``lambda_u`` 150,
            ``temperature`` 0.5, mixup's ``alpha`` 4 and ``alpha_late`` 0.75 from
            ``alpha_late_epoch``, ``rampup_epochs`` 16, ``class_weight_cap`` 3, ``lpa3_mixup``,
            ``lpa3_confidence``, ``guess_forward``, ``train_forward``), or a mapping of its fields; None: the
            defaults. Here ``alpha_late_epoch=None`` is half-way through the epochs outside the
            refine phase (the authors' epoch 150 of 300) and a negative value never switches. In a
            YAML config, ``pes:`` with the fields under it.
        freeze_head_in_semi: keep the refined head fixed in the semi phase (the authors' script).
        twin_bn: give every BatchNorm a twin for ``x'`` (the authors' choice).
        model: use this network instead of building ``arch``, or its class-path config (kept in the
            checkpoint, as :class:`~lpa3_lightning.LPA3Classifier`'s ``model``).

    Example:
        >>> module = PESClassifier(num_classes=10, num_samples=4000)
        >>> module.pes_phase(0), module.pes_phase(20), module.pes_phase(25)
        ('early', 'refine', 'semi')
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
        refine_lr: float = 1e-4,
        pes: PESSettings | None = None,
        freeze_head_in_semi: bool = False,
        twin_bn: bool = True,
        model: nn.Module | None = None,
    ) -> None:
        super().__init__()
        for name, value, low in [("num_classes", num_classes, 2)] + ([("num_samples", num_samples, 2)]
                                                                      if num_samples is not None else []):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"`{name}` must be an int >= {low}, got {value!r}. Fix: e.g. num_classes=10, "
                                 "num_samples=<training set size>.")
        for name, value in (("lr", lr), ("refine_lr", refine_lr)):
            if not value > 0:
                raise ValueError(f"`{name}` must be > 0, got {value!r}. Fix: use lr=0.02 and refine_lr=1e-4 (PES).")
        self.lpa3_settings = settings_from(PESSettings, pes, "pes")
        net, given = resolve_network(model, lambda: build_ssl_backbone(arch, in_channels, num_classes))
        # the effective settings as a mapping of their fields (None: the defaults), for hparams.yaml,
        # TensorBoard and load_from_checkpoint (which rebuilds the dataclass from it)
        save_ready_hparams(self, {"arch": arch, "in_channels": in_channels, "num_classes": num_classes,
                                  "num_samples": num_samples, "lr": lr, "momentum": momentum,
                                  "weight_decay": weight_decay, "refine_lr": refine_lr,
                                  "freeze_head_in_semi": freeze_head_in_semi, "twin_bn": twin_bn, "model": model},
                           ("pes", settings_hparams(self.lpa3_settings)), given)
        self.automatic_optimization = False
        self.model = convert_dual_bn(net) if twin_bn else net
        self.lpa3_num_classes = num_classes
        self.lpa3_num_samples = num_samples
        self._alpha_late_start: int | None = None  # from alpha_late_epoch and the run's length, at fit start
        self.val_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")
        self.test_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")

    def setup(self, stage: str) -> None:
        adopt_training_set_size(self, check_datamodule_agrees(self, ("num_classes", "in_channels"), "PESClassifier"))

    def lpa3_model(self) -> nn.Module:
        return self.model

    def forward(self, x: Tensor) -> Tensor:
        return self.model(x)

    # ------------------------------------------------------------------ optimisation
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
        if self.lpa3_settings.lambda_u == 0 and lpa3_callbacks(self.trainer):
            # x' are weighted like the unlabeled loss (lambda_u x ramp), so each attack would train nothing
            raise ValueError("LPA3Callback is attached but pes.lambda_u=0, the weight of the x' term, so every "
                             "attack would train nothing. Fix: pass pes.lambda_u > 0 (e.g. 25, or PES's 150), or "
                             "drop the callback.")
        start, refine = self.lpa3_settings.alpha_late_epoch, self.lpa3_settings.refine_epochs
        counted = (self.trainer.max_epochs or 0) - refine  # the authors' refine epochs are not outer epochs
        self._alpha_late_start = (refine + counted // 2 if counted > 0 else None) if start is None \
            else (None if start < 0 else start)
        self._anchored = anchor_twins_without_callback(self.trainer, [self.model])

    def pes_alpha_late_start(self) -> int | None:
        """The first epoch of ``alpha_late`` as resolved at fit start: ``alpha_late_epoch``, for None
        half of the run outside the refine phase, for a negative value never (None before a fit)."""
        return self._alpha_late_start

    def on_fit_end(self) -> None:
        if getattr(self, "_anchored", False):
            release_twins([self.model])

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
        # refine: every parameter gets its gradient (DDP needs them all in the graph), Adam
        # updates the head only; the rest stays as the early phase left it
        optimizer = adam if phase == "refine" else sgd
        sgd.zero_grad()
        adam.zero_grad()
        self.manual_backward(loss)
        if phase == "semi" and ready_hparams(self).freeze_head_in_semi:
            for p in self.pes_head().parameters():
                p.grad = None
        optimizer.step()
        self.log("train/loss", loss.detach(), prog_bar=True)
        for name, value in parts.items():
            self.log(f"train/{name}", value.float())
        return loss.detach()

    def on_train_epoch_end(self) -> None:
        phase = self.pes_phase(self.current_epoch)
        if phase == "semi":  # the largest class's share of the epoch's guessed labels (a warning if they collapse)
            for name, value in self.pes_guess_report().items():
                self.log(name, value, sync_dist=True)  # (the same on every rank: the counts are all-reduced)
        if phase != "refine":
            scheduler = self.lr_schedulers()
            scheduler.step()  # type: ignore[union-attr]

    # ------------------------------------------------------------------ evaluation
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y, _ = split_indexed_batch(batch)
        self.val_acc(self.model(x), y)
        self.log("val/acc", self.val_acc, prog_bar=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y, _ = split_indexed_batch(batch)
        self.test_acc(self.model(x), y)
        self.log("test/acc", self.test_acc)

    # ------------------------------------------------------------------ checkpoint
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["pes_split"] = self.pes_state_dict()
        save_network_record(self, checkpoint, self.model)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        check_network_record(self, checkpoint, self.model)
        if "pes_split" in checkpoint:
            self.pes_load_state_dict(checkpoint["pes_split"])
