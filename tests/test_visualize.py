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
from lpa3_lightning.data import MedMNISTDataModule
from lpa3_lightning.visualize import comparison_grid, save_comparison_grid, to_unit_range
from tests.helpers import indexed_images
from tests.test_callback import TinyClassifier


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
    callback = LPA3Callback(steps=1, log_images_every_n_epochs=1, num_logged_images=4)
    logger = pl.loggers.TensorBoardLogger(tmp_path, name="")
    trainer = pl.Trainer(max_epochs=2, accelerator="cpu", callbacks=[callback], logger=logger,
                         enable_progress_bar=False, enable_checkpointing=False)
    trainer.fit(TinyClassifier(), DataLoader(indexed_images(16), batch_size=8))
    assert callback.last_grid is not None and tuple(callback.last_grid.shape) == (3, 92, 122)
    events = EventAccumulator(str(tmp_path / "version_0"), size_guidance={"images": 0})
    events.Reload()
    tags = events.Tags()["images"]
    assert any(tag.startswith("lpa3/examples") for tag in tags)
    assert len(events.Images(tags[0])) == 2  # once per epoch


def test_show_command_writes_a_png_of_the_right_size(tmp_path, capsys):
    pl.seed_everything(0)
    module = LPA3Classifier(num_classes=2, in_channels=1)
    trainer = pl.Trainer(max_epochs=1, limit_train_batches=1, limit_val_batches=0, accelerator="cpu",
                         logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.fit(module, datamodule=MedMNISTDataModule("breastmnist", batch_size=8))
    ckpt = tmp_path / "m.ckpt"
    trainer.save_checkpoint(ckpt)
    main(["show", "--ckpt", str(ckpt), "--out", str(tmp_path / "show.png"), "--num", "6", "--steps", "2"])
    out = capsys.readouterr().out
    assert "wrote" in out and "bn mode eval" in out and out.count("label preserved") == 6
    with Image.open(tmp_path / "show.png") as image:
        assert image.size == (6 * 30 + 2, 3 * 30 + 2)
    main(["show", "--ckpt", str(ckpt), "--out", str(tmp_path / "capped.png"), "--num", "2", "--steps", "1",
          "--max-step", "0.5"])
    assert "max step 0.5" in capsys.readouterr().out and (tmp_path / "capped.png").is_file()
    with pytest.raises(SystemExit):
        main(["show", "--ckpt", str(ckpt), "--max-step", "0"])
    assert "--max-step" in capsys.readouterr().err


def test_grid_logging_does_not_change_the_training_run(tmp_path):
    def run(every: int) -> dict[str, torch.Tensor]:
        pl.seed_everything(0)
        module = TinyClassifier()
        callback = LPA3Callback(steps=1, log_images_every_n_epochs=every, num_logged_images=4)
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
