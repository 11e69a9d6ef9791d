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
              "lpa3_confidence", "augment", "noise_norm", "mean_input_distance", "eval_every"}
SSL_CURVE = {"step", "train_seconds", "test_acc", "raw_test_acc", "mask_rate", "masked_count", "masked_acc",
             "xprime_per_step", "xprime_kept_rate", "xprime_kept_acc", "selected_fraction",
             "xprime_perceptual_distance", "xprime_label_preserved", "xprime_input_distance"}
NOISY_FIELDS = {"source", "rate", "actual_noise", "method", "seed", "epochs", "warmup", "refine", "lambda_u",
                "batch_size", "final_test_acc", "best_test_acc", "wall_seconds", "curve", "torch_threads", "commit",
                "noise_convention", "augment"}
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
                    "mnist5k_r50_any_ce_e1_seed0.json", NOISY_FIELDS, "| mnist5k | 50% sym | ce |"),
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
        assert result["augment"] == "lpa3" and result["mean_input_distance"] > 0
    if script == "noisy_table":
        assert result["epochs"] == 1 and len(result["curve"]) == 1
        assert set(result["curve"][-1]) == NOISY_CURVE
        # the references' convention by default: a re-draw over all ten classes keeps a tenth of the drawn labels
        # right, so about 45% of the labels are wrong at a rate of 0.5 (4,000 labels: a std of 0.008)
        assert result["noise_convention"] == "any" and 0.42 < result["actual_noise"] < 0.48
    assert any(line.startswith(row) for line in done.stdout.splitlines()), done.stdout


def test_the_noise_control_takes_the_norm_of_its_paired_lp_a3_run(tmp_path):
    """ssl_table's fixmatch_noise reads the mean input distance of the same seed's fixmatch_lpa3 run, and its own
    x' lie at that distance (measured by the callback's lpa3/input_distance, inside the input box); without the
    LP-A3 run it refuses to start, naming it."""
    flags = ["--labels", "10", "--seeds", "0", "--steps", "2", "--eval-every", "1", "--lpa3-warmup", "0",
             "--lpa3-confidence", "0", "--solve-trained-only", "--threads", "1", "--jobs", "1", "--out", str(tmp_path)]
    script = str(ROOT / "benchmarks" / "ssl_table.py")
    alone = subprocess.run([sys.executable, script, *flags, "--methods", "fixmatch_noise"], capture_output=True,
                           text=True, timeout=600, cwd=ROOT)
    assert alone.returncode != 0 and "run fixmatch_lpa3 with the same flags and seed first" in alone.stderr
    paired = subprocess.run([sys.executable, script, *flags, "--methods", "fixmatch_lpa3", "fixmatch_noise"],
                            capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert paired.returncode == 0, paired.stderr[-3000:]
    lpa3 = json.loads((tmp_path / "mnist5k_10_fixmatch_lpa3_trained_c0_s2_seed0.json").read_text())
    noise = json.loads((tmp_path / "mnist5k_10_fixmatch_noise_trained_c0_s2_seed0.json").read_text())
    assert noise["augment"] == "noise" and noise["noise_norm"] == lpa3["mean_input_distance"] > 0
    assert noise["mean_input_distance"] == pytest.approx(noise["noise_norm"], rel=1e-3)
