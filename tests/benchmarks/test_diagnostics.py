"""The two diagnostics in benchmarks/ run on the smallest setting and print what their docs say:
noisy_diagnose.py (PES, and DivideMix given the true split) and saturation.py (on a checkpoint
trained for one step); bad input is refused naming the flag and the fix."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.ssl_table import contradiction

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"


def _script(name: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCHMARKS / name), *args, "--threads", "1"], capture_output=True,
                          text=True, timeout=600, cwd=ROOT)


def test_noisy_diagnose_counts_the_labels_pes_and_lpa3_train_on():
    done = _script("noisy_diagnose.py", "--epochs", "2", "--warmup", "1", "--limit-train-batches", "3")
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("epoch")]
    assert len(lines) == 2
    assert lines[0].startswith("epoch  0: labeled clean -, guess right -, x' label right -, x' share -")  # warm-up
    assert re.match(r"epoch  1: labeled clean 0\.\d{3}, guess right 0\.\d{3}, x' label right 0\.\d{3}, "
                    r"x' share \d\.\d{3}, test acc 0\.\d{3}$", lines[1]), lines[1]


def test_noisy_diagnose_scores_a_true_split_as_perfect():
    # --oracle-split hands each network the truth: its labeled set is the 20% of clean labels, all of them
    done = _script("noisy_diagnose.py", "--method", "dividemix", "--epochs", "2", "--warmup", "1", "--lpa3",
                   "--per-class", "--oracle-split", "--limit-train-batches", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout.splitlines()
    assert out[0] == "clean labels: 800 of 4000"
    assert out[1].startswith("epoch  0: warm-up (no split); test acc net1 ")
    epoch1 = next(line for line in out if line.startswith("epoch  1:"))
    for net in ("net1", "net2"):
        assert f"{net}: labeled 0.200 precision 1.000 recall 1.000 AUROC 1.000" in epoch1
    assert any(line.startswith("    net1 labeled per class [") for line in out)


def test_noisy_diagnose_refuses_a_flag_of_the_other_method(capsys):
    spec = importlib.util.spec_from_file_location("noisy_diagnose", BENCHMARKS / "noisy_diagnose.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for argv, named in ((["--oracle-split"], "--oracle-split only applies to --method dividemix"),
                        (["--method", "dividemix", "--confidence", "0.9"], "--confidence only applies to --method pes"),
                        (["--method", "dividemix", "--freeze-count"], "--freeze-count needs --balanced-split")):
        with pytest.raises(SystemExit) as stopped:
            module.main(argv)
        assert stopped.value.code == 2 and named in capsys.readouterr().err


def test_saturation_prints_every_bn_mode_and_step_cap(tmp_path):
    import lightning.pytorch as pl

    from lpa3_lightning import LPA3Classifier
    from lpa3_lightning.data import MedMNISTDataModule

    pl.seed_everything(0)
    trainer = pl.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    trainer.fit(LPA3Classifier(), datamodule=MedMNISTDataModule("breastmnist", batch_size=8))
    ckpt = tmp_path / "one_step.ckpt"
    trainer.save_checkpoint(ckpt)

    done = _script("saturation.py", "--ckpt", str(ckpt), "--batch-size", "8")
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout.splitlines()
    assert out[0] == f"{ckpt}: 8 training images of breastmnist"
    rows = [line.split()[:2] for line in out[2:]]
    assert rows == [[mode, cap] for mode in ("twin", "eval") for cap in ("None", "auto", "1.0", "0.5")]

    missing = _script("saturation.py", "--ckpt", str(tmp_path / "none.ckpt"))
    assert missing.returncode == 1 and "--ckpt" in missing.stderr and "make demo" in missing.stderr


def test_a_tally_at_chance_beside_a_high_accuracy_is_flagged_and_the_reverse_too():
    assert "near chance" in contradiction({"masked_acc": 0.10, "raw_test_acc": 0.79, "masked_count": 224}, 10)
    assert "near chance" in contradiction({"masked_acc": 0.95, "raw_test_acc": 0.11, "masked_count": 224}, 10)
    assert contradiction({"masked_acc": 0.93, "raw_test_acc": 0.90, "masked_count": 224}, 10) is None
    assert contradiction({"masked_acc": 0.10, "raw_test_acc": 0.12, "masked_count": 224}, 10) is None  # both low
    assert contradiction({"masked_acc": 0.0, "raw_test_acc": 0.53, "masked_count": 3}, 10) is None  # too few counted
    assert contradiction({"masked_acc": None, "raw_test_acc": 0.9}, 10) is None
