"""The training methods that consume LP-A3's hard positives: one mixin each (supervised, FixMatch, PES,
DivideMix) on :class:`~lpa3_lightning.methods.base.LPA3ModuleMixin`, their pieces and their settings
(:mod:`lpa3_lightning.methods.settings`). Settings and what each loss returns: ``docs/mixins.md``.
"""

from lpa3_lightning.methods.base import LPA3ModuleMixin, split_indexed_batch
from lpa3_lightning.methods.dividemix import DivideMixLPA3Mixin
from lpa3_lightning.methods.fixmatch import FixMatchLPA3Mixin, split_semi_supervised_batch
from lpa3_lightning.methods.pes import PESLPA3Mixin, split_two_view_batch
from lpa3_lightning.methods.settings import (
    DivideMixSettings,
    FixMatchSettings,
    LPA3Settings,
    PESSettings,
    SupervisedSettings,
)
from lpa3_lightning.methods.supervised import SupervisedLPA3Mixin

__all__ = [
    "DivideMixLPA3Mixin", "DivideMixSettings", "FixMatchLPA3Mixin", "FixMatchSettings", "LPA3ModuleMixin",
    "LPA3Settings", "PESLPA3Mixin", "PESSettings", "SupervisedLPA3Mixin", "SupervisedSettings",
    "split_indexed_batch", "split_semi_supervised_batch", "split_two_view_batch",
]
