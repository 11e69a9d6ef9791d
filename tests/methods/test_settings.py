"""A misspelled or unprefixed mixin setting fails instead of leaving the defaults to run."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
from torch import nn

from lpa3_lightning import LPA3Callback
from lpa3_lightning.methods.base import check_mixin_settings, mixin_settings
from lpa3_lightning.mixins import FixMatchLPA3Mixin, PESLPA3Mixin
from tests.methods.test_fixmatch import UserFixMatch, _loaders, _trainer


class UserPES(PESLPA3Mixin, pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 3)
        if "lpa3_num_classes" not in vars(type(self)):  # (a subclass may give it as a property)
            self.lpa3_num_classes = 3


def test_the_settings_are_the_mixins_annotated_attributes():
    settings = mixin_settings(UserPES)
    assert settings["pes_early_epochs"] == "PESLPA3Mixin" and settings["lpa3_num_classes"] == "LPA3ModuleMixin"
    assert "pes_guess" not in settings and "_pes_labeled" not in settings  # methods and private state


@pytest.mark.parametrize("name, meant", [("pes_early_epoch", "pes_early_epochs"), ("pes_lamda_u", "pes_lambda_u"),
                                         ("lpa3_num_clases", "lpa3_num_classes")])
def test_a_misspelled_setting_is_refused_naming_the_setting(name, meant):
    module = UserPES()
    setattr(module, name, 5)
    with pytest.raises(ValueError, match=f"UserPES.{name} is not a setting.*`{meant}`"):
        check_mixin_settings(module)


@pytest.mark.parametrize("name, meant", [("early_epochs", "pes_early_epochs"), ("lambda_u", "pes_lambda_u")])
def test_a_setting_without_its_prefix_gets_one_warning_naming_the_setting(name, meant):
    module = UserPES()
    setattr(module, name, 5)
    with pytest.warns(UserWarning, match=f"UserPES.{name} is not read.*`{meant}`"):
        check_mixin_settings(module)


def test_a_typo_in_the_class_body_is_refused_too():
    class Typo(UserPES):
        pes_refine_epoch = 2

    with pytest.raises(ValueError, match="Typo.pes_refine_epoch.*`pes_refine_epochs`"):
        check_mixin_settings(Typo())


def test_ordinary_attributes_and_the_real_settings_pass_silently():
    import warnings

    class Own(UserPES):
        @property
        def lpa3_num_classes(self):  # a setting given as a property
            return self.num_classes

    module = Own()
    module.num_classes = 3
    module.pes_early_epochs = 3
    for name in ("epochs", "threshold", "weight", "seed", "warmup_epochs", "my_counter"):
        setattr(module, name, 1)  # attributes a user's module may well have (no PES setting's name)
    module.lambda_u = 2.0  # an attribute of the user's own, with the real setting set explicitly
    module.pes_lambda_u = 25.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_mixin_settings(module)


def test_the_fit_stops_at_setup_with_the_callback_and_at_the_first_loss_without(tmp_path):
    module = UserFixMatch(num_unlabeled=64)
    module.fixmatch_lamda_u = 2.0  # meant: fixmatch_lambda_u
    with pytest.raises(ValueError, match="`fixmatch_lambda_u`"):
        _trainer(tmp_path, [LPA3Callback(ratio=0.5, steps=1, input_range=None)], max_epochs=1).fit(module, _loaders())
    module = UserFixMatch(num_unlabeled=64)
    module.fixmatch_treshold = 0.9  # meant: fixmatch_threshold; plain FixMatch, no callback
    with pytest.raises(ValueError, match="`fixmatch_threshold`"):
        _trainer(tmp_path, [], max_epochs=1).fit(module, _loaders())
    assert FixMatchLPA3Mixin.fixmatch_threshold == 0.95
