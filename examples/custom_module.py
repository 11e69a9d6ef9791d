"""Adopt LP-A3 in your own LightningModule: the few lines the README shows, runnable.

    python examples/custom_module.py

Trains a small CNN for two epochs on the embedded BreastMNIST data with LPA3Callback and
prints what the callback logged.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn

from lpa3_lightning import LPA3Callback, convert_dual_bn
from lpa3_lightning.data import MedMNISTDataModule
from lpa3_lightning.mixins import LPA3ModuleMixin


class MyClassifier(LPA3ModuleMixin, pl.LightningModule):  # 1. inherit the mixin
    def __init__(self, num_classes: int = 2) -> None:
        super().__init__()
        self.net = convert_dual_bn(nn.Sequential(  # twin BNs keep x' out of the test-time statistics
            nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, num_classes),
        ))
        self.lpa3_num_classes = num_classes  # 2. size of the TCS memory

    def lpa3_model(self) -> nn.Module:  # 3. the network to attack (its layers give the features)
        return self.net

    # 4. what may be augmented: the default `lpa3_request` takes (x, y, index) batches and their
    #    true labels; override it to preserve other labels (e.g. pseudo-labels)

    def training_step(self, batch, batch_idx):
        x, y, index = self.lpa3_split_batch(batch)  # names the fix when the batch has no indices
        logits = self.net(x)
        self.lpa3_record_predictions(index, logits)  # 5. clean logits feed the TCS memory
        loss = F.cross_entropy(logits, y)
        augmented = self.lpa3_take_augmented()  # 6. the hard positives of this batch, if any
        if augmented is not None and len(augmented):
            # 7. their logits in the forward the solver verified (twin BNs on the clean selected
            #    samples' statistics)
            loss = loss + F.cross_entropy(self.lpa3_forward_augmented(augmented), augmented.targets)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def main(max_epochs: int = 2, limit_train_batches: int | float = 1.0, default_root_dir: str = "runs/custom") -> dict:
    pl.seed_everything(0)
    trainer = pl.Trainer(max_epochs=max_epochs, callbacks=[LPA3Callback(ratio=0.5, sigma=0.02)],
                         limit_train_batches=limit_train_batches, limit_val_batches=0, accelerator="cpu",
                         default_root_dir=default_root_dir, enable_progress_bar=False, log_every_n_steps=1)
    trainer.fit(MyClassifier(), datamodule=MedMNISTDataModule("breastmnist", batch_size=64))
    logged = {k: round(float(v), 4) for k, v in trainer.callback_metrics.items() if k.startswith("lpa3/")}
    print(logged)
    return logged


if __name__ == "__main__":
    main()
