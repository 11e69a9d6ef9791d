"""Past one machine, on torchrun (the launcher users already have), two CPU processes over gloo:

* a rank lost mid-epoch (a real SIGKILL; torchrun then stops the job) and the same command
  launched again, resuming from the last checkpoint, end bitwise equal to an uninterrupted run: TCS memory (sharded), x' cache, weights, optimizer
  state, and every later step's x' on each rank (each rank's solver noise is its own again);
* the recipe of docs/multinode.md: a CLI config, unchanged, on two "nodes" (two torchrun agents
  on 127.0.0.1, one process each) ends with the TCS memory, selection scores and weights of the
  same config on one node with two processes;
* and against one process without DDP (the algorithm, not only the launcher): a config whose
  network has no BatchNorm, trained without x' (a warm-up as long as the run), on two nodes with
  8 rows each ends with the TCS memory and weights of one process with batches of 16, up to float
  rounding (the two ranks' batches together are the one process's batch: the same permutation).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DistributedSampler

from tests.helpers import lpa3_state

ROOT = Path(__file__).resolve().parents[1]
FIT_DDP = ROOT / "tests" / "multinode" / "fit_ddp.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]  # `torchrun` of this interpreter
pytestmark = pytest.mark.ddp


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(args: list[str]) -> subprocess.Popen:
    """A torchrun agent in its own process group, so that a hung job can be killed with its workers."""
    return subprocess.Popen([*TORCHRUN, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            env=_env(), start_new_session=True)


def _finish(agent: subprocess.Popen, timeout: float = 300, returncode: int = 0) -> str:
    """The agent's output once it ended with ``returncode`` (a hang fails after ``timeout`` s, its workers killed)."""
    try:
        output, _ = agent.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(agent.pid, signal.SIGKILL)
        output, _ = agent.communicate()
        pytest.fail(f"torchrun did not finish in {timeout} s:\n{output[-4000:]}")
    assert (agent.returncode == 0) == (returncode == 0), output[-4000:]
    return output


def _fit_ddp(out: Path, mode: str) -> list[dict]:
    output = _finish(_start(["--standalone", "--nproc_per_node", "2", str(FIT_DDP), str(out), mode]),
                     returncode=1 if mode == "killed" else 0)
    if mode == "killed":  # torchrun saw rank 1 die of SIGKILL, stopped rank 0 and failed
        assert f"exitcode: -{int(signal.SIGKILL)}" in output, output[-3000:]
        assert not (out / "rank0.pt").exists() and (out / "ckpt" / "last.ckpt").exists()
        return []
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]


def test_a_rank_killed_mid_epoch_resumes_under_torchrun_equal_to_an_uninterrupted_run(tmp_path):
    full = _fit_ddp(tmp_path / "full", "full")
    _fit_ddp(tmp_path / "crash", "killed")
    resumed = _fit_ddp(tmp_path / "crash", "resume")  # the same command again, as a requeue launches it
    for rank in (0, 1):
        a, b = full[rank], resumed[rank]
        # the loader passed to fit kept its own shuffle under DDP: each epoch is torch's DistributedSampler's share
        for epoch in range(3):
            sampler = DistributedSampler(range(48), num_replicas=2, rank=rank, shuffle=True, seed=0)
            sampler.set_epoch(epoch)
            assert torch.cat(a["indices"][3 * epoch:3 * epoch + 3]).tolist() == list(sampler)
        assert torch.cat(b["indices"]).tolist() == torch.cat(a["indices"][4:]).tolist()
        assert b["steps"] == a["steps"][4:]  # the restarted processes ran only the steps after the loss
        assert a["sharded"] == b["sharded"] == "ShardedTimeConsistency"  # (selection.memory_layout="sharded")
        for key in ("scores", "seen", "threshold"):
            assert torch.equal(a["tcs"][key], b["tcs"][key]), (rank, key)
        if rank == 0:  # rank 0's state assembles the whole memory
            assert torch.equal(a["tcs"]["memory"], b["tcs"]["memory"])
        for key in ("written", "storage"):
            assert torch.equal(a["cache"][key], b["cache"][key]), (rank, key)
        for key, value in a["params"].items():
            assert torch.equal(value, b["params"][key]), (rank, key)
        for key, state in a["optimizer"]["state"].items():
            assert torch.equal(state["momentum_buffer"], b["optimizer"]["state"][key]["momentum_buffer"])
        # each rank's x' after the restart, solver noise included, are the uninterrupted run's on that rank
        later = {step: (idx, x) for step, idx, x in a["x_prime"] if step >= 4}
        assert sorted(later) == [step for step, _, _ in b["x_prime"]]
        assert sum(len(idx) for idx, _ in later.values()) > 0
        for step, idx, x in b["x_prime"]:
            assert torch.equal(idx, later[step][0]) and torch.equal(x, later[step][1]), (rank, step)
    assert not torch.equal(full[0]["x_prime"][-1][2], full[1]["x_prime"][-1][2])  # the ranks' x' differ


