"""The ready FixMatch module resumed mid-epoch trains the batches the uninterrupted fit trains, and
ends with its weights (issue: steps after a mid-epoch resume trained epoch 0's batches)."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lpa3_lightning import FixMatchClassifier, LPA3Callback
from lpa3_lightning.data import SemiSupervisedDataModule
from lpa3_lightning.methods.fixmatch_ema import FixMatchEMA
from tests.helpers import GlobalRandomState

STEPS_PER_EPOCH, MAX_STEPS = 3, 8
#: the run's length by max_steps, or by max_epochs (9 steps): then trainer.estimated_stepping_batches, which
#: a cosine schedule needs, sets the training loader up, and a configure_optimizers that reads it before the
#: checkpoint's loops are restored leaves the loader's saved position unloaded (Lightning issue #20550)
LENGTHS = {"max_steps": {"max_steps": MAX_STEPS}, "max_epochs": {"max_epochs": 3}}


class Batches(pl.Callback):
    """The dataset indices each step trained: (global step, labeled indices, unlabeled indices)."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, list[int], list[int]]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.seen.append((trainer.global_step, batch["labeled"][2].tolist(), batch["unlabeled"][2].tolist()))


def _fit(root, ckpt_path=None, length="max_steps"):
    pl.seed_everything(0)
    data = SemiSupervisedDataModule("mnist5k", num_labels=20, seed=0, split_file=str(root / "split.json"),
                                    batch_size=4, mu=2, steps_per_epoch=STEPS_PER_EPOCH, eval_batch_size=200)
    module = FixMatchClassifier(arch="small_cnn", in_channels=1, num_classes=10,
                                fixmatch={"lpa3_loss_warmup_epochs": 0, "lpa3_confidence_threshold": 0.0})
    batches = Batches()
    callbacks = [batches, LPA3Callback(ratio=0.5, sigma=0.02, steps=1, seed=0), FixMatchEMA(decay=0.9),
                 GlobalRandomState(),
                 ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=1, save_top_k=-1, filename="{step}")]
    trainer = pl.Trainer(default_root_dir=root, **LENGTHS[length], accelerator="cpu", devices=1, callbacks=callbacks,
                         logger=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         num_sanity_val_steps=0)
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    return batches.seen, {k: v.clone() for k, v in module.state_dict().items()}


@pytest.fixture(scope="module", params=sorted(LENGTHS))
def uninterrupted(tmp_path_factory, request):
    root = tmp_path_factory.mktemp(f"fixmatch_full_{request.param}")
    return request.param, root, *_fit(root, length=request.param)


@pytest.mark.parametrize("step", [2, 4, 6], ids=["epoch_0_last_batch", "epoch_1_after_first", "epoch_2_first"])
def test_a_mid_epoch_resume_trains_the_uninterrupted_batches(tmp_path, uninterrupted, step):
    length, root, full_batches, full_weights = uninterrupted
    resumed_batches, resumed_weights = _fit(tmp_path, ckpt_path=root / "ckpt" / f"step={step}.ckpt", length=length)
    assert [s for s, _, _ in resumed_batches] == list(range(step, len(full_batches)))
    assert resumed_batches == full_batches[step:]
    for key, value in full_weights.items():
        assert torch.equal(value, resumed_weights[key]), key
