"""Each mixin's settings are one frozen dataclass: a misspelled field fails where it is written, a
value out of range names its field and the fix, settings of another class are refused at the
fit's start and at the first loss, and a module's own attributes are simply its own."""

from __future__ import annotations

import warnings
from dataclasses import FrozenInstanceError, fields

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from lpa3_lightning import LPA3Callback
from lpa3_lightning.methods.settings import settings_from, settings_hparams
from lpa3_lightning.mixins import (
    DivideMixSettings,
    FixMatchSettings,
    LPA3ModuleMixin,
    LPA3Settings,
    PESLPA3Mixin,
    PESSettings,
    SupervisedLPA3Mixin,
    SupervisedSettings,
)
from tests.helpers import indexed_images
from tests.methods.test_dividemix import TwoNets
from tests.methods.test_fixmatch import UserFixMatch, _loaders, _tiny_batch, _trainer
from tests.methods.test_pes import NUM_CLASSES, NoisyTwoViews, _net

SETTINGS = [LPA3Settings, SupervisedSettings, FixMatchSettings, PESSettings, DivideMixSettings]


# ------------------------------------------------------------------ the dataclasses
@pytest.mark.parametrize("cls, typo", [(SupervisedSettings, "wieght"), (FixMatchSettings, "treshold"),
                                       (PESSettings, "early_epoch"), (DivideMixSettings, "lamda_u")])
def test_a_misspelled_field_fails_where_it_is_written(cls, typo):
    with pytest.raises(TypeError, match=f"unexpected keyword argument '{typo}'"):
        cls(**{typo: 3})


@pytest.mark.parametrize("cls", SETTINGS)
def test_the_settings_are_frozen_and_carry_the_bases_field(cls):
    settings = cls()
    assert fields(settings)[0].name == "train_forward" and settings.train_forward == "verified"
    with pytest.raises(FrozenInstanceError):
        settings.train_forward = "batch_stats"  # type: ignore[misc]


@pytest.mark.parametrize("cls, field, value, message", [
    (LPA3Settings, "train_forward", "batch", "`lpa3.train_forward` must be 'verified'"),
    (SupervisedSettings, "weight", -1.0, r"`supervised.weight` must be a finite number >= 0, got -1.0. Fix:"),
    (SupervisedSettings, "train_forward", "batch", "`supervised.train_forward` must be 'verified'"),
    (FixMatchSettings, "threshold", 1.5, r"`fixmatch.threshold` must be a finite number > 0 and <= 1, got 1.5"),
    (FixMatchSettings, "lpa3_loss_warmup_epochs", True, "`fixmatch.lpa3_loss_warmup_epochs` must be an int >= 0"),
    (FixMatchSettings, "solve_trained_only", "yes", "`fixmatch.solve_trained_only` must be True or False"),
    (FixMatchSettings, "lambda_u", float("nan"), "`fixmatch.lambda_u` must be a finite number"),
    (PESSettings, "early_epochs", 0, "`pes.early_epochs` must be an int >= 1, got 0. Fix:"),
    (PESSettings, "refine_epochs", 1.0, "`pes.refine_epochs` must be an int >= 0"),
    (PESSettings, "alpha_late_epoch", 2.5, "`pes.alpha_late_epoch` must be None or an int"),
    (PESSettings, "class_weight_cap", 0, r"`pes.class_weight_cap` must be a finite number > 0"),
    (PESSettings, "lpa3_mixup", 1, "`pes.lpa3_mixup` must be True or False"),
    (PESSettings, "lpa3_confidence", 0.0, r"`pes.lpa3_confidence` must be None or a number in \(0, 1\]"),
    (DivideMixSettings, "networks", ("net1", "net1"), "`dividemix.networks` must be two distinct"),
    (DivideMixSettings, "threshold", 1.0, r"`dividemix.threshold` must be a finite number > 0 and < 1"),
    (DivideMixSettings, "loss_history", 0, "`dividemix.loss_history` must be an int >= 1"),
    (DivideMixSettings, "lpa3_weight", -2.0, "`dividemix.lpa3_weight` must be a finite number >= 0"),
    (DivideMixSettings, "seed", -1, "`dividemix.seed` must be an int >= 0"),
    (DivideMixSettings, "class_prior", (1.0,), "`dividemix.class_prior` must be None or one frequency per class"),
    (DivideMixSettings, "class_prior", (0.7, 0.7), "`dividemix.class_prior` must hold num_classes=2 positive"),
])
def test_a_value_out_of_range_names_the_field_the_value_and_the_fix(cls, field, value, message):
    with pytest.raises(ValueError, match=message) as raised:
        cls(**{field: value})
    assert "Fix:" in str(raised.value)


def test_lists_are_kept_as_tuples_and_the_hparams_mapping_rebuilds_the_settings():
    settings = DivideMixSettings(networks=["a", "b"], class_prior=[0.25, 0.75])
    assert settings.networks == ("a", "b") and settings.class_prior == (0.25, 0.75)
    hparams = settings_hparams(settings)
    assert hparams["networks"] == ["a", "b"] and hparams["class_prior"] == [0.25, 0.75]  # plain YAML values
    assert settings_from(DivideMixSettings, hparams, "dividemix") == settings
    assert settings_from(PESSettings, None, "pes") == PESSettings()
    with pytest.raises(TypeError, match=r"`pes` has no setting `early_epoch`: did you mean `early_epochs`\?. Fix: use the fields of PESSettings"):
        settings_from(PESSettings, {"early_epoch": 3}, "pes")
    with pytest.raises(TypeError, match="`pes` must be a PESSettings, a mapping of its fields or None, got "
                                        "FixMatchSettings"):
        settings_from(PESSettings, FixMatchSettings(), "pes")


