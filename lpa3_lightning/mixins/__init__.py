"""LightningModule mixins that consume LP-A3's augmented batch."""

from lpa3_lightning.mixins.base import LPA3ModuleMixin
from lpa3_lightning.mixins.supervised import SupervisedLPA3Mixin, split_indexed_batch

__all__ = ["LPA3ModuleMixin", "SupervisedLPA3Mixin", "split_indexed_batch"]
