"""Exact resume: a run SIGKILLed mid-epoch, or in an epoch's first step (its last checkpoint was
written on the previous epoch's last batch), and resumed from its last checkpoint ends bitwise
equal to an uninterrupted run (TCS memory, threshold, cached x', weights). The training loader's
own tests: tests/data/test_sampling.py; Lightning's hooks after a resume:
tests/callback/test_resume_point.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parent / "resume" / "run_resume.py"


def _run(out: Path, mode: str, kill_at: int | str | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    extra = [] if kill_at is None else [str(kill_at)]
    return subprocess.run([sys.executable, str(SCRIPT), str(out), mode, *extra], capture_output=True, text=True,
                          timeout=300, cwd=SCRIPT.parents[2], env=env)


def _temp_on_another_device(out: Path) -> dict:
    """The environment with TMPDIR on another file system than ``out`` where there is one (tmpfs
    /dev/shm): Lightning's own save stages a checkpoint in TMPDIR and, across file systems, copies
    it over the previous one."""
    env = dict(os.environ)
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK) and shm.stat().st_dev != out.stat().st_dev:
        env["TMPDIR"] = str(shm)
    return env


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("full")
    full = _run(out, "full")
    assert full.returncode == 0, full.stderr[-3000:]
    return torch.load(out / "final.pt", weights_only=False)


@pytest.mark.parametrize("kill_at", [5, 6], ids=["mid_epoch", "epoch_1_last_batch"])
def test_sigkill_then_resume_equals_uninterrupted(tmp_path, uninterrupted, kill_at):
    """3 epochs of 3 steps, a checkpoint every step. Killed at the start of step 6, the last
    checkpoint is the one of epoch 1's last batch, written before that epoch's end: the resumed run
    must end it (the threshold) and train the next epoch whole. (Every step's checkpoint, epoch 0's
    last batch included: tests/callback/test_resume_point.py; more kill points: the chaos run.)"""
    killed = _run(tmp_path, "killed", kill_at)
    assert killed.returncode == -signal.SIGKILL, (killed.returncode, killed.stderr[-2000:])
    assert not (tmp_path / "final.pt").exists()
    resumed = _run(tmp_path, "resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    a, b = uninterrupted, torch.load(tmp_path / "final.pt", weights_only=False)
    # the resumed process ran only the steps after the crash
    assert len(b["seen_augmented"]) == 9 - kill_at and b["seen_augmented"] == a["seen_augmented"][kill_at:]
    for key in ("memory", "scores", "seen", "threshold"):
        assert torch.equal(a["tcs"][key], b["tcs"][key]), key
    for key in ("written", "storage"):
        assert torch.equal(a["cache"][key], b["cache"][key]), key
    for key in a["weights"]:
        assert torch.equal(a["weights"][key], b["weights"][key]), key


def test_a_kill_while_a_checkpoint_is_written_leaves_the_previous_one_and_resumes_exactly(tmp_path, uninterrupted):
    """Killed while step 5's checkpoint is written over last.ckpt: last.ckpt still holds step 4 and
    loads, and the run resumed from it ends bitwise equal to the uninterrupted run."""
    killed = _run(tmp_path, "killed", "write:5", env=_temp_on_another_device(tmp_path))
    assert killed.returncode == -signal.SIGKILL, (killed.returncode, killed.stderr[-2000:])
    assert torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)["global_step"] == 4
    resumed = _run(tmp_path, "resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = uninterrupted, torch.load(tmp_path / "final.pt", weights_only=False)
    assert b["seen_augmented"] == a["seen_augmented"][4:]
    for key in a["weights"]:
        assert torch.equal(a["weights"][key], b["weights"][key]), key
    for key in ("memory", "scores", "threshold"):
        assert torch.equal(a["tcs"][key], b["tcs"][key]), key
