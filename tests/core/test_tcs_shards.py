"""The sharded TCS memory against the replicated one, in 2, 4 and 8 CPU processes (gloo).

Each worker feeds both memories the same steps (DistributedSampler's order with its padding
duplicates, a few non-finite predictions) through their one update, a collective with an exchange
of its own: the replicated memory all-gathers the predictions, the sharded one routes each row
to its owner. Scores, seen flags,
thresholds, every step's selection and the whole memory (assembled by the sharded state_dict)
must be equal bit for bit, in float32 and in bfloat16 storage (on the CPU). A checkpoint written
by 8 processes loads into 4, and 4's into 2, each layout from the other's state, restoring the
same memory; the shards are assembled a few rows at a time, over many chunks.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import DistributedSampler

from lpa3_lightning.core import tcs_shards
from lpa3_lightning.core.tcs_shards import owned_rows, route_to_owners
from lpa3_lightning.core.tcs import TimeConsistency
from lpa3_lightning.core.tcs_shards import ShardedTimeConsistency

N, C, BATCH, EPOCHS = 103, 7, 6, 3  # 103: divisible by none of the world sizes
DTYPES = ("float32", "bfloat16")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _predictions(epoch: int, step: int, indices: torch.Tensor) -> torch.Tensor:
    """Each sample's prediction at a step, the same whichever rank computes it; a few are NaN."""
    g = torch.Generator().manual_seed(1000 * epoch + step)
    table = torch.softmax(3 * torch.randn(N, C, generator=g), dim=1)
    table[(torch.arange(N) + step) % 37 == 0] = float("nan")
    return table[indices]


