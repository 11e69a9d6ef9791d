"""FixMatch + LP-A3 in your own LightningModule (semi-supervised), runnable on the CPU.

    python examples/fixmatch.py

Trains a small CNN on the embedded MNIST-5k digits with 40 labels (all 4,000 training images,
labels hidden, form the unlabeled set) for three 10-step epochs: the first is the LP-A3 loss
warm-up; in the next two the callback attacks the weak view of the unlabeled samples with their
pseudo-label and the loss adds the hard positives. Prints what the callback and the loss logged, e.g.
``{'lpa3/selected_fraction_epoch': ..., 'train/loss_lpa3': ..., 'tcs_seen': ...}``.
(FixMatch: Sohn et al., NeurIPS 2020; LP-A3: Yang et al., NeurIPS 2022.)
"""

from __future__ import annotations

import math

import lightning.pytorch as pl
import torch

from lpa3_lightning import LPA3Callback, convert_dual_bn
from lpa3_lightning.data import SemiSupervisedDataModule
from lpa3_lightning.mixins import FixMatchLPA3Mixin, FixMatchSettings
from lpa3_lightning.models import small_cnn


class MyFixMatch(FixMatchLPA3Mixin, pl.LightningModule):  # 1. inherit the mixin (before LightningModule)
    def __init__(self, num_unlabeled: int, num_classes: int = 10, lr: float = 0.03,
                 loss_warmup_epochs: int = 1, confidence_threshold: float = 0.9) -> None:
        super().__init__()
        # twin BatchNorms: the x' never move the running statistics used at test time
        self.net = convert_dual_bn(small_cnn(in_channels=1, num_classes=num_classes))
        self.lr = lr
        # 2. the data's sizes, and the mixin's settings: one frozen dataclass (a misspelled field fails here)
        self.lpa3_num_classes = num_classes
        self.lpa3_num_samples = num_unlabeled  # the TCS memory runs over the unlabeled set
        self.lpa3_settings = FixMatchSettings(
            lpa3_loss_warmup_epochs=loss_warmup_epochs,  # default 5: far beyond a 3-epoch demo
            lpa3_confidence_threshold=confidence_threshold,  # the x' train only above it (authors: 0.9)
        )  # threshold (0.95), lambda_u (1) and lpa3_weight (1) keep the papers' defaults

    def lpa3_model(self):  # 3. the network the callback attacks and the loss forwards
        return self.net

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):  # batch: {"labeled": (x, y, idx), "unlabeled": (weak, strong, idx)}
        # 4. one call: labeled CE + masked pseudo-label CE on the strong view + the LP-A3 term;
        #    it also records the weak-view logits for the TCS memory and takes this batch's x'
        loss, parts = self.fixmatch_loss(batch)
        batch_size = batch["labeled"][0].shape[0]
        self.log("train/loss", loss, prog_bar=True, batch_size=batch_size)
        self.log_dict({f"train/{k}": v for k, v in parts.items()}, batch_size=batch_size)
        return loss

    def configure_optimizers(self):
        # 5. FixMatch's recipe: SGD, Nesterov momentum 0.9, weight decay 5e-4 except on biases and
        #    BatchNorm, cosine decay lr * cos(7 pi k / 16K) over the K optimizer steps of the run
        decay = [p for n, p in self.named_parameters() if p.dim() > 1 and not n.endswith(".bias")]
        no_decay = [p for n, p in self.named_parameters() if p.dim() <= 1 or n.endswith(".bias")]
        groups = [{"params": decay, "weight_decay": 5e-4}, {"params": no_decay, "weight_decay": 0.0}]
        optimizer = torch.optim.SGD(groups, lr=self.lr, momentum=0.9, nesterov=True)
        # K read at the first step, not here: trainer.estimated_stepping_batches sets the training loader up, and
        #    read in configure_optimizers it keeps a resumed fit from loading the loader's saved position
        #    (Lightning issue #20550: a mid-epoch resume would train other batches)
        length: list[int] = []

        def cosine(k: int) -> float:
            if k and not length:
                length.append(max(1, int(self.trainer.estimated_stepping_batches)))
            return math.cos(7 * math.pi * k / (16 * length[0])) if k else 1.0

        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def main(max_epochs: int = 3, limit_train_batches: int | float = 1.0, default_root_dir: str = "runs/fixmatch",
         ratio: float = 0.9, steps_per_epoch: int = 10, loss_warmup_epochs: int = 1,
         confidence_threshold: float = 0.9) -> dict:
    pl.seed_everything(0)
    # 40 labels drawn stratified (seed 0); 32 labeled + 7 x 32 unlabeled images a step; no download
    datamodule = SemiSupervisedDataModule("mnist5k", num_labels=40, batch_size=32, mu=7,
                                          steps_per_epoch=steps_per_epoch)
    module = MyFixMatch(datamodule.num_unlabeled, datamodule.num_classes, loss_warmup_epochs=loss_warmup_epochs,
                        confidence_threshold=confidence_threshold)
    # 6. the callback: ratio (tau) and sigma as the package's MNIST-5k FixMatch rows; it reads the
    #    data module's normalisation for the solver's input box, and the module's loss warm-up
    #    (lpa3_consumes_augmented) for when to start solving
    callback = LPA3Callback(ratio=ratio, sigma=0.02, seed=0)
    trainer = pl.Trainer(max_epochs=max_epochs, callbacks=[callback], limit_train_batches=limit_train_batches,
                         limit_val_batches=0, accelerator="cpu", default_root_dir=default_root_dir,
                         enable_progress_bar=False, log_every_n_steps=1)
    trainer.fit(module, datamodule=datamodule)
    logged = {k: round(float(v), 4) for k, v in trainer.callback_metrics.items() if k.startswith(("lpa3/", "train/"))}
    logged["tcs_seen"] = int(callback.runner().tcs.seen.sum())  # unlabeled samples whose weak view fed the memory
    print(logged)
    return logged


if __name__ == "__main__":
    main()
