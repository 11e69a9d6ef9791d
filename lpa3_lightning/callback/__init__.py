"""The Lightning side of LP-A3: :class:`LPA3Callback` and its settings.

The per-batch path, stage by stage: :mod:`.request_checks` (the module's request) ->
:mod:`.selection_stage` (TCS selection) -> :mod:`.augment_stage` (the hard positives) ->
the module's loss -> the TCS memory's update (:meth:`~lpa3_lightning.core.tcs.TimeConsistency.update`);
:mod:`.logging_stage` logs each; :mod:`.runner` runs them for one network with the fit's
:class:`~lpa3_lightning.callback.settings.RunSettings`; :mod:`.lpa3_callback` holds the Lightning
hooks and the step's one reduction.
"""

from lpa3_lightning.callback.augment_stage import batch_noise_seed
from lpa3_lightning.callback.lpa3_callback import LPA3Callback
from lpa3_lightning.callback.runner import NetworkRunner
from lpa3_lightning.callback.settings import (
    PRESETS,
    CacheSettings,
    LoggingSettings,
    RunSettings,
    RuntimeSettings,
    SelectionSettings,
    SolverSettings,
)

__all__ = ["CacheSettings", "LPA3Callback", "LoggingSettings", "NetworkRunner", "PRESETS", "RunSettings",
           "RuntimeSettings", "SelectionSettings", "SolverSettings", "batch_noise_seed"]
