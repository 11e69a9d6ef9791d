"""Exact resume: a run SIGKILLed mid-epoch and resumed from its last checkpoint ends bitwise
equal to an uninterrupted run (TCS memory, threshold, cached x', weights). The training loader's
own tests: tests/data/test_train_loader.py."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import torch

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
