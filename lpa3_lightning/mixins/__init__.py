"""LightningModule mixins that consume LP-A3's augmented batch."""

from lpa3_lightning.mixins.base import LPA3ModuleMixin, split_indexed_batch
from lpa3_lightning.mixins.dividemix import DivideMixLPA3Mixin
from lpa3_lightning.mixins.fixmatch import FixMatchLPA3Mixin, split_semi_supervised_batch
from lpa3_lightning.mixins.pes import PESLPA3Mixin, split_two_view_batch
from lpa3_lightning.mixins.supervised import SupervisedLPA3Mixin

__all__ = [
    "DivideMixLPA3Mixin", "FixMatchLPA3Mixin", "LPA3ModuleMixin", "PESLPA3Mixin", "SupervisedLPA3Mixin", "split_indexed_batch",
    "split_semi_supervised_batch", "split_two_view_batch",
]