# ------------------------------------------------------------------ a module of one's own, per mixin
class UserSupervised(SupervisedLPA3Mixin, pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = _net()
        self.lpa3_num_classes = NUM_CLASSES

    def lpa3_model(self) -> nn.Module:
        return self.net


class UserPES(PESLPA3Mixin, pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = _net()
        self.lpa3_num_classes, self.lpa3_num_samples = NUM_CLASSES, 48
        self.lpa3_settings = PESSettings(early_epochs=3)

    def lpa3_model(self) -> nn.Module:
        return self.net


def _user_step(kind: str):
    """(module, one training step) of a user's module of each mixin, in its first epoch."""
    if kind == "supervised":
        module = UserSupervised()
        batch = next(iter(DataLoader(indexed_images(8), batch_size=8)))
        return module, lambda: module.lpa3_supervised_loss(batch)
    if kind == "fixmatch":
        module = UserFixMatch(num_unlabeled=64)
        return module, lambda: module.fixmatch_loss(_tiny_batch())
    if kind == "pes":
        module = UserPES()
        batch = next(iter(DataLoader(NoisyTwoViews(48), batch_size=8)))
        return module, lambda: module.pes_loss(batch)
    module = TwoNets(warmup=2)
    batch = next(iter(DataLoader(NoisyTwoViews(48), batch_size=8)))
    return module, lambda: module.dividemix_losses(batch)


KINDS = ["supervised", "fixmatch", "pes", "dividemix"]
EXPECTED = {"supervised": SupervisedSettings, "fixmatch": FixMatchSettings, "pes": PESSettings,
            "dividemix": DivideMixSettings}


@pytest.mark.parametrize("kind", KINDS)
def test_a_modules_own_attributes_are_its_own_no_error_no_warning(kind):
    """Names a user's module may well have (FlexMatch's per-class thresholds, a temperature, a
    weight) are not settings of the mixin, so they are neither refused nor warned about."""
    module, step = _user_step(kind)
    module.temperature = 7
    module.fixmatch_thresholds = [0.9] * NUM_CLASSES
    module.lambda_u, module.weight, module.early_epochs = 2.0, 0.5, 3
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        module.lpa3_check_settings()  # what the callback calls in setup
        loss = step()
    losses = [v[0] for v in loss.values()] if isinstance(loss, dict) else [loss[0]]
    assert all(torch.isfinite(x) for x in losses)
    assert isinstance(module.lpa3_settings, EXPECTED[kind])
    assert module.temperature == 7 and module.lpa3_settings.train_forward == "verified"


@pytest.mark.parametrize("kind", KINDS)
def test_settings_of_another_class_are_refused_naming_the_class_and_the_fix(kind):
    module, step = _user_step(kind)
    expected = EXPECTED[kind].__name__
    module.lpa3_settings = LPA3Settings() if kind != "supervised" else FixMatchSettings()
    with pytest.raises(TypeError, match=f"lpa3_settings must be a {expected}, got .*Fix: set `self.lpa3_settings = "
                                        f"{expected}\\(...\\)`"):
        module.lpa3_check_settings()
    with pytest.raises(TypeError, match=f"lpa3_settings must be a {expected}"):
        step()  # the loss checks too (no callback needed)
    module.lpa3_settings = {"train_forward": "verified"}  # a mapping is no settings object either
    with pytest.raises(TypeError, match=f"must be a {expected}, got dict"):
        step()


def test_the_base_mixin_reads_its_own_settings():
    assert LPA3ModuleMixin.lpa3_settings == LPA3Settings() and LPA3ModuleMixin.lpa3_settings_class is LPA3Settings


def test_a_flexmatch_style_subclass_fits_with_the_callback_without_a_word(tmp_path):
    """A FixMatch module with per-class thresholds and a temperature of its own fits with the
    callback: no error, and no warning from this package about its attributes."""

    class FlexMatch(UserFixMatch):
        def __init__(self) -> None:
            super().__init__(num_unlabeled=64, confidence=0.4)
            self.fixmatch_thresholds = [0.95] * NUM_CLASSES
            self.temperature = 7

    module = FlexMatch()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _trainer(tmp_path, [LPA3Callback(ratio=1.0, steps=1, input_range=None)], max_epochs=1).fit(module, _loaders())
    ours = [str(w.message) for w in caught if "temperature" in str(w.message) or "fixmatch_" in str(w.message)
            or "lpa3_lightning" in (w.filename or "")]
    assert ours == []
    assert module.parts and module.fixmatch_thresholds == [0.95] * NUM_CLASSES


def test_the_fit_stops_at_setup_with_the_callback_and_at_the_first_loss_without(tmp_path):
    module = UserFixMatch(num_unlabeled=64)
    module.lpa3_settings = PESSettings()  # another mixin's settings
    with pytest.raises(TypeError, match="lpa3_settings must be a FixMatchSettings, got PESSettings"):
        _trainer(tmp_path, [LPA3Callback(ratio=0.5, steps=1, input_range=None)], max_epochs=1).fit(module, _loaders())
    assert module.parts == []  # refused before the first step
    module = UserFixMatch(num_unlabeled=64)
    module.lpa3_settings = {"threshold": 0.9}  # plain FixMatch, no callback
    with pytest.raises(TypeError, match="lpa3_settings must be a FixMatchSettings, got dict"):
        _trainer(tmp_path, [], max_epochs=1).fit(module, _loaders())
    assert FixMatchSettings().threshold == 0.95
