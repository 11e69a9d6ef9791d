"""Models users bring: torchvision's ResNet-18 and MobileNetV3-small (plain BatchNorm, no twins)
on 32 px digits (scikit-learn's 8x8 digits upsampled, three channels), batches of 16, SGD: the
setting in which a newcomer's x' barely moved and kept their label on only 86% of the rows as
trained (ResNet-18), and in which MobileNet's x' became NaN (the feature norm's gradient at
positions whose channels are all 0, spread by its squeeze-and-excitation products).

One fit records every batch's x', the model as the attack saw it and the logits of x' that the
loss used; the tests re-measure from those records with their own forwards.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lpa3_lightning import LPA3Callback
from lpa3_lightning.data import IndexedDataset
from lpa3_lightning.mixins import LPA3ModuleMixin
from tests.helpers import reference_model

SIGMA = 0.02


def digits_32px(n: int = 320) -> IndexedDataset:
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.images[:n], dtype=torch.float32).div(16)[:, None]
    x = F.interpolate(x, size=32, mode="bilinear", align_corners=False).repeat(1, 3, 1, 1)
    return IndexedDataset(TensorDataset(x, torch.tensor(digits.target[:n])))


class UserResNet(LPA3ModuleMixin, pl.LightningModule):
    """A newcomer's module: a torchvision network as it comes, the README's recipe, SGD."""

    def __init__(self, architecture: str = "resnet18") -> None:
        super().__init__()
        import torchvision

        self.net = getattr(torchvision.models, architecture)(num_classes=10)
        self.lpa3_num_classes = 10
        self.records: list[dict[str, Any]] = []

    def lpa3_model(self) -> nn.Module:
        return self.net

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, idx = batch
        before = copy.deepcopy(self.net)  # the weights and statistics the attack saw
        logits = self.net(x)
        self.lpa3_record_predictions(idx, logits)
        loss = F.cross_entropy(logits, y)
        augmented = self.lpa3_take_augmented()
        if augmented is not None and len(augmented):
            logits_aug = self.lpa3_forward_augmented(augmented)
            self.records.append({"model": before, "batch": x.detach().clone(), "x": x[augmented.mask].detach().clone(),
                                 "y": augmented.targets,
                                 "x_adv": augmented.inputs.detach().clone(), "logits_aug": logits_aug.detach().clone()})
            loss = loss + F.cross_entropy(logits_aug, augmented.targets)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class RecordsStats(LPA3Callback):
    """Keeps each batch's solver statistics of its x' (distance in the model's features, projected)."""

    def on_augmented(self, trainer, pl_module, augmented):
        stats = self.runner().last.stats  # (the solver's diagnostics of the batch handed over now)
        if stats is not None and len(augmented):
            self.stats.append((stats.perceptual_distance, stats.projected))

    stats: list = []


@pytest.fixture(scope="module", params=["resnet18", "mobilenet_v3_small"])
def run(request, tmp_path_factory) -> tuple[UserResNet, pl.Trainer, list, RecordsStats]:
    pl.seed_everything(0)
    module = UserResNet(request.param)
    callback = RecordsStats(ratio=0.2, sigma=SIGMA, seed=0, input_range=(0.0, 1.0))
    callback.stats = []
    trainer = pl.Trainer(default_root_dir=tmp_path_factory.mktemp("tv"), max_epochs=2, accelerator="cpu", devices=1,
                         callbacks=[callback], logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    # one thread: the statistics asserted below move with the order of float reductions (the share
    # of x' pulled back read 0.496 at one thread and 0.512 at two on the same machine)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(module, DataLoader(digits_32px(), batch_size=16, shuffle=True))
    finally:
        torch.set_num_threads(threads)
    return module, trainer, [str(w.message) for w in caught], callback


def torchvision_resnet() -> type:
    from torchvision.models import ResNet

    return ResNet


def _logp(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.log_softmax(logits.float(), dim=1).gather(1, y[:, None]).squeeze(1)


def test_the_x_prime_of_a_torchvision_resnet_move_in_its_feature_space(run):
    """Attacked and trained on its own BatchNorms with the clean batch's statistics ("batch" mode):
    before, on the running statistics, training on x' diverged (NaN weights) and most x' came back
    as x (perceptual distance 1e-4 or less, 67-100% pulled back by the bisection)."""
    module, _, messages, callback = run
    assert len(module.records) >= 10
    distance = torch.cat([d for d, _ in callback.stats])
    projected = torch.cat([p for _, p in callback.stats]).float()
    assert torch.isfinite(torch.cat([r["x_adv"] for r in module.records])).all()
    assert float(distance.median()) > 0.01, distance  # (the x' of noise alone: ~0.003)
    if isinstance(module.net, torchvision_resnet()):
        # about half are bisected (0.50 measured), against 67-100% before: the bound leaves a margin
        # on both sides. MobileNet is steeper: about two thirds of its x' are bisected
        # (benchmarks/hardness.py), each to a partial step that still moves; the distance and
        # warning checks cover it
        assert float(projected.mean()) < 0.6
    assert not [m for m in messages if "barely moved" in m]
    assert all(torch.isfinite(p).all() for p in module.parameters())  # training on x' did not diverge


def test_every_x_prime_keeps_its_label_in_the_forward_that_trains_it(run):
    """Re-measured with the records' own models: the clean rows' log p under the normalisation the
    training forward must use (the clean batch's statistics, written into a copy's BatchNorms),
    against the log p of the logits the loss used. Tiny selections included."""
    module = run[0]
    kept = total = 0
    for r in module.records:
        reference = reference_model(r["model"], r["batch"], mode="batch")
        with torch.no_grad():
            logp_x = _logp(reference(r["x"]), r["y"])
        kept += int((_logp(r["logits_aug"], r["y"]) >= logp_x - SIGMA).sum())
        total += len(r["y"])
    assert min(len(r["y"]) for r in module.records) <= 3  # small selections were part of the run
    assert kept == total, (kept, total)
