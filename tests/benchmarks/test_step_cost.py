"""benchmarks/step_cost.py, each measure end to end on the small CNN (one torch thread): what it prints and the
fields of its JSON, and that what it measured holds together (the noise control moves x' by LP-A3's distance,
LP-A3 reads the host more often than the plain step, gpu_summary.py reads the ratios' log lines)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.gpu_summary import overhead_figures

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "step_cost.py"
#: the quick model, and one solver step (each measure's figures are not the point here)
SMALL = ["--arch", "small_cnn", "--solver-steps", "1", "--threads", "1"]


def _run(measure: str, *args: str) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, str(SCRIPT), measure, *SMALL, *args], capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_ratios_put_the_controls_and_the_cache_beside_lpa3(tmp_path):
    out = tmp_path / "ratios.json"
    done = _run("ratios", "--epochs", "2", "--cached-epochs", "3", "--configs", "lpa3_noise", "lpa3_cached",
                "--json", str(out))
    results = json.loads(out.read_text())["results"]
    # baseline runs for the ratios, lpa3 for the noise's norm
    assert list(results) == ["baseline", "lpa3", "lpa3_noise", "lpa3_cached"]
    for r in results.values():
        assert r["step_s"] > 0 and r["peak_mb"] > 0 and r["repeats"] == 1
    assert set(results["lpa3_cached"]["epochs_s"]) == {"1", "2"}  # its own epochs; the others' 1 only
    assert set(results["lpa3"]["epochs_s"]) == {"1"}
    lpa3, noise = results["lpa3"], results["lpa3_noise"]
    assert results["baseline"]["input_distance"] is None
    assert noise["noise_norm"] == lpa3["input_distance"] > 0
    assert noise["input_distance"] == pytest.approx(noise["noise_norm"], rel=1e-4)  # each row moved by that norm
    assert lpa3["attack_s"] > 0 and lpa3["x_adv_pass_s"] > 0 and lpa3["steps_per_epoch"] == 5
    lines = done.stdout.splitlines()
    assert [line.split()[0] for line in lines if re.match(r"\w+ +\d+\.\d{3} +\d+\.\d\dx", line)] == list(results)
    assert any(line.startswith("floor per step: the baseline step") for line in lines)
    assert any(line.startswith("lpa3: step ") and line.endswith("x the floor") for line in lines)
    assert any(line.startswith("lpa3_noise: step ") and "x lpa3's" in line for line in lines)
    assert any(line.startswith("lpa3_cached: regeneration epoch") and "amortized over K=10" in line for line in lines)
    # a GPU session whose part stopped before the JSON reads the same figures from these lines
    figures = overhead_figures(None, done.stdout)
    assert figures["source"] == "log lines" and list(figures["configs"]) == list(results)
    assert figures["floor_step_s"] == pytest.approx(
        results["baseline"]["step_s"] + lpa3["attack_s"] + lpa3["x_adv_pass_s"])


def test_profile_lists_the_host_places_of_steady_steps(tmp_path):
    out = tmp_path / "profile.json"
    done = _run("profile", "--batch", "8", "--steps", "2", "--warm-steps", "1", "--rows", "5", "--stack",
                "--json", str(out))
    result = json.loads(out.read_text())
    assert (result["measure"], result["steps"], result["with_stack"]) == ("profile", 2, True)
    assert result["wall_ms_per_step"] > 0 and result["operators_per_step"] > 0
    assert len(result["self_cpu_ms_per_step_by_operator"]) == 5
    assert result["self_cpu_ms_per_step_by_python_function"]  # the Python tracer's functions
    assert not any("benchmarks/" in name for name in result["self_cpu_ms_per_step_by_python_function"])
    ms = [p["ms_per_step"] for p in result["top_host_places"]]
    assert len(ms) == 5 and ms == sorted(ms, reverse=True)
    # nothing of CUDA on the CPU
    assert result["kernel_launches_per_step"] == 0 and result["syncs_per_step"] == 0 and result["h2d_per_step"] == 0
    assert result["self_cuda_ms_per_step_by_operator"] is None and result["peak_mb"] is None
    assert done.stdout.splitlines()[-1].startswith("per step: 0 kernel launches")


def test_reads_count_more_host_reads_with_lpa3_than_without(tmp_path):
    out = tmp_path / "reads.json"
    done = _run("reads", "--batch", "64", "--sites", "5", "--json", str(out))
    runs = json.loads(out.read_text())["runs"]
    plain, lpa3 = runs["plain"], runs["LP-A3"]
    assert sum(lpa3["reads"].values()) > sum(plain["reads"].values()) > 0
    assert lpa3["operators"] > plain["operators"] > 0
    assert 0 < len(lpa3["sites"]) <= 5
    # each site is a line of the package (file:line and its code), or outside it
    assert all(re.match(r"\w+\.py:\d+ ", site) or site == "(outside)" for site, _ in lpa3["sites"])
    rows = [line for line in done.stdout.splitlines() if line.startswith(("| plain |", "| LP-A3 |"))]
    assert len(rows) == 2 and rows[0].endswith("| 1.0x |")


def test_logging_times_both_settings_on_the_same_steps(tmp_path):
    out = tmp_path / "logging.json"
    done = _run("logging", "--repeats", "1", "--epochs", "2", "--json", str(out))
    result = json.loads(out.read_text())
    every, sampled = result["settings"]["every step"], result["settings"]["default (sampled)"]
    assert every["steps"] == sampled["steps"] == 5  # epoch 1 of BreastMNIST at batch 128
    assert result["sampled_over_every_step"] == pytest.approx(sampled["mean_step_s"] / every["mean_step_s"])
    assert f"default / every step (mean step): {result['sampled_over_every_step']:.3f}" in done.stdout


def test_a_measure_is_required_and_an_unknown_one_refused_naming_the_measures():
    missing = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert missing.returncode == 2 and "the following arguments are required: MEASURE" in missing.stderr
    unknown = subprocess.run([sys.executable, str(SCRIPT), "speed"], capture_output=True, text=True, timeout=120,
                             cwd=ROOT)
    assert unknown.returncode == 2 and "invalid choice" in unknown.stderr
    assert all(measure in unknown.stderr for measure in ("ratios", "profile", "reads", "logging"))
