"""The `lpa3` command (LightningCLI) and the shipped configs."""

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


def _config_with_ratio(tmp_path: Path, value: str) -> Path:
    text = (CONFIGS / "lpa3_tau0.5.yaml").read_text()
    assert "ratio: 0.5" in text
    path = tmp_path / "bad.yaml"
    path.write_text(text.replace("ratio: 0.5", f"ratio: {value}"))
    return path


def test_bad_config_value_is_refused_by_the_parser(tmp_path, capsys):
    with pytest.raises(SystemExit):
        _instantiate(_config_with_ratio(tmp_path, "oops"), f"--trainer.default_root_dir={tmp_path}")
    err = capsys.readouterr().err
    assert "ratio" in err and "oops" in err


def test_out_of_range_ratio_in_a_config_is_refused_with_the_fix(tmp_path, capsys):
    with pytest.raises((SystemExit, ValueError)) as info:
        _instantiate(_config_with_ratio(tmp_path, "1.5"), f"--trainer.default_root_dir={tmp_path}")
    message = str(info.value) + capsys.readouterr().err
    assert "`ratio`" in message and "(0, 1]" in message and "Fix" in message


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
            "selection": callback.selection, "cache": callback.cache, "runtime": callback.runtime,
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


def test_a_flat_key_of_a_config_is_refused_naming_it(tmp_path, capsys):
    text = (CONFIGS / "lpa3_maxstep1.yaml").read_text()
    flat = text.replace("        solver:\n          lam: 1.0\n          max_step: 1.0", "        lam: 1.0\n        max_step: 1.0"
                        ).replace("          attack_bn: auto", "        attack_bn: auto")
    assert flat != text
    path = tmp_path / "flat.yaml"
    path.write_text(flat)
    with pytest.raises((SystemExit, TypeError)) as info:
        _instantiate(path, f"--trainer.default_root_dir={tmp_path}")
    message = str(info.value) + capsys.readouterr().err
    assert "LPA3Callback's `lam` is a setting of the `solver` group" in message  # its new place


def _refused(tmp_path: Path, capsys, text: str, *args: str) -> str:
    """The error ``lpa3 fit`` prints for a config ``text`` (written to a file) and ``args``."""
    path = tmp_path / "config.yaml"
    path.write_text(text)
    with pytest.raises(SystemExit) as info:
        main(["fit", "--config", str(path), f"--trainer.default_root_dir={tmp_path}", *args, "--print_config"])
    assert info.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("old, new, expected", [
    # a typo of the callback's own argument: the closest one
    ("        ratio: 0.5\n", "        ratoi: 0.5\n", "did you mean `ratio`?"),
    # a former flat setting: its group, and how to write it in YAML
    ("        solver:\n          lam: 1.0\n", "        lam: 1.0\n        solver:\n",
     "`lam` is a setting of the `solver` group"),
    # a typo inside a group: the group's closest field
    ("          lam: 1.0\n", "          lamm: 1.0\n", "`solver` has no setting `lamm`: did you mean `lam`?"),
    # a setting under the wrong group: its group
    ("          lam: 1.0\n", "          regenerate_every_n_epochs: 2\n",
     "`solver` has no setting `regenerate_every_n_epochs`: it is a setting of the `cache` group"),
])
def test_a_misplaced_or_misspelled_callback_setting_in_a_config_is_named_with_its_place(tmp_path, capsys, old, new,
                                                                                         expected):
    """The message the Python API gives (settings.unknown_argument), in a few lines: not jsonargparse's
    48 lines of usage and nested union errors."""
    text = (CONFIGS / "lpa3_maxstep1.yaml").read_text()
    assert old in text
    err = _refused(tmp_path, capsys, text.replace(old, new))
    assert expected in err, err
    assert len(err.splitlines()) <= 6, err


def test_a_parser_error_is_short(tmp_path, capsys):
    """Any refusal: the error and where the options are listed, not the whole usage."""
    err = _refused(tmp_path, capsys, (CONFIGS / "lpa3_maxstep1.yaml").read_text(), "--trainer.max_epochz=3")
    assert "max_epochz" in err and "--help" in err
    assert len(err.splitlines()) <= 6, err


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


@pytest.mark.parametrize("block, key", [
    ("lr_scheduler:\n  class_path: torch.optim.lr_scheduler.CosineAnnealingLR\n  init_args:\n    T_max: 10\n",
     "lr_scheduler"),
    ("optimizer:\n  class_path: torch.optim.AdamW\n  init_args:\n    lr: 0.01\n", "optimizer"),
])
def test_an_optimizer_or_schedule_in_a_config_names_that_the_module_owns_them(tmp_path, capsys, block, key):
    """LightningCLI's `optimizer:` / `lr_scheduler:` keys are off (each module's configure_optimizers holds its
    recipe): a config with them says so and where the recipe's settings are, not only 'does not accept'."""
    err = _refused(tmp_path, capsys, (CONFIGS / "lpa3_maxstep1.yaml").read_text() + block)
    assert f"`{key}:`" in err and "configure_optimizers" in err and "model.init_args" in err, err
    assert len(err.splitlines()) <= 6, err


def test_fit_help_says_the_modules_own_their_optimizer_and_schedule(capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--help"])
    assert "configure_optimizers" in capsys.readouterr().out
