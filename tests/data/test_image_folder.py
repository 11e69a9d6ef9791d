"""ImageFolderDataModule: a folder of class sub-folders as (x, y, index) batches, with the facts LP-A3 reads."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from lpa3_lightning.data import IndexedDataset, ImageFolderDataModule


def _write(folder: Path, classes: dict[str, int], mode: str = "L", size: tuple[int, int] = (8, 8),
           seed: int = 0) -> Path:
    """``folder/<class>/<i>.png``: ``classes[name]`` images of ``mode`` each, the class in their brightness."""
    rng = np.random.default_rng(seed)
    for c, (name, count) in enumerate(classes.items()):
        (folder / name).mkdir(parents=True, exist_ok=True)
        for i in range(count):
            base = rng.integers(0, 100, size=(size[1], size[0])) + 100 * c
            if mode == "RGB":
                pixels = np.stack([base, base // 2, 255 - base], axis=-1).astype(np.uint8)
            elif mode == "I;16":
                pixels = (base * 250).astype(np.uint16)
            else:
                pixels = base.astype(np.uint8)
            Image.fromarray(pixels).save(folder / name / f"{i}.png")  # (L, RGB or I;16 by the dtype and shape)
    return folder


def _batch(data: ImageFolderDataModule, split: str = "train"):
    data.setup("fit" if split in ("train", "val") else "test")
    return next(iter(getattr(data, f"{split}_dataloader")()))


def test_grayscale_pngs_load_as_one_channel_and_rgb_as_three(tmp_path):
    """Grayscale PNGs loaded as RGB silently (the solver then perturbed three copies of one channel)."""
    gray = ImageFolderDataModule(str(_write(tmp_path / "gray", {"a": 4, "b": 4})), batch_size=4, val_fraction=0)
    x, y, index = _batch(gray)
    assert gray.in_channels == 1 and tuple(x.shape) == (4, 1, 8, 8)
    assert y.dtype == torch.long and index.dtype == torch.long
    assert gray.normalization == {"mean": [0.5], "std": [0.5]} and float(x.min()) >= -1 and float(x.max()) <= 1
    rgb = ImageFolderDataModule(str(_write(tmp_path / "rgb", {"a": 4, "b": 4}, mode="RGB")), batch_size=4,
                                val_fraction=0)
    assert rgb.in_channels == 3 and tuple(_batch(rgb)[0].shape) == (4, 3, 8, 8)
    assert rgb.normalization == {"mean": [0.5] * 3, "std": [0.5] * 3}


def test_the_channel_rule_one_only_when_every_training_image_has_one_and_channels_overrides_it(tmp_path):
    root = _write(tmp_path / "mixed", {"a": 3, "b": 3})
    _write(root, {"a": 1}, mode="RGB", seed=1)  # one colour image among grey ones: 3 channels (0.png of a replaced)
    assert ImageFolderDataModule(str(root), val_fraction=0).in_channels == 3
    forced = ImageFolderDataModule(str(root), channels=1, batch_size=6, val_fraction=0)
    assert forced.in_channels == 1 and _batch(forced)[0].shape[1] == 1
    with pytest.raises(ValueError, match="`channels` must be None.*1 or 3, got 2.*Fix"):
        ImageFolderDataModule(str(root), channels=2)


def test_sixteen_bit_grayscale_keeps_its_range(tmp_path):
    """An ``I;16`` PNG is scaled by 65535 (a conversion to 8 bits clips it at 255)."""
    root = _write(tmp_path / "deep", {"a": 2, "b": 2}, mode="I;16")
    data = ImageFolderDataModule(str(root), normalization="unit", batch_size=4, val_fraction=0)
    x, y, _ = _batch(data)
    assert data.in_channels == 1 and x.shape[1] == 1
    brightest = 250 * (100 * 1 + 99) / 65535  # (class b, the largest base value)
    assert 0 < float(x.max()) <= brightest + 1e-6 and float(x.max()) > 0.5 * brightest


def test_train_val_test_from_sub_folders_share_the_training_classes(tmp_path):
    _write(tmp_path / "train", {"cat": 3, "dog": 3, "eel": 2})
    _write(tmp_path / "val", {"cat": 1, "eel": 1}, seed=1)  # no dog: the indices stay the training set's
    _write(tmp_path / "test", {"dog": 2}, seed=2)
    data = ImageFolderDataModule(str(tmp_path), batch_size=8)
    assert data.class_names == ["cat", "dog", "eel"] and data.num_classes == 3
    data.setup("fit")
    data.setup("test")
    assert (len(data.train_dataset), len(data.val_dataset), len(data.test_dataset)) == (8, 2, 2)
    assert sorted(int(data.val_dataset[i][1]) for i in range(2)) == [0, 2]
    assert [int(data.test_dataset[i][1]) for i in range(2)] == [1, 1]
    assert isinstance(data.train_dataset, IndexedDataset) and data.num_train == 8
    _write(tmp_path / "val", {"fox": 1}, seed=3)
    with pytest.raises(ValueError, match=r"val.*fox.*not a class of .*train.*Fix"):
        ImageFolderDataModule(str(tmp_path)).setup("fit")


def test_one_folder_is_split_by_a_seeded_stratified_draw(tmp_path):
    root = _write(tmp_path / "all", {"a": 10, "b": 10})

    def positions(seed: int) -> tuple[list[int], list[int], list[int]]:
        data = ImageFolderDataModule(str(root), val_fraction=0.2, test_fraction=0.3, split_seed=seed)
        data.setup("fit")
        data.setup("test")
        return tuple(sorted(d.dataset.indices) for d in (data.train_dataset, data.val_dataset, data.test_dataset))

    train, val, test = positions(0)
    assert (len(train), len(val), len(test)) == (10, 4, 6)
    assert not set(train) & set(val) and not set(train) & set(test) and not set(val) & set(test)
    assert sum(1 for i in val if i < 10) == 2 and sum(1 for i in test if i < 10) == 3  # per class
    assert positions(0) == (train, val, test) and positions(1) != (train, val, test)
    no_test = ImageFolderDataModule(str(root))
    no_test.setup("test")
    with pytest.raises(RuntimeError, match=r"no test split.*Fix: add .*test.*test_fraction"):
        no_test.test_dataloader()


def test_a_missing_or_empty_folder_is_named_with_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match=rf"`root` {tmp_path / 'nope'} is not a folder.*Fix"):
        ImageFolderDataModule(str(tmp_path / "nope"))
    (tmp_path / "empty" / "a").mkdir(parents=True)
    (tmp_path / "empty" / "b").mkdir()
    with pytest.raises(FileNotFoundError, match=r"No images.*empty.*Fix"):
        ImageFolderDataModule(str(tmp_path / "empty")).setup("fit")


def test_images_of_several_sizes_need_image_size(tmp_path):
    root = _write(tmp_path / "sizes", {"a": 2, "b": 2})
    _write(root, {"b": 1}, size=(12, 10), seed=1)
    with pytest.raises(ValueError, match=r"8x8.*12x10.*Fix: pass image_size"):
        ImageFolderDataModule(str(root), val_fraction=0).setup("fit")
    data = ImageFolderDataModule(str(root), image_size=16, batch_size=4, val_fraction=0)
    assert tuple(_batch(data)[0].shape) == (4, 1, 16, 16)


def test_its_hyperparameters_rebuild_it_and_normalization_can_be_imagenet_or_given(tmp_path):
    root = str(_write(tmp_path / "rgb", {"a": 2, "b": 2}, mode="RGB"))
    data = ImageFolderDataModule(root, normalization="imagenet", batch_size=2)
    assert data.hparams["root"] == root and data.hparams["normalization"] == "imagenet"
    assert data.normalization["mean"] == pytest.approx([0.485, 0.456, 0.406])
    given = ImageFolderDataModule(root, normalization={"mean": [0.1] * 3, "std": [0.2] * 3})
    assert given.normalization == {"mean": [0.1] * 3, "std": [0.2] * 3}
    with pytest.raises(ValueError, match=r"`normalization`.*3 channels.*Fix"):
        ImageFolderDataModule(root, normalization={"mean": [0.1], "std": [0.2]}).normalization


def test_lpa3_fit_trains_lpa3_classifier_on_it_and_lpa3_show_draws_it_with_class_names(tmp_path, capsys):
    from lpa3_lightning.cli import main

    root = _write(tmp_path / "data" / "train", {"benign": 6, "malignant": 6}, size=(28, 28)).parent
    _write(root / "test", {"benign": 2, "malignant": 2}, size=(28, 28), seed=1)
    main(["fit", "--model", "lpa3_lightning.LPA3Classifier", "--model.init_args.in_channels=1",
          "--model.init_args.num_classes=2", "--data", "lpa3_lightning.data.ImageFolderDataModule",
          f"--data.root={root}", "--data.batch_size=4", "--trainer.max_epochs=1", "--trainer.limit_train_batches=2",
          "--trainer.accelerator=cpu", f"--trainer.default_root_dir={tmp_path / 'run'}", "--trainer.logger=false",
          "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
          "--trainer.callbacks+=lpa3_lightning.LPA3Callback", "--trainer.callbacks.init_args.steps=1"])
    (ckpt,) = (tmp_path / "run").rglob("*.ckpt")
    capsys.readouterr()
    main(["show", "--ckpt", str(ckpt), "--out", str(tmp_path / "show.png"), "--images", "per-class"])
    out = capsys.readouterr().out
    assert "of ImageFolderDataModule" in out and "(class benign)" in out and "(class malignant)" in out
