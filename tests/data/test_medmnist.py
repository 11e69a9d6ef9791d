"""Tests for MedMNISTDataModule on the embedded BreastMNIST file (and, when the
shared data folder is present, PneumoniaMNIST)."""

from __future__ import annotations

import hashlib
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from lpa3_lightning.data import EMBEDDED_DATA_DIR, IndexedDataset, MedMNISTDataModule

BREAST_MD5 = "750601b1f35ba3300ea97c75c52ff8f6"
BREAST_SIZES = {"train": 546, "val": 78, "test": 156}

# In CI the repository is a clean clone with the shared data next to it
# (<repo>/../shared); locally that is /work/shared.
SHARED_MEDMNIST = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "medmnist"


@pytest.fixture(scope="module")
def breast_raw() -> dict[str, np.ndarray]:
    with np.load(EMBEDDED_DATA_DIR / "breastmnist.npz") as data:
        return {key: data[key] for key in data.files}


@pytest.fixture(scope="module")
def breast_dm() -> MedMNISTDataModule:
    dm = MedMNISTDataModule("breastmnist", batch_size=64, eval_batch_size=50)
    dm.setup("fit")
    dm.setup("test")
    return dm


def _expected_tensor(images: np.ndarray) -> torch.Tensor:
    """Benchmark preprocessing written out by hand: (uint8/255 - 0.5) / 0.5."""
    return (torch.from_numpy(images).float().div(255.0).sub(0.5).div(0.5)).unsqueeze(1)


# ----------------------------------------------------------------------------
# Embedded file
# ----------------------------------------------------------------------------
def test_embedded_file_is_the_official_one():
    path = EMBEDDED_DATA_DIR / "breastmnist.npz"
    assert path.is_file()
    assert hashlib.md5(path.read_bytes()).hexdigest() == BREAST_MD5
    assert (EMBEDDED_DATA_DIR / "README.md").is_file()
    assert "CC BY 4.0" in (EMBEDDED_DATA_DIR / "README.md").read_text()


# ----------------------------------------------------------------------------
# Properties before setup
# ----------------------------------------------------------------------------
def test_properties_before_setup_need_no_file(tmp_path):
    # root points at an empty folder: properties must come from INFO only.
    dm = MedMNISTDataModule("breastmnist", root=str(tmp_path))
    assert dm.num_classes == 2
    assert dm.in_channels == 1
    assert dm.normalization == {"mean": [0.5], "std": [0.5]}
    assert dm.num_train_samples == 546
    assert dm.train_dataset is None and dm.val_dataset is None and dm.test_dataset is None


def test_properties_for_colour_and_multiclass_flags():
    dm = MedMNISTDataModule("bloodmnist")
    assert dm.num_classes == 8
    assert dm.in_channels == 3
    assert dm.normalization == {"mean": [0.5] * 3, "std": [0.5] * 3}
    assert dm.num_train_samples == 11959
    # Ordinal regression is accepted and treated as multi-class.
    assert MedMNISTDataModule("retinamnist").num_classes == 5


def test_hyperparameters_are_saved():
    dm = MedMNISTDataModule("breastmnist", batch_size=32, randaugment=True)
    assert dm.hparams.flag == "breastmnist"
    assert dm.hparams.batch_size == 32
    assert dm.hparams.randaugment is True
    assert dm.eval_batch_size == 32  # defaults to batch_size


# ----------------------------------------------------------------------------
# Loading the embedded BreastMNIST
# ----------------------------------------------------------------------------
def test_split_sizes(breast_dm):
    assert len(breast_dm.train_dataset) == BREAST_SIZES["train"]
    assert len(breast_dm.val_dataset) == BREAST_SIZES["val"]
    assert len(breast_dm.test_dataset) == BREAST_SIZES["test"]
    assert isinstance(breast_dm.train_dataset, IndexedDataset)
    assert breast_dm.num_train_samples == len(breast_dm.train_dataset)


