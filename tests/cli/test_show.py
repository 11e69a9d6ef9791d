"""The x / x' / |x' - x| grid, its logging by the callback, and the `lpa3 show` command."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils.data import DataLoader

from lpa3_lightning import LPA3Callback, LPA3Classifier
from lpa3_lightning.cli import main
from lpa3_lightning.core.visualize import comparison_grid, save_comparison_grid, to_unit_range
from lpa3_lightning.data import MedMNISTDataModule
from tests.callback.test_callback import TinyClassifier
from tests.helpers import indexed_images


def test_grid_rows_are_clean_augmented_and_stretched_difference():
    x = torch.zeros(2, 1, 4, 4)
    x_adv = x.clone()
    x_adv[0, 0, 1, 1] = 0.2
    grid = comparison_grid(x, x_adv, normalization={"mean": [0.5], "std": [0.5]}, padding=0)
    assert tuple(grid.shape) == (3, 12, 8)
    assert float(grid.min()) >= 0 and float(grid.max()) <= 1
    assert torch.allclose(grid[0, 0:4, 0:4], torch.full((4, 4), 0.5))  # x = 0 is grey 0.5
    assert float(grid[0, 4 + 1, 1]) == pytest.approx(0.6)  # x' = 0.2 -> 0.6
    assert float(grid[0, 8 + 1, 1]) == pytest.approx(1.0) and float(grid[0, 8:12, 4:8].max()) == 0.0
    with pytest.raises(ValueError, match="image batches"):
        comparison_grid(torch.zeros(2, 5, 4, 4), torch.zeros(2, 5, 4, 4))
    assert float(to_unit_range(torch.tensor([[-2.0, 2.0]])).max()) == 1.0


def test_without_normalization_an_unchanged_image_has_a_zero_difference_row():
    x = torch.rand(3, 1, 6, 6, generator=torch.Generator().manual_seed(0)) * 4 - 2
    x_adv = x.clone()
    x_adv[1] += 0.5  # only image 1 changes
    grid = comparison_grid(x, x_adv, padding=0)
    diff_row = grid[0, 12:18]
    assert float(diff_row[:, 0:6].max()) == 0.0 and float(diff_row[:, 12:18].max()) == 0.0
    # A uniform shift is a uniform difference; float32 rescaling leaves a few ulps per pixel.
    assert float(diff_row[:, 6:12].min()) == pytest.approx(1.0, abs=1e-5)
    assert torch.equal(grid[0, 0:6, 0:6], grid[0, 6:12, 0:6])  # same grey for the unchanged image


def test_saved_png_has_the_grid_size(tmp_path):
    path = save_comparison_grid(tmp_path / "g" / "grid.png", torch.rand(5, 3, 28, 28), torch.rand(5, 3, 28, 28))
    with Image.open(path) as image:
        assert image.size == (5 * 30 + 2, 3 * 30 + 2)


def test_callback_logs_the_grid_to_tensorboard(tmp_path):
    pl.seed_everything(0)
    callback = LPA3Callback(steps=1, logging={"images_every_n_epochs": 1, "num_images": 4})
    logger = pl.loggers.TensorBoardLogger(tmp_path, name="")
    trainer = pl.Trainer(max_epochs=2, accelerator="cpu", callbacks=[callback], logger=logger,
                         enable_progress_bar=False, enable_checkpointing=False)
    trainer.fit(TinyClassifier(), DataLoader(indexed_images(16), batch_size=8))
    assert callback.runner().last_grid is not None and tuple(callback.runner().last_grid.shape) == (3, 92, 122)
    events = EventAccumulator(str(tmp_path / "version_0"), size_guidance={"images": 0})
    events.Reload()
    tags = events.Tags()["images"]
    assert any(tag.startswith("lpa3/examples") for tag in tags)
    assert len(events.Images(tags[0])) == 2  # once per epoch


@pytest.mark.parametrize("twin_bn, expected", [(True, "twin"), (False, "batch")])
def test_the_grid_is_solved_under_the_trainings_normalisation(tmp_path, monkeypatch, twin_bn, expected):
    """The picture shows x' as training makes them: a model without twins is attacked on its batch's
    statistics in training ("batch"), and its eval-mode x' would barely move."""
    from lpa3_lightning.callback.augment_stage import Augmenter

    modes: list[tuple[str, bool]] = []
    solve = Augmenter.solve

    def recording(self, module, model, x, y, generator, bn_mode, frozen=None, graphs=True):
        modes.append((bn_mode, graphs))
        return solve(self, module, model, x, y, generator, bn_mode, frozen, graphs)

    monkeypatch.setattr(Augmenter, "solve", recording)
    pl.seed_everything(0)
    callback = LPA3Callback(steps=1, logging={"images_every_n_epochs": 1, "num_images": 4})
    trainer = pl.Trainer(max_epochs=1, accelerator="cpu", callbacks=[callback],
                         logger=pl.loggers.TensorBoardLogger(tmp_path, name=""), enable_progress_bar=False,
                         enable_checkpointing=False)
    trainer.fit(TinyClassifier(twin_bn=twin_bn), DataLoader(indexed_images(16), batch_size=8))
    grid_modes = {mode for mode, graphs in modes if not graphs}
    training_modes = {mode for mode, graphs in modes if graphs}
    assert grid_modes == training_modes == {expected}


