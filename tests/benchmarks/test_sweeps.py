"""Each sweep table, run through its command line on the smallest setting: the sweep starts one
worker, the worker writes its JSON with the fields the summaries and docs/*_runs use, and the
summary prints its row. (medmnist_table.py: tests/benchmarks/test_medmnist_table.py.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SSL_FIELDS = {"source", "labels", "method", "seed", "steps", "final_test_acc", "wall_seconds", "curve",
              "steps_per_epoch", "lpa3_warmup_epochs", "regenerate_every_n_epochs", "final_raw_test_acc", "num_workers",
              "auto_max_step_fraction", "solve_trained_only", "ema_decay", "ema", "torch_threads", "commit",
              "lpa3_confidence"}
SSL_CURVE = {"step", "train_seconds", "test_acc", "raw_test_acc", "mask_rate", "masked_count", "masked_acc",
             "xprime_per_step", "xprime_kept_rate", "xprime_kept_acc", "selected_fraction",
             "xprime_perceptual_distance", "xprime_label_preserved"}
NOISY_FIELDS = {"source", "rate", "actual_noise", "method", "seed", "epochs", "warmup", "refine", "lambda_u",
                "batch_size", "final_test_acc", "best_test_acc", "wall_seconds", "curve", "torch_threads", "commit"}
NOISY_CURVE = {"epoch", "train_seconds", "test_acc", "guess_acc", "xprime_acc", "selected_fraction",
               "xprime_perceptual_distance"}
TABULAR_FIELDS = {"dataset", "method", "seed", "epochs", "test_acc", "wall_s", "perceptual_distance",
                  "label_preserved"}
HARDNESS_FIELDS = {"model", "preset", "seed", "samples", "side", "twins", "bn_mode", "x_prime", "perceptual_median",
                   "perceptual_p10", "perceptual_p90", "l2_median", "rms_over_std_median", "projected", "barely_moved",
                   "label_preserved", "lpa3_epoch_over_plain", "wall_s"}

#: script, flags of one tiny run, its JSON file, its fields, the start of its summary row
CASES = {
    # LP-A3 from the first step (--lpa3-warmup 0), so the x' columns of the tally are filled
    "ssl_table": (["--labels", "10", "--methods", "fixmatch_lpa3", "--seeds", "0", "--steps", "2", "--eval-every", "1",
                   "--lpa3-warmup", "0"], "mnist5k_10_fixmatch_lpa3_s2_seed0.json", SSL_FIELDS,
                  "| mnist5k | 10 | fixmatch_lpa3 | 1 |"),
    "noisy_table": (["--rates", "0.5", "--methods", "ce", "--seeds", "0", "--epochs", "1"],
                    "mnist5k_r50_ce_e1_seed0.json", NOISY_FIELDS, "| mnist5k | 50% sym | ce |"),
    "tabular_table": (["--datasets", "breast_cancer", "--methods", "lpa3", "--seeds", "0", "--epochs", "2"],
                      "breast_cancer_lpa3_0.json", TABULAR_FIELDS, "breast_cancer  lpa3          1"),
    "hardness": (["--models", "small_cnn", "--presets", "package", "--seeds", "0", "--samples", "128"],
                 "small_cnn_package_0.json", HARDNESS_FIELDS, "small_cnn     package  twin      1"),
}


@pytest.mark.parametrize("script", sorted(CASES))
def test_a_sweep_runs_its_worker_and_summarises_the_json(script, tmp_path):
    flags, name, fields, row = CASES[script]
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / f"{script}.py"), *flags, "--threads", "1",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / name).read_text())
    assert set(result) == fields
    if script == "ssl_table":
        assert result["steps"] == 2 and [row["step"] for row in result["curve"]] == [1, 2]  # the flags reached it
        assert set(result["curve"][-1]) == SSL_CURVE
        assert result["curve"][-1]["xprime_per_step"] > 0  # x' were solved and tallied
        # FixMatch's EMA (BatchNorm buffers copied), not Lightning's, which averages them (its EMA column
        # scored 0.662 against 0.873 on PneumoniaMNIST, seed 0, 300 steps)
        assert result["ema"] == "FixMatchEMA, buffers copied"
    if script == "noisy_table":
        assert result["epochs"] == 1 and len(result["curve"]) == 1
        assert set(result["curve"][-1]) == NOISY_CURVE
    assert any(line.startswith(row) for line in done.stdout.splitlines()), done.stdout
