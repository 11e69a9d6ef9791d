"""Tests for IndexedDataset: label normalisation, index semantics, collation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from lpa3_lightning.data import IndexedDataset


class _PairDataset(Dataset):
    """Minimal map-style dataset returning (x, label) with a chosen label type."""

    def __init__(self, labels: list) -> None:
        self.labels = labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        return torch.full((2, 3), float(i)), self.labels[i]


@pytest.mark.parametrize(
    "label",
    [
        3,
        np.int64(3),
        np.uint8(3),
        np.array([3], dtype=np.uint8),
        np.array([3], dtype=np.int64),
        np.array(3),
        torch.tensor(3),
        torch.tensor([3], dtype=torch.int32),
    ],
    ids=["int", "np.int64", "np.uint8", "np(1,)uint8", "np(1,)int64", "np0d", "tensor0d", "tensor(1,)int32"],
)
def test_label_becomes_long_scalar(label):
    x, y, i = IndexedDataset(_PairDataset([0, label]))[1]
    assert isinstance(y, torch.Tensor)
    assert y.dtype == torch.long
    assert y.shape == ()
    assert y.item() == 3
    assert type(i) is int and i == 1
    assert torch.equal(x, torch.full((2, 3), 1.0))


def test_len_matches_wrapped_dataset():
    assert len(IndexedDataset(_PairDataset([0, 1, 2, 3, 4]))) == 5


def test_negative_index_is_normalised_to_position():
    ds = IndexedDataset(_PairDataset([0, 1, 2]))
    x, _, i = ds[-1]
    assert i == 2
    assert torch.equal(x, torch.full((2, 3), 2.0))


def test_numpy_and_tensor_indices_are_accepted():
    ds = IndexedDataset(_PairDataset([0, 1, 2]))
    assert ds[np.int64(1)][2] == 1
    assert type(ds[torch.tensor(2)][2]) is int


def test_out_of_range_index_raises_index_error():
    ds = IndexedDataset(_PairDataset([0, 1, 2]))
    with pytest.raises(IndexError, match="out of range"):
        ds[3]
    with pytest.raises(IndexError):
        ds[-4]


def test_non_integer_index_raises_type_error():
    with pytest.raises(TypeError, match="integers"):
        IndexedDataset(_PairDataset([0, 1]))[0.5]


class _SizedStream(IterableDataset):
    """Iterable-style dataset that has a length but no random access."""

    def __iter__(self):
        return iter([(torch.zeros(1), 0)])

    def __len__(self) -> int:
        return 1


@pytest.mark.parametrize("bad", [object(), 5, _SizedStream()], ids=["object", "int", "iterable"])
def test_object_without_len_or_getitem_is_refused(bad):
    with pytest.raises(TypeError, match="map-style"):
        IndexedDataset(bad)


def test_multi_element_label_raises_value_error():
    ds = IndexedDataset(_PairDataset([np.array([1, 0, 1])]))
    with pytest.raises(ValueError, match="single-label"):
        ds[0]


@pytest.mark.parametrize("label", [1.0, np.array([1.0]), torch.tensor(0.7), True])
def test_non_integer_label_raises_type_error(label):
    with pytest.raises(TypeError, match="integer"):
        IndexedDataset(_PairDataset([label]))[0]


def test_item_that_is_not_a_pair_raises_type_error():
    class _Triples(_PairDataset):
        def __getitem__(self, i):
            return torch.zeros(1), 0, "extra"

    with pytest.raises(TypeError, match=r"\(x, y\) pairs"):
        IndexedDataset(_Triples([0]))[0]


def test_default_collate_gives_long_labels_and_indices():
    labels = [np.array([k % 2], dtype=np.uint8) for k in range(7)]
    loader = DataLoader(IndexedDataset(_PairDataset(labels)), batch_size=4, shuffle=False)
    batches = list(loader)
    assert [b[0].shape[0] for b in batches] == [4, 3]
    x, y, idx = batches[0]
    assert x.shape == (4, 2, 3)
    assert y.dtype == torch.long and y.shape == (4,)
    assert idx.dtype == torch.long and idx.tolist() == [0, 1, 2, 3]
    assert y.tolist() == [0, 1, 0, 1]


def test_shuffled_indices_identify_samples():
    # Why the wrapper exists: after shuffling, the index must still point at
    # the sample that produced each row.
    ds = IndexedDataset(_PairDataset(list(range(20))))
    loader = DataLoader(ds, batch_size=6, shuffle=True, generator=torch.Generator().manual_seed(0))
    seen = []
    for x, y, idx in loader:
        assert torch.equal(x[:, 0, 0], idx.float())
        assert torch.equal(y, idx)
        seen += idx.tolist()
    assert sorted(seen) == list(range(20))
    assert seen != list(range(20))
