"""The semi-supervised (FixMatch) data module on MNIST-5k: arguments, the split file, batches, checkpoints."""

from __future__ import annotations

import lightning.pytorch as pl
import numpy as np
import pytest
import torch

from lpa3_lightning.data import SemiSupervisedDataModule, load_label_split, save_label_split


@pytest.fixture(scope="module")
def mnist_dm() -> SemiSupervisedDataModule:
    dm = SemiSupervisedDataModule("mnist5k", num_labels=40, seed=0, batch_size=4, mu=7, steps_per_epoch=2,
                                  eval_batch_size=100)
    dm.setup()
    return dm


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
