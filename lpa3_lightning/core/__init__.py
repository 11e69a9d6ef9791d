"""The LP-A3 algorithm in plain PyTorch (no Lightning import), for a training loop of your own (README).

One concept a module: ``tcs`` (and ``tcs_shards``), ``features`` and ``feature_layers``, ``solver``,
``input_box``, ``forward_modes``, ``dual_bn``, ``cache``, ``distributed``, ``checks``, ``visualize``.
"""

from lpa3_lightning.core.dual_bn import convert_dual_bn, has_dual_bn, use_twin_bn
from lpa3_lightning.core.feature_layers import default_feature_layers, resolve_layers
from lpa3_lightning.core.features import PerceptualFeatures
from lpa3_lightning.core.forward_modes import augmented_logits, label_log_prob
from lpa3_lightning.core.input_box import resolve_input_range
from lpa3_lightning.core.solver import AttackStats, SolverSettings, lpa3_attack
from lpa3_lightning.core.tcs import TimeConsistency, selection_threshold, tcs_divergence, tcs_update
from lpa3_lightning.core.tcs_shards import ShardedTimeConsistency

__all__ = [
    "AttackStats", "PerceptualFeatures", "ShardedTimeConsistency", "SolverSettings", "TimeConsistency",
    "augmented_logits", "convert_dual_bn", "default_feature_layers", "has_dual_bn", "label_log_prob", "lpa3_attack",
    "resolve_input_range", "resolve_layers", "selection_threshold", "tcs_divergence", "tcs_update", "use_twin_bn",
]