def test_setup_fit_does_not_build_test_split():
    dm = MedMNISTDataModule()
    dm.setup("fit")
    assert dm.train_dataset is not None and dm.val_dataset is not None
    assert dm.test_dataset is None
    with pytest.raises(RuntimeError, match="setup"):
        dm.test_dataloader()


@pytest.mark.parametrize(
    ("split", "loader_name", "batch_size"),
    [("val", "val_dataloader", 50), ("test", "test_dataloader", 50)],
)
def test_eval_loaders_are_ordered_and_exact(breast_dm, breast_raw, split, loader_name, batch_size):
    loader = getattr(breast_dm, loader_name)()
    xs, ys, idxs = [], [], []
    for x, y, idx in loader:
        assert x.shape[1:] == (1, 28, 28) and x.shape[0] <= batch_size
        assert x.dtype == torch.float32
        assert y.dtype == torch.long and idx.dtype == torch.long
        xs.append(x), ys.append(y), idxs.append(idx)
    x, y, idx = torch.cat(xs), torch.cat(ys), torch.cat(idxs)
    n = BREAST_SIZES[split]
    # Not shuffled, nothing dropped: indices are exactly the dataset positions.
    assert idx.tolist() == list(range(n))
    assert torch.allclose(x, _expected_tensor(breast_raw[f"{split}_images"]), atol=1e-6)
    assert y.tolist() == breast_raw[f"{split}_labels"].ravel().tolist()
    assert set(y.tolist()) == {0, 1}
    assert x.min() >= -1.0 and x.max() <= 1.0


def test_train_loader_shuffles_and_indices_point_at_samples(breast_dm, breast_raw):
    torch.manual_seed(0)
    batches = list(breast_dm.train_dataloader())
    # 546 = 8 * 64 + 34: the last partial batch is kept (drop_last=False).
    assert [b[0].shape[0] for b in batches] == [64] * 8 + [34]
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    idx = torch.cat([b[2] for b in batches])
    assert x.shape == (546, 1, 28, 28) and x.dtype == torch.float32
    assert y.dtype == torch.long and idx.dtype == torch.long
    assert sorted(idx.tolist()) == list(range(546))
    assert idx.tolist() != list(range(546)), "training loader should shuffle"
    # Each row is the sample its index names (no augmentation here).
    order = idx.numpy()
    assert torch.allclose(x, _expected_tensor(breast_raw["train_images"][order]), atol=1e-6)
    assert y.tolist() == breast_raw["train_labels"].ravel()[order].tolist()
    assert x.min() >= -1.0 and x.max() <= 1.0
    assert set(y.tolist()) == {0, 1}


def test_single_item_layout(breast_dm):
    x, y, i = breast_dm.train_dataset[5]
    assert x.shape == (1, 28, 28)
    assert y.shape == () and y.dtype == torch.long
    assert type(i) is int and i == 5


def test_datasets_pickle_for_worker_processes(breast_dm):
    # Spawned workers (macOS/Windows default) pickle the dataset and transforms.
    clone = pickle.loads(pickle.dumps(breast_dm.train_dataset))
    assert torch.equal(clone[3][0], breast_dm.train_dataset[3][0])


# ----------------------------------------------------------------------------
# RandAugment
# ----------------------------------------------------------------------------
def test_randaugment_changes_train_images_but_not_val():
    plain = MedMNISTDataModule(randaugment=False)
    augmented = MedMNISTDataModule(randaugment=True, randaugment_num_ops=3, randaugment_magnitude=9)
    plain.setup("fit")
    augmented.setup("fit")
    torch.manual_seed(0)
    indices = range(32)
    changed = sum(
        not torch.equal(plain.train_dataset[i][0], augmented.train_dataset[i][0]) for i in indices
    )
    assert changed >= 16, f"RandAugment changed only {changed}/32 training images"
    for i in indices:
        xa, ya, ia = augmented.train_dataset[i]
        assert xa.shape == (1, 28, 28) and xa.dtype == torch.float32
        assert xa.min() >= -1.0 and xa.max() <= 1.0
        assert ya == plain.train_dataset[i][1] and ia == i  # labels and indices untouched
        assert torch.equal(plain.val_dataset[i][0], augmented.val_dataset[i][0])


