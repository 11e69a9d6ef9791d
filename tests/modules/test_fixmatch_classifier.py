"""The ready FixMatch module on the shipped MNIST-5k: fit with LP-A3 and EMA, resume, configs."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import EMAWeightAveraging, ModelCheckpoint

from lpa3_lightning import FixMatchClassifier, LPA3Callback
from lpa3_lightning.cli import build_cli
from lpa3_lightning.data import SemiSupervisedDataModule
from lpa3_lightning.mixins import FixMatchSettings
from tests.helpers import lpa3_state

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "ssl"


def _data(tmp_path) -> SemiSupervisedDataModule:
    return SemiSupervisedDataModule("mnist5k", num_labels=10, seed=0, split_file=str(tmp_path / "split.json"),
                                    batch_size=8, mu=2, steps_per_epoch=3, eval_batch_size=500)


def _trainer(tmp_path, callbacks, max_epochs: int) -> pl.Trainer:
    return pl.Trainer(default_root_dir=tmp_path, max_epochs=max_epochs, accelerator="cpu", devices=1,
                      callbacks=callbacks, logger=False, enable_progress_bar=False, enable_model_summary=False,
                      limit_val_batches=1, limit_test_batches=1, num_sanity_val_steps=0)


def test_ready_module_fits_with_lpa3_and_ema_then_resumes(tmp_path):
    pl.seed_everything(0)
    module = FixMatchClassifier(arch="small_cnn", in_channels=1, num_classes=10,
                                fixmatch=FixMatchSettings(lpa3_loss_warmup_epochs=1))
    lpa3 = LPA3Callback(ratio=0.5, sigma=0.02, steps=1, seed=0)
    ema = EMAWeightAveraging(decay=0.999)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    unlabeled: set[int] = set()

    class Indices(pl.Callback):  # the unlabeled rows the steps saw
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            unlabeled.update(batch["unlabeled"][2].tolist())

    trainer = _trainer(tmp_path, [lpa3, ema, ckpt, Indices()], max_epochs=2)
    data = _data(tmp_path)
    trainer.fit(module, datamodule=data)
    assert module.lpa3_num_samples == data.num_unlabeled == 4000  # TCS over the unlabeled set
    assert lpa3.runner().tcs is not None and lpa3.runner().tcs.num_samples == 4000
    assert int(lpa3.runner().tcs.seen.sum()) == len(unlabeled) > 16  # every unlabeled row of the 2 x 3 steps, none else
    assert bool(lpa3.runner().tcs.seen[sorted(unlabeled)].all())
    assert "lpa3/label_preserved_epoch" in trainer.callback_metrics
    assert "val/acc" in trainer.callback_metrics
    saved = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)
    assert saved["hyper_parameters"]["fixmatch"]["lpa3_loss_warmup_epochs"] == 1  # the fields, a plain mapping
    loaded = FixMatchClassifier.load_from_checkpoint(tmp_path / "ckpt" / "last.ckpt")
    assert loaded.lpa3_settings == module.lpa3_settings
    # resume: the TCS memory, the EMA weights and the labeled split come back
    module2 = FixMatchClassifier(arch="small_cnn", in_channels=1, num_classes=10,
                                 fixmatch=FixMatchSettings(lpa3_loss_warmup_epochs=1))
    lpa3_2 = LPA3Callback(ratio=0.5, sigma=0.02, steps=1, seed=0)
    ema2 = EMAWeightAveraging(decay=0.999)
    restored: dict = {}

    class Peek(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            restored["scores"] = lpa3_2.runner().tcs.scores.clone()
            restored["ema"] = {k: v.clone() for k, v in ema2._average_model.module.state_dict().items()}
            restored["labels"] = list(trainer.datamodule.labeled_indices)

    data2 = SemiSupervisedDataModule("mnist5k", num_labels=10, seed=123, batch_size=8, mu=2, steps_per_epoch=3,
                                     eval_batch_size=500)  # another seed: the checkpoint's split must win
    with pytest.warns(UserWarning):
        _trainer(tmp_path, [lpa3_2, ema2, Peek()], max_epochs=3).fit(module2, datamodule=data2,
                                                                     ckpt_path=tmp_path / "ckpt" / "last.ckpt")
    state = lpa3_state(saved)["tcs"]
    assert torch.equal(restored["scores"], state["scores"])
    assert restored["labels"] == list(data.labeled_indices)
    # the checkpoint's state_dict holds the EMA weights (Lightning's WeightAveraging), restored into the average
    assert "current_model_state" in saved
    for name, value in saved["state_dict"].items():
        torch.testing.assert_close(restored["ema"][name], value, msg=name)


@pytest.mark.parametrize("config", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_each_ssl_config_parses(config, tmp_path):
    args = ["--config", str(CONFIGS / config), f"--trainer.default_root_dir={tmp_path}",
            f"--trainer.logger.init_args.save_dir={tmp_path}", "--data.init_args.download=false",
            f"--data.init_args.split_file={tmp_path / 'split.json'}"]
    cli = build_cli(args, run=False)
    assert isinstance(cli.model, FixMatchClassifier) and isinstance(cli.datamodule, SemiSupervisedDataModule)
    has_lpa3 = any(isinstance(c, LPA3Callback) for c in cli.trainer.callbacks)
    assert has_lpa3 == config.endswith("_lpa3.yaml")
    assert any(isinstance(c, EMAWeightAveraging) for c in cli.trainer.callbacks)
    if has_lpa3:
        callback = next(c for c in cli.trainer.callbacks if isinstance(c, LPA3Callback))
        assert callback.ratio == 0.9
        assert callback.sigma == (0.02 if config.startswith(("cifar100", "mnist5k", "pneumonia")) else 0.002)


def test_a_non_bool_solve_trained_only_is_refused_by_name():
    with pytest.raises(ValueError, match="`fixmatch.solve_trained_only` must be True or False"):
        FixMatchClassifier(arch="small_cnn", in_channels=1, num_classes=10, fixmatch={"solve_trained_only": "yes"})
    with pytest.raises(TypeError, match=r"`fixmatch` has no setting `lpa3_solve_trained_only`"):
        FixMatchClassifier(fixmatch={"lpa3_solve_trained_only": True})  # the former name: not a field