class OwnCallback(LPA3Callback):
    """A user's subclass: its checkpoint key names this class."""


@pytest.mark.parametrize("callback_class", [LPA3Callback, OwnCallback])
def test_show_command_writes_a_png_of_the_right_size(tmp_path, capsys, callback_class):
    pl.seed_everything(0)
    module = LPA3Classifier(num_classes=2, in_channels=1)
    callback = callback_class(ratio=0.5, sigma=0.05, steps=2, seed=0, solver={"max_step": 0.7})
    trainer = pl.Trainer(max_epochs=1, limit_train_batches=1, limit_val_batches=0, accelerator="cpu", callbacks=[callback],
                         logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.fit(module, datamodule=MedMNISTDataModule("breastmnist", batch_size=8))
    ckpt = tmp_path / "m.ckpt"
    trainer.save_checkpoint(ckpt)
    main(["show", "--ckpt", str(ckpt), "--out", str(tmp_path / "show.png"), "--num", "6"])
    out = capsys.readouterr().out
    # the training callback's settings, read from the checkpoint (not the command's own defaults)
    assert "bn mode twin, sigma 0.05, 2 steps, max step 0.7 (settings from the checkpoint's LPA3Callback)" in out
    assert "LPA3Classifier; label preserved: the true label" in out and out.count("label preserved True") == 6
    with Image.open(tmp_path / "show.png") as image:
        assert image.size == (6 * 30 + 2, 3 * 30 + 2)
    main(["show", "--ckpt", str(ckpt), "--out", str(tmp_path / "capped.png"), "--num", "2", "--steps", "1",
          "--max-step", "0.5", "--bn-mode", "eval"])
    assert "bn mode eval, sigma 0.05, 1 steps, max step 0.5" in capsys.readouterr().out
    assert (tmp_path / "capped.png").is_file()
    with pytest.raises(SystemExit):
        main(["show", "--ckpt", str(ckpt), "--max-step", "0"])
    assert "--max-step" in capsys.readouterr().err


@pytest.mark.parametrize("family", ["fixmatch", "pes", "dividemix"])
def test_show_command_draws_the_other_ready_modules_checkpoints(tmp_path, capsys, family):
    from lpa3_lightning import DivideMixClassifier, FixMatchClassifier, PESClassifier
    from lpa3_lightning.data import NoisyLabelDataModule, SemiSupervisedDataModule

    pl.seed_everything(0)
    if family == "fixmatch":
        module = FixMatchClassifier(arch="small_cnn", in_channels=1, num_classes=10,
                                    fixmatch={"lpa3_loss_warmup_epochs": 0})
        data = SemiSupervisedDataModule("mnist5k", num_labels=10, batch_size=4, mu=2, steps_per_epoch=1)
    elif family == "pes":
        module = PESClassifier(arch="small_cnn", in_channels=1, num_classes=10,
                               pes={"early_epochs": 1, "refine_epochs": 0})
        data = NoisyLabelDataModule("mnist5k", noise_rate=0.5, batch_size=8)
    else:
        module = DivideMixClassifier(arch="small_cnn", in_channels=1, num_classes=10, dividemix={"warmup_epochs": 1})
        data = NoisyLabelDataModule("mnist5k", noise_rate=0.5, batch_size=8)
    callback = LPA3Callback(ratio=0.5, sigma=0.03, steps=1, seed=0)
    trainer = pl.Trainer(max_epochs=1, limit_train_batches=1, limit_val_batches=0, accelerator="cpu", callbacks=[callback],
                         logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.fit(module, datamodule=data)
    ckpt = tmp_path / f"{family}.ckpt"
    trainer.save_checkpoint(ckpt)
    main(["show", "--ckpt", str(ckpt), "--out", str(tmp_path / "show.png"), "--num", "4"])
    out = capsys.readouterr().out
    assert f"{type(module).__name__}; label preserved: the model prediction" in out
    assert "of mnist5k" in out and "sigma 0.03, 1 steps, max step auto (settings from the checkpoint's" in out
    assert out.count("label preserved True") == 4
    with Image.open(tmp_path / "show.png") as image:
        assert image.size == (4 * 30 + 2, 3 * 30 + 2)


def test_grid_logging_does_not_change_the_training_run(tmp_path):
    def run(every: int) -> dict[str, torch.Tensor]:
        pl.seed_everything(0)
        module = TinyClassifier()
        callback = LPA3Callback(steps=1, logging={"images_every_n_epochs": every, "num_images": 4})
        trainer = pl.Trainer(max_epochs=2, accelerator="cpu", callbacks=[callback], deterministic=True,
                             logger=pl.loggers.TensorBoardLogger(tmp_path, name=f"e{every}"),
                             enable_progress_bar=False, enable_checkpointing=False)
        trainer.fit(module, DataLoader(indexed_images(16), batch_size=8, shuffle=True))
        return {k: v.clone() for k, v in module.state_dict().items()}

    plain, logged = run(0), run(1)
    assert all(torch.equal(plain[k], logged[k]) for k in plain)


def test_show_command_refuses_a_missing_checkpoint(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["show", "--ckpt", str(tmp_path / "nope.ckpt")])
    assert "does not exist" in capsys.readouterr().err


class Digits(pl.LightningDataModule):
    """A user's own data module (1x28x28, 3 classes): its images are not BreastMNIST's."""

    def __init__(self, batch_size: int = 8) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.normalization = {"mean": [0.0], "std": [1.0]}

    def train_dataloader(self):
        return DataLoader(indexed_images(16), batch_size=self.hparams.batch_size)

    def test_dataloader(self):
        return DataLoader(indexed_images(16, seed=3), batch_size=self.hparams.batch_size)


class OwnModule(TinyClassifier):
    """A user's own LightningModule (the supervised mixin), configured from the command line."""

    def __init__(self, num_classes: int = 3) -> None:
        super().__init__(num_classes=num_classes)
        self.save_hyperparameters()


def _fit_from_the_command_line(tmp_path, model: list[str]) -> str:
    """``lpa3 fit`` for one step on :class:`Digits`; the checkpoint it wrote."""
    main(["fit", *model, "--data", "tests.cli.test_show.Digits", "--trainer.max_epochs=1",
          "--trainer.limit_train_batches=2", "--trainer.limit_val_batches=0", "--trainer.accelerator=cpu",
          f"--trainer.default_root_dir={tmp_path}", "--trainer.logger=false", "--trainer.enable_progress_bar=false",
          "--trainer.callbacks+=lpa3_lightning.LPA3Callback", "--trainer.callbacks.init_args.steps=1",
          "--trainer.callbacks.init_args.input_range=null"])
    (ckpt,) = tmp_path.rglob("*.ckpt")
    return str(ckpt)


@pytest.mark.parametrize("model", [["--model", "lpa3_lightning.LPA3Classifier", "--model.init_args.in_channels=1",
                                    "--model.init_args.num_classes=3"],
                                   ["--model", "tests.cli.test_show.OwnModule"]], ids=["ready_module", "own_module"])
def test_show_draws_the_checkpoints_own_data_through_its_own_module(tmp_path, capsys, model):
    """A checkpoint of ``lpa3 fit`` on the user's own data module: its images (not BreastMNIST's),
    and a module of the user's own loaded from the class path the command saved (it ended in
    load_from_checkpoint's traceback)."""
    ckpt = _fit_from_the_command_line(tmp_path, model)
    capsys.readouterr()
    main(["show", "--ckpt", ckpt, "--out", str(tmp_path / "show.png"), "--num", "4"])
    out = capsys.readouterr().out
    assert "of Digits" in out and "breastmnist" not in out.lower(), out
    assert out.count("label preserved") == 5  # the header and the four images
    with Image.open(tmp_path / "show.png") as image:
        assert image.size == (4 * 30 + 2, 3 * 30 + 2)


def test_show_refuses_a_checkpoint_whose_data_module_it_cannot_rebuild(tmp_path, capsys):
    """A fit from Python on the user's own data module saves its hyperparameters but not its class: the
    command names what is missing and the fix instead of drawing BreastMNIST through the model."""
    ckpt = _fit_from_the_command_line(tmp_path, ["--model", "lpa3_lightning.LPA3Classifier",
                                                 "--model.init_args.in_channels=1", "--model.init_args.num_classes=3"])
    checkpoint = torch.load(ckpt, weights_only=False)
    hparams = checkpoint["datamodule_hyper_parameters"]
    checkpoint["datamodule_hyper_parameters"] = {k: v for k, v in hparams.items() if not k.startswith("_")}
    assert checkpoint["datamodule_hyper_parameters"] == {"batch_size": 8}  # (what a fit from Python saves)
    torch.save(checkpoint, tmp_path / "from_python.ckpt")
    capsys.readouterr()
    with pytest.raises(SystemExit, match="no MedMNIST `flag` and no `source`.*Fix"):
        main(["show", "--ckpt", str(tmp_path / "from_python.ckpt"), "--out", str(tmp_path / "show.png")])


class TwoStreams(pl.LightningDataModule):
    """A user's semi-supervised data module: its training loader combines a labeled and an unlabeled stream."""

    def train_dataloader(self):
        from lightning.pytorch.utilities.combined_loader import CombinedLoader

        loader = DataLoader(indexed_images(8), batch_size=4)
        return CombinedLoader({"labeled": loader, "unlabeled": loader}, mode="max_size_cycle")


def test_show_names_the_fix_when_a_splits_loader_has_no_single_dataset():
    from lpa3_lightning.cli.show import _own_images

    with pytest.raises(SystemExit, match="TwoStreams.train_dataloader.*CombinedLoader.*Fix: pass --split"):
        _own_images(TwoStreams, {}, "train", 4)