# ----------------------------------------------------------------------------
# Other data folders
# ----------------------------------------------------------------------------
def test_pneumoniamnist_from_shared_folder():
    if not (SHARED_MEDMNIST / "pneumoniamnist.npz").is_file():
        pytest.skip(f"external data not available: {SHARED_MEDMNIST / 'pneumoniamnist.npz'}")
    dm = MedMNISTDataModule("pneumoniamnist", root=str(SHARED_MEDMNIST), batch_size=256)
    dm.setup("fit")
    dm.setup("test")
    assert (len(dm.train_dataset), len(dm.val_dataset), len(dm.test_dataset)) == (4708, 524, 624)
    x, y, idx = next(iter(dm.val_dataloader()))
    assert x.shape == (256, 1, 28, 28) and x.dtype == torch.float32
    assert y.dtype == torch.long and set(y.unique().tolist()) <= {0, 1}
    assert idx.tolist() == list(range(256))
    assert x.min() >= -1.0 and x.max() <= 1.0
    assert dm.num_classes == 2 and dm.num_train_samples == 4708


def test_pneumoniamnist_in_the_official_layout_from_a_user_folder(tmp_path):
    """The same load without the shared data (a fresh clone has none): a file written here in
    the official layout (uint8 images, labels of shape (N, 1), the official split sizes, which
    the medmnist reader checks), with its values checked back."""
    rng = np.random.default_rng(0)
    sizes = {"train": 4708, "val": 524, "test": 624}
    arrays = {}
    for split, n in sizes.items():
        arrays[f"{split}_images"] = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
        arrays[f"{split}_labels"] = rng.integers(0, 2, (n, 1), dtype=np.uint8)
    np.savez(tmp_path / "pneumoniamnist.npz", **arrays)
    dm = MedMNISTDataModule("pneumoniamnist", root=str(tmp_path), batch_size=64)
    dm.setup("fit")
    dm.setup("test")
    assert (len(dm.train_dataset), len(dm.val_dataset), len(dm.test_dataset)) == (4708, 524, 624)
    x, y, idx = dm.test_dataset[4]
    assert x.shape == (1, 28, 28) and idx == 4
    torch.testing.assert_close(x, _expected_tensor(arrays["test_images"][4:5])[0])
    assert int(y) == int(arrays["test_labels"][4, 0])
    assert dm.num_classes == 2 and dm.num_train_samples == 4708


def test_copied_file_in_custom_root_loads(tmp_path):
    shutil.copy(EMBEDDED_DATA_DIR / "breastmnist.npz", tmp_path / "breastmnist.npz")
    dm = MedMNISTDataModule("breastmnist", root=str(tmp_path))
    dm.setup("test")
    assert len(dm.test_dataset) == 156


# ----------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------
def test_missing_file_error_names_path_and_fix(tmp_path):
    dm = MedMNISTDataModule("breastmnist", root=str(tmp_path))
    with pytest.raises(FileNotFoundError) as info:
        dm.setup("fit")
    message = str(info.value)
    assert str(tmp_path / "breastmnist.npz") in message
    assert "root=" in message and "download=True" in message
    assert "medmnist.com" in message


def test_missing_root_folder_gives_same_error(tmp_path):
    missing = tmp_path / "does" / "not" / "exist"
    dm = MedMNISTDataModule("breastmnist", root=str(missing))
    with pytest.raises(FileNotFoundError, match="breastmnist.npz"):
        dm.setup("test")


def test_non_embedded_flag_without_root_explains(tmp_path):
    dm = MedMNISTDataModule("pneumoniamnist")
    with pytest.raises(FileNotFoundError) as info:
        dm.setup("fit")
    assert str(EMBEDDED_DATA_DIR / "pneumoniamnist.npz") in str(info.value)
    assert "only holds breastmnist" in str(info.value)


