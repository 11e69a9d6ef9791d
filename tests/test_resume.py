"""Exact resume: a run SIGKILLed mid-epoch and resumed from its last checkpoint ends bitwise
equal to an uninterrupted run (TCS memory, threshold, cached x', weights)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lpa3_lightning.data import EpochPermutationSampler, ResumableDataLoader
from tests.helpers import indexed_images

SCRIPT = Path(__file__).resolve().parent / "resume" / "run_resume.py"


def _run(out: Path, mode: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), str(out), mode], capture_output=True, text=True, timeout=300,
                          cwd=SCRIPT.parents[2])


def test_sigkill_mid_epoch_then_resume_equals_uninterrupted(tmp_path):
    full = _run(tmp_path / "full", "full")
    assert full.returncode == 0, full.stderr[-3000:]
    killed = _run(tmp_path / "crash", "killed")
    assert killed.returncode == -signal.SIGKILL, (killed.returncode, killed.stderr[-2000:])
    assert not (tmp_path / "crash" / "final.pt").exists()
    resumed = _run(tmp_path / "crash", "resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    a = torch.load(tmp_path / "full" / "final.pt", weights_only=False)
    b = torch.load(tmp_path / "crash" / "final.pt", weights_only=False)
    for key in ("memory", "scores", "seen", "threshold"):
        assert torch.equal(a["tcs"][key], b["tcs"][key]), key
    for key in ("written", "storage"):
        assert torch.equal(a["cache"][key], b["cache"][key]), key
    for key in a["weights"]:
        assert torch.equal(a["weights"][key], b["weights"][key]), key
    # the resumed process ran only the steps after the crash
    assert len(b["seen_augmented"]) == 9 - 5 and b["seen_augmented"] == a["seen_augmented"][5:]


def test_resumable_loader_skips_exactly_the_consumed_batches():
    loader = ResumableDataLoader(indexed_images(10), batch_size=3, shuffle=True, seed=1)
    loader.resume_sampler.set_epoch(2)
    full = [batch[2].tolist() for batch in loader]
    iterator = iter(loader)
    next(iterator)
    next(iterator)
    state = loader.state_dict()
    assert state == {"epoch": 2, "batches_in_epoch": 2, "seed": 1, "num_replicas": 1}
    other = ResumableDataLoader(indexed_images(10), batch_size=3, shuffle=True, seed=1)
    other.resume_sampler.set_epoch(2)
    other.load_state_dict(state)
    assert [batch[2].tolist() for batch in other] == full[2:]
    assert [batch[2].tolist() for batch in other] == full  # the skip applies once
    sampler = EpochPermutationSampler(6, seed=0)
    sampler.set_epoch(0)
    first = list(sampler)
    sampler.set_epoch(1)
    assert sorted(first) == list(range(6)) and list(sampler) != first


def test_under_ddp_the_resumable_loader_shards_like_distributed_sampler_and_skips():
    """Each rank's share of an epoch is torch's DistributedSampler's (same seed, padding and slice);
    a restore skips the consumed batches, and a checkpoint of another world size restarts the epoch.
    (Under Lightning's DDP the ranks come from the process group: tests/test_multinode.py.)"""
    from torch.utils.data import DistributedSampler

    data = indexed_images(11)
    single = ResumableDataLoader(data, batch_size=3, seed=5)
    single.resume_sampler.set_epoch(3)
    sampler = EpochPermutationSampler(11, seed=5)
    sampler.set_epoch(3)
    assert sum((batch[2].tolist() for batch in single), []) == list(sampler)  # one process: as before
    for rank in (0, 1):
        loader = ResumableDataLoader(data, batch_size=2, seed=5, num_replicas=2, rank=rank)
        assert isinstance(loader.sampler, DistributedSampler)  # so Lightning keeps it under DDP
        loader.sampler.set_epoch(3)
        reference = DistributedSampler(data, num_replicas=2, rank=rank, shuffle=True, seed=5)
        reference.set_epoch(3)
        batches = [batch[2].tolist() for batch in loader]
        assert sum(batches, []) == list(reference) and len(loader) == 3  # 11 padded to 12: 6 a rank
        iterator = iter(loader)
        next(iterator)
        state = loader.state_dict()
        assert state == {"epoch": 3, "batches_in_epoch": 1, "seed": 5, "num_replicas": 2}
        again = ResumableDataLoader(data, batch_size=2, seed=5, num_replicas=2, rank=rank)
        again.sampler.set_epoch(3)
        again.load_state_dict(state)
        assert [batch[2].tolist() for batch in again] == batches[1:]
        other_world = ResumableDataLoader(data, batch_size=2, seed=5, num_replicas=4, rank=rank)
        other_world.sampler.set_epoch(3)
        with pytest.warns(UserWarning, match="written mid-epoch by 2 processes and this run has 4.*restarts"):
            other_world.load_state_dict(state)
        assert len([batch for batch in other_world]) == 2  # the whole epoch: 3 of 12 rows in batches of 2
    with pytest.raises(ValueError, match="chooses its own sampler"):
        ResumableDataLoader(data, sampler=list(range(11)))
    with pytest.raises(ValueError, match="`num_replicas` must be a positive int"):
        ResumableDataLoader(data, num_replicas=0)
    with pytest.raises(ValueError, match=r"`rank` must be in 0\.\.1"):
        ResumableDataLoader(data, num_replicas=2, rank=2)
