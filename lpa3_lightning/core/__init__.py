"""The LP-A3 algorithm in plain PyTorch (no Lightning import): a training loop of your own can
use it directly (README, "Without Lightning").

The per-batch data path, one module each: ``tcs`` (time-consistency memory; ``tcs_shards`` splits
it over data-parallel processes, ``shard_exchange`` moves its rows) -> ``selection``
(the threshold) -> ``features`` / ``feature_layers`` (the model's own perceptual features) ->
``attack`` (the label-preserving solver: ``solver_loop``, ``solver_forward``, ``input_box``,
``solver_graphs``) -> ``augmented`` (what a module receives) -> ``augmented_forward`` (the
forward that trains ``x'`` as the solver verified it). ``dual_bn`` adds the twin BatchNorms;
``cache``, ``batch_plan``, ``distributed``, ``host_reads``, ``checks`` and ``visualize`` serve the
callback and the tests.
"""

from lpa3_lightning.core.attack import AttackStats, lpa3_attack
from lpa3_lightning.core.augmented import AugmentedBatch, LPA3Request
from lpa3_lightning.core.augmented_forward import augmented_logits
from lpa3_lightning.core.dual_bn import convert_dual_bn, has_dual_bn, use_twin_bn
from lpa3_lightning.core.feature_layers import default_feature_layers, resolve_layers
from lpa3_lightning.core.features import PerceptualFeatures
from lpa3_lightning.core.input_box import resolve_input_range
from lpa3_lightning.core.selection import select_below_threshold, selection_threshold
from lpa3_lightning.core.solver_forward import label_log_prob
from lpa3_lightning.core.solver_graphs import SolverGraphs
from lpa3_lightning.core.tcs import TimeConsistency, tcs_divergence, tcs_update
from lpa3_lightning.core.tcs_shards import ShardedTimeConsistency

__all__ = [
    "AttackStats", "AugmentedBatch", "LPA3Request", "PerceptualFeatures", "ShardedTimeConsistency", "SolverGraphs",
    "TimeConsistency",
    "augmented_logits", "convert_dual_bn", "default_feature_layers", "has_dual_bn", "label_log_prob", "lpa3_attack",
    "resolve_input_range", "resolve_layers", "select_below_threshold", "selection_threshold", "tcs_divergence",
    "tcs_update", "use_twin_bn",
]
