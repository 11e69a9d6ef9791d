"""The ready modules resumed mid-epoch train the batches the uninterrupted fit trains and end with its
weights, bit for bit: FixMatch (its CombinedLoader of two random streams; a mid-epoch resume once trained
epoch 0's batches in epoch 1), PES (its phases and its balanced semi-supervised batches) and DivideMix (its
split and two networks), each with LP-A3, a checkpoint at every step and torch's generator checkpointed."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lpa3_lightning import DivideMixClassifier, FixMatchClassifier, LPA3Callback, PESClassifier
from lpa3_lightning.data import NoisyLabelDataModule, SemiSupervisedDataModule
from lpa3_lightning.methods.fixmatch_ema import FixMatchEMA
from tests.helpers import GlobalRandomState


class Batches(pl.Callback):
    """The dataset indices each step trained: (global step, indices of every index tensor of the batch)."""

    def __init__(self) -> None:
        self.seen: list[tuple] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        parts = batch.values() if isinstance(batch, dict) else [batch]
        self.seen.append((trainer.global_step, *(part[-1].tolist() for part in parts)))


def ready_setting(name: str, root, length: str = "max_epochs", batches_per_epoch: int | None = None,
                  wrap=lambda cls: cls):
    """(data module, module, LP-A3 callback, trainer length, other callbacks) of a ready module's short run
    (``wrap``: a subclass of the module's class to build instead; the chaos run adds its kills so)."""
    if name == "fixmatch":
        data = SemiSupervisedDataModule("mnist5k", num_labels=20, seed=0, split_file=str(root / "split.json"),
                                        batch_size=4, mu=2, steps_per_epoch=3, eval_batch_size=200)
        module = wrap(FixMatchClassifier)(arch="small_cnn", in_channels=1, num_classes=10,
                                          fixmatch={"lpa3_loss_warmup_epochs": 0, "lpa3_confidence_threshold": 0.0})
        # the run's length by max_steps, or by max_epochs: then trainer.estimated_stepping_batches, which the cosine
        # schedule needs, sets the training loader up, and read in configure_optimizers (before the checkpoint's
        # loops are restored) it kept Lightning from loading the loader's saved position (Lightning #20550)
        lengths = {"max_steps": {"max_steps": 8}, "max_epochs": {"max_epochs": 3}}
        return data, module, LPA3Callback(ratio=0.5, sigma=0.02, steps=1, seed=0), lengths[length], [FixMatchEMA(0.9)]
    # BreastMNIST (546 training images, shipped): 9 batches of 64 an epoch, 20% of the labels flipped
    batch_size = 546 // batches_per_epoch if batches_per_epoch else 64
    data = NoisyLabelDataModule("breastmnist", noise_rate=0.2, seed=0, batch_size=batch_size,
                                noise_file=str(root / "noise.json"))
    if name == "pes":  # epoch 0 PES's early phase, epoch 1 its refine phase (the head alone), epoch 2 semi
        module = wrap(PESClassifier)(arch="small_cnn", in_channels=1, num_classes=2,
                                     pes={"early_epochs": 1, "refine_epochs": 1})
        warmup = 2
    else:  # epoch 0 DivideMix's warm-up, then its split and co-training
        module = wrap(DivideMixClassifier)(arch="small_cnn", in_channels=1, num_classes=2,
                                           dividemix={"warmup_epochs": 1})
        warmup = 1
    return data, module, LPA3Callback(ratio=0.5, sigma=0.02, steps=1, seed=0, warmup_epochs=warmup), \
        {"max_epochs": 3}, []


def _fit(name: str, root, ckpt_path=None, length: str = "max_epochs"):
    pl.seed_everything(0)
    data, module, lpa3, limits, extra = ready_setting(name, root, length)
    batches = Batches()
    callbacks = [batches, lpa3, *extra, GlobalRandomState(),
                 ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=1, save_top_k=-1, filename="{step}")]
    trainer = pl.Trainer(default_root_dir=root, **limits, accelerator="cpu", devices=1, callbacks=callbacks,
                         logger=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         num_sanity_val_steps=0, deterministic=True)
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    return batches.seen, {k: v.clone() for k, v in module.state_dict().items()}


#: (module, run length): the checkpoints resumed from (the global step a checkpoint was written at)
CASES = {("fixmatch", "max_steps"): (2, 4, 6), ("fixmatch", "max_epochs"): (2, 4, 6),
         ("pes", "max_epochs"): (9, 13, 22), ("dividemix", "max_epochs"): (9, 13, 22)}


@pytest.fixture(scope="module", params=sorted(CASES), ids=lambda case: "-".join(case))
def uninterrupted(tmp_path_factory, request):
    name, length = request.param
    root = tmp_path_factory.mktemp(f"{name}_{length}")
    return name, length, root, *_fit(name, root, length=length)


@pytest.mark.parametrize("which", [0, 1, 2], ids=["an_epochs_last_batch", "mid_epoch", "late"])
def test_a_resume_trains_the_uninterrupted_batches_and_ends_with_its_weights(tmp_path, uninterrupted, which):
    name, length, root, full_batches, full_weights = uninterrupted
    step = CASES[(name, length)][which]
    resumed_batches, resumed_weights = _fit(name, tmp_path, ckpt_path=root / "ckpt" / f"step={step}.ckpt",
                                            length=length)
    assert [s for s, *_ in resumed_batches] == list(range(step, len(full_batches)))
    assert resumed_batches == full_batches[step:]
    for key, value in full_weights.items():
        assert torch.equal(value, resumed_weights[key]), key
