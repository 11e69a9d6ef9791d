"""The noisy-label data module: batch layout, the noise actually applied, the noise file, checkpoints."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lpa3_lightning.data import NoisyLabelDataModule


@pytest.fixture(scope="module")
def dm():
    module = NoisyLabelDataModule("mnist5k", noise_rate=0.8, batch_size=16, eval_batch_size=500)
    module.setup("fit")
    return module


def test_batches_carry_two_views_the_noisy_label_and_the_index(dm):
    x1, x2, y, idx = next(iter(dm.train_dataloader()))
    assert x1.shape == x2.shape == (16, 1, 28, 28) and not torch.equal(x1, x2)  # independent random views
    assert torch.equal(y, torch.as_tensor(dm.noisy_train_labels)[idx])  # the noisy label, never the clean one
    assert len(dm.train_dataloader()) == dm.num_train // 16  # last partial batch dropped


def test_the_noise_applied_is_the_requested_share_and_val_test_keep_clean_labels(dm):
    wrong = dm.noisy_train_labels != dm.clean_train_labels
    assert dm.num_train == 4000 and int(wrong.sum()) == 3200
    x, y, idx = next(iter(dm.val_dataloader()))
    from lpa3_lightning.data import load_mnist5k

    clean = torch.as_tensor(load_mnist5k()["test_labels"], dtype=torch.long)
    assert x.shape[0] == 500 and torch.equal(y.long(), clean[idx])  # MNIST-5k validates on its clean test split


def test_noise_file_is_written_then_read_and_a_file_for_another_rate_is_refused(tmp_path):
    path = tmp_path / "noise.json"
    first = NoisyLabelDataModule("mnist5k", noise_rate=0.5, seed=1, noise_file=str(path))
    first.setup("fit")
    assert path.is_file()
    again = NoisyLabelDataModule("mnist5k", noise_rate=0.5, seed=99, noise_file=str(path))  # the file wins
    with pytest.warns(UserWarning, match="holds the noise of seed 1, not of seed=99"):  # a seed sweep would not vary
        again.setup("fit")
    assert np.array_equal(again.noisy_train_labels, first.noisy_train_labels)
    assert again.state_dict()["seed"] == 1  # the checkpoint records the seed of the labels in use
    other = NoisyLabelDataModule("mnist5k", noise_rate=0.8, noise_file=str(path))
    with pytest.raises(ValueError, match="rate=0.5, not rate=0.8"):
        other.setup("fit")


def test_asymmetric_digits_by_default_and_refusals_name_the_fix(tmp_path):
    asym = NoisyLabelDataModule("mnist5k", noise_mode="asymmetric", noise_rate=0.4)
    asym.setup("fit")
    changed = asym.noisy_train_labels != asym.clean_train_labels
    assert set(np.unique(asym.clean_train_labels[changed])) == {2, 3, 5, 6, 7}
    with pytest.raises(ValueError, match="stl10"):
        NoisyLabelDataModule("stl10", root=str(tmp_path))
    with pytest.raises(ValueError, match="noise_mapping"):
        NoisyLabelDataModule("cifar100", root=str(tmp_path), noise_mode="asymmetric")
    with pytest.raises(ValueError, match="`rate`"):
        NoisyLabelDataModule("mnist5k", noise_rate=1.5)


def test_state_dict_restores_the_noisy_labels_of_a_checkpoint(dm):
    state = dm.state_dict()
    fresh = NoisyLabelDataModule("mnist5k", noise_rate=0.8, seed=5)
    fresh.setup("fit")
    assert not np.array_equal(fresh.noisy_train_labels, dm.noisy_train_labels)
    with pytest.warns(UserWarning, match="resuming on the checkpoint's noisy labels"):  # another seed
        fresh.load_state_dict(state)
    assert np.array_equal(fresh.noisy_train_labels, dm.noisy_train_labels)
    assert torch.equal(fresh.train_dataset.labels, torch.as_tensor(dm.noisy_train_labels))
    assert fresh.state_dict()["seed"] == dm.state_dict()["seed"] != 5  # the labels in use are the checkpoint's
    with pytest.raises(ValueError, match="source"):
        fresh.load_state_dict({**state, "source": "cifar10"})


def test_a_noise_file_of_another_convention_is_refused(tmp_path):
    path = tmp_path / "noise.json"
    NoisyLabelDataModule("mnist5k", noise_rate=0.5, noise_file=str(path)).setup("fit")
    other = NoisyLabelDataModule("mnist5k", noise_rate=0.5, noise_convention="any", noise_file=str(path))
    with pytest.raises(ValueError, match="convention='other', not convention='any'"):
        other.setup("fit")


def test_a_resume_with_other_noise_settings_is_refused_naming_them(dm):
    state = dm.state_dict()  # 80% symmetric
    other = NoisyLabelDataModule("mnist5k", noise_rate=0.5)
    other.setup("fit")
    with pytest.raises(ValueError, match="drawn with rate=0.8; this data module asks for rate=0.5.*noise_rate"):
        other.load_state_dict(state)
    asymmetric = NoisyLabelDataModule("mnist5k", noise_mode="asymmetric", noise_rate=0.8)
    asymmetric.setup("fit")
    with pytest.raises(ValueError, match="mode='symmetric'"):
        asymmetric.load_state_dict(state)
