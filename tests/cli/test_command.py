"""The `lpa3` command (lpa3_lightning.cli.command): LightningCLI over the shipped configs, fit then test,
`python -m lpa3_lightning`, the console script, and the saved config."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lpa3_lightning import LPA3Callback, LPA3Classifier
from lpa3_lightning.cli import LPA3CLI, build_cli, main
from lpa3_lightning.data import MedMNISTDataModule

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "medmnist"


def _instantiate(config: Path, *overrides: str) -> LPA3CLI:
    return build_cli(["--config", str(config), *overrides], run=False)


@pytest.mark.parametrize(
    ("name", "ratio", "randaugment"),
    [("baseline", None, False), ("randaugment", None, True), ("lpa3_tau0.2", 0.2, False),
     ("lpa3_tau0.5", 0.5, False), ("lpa3_tau0.9", 0.9, False), ("lpa3_maxstep1", 0.5, False),
     ("demo_breastmnist_lpa3", 0.2, False)],
)
def test_each_config_builds_the_paper_setting(name, ratio, randaugment, tmp_path):
    cli = _instantiate(CONFIGS / f"{name}.yaml", f"--trainer.default_root_dir={tmp_path}",
                       f"--trainer.logger.init_args.save_dir={tmp_path}")
    assert isinstance(cli.model, LPA3Classifier) and isinstance(cli.datamodule, MedMNISTDataModule)
    callbacks = [c for c in cli.trainer.callbacks if isinstance(c, LPA3Callback)]
    if ratio is None:
        assert not callbacks
    else:
        assert len(callbacks) == 1 and callbacks[0].ratio == ratio and callbacks[0].sigma == 0.02
        assert callbacks[0].solver.max_step == (1.0 if name == "lpa3_maxstep1" else "auto")
    assert cli.datamodule.hparams.randaugment is randaugment
    if not name.startswith("demo"):
        assert cli.trainer.max_epochs == 100 and list(cli.model.hparams.milestones) == [50, 75]


def test_fit_then_test_from_the_command_line(tmp_path, capsys):
    main([
        "fit", "--config", str(CONFIGS / "demo_breastmnist_lpa3.yaml"),
        f"--trainer.default_root_dir={tmp_path}", f"--trainer.logger.init_args.save_dir={tmp_path}",
        "--trainer.max_epochs=2", "--trainer.limit_train_batches=2", "--trainer.limit_val_batches=2",
        "--trainer.limit_test_batches=2", "--trainer.enable_progress_bar=false",
        "--data.init_args.batch_size=8", "--model.init_args.milestones=[1]",
    ])
    out = capsys.readouterr().out
    assert "=== LP-A3 run finished ===" in out
    assert "test/acc:" in out and "test/auc:" in out
    assert list(tmp_path.rglob("*.ckpt")), "no checkpoint written"
    assert list(tmp_path.rglob("events.out.tfevents.*")), "no TensorBoard log written"
    assert (tmp_path / "version_0" / "config.yaml").exists() or list(tmp_path.rglob("config.yaml"))


def test_python_dash_m_is_the_same_command():
    done = subprocess.run([sys.executable, "-m", "lpa3_lightning", "fit", "--help"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "--test_after_fit" in done.stdout and "--config" in done.stdout


def test_lpa3_console_script_is_installed():
    script = Path(sys.executable).parent / "lpa3"
    assert script.exists(), "the `lpa3` console script is not installed next to the interpreter"
    done = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "fit" in done.stdout and "test" in done.stdout


def test_model_and_data_mismatch_is_refused_before_training(tmp_path):
    cli = _instantiate(CONFIGS / "demo_breastmnist_lpa3.yaml", "--model.init_args.num_classes=5",
                       f"--trainer.default_root_dir={tmp_path}", f"--trainer.logger.init_args.save_dir={tmp_path}")
    with pytest.raises(ValueError, match="--model.init_args.num_classes 2"):
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)


def _lpa3(cli: LPA3CLI) -> LPA3Callback:
    (callback,) = [c for c in cli.trainer.callbacks if isinstance(c, LPA3Callback)]
    return callback


def _settings(callback: LPA3Callback) -> dict:
    return {"ratio": callback.ratio, "sigma": callback.sigma, "steps": callback.steps, "solver": callback.solver,
            "selection": callback.selection, "cache": callback.cache,
            "logging": callback.logging}


def test_the_saved_config_equals_the_settings_that_ran(tmp_path):
    """``preset: authors`` with an explicit solver group: the group runs as written, and the config
    the run saved rebuilds exactly the settings that ran."""
    text = (CONFIGS / "demo_breastmnist_lpa3.yaml").read_text()
    explicit = "        preset: authors\n        solver:\n          project: true\n          max_step: auto\n" \
               "          allow_tf32: false\n        selection:\n          initial_selection: random\n"
    config = tmp_path / "authors_with_solver.yaml"
    config.write_text(text.replace("        solver:\n          attack_bn: auto\n", explicit))
    assert config.read_text() != text
    cli = build_cli(["fit", "--config", str(config), f"--trainer.default_root_dir={tmp_path}",
                     f"--trainer.logger.init_args.save_dir={tmp_path}", "--trainer.max_epochs=1",
                     "--trainer.limit_train_batches=2", "--trainer.limit_val_batches=2",
                     "--trainer.enable_progress_bar=false", "--test_after_fit=false",
                     "--data.init_args.batch_size=8"])
    ran = _lpa3(cli)
    assert (ran.solver.project, ran.solver.max_step, ran.solver.allow_tf32) == (True, "auto", False)
    assert ran.selection.initial_selection == "random"
    import yaml

    saved = yaml.safe_load((Path(cli.trainer.log_dir) / "config.yaml").read_text())
    for key in ("ckpt_path", "weights_only"):  # (arguments of `fit` itself, not of the objects it builds)
        saved.pop(key, None)
    again = tmp_path / "saved_again.yaml"
    again.write_text(yaml.safe_dump(saved))
    rebuilt = _lpa3(_instantiate(again, f"--trainer.default_root_dir={tmp_path}"))
    assert _settings(rebuilt) == _settings(ran)


def test_the_lpa3_command_imports_a_module_from_the_current_folder(tmp_path):
    """As ``python -m lpa3_lightning`` does: a console script's sys.path holds its own folder, not the
    working one, so ``--model my_module.MyModule`` of a file beside the config failed to import."""
    (tmp_path / "bin").mkdir()
    script = tmp_path / "bin" / "lpa3"  # what pip writes for the console script
    script.write_text("import sys\nfrom lpa3_lightning.cli import main\nsys.exit(main())\n")
    work = tmp_path / "work"
    work.mkdir()
    (work / "my_module.py").write_text("from lpa3_lightning import LPA3Classifier\n\n\n"
                                       "class MyModule(LPA3Classifier):\n    pass\n")
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, str(script), "fit", "--model", "my_module.MyModule", "--print_config"],
                          capture_output=True, text=True, timeout=300, cwd=work, check=False,
                          env={**os.environ, "PYTHONPATH": str(root)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "class_path: my_module.MyModule" in done.stdout
