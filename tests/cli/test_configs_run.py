"""One config of each family runs as ``lpa3 fit --config`` builds it, for a few steps with LP-A3
solving hard positives (the warm-ups shortened so the steps reach the epochs that augment). PES's
row runs from the command line through its three phases in tests/modules/test_pes_classifier.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from lpa3_lightning import LPA3Callback
from lpa3_lightning.cli import build_cli

CONFIGS = Path(__file__).resolve().parents[2] / "configs"

#: config -> (command-line overrides, callback settings set on the built callback). Two epochs of
#: two batches see a few hundred of the noisy sets' 4,000 samples: the memory ranks only those it
#: saw (an unseen sample never passes the threshold), so those rows run at ratio 1
FAMILIES = {
    "medmnist/lpa3_tau0.5.yaml": (["--trainer.max_epochs=1", "--trainer.limit_train_batches=2",
                                   "--data.init_args.batch_size=32"], {}),
    # an untrained model's pseudo-labels are not confident: every one counts for these steps
    "ssl/mnist5k_40_fixmatch_lpa3.yaml": (["--trainer.max_steps=4",
                                           "--model.init_args.fixmatch.lpa3_loss_warmup_epochs=0",
                                           "--model.init_args.fixmatch.lpa3_confidence_threshold=0.0"], {}),
    "noisy/mnist5k_sym80_dividemix_lpa3.yaml": (["--trainer.max_epochs=2", "--trainer.limit_train_batches=2",
                                                 "--model.init_args.dividemix.warmup_epochs=1"],
                                                {"warmup_epochs": 1, "ratio": 1.0}),
}


@pytest.mark.parametrize("config", sorted(FAMILIES))
def test_a_config_of_each_family_fits_a_few_steps_with_hard_positives(config, tmp_path):
    overrides, callback_settings = FAMILIES[config]
    cli = build_cli(["--config", str(CONFIGS / config), *overrides, "--trainer.logger=false",
                     f"--trainer.default_root_dir={tmp_path}", "--trainer.limit_val_batches=2",
                     "--trainer.enable_progress_bar=false"], run=False)
    callbacks = [c for c in cli.trainer.callbacks if isinstance(c, LPA3Callback)]
    assert len(callbacks) == 1
    callback = callbacks[0]
    for name, value in callback_settings.items():
        setattr(callback, name, value)
    solved = []
    callback.on_augmented = lambda trainer, module, augmented: solved.append(len(augmented))
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert 1 <= cli.trainer.global_step <= 8
    assert sum(solved) > 0, f"{config}: no hard positive in {cli.trainer.global_step} steps"
    runners = list(callback.networks.values()) or [callback.runner()]
    assert all(int(r.tcs.seen.sum()) > 0 for r in runners)


def test_a_fit_with_the_tensorboard_logger_keeps_the_settings_as_plain_hparams_and_reloads(tmp_path):
    """The ready modules keep their settings dataclass in the hyper-parameters as a mapping of its
    fields: hparams.yaml and TensorBoard take it without a warning, and load_from_checkpoint rebuilds
    the dataclass (a command-line override included)."""
    import warnings

    import yaml

    from lpa3_lightning import PESClassifier
    from lpa3_lightning.mixins import PESSettings

    args = ["--config", str(CONFIGS / "noisy/mnist5k_sym50_pes_lpa3.yaml"), f"--trainer.default_root_dir={tmp_path}",
            f"--trainer.logger.init_args.save_dir={tmp_path}", "--trainer.max_epochs=1",
            "--trainer.limit_train_batches=2", "--trainer.limit_val_batches=2", "--trainer.enable_progress_bar=false",
            f"--data.init_args.noise_file={tmp_path / 'noise.json'}", "--model.init_args.pes.class_weight_cap=2.5"]
    cli = build_cli(args, run=False)
    assert cli.model.lpa3_settings == PESSettings(early_epochs=5, refine_epochs=0, lambda_u=25.0, class_weight_cap=2.5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    about_hparams = [str(w.message) for w in caught if "hparam" in str(w.message).lower()
                     or "dump" in str(w.message).lower() or "pes" in str(w.message)]
    assert about_hparams == []
    hparams = yaml.safe_load((Path(cli.trainer.logger.log_dir) / "hparams.yaml").read_text())
    assert hparams["pes"]["class_weight_cap"] == 2.5 and hparams["pes"]["early_epochs"] == 5  # plain YAML
    assert list(Path(cli.trainer.logger.log_dir).glob("events.out.tfevents.*"))  # TensorBoard logged
    checkpoint = Path(cli.trainer.checkpoint_callback.last_model_path)  # the config's ModelCheckpoint(save_last)
    assert PESClassifier.load_from_checkpoint(checkpoint).lpa3_settings == cli.model.lpa3_settings
