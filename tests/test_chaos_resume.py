"""The chaos run (benchmarks/chaos_resume.py): training SIGKILLed at chosen moments, relaunched
from its last checkpoint each time, ends bitwise equal to the uninterrupted run. The suite runs
its fast variant: a single process killed after an epoch's last checkpoint (the epoch boundary,
in the warm-up) and during a validation, with the x' cache in memory; and two DDP processes, one
rank killed mid-epoch. The whole run (>= 10 kills over every point, one and two processes, with
and without the cache, in memory and on disk): ``python benchmarks/chaos_resume.py``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.chaos_resume import POINTS, SCENARIOS, Kill, differences, draw_schedule

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.ddp


def test_the_fast_chaos_run_ends_bitwise_equal(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "chaos_resume.py"), "--fast", "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=900, cwd=ROOT, check=False)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert out.count("killed there") == 3, out
    for rank_line in ("1proc_cache_memory rank 0: bitwise equal", "ddp rank 0: bitwise equal",
                      "ddp rank 1: bitwise equal"):
        assert rank_line in out, out


def test_a_drawn_schedule_covers_every_point_and_replays_from_its_seed():
    schedule = draw_schedule(7, 12, list(SCENARIOS))
    kills = [k for ks in schedule.values() for k in ks]
    assert len(kills) == 12 and {k.point for k in kills} == set(POINTS)
    assert {k.epoch == 0 for k in kills} == {True, False}  # in the warm-up and after it
    assert {k.rank for name, ks in schedule.items() if SCENARIOS[name][0] == 2 for k in ks} == {0, 1}
    for ks in schedule.values():
        assert ks == sorted(ks) and len(set(ks)) == len(ks)  # each launch gets further than the last
    assert all(k.rank == 0 for k in kills if k.point == "checkpoint_write")  # (rank 0 writes them)
    assert draw_schedule(7, 12, list(SCENARIOS)) == schedule
    assert Kill.at("checkpoint_write", 1, 0).step == 4 and Kill.at("epoch_first_step", 1, 0).step == 3


def test_the_comparison_is_bitwise():
    nan = torch.tensor([float("nan"), 1.0])
    assert differences({"a": [nan, 2]}, {"a": [nan.clone(), 2]}) == []
    assert differences(torch.tensor([0.0]), torch.tensor([-0.0])) != []  # equal by ==, not by their bits
    assert differences({"a": torch.ones(2)}, {"a": torch.ones(3)}) != []
    assert differences({"a": 1}, {"b": 1}) != []