def test_unknown_flag_lists_valid_flags():
    with pytest.raises(ValueError) as info:
        MedMNISTDataModule("notamnist")
    message = str(info.value)
    assert "notamnist" in message
    assert "breastmnist" in message and "pneumoniamnist" in message and "pathmnist" in message
    assert "organmnist3d" not in message  # 3D flags are not valid choices


def test_3d_flag_is_refused():
    with pytest.raises(ValueError, match="3D"):
        MedMNISTDataModule("organmnist3d")


def test_multi_label_flag_is_refused():
    with pytest.raises(ValueError, match="single-label"):
        MedMNISTDataModule("chestmnist")


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"batch_size": 0}, "batch_size"),
        ({"batch_size": -3}, "batch_size"),
        ({"batch_size": 2.5}, "batch_size"),
        ({"eval_batch_size": 0}, "eval_batch_size"),
        ({"num_workers": -1}, "num_workers"),
        ({"randaugment_num_ops": -1}, "randaugment_num_ops"),
        ({"randaugment_magnitude": 31}, "randaugment_magnitude"),
        ({"randaugment_magnitude": -1}, "randaugment_magnitude"),
    ],
)
def test_bad_arguments_raise_value_error_naming_them(kwargs, name):
    with pytest.raises(ValueError, match=name):
        MedMNISTDataModule(**kwargs)


def test_unknown_stage_is_refused():
    with pytest.raises(ValueError, match="stage"):
        MedMNISTDataModule().setup("train")


def _fit_demo_like(root: Path, epochs: int, ckpt: Path | None = None):
    import lightning.pytorch as pl

    from lpa3_lightning import LPA3Callback, LPA3Classifier

    pl.seed_everything(0)
    module = LPA3Classifier(in_channels=1, num_classes=2, milestones=[100])
    callback = LPA3Callback(ratio=0.5, steps=1, seed=0)
    trainer = pl.Trainer(default_root_dir=root, max_epochs=epochs, limit_train_batches=3, limit_val_batches=0,
                         accelerator="cpu", devices=1, callbacks=[callback], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, deterministic=True)
    trainer.fit(module, datamodule=MedMNISTDataModule("breastmnist", batch_size=16), ckpt_path=ckpt)
    return trainer, module, callback


def test_the_default_train_loader_resumes_an_epoch_end_checkpoint_exactly(tmp_path):
    """The README's promise for its demo: an interrupted run resumes exactly (here from the end
    of epoch 0): the same weights and TCS memory as an uninterrupted run."""
    _, full, full_callback = _fit_demo_like(tmp_path / "full", 2)
    trainer, _, _ = _fit_demo_like(tmp_path / "part", 1)
    trainer.save_checkpoint(tmp_path / "epoch0.ckpt")
    _, resumed, resumed_callback = _fit_demo_like(tmp_path / "part", 2, tmp_path / "epoch0.ckpt")
    for key, value in full.state_dict().items():
        assert torch.equal(value, resumed.state_dict()[key]), key
    for key in ("memory", "scores", "seen", "threshold"):
        assert torch.equal(getattr(full_callback.runner().tcs, key), getattr(resumed_callback.runner().tcs, key)), key


def test_overfit_batches_runs_with_the_default_train_loader(tmp_path):
    """Lightning rebuilds the loader with a sequential sampler for ``overfit_batches``."""
    import lightning.pytorch as pl

    from lpa3_lightning import LPA3Callback, LPA3Classifier

    module = LPA3Classifier(in_channels=1, num_classes=2)
    trainer = pl.Trainer(default_root_dir=tmp_path, max_epochs=2, overfit_batches=2, accelerator="cpu", devices=1,
                         callbacks=[LPA3Callback(ratio=0.5, steps=1, seed=0)], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, datamodule=MedMNISTDataModule("breastmnist", batch_size=8))
    assert trainer.global_step == 4
