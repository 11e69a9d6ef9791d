"""The table and the time-to-accuracy numbers of benchmarks/medmnist_table.py, on made-up runs."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from PIL import Image

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "medmnist_table.py"


def _module():
    spec = importlib.util.spec_from_file_location("medmnist_table", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(method: str, seed: int, accs: list[float], seconds: float) -> dict:
    curve = [{"epoch": i, "train_seconds": seconds * (i + 1), "test_acc": a, "test_auc": a, "val_auc": a}
             for i, a in enumerate(accs)]
    return {"flag": "breastmnist", "method": method, "seed": seed, "epochs": len(accs), "best_epoch": len(accs) - 1,
            "test_acc": accs[-1], "test_auc": accs[-1], "wall_seconds": seconds * len(accs), "curve": curve}


def test_table_and_time_to_accuracy(tmp_path):
    table = _module()
    results = [
        _run("baseline", 0, [0.70, 0.80, 0.82], 10.0),
        _run("baseline", 1, [0.70, 0.84, 0.83], 10.0),
        _run("randaugment", 0, [0.60, 0.70, 0.75], 11.0),
        _run("lpa3", 0, [0.75, 0.83, 0.85], 25.0),  # reaches 0.82 at 50 s; baseline at 30 s
        _run("lpa3", 1, [0.70, 0.80, 0.81], 25.0),  # never reaches 0.84
    ]
    text = table.summarize(results, tmp_path)
    assert "| breastmnist | baseline | 0.825 +- 0.007 |" in text
    assert "| breastmnist | lpa3 | 0.830 +- 0.028 | 0.830 +- 0.028 | 0.830 +- 0.028 |" in text  # ACC, AUC, last ACC
    assert (tmp_path / "table.md").read_text().strip() == text
    notes = table.plot(results, tmp_path)
    assert notes == [
        "breastmnist seed 0: baseline test acc 0.820 first at 30.0 s; LP-A3 reached it at 50.0 s = 1.67x",
        "breastmnist seed 1: baseline test acc 0.830 first at 20.0 s; LP-A3 never reached it",
        "breastmnist: median time-to-baseline-test-acc ratio 1.67x over 1 seeds; 1 seed(s) never reached it",
        # the selection metric: the baseline's best validation AUC (0.82 at 30 s; 0.84 at 20 s)
        "breastmnist seed 0: baseline best val AUC 0.820 first at 30.0 s; LP-A3 reached it at 50.0 s = 1.67x",
        "breastmnist seed 1: baseline best val AUC 0.840 first at 20.0 s; LP-A3 never reached it",
        "breastmnist: median time-to-baseline-best-val-AUC ratio 1.67x over 1 seeds; 1 seed(s) never reached it",
    ]
    with Image.open(tmp_path / "time_to_accuracy.png") as image:
        assert image.size[0] > 300 and image.size[1] > 200


def test_best_epoch_is_chosen_by_validation_auc_not_test():
    table = _module()
    rows = [{"epoch": 0, "val_auc": 0.7, "test_acc": 0.9}, {"epoch": 1, "val_auc": 0.8, "test_acc": 0.6},
            {"epoch": 2, "val_auc": 0.8, "test_acc": 0.7}]
    assert table.select_best(rows)["epoch"] == 1  # best validation AUC, earliest on ties


def test_tau_is_tuned_on_validation_auc_over_the_papers_values_only(tmp_path):
    table = _module()

    def run(method, seed, val_auc, test_acc):
        r = _run(method, seed, [test_acc], 10.0)
        r["val_auc"] = val_auc
        return r

    results = [run("baseline", 0, 0.8, 0.80), run("lpa3", 0, 0.85, 0.81), run("lpa3_tau0.2", 0, 0.90, 0.70),
               run("lpa3_maxstep1", 0, 0.99, 0.99)]  # not a tau value: never the tuned row
    assert table.tuned_lpa3(results, "breastmnist") == "lpa3_tau0.2"
    text = table.summarize(results, tmp_path)
    assert "| breastmnist | lpa3, tau tuned on val AUC (lpa3_tau0.2) | 0.700 +- 0.000 |" in text
    # a variant with other seeds than the rest is not compared
    assert table.tuned_lpa3(results + [run("lpa3_tau0.9", 1, 0.95, 0.9)], "breastmnist") is None
    assert table.tuned_lpa3(results[:2], "breastmnist") is None


def test_flag_epochs_override_the_budget_and_refuse_unknown_flags():
    table = _module()
    assert table._parse_flag_epochs(["pneumoniamnist=20"], ["breastmnist", "pneumoniamnist"], 100) == {
        "breastmnist": 100, "pneumoniamnist": 20}
    import pytest

    with pytest.raises(SystemExit, match="--flag-epochs"):
        table._parse_flag_epochs(["retinamnist=5"], ["breastmnist"], 100)
    with pytest.raises(SystemExit, match="--flag-epochs"):
        table._parse_flag_epochs(["breastmnist=0"], ["breastmnist"], 100)


def test_a_run_past_its_deadline_stops_after_the_epoch_and_leaves_a_partial_file(tmp_path):
    import time

    from lpa3_lightning.data import EMBEDDED_DATA_DIR

    table = _module()
    result = table.run("breastmnist", str(EMBEDDED_DATA_DIR), "baseline", 0, 2, tmp_path, "cpu", stop_at=time.time(),
                       limit_train_batches=1)
    assert result["complete"] is False and len(result["curve"]) == 1
    assert (tmp_path / "breastmnist_baseline_e2_seed0.partial.json").is_file()
    assert not (tmp_path / "breastmnist_baseline_e2_seed0.json").exists()  # left out of tables


def test_parallel_runs_write_results_and_the_table(tmp_path):
    import subprocess
    import sys

    from lpa3_lightning.data import EMBEDDED_DATA_DIR

    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--flags", "breastmnist", "--methods", "baseline", "--seeds", "0", "1",
         "--epochs", "1", "--jobs", "2", "--threads", "1", "--root", str(EMBEDDED_DATA_DIR), "--out", str(tmp_path),
         "--limit-train-batches", "1"],
        capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "breastmnist_baseline_e1_seed0.json").is_file()
    assert (tmp_path / "breastmnist_baseline_e1_seed1.json").is_file()
    assert "| breastmnist | baseline |" in (tmp_path / "table.md").read_text()
    bad = subprocess.run([sys.executable, str(SCRIPT), "--jobs", "0"], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "--jobs" in bad.stderr
