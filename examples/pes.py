"""PES + LP-A3 in your own LightningModule (noisy labels), runnable on the CPU.

    python examples/pes.py

Trains a small CNN on the embedded MNIST-5k digits with 50% symmetric label noise through PES's
three phases (Progressive Early Stopping, Bai et al., NeurIPS 2021): one early-stopped epoch on
the noisy labels, one epoch re-training a fresh classifier head alone, then semi-supervised
MixMatch epochs on the agreement split, where the callback attacks the unlabeled samples with
their guessed label (LP-A3, Yang et al., NeurIPS 2022). Prints what the callback and the loss
logged, e.g. ``{'lpa3/selected_fraction_epoch': ..., 'train/labeled_share': ..., 'tcs_seen': ...}``.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch

from lpa3_lightning import LPA3Callback, convert_dual_bn
from lpa3_lightning.data import NoisyLabelDataModule
from lpa3_lightning.methods.noisy_training import whole_training_set_loader
from lpa3_lightning.mixins import PESLPA3Mixin, PESSettings
from lpa3_lightning.models import small_cnn


class MyPES(PESLPA3Mixin, pl.LightningModule):  # 1. inherit the mixin (before LightningModule)
    def __init__(self, num_samples: int, num_classes: int = 10, early_epochs: int = 1, refine_epochs: int = 1,
                 lambda_u: float = 25.0) -> None:
        super().__init__()
        # 2. manual optimisation: PES switches optimizer by phase (SGD, then Adam on the head, then SGD)
        self.automatic_optimization = False
        self.net = convert_dual_bn(small_cnn(in_channels=1, num_classes=num_classes))
        # 3. the data's sizes (without both the split cannot be built: refused at fit start) and the
        #    mixin's settings, one frozen dataclass (a misspelled field fails right here)
        self.lpa3_num_classes = num_classes
        self.lpa3_num_samples = num_samples  # the split and the TCS memory are over the training set
        self.lpa3_settings = PESSettings(
            early_epochs=early_epochs,  # T1 (authors: 20 on CIFAR-10)
            refine_epochs=refine_epochs,  # T2 (authors: 5)
            lambda_u=lambda_u,  # the x' term has this weight too (authors: 150; 25 on small sets)
        )

    def lpa3_model(self):  # 4. the network; pes_head() defaults to its last nn.Linear (here `fc`)
        return self.net

    def forward(self, x):
        return self.net(x)

    def on_train_epoch_start(self):
        # 5. every epoch: re-initialise the head when the refine phase starts and, in the semi phase,
        #    re-split the set by agreement. The loader must hold every training sample once: not the
        #    training loader (it drops its last batch and, in the semi phase, draws balanced batches)
        whole_set = whole_training_set_loader(self.trainer, self.global_rank)  # (split across ranks under DDP)
        self.pes_begin_epoch(self.current_epoch, whole_set)
        if self.current_epoch == self.lpa3_settings.early_epochs and self.lpa3_settings.refine_epochs > 0:
            sgd, _ = self.optimizers()
            for p in self.pes_head().parameters():  # the head was reset in place: drop its old momentum
                sgd.optimizer.state.pop(p, None)

    def training_step(self, batch, batch_idx):  # batch: (x_view1, x_view2, noisy_label, index)
        # 6. the phase's loss: CE on the noisy labels (early, refine), MixMatch + the LP-A3 term (semi);
        #    batches_per_epoch makes the unlabeled weight's ramp advance per step
        loss, parts = self.pes_loss(batch, batch_idx)  # the ramp-up advances per step (the trainer's batches per epoch)
        sgd, adam = self.optimizers()
        refine = self.pes_phase(self.current_epoch) == "refine"
        sgd.zero_grad()
        adam.zero_grad()
        self.manual_backward(loss)
        # 7. refine phase: only Adam steps, and Adam holds the head alone, so the rest stays as T1 left it
        (adam if refine else sgd).step()
        self.log("train/loss", loss.detach(), prog_bar=True)
        self.log_dict({f"train/{k}": v.float() for k, v in parts.items()})

    def on_train_epoch_end(self):
        if self.pes_phase(self.current_epoch) != "refine":  # the cosine schedule skips the refine epochs
            self.lr_schedulers().step()

    def configure_optimizers(self):
        # PES's optimizers: SGD (lr 0.02, momentum 0.9, weight decay 5e-4) for the early and semi
        # phases with cosine annealing to lr/100; Adam (lr 1e-4) on the re-initialised head alone
        # in the refine phase
        sgd = torch.optim.SGD(self.net.parameters(), lr=0.02, momentum=0.9, weight_decay=5e-4)
        adam = torch.optim.Adam(self.pes_head().parameters(), lr=1e-4)
        epochs = max(1, self.trainer.max_epochs - self.lpa3_settings.refine_epochs)
        cosine = torch.optim.lr_scheduler.CosineAnnealingLR(sgd, T_max=epochs, eta_min=0.02 / 100)
        return [sgd, adam], [cosine]


def main(max_epochs: int = 4, limit_train_batches: int | float = 10, default_root_dir: str = "runs/pes",
         ratio: float = 0.9, early_epochs: int = 1, refine_epochs: int = 1) -> dict:
    pl.seed_everything(0)
    # (view1, view2, noisy_label, index) batches; noisy labels drawn with seed 0, no download
    datamodule = NoisyLabelDataModule("mnist5k", noise_rate=0.5, batch_size=64)
    module = MyPES(datamodule.num_train, datamodule.num_classes, early_epochs, refine_epochs)
    # 8. no warmup_epochs needed: the mixin's lpa3_consumes_augmented keeps the callback idle
    #    before the semi phase, while the TCS memory already learns from the noisy-label epochs
    callback = LPA3Callback(ratio=ratio, sigma=0.02, seed=0)
    trainer = pl.Trainer(max_epochs=max_epochs, callbacks=[callback], limit_train_batches=limit_train_batches,
                         limit_val_batches=0, accelerator="cpu", default_root_dir=default_root_dir,
                         enable_progress_bar=False, log_every_n_steps=1)
    trainer.fit(module, datamodule=datamodule)
    logged = {k: round(float(v), 4) for k, v in trainer.callback_metrics.items() if k.startswith(("lpa3/", "train/"))}
    logged["tcs_seen"] = int(callback.runner().tcs.seen.sum())  # training samples whose logits fed the memory
    print(logged)
    return logged


if __name__ == "__main__":
    main()
