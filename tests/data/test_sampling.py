"""Resumable sampling: the training loader (torchdata's StatefulDataLoader over a ``(seed, epoch)`` shuffle,
whose state Lightning saves and restores, mid-epoch included) and the batches with the method's labeled share
once PES or DivideMix has split the noisy set."""

from __future__ import annotations

from collections import Counter

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
from torch.utils.data import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from lpa3_lightning import DivideMixClassifier, PESClassifier
from lpa3_lightning.data import NoisyLabelDataModule
from lpa3_lightning.data.sampling import EpochSampler, SplitBalancedSampler, labeled_per_batch, train_loader
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


@pytest.mark.parametrize(("labeled", "rule", "expected"), [
    (550, "pes", 32),    # unlabeled outnumber labeled: the unlabeled part is half the batch
    (3000, "pes", 48),   # else the unlabeled part is its share of the set: int(1000 / 4000 * 64) = 16
    (2000, "pes", 32),   # a tie is the second case: int(2000 / 4000 * 64) = 32
    (550, "half", 32),
    (3990, "half", 54),  # 10 unlabeled samples cannot fill half a batch without repeats
    (5, "pes", 5),       # nor 5 labeled ones
])
def test_the_labeled_part_of_a_batch_follows_each_method(labeled, rule, expected):
    assert labeled_per_batch(labeled, 4000, 64, rule) == expected


def _split(n: int, labeled: int, seed: int = 0) -> torch.Tensor:
    mask = torch.zeros(n, dtype=torch.bool)
    mask[torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:labeled]] = True
    return mask


def test_every_batch_has_the_labeled_share_and_the_labeled_set_is_revisited_evenly():
    mask = _split(400, 30)
    batches = torch.tensor(list(SplitBalancedSampler(400, 16, lambda: (mask, 0)))).view(-1, 16)
    assert batches.shape == (25, 16)  # a pass's number of batches, whatever the split
    assert (mask[batches].sum(1) == 8).all()
    seen = Counter(batches[mask[batches]].tolist())
    assert set(seen) == set(mask.nonzero().flatten().tolist())  # 200 draws over 30 samples: every one, ...
    assert max(seen.values()) - min(seen.values()) <= 1  # ... in shuffled passes (6 or 7 times each)
    unlabeled = batches[~mask[batches]].tolist()
    assert len(unlabeled) == len(set(unlabeled)) == 200  # fewer draws than unlabeled samples: no repeat
    assert all(len(set(b.tolist())) == 16 for b in batches)  # no sample twice in a batch


def test_without_a_split_an_epoch_is_the_seeded_shuffle_and_the_epoch_seeds_the_balanced_order():
    state = torch.get_rng_state()
    order = list(SplitBalancedSampler(100, 16, lambda: (None, 2), seed=1))
    assert torch.equal(torch.get_rng_state(), state)  # nothing drawn from the global generator
    generator = torch.Generator().manual_seed(1 * 1_000_003 + 2)
    assert order == torch.randperm(100, generator=generator)[:96].tolist()  # a pass of whole batches
    mask = _split(100, 20)
    first = list(SplitBalancedSampler(100, 16, lambda: (mask, 4), seed=1))
    assert first == list(SplitBalancedSampler(100, 16, lambda: (mask, 4), seed=1))  # reproducible
    assert first != list(SplitBalancedSampler(100, 16, lambda: (mask, 5), seed=1))  # a new order each epoch


@pytest.mark.parametrize("split", [True, False])
def test_under_ddp_each_process_deals_whole_batches_with_the_share(split):
    mask = _split(400, 30) if split else None
    sampler = SplitBalancedSampler(400, 16, lambda: (mask, 2), num_replicas=3)
    stream = list(sampler)
    # what Lightning injects under DDP for a custom sampler (shuffle follows the loader: False here)
    per_rank = [torch.tensor(list(DistributedSamplerWrapper(sampler, num_replicas=3, rank=r, shuffle=False)))
                for r in range(3)]
    assert set(torch.cat(per_rank).tolist()) == set(stream)  # every drawn index reaches a process
    for indices in per_rank:
        batches = indices[: len(indices) // 16 * 16].view(-1, 16)
        assert all(len(set(b.tolist())) == 16 for b in batches)
        if split:
            assert (mask[batches[:24 // 3]].sum(1) == 8).all()  # 25 batches: the 24 of whole blocks are exact


def test_bad_arguments_and_a_split_of_another_size_are_refused_by_name():
    with pytest.raises(ValueError, match="batch_size"):
        SplitBalancedSampler(10, 11, lambda: (None, 0))
    with pytest.raises(ValueError, match="num_replicas"):
        SplitBalancedSampler(10, 2, lambda: (None, 0), num_replicas=0)
    with pytest.raises(ValueError, match="rule"):
        SplitBalancedSampler(10, 2, lambda: (None, 0), rule="divide")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="one labeled flag per training sample"):
        list(SplitBalancedSampler(10, 2, lambda: (torch.ones(9, dtype=torch.bool), 0)))
    with pytest.raises(ValueError, match="balance_split"):
        NoisyLabelDataModule("mnist5k", balance_split="yes")  # type: ignore[arg-type]


class _Recording:
    """Records, per epoch, the share of each batch that the module's split marks labeled."""

    def on_train_batch_start(self, batch, batch_idx):  # noqa: D102 (a LightningModule hook)
        mask = self.noisy_split_mask()
        if mask is not None:
            self.shares.setdefault(self.current_epoch, []).append(float(mask[batch[3]].float().mean()))


class _RecordingPES(_Recording, PESClassifier):
    pass


class _RecordingDivideMix(_Recording, DivideMixClassifier):
    pass


@pytest.mark.parametrize(("module_class", "kwargs", "balance"), [
    (_RecordingPES, {"pes": {"early_epochs": 1, "refine_epochs": 0}}, True),
    (_RecordingDivideMix, {"dividemix": {"warmup_epochs": 1}}, True),
    (_RecordingPES, {"pes": {"early_epochs": 1, "refine_epochs": 0}}, False),
])
def test_the_semi_phase_draws_batches_with_the_methods_labeled_share(module_class, kwargs, balance, tmp_path):
    pl.seed_everything(0)
    data = NoisyLabelDataModule("mnist5k", noise_rate=0.8, batch_size=32, balance_split=balance)
    module = module_class(num_samples=4000, **kwargs)
    module.shares = {}
    trainer = pl.Trainer(max_epochs=2, limit_train_batches=6, limit_val_batches=0, accelerator="cpu", logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=tmp_path)
    trainer.fit(module, data)
    mask = module.noisy_split_mask()
    assert set(module.shares) == {1} and mask is not None  # the split exists in the semi phase only
    labeled = int(mask.sum())
    assert 0 < labeled < 4000 // 2  # at 80% noise the labeled set is the smaller part
    shares = torch.tensor(module.shares[1])
    if balance:  # exactly the method's labeled part in every batch (both rules give half here)
        assert torch.allclose(shares, torch.full_like(shares, labeled_per_batch(labeled, 4000, 32, "pes") / 32))
    else:  # the set's share, on average
        assert float(shares.mean()) < 0.5 * 0.8
