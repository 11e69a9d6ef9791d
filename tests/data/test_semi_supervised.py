"""Semi-supervised (FixMatch) data: label split, its file, transforms, the data module on MNIST-5k."""

from __future__ import annotations

import hashlib
import json

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from PIL import Image

from lpa3_lightning.data import (
    EMBEDDED_DATA_DIR,
    Cutout,
    LabeledDataset,
    SemiSupervisedDataModule,
    UnlabeledDataset,
    load_label_split,
    load_mnist5k,
    save_label_split,
    stratified_label_split,
    strong_transform,
    weak_transform,
)

MNIST5K_MD5 = "11def57eb666ead6d8efa9a9ff9c2218"


@pytest.fixture(scope="module")
def mnist_dm() -> SemiSupervisedDataModule:
    dm = SemiSupervisedDataModule("mnist5k", num_labels=40, seed=0, batch_size=4, mu=7, steps_per_epoch=2,
                                  eval_batch_size=100)
    dm.setup()
    return dm


# ----------------------------------------------------------------------------------------
# Embedded file and its split
# ----------------------------------------------------------------------------------------
def test_embedded_mnist5k_file_license_and_fixed_split():
    path = EMBEDDED_DATA_DIR / "mnist5k.npz"
    assert hashlib.md5(path.read_bytes()).hexdigest() == MNIST5K_MD5
    assert "CC BY-SA 3.0" in (EMBEDDED_DATA_DIR / "LICENSE-mnist").read_text()
    assert "mnist5k.npz" in (EMBEDDED_DATA_DIR / "README.md").read_text()
    data = load_mnist5k()
    assert data["train_images"].shape == (4000, 28, 28) and data["test_images"].shape == (1000, 28, 28)
    assert np.bincount(data["test_labels"]).tolist() == [100] * 10
    assert np.bincount(data["train_labels"]).tolist() == [400] * 10
    assert not np.intersect1d(data["train_file_indices"], data["test_file_indices"]).size
    np.testing.assert_array_equal(load_mnist5k()["test_file_indices"], data["test_file_indices"])  # fixed


def test_missing_mnist5k_names_path_and_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="mnist5k.npz") as info:
        SemiSupervisedDataModule("mnist5k", root=str(tmp_path)).setup("fit")
    assert str(tmp_path) in str(info.value) and "root=None" in str(info.value)


# ----------------------------------------------------------------------------------------
# stratified_label_split
# ----------------------------------------------------------------------------------------
def test_split_is_equal_per_class_sorted_and_seeded():
    labels = np.repeat(np.arange(10), 50)[np.random.default_rng(3).permutation(500)]
    idx = stratified_label_split(labels, 40, 10, seed=0)
    assert idx.dtype == np.int64 and len(idx) == 40 and len(np.unique(idx)) == 40
    assert np.all(np.diff(idx) > 0)
    assert np.bincount(labels[idx], minlength=10).tolist() == [4] * 10
    np.testing.assert_array_equal(idx, stratified_label_split(torch.from_numpy(labels), 40, 10, seed=0))
    assert not np.array_equal(idx, stratified_label_split(labels, 40, 10, seed=1))


@pytest.mark.parametrize("num_labels, fix", [(5, "num_labels=10"), (25, "num_labels=20 or 30"), (0, "num_labels")])
def test_split_refuses_fewer_labels_than_classes_or_a_non_multiple(num_labels, fix):
    with pytest.raises(ValueError, match="num_labels") as info:
        stratified_label_split(np.repeat(np.arange(10), 5), num_labels, 10, seed=0)
    assert fix in str(info.value) and "Fix" in str(info.value)


def test_split_refuses_a_class_with_too_few_samples():
    labels = np.array([0] * 10 + [1] * 2)
    with pytest.raises(ValueError, match="class 1 has only 2.*num_labels <= 4"):
        stratified_label_split(labels, 6, 2, seed=0)


def test_datamodule_refuses_bad_arguments_with_the_fix():
    with pytest.raises(ValueError, match="num_labels=10 or 20"):
        SemiSupervisedDataModule("mnist5k", num_labels=15)
    with pytest.raises(ValueError, match="Unknown `source`"):
        SemiSupervisedDataModule("mnist")
    with pytest.raises(ValueError, match="`mu`"):
        SemiSupervisedDataModule("mnist5k", mu=0)
    with pytest.raises(ValueError, match="root"):
        SemiSupervisedDataModule("cifar10")
    with pytest.raises(ValueError, match="lower `mu` or `batch_size`"):
        SemiSupervisedDataModule("mnist5k", batch_size=1000).setup("fit")


