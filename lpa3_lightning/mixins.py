"""The LightningModule mixins that consume LP-A3's augmented batch, and their settings (defined in
:mod:`lpa3_lightning.methods`; this is the import path the docs use)."""

from lpa3_lightning.methods import (
    DivideMixLPA3Mixin,
    DivideMixSettings,
    FixMatchLPA3Mixin,
    FixMatchSettings,
    LPA3ModuleMixin,
    LPA3Settings,
    PESLPA3Mixin,
    PESSettings,
    SupervisedLPA3Mixin,
    SupervisedSettings,
    split_indexed_batch,
    split_semi_supervised_batch,
    split_two_view_batch,
)

__all__ = [
    "DivideMixLPA3Mixin", "DivideMixSettings", "FixMatchLPA3Mixin", "FixMatchSettings", "LPA3ModuleMixin",
    "LPA3Settings", "PESLPA3Mixin", "PESSettings", "SupervisedLPA3Mixin", "SupervisedSettings",
    "split_indexed_batch", "split_semi_supervised_batch", "split_two_view_batch",
]
