"""benchmarks/paired_curves.py through its command line on run JSONs written here: the paired
differences and interval against a computation by hand, and partial JSONs left out."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
T_975_DF2 = 4.302652729911275  # Student-t quantile 0.975 with 2 degrees of freedom (tables)


def write_run(folder: Path, method: str, seed: int, curve: list[float], *, partial: bool = False) -> None:
    name = f"{method}_seed{seed}{'.partial' if partial else ''}.json"
    points = [{"step": 25 * (i + 1), "raw_test_acc": a, "test_acc": a - 0.1} for i, a in enumerate(curve)]
    (folder / name).write_text(json.dumps({"method": method, "seed": seed, "curve": points, "wall_seconds": 60.0}))


def test_the_last_three_and_curve_mean_differences_match_a_computation_by_hand(tmp_path):
    base = {100: [0.2, 0.4, 0.5, 0.6, 0.7], 101: [0.3, 0.3, 0.6, 0.6, 0.6], 102: [0.1, 0.5, 0.5, 0.7, 0.8]}
    arm = {100: [0.3, 0.5, 0.6, 0.6, 0.8], 101: [0.3, 0.4, 0.6, 0.7, 0.6], 102: [0.2, 0.5, 0.7, 0.7, 0.8]}
    for seed in base:
        write_run(tmp_path, "base", seed, base[seed])
        write_run(tmp_path, "arm", seed, arm[seed])
    write_run(tmp_path, "arm", 103, [1.0] * 5, partial=True)  # unfinished: not counted
    out = tmp_path / "rows.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "paired_curves.py"), str(tmp_path),
                    "--pairs", "arm:base", "--json", str(out)], check=True, capture_output=True, cwd=ROOT)
    rows = {row["measure"]: row for row in json.loads(out.read_text())}
    last3 = [sum(arm[s][-3:]) / 3 - sum(base[s][-3:]) / 3 for s in (100, 101, 102)]
    curve = [sum(arm[s]) / 5 - sum(base[s]) / 5 for s in (100, 101, 102)]
    for measure, diffs in (("last3", last3), ("curve_mean", curve)):
        row = rows[measure]
        mean = sum(diffs) / 3
        std = math.sqrt(sum((d - mean) ** 2 for d in diffs) / 2)
        assert row["seeds"] == [100, 101, 102]
        assert math.isclose(row["mean"], mean, abs_tol=1e-12)
        half = T_975_DF2 * std / math.sqrt(3)
        assert math.isclose(row["ci"][0], mean - half, rel_tol=1e-6)
        assert math.isclose(row["ci"][1], mean + half, rel_tol=1e-6)
    # raw_test_acc, not the EMA's test_acc, is the measure: the constant 0.1 offset would cancel anyway,
    # so check the arm's own level in the printed table instead
    printed = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "paired_curves.py"), str(tmp_path),
                              "--pairs", "arm:base"], check=True, capture_output=True, text=True, cwd=ROOT).stdout
    arm_last3 = sum(sum(arm[s][-3:]) / 3 for s in arm) / 3
    assert f"| arm | 100, 101, 102 | {arm_last3:.3f}" in printed


def test_a_pair_of_the_wrong_form_is_refused(tmp_path):
    write_run(tmp_path, "base", 100, [0.5] * 3)
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "paired_curves.py"), str(tmp_path),
                           "--pairs", "arm-base"], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode != 0 and "ARM:BASE" in done.stderr


def test_noisy_table_runs_are_read_by_test_acc_and_the_runs_below_the_base_counted(tmp_path):
    # noisy_table.py's JSON: per-epoch points with `test_acc` only; E2 counts the runs of an arm below `ce`
    base = {100: [0.2, 0.5, 0.6], 101: [0.3, 0.4, 0.5], 102: [0.1, 0.6, 0.7]}
    arm = {100: [0.1, 0.4, 0.5], 101: [0.3, 0.5, 0.6], 102: [0.1, 0.5, 0.6]}
    for method, curves in (("ce", base), ("pes", arm)):
        for seed, curve in curves.items():
            points = [{"epoch": e, "test_acc": a} for e, a in enumerate(curve)]
            (tmp_path / f"{method}_seed{seed}.json").write_text(
                json.dumps({"method": method, "seed": seed, "curve": points, "wall_seconds": 1.0}))
    out = tmp_path / "rows.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "paired_curves.py"), str(tmp_path),
                    "--pairs", "pes:ce", "--json", str(out)], check=True, capture_output=True, cwd=ROOT)
    row = next(r for r in json.loads(out.read_text()) if r["measure"] == "last3")
    by_hand = [sum(arm[s]) / 3 - sum(base[s]) / 3 for s in (100, 101, 102)]
    assert row["below"] == sum(d < 0 for d in by_hand) == 2
    assert row["above"] == 1
    assert all(math.isclose(a, b, abs_tol=1e-12) for a, b in zip(row["diffs"], by_hand))


def test_a_spread_too_wide_to_size_prints_the_cap_not_none(tmp_path):
    # differences of -30 / +30 / -30 points: no number of seeds up to the cap finds +1 point at 80% power
    base = {100: [0.5] * 3, 101: [0.5] * 3, 102: [0.5] * 3}
    arm = {100: [0.2] * 3, 101: [0.8] * 3, 102: [0.2] * 3}
    for method, curves in (("base", base), ("arm", arm)):
        for seed, curve in curves.items():
            write_run(tmp_path, method, seed, curve)
    printed = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "paired_curves.py"), str(tmp_path),
                              "--pairs", "arm:base"], check=True, capture_output=True, text=True, cwd=ROOT).stdout
    row = next(line for line in printed.splitlines() if line.startswith("| arm minus base | last3"))
    assert row.rstrip().endswith("| > 1000 / > 1000 |") and "None" not in printed
