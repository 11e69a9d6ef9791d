"""``lpa3 compare``: a config run with LP-A3 and with it off on paired seeds, a JSON per run, the paired
statistics (checked against SciPy), a second call that trains nothing, a failed run named with its log, the
off arm equal to the config without the callback, the null arm training x' = x, the three-arm summary, and a
comparison under 2-process DDP."""

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
from lpa3_lightning.cli.compare import summarize

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
    for s in (0, 1, 2):  # what each arm did, as its callback measured it in the last epoch
        assert runs[f"lpa3_seed{s}"]["lpa3_last_epoch"]["lpa3/input_distance_epoch"] > 0
        assert runs[f"off_seed{s}"]["lpa3_last_epoch"] == {}
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


def test_the_off_arm_is_the_config_without_the_callback_and_null_trains_x_prime_equal_to_x(work, capsys):
    """The off arm: the same test metrics, bit for bit, as `lpa3 fit` of the config with LPA3Callback removed (one
    thread; the seed given to seed_everything and to the data module, whose shuffle takes one, as the comparison
    gives it). The null arm (``--arms null off``): its callback selected rows and trained them at x' = x."""
    out = work / "out"
    main(["compare", "--config", "config.yaml", "--seeds", "4", "--out", str(out), "--arms", "null", "off"])
    assert sorted(p.name for p in out.glob("*.json")) == ["null_seed4.json", "off_seed4.json"]
    assert "null - off over 1 seeds" in capsys.readouterr().out
    null = json.loads((out / "null_seed4.json").read_text())["lpa3_last_epoch"]
    assert null["lpa3/selected_fraction_epoch"] > 0 and null["lpa3/input_distance_epoch"] == 0
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
    (["--seeds", "0", "--arms", "lpa3"], "give two or more distinct arms"),
    (["--seeds", "0", "--arms", "lpa3", "noise"], "'noise' is not an arm; the arms are lpa3, null, off. The noise"),
    (["--seeds", "0", "--arms", "off", "off"], "give two or more distinct arms"),
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


def test_the_summary_of_three_arms_pairs_each_with_off_and_lpa3_with_null():
    """summarize() on run records written here: the rows lpa3 - off, null - off and lpa3 - null, each mean the
    hand-computed one, and each arm's wall-time ratio to its base."""
    acc = {"lpa3": [0.80, 0.70, 0.90], "null": [0.78, 0.71, 0.85], "off": [0.75, 0.65, 0.86]}
    wall = {"lpa3": 30.0, "null": 12.0, "off": 10.0}
    runs = {(arm, seed): {"metrics": {"test/acc": acc[arm][seed]}, "wall_seconds": wall[arm]}
            for arm in acc for seed in range(3)}
    text = summarize(runs, [0, 1, 2], ["lpa3", "null", "off"])
    for arm, base in (("lpa3", "off"), ("null", "off"), ("lpa3", "null")):
        line = next(line for line in text.splitlines() if line.startswith(f"test/acc: {arm} - {base} over 3 seeds"))
        mean = sum(a - b for a, b in zip(acc[arm], acc[base])) / 3
        assert float(re.search(r"mean ([+-][\d.]+)", line).group(1)) == pytest.approx(mean, abs=1e-4)
        assert f"fit wall time: {arm} / {base} = {wall[arm] / wall[base]:.2f}x" in text
    assert text.splitlines()[0].split() == ["seed", "lpa3:test/acc", "null:test/acc", "off:test/acc", "lpa3:s",
                                            "null:s", "off:s"]
    # the pairs follow the arms' fixed order whatever order they are given in
    given_order = summarize(runs, [0, 1, 2], ["null", "off", "lpa3"])
    assert [line.split(" over")[0] for line in given_order.splitlines() if " over 3 seeds" in line] == [
        "test/acc: lpa3 - off", "test/acc: null - off", "test/acc: lpa3 - null"]
    # a spread too wide to size prints the cap, as benchmarks/paired_curves.py does
    wide = {(arm, seed): {"metrics": {"test/acc": 0.5 + (0.9 if arm == "lpa3" and seed == 1 else 0.0)},
                          "wall_seconds": 1.0} for arm in ("lpa3", "off") for seed in range(3)}
    assert "+1 point (0.01) needs > 1000 seeds, +2 points > 1000" in summarize(wide, [0, 1, 2])
    # the default arms print what they printed before: one pair
    assert "null" not in summarize({k: v for k, v in runs.items() if k[0] != "null"}, [0, 1, 2])


def test_summary_only_reports_the_arms_found_in_the_folder(work, capsys):
    out = work / "out"
    out.mkdir()
    for arm, shift in (("lpa3", 0.02), ("null", 0.01), ("off", 0.0)):
        for seed in (0, 1, 2):
            record = {"arm": arm, "seed": seed, "metrics": {"test/acc": 0.7 + shift + 0.01 * seed * (arm == "lpa3")},
                      "wall_seconds": 10.0}
            (out / f"{arm}_seed{seed}.json").write_text(json.dumps(record))
    main(["compare", "--config", "config.yaml", "--seeds", "0", "1", "2", "--out", str(out), "--summary-only"])
    printed = capsys.readouterr().out
    assert "test/acc: lpa3 - null over 3 seeds" in printed and "test/acc: null - off over 3 seeds" in printed


@pytest.mark.parametrize("callback_args, arm, message", [
    ("augment: 'null'", "lpa3", "arm lpa3 runs the config as given, but its LPA3Callback has augment='null'"),
    ("cache: {regenerate_every_n_epochs: 2}", "null", "arm null cannot run this config"),
])
def test_a_worker_refuses_an_arm_its_config_cannot_give(work, callback_args, arm, message, capsys):
    (work / "other.yaml").write_text(CONFIG.replace("warmup_epochs: 1, seed: 0}", f"warmup_epochs: 1, seed: 0, "
                                                                                   f"{callback_args}}}"))
    with pytest.raises(SystemExit) as info:
        main(["compare", "--worker", arm, "0", "--config", "other.yaml", "--out", str(work / "out")])
    assert message in str(info.value)
