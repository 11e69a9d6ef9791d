"""The training loader of the shipped data modules: torchdata's StatefulDataLoader over a
``(seed, epoch)`` shuffle, whose state Lightning saves and restores (mid-epoch included)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from lpa3_lightning.data.train_loader import EpochSampler, train_loader
from tests.helpers import indexed_images


def _indices(loader) -> list[list[int]]:
    return [batch[2].tolist() for batch in loader]


def test_each_process_gets_torchs_distributed_share_of_the_seeded_epoch():
    data = indexed_images(11)
    for world in (1, 2):
        for rank in range(world):
            loader = train_loader(data, batch_size=2, seed=5, num_replicas=world, rank=rank)
            assert isinstance(loader, StatefulDataLoader) and isinstance(loader.sampler, DistributedSampler)
            loader.sampler.set_epoch(3)
            reference = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=5)
            reference.set_epoch(3)
            assert sum(_indices(loader), []) == list(reference)


@pytest.mark.parametrize("world", [1, 2])
def test_a_mid_epoch_state_resumes_the_rest_of_the_epoch(world):
    data = indexed_images(20)
    loader = train_loader(data, batch_size=2, seed=1, num_replicas=world, rank=0)
    loader.sampler.set_epoch(2)
    full = _indices(loader)
    iterator = iter(loader)
    for _ in range(3):
        next(iterator)
    state = loader.state_dict()
    again = train_loader(data, batch_size=2, seed=1, num_replicas=world, rank=0)
    again.sampler.set_epoch(2)
    again.load_state_dict(state)
    assert _indices(again) == full[3:]


@pytest.mark.parametrize("world", [1, 4])
def test_a_mid_epoch_state_of_another_world_size_is_refused_by_name(world):
    """Lightning counts an interrupted epoch's batches per process: at another world size neither a
    restart of the epoch (samples seen twice, and at a larger world size the loop ends the epoch
    before the loader) nor a skip (samples never seen) continues it. Refused, with the fix."""
    data = indexed_images(40)
    loader = train_loader(data, batch_size=2, seed=5, num_replicas=2, rank=0)
    iterator = iter(loader)
    for _ in range(6):
        next(iterator)
    other = train_loader(data, batch_size=2, seed=5, num_replicas=world, rank=0)
    other.load_state_dict(loader.state_dict())
    with pytest.raises(ValueError, match=r"mid-epoch by 2 processes.*this run has " + str(world) + r".*Fix"):
        next(iter(other))


def test_an_epoch_end_state_loads_at_any_world_size():
    data = indexed_images(12)
    loader = train_loader(data, batch_size=2, seed=5, num_replicas=2, rank=0)
    _indices(loader)  # the whole epoch
    state = loader.state_dict()
    other = train_loader(data, batch_size=2, seed=5, num_replicas=1, rank=0)
    other.load_state_dict(state)
    other.sampler.set_epoch(1)
    reference = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=5)
    reference.set_epoch(1)
    assert sum(_indices(other), []) == list(reference)


def _state_after_the_last_batch(data) -> dict:
    """The state Lightning saves in the ``on_train_batch_end`` of an epoch's last batch: every batch
    drawn, the iterator not yet ended."""
    loader = train_loader(data, batch_size=2, seed=5)
    loader.sampler.set_epoch(0)
    iterator = iter(loader)
    for _ in range(len(loader)):
        next(iterator)
    return loader.state_dict()


def test_a_used_up_pass_restored_but_never_drawn_leaves_the_next_epoch_whole():
    """Lightning makes the restored iterator at resume and, resuming into that epoch's end, may never
    draw from it before it makes the next epoch's: that epoch is whole (it was empty: the restored
    position was still pending)."""
    data = indexed_images(12)
    again = train_loader(data, batch_size=2, seed=5)
    again.load_state_dict(_state_after_the_last_batch(data))
    iter(again)  # the restored iterator, as Lightning makes it at resume (the rest of epoch 0: nothing)
    again.sampler.set_epoch(1)
    reference = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=5)
    reference.set_epoch(1)
    assert sum(_indices(again), []) == list(reference)


def test_a_used_up_pass_restored_and_drawn_ends_at_once_then_the_next_is_whole():
    data = indexed_images(12)
    again = train_loader(data, batch_size=2, seed=5)
    again.load_state_dict(_state_after_the_last_batch(data))
    assert list(iter(again)) == []
    assert len(_indices(again)) == 6


def test_the_sampler_refuses_a_bad_world():
    data = indexed_images(4)
    with pytest.raises(ValueError, match="num_replicas"):
        EpochSampler(data, num_replicas=0, rank=0)
    with pytest.raises(ValueError, match="rank"):
        EpochSampler(data, num_replicas=2, rank=2)
    with pytest.raises(ValueError, match="batch_size"):
        train_loader(data, batch_size=0)
    assert torch.is_tensor(next(iter(train_loader(data, batch_size=2)))[0])
