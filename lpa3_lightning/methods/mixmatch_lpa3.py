"""The hard positives in a MixMatch loss (PES and DivideMix, as the LP-A3 authors' PES code uses them).

Each ``x'`` joins a second mixup batch with the labeled views (the same ``l`` as the clean mixup,
a fresh permutation); the mixed ``x'`` rows go through the solver's verified forward
(:func:`~lpa3_lightning.core.augmented_forward.augmented_logits`) and add a probability MSE against
their mixed targets. ``lpa3/label_preserved`` is measured on the unmixed ``x'`` in the same
forward (a no-grad pass).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lpa3_lightning.core.augmented import AugmentedBatch
from lpa3_lightning.core.augmented_forward import augmented_logits
from lpa3_lightning.methods.base import LPA3ModuleMixin
from lpa3_lightning.methods.mixmatch import mixup, probability_mse

__all__ = ["augmented_mixmatch_loss"]


def augmented_mixmatch_loss(module: LPA3ModuleMixin, augmented: AugmentedBatch, targets_adv: Tensor,
                            labeled_views: Tensor, labeled_targets: Tensor, lam: float, mix: bool = True) -> Tensor:
    """The LP-A3 term of a MixMatch step.

    Args:
        module: the LightningModule (its ``lpa3_model``, ``lpa3_logits``, ``lpa3_settings.train_forward``).
        augmented: this batch's hard positives (``augmented.network`` picks the network).
        targets_adv: ``(M, C)`` target distribution of each ``x'`` (the guessed label).
        labeled_views: the labeled rows' views the ``x'`` are mixed with.
        labeled_targets: their targets ``(L, C)``.
        lam: the clean mixup's ``l``.
        mix: False trains the unmixed ``x'`` against ``targets_adv``.
    """
    if not mix:
        return probability_mse(module.lpa3_forward_augmented(augmented), targets_adv)
    x_adv = augmented.inputs.to(labeled_views.dtype)
    inputs = torch.cat([labeled_views, x_adv])
    targets = torch.cat([labeled_targets, targets_adv.to(labeled_targets)])
    mixed_x, mixed_t = mixup(inputs, targets, lam, torch.randperm(inputs.shape[0], device=inputs.device))
    rows = slice(labeled_views.shape[0], None)
    network = augmented.network
    model = module.lpa3_model() if network is None else module.lpa3_model(network=network)  # type: ignore[call-arg]
    logits = augmented_logits(
        model, mixed_x[rows], bn_mode=augmented.bn_mode,  # type: ignore[arg-type]
        bn_statistics=augmented.bn_statistics, reference_inputs=augmented.reference_inputs,
        logits_fn=module.lpa3_logits, train_forward=module.lpa3_settings.train_forward, allow_tf32=augmented.allow_tf32,
    )
    if module.lpa3_settings.train_forward == "verified":  # lpa3/label_preserved: the unmixed x' in the same forward
        with torch.no_grad():  # (in "batch_stats" it would move the running statistics once more)
            module.lpa3_forward_augmented(augmented)
    return probability_mse(logits, mixed_t[rows])