# ----------------------------------------------------------------------------------------
# Split file
# ----------------------------------------------------------------------------------------
def test_split_file_is_written_then_read_and_another_source_is_refused(tmp_path):
    path = tmp_path / "splits" / "mnist5k_40.json"
    first = SemiSupervisedDataModule("mnist5k", num_labels=40, seed=5, split_file=str(path), batch_size=4)
    first.setup("fit")
    assert path.is_file()
    indices, meta = load_label_split(path)
    np.testing.assert_array_equal(indices, first.labeled_indices)
    assert meta == {"source": "mnist5k", "num_labels": 40, "seed": 5, "dataset_size": 4000, "num_classes": 10}

    # Another seed, same file: the file wins (reproducible from the file), with a warning (a seed
    # sweep that keeps one path would train every seed on the same labels)
    again = SemiSupervisedDataModule("mnist5k", num_labels=40, seed=6, split_file=str(path), batch_size=4)
    with pytest.warns(UserWarning, match="holds the labeled subset of seed 5, not of seed=6"):
        again.setup("fit")
    np.testing.assert_array_equal(again.labeled_indices, first.labeled_indices)

    other = tmp_path / "other.json"
    save_label_split(other, indices, {**meta, "source": "cifar10", "dataset_size": 50000})
    with pytest.raises(ValueError, match="source='cifar10'") as info:
        SemiSupervisedDataModule("mnist5k", num_labels=40, split_file=str(other), batch_size=4).setup("fit")
    assert str(other) in str(info.value) and "Fix" in str(info.value)
    with pytest.raises(ValueError, match="dataset_size=50000"):
        load_label_split(other, {"dataset_size": 4000})


def test_a_damaged_split_file_is_refused_with_its_path(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"indices": [1, 2]}))
    with pytest.raises(ValueError, match="not a label split file") as info:
        load_label_split(path)
    assert str(path) in str(info.value)


# ----------------------------------------------------------------------------------------
# Transforms and data sets
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode, channels, side", [("L", 1, 28), ("RGB", 3, 32)])
def test_weak_and_strong_views_for_gray_and_rgb(mode, channels, side):
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    shape = (side, side) if channels == 1 else (side, side, channels)
    img = Image.fromarray(rng.integers(0, 256, size=shape, dtype=np.uint8))
    norm = ([0.5] * channels, [0.5] * channels)
    weak, strong = weak_transform(*norm, side), strong_transform(*norm, side)
    assert weak(img).shape == strong(img).shape == (channels, side, side)
    assert not torch.equal(weak(img), strong(img))


def test_cutout_paints_one_gray_square_of_at_most_half_the_side():
    torch.manual_seed(0)
    for _ in range(20):
        out = np.array(Cutout(0.5, fill=127)(Image.new("L", (28, 28), color=0)))
        rows, cols = np.nonzero(out == 127)
        if rows.size:
            assert rows.max() - rows.min() < 14 and cols.max() - cols.min() < 14
            assert rows.size == (rows.max() - rows.min() + 1) * (cols.max() - cols.min() + 1)


def test_labeled_and_unlabeled_datasets_return_whole_set_indices():
    base = [(Image.new("L", (28, 28), color=k), k % 3) for k in range(9)]
    norm = ([0.5], [0.5])
    labeled = LabeledDataset(base, [2, 7], weak_transform(*norm, 28, flip=False))
    x, y, i = labeled[1]
    assert x.shape == (1, 28, 28) and y.dtype == torch.long and int(y) == 1 and i == 7
    xw, xs, j = UnlabeledDataset(base, weak_transform(*norm, 28), strong_transform(*norm, 28))[4]
    assert xw.shape == xs.shape == (1, 28, 28) and j == 4
    with pytest.raises(ValueError, match="indices"):
        LabeledDataset(base, [9], None)


# ----------------------------------------------------------------------------------------
# Data module
# ----------------------------------------------------------------------------------------
def test_properties_before_setup():
    dm = SemiSupervisedDataModule("mnist5k")
    assert (dm.num_classes, dm.in_channels, dm.num_unlabeled, dm.flip) == (10, 1, 4000, False)
    assert dm.normalization == {"mean": [0.1313], "std": [0.3086]}
    assert dm.num_steps_per_epoch == 9  # ceil(4000 / (7 * 64))
    assert dm.hparams["num_labels"] == 40 and dm.hparams["mu"] == 7
    with pytest.raises(RuntimeError, match="setup"):
        dm.labeled_indices
    cifar = SemiSupervisedDataModule("cifar100", root="/nonexistent", num_labels=400)
    assert (cifar.num_classes, cifar.in_channels, cifar.num_unlabeled, cifar.flip) == (100, 3, 50000, True)
    assert SemiSupervisedDataModule("organamnist", num_labels=11).flip is False  # "kidney-left" vs "-right"


