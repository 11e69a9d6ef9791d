"""Two CPU processes (gloo): the TCS memory stays identical on every rank, the selection equals
a single-process run over the same global order, a rank that selects nothing neither deadlocks
nor trips DDP over unused twin-BN parameters, and rank 0's checkpoint holds the synced state."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DistributedSampler

from lpa3_lightning import TimeConsistency
from lpa3_lightning.core.distributed import (
    bytes_per_sample,
    deduplicate_first,
    exchange_sizes,
    gather_padded,
    gather_rows,
)
from tests.ddp.run_ddp import EPOCHS, N_PADDED, PER_RANK_BATCH, N, no_bn_net
from tests.helpers import indexed_images, lpa3_state

SCRIPT = Path(__file__).resolve().parent / "ddp" / "run_ddp.py"
pytestmark = pytest.mark.ddp


def _run(tmp_path: Path, mode: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """One launch of two processes; a hang fails after ``timeout`` seconds (the watchdog kills both)."""
    launch = subprocess.Popen([sys.executable, str(SCRIPT), str(tmp_path), mode], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=SCRIPT.parents[2], start_new_session=True)
    try:
        stdout, stderr = launch.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(launch.pid, signal.SIGKILL)  # rank 1 is a child of rank 0: the whole group
        stdout, stderr = launch.communicate()
        pytest.fail(f"{mode}: the two processes did not end in {timeout} s (a hang)\n{stdout[-2000:]}{stderr[-2000:]}")
    return subprocess.CompletedProcess(launch.args, launch.returncode, stdout, stderr)


#: the runs that end normally, made one after the other in one launch of two processes (their
#: start-up is most of a short run's time); the runs that must fail (a refusal on one rank) and
#: the one whose whole log is read get their own launch
SHARED_MODES = ("ignore_aug", "ignore_aug+sharded", "supervised", "empty_rank1", "padded", "padded+sharded", "fixmatch",
                "pes", "dividemix", "dividemix_stratified", "noise_full", "noise_first", "noise_resume", "syncbn_dividemix",
                "syncbn_pes_grid", "user_module", "seed_differs")


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ddp_shared")
    done = subprocess.run([sys.executable, str(SCRIPT), str(out), ",".join(SHARED_MODES)], capture_output=True,
                          text=True, timeout=1200, cwd=SCRIPT.parents[2])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (out / "log.txt").write_text(done.stdout + done.stderr)
    return out


def _results(shared: Path, mode: str) -> tuple[dict, dict]:
    return tuple(torch.load(shared / mode / f"rank{r}.pt", weights_only=False) for r in (0, 1))  # type: ignore[return-value]


def _same_on_both_ranks(tcs0: dict, tcs1: dict) -> None:
    """Scores, seen flags, threshold and stored predictions equal on both ranks (a memory this
    small is kept whole on every rank)."""
    for key in ("scores", "seen", "threshold", "memory"):
        assert torch.equal(tcs0[key], tcs1[key]) or bool(tcs0[key].isnan().all() & tcs1[key].isnan().all()), key


def _single_process_reference() -> tuple[dict[int, list[torch.Tensor]], TimeConsistency]:
    """The same training as mode 'ignore_aug', in one process over the same global order."""
    data = indexed_images(N)
    x_all = torch.stack([data[i][0] for i in range(N)])
    y_all = torch.stack([data[i][1] for i in range(N)])
    torch.manual_seed(0)
    net = no_bn_net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
    tcs = TimeConsistency(N, 3, 0.5)
    masks: dict[int, list[torch.Tensor]] = {0: [], 1: []}
    for epoch in range(EPOCHS):
        orders = []
        for rank in (0, 1):
            sampler = DistributedSampler(data, num_replicas=2, rank=rank, shuffle=True, seed=0)
            sampler.set_epoch(epoch)
            orders.append(list(sampler))
        for k in range(N // (2 * PER_RANK_BATCH)):
            batches = [torch.tensor(order[k * PER_RANK_BATCH:(k + 1) * PER_RANK_BATCH]) for order in orders]
            for rank, batch in enumerate(batches):
                mask = tcs.select(batch)
                masks[rank].append(torch.zeros_like(mask) if int(mask.sum()) == 1 else mask)
            idx = torch.cat(batches)
            logits = net(x_all[idx])
            # DDP averages the two ranks' mean losses
            loss = 0.5 * (F.cross_entropy(logits[:PER_RANK_BATCH], y_all[idx[:PER_RANK_BATCH]])
                          + F.cross_entropy(logits[PER_RANK_BATCH:], y_all[idx[PER_RANK_BATCH:]]))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            tcs.update(idx, logits.detach().softmax(1))
        tcs.refresh_threshold()
    return masks, tcs


def test_memory_identical_on_both_ranks_and_selection_equals_single_process(shared):
    rank0, rank1 = _results(shared, "ignore_aug")
    _same_on_both_ranks(rank0["tcs"], rank1["tcs"])
    assert bool(rank0["tcs"]["seen"].all())

    masks, reference = _single_process_reference()
    for rank, result in ((0, rank0), (1, rank1)):
        got = [mask for _, mask in result["steps"]]
        assert len(got) == len(masks[rank])
        for step, (a, b) in enumerate(zip(got, masks[rank])):
            assert torch.equal(a, b), (rank, step)
    torch.testing.assert_close(rank0["tcs"]["memory"], reference.memory, atol=1e-5, rtol=0)
    torch.testing.assert_close(rank0["tcs"]["scores"], reference.scores, atol=1e-5, rtol=0)

    # rank 0 wrote the checkpoint: it holds the synced memory
    saved = lpa3_state(shared / "ignore_aug" / "final.ckpt")["tcs"]
    assert torch.equal(saved["memory"], rank0["tcs"]["memory"])


@pytest.mark.parametrize("mode", ["ignore_aug", "padded"])
def test_the_sharded_memory_runs_the_same_fit_as_the_replicated_one(shared, mode):
    """Under DDP each rank keeps half the stored predictions: the same selections, memory (as rank
    0 assembles it), scores and weights as the run where every rank keeps all of them."""
    sharded, replicated = _results(shared, mode + "+sharded"), _results(shared, mode)
    for rank in (0, 1):
        assert len(sharded[rank]["steps"]) == len(replicated[rank]["steps"])
        for (idx_a, a), (idx_b, b) in zip(sharded[rank]["steps"], replicated[rank]["steps"]):
            assert torch.equal(idx_a, idx_b) and torch.equal(a, b), rank
        assert sharded[rank]["applied"] == replicated[rank]["applied"]
        for key, value in sharded[rank]["params"].items():
            assert torch.equal(value, replicated[rank]["params"][key]), key
    for key in ("memory", "scores", "seen", "threshold"):
        assert torch.equal(sharded[0]["tcs"][key], replicated[0]["tcs"][key]), key
    assert torch.equal(replicated[1]["tcs"]["memory"], replicated[0]["tcs"]["memory"])  # (whole on both)
    assert sharded[1]["tcs"]["memory"] is None  # (rank 0's state assembled the split memory)
    assert sum(int(m.sum()) for _, m in sharded[0]["steps"]) > 0


@pytest.mark.parametrize("mode, expected", [
    # the step's one reduction; the memory's size exchange and its gather (int64 columns, float32 rows)
    ("ignore_aug", {"all_reduce": 1, "all_gather": 3}),
    # split memory: rows to their owners (all-to-all), the owners' divergences summed (an all-reduce)
    ("ignore_aug+sharded", {"all_reduce": 2, "all_gather": 2, "all_to_all_single": 1}),
    # a rank without x' joins the same collectives as the other
    ("empty_rank1", None),
])
def test_each_step_makes_one_reduction_and_the_memory_exchange(shared, mode, expected):
    """Counted from torch.distributed's functions during the callback's batch hooks, every step."""
    rank0, rank1 = _results(shared, mode)
    assert len(rank0["collectives"]) == len(rank1["collectives"]) == EPOCHS * N // 16
    for step, (a, b) in enumerate(zip(rank0["collectives"], rank1["collectives"])):
        assert a == b, step  # the same collectives on both ranks, step by step
        if expected is not None:
            assert a == expected, step
        else:  # with a cache the new x' travel too, by gathers: still one reduction
            assert a["all_reduce"] == 1, step


def test_ranks_seeded_differently_agree_on_the_callbacks_seed_and_its_random_first_pass(shared):
    rank0, rank1 = _results(shared, "seed_differs")
    from lpa3_lightning.core.tcs import random_selection

    # rank 0's: its torch seed is 1000, rank 1's 1001 (tests/ddp/run_ddp.py); not the largest of them
    assert rank0["seed"] == rank1["seed"] == 1000
    share = random_selection(N, 0.5, rank0["seed"], epoch=0)  # rank 0's seed: the one share
    for result in (rank0, rank1):
        for idx, mask in result["steps"][:N // 16]:  # the first pass, before any threshold
            expected = share[idx]
            assert torch.equal(mask, torch.zeros_like(expected) if int(expected.sum()) == 1 else expected)


def test_supervised_mixin_with_twin_bn_and_cache_under_ddp(shared):
    rank0, rank1 = _results(shared, "supervised")
    _same_on_both_ranks(rank0["tcs"], rank1["tcs"])
    for key in rank0["params"]:  # DDP kept the replicas equal, twins included
        assert torch.equal(rank0["params"][key], rank1["params"][key]) or "running" in key or "tracked" in key, key
    assert sum(int(m.sum()) for _, m in rank0["steps"]) > 0
    # the x' cache is synced: both ranks hold every rank's x'
    for key in ("written", "storage"):
        assert torch.equal(rank0["cache"][key], rank1["cache"][key]), key
    assert int((rank0["cache"]["written"] >= 0).sum()) > PER_RANK_BATCH * 2


def test_a_rank_that_selects_nothing_neither_deadlocks_nor_fails(shared):
    rank0, rank1 = _results(shared, "empty_rank1")
    # seen from the modules: rank 1 trained on no x', rank 0 did (its harness empties rank 1's selection)
    assert sum(rank1["seen_augmented"]) == 0 and sum(rank0["seen_augmented"]) > 0
    _same_on_both_ranks(rank0["tcs"], rank1["tcs"])
    twin_keys = [k for k in rank0["params"] if ".twin." in k and k.endswith(("weight", "bias"))]
    assert twin_keys and all(torch.equal(rank0["params"][k], rank1["params"][k]) for k in twin_keys)


def test_padded_duplicates_update_each_sample_once_an_epoch(shared):
    rank0, rank1 = _results(shared, "padded")
    _same_on_both_ranks(rank0["tcs"], rank1["tcs"])
    assert rank0["applied"] == {epoch: N_PADDED for epoch in range(EPOCHS)}


def test_bad_input_on_one_rank_stops_every_rank_with_the_reason(tmp_path):
    done = _run(tmp_path, "bad_rank1")  # the 300 s timeout would raise on a hang
    assert done.returncode != 0
    log = done.stdout + done.stderr
    assert "Labels out of range (simulated on one rank)" in log
    assert "another process failed in this step" in log


def test_the_exchange_is_a_no_op_in_one_process_and_dedup_keeps_first():
    idx, probs = torch.tensor([2, 0]), torch.rand(2, 3)
    assert exchange_sizes(2) == [2]
    out = gather_padded([idx, probs], [2])
    assert out[0] is idx and out[1] is probs
    assert gather_rows(idx, probs)[1] is probs
    assert deduplicate_first(torch.tensor([5, 5, 1, 5, 1])).tolist() == [True, False, True, False, False]
    assert deduplicate_first(torch.tensor([], dtype=torch.long)).numel() == 0
    assert bytes_per_sample(10) == 8 + 8 + 8 + 40


def test_a_user_written_module_trains_through_warmup_under_ddp(shared):
    """The README recipe has no twin anchor of its own: the callback ties the twins into every
    step, so the warm-up (no x' anywhere) does not fail with unused parameters."""
    # the callback's per-epoch logs are torchmetrics aggregates synced across ranks: no Lightning
    # warning asks for sync_dist=True (in the log of every shared run)
    assert "sync_dist=True" not in (shared / "log.txt").read_text()
    rank0, rank1 = _results(shared, "user_module")
    for state in (rank0, rank1):
        assert state["seen_augmented"][: N // (2 * PER_RANK_BATCH)] == [0] * (N // (2 * PER_RANK_BATCH))
        assert sum(state["seen_augmented"]) > 0  # after the warm-up x' was trained
    torch.testing.assert_close(rank0["tcs"]["scores"], rank1["tcs"]["scores"])
    # DDP kept the replicas equal, twins included (BN running statistics are per rank after the last step)
    for key, value in rank0["params"].items():
        if "running" not in key and "tracked" not in key:
            torch.testing.assert_close(value, rank1["params"][key], msg=key)
    assert "lpa3/label_preserved_epoch" in rank0["metrics"]


@pytest.mark.parametrize("mode, reason", [("bad_index_rank1", "LPA3Request.indices` out of range"),
                                          ("crash_rank1", "lpa3_request failed on one rank"),
                                          # after the step's reduction: the rank withdraws from the memory's exchange
                                          ("on_augmented_rank1", "on_augmented failed on one rank"),
                                          # at the fit's start, named by its setting
                                          ("cache_dir_rank1", "`cache.dir`"),
                                          # after the step's reduction, in the x' cache's exchange
                                          ("cache_put_rank1", "x' cache write failed on one rank")])
def test_a_refusal_on_one_rank_stops_every_rank(tmp_path, mode, reason):
    done = _run(tmp_path, mode)
    assert done.returncode != 0
    assert reason in done.stdout + done.stderr
    # the other rank stops at the step's next exchange with the package's word, not a dropped connection
    # (gloo's "Connection closed by peer" once rank 1 has exited; NCCL would wait for its watchdog)
    assert "LPA3Callback stopped because another process failed" in done.stdout + done.stderr


def test_fixmatch_under_ddp_keeps_one_tcs_memory_over_the_unlabeled_set(shared):
    rank0, rank1 = _results(shared, "fixmatch")
    _same_on_both_ranks(rank0["tcs"], rank1["tcs"])
    assert rank0["tcs"]["num_samples"] == 64 and bool(rank0["tcs"]["seen"].all())  # both ranks' samples applied
    assert sum(p["num_augmented"] for p in rank0["parts"] + rank1["parts"]) > 0


def test_dividemix_keeps_two_memories_each_identical_on_both_ranks(shared):
    rank0, rank1 = _results(shared, "dividemix")
    assert set(rank0["tcs"]) == {"net1", "net2"}
    for name in ("net1", "net2"):
        _same_on_both_ranks(rank0["tcs"][name], rank1["tcs"][name])
        assert bool(rank0["tcs"][name]["seen"].all())  # both ranks' samples applied to each memory
        assert torch.equal(rank0["clean_prob"][name], rank1["clean_prob"][name])  # one split everywhere
        cache0, cache1 = rank0["cache"][name], rank1["cache"][name]
        assert torch.equal(cache0["written"], cache1["written"]) and bool((cache0["written"] >= 0).any())
        assert torch.equal(cache0["storage"], cache1["storage"])
    assert not torch.equal(rank0["tcs"]["net1"]["memory"], rank0["tcs"]["net2"]["memory"])
    for key, value in rank0["params"].items():  # DDP kept the two replicas of both networks equal
        assert torch.allclose(value.float(), rank1["params"][key].float(), atol=1e-6), key
    for name in ("net1", "net2"):  # each network's epoch aggregates are synced across the ranks
        key = f"lpa3/{name}/selected_fraction_epoch"
        assert rank0["metrics"][key] == pytest.approx(rank1["metrics"][key]) and rank0["metrics"][key] > 0


def test_the_stratified_dividemix_split_is_the_same_on_both_ranks(shared):
    rank0, rank1 = _results(shared, "dividemix_stratified")
    assert rank0["stratified_count"] == rank1["stratified_count"]
    assert set(rank0["stratified_count"]) == {"net1", "net2"}
    for name, count in rank0["stratified_count"].items():
        w = rank0["clean_prob"][name]
        assert torch.equal(w, rank1["clean_prob"][name])  # one split everywhere
        assert set(w.unique().tolist()) <= {0.0, 1.0} and int(w.sum()) == count  # the kept count, as 0/1


def test_pes_splits_the_same_way_on_both_ranks_through_all_three_phases(shared):
    rank0, rank1 = _results(shared, "pes")
    assert torch.equal(rank0["labeled"], rank1["labeled"])  # the agreement split, all-reduced
    assert 0 < int(rank0["labeled"].sum()) < N
    _same_on_both_ranks(rank0["tcs"], rank1["tcs"])
    for key, value in rank0["params"].items():  # the refine phase's partial update kept the replicas equal
        assert torch.allclose(value, rank1["params"][key], atol=1e-6), key
    assert rank0["metrics"]["lpa3/selected_fraction_epoch"] > 0
    # x' were trained in the semi phase (the label-preservation share exists only where the training
    # forward of x' ran) and kept their label there
    assert rank0["metrics"]["lpa3/label_preserved_epoch"] >= 0.99


def test_each_rank_draws_its_own_solver_noise_after_a_resume(shared):
    """Resumed from epoch 0's checkpoint, every rank's epoch-1 x' (its solver noise included) equal
    an uninterrupted run's on that rank (once, rank 0's generator state was restored on every rank)."""
    runs = {mode: _results(shared, mode) for mode in ("noise_full", "noise_resume")}
    for rank in (0, 1):
        full = [(idx, x) for epoch, idx, x in runs["noise_full"][rank]["x_prime"] if epoch == 1]
        resumed = [(idx, x) for epoch, idx, x in runs["noise_resume"][rank]["x_prime"] if epoch == 1]
        assert len(full) == len(resumed) == N // (2 * PER_RANK_BATCH)
        assert sum(len(idx) for idx, _ in full) > 0
        for (idx_a, x_a), (idx_b, x_b) in zip(full, resumed):
            assert torch.equal(idx_a, idx_b), rank
            torch.testing.assert_close(x_b, x_a, rtol=0, atol=1e-6, msg=f"rank {rank}")


@pytest.mark.parametrize("mode", ["syncbn_dividemix", "syncbn_pes_grid"])
def test_every_rank_makes_the_same_synced_batchnorm_forwards(shared, mode):
    """A train-mode SyncBatchNorm forward is a collective on a GPU: a rank that skips one (PES's
    guess with no unlabeled row, DivideMix's co-refinement with no labeled row, the image grid's
    request, whose guess forward ran on rank 0 only) leaves the others waiting. A counting stand-in on the CPU: every rank
    makes as many as the others."""
    rank0, rank1 = _results(shared, mode)
    assert rank0["synced_forwards"] > 0
    assert rank0["synced_forwards"] == rank1["synced_forwards"]
    if mode == "syncbn_pes_grid":
        # rank 0 draws it; rank 1, whose rows in PES's semi-supervised phase (the only one that trains x', the only
        # one with a grid) are all labeled, has no image to draw, but made the request's synced forwards all the same
        assert rank0["grid"] is not None


def test_an_override_that_differs_by_rank_stops_every_rank_with_its_name(tmp_path):
    """``lpa3_consumes_augmented`` answering True on rank 0 and False on rank 1: every rank stops
    with the override's name (the step's one reduction carries the decision), none waits for ever."""
    done = _run(tmp_path, "consumes_rank0", timeout=180)  # the watchdog: a hang fails here
    assert done.returncode != 0
    log = done.stdout + done.stderr
    assert "lpa3_consumes_augmented" in log and "every rank" in log


def test_a_rank_zero_only_state_dict_of_a_sharded_memory_fails_at_once(tmp_path):
    """``if trainer.is_global_zero: callback.state_dict()`` on a memory split over the ranks: rank 0
    is told at once how to save it (no collective that rank 1 never joins); the run ends."""
    done = _run(tmp_path, "state_dict_rank0", timeout=180)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rank0, rank1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    assert rank0["layout"] == "ShardedTimeConsistency"
    assert "split over 2 processes" in rank0["outcome"] and "save_checkpoint" in rank0["outcome"]
    assert rank1["outcome"] == "returned"


def test_an_ordinary_ddp_run_keeps_the_whole_memory_on_every_rank(shared):
    """``memory_layout='auto'`` splits the memory only where it pays (hundreds of MB): a run of 48
    samples keeps every row on every rank, so ``callback.runner().tcs.memory`` means the same on each."""
    rank0, rank1 = _results(shared, "supervised")
    for key in ("memory", "scores", "seen", "threshold"):
        assert torch.equal(rank0["tcs"][key], rank1["tcs"][key]), key
    assert rank0["tcs"]["memory"].shape == (N, 3)
