"""LP-A3: label-preserving adversarial auto-augmentation (Yang et al., NeurIPS 2022) for Lightning.

The package in folders: ``core`` (the algorithm in plain PyTorch: no Lightning import, usable in
any training loop), ``callback`` (:class:`LPA3Callback`, its runner per network, hard positives, logging), ``methods`` (the mixins
for supervised, FixMatch, PES and DivideMix training and their pieces), ``modules`` (ready
LightningModules), ``data``, ``models`` and ``cli`` (the ``lpa3`` command).
"""

from lpa3_lightning.core.dual_bn import convert_dual_bn, has_dual_bn, use_twin_bn
from lpa3_lightning.core.feature_layers import default_feature_layers
from lpa3_lightning.core.features import PerceptualFeatures
from lpa3_lightning.core.forward_modes import augmented_logits
from lpa3_lightning.core.input_box import resolve_input_range
from lpa3_lightning.core.solver import AttackStats, SolverSettings, lpa3_attack
from lpa3_lightning.core.tcs import TimeConsistency, selection_threshold, tcs_divergence, tcs_update

__version__ = "0.4.0"

__all__ = [
    "AttackStats",
    "AugmentedBatch",
    "LPA3Request",
    "CacheSettings",
    "DivideMixClassifier",
    "DivideMixSettings",
    "FixMatchClassifier",
    "FixMatchEMA",
    "FixMatchSettings",
    "LPA3Callback",
    "LPA3Classifier",
    "LPA3Settings",
    "LoggingSettings",
    "PESClassifier",
    "PESSettings",
    "PerceptualFeatures",
    "SelectionSettings",
    "SolverSettings",
    "SupervisedSettings",
    "TimeConsistency",
    "augmented_logits",
    "convert_dual_bn",
    "default_feature_layers",
    "has_dual_bn",
    "lpa3_attack",
    "resolve_input_range",
    "selection_threshold",
    "tcs_divergence",
    "tcs_update",
    "use_twin_bn",
]


_SETTINGS = ("CacheSettings", "LoggingSettings", "SelectionSettings")
#: the mixins' settings (the ready modules' ``supervised=``, ``fixmatch=``, ``pes=``, ``dividemix=``)
_MIXIN_SETTINGS = ("DivideMixSettings", "FixMatchSettings", "LPA3Settings", "PESSettings", "SupervisedSettings")


def __getattr__(name: str):  # Lightning-dependent names load lazily, keeping the core Lightning-free
    if name in _SETTINGS:
        from lpa3_lightning.callback import settings

        return getattr(settings, name)
    if name in _MIXIN_SETTINGS:
        from lpa3_lightning.methods import settings as mixin_settings

        return getattr(mixin_settings, name)
    if name in ("AugmentedBatch", "LPA3Request"):
        from lpa3_lightning.methods import base

        return getattr(base, name)
    if name == "LPA3Callback":
        from lpa3_lightning.callback import LPA3Callback

        return LPA3Callback
    if name == "LPA3Classifier":
        from lpa3_lightning.modules.classifier import LPA3Classifier

        return LPA3Classifier
    if name == "FixMatchEMA":
        from lpa3_lightning.methods.fixmatch_ema import FixMatchEMA

        return FixMatchEMA
    if name == "FixMatchClassifier":
        from lpa3_lightning.modules.fixmatch_classifier import FixMatchClassifier

        return FixMatchClassifier
    if name == "DivideMixClassifier":
        from lpa3_lightning.modules.dividemix_classifier import DivideMixClassifier

        return DivideMixClassifier
    if name == "PESClassifier":
        from lpa3_lightning.modules.pes_classifier import PESClassifier

        return PESClassifier
    raise AttributeError(f"module 'lpa3_lightning' has no attribute {name!r}")