CLI_RUN = ["-m", "lpa3_lightning", "fit", "--config", "configs/medmnist/lpa3_tau0.5.yaml",
           "--trainer.accelerator", "cpu", "--trainer.strategy", "ddp", "--trainer.max_epochs", "2",
           "--trainer.limit_train_batches", "0.05", "--trainer.limit_val_batches", "0.2", "--trainer.num_sanity_val_steps",
           "0", "--data.init_args.batch_size", "8",
           "--trainer.logger", "false", "--trainer.enable_progress_bar", "false", "--test_after_fit", "false"]


def _lpa3_checkpoint(root: Path) -> dict:
    return torch.load(root / "checkpoints" / "last.ckpt", weights_only=False)


def test_a_cli_config_on_two_torchrun_nodes_equals_one_node_with_two_processes(tmp_path):
    port = _free_port()
    nodes = [_start(["--nnodes", "2", "--node_rank", str(rank), "--nproc_per_node", "1", "--master_addr", "127.0.0.1",
                     "--master_port", str(port), *CLI_RUN, "--trainer.devices", "1", "--trainer.num_nodes", "2",
                     "--trainer.default_root_dir", str(tmp_path / "two_nodes")]) for rank in (0, 1)]
    for node in nodes:
        _finish(node)
    _finish(_start(["--standalone", "--nproc_per_node", "2", *CLI_RUN, "--trainer.devices", "2",
                    "--trainer.num_nodes", "1", "--trainer.default_root_dir", str(tmp_path / "one_node")]))
    two, one = _lpa3_checkpoint(tmp_path / "two_nodes"), _lpa3_checkpoint(tmp_path / "one_node")
    tcs_two, tcs_one = lpa3_state(two)["tcs"], lpa3_state(one)["tcs"]
    for key in ("memory", "scores", "seen", "threshold"):
        assert torch.equal(tcs_two[key], tcs_one[key]), key
    assert int(tcs_one["seen"].sum()) >= 2 * 8  # an epoch's batch on each of 2 processes: both ranks' rows
    for key, value in one["state_dict"].items():
        assert torch.equal(value, two["state_dict"][key]), key


def _single_process_config(tmp_path: Path) -> Path:
    """lpa3_tau0.5.yaml with a network without BatchNorm and a warm-up as long as the run."""
    text = (ROOT / "configs" / "medmnist" / "lpa3_tau0.5.yaml").read_text()
    text = text.replace("        ratio: 0.5\n", "        ratio: 0.5\n        warmup_epochs: 2\n")
    text = text.replace("    twin_bn: true\n", "    twin_bn: true\n    model:\n      class_path: tests.multinode.nets.NoBatchNormNet\n")
    path = tmp_path / "no_batchnorm.yaml"
    path.write_text(text)
    assert "warmup_epochs: 2" in text and "NoBatchNormNet" in text
    return path


def test_two_torchrun_nodes_equal_one_process_without_ddp(tmp_path):
    config = _single_process_config(tmp_path)
    run = [arg if arg != "configs/medmnist/lpa3_tau0.5.yaml" else str(config) for arg in CLI_RUN]
    run[run.index("--trainer.limit_train_batches") + 1] = "3"
    port = _free_port()
    nodes = [_start(["--nnodes", "2", "--node_rank", str(rank), "--nproc_per_node", "1", "--master_addr", "127.0.0.1",
                     "--master_port", str(port), *run, "--trainer.devices", "1", "--trainer.num_nodes", "2",
                     "--trainer.default_root_dir", str(tmp_path / "two_nodes")]) for rank in (0, 1)]
    for node in nodes:
        _finish(node)
    single = [arg for arg in run if arg not in ("--trainer.strategy", "ddp")]
    single[single.index("--data.init_args.batch_size") + 1] = "16"  # the two ranks' 2 x 8 rows
    _finish(_start(["--standalone", "--nproc_per_node", "1", *single, "--trainer.devices", "1",
                    "--trainer.default_root_dir", str(tmp_path / "one_process")]))
    two, one = _lpa3_checkpoint(tmp_path / "two_nodes"), _lpa3_checkpoint(tmp_path / "one_process")
    tcs_two, tcs_one = lpa3_state(two)["tcs"], lpa3_state(one)["tcs"]
    assert torch.equal(tcs_two["seen"], tcs_one["seen"]) and int(tcs_one["seen"].sum()) >= 3 * 16
    for key in ("memory", "scores"):
        torch.testing.assert_close(tcs_two[key], tcs_one[key], rtol=0, atol=1e-5, msg=key)
    torch.testing.assert_close(tcs_two["threshold"], tcs_one["threshold"], rtol=0, atol=1e-5)
    for key, value in one["state_dict"].items():
        torch.testing.assert_close(two["state_dict"][key], value, rtol=1e-4, atol=1e-5, msg=key)
