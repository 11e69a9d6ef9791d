"""DivideMix + LP-A3 in your own LightningModule (two networks, noisy labels), runnable on the CPU.

    python examples/dividemix.py

Trains two small CNNs on the embedded MNIST-5k digits with 50% symmetric label noise (DivideMix:
Li, Socher, Hoi, ICLR 2020): a cross-entropy warm-up epoch, then semi-supervised epochs in which
each network's per-sample losses are split by a Gaussian mixture for the *other* network, and
one LPA3Callback attacks each network's unlabeled samples with their co-guessed label (LP-A3:
Yang et al., NeurIPS 2022), each network with its own memory. Prints what the callback and the
loss logged, e.g. ``{'lpa3/net1/selected_fraction_epoch': ..., 'tcs_seen/net2': ...}``.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch

from lpa3_lightning import LPA3Callback, convert_dual_bn
from lpa3_lightning.data import NoisyLabelDataModule
from lpa3_lightning.methods.noisy_training import whole_training_set_loader
from lpa3_lightning.mixins import DivideMixLPA3Mixin, DivideMixSettings
from lpa3_lightning.models import small_cnn


class MyDivideMix(DivideMixLPA3Mixin, pl.LightningModule):  # 1. inherit the mixin (before LightningModule)
    def __init__(self, num_samples: int, num_classes: int = 10, warmup_epochs: int = 1,
                 lambda_u: float = 25.0) -> None:
        super().__init__()
        # two networks of one architecture, different initialisations, each with twin BatchNorms
        self.net1 = convert_dual_bn(small_cnn(in_channels=1, num_classes=num_classes))
        self.net2 = convert_dual_bn(small_cnn(in_channels=1, num_classes=num_classes))
        # 2. the data's sizes (without both the split cannot be built) and the mixin's settings, one
        #    frozen dataclass (a misspelled field fails right here)
        self.lpa3_num_classes = num_classes
        self.lpa3_num_samples = num_samples  # the split and each TCS memory are over the training set
        self.lpa3_settings = DivideMixSettings(
            warmup_epochs=warmup_epochs,  # authors: 10 on CIFAR-10, 30 on CIFAR-100
            lambda_u=lambda_u,  # also the x' term's weight (lpa3_weight=None)
        )

    def dividemix_model(self, network):  # 3. the network of each name in lpa3_settings.networks ("net1", "net2")
        return self.net1 if network == "net1" else self.net2

    def forward(self, x):  # DivideMix predicts with both networks' logits added
        return self.net1(x) + self.net2(x)

    def on_train_epoch_start(self):
        # 4. in the semi phase, fit each network's Gaussian mixture on its per-sample losses before
        #    either network trains. The loader must hold every training sample once, in the
        #    evaluation view (DivideMix takes these losses without augmentation)
        evaluation_view = self.trainer.datamodule.train_eval_dataset
        whole_set = whole_training_set_loader(self.trainer, self.global_rank, evaluation_view)  # split under DDP
        self.dividemix_begin_epoch(self.current_epoch, whole_set)

    def training_step(self, batch, batch_idx):  # batch: (x_view1, x_view2, noisy_label, index)
        # 5. both networks' losses, every co-guess made before either trains; each records its own
        #    logits for its TCS memory and takes its own x'. Their parameters are disjoint, so one
        #    backward of the sum updates each network by its own loss
        losses = self.dividemix_losses(batch, batch_idx)  # the ramp-up advances per step (trainer's batches)
        total = sum(loss for loss, _ in losses.values())
        for name, (_, parts) in losses.items():
            self.log_dict({f"train/{name}/{k}": v.float() for k, v in parts.items()})
        self.log("train/loss", total.detach(), prog_bar=True)
        return total

    def configure_optimizers(self):
        # 6. DivideMix's recipe: SGD (lr 0.02, momentum 0.9, weight decay 5e-4) over both networks
        #    (per parameter the same as the authors' one optimizer per network), lr / 10 half-way
        sgd = torch.optim.SGD(self.parameters(), lr=0.02, momentum=0.9, weight_decay=5e-4)
        drop = torch.optim.lr_scheduler.MultiStepLR(sgd, milestones=[max(1, self.trainer.max_epochs // 2)], gamma=0.1)
        return {"optimizer": sgd, "lr_scheduler": {"scheduler": drop, "interval": "epoch"}}


def main(max_epochs: int = 3, limit_train_batches: int | float = 10, default_root_dir: str = "runs/dividemix",
         ratio: float = 0.9, warmup_epochs: int = 1) -> dict:
    pl.seed_everything(0)
    # (view1, view2, noisy_label, index) batches, and `train_eval_dataset` for the split; no download
    datamodule = NoisyLabelDataModule("mnist5k", noise_rate=0.5, batch_size=64)
    module = MyDivideMix(datamodule.num_train, datamodule.num_classes, warmup_epochs)
    # 7. one callback serves both networks (lpa3_networks() names them); no warmup_epochs needed:
    #    the mixin's lpa3_consumes_augmented keeps it idle during the warm-up
    callback = LPA3Callback(ratio=ratio, sigma=0.02, seed=0)
    trainer = pl.Trainer(max_epochs=max_epochs, callbacks=[callback], limit_train_batches=limit_train_batches,
                         limit_val_batches=0, accelerator="cpu", default_root_dir=default_root_dir,
                         enable_progress_bar=False, log_every_n_steps=1)
    trainer.fit(module, datamodule=datamodule)
    logged = {k: round(float(v), 4) for k, v in trainer.callback_metrics.items() if k.startswith(("lpa3/", "train/"))}
    for name, runner in callback.networks.items():  # each network's own memory
        logged[f"tcs_seen/{name}"] = int(runner.tcs.seen.sum())
    print(logged)
    return logged


if __name__ == "__main__":
    main()
