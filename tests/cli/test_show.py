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
from tests.callback.test_lpa3_callback import TinyClassifier
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


def _logged_grids(tmp_path, monkeypatch, warmup_epochs: int) -> tuple[LPA3Callback, list, list[dict]]:
    """A two-epoch fit logging the grid every epoch: the callback, the TensorBoard images (their tag's
    events) and the arguments each grid was drawn with."""
    import lpa3_lightning.callback.logging as logging_stage

    drawn: list[dict] = []
    draw = logging_stage.comparison_grid

    def recording(*args, **kwargs):
        drawn.append(kwargs)
        return draw(*args, **kwargs)

    monkeypatch.setattr(logging_stage, "comparison_grid", recording)
    pl.seed_everything(0)
    callback = LPA3Callback(steps=1, warmup_epochs=warmup_epochs, logging={"images_every_n_epochs": 1, "num_images": 4})
    logger = pl.loggers.TensorBoardLogger(tmp_path, name="")
    trainer = pl.Trainer(max_epochs=2, accelerator="cpu", callbacks=[callback], logger=logger,
                         enable_progress_bar=False, enable_checkpointing=False)
    trainer.fit(TinyClassifier(), DataLoader(indexed_images(16), batch_size=8))
    events = EventAccumulator(str(tmp_path / "version_0"), size_guidance={"images": 0})
    events.Reload()
    tags = [tag for tag in events.Tags()["images"] if tag.startswith("lpa3/examples")]
    return callback, [image for tag in tags for image in events.Images(tag)], drawn


def test_callback_logs_the_grid_to_tensorboard_with_its_scale_and_distances(tmp_path, monkeypatch):
    callback, images, drawn = _logged_grids(tmp_path, monkeypatch, warmup_epochs=0)
    grid = callback.runner().last_grid
    assert grid is not None and grid.shape[2] == 122 and grid.shape[1] > 92  # the rows, then the text under them
    assert len(images) == 2  # once per epoch
    assert all(len(kwargs["labels"]) == 4 and "white = " in kwargs["caption"] for kwargs in drawn)


def test_the_grid_is_not_logged_before_the_first_epoch_that_trains_x_prime(tmp_path, monkeypatch):
    """In the warm-up no x' was trained: a grid there showed a solve no training step made."""
    _, images, drawn = _logged_grids(tmp_path, monkeypatch, warmup_epochs=1)
    assert len(images) == 1 and images[0].step == 4  # the end of epoch 1 (two steps an epoch)
    assert "epoch 1" in drawn[0]["caption"]


@pytest.mark.parametrize("twin_bn, expected", [(True, "twin"), (False, "batch")])
def test_the_grid_is_solved_under_the_trainings_normalisation(tmp_path, monkeypatch, twin_bn, expected):
    """The picture shows x' as training makes them: a model without twins is attacked on its batch's
    statistics in training ("batch"), and its eval-mode x' would barely move."""
    import lpa3_lightning.callback.hard_positives as hard_positives
    import lpa3_lightning.core.solver as solver

    modes: list[tuple[str, str]] = []  # (bn_mode, who solved: the training step or the grid)
    train_solve, grid_attack = hard_positives.solve, solver.lpa3_attack

    def training(*args, bn_mode, **kwargs):
        modes.append((bn_mode, "training"))
        return train_solve(*args, bn_mode=bn_mode, **kwargs)

    def grid(*args, bn_mode, **kwargs):
        modes.append((bn_mode, "grid"))
        return grid_attack(*args, bn_mode=bn_mode, **kwargs)

    monkeypatch.setattr(hard_positives, "solve", training)
    monkeypatch.setattr(solver, "lpa3_attack", grid)
    pl.seed_everything(0)
    callback = LPA3Callback(steps=1, logging={"images_every_n_epochs": 1, "num_images": 4})
    trainer = pl.Trainer(max_epochs=1, accelerator="cpu", callbacks=[callback],
                         logger=pl.loggers.TensorBoardLogger(tmp_path, name=""), enable_progress_bar=False,
                         enable_checkpointing=False)
    trainer.fit(TinyClassifier(twin_bn=twin_bn), DataLoader(indexed_images(16), batch_size=8))
    grid_modes = {mode for mode, who in modes if who == "grid"}
    training_modes = {mode for mode, who in modes if who == "training"}
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
    main(["show", "--ckpt", str(ckpt), "--out", str(tmp_path / "show.png"), "--num", "6", "--scale", "1",
          "--no-labels"])
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
    main(["show", "--ckpt", str(ckpt), "--out", str(tmp_path / "show.png"), "--num", "4", "--scale", "1",
          "--no-labels"])
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
    main(["show", "--ckpt", ckpt, "--out", str(tmp_path / "show.png"), "--num", "4", "--scale", "1", "--no-labels"])
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
    from lpa3_lightning.cli.show import _own_split

    with pytest.raises(SystemExit, match="TwoStreams.train_dataloader.*CombinedLoader.*Fix: pass --split"):
        _own_split(TwoStreams, {}, "train")


