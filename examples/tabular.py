"""LP-A3 on tabular data: an MLP on scikit-learn's breast cancer set (569 rows, 30 features).

    python examples/tabular.py [--no-lpa3] [--seed 0]

Nothing in LP-A3 is specific to images: the solver moves the input in the model's own feature
space and keeps ``log p(y|x')`` within ``sigma`` of ``log p(y|x)``. Three settings need a thought
for other inputs, and this file shows a choice for each:

* **The input box** (``input_range``): the solver clamps ``x'`` into it. Images have one ([0, 1]
  before their normalisation); standardised features have none by nature. Here the box is each
  feature's range over the training rows, ``(low, high)`` with one value per feature (the
  callback broadcasts per-feature values along dim 1), so ``x'`` never leaves the values the data
  takes. ``input_range=None`` would leave ``x'`` unclamped; the step bound
  (``solver.max_step="auto"``, 2% of the box's diagonal) then comes from the batch's spread.
* **sigma**: a drop in ``log p`` of the label, so it means the same on any input: 0.02 (the
  paper's MedMNIST value) lets the probability of the label fall by about 2% of itself.
* **The feature layers**: by default an MLP's every ``nn.Linear`` but the last (the hidden
  representations); ``layers=["net.2"]`` style names choose others.

The MLP has BatchNorm layers with twins (``convert_dual_bn``), as the image networks of this
package do, so ``x'`` never move the statistics used at test time. Prints the test accuracy.
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl
import torch
from sklearn.datasets import load_breast_cancer
from sklearn.model_selection import train_test_split
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

from lpa3_lightning import LPA3Callback, convert_dual_bn
from lpa3_lightning.data import IndexedDataset
from lpa3_lightning.mixins import SupervisedLPA3Mixin


def tabular_data(seed: int = 0, dataset=load_breast_cancer) -> tuple[TensorDataset, TensorDataset, int]:
    """Standardised (train rows' mean and std) train / test split, 25% test, stratified by label."""
    features, labels = dataset(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(features, labels, test_size=0.25, stratify=labels,
                                                        random_state=seed)
    x_train, x_test = torch.tensor(x_train, dtype=torch.float32), torch.tensor(x_test, dtype=torch.float32)
    mean, std = x_train.mean(0), x_train.std(0).clamp_min(1e-8)
    x_train, x_test = (x_train - mean) / std, (x_test - mean) / std
    num_classes = int(labels.max()) + 1
    return (TensorDataset(x_train, torch.tensor(y_train)), TensorDataset(x_test, torch.tensor(y_test)), num_classes)


class TabularMLP(SupervisedLPA3Mixin, pl.LightningModule):
    """Two hidden layers with BatchNorm (twins for ``x'``); the supervised LP-A3 loss."""

    def __init__(self, in_features: int, num_classes: int, hidden: int = 64, lr: float = 1e-3) -> None:
        super().__init__()
        self.net = convert_dual_bn(nn.Sequential(
            nn.Linear(in_features, hidden), nn.BatchNorm1d(hidden), nn.ReLU(),
            nn.Linear(hidden, hidden), nn.BatchNorm1d(hidden), nn.ReLU(),
            nn.Linear(hidden, num_classes)))
        self.lpa3_num_classes, self.lr = num_classes, lr
        self.test_acc = MulticlassAccuracy(num_classes, average="micro")

    def lpa3_model(self) -> nn.Module:
        return self.net

    def training_step(self, batch, batch_idx):
        loss, _, _ = self.lpa3_supervised_loss(batch)  # CE(x) + CE(x') when the callback gave x'
        self.log("train/loss", loss)
        return loss

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.test_acc(self.net(x), y)
        self.log("test/acc", self.test_acc)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def main(lpa3: bool = True, seed: int = 0, max_epochs: int = 30, dataset=load_breast_cancer,
         default_root_dir: str = "runs/tabular") -> dict[str, float]:
    """Train and test; returns the test accuracy and what the callback logged in its last epoch."""
    pl.seed_everything(seed)
    train, test, num_classes = tabular_data(seed, dataset)
    features = train.tensors[0]
    callbacks = []
    if lpa3:
        box = (features.min(0).values, features.max(0).values)  # each feature's range over the training rows
        callbacks.append(LPA3Callback(ratio=0.5, sigma=0.02, warmup_epochs=1, seed=seed, input_range=box))
    trainer = pl.Trainer(max_epochs=max_epochs, accelerator="cpu", devices=1, callbacks=callbacks, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=default_root_dir, log_every_n_steps=1)
    module = TabularMLP(features.shape[1], num_classes)
    generator = torch.Generator().manual_seed(seed)
    trainer.fit(module, DataLoader(IndexedDataset(train), batch_size=64, shuffle=True, generator=generator))
    logged = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("lpa3/")}
    logged.update(trainer.test(module, DataLoader(test, batch_size=256), verbose=False)[0])
    return logged


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="An MLP on breast cancer features, with or without LP-A3.")
    parser.add_argument("--no-lpa3", action="store_true", help="train without the callback (the baseline)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=30)
    args = parser.parse_args()
    results = main(lpa3=not args.no_lpa3, seed=args.seed, max_epochs=args.epochs)
    print({k: round(v, 4) for k, v in sorted(results.items())})
