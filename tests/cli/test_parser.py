"""The `lpa3` command's parser (lpa3_lightning.cli.parser): a refusal in a few lines, a misplaced or misspelled
LPA3Callback setting named with its place, an optimizer or schedule key named as the module's."""

from __future__ import annotations

from pathlib import Path

import pytest

from lpa3_lightning.cli import LPA3CLI, build_cli, main
from lpa3_lightning.cli.parser import explain, import_class

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "medmnist"


def _instantiate(config: Path, *overrides: str) -> LPA3CLI:
    return build_cli(["--config", str(config), *overrides], run=False)


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


def test_import_class_names_an_object_by_its_dotted_path_or_none():
    from lpa3_lightning import LPA3Callback

    assert import_class("lpa3_lightning.LPA3Callback") is LPA3Callback
    assert import_class("no.such.Module") is None and import_class("lpa3_lightning.NoSuchName") is None
    assert import_class("nodots") is None


def test_explain_leaves_other_errors_alone():
    assert explain("error: something else went wrong") is None