class Colours(pl.LightningDataModule):
    """A user's RGB data module (3x28x28, 3 named classes) with what ``lpa3 show`` reads."""

    def __init__(self, batch_size: int = 4) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.normalization = {"mean": [0.5] * 3, "std": [0.5] * 3}
        self.num_classes, self.in_channels, self.class_names = 3, 3, ["red", "green", "blue"]

    def _data(self, seed: int):
        data = indexed_images(12, seed=seed)
        return [(x.repeat(3, 1, 1).clamp(-1, 1), y, i) for x, y, i in (data[i] for i in range(len(data)))]

    def train_dataloader(self):
        return DataLoader(self._data(0), batch_size=self.hparams.batch_size)

    def test_dataloader(self):
        return DataLoader(self._data(3), batch_size=self.hparams.batch_size)


def _fit_resnet18(tmp_path) -> str:
    """``lpa3 fit`` of LPA3Classifier with ``model: {class_path: torchvision.models.resnet18}``: its checkpoint."""
    main(["fit", "--model", "lpa3_lightning.LPA3Classifier", "--model.init_args.in_channels=3",
          "--model.init_args.num_classes=3", "--model.init_args.model", "torchvision.models.resnet18",
          "--model.init_args.model.init_args.num_classes=3", "--data", "tests.cli.test_show.Colours",
          "--trainer.max_epochs=1", "--trainer.limit_train_batches=2", "--trainer.limit_val_batches=0",
          "--trainer.accelerator=cpu", f"--trainer.default_root_dir={tmp_path}", "--trainer.logger=false",
          "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
          "--trainer.callbacks+=lpa3_lightning.LPA3Callback", "--trainer.callbacks.init_args.steps=1"])
    (ckpt,) = tmp_path.rglob("*.ckpt")
    return str(ckpt)


def test_show_draws_a_network_given_through_model_in_lpa3_fit(tmp_path, capsys):
    """``model: {class_path: torchvision.models.resnet18}``: the command rebuilt the package's ResNet and
    stopped at a size mismatch ("It may be a checkpoint of another module")."""
    ckpt = _fit_resnet18(tmp_path)
    capsys.readouterr()
    main(["show", "--ckpt", ckpt, "--out", str(tmp_path / "show.png"), "--num", "3"])
    out = capsys.readouterr().out
    assert "of Colours" in out and out.count("label preserved") == 4
    assert "(class red)" in out or "(class green)" in out or "(class blue)" in out  # the data module's names


def test_show_rebuilds_an_older_checkpoints_network_from_the_runs_config_yaml(tmp_path, capsys):
    """A checkpoint written before the network was kept in it: the run's config.yaml (LightningCLI's) names it."""
    from lpa3_lightning.modules.classifier import NETWORK_RECORD

    ckpt = _fit_resnet18(tmp_path)
    checkpoint = torch.load(ckpt, weights_only=False)
    del checkpoint["hyper_parameters"]["model"], checkpoint[NETWORK_RECORD]
    older = tmp_path / "checkpoints" / "older.ckpt"
    torch.save(checkpoint, older)
    assert (older.parent.parent / "config.yaml").is_file()
    capsys.readouterr()
    main(["show", "--ckpt", str(older), "--out", str(tmp_path / "show.png"), "--num", "2"])
    out = capsys.readouterr().out
    assert f"network: torchvision.models.resnet18 from {older.parent.parent / 'config.yaml'}" in out


