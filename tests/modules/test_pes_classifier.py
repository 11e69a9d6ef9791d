"""The ready PES and DivideMix modules from the command line: each noisy-label config parses and agrees with its data."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest

from lpa3_lightning import DivideMixClassifier, LPA3Callback, PESClassifier
from lpa3_lightning.cli import build_cli
from lpa3_lightning.data import NoisyLabelDataModule

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "noisy"


@pytest.mark.parametrize("config", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_each_noisy_config_parses(config, tmp_path):
    args = ["--config", str(CONFIGS / config), f"--trainer.default_root_dir={tmp_path}",
            f"--trainer.logger.init_args.save_dir={tmp_path}", "--data.init_args.download=false",
            f"--data.init_args.noise_file={tmp_path / 'noise.json'}"]
    cli = build_cli(args, run=False)
    expected = PESClassifier if "_pes" in config else DivideMixClassifier
    assert isinstance(cli.model, expected) and isinstance(cli.datamodule, NoisyLabelDataModule)
    callbacks = [c for c in cli.trainer.callbacks if isinstance(c, LPA3Callback)]
    assert bool(callbacks) == config.endswith("_lpa3.yaml")
    model, data = cli.model, cli.datamodule
    assert model.hparams.num_classes == data.num_classes and model.hparams.in_channels == data.in_channels
    if callbacks:
        # x' are used from the semi-supervised phase on: the attack's warm-up covers the two first phases
        start = model.pes_semi_start if isinstance(model, PESClassifier) else model.lpa3_settings.warmup_epochs
        assert callbacks[0].warmup_epochs == start
        # (sigma, ratio and the rest of the paper rows: tests/test_paper_rows.py, against the reference)
        assert callbacks[0].steps == 5
    if config.startswith("cifar"):
        assert data.noise_convention == "any" and model.hparams.arch == "preact_resnet18"
    if isinstance(model, DivideMixClassifier):  # the class shares where the classes are unequal (ours)
        prior = model.lpa3_settings.class_prior
        assert (prior is not None) == config.startswith("pneumoniamnist"), prior
        if prior is not None:  # PneumoniaMNIST's training set: 1,214 normal of 4,708
            assert prior == pytest.approx([1214 / 4708, 1 - 1214 / 4708], abs=5e-4)


def test_the_mnist5k_row_fits_from_the_command_line_for_one_epoch_of_each_phase(tmp_path):
    # the row's config with one epoch per phase (the attack's warm-up moved with them)
    text = (CONFIGS / "mnist5k_sym80_pes_lpa3.yaml").read_text()
    for old, new in (("warmup_epochs: 5", "warmup_epochs: 2"), ("early_epochs: 5", "early_epochs: 1"),
                     ("refine_epochs: 0", "refine_epochs: 1")):
        assert old in text
        text = text.replace(old, new)
    config = tmp_path / "short.yaml"
    config.write_text(text)
    args = ["fit", "--config", str(config), f"--trainer.default_root_dir={tmp_path}",
            f"--trainer.logger.init_args.save_dir={tmp_path}", "--trainer.max_epochs=3",
            "--trainer.limit_train_batches=3", "--trainer.limit_val_batches=2", "--trainer.limit_test_batches=2",
            f"--data.init_args.noise_file={tmp_path / 'noise.json'}", "--data.init_args.batch_size=16"]
    cli = build_cli(args, run=True)
    assert cli.trainer.current_epoch == 3 and "test/acc" in cli.trainer.callback_metrics  # test_after_fit ran
    assert (tmp_path / "noise.json").is_file()


def test_the_asymmetric_dividemix_row_carries_the_confidence_penalty(tmp_path):
    def model_of(name: str) -> DivideMixClassifier:
        args = ["--config", str(CONFIGS / name), f"--trainer.default_root_dir={tmp_path}",
                f"--trainer.logger.init_args.save_dir={tmp_path}", "--data.init_args.download=false",
                f"--data.init_args.noise_file={tmp_path / 'noise.json'}"]
        return build_cli(args, run=False).model  # type: ignore[return-value]

    # the asymmetric row (the symmetric ones: tests/test_paper_rows.py): DivideMix's confidence penalty
    # for asymmetric noise (LiJunnan1992/DivideMix Train_cifar.py:237-238, NegEntropy) and lambda_u 0
    asym = model_of("cifar10_asym40_dividemix.yaml")
    assert asym.lpa3_settings.lambda_u == 0.0 and asym.lpa3_settings.negative_entropy


@pytest.mark.parametrize("config", ["mnist5k_sym80_dividemix_st.yaml", "mnist5k_sym80_dividemix_st_lpa3.yaml"])
def test_the_stratified_rows_carry_the_settings_they_were_measured_with(config, tmp_path):
    """The noisy_table.py ``dividemix_st`` rows: stratified split, warm-up 10 of 16 epochs, batch 64."""
    args = ["--config", str(CONFIGS / config), f"--trainer.default_root_dir={tmp_path}",
            f"--trainer.logger.init_args.save_dir={tmp_path}", f"--data.init_args.noise_file={tmp_path / 'noise.json'}"]
    cli = build_cli(args, run=False)
    model = cli.model
    assert isinstance(model, DivideMixClassifier) and model.lpa3_settings.stratified_split
    assert not model.lpa3_settings.split_per_class and model.lpa3_settings.warmup_epochs == 10
    assert cli.trainer.max_epochs == 16 and cli.datamodule.hparams.batch_size == 64
    assert (cli.datamodule.noise_rate, cli.datamodule.noise_convention) == (0.8, "other")


class _OwnNoisyData(pl.LightningDataModule):
    """A user's own data module: the PES / DivideMix batch layout, a plain shuffled loader."""

    num_train = 48

    def train_dataloader(self):
        from torch.utils.data import DataLoader

        from tests.methods.test_pes import NoisyTwoViews

        return DataLoader(NoisyTwoViews(48), batch_size=16, shuffle=True, drop_last=True)


@pytest.mark.parametrize("method", ["pes", "dividemix"])
def test_a_semi_phase_without_balanced_batches_is_warned_with_the_recipe(tmp_path, method):
    """The semi-supervised batches of the ready modules are balanced by the data module's sampler
    (NoisyLabelDataModule(balance_split=True)); with a user's own loader they silently were not."""
    import warnings

    pl.seed_everything(0)
    if method == "pes":
        module = PESClassifier(arch="small_cnn", in_channels=1, num_classes=3,
                               pes={"early_epochs": 1, "refine_epochs": 0, "rampup_epochs": 1.0})
    else:
        module = DivideMixClassifier(arch="small_cnn", in_channels=1, num_classes=3,
                                     dividemix={"warmup_epochs": 1, "rampup_epochs": 1.0})
    trainer = pl.Trainer(max_epochs=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, datamodule=_OwnNoisyData())
    messages = [str(w.message) for w in caught if "SplitBalancedSampler" in str(w.message)]
    assert len(messages) == 1 and "labeled share" in messages[0] and "Fix" in messages[0], messages
