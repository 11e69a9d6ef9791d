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


def test_equal_compute_reads_the_arm_at_s_against_the_base_interpolated_at_ratio_s(tmp_path):
    # evaluations every 25 steps up to 125; at ratio 2.2 the arm's last step s with 2.2 s <= 125 is 50, and the
    # base is read at 110, 40% of the way from its step-100 to its step-125 evaluation
    base = {100: [0.1, 0.2, 0.3, 0.4, 0.9], 101: [0.2, 0.2, 0.4, 0.5, 0.5], 102: [0.1, 0.3, 0.3, 0.6, 0.8]}
    arm = {100: [0.3, 0.5, 0.9, 0.9, 0.9], 101: [0.3, 0.4, 0.9, 0.9, 0.9], 102: [0.2, 0.7, 0.9, 0.9, 0.9]}
    for method, curves in (("base", base), ("arm", arm)):
        for seed, curve in curves.items():
            write_run(tmp_path, method, seed, curve)
    out = tmp_path / "rows.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "paired_curves.py"), str(tmp_path), "--pairs",
                    "arm:base", "--equal-compute", "arm:base:2.2", "--json", str(out)], check=True,
                   capture_output=True, cwd=ROOT)
    row = next(r for r in json.loads(out.read_text()) if r["measure"].startswith("equal compute"))
    assert row["arm_step"] == 50 and math.isclose(row["base_step"], 110)
    by_hand = [arm[s][1] - (base[s][3] + 0.4 * (base[s][4] - base[s][3])) for s in (100, 101, 102)]
    assert all(math.isclose(a, b, abs_tol=1e-12) for a, b in zip(row["diffs"], by_hand))
    assert math.isclose(row["mean"], sum(by_hand) / 3, abs_tol=1e-12)


def test_an_equal_compute_reading_of_the_wrong_form_or_past_the_base_is_refused(tmp_path):
    for method in ("arm", "base"):
        write_run(tmp_path, method, 100, [0.5] * 3)
    script = [sys.executable, str(ROOT / "benchmarks" / "paired_curves.py"), str(tmp_path), "--pairs", "arm:base"]
    bad = subprocess.run([*script, "--equal-compute", "arm:base"], capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode != 0 and "ARM:BASE:RATIO" in bad.stderr
    # at ratio 4 even the arm's first evaluation (step 25) costs 100 base steps, past the base's last (75)
    past = subprocess.run([*script, "--equal-compute", "arm:base:4"], capture_output=True, text=True, cwd=ROOT)
    assert past.returncode != 0 and "no evaluation step" in past.stderr


def test_a_cached_run_is_its_own_arm_and_a_repeated_run_is_refused(tmp_path):
    # ssl_table.py writes the cache arm with the uncached run's method; its regenerate_every_n_epochs tells them apart
    for name, regenerate, level in (("lpa3.json", 1, 0.8), ("lpa3_k6.json", 6, 0.6), ("base.json", 1, 0.5)):
        points = [{"step": 100 * (i + 1), "raw_test_acc": level} for i in range(3)]
        method = "base" if name == "base.json" else "fixmatch_lpa3"
        (tmp_path / name).write_text(json.dumps({"method": method, "seed": 100, "curve": points,
                                                 "regenerate_every_n_epochs": regenerate, "wall_seconds": 1.0}))
    script = [sys.executable, str(ROOT / "benchmarks" / "paired_curves.py"), str(tmp_path)]
    printed = subprocess.run([*script, "--pairs", "fixmatch_lpa3:base", "fixmatch_lpa3_k6:base"], check=True,
                             capture_output=True, text=True, cwd=ROOT).stdout
    assert "| fixmatch_lpa3 minus base | last3 | +30.0 |" in printed
    assert "| fixmatch_lpa3_k6 minus base | last3 | +10.0 |" in printed
    # an arm the folder does not hold is named, with the arms it does hold
    typo = subprocess.run([*script, "--pairs", "fixmatch_lpa3_k10:base"], capture_output=True, text=True, cwd=ROOT)
    assert typo.returncode != 0 and "no run of arm(s) fixmatch_lpa3_k10" in typo.stderr
    assert "base, fixmatch_lpa3, fixmatch_lpa3_k6" in typo.stderr
    # plain FixMatch has no cache: its regenerate_every_n_epochs (ssl_table.py writes it for every run) names no arm
    plain = json.loads((tmp_path / "base.json").read_text())
    (tmp_path / "fixmatch.json").write_text(json.dumps({**plain, "method": "fixmatch", "regenerate_every_n_epochs": 6}))
    assert subprocess.run([*script, "--pairs", "fixmatch_lpa3:fixmatch"], capture_output=True, cwd=ROOT).returncode == 0
    # a second run of one arm and seed from another protocol is refused, with what differs
    (tmp_path / "again.json").write_text(json.dumps({**json.loads((tmp_path / "lpa3.json").read_text()), "labels": 40}))
    twice = subprocess.run([*script, "--pairs", "fixmatch_lpa3:base"], capture_output=True, text=True, cwd=ROOT)
    assert twice.returncode != 0 and "two runs of arm fixmatch_lpa3 seed 100" in twice.stderr
    assert "they differ in labels" in twice.stderr