def test_show_names_the_fix_for_a_network_given_as_an_object(tmp_path, capsys):
    from tests.modules.test_ready import Net

    pl.seed_everything(0)
    module = LPA3Classifier(num_classes=2, in_channels=1, model=Net(1, 2, 4))
    trainer = pl.Trainer(max_epochs=1, limit_train_batches=1, limit_val_batches=0, accelerator="cpu", logger=False,
                         callbacks=[LPA3Callback(steps=1)], enable_checkpointing=False, enable_progress_bar=False)
    trainer.fit(module, datamodule=MedMNISTDataModule("breastmnist", batch_size=8))
    trainer.save_checkpoint(tmp_path / "m.ckpt")
    with pytest.raises(SystemExit):
        main(["show", "--ckpt", str(tmp_path / "m.ckpt"), "--out", str(tmp_path / "show.png")])
    err = " ".join(capsys.readouterr().err.split())
    assert "test_ready.Net, was given to LPA3Classifier as an object" in err
    assert "Fix for lpa3 show: train with `model` given as a class-path config" in err


@pytest.fixture(scope="module")
def breastmnist_ckpt(tmp_path_factory):
    pl.seed_everything(0)
    tmp_path = tmp_path_factory.mktemp("breast")
    module = LPA3Classifier(num_classes=2, in_channels=1)
    trainer = pl.Trainer(max_epochs=1, limit_train_batches=1, limit_val_batches=0, accelerator="cpu", logger=False,
                         callbacks=[LPA3Callback(steps=1)], enable_checkpointing=False, enable_progress_bar=False)
    trainer.fit(module, datamodule=MedMNISTDataModule("breastmnist", batch_size=8))
    trainer.save_checkpoint(tmp_path / "m.ckpt")
    return str(tmp_path / "m.ckpt")


def _shown(capsys, ckpt: str, out, *flags: str) -> tuple[list[str], str]:
    capsys.readouterr()
    main(["show", "--ckpt", ckpt, "--out", str(out), "--steps", "1", *flags])
    text = capsys.readouterr().out
    return [line for line in text.splitlines() if line.startswith("  image ")], text


def test_show_picks_the_images_by_index_at_random_or_one_per_class(tmp_path, capsys, breastmnist_ckpt):
    """It always drew the first eight test images (an image folder sorted by class gives eight of one class)."""
    lines, _ = _shown(capsys, breastmnist_ckpt, tmp_path / "a.png", "--indices", "3", "17", "42")
    assert [line.split("(index ")[1].split(")")[0] for line in lines] == ["3", "17", "42"]
    lines, _ = _shown(capsys, breastmnist_ckpt, tmp_path / "b.png", "--images", "per-class")
    assert len(lines) == 2 and "label 0 (class malignant)" in lines[0] and "label 1 (class normal, benign)" in lines[1]
    first, _ = _shown(capsys, breastmnist_ckpt, tmp_path / "c.png", "--num", "4")
    drawn, _ = _shown(capsys, breastmnist_ckpt, tmp_path / "d.png", "--num", "4", "--images", "random",
                      "--sample-seed", "1")
    again, _ = _shown(capsys, breastmnist_ckpt, tmp_path / "e.png", "--num", "4", "--images", "random",
                      "--sample-seed", "1")
    assert drawn == again and drawn != first
    with pytest.raises(SystemExit):
        main(["show", "--ckpt", breastmnist_ckpt, "--indices", "156"])
    assert "--indices 156" in capsys.readouterr().err


def test_show_scales_the_picture_and_writes_the_distances_and_the_difference_scale(tmp_path, capsys,
                                                                                   breastmnist_ckpt):
    """242 x 92 px with no scale option, no distances in the picture, each difference stretched on its own."""
    _, text = _shown(capsys, breastmnist_ckpt, tmp_path / "plain.png", "--num", "2", "--scale", "3", "--no-labels")
    with Image.open(tmp_path / "plain.png") as image:
        assert image.size == (3 * (2 * 30 + 2), 3 * 92)
    assert "|x' - x| on one scale for all images, white = " in text
    _, text = _shown(capsys, breastmnist_ckpt, tmp_path / "auto.png", "--num", "2")
    with Image.open(tmp_path / "auto.png") as image:  # auto: 28 px images drawn 4x, the text under them
        assert image.size[0] == 4 * (2 * 30 + 2) and image.size[1] > 4 * 92
    assert "perceptual distance" in text and "||x' - x||" in text
