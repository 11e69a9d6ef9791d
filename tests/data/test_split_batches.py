"""Batches with the method's labeled share once PES or DivideMix has split the noisy set."""

from __future__ import annotations

from collections import Counter

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric.utilities.distributed import DistributedSamplerWrapper

from lpa3_lightning import DivideMixClassifier, PESClassifier
from lpa3_lightning.data import NoisyLabelDataModule
from lpa3_lightning.data.split_batches import SplitBalancedSampler, labeled_per_batch


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
