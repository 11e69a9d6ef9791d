"""The Lightning side of LP-A3: :class:`LPA3Callback` and its settings.

A batch's path: :mod:`.lpa3_callback` (the hooks, the selection rule) -> :mod:`.runner` (one network: request,
selection, the step's one reduction, hand-over, memory update) -> :mod:`.hard_positives` (what the fit fixes for
the network, resolved once; the solver or a control, the cache, the verified forward); :mod:`.logging` logs.
At a fit's start :mod:`.fit_checks` and :mod:`.rank_agreement` check the module and the ranks;
:mod:`.resume_point` and :mod:`.checkpoint_io` keep resumes exact.
"""

from lpa3_lightning.callback.hard_positives import batch_noise_seed
from lpa3_lightning.callback.lpa3_callback import LPA3Callback
from lpa3_lightning.callback.runner import NetworkRunner
from lpa3_lightning.callback.settings import (
    PRESETS,
    CacheSettings,
    LoggingSettings,
    RunSettings,
    SelectionSettings,
    SolverSettings,
)

__all__ = ["CacheSettings", "LPA3Callback", "LoggingSettings", "NetworkRunner", "PRESETS", "RunSettings",
           "SelectionSettings", "SolverSettings", "batch_noise_seed"]
