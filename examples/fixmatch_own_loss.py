"""FixMatch with your own loss and your own tensors, LP-A3 through the base mixin, runnable on the CPU.

    python examples/fixmatch_own_loss.py

For when you keep your FixMatch code and only want LP-A3's hard positives: the module inherits the
base mixin (not ``FixMatchLPA3Mixin``), offers the callback the weak unlabeled view with its
pseudo-labels in ``lpa3_request``, and adds its own term for the ``x'`` to its own loss. The data are
plain tensors (MNIST-5k digits, 40 labels) wrapped so that every part of a batch carries the dataset
index the callback keys its memory by. Three things matter, each learnt the hard way:

1. **Both parts carry an index.** ``LabeledDataset`` returns ``(x, y, index)`` and
   ``UnlabeledDataset`` ``(x_weak, x_strong, index)``, from tensors as well as from images (the
   views are then transforms of tensors). The TCS memory runs over the unlabeled set: its size is
   ``lpa3_num_samples``.
2. **Labeled, weak and strong views in one forward.** FixMatch forwards the three views as one
   batch in train mode, so BatchNorm normalises the weak view by the statistics of the batch that
   trains, and its pseudo-labels are the detached predictions of that weak slice. Forwarding the
   weak view alone normalises it by its own statistics, which under a strong view with Cutout
   differ so much that every confident pseudo-label fell in one class (measured); in eval mode
   (running statistics, which lag the weights early on) they were wrong too (0.21 to 0.62 accuracy
   in a newcomer's run). The callback needs the pseudo-labels before the step, so the request makes
   the same joint forward without gradient, the BatchNorm running statistics left alone: its
   pseudo-labels are the ones the training forward computes.
3. **An epoch is the longest loader's pass.** Under ``CombinedLoader(mode="max_size_cycle")`` an
   epoch ends when the longer stream (here the unlabeled one) is through; the shorter one cycles.
   ``lpa3_consumes_augmented(epoch)`` counts those epochs: the LP-A3 term and the solver start at
   ``loss_warmup_epochs`` of them.

Prints what the callback and the loss logged. (FixMatch: Sohn et al., NeurIPS 2020; LP-A3: Yang et
al., NeurIPS 2022.)
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities.combined_loader import CombinedLoader
from torch.utils.data import DataLoader, RandomSampler, TensorDataset
from torchvision.transforms import v2

from lpa3_lightning import LPA3Callback, LPA3Request, convert_dual_bn
from lpa3_lightning.data import LabeledDataset, UnlabeledDataset, load_mnist5k, stratified_label_split
from lpa3_lightning.methods.base import BatchNormStatisticsFrozen
from lpa3_lightning.mixins import LPA3ModuleMixin
from lpa3_lightning.models import small_cnn

MEAN, STD = 0.1307, 0.3081  # MNIST's


class OwnFixMatch(LPA3ModuleMixin, pl.LightningModule):
    def __init__(self, num_unlabeled: int, num_classes: int = 10, threshold: float = 0.95,
                 loss_warmup_epochs: int = 1) -> None:
        super().__init__()
        self.net = convert_dual_bn(small_cnn(in_channels=1, num_classes=num_classes))  # x' keep off the main BN
        self.lpa3_num_classes = num_classes
        self.lpa3_num_samples = num_unlabeled  # 1. the memory runs over the unlabeled set
        self.threshold, self.loss_warmup_epochs = threshold, loss_warmup_epochs

    def lpa3_model(self):
        return self.net

    def joint_logits(self, batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """2. FixMatch's one forward of the labeled, weak and strong views: their three slices of logits."""
        x, _, _ = batch["labeled"]
        x_weak, x_strong, _ = batch["unlabeled"]
        logits = self.net(torch.cat([x, x_weak, x_strong]))
        return logits[: len(x)], logits[len(x): len(x) + len(x_weak)], logits[len(x) + len(x_weak):]

    def lpa3_request(self, batch) -> LPA3Request:
        with torch.no_grad(), BatchNormStatisticsFrozen(self.net):  # 2. the step's forward, before the step
            weak = self.joint_logits(batch)[1]
        return LPA3Request(inputs=batch["unlabeled"][0], targets=weak.argmax(1), indices=batch["unlabeled"][2])

    def lpa3_consumes_augmented(self, epoch: int) -> bool:
        return epoch >= self.loss_warmup_epochs  # 3. epochs of the CombinedLoader (the unlabeled pass)

    def training_step(self, batch, batch_idx):
        y, index = batch["labeled"][1], batch["unlabeled"][2]
        logits_x, weak, logits_strong = self.joint_logits(batch)
        self.lpa3_record_predictions(index, weak)  # the TCS memory learns from the weak view
        confidence, pseudo = weak.detach().softmax(1).max(1)
        loss = F.cross_entropy(logits_x, y)
        mask = (confidence >= self.threshold).float()
        loss = loss + (F.cross_entropy(logits_strong, pseudo, reduction="none") * mask).mean()
        augmented = self.lpa3_take_augmented()
        if augmented is not None and len(augmented):  # your own term: here, the x' with their pseudo-label
            loss_lpa3 = F.cross_entropy(self.lpa3_forward_augmented(augmented), augmented.targets)
            self.log("train/loss_lpa3", loss_lpa3, batch_size=len(augmented))
            loss = loss + loss_lpa3
        self.log("train/loss", loss, batch_size=len(y))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.03, momentum=0.9, nesterov=True, weight_decay=5e-4)