def test_train_loader_yields_the_documented_dict(mnist_dm):
    dm = mnist_dm
    assert len(dm.labeled_indices) == 40
    labels = dm.train_base.labels
    assert np.bincount(labels[dm.labeled_indices]).tolist() == [4] * 10
    loader = dm.train_dataloader()
    batches = [batch for batch, _, _ in loader]
    assert len(batches) == 2
    for batch in batches:
        assert set(batch) == {"labeled", "unlabeled"}
        x, y, idx = batch["labeled"]
        assert x.shape == (4, 1, 28, 28) and y.shape == idx.shape == (4,)
        assert y.dtype == idx.dtype == torch.long
        assert set(idx.tolist()) <= set(dm.labeled_indices.tolist())
        assert torch.equal(y, torch.from_numpy(labels[idx.numpy()]))
        xw, xs, uidx = batch["unlabeled"]
        assert xw.shape == xs.shape == (28, 1, 28, 28) and uidx.shape == (28,)
        assert 0 <= int(uidx.min()) and int(uidx.max()) < dm.num_unlabeled
        assert len(set(uidx.tolist())) == 28
        assert not torch.equal(xw, xs)


def test_val_and_test_are_the_fixed_test_split(mnist_dm):
    x, y, idx = next(iter(mnist_dm.val_dataloader()))
    assert x.shape == (100, 1, 28, 28) and torch.equal(idx, torch.arange(100))
    xt, yt, _ = next(iter(mnist_dm.test_dataloader()))
    assert torch.equal(x, xt) and torch.equal(y, yt)  # no validation split: val = test, documented
    assert len(mnist_dm.test_dataset) == 1000


def test_missing_cifar_file_offline_names_the_path(tmp_path):
    dm = SemiSupervisedDataModule("cifar10", root=str(tmp_path), num_labels=40)
    with pytest.raises(FileNotFoundError) as info:
        dm.setup("fit")
    message = str(info.value)
    assert str(tmp_path / "cifar-10-batches-py" / "data_batch_1") in message
    assert "download=True" in message and "cifar-10-python.tar.gz" in message


def test_state_dict_round_trip_adopts_the_checkpoint_split(mnist_dm):
    state = mnist_dm.state_dict()
    assert state["labeled_indices"] == mnist_dm.labeled_indices.tolist() and state["source"] == "mnist5k"

    other = SemiSupervisedDataModule("mnist5k", num_labels=40, seed=1, batch_size=4)
    other.setup("fit")
    assert not np.array_equal(other.labeled_indices, mnist_dm.labeled_indices)
    with pytest.warns(UserWarning, match="adopting"):
        other.load_state_dict(state)
    np.testing.assert_array_equal(other.labeled_indices, mnist_dm.labeled_indices)
    np.testing.assert_array_equal(other.labeled_dataset.indices, mnist_dm.labeled_indices)

    early = SemiSupervisedDataModule("mnist5k", num_labels=40, seed=2, batch_size=4)
    early.load_state_dict(state)  # before setup: applied by setup
    early.setup("fit")
    np.testing.assert_array_equal(early.labeled_indices, mnist_dm.labeled_indices)

    with pytest.raises(ValueError, match="num_labels=40"):
        SemiSupervisedDataModule("mnist5k", num_labels=20).load_state_dict(state)
    with pytest.raises(ValueError, match="source='mnist5k'"):
        SemiSupervisedDataModule("breastmnist", num_labels=40).load_state_dict(state)


class _TinyFixMatch(pl.LightningModule):
    """Consumes the combined batch; just enough to write and resume a checkpoint."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(28 * 28, 10)

    def training_step(self, batch, batch_idx):
        x, y, _ = batch["labeled"]
        xw, xs, _ = batch["unlabeled"]
        loss = torch.nn.functional.cross_entropy(self.net(x.flatten(1)), y)
        return loss + 0.0 * self.net(xs.flatten(1)).sum() + 0.0 * self.net(xw.flatten(1)).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_trainer_checkpoint_carries_hparams_and_the_split(tmp_path):
    kwargs = {"logger": False, "enable_progress_bar": False, "enable_model_summary": False, "accelerator": "cpu",
              "default_root_dir": str(tmp_path), "limit_val_batches": 0}
    dm = SemiSupervisedDataModule("mnist5k", num_labels=20, seed=3, batch_size=2, mu=2, steps_per_epoch=2)
    trainer = pl.Trainer(max_epochs=1, **kwargs)
    trainer.fit(_TinyFixMatch(), datamodule=dm)
    assert trainer.global_step == 2
    ckpt = tmp_path / "last.ckpt"
    trainer.save_checkpoint(ckpt)
    saved = torch.load(ckpt, weights_only=False)
    assert saved["datamodule_hyper_parameters"]["seed"] == 3
    assert saved["SemiSupervisedDataModule"]["labeled_indices"] == dm.labeled_indices.tolist()

    resumed = SemiSupervisedDataModule("mnist5k", num_labels=20, seed=4, batch_size=2, mu=2, steps_per_epoch=2)
    with pytest.warns(UserWarning, match="adopting"):
        pl.Trainer(max_epochs=2, **kwargs).fit(_TinyFixMatch(), datamodule=resumed, ckpt_path=str(ckpt))
    np.testing.assert_array_equal(resumed.labeled_indices, dm.labeled_indices)
