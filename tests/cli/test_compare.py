"""``lpa3 compare``: a config run with LP-A3 and with it off on paired seeds, a JSON per run, the paired
statistics (checked against SciPy), a second call that trains nothing, a failed run named with its log, the
off arm equal to the config without the callback, and a comparison under 2-process DDP."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lpa3_lightning.cli import main

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

CONFIG = """\
seed_everything: 0
trainer:
  max_epochs: 2
  limit_train_batches: 2
  limit_val_batches: 1
  limit_test_batches: 2
  accelerator: cpu
  devices: 1
  logger: false
  enable_progress_bar: false
  enable_model_summary: false
  callbacks:
    - class_path: lpa3_lightning.LPA3Callback
      init_args: {ratio: 0.5, sigma: 0.02, steps: 1, warmup_epochs: 1, seed: 0}
model:
  class_path: compare_module.Tiny
data:
  class_path: lpa3_lightning.data.MedMNISTDataModule
  init_args: {flag: breastmnist, batch_size: 32}
"""


@pytest.fixture()
def work(tmp_path, monkeypatch):
    """A folder with the config and the module it names (a user's own LightningModule), made the cwd."""
    shutil.copy(HERE / "compare_module.py", tmp_path / "compare_module.py")
    (tmp_path / "config.yaml").write_text(CONFIG)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return tmp_path


def test_three_paired_seeds_give_a_json_per_run_the_interval_and_a_second_call_trains_nothing(work, capsys):
    from scipy import stats

    out = work / "out"
    main(["compare", "--config", "config.yaml", "--seeds", "0", "1", "2", "--out", str(out), "--jobs", "2"])
    printed = capsys.readouterr().out
    runs = {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}
    assert sorted(runs) == [f"{arm}_seed{s}" for arm in ("lpa3", "off") for s in (0, 1, 2)]
    for name, record in runs.items():
        assert {"test/acc", "test/auc"} <= set(record["metrics"]) and record["wall_seconds"] > 0
        assert record["arm"] == name.split("_")[0] and record["configs"] == ["config.yaml"]
        assert record["torch_threads"] == 1 and "commit" in record
    assert printed.count("done: arm") == 6
    for metric in ("test/acc", "test/auc"):  # the printed row against SciPy on the JSON
        diffs = [runs[f"lpa3_seed{s}"]["metrics"][metric] - runs[f"off_seed{s}"]["metrics"][metric] for s in (0, 1, 2)]
        line = next(line for line in printed.splitlines() if line.startswith(f"{metric}: lpa3 - off over 3 seeds"))
        mean = float(re.search(r"mean ([+-][\d.]+)", line).group(1))
        assert mean == pytest.approx(sum(diffs) / 3, abs=1e-4)
        if len(set(diffs)) > 1:
            low, high = stats.t.interval(0.95, 2, loc=sum(diffs) / 3, scale=stats.sem(diffs))
            shown = re.search(r"interval \[([+-][\d.]+), ([+-][\d.]+)\]", line)
            assert (float(shown.group(1)), float(shown.group(2))) == pytest.approx((low, high), abs=1e-4)
    ratios = [runs[f"lpa3_seed{s}"]["wall_seconds"] / runs[f"off_seed{s}"]["wall_seconds"] for s in (0, 1, 2)]
    assert f"lpa3 / off = {sum(ratios) / 3:.2f}x" in printed
    # the same call again: every run is there, none is trained
    main(["compare", "--config", "config.yaml", "--seeds", "0", "1", "2", "--out", str(out), "--jobs", "2"])
    again = capsys.readouterr().out
    assert "6 already in" in again and "0 to run" in again and "start:" not in again
    # another config over the same folder is refused, naming the fix
    with pytest.raises(SystemExit):
        main(["compare", "--config", "config.yaml", "--seeds", "0", "--out", str(out), "--trainer.max_epochs=3"])
    assert "holds runs of another config" in capsys.readouterr().err


def test_the_off_arm_is_the_config_without_the_callback(work, capsys):
    """The same test metrics, bit for bit, as `lpa3 fit` of the config with LPA3Callback removed (one thread; the
    seed given to seed_everything and to the data module, whose shuffle takes one, as the comparison gives it)."""
    out = work / "out"
    main(["compare", "--config", "config.yaml", "--seeds", "4", "--out", str(out)])
    off = json.loads((out / "off_seed4.json").read_text())["metrics"]
    (work / "plain.yaml").write_text(re.sub(r"  callbacks:\n(    .*\n)+", "", CONFIG))
    script = ("import json, sys, torch\nfrom lpa3_lightning.cli.command import build_cli\ntorch.set_num_threads(1)\n"
              "cli = build_cli(['--config', 'plain.yaml', '--seed_everything=4', '--data.init_args.seed=4', "
              "'--trainer.default_root_dir=plain'], "
              "run=False)\ncli.trainer.fit(cli.model, datamodule=cli.datamodule)\n"
              "best = cli.trainer.checkpoint_callback.best_model_path\n"
              "print(json.dumps(cli.trainer.test(cli.model, datamodule=cli.datamodule, ckpt_path=best or None, "
              "verbose=False)[0]))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, cwd=work,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    plain = json.loads(done.stdout.strip().splitlines()[-1])
    assert off == pytest.approx(plain, abs=0)


def test_a_run_that_fails_is_named_with_its_log_and_the_others_go_on(work, capsys):
    out = work / "out"
    with pytest.raises(SystemExit) as info:
        main(["compare", "--config", "config.yaml", "--seeds", "5", "6", "--out", str(out),
              "--model.init_args.fail_seed=6"])
    assert info.value.code == 1
    err, printed = capsys.readouterr().err, ""
    assert "2 run(s) failed" in err and str(out / "logs" / "lpa3_seed6.log") in err
    assert "the test's failing seed 6" in (out / "logs" / "lpa3_seed6.log").read_text()
    assert sorted(p.name for p in out.glob("*.json")) == ["lpa3_seed5.json", "off_seed5.json"]


@pytest.mark.parametrize("arguments, message", [
    (["--seeds", "0", "0"], "repeats a seed"),
    (["--seeds", "0", "--jobs", "0"], "--jobs must be >= 1"),
    (["--config", "missing.yaml", "--seeds", "0"], "--config missing.yaml does not exist"),
])
def test_bad_arguments_are_refused_by_name(work, capsys, arguments, message):
    given = ["--config", "config.yaml"] if "--config" not in arguments else []
    with pytest.raises(SystemExit):
        main(["compare", *given, *arguments, "--out", str(work / "out")])
    assert message in capsys.readouterr().err


@pytest.mark.ddp
def test_a_comparison_under_two_process_ddp_ends(work):
    """One seed, each arm a 2-process DDP fit (gloo); the watchdog is the timeout."""
    out = work / "out"
    done = subprocess.run([sys.executable, "-m", "lpa3_lightning", "compare", "--config", "config.yaml", "--seeds",
                           "0", "--out", str(out), "--trainer.devices=2", "--trainer.strategy=ddp"],
                          capture_output=True, text=True, timeout=600, cwd=work)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    for arm in ("lpa3", "off"):
        record = json.loads((out / f"{arm}_seed0.json").read_text())
        assert record["world_size"] == 2 and "test/acc" in record["metrics"]
    assert torch.cuda.is_available() or "fit wall time" in done.stdout
