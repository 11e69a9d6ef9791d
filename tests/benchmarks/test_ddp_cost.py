"""benchmarks/ddp_cost.py, both measures end to end on a tiny grid (gloo processes of one thread): the rows they
print, their byte counts against the formulas, and the process group's failure named rather than waited on."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.ddp_cost import memory_bytes, received_bytes, run_group
from lpa3_lightning.core.distributed import bytes_per_sample

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "ddp_cost.py"


def _run(*args: str) -> list[str]:
    done = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.splitlines()


def test_exchange_times_the_sync_beside_the_step():
    lines = _run("exchange", "--quick", "--batches", "8", "16", "--classes", "2")
    rows = [line.split() for line in lines if re.match(r" +2 +\d+ +2 ", line)]
    assert [row[1] for row in rows] == ["8", "16"]
    for row in rows:
        batch = int(row[1])
        assert int(row[3].replace(",", "")) == batch * bytes_per_sample(2)  # sent per rank and step
        assert int(row[4].replace(",", "")) == 2 * batch * bytes_per_sample(2)  # received: both ranks' rows
        assert float(row[5]) > 0
    # --quick times the step at the smallest batch only: 3 steps after one warm-up
    assert rows[0][7] == "[3,1]" and float(rows[0][6]) > 0 and float(rows[0][8]) > 0  # step ms, sync / step
    assert rows[1][6] == "skipped"
    assert any(line.startswith("for scale: DDP's gradient all-reduce of ResNet-18") for line in lines)


def test_memory_measures_both_layouts_and_matches_its_formulas():
    lines = _run("memory", "--num-samples", "100000", "--num-classes", "100", "--batch", "16", "--worlds", "2",
                 "--steps", "2", "--warmup", "1")
    rows = {row[1]: row for row in (line.split() for line in lines) if row[:1] == ["2"] and len(row) == 6}
    assert set(rows) == {"replicated", "sharded"}
    for layout, row in rows.items():
        assert float(row[2]) == pytest.approx(memory_bytes(100_000, 100, 2, 0, layout, 4) / 1e9, abs=5e-4)
        assert float(row[5]) > 0  # ms per step
    assert int(rows["replicated"][4].replace(",", "")) == received_bytes(2, 16, 100, "replicated", 16)
    assert float(rows["sharded"][2]) < float(rows["replicated"][2])
    assert any(line.startswith("Projection") for line in lines)


def _fails(rank: int, world: int, config: None) -> None:
    if rank == 1:
        raise SystemExit(3)


def test_a_failed_process_of_the_group_is_named():
    with pytest.raises(RuntimeError, match="world 2: a process exited with 3"):
        run_group(2, _fails, None)