def _steps(world: int, rank: int, epochs: range):
    data = list(range(N))
    for epoch in epochs:
        sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
        sampler.set_epoch(epoch)
        order = torch.tensor(list(sampler))
        for step in range((len(order) + BATCH - 1) // BATCH):
            yield epoch, step, order[step * BATCH:(step + 1) * BATCH]


def _train(memories: dict, world: int, rank: int, epochs: range) -> list[dict[str, torch.Tensor]]:
    selections = []
    for epoch, step, indices in _steps(world, rank, epochs):
        if step == 0 and epoch > epochs.start:
            for memory in memories.values():
                memory.refresh_threshold()
        selections.append({name: memory.select(indices, epoch) for name, memory in memories.items()})
        probs = _predictions(epoch, step, indices)
        for memory in memories.values():
            memory.update(indices, probs)
    for memory in memories.values():
        memory.refresh_threshold()
    return selections


def _worker(rank: int, world: int, port: int, out: str, load_from: str | None) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    tcs_shards.ASSEMBLE_CHUNK_BYTES = 5 * world * C * 4  # checkpoints assembled 5 rows a shard at a time
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result: dict = {"fresh": _run(world, rank, None)}
        if load_from is not None:  # resume another world size's checkpoint, then train on
            result["resumed"] = _run(world, rank, torch.load(load_from, weights_only=False)["fresh"]["states"])
        torch.save(result, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _run(world: int, rank: int, saved: dict | None) -> dict:
    memories: dict = {}
    for dtype in DTYPES:
        memories[f"replicated_{dtype}"] = TimeConsistency(N, C, 0.3, storage_dtype=dtype)
        memories[f"sharded_{dtype}"] = ShardedTimeConsistency(N, C, 0.3, num_shards=world, shard=rank,
                                                              storage_dtype=dtype)
    result: dict = {}
    if saved is not None:  # across layouts too: each memory loads the other layout's state
        for name, memory in memories.items():
            other = name.replace("replicated", "x").replace("sharded", "replicated").replace("x", "sharded")
            memory.load_state_dict(saved[other])
        result["restored"] = {name: memory.state_dict() for name, memory in memories.items()}
    epochs = range(EPOCHS, 2 * EPOCHS) if saved is not None else range(EPOCHS)
    result["selections"] = _train(memories, world, rank, epochs)
    result["states"] = {name: memory.state_dict() for name, memory in memories.items()}  # collective
    result["local_rows"] = {name: tuple(m.local_rows.shape) for name, m in memories.items() if "sharded" in name}
    return result


def _launch(tmp_path: Path, world: int, load_from: Path | None = None) -> list[dict]:
    out = tmp_path / f"world{world}"
    out.mkdir()
    # fork: the children reuse this process's imports (a spawn imports torch again in each of 14)
    mp.start_processes(_worker, args=(world, _free_port(), str(out), None if load_from is None else str(load_from)),
                       nprocs=world, start_method="fork")
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]


def _assert_states_equal(a: dict, b: dict, where: str) -> None:
    for key in ("memory", "scores", "seen", "threshold"):
        x, y = a[key], b[key]
        assert x.dtype == y.dtype and torch.equal(x, y) or (key == "threshold" and bool(x.isnan() & y.isnan())), \
            f"{where}: {key}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[int, list[dict]]:
    """Per world size, each rank's fresh run and (4 and 2) its run resumed from the next larger world's."""
    tmp = tmp_path_factory.mktemp("shards")
    runs = {8: _launch(tmp, 8)}
    runs[4] = _launch(tmp, 4, load_from=tmp / "world8" / "rank0.pt")
    runs[2] = _launch(tmp, 2, load_from=tmp / "world4" / "rank0.pt")
    return runs


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("world,run", [(2, "fresh"), (4, "fresh"), (8, "fresh"), (2, "resumed"), (4, "resumed")])
def test_sharded_equals_replicated_bit_for_bit(runs, world, dtype, run):
    ranks = [r[run] for r in runs[world]]
    states = ranks[0]["states"]
    # rank 0's assembled memory is the replicated memory, entry for entry
    _assert_states_equal(states[f"sharded_{dtype}"], states[f"replicated_{dtype}"], f"world {world}")
    assert states[f"sharded_{dtype}"]["memory"].dtype == getattr(torch, dtype)
    for rank, result in enumerate(ranks):
        for step in result["selections"]:
            assert torch.equal(step[f"sharded_{dtype}"], step[f"replicated_{dtype}"]), (rank, step)
        assert result["local_rows"][f"sharded_{dtype}"] == (owned_rows(N, world, rank), C)
        if rank:  # only rank 0 assembles the memory; the replicated scores agree on every rank
            assert result["states"][f"sharded_{dtype}"]["memory"] is None
            assert torch.equal(result["states"][f"sharded_{dtype}"]["scores"], states[f"replicated_{dtype}"]["scores"])
    selected = sum(int(step[f"sharded_{dtype}"].sum()) for r in ranks for step in r["selections"])
    assert selected > 0  # the selections compared are not all empty


@pytest.mark.parametrize("writer,reader", [(8, 4), (4, 2)])
def test_a_checkpoint_loads_into_another_world_size_and_layout(runs, writer, reader):
    """Each memory of the reader loaded the writer's state of the other layout (sharded from
    replicated and back): the same memory, whatever wrote it."""
    written = runs[writer][0]["fresh"]["states"]
    for rank in range(reader):
        restored = runs[reader][rank]["resumed"]["restored"]
        for name, state in restored.items():
            if rank == 0 or "replicated" in name:
                _assert_states_equal(state, written[name], f"{writer} -> {reader}, rank {rank}: {name}")
            else:
                assert torch.equal(state["scores"], written[name]["scores"])


def test_bad_layouts_and_states_are_refused_by_name():
    with pytest.raises(ValueError, match="num_shards"):
        ShardedTimeConsistency(10, 2, 0.5, num_shards=0, shard=0)
    with pytest.raises(ValueError, match="cannot be split over 11 processes.*memory_layout='replicated'"):
        ShardedTimeConsistency(10, 2, 0.5, num_shards=11, shard=0)
    with pytest.raises(ValueError, match="`shard` must be in 0..1"):
        ShardedTimeConsistency(10, 2, 0.5, num_shards=2, shard=2)
    with pytest.raises(ValueError, match="storage_dtype"):
        TimeConsistency(10, 2, 0.5, storage_dtype="int8")
    two = ShardedTimeConsistency(10, 2, 0.5, num_shards=2, shard=1)
    with pytest.raises(RuntimeError, match="split over 2 processes, but the process group has 1"):
        two.update(torch.arange(4), torch.full((4, 2), 0.5))
    state = TimeConsistency(10, 2, 0.5).state_dict()
    with pytest.raises(ValueError, match="for 10 samples x 2 classes, but this training set has 12 x 2"):
        ShardedTimeConsistency(12, 2, 0.5, num_shards=2, shard=0).load_state_dict(state)
    with pytest.raises(ValueError, match="other than global rank 0.*load the checkpoint file that rank 0 wrote"):
        two.load_state_dict({**state, "memory": None})
    with pytest.raises(ValueError, match="one entry per gathered row \\(3\\).*Fix: pass every rank"):
        route_to_owners(torch.rand(2, 2), torch.arange(2), torch.ones(2, dtype=torch.bool), [3], 1, 0)
    with pytest.raises(ValueError, match="of version 2; this package reads version 3"):
        two.load_state_dict({**state, "version": 2})


def test_a_float32_state_loads_into_16_bit_storage():
    old = TimeConsistency(6, 3, 0.5)
    old.update(torch.arange(6), torch.softmax(torch.randn(6, 3), dim=1))
    state = old.state_dict()
    half = ShardedTimeConsistency(6, 3, 0.5, num_shards=1, shard=0, storage_dtype="float16")
    half.load_state_dict(state)
    assert half.local_rows.dtype == torch.float16
    assert torch.equal(half.state_dict()["memory"], old.memory.half()) and torch.equal(half.scores, old.scores)


def test_a_sharded_memory_has_no_memory_attribute_of_another_meaning():
    """``memory`` of a replicated memory is row i = dataset index i; a shard's rows are other
    indices (j * num_shards + shard), kept under another name so no reader mistakes them."""
    tcs = ShardedTimeConsistency(10, 3, 0.5, num_shards=4, shard=1)
    assert tcs.local_rows.shape == (3, 3)  # indices 1, 5 and 9
    with pytest.raises(AttributeError, match="local_rows.*full_memory"):
        tcs.memory  # noqa: B018
