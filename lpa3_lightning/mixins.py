"""The LightningModule mixins that consume LP-A3's augmented batch (defined in
:mod:`lpa3_lightning.methods`; this is the import path the docs use)."""

from lpa3_lightning.methods import (
    DivideMixLPA3Mixin,
    FixMatchLPA3Mixin,
    LPA3ModuleMixin,
    PESLPA3Mixin,
    SupervisedLPA3Mixin,
    split_indexed_batch,
    split_semi_supervised_batch,
    split_two_view_batch,
)

__all__ = [
    "DivideMixLPA3Mixin", "FixMatchLPA3Mixin", "LPA3ModuleMixin", "PESLPA3Mixin", "SupervisedLPA3Mixin",
    "split_indexed_batch", "split_semi_supervised_batch", "split_two_view_batch",
]
