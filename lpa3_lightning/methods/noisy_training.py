"""What the ready noisy-label modules (PES, DivideMix) share with Lightning: the training-set size, a
loader over every training sample, the balanced-batches check and the twins' anchoring under DDP."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lpa3_lightning.core.dual_bn import anchor_twin_parameters, has_dual_bn
from lpa3_lightning.data.sampling import draws_split_balanced
from lpa3_lightning.methods.base import lpa3_callbacks as find_lpa3_callbacks

__all__ = ["adopt_training_set_size", "anchor_twins_without_callback", "release_twins", "warn_unbalanced_batches",
           "whole_training_set_loader"]


def adopt_training_set_size(module: pl.LightningModule, datamodule: Any) -> None:
    """Set ``module.lpa3_num_samples`` from the data module's ``num_train`` (when it has one); a
    ValueError if the module was built with another ``num_samples``."""
    size = getattr(datamodule, "num_train", None)
    if isinstance(size, int):
        declared = module.hparams.get("num_samples")
        if declared is not None and declared != size:
            raise ValueError(f"The data module has {size} training samples but the model was built with "
                             f"num_samples={declared}. Fix: pass num_samples={size} or leave it None.")
        module.lpa3_num_samples = size  # type: ignore[attr-defined]


def whole_training_set_loader(trainer: pl.Trainer, rank: int, dataset: Dataset | None = None) -> DataLoader:
    """Every training sample once, in order (the training loader drops its last partial batch),
    split across the ranks under DDP; ``dataset`` replaces the training loader's (e.g. the same
    samples in the evaluation view)."""
    train = trainer.train_dataloader
    dataset = dataset if dataset is not None else train.dataset
    sampler = None
    if trainer.world_size > 1:
        sampler = DistributedSampler(dataset, num_replicas=trainer.world_size, rank=rank, shuffle=False,
                                     drop_last=False)
    return DataLoader(dataset, batch_size=train.batch_size or 64, shuffle=False, sampler=sampler, num_workers=0)


def lpa3_callbacks(trainer: pl.Trainer) -> list:
    """The LP-A3 callbacks attached to ``trainer`` (found by their marker: no import of the callback)."""
    return find_lpa3_callbacks(trainer.callbacks)  # type: ignore[attr-defined]


def anchor_twins_without_callback(trainer: pl.Trainer, networks: list[nn.Module]) -> bool:
    """At fit start, without the callback under DDP: tie every twin BatchNorm into the loss (an unused
    parameter stalls DDP's gradient reducer; the callback does it itself). Returns whether it anchored
    (undo with :func:`release_twins`)."""
    callbacks = lpa3_callbacks(trainer)
    anchored = not callbacks and trainer.world_size > 1 and all(has_dual_bn(n) for n in networks)
    if anchored:
        for network in networks:
            anchor_twin_parameters(network, True)
    return anchored


def release_twins(networks: list[nn.Module]) -> None:
    """Undo :func:`anchor_twins_without_callback` at fit end."""
    for network in networks:
        anchor_twin_parameters(network, False)


def warn_unbalanced_batches(module: Any, trainer: pl.Trainer, method: str) -> None:
    """Once a fit, in the semi phase: warn when the training loader does not draw the method's labeled
    share (:class:`~lpa3_lightning.data.SplitBalancedSampler`), as the authors' loaders do."""
    if getattr(module, "_warned_unbalanced", False) or draws_split_balanced(trainer.train_dataloader):
        return
    module._warned_unbalanced = True
    rank_zero_warn(
        f"{method}'s semi-supervised batches come from the training loader as its sampler draws them, not with the "
        "method's labeled share: at high noise the labeled set is small and many batches hold few or none of it (the "
        "authors' loaders balance each batch). Fix: use NoisyLabelDataModule (balance_split=True, the default), or "
        "give your training loader lpa3_lightning.data.SplitBalancedSampler(len(dataset), batch_size, lambda: "
        "(module.noisy_split_mask(), trainer.current_epoch), rule=module.noisy_batch_rule) and drop_last=True "
        "(docs/noisy-labels.md, 'Your own data')."
    )