def loaders(num_labels: int = 40, batch_size: int = 16, mu: int = 7, steps: int = 10) -> tuple[CombinedLoader, int]:
    """Plain tensors, wrapped: ``(x, y, index)`` labeled and ``(weak, strong, index)`` unlabeled batches."""
    data = load_mnist5k()
    images = torch.tensor(data["train_images"]).float().div(255)[:, None]
    base = TensorDataset(images, torch.tensor(data["train_labels"]))
    normalise = v2.Normalize([MEAN], [STD])
    weak = v2.Compose([v2.RandomCrop(28, padding=2, padding_mode="reflect"), normalise])
    strong = v2.Compose([weak, v2.RandomErasing(p=1.0, scale=(0.02, 0.15))])
    labeled = LabeledDataset(base, stratified_label_split(data["train_labels"], num_labels, 10, seed=0), weak)
    unlabeled = UnlabeledDataset(base, weak, strong)  # every training image, its label unused
    streams = {
        "labeled": DataLoader(labeled, batch_size, sampler=RandomSampler(labeled, replacement=True,
                                                                           num_samples=steps * batch_size)),
        "unlabeled": DataLoader(unlabeled, mu * batch_size, sampler=RandomSampler(unlabeled,
                                                                                  num_samples=steps * mu * batch_size)),
    }
    return CombinedLoader(streams, mode="max_size_cycle"), len(unlabeled)


def main(max_epochs: int = 3, limit_train_batches: int | float = 1.0, default_root_dir: str = "runs/fixmatch_own",
         ratio: float = 0.9, loss_warmup_epochs: int = 1, threshold: float = 0.95) -> dict:
    pl.seed_everything(0)
    train, num_unlabeled = loaders()
    module = OwnFixMatch(num_unlabeled, threshold=threshold, loss_warmup_epochs=loss_warmup_epochs)
    # the input box of normalised [0, 1] pixels (no data module tells it here)
    callback = LPA3Callback(ratio=ratio, sigma=0.02, seed=0, input_range={"mean": [MEAN], "std": [STD]})
    trainer = pl.Trainer(max_epochs=max_epochs, callbacks=[callback], limit_train_batches=limit_train_batches,
                         accelerator="cpu", default_root_dir=default_root_dir, enable_progress_bar=False,
                         log_every_n_steps=1, logger=False, enable_checkpointing=False)
    trainer.fit(module, train)
    logged = {k: round(float(v), 4) for k, v in trainer.callback_metrics.items() if k.startswith(("lpa3/", "train/"))}
    logged["tcs_seen"] = int(callback.runner().tcs.seen.sum())  # unlabeled samples whose weak view fed the memory
    print(logged)
    return logged


if __name__ == "__main__":
    main()
