"""LP-A3: label-preserving adversarial auto-augmentation (Yang et al., NeurIPS 2022) for Lightning.

The algorithm (``tcs``, ``selection``, ``features``, ``attack``, ``solver_graphs``, ``dual_bn``) imports no
Lightning and works in a plain PyTorch loop; Lightning lives in ``callback``, ``mixins``,
``classifier``, ``data`` and ``cli``.
"""

from lpa3_lightning.attack import AttackStats, lpa3_attack, resolve_input_range
from lpa3_lightning.augmented import AugmentedBatch, LPA3Request
from lpa3_lightning.augmented_forward import augmented_logits
from lpa3_lightning.dual_bn import convert_dual_bn, has_dual_bn, use_twin_bn
from lpa3_lightning.features import PerceptualFeatures, default_feature_layers
from lpa3_lightning.selection import select_below_threshold, selection_threshold
from lpa3_lightning.solver_graphs import SolverGraphs
from lpa3_lightning.tcs import TimeConsistency, tcs_divergence, tcs_update

__version__ = "0.1.0"

__all__ = [
    "AttackStats",
    "AugmentedBatch",
    "CacheSettings",
    "DivideMixClassifier",
    "FixMatchClassifier",
    "FixMatchEMA",
    "LPA3Callback",
    "LPA3Classifier",
    "LPA3Request",
    "LoggingSettings",
    "PESClassifier",
    "PerceptualFeatures",
    "RuntimeSettings",
    "SelectionSettings",
    "SolverSettings",
    "SolverGraphs",
    "TimeConsistency",
    "augmented_logits",
    "convert_dual_bn",
    "default_feature_layers",
    "has_dual_bn",
    "lpa3_attack",
    "resolve_input_range",
    "select_below_threshold",
    "selection_threshold",
    "tcs_divergence",
    "tcs_update",
    "use_twin_bn",
]


_SETTINGS = ("CacheSettings", "LoggingSettings", "RuntimeSettings", "SelectionSettings", "SolverSettings")


def __getattr__(name: str):  # Lightning-dependent names load lazily, keeping the core Lightning-free
    if name in _SETTINGS:
        from lpa3_lightning.callback import settings

        return getattr(settings, name)
    if name == "LPA3Callback":
        from lpa3_lightning.callback import LPA3Callback

        return LPA3Callback
    if name == "LPA3Classifier":
        from lpa3_lightning.classifier import LPA3Classifier

        return LPA3Classifier
    if name == "FixMatchEMA":
        from lpa3_lightning.ema import FixMatchEMA

        return FixMatchEMA
    if name == "FixMatchClassifier":
        from lpa3_lightning.fixmatch_classifier import FixMatchClassifier

        return FixMatchClassifier
    if name == "DivideMixClassifier":
        from lpa3_lightning.dividemix_classifier import DivideMixClassifier

        return DivideMixClassifier
    if name == "PESClassifier":
        from lpa3_lightning.pes_classifier import PESClassifier

        return PESClassifier
    raise AttributeError(f"module 'lpa3_lightning' has no attribute {name!r}")
