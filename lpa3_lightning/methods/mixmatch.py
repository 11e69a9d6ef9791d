"""MixMatch (Berthelot et al., NeurIPS 2019) as PES and DivideMix use it: the pure pieces (sharpening,
mixup, the two losses, the ramp-up, PES's agreement split and class weights) and the step's shared
machinery: the two-view batch, the pass over the training set that splits it, the no-grad forward of two
views, the mixed training forward and the LP-A3 term. No Lightning, so a plain PyTorch loop can use them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from lpa3_lightning.core.checks import check_class_labels, check_dataset_indices, check_split_loader_covered
from lpa3_lightning.core.distributed import batchnorm_buffers_kept
from lpa3_lightning.methods.base import AugmentedBatch, BatchNormStatisticsFrozen, LPA3ModuleMixin

__all__ = ["agreement_split", "augmented_mixmatch_loss", "check_noisy_batch", "class_balance_weights", "linear_rampup",
           "mixmatch_forward", "mixup", "mixup_lambda", "noisy_sizes", "probability_mse", "sharpen",
           "soft_cross_entropy", "split_two_view_batch", "sum_over_training_set", "two_view_logits"]


def sharpen(probs: Tensor, temperature: float) -> Tensor:
    """``p ** (1 / T)`` renormalised per row (MixMatch's sharpening; T = 0.5 in PES and DivideMix).

    Example:
        >>> sharpen(torch.tensor([[0.6, 0.4]]), 0.5)
        tensor([[0.6923, 0.3077]])
    """
    if not temperature > 0:
        raise ValueError(f"`temperature` must be > 0, got {temperature!r}. Fix: use 0.5 (MixMatch).")
    powered = probs.clamp_min(0).pow(1.0 / temperature)
    return powered / powered.sum(dim=1, keepdim=True).clamp_min(torch.finfo(powered.dtype).tiny)


def mixup_lambda(alpha: float) -> float:
    """``l ~ Beta(alpha, alpha)``, then ``max(l, 1 - l)``: each mixed sample stays closer to its own row
    (drawn from torch's global generator, which ``seed_everything`` seeds)."""
    if not alpha > 0:
        raise ValueError(f"`alpha` must be > 0, got {alpha!r}. Fix: use 4 (PES, DivideMix) or 0.75 (MixMatch).")
    lam = float(torch.distributions.Beta(float(alpha), float(alpha)).sample())
    return max(lam, 1.0 - lam)


def mixup(inputs: Tensor, targets: Tensor, lam: float, permutation: Tensor) -> tuple[Tensor, Tensor]:
    """``lam * row + (1 - lam) * row[permutation]`` for the inputs ``(N, ...)`` and soft targets ``(N, C)``."""
    if permutation.shape != (inputs.shape[0],) or targets.shape[0] != inputs.shape[0]:
        raise ValueError(f"`mixup` needs one target row and one permutation entry per input: inputs "
                         f"{tuple(inputs.shape)}, targets {tuple(targets.shape)}, permutation {tuple(permutation.shape)}.")
    mixed_x = lam * inputs + (1.0 - lam) * inputs[permutation]
    mixed_t = lam * targets + (1.0 - lam) * targets[permutation]
    return mixed_x, mixed_t


def soft_cross_entropy(logits: Tensor, targets: Tensor, class_weights: Tensor | None = None) -> Tensor:
    """``-sum_c w_c * mean_i(t_ic * log p_ic)``: cross-entropy against soft targets (``class_weights``
    None: every ``w_c = 1``, DivideMix's ``Lx``; PES's: :func:`class_balance_weights`). Empty batch: 0."""
    if logits.shape[0] == 0:
        return logits.sum() * 0.0
    per_class = -(targets * F.log_softmax(logits.float(), dim=1)).mean(dim=0)
    if class_weights is not None:
        per_class = per_class * class_weights.to(per_class)
    return per_class.sum()


def probability_mse(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean over samples *and* classes of ``(softmax(logits) - targets)^2`` (MixMatch's unlabeled loss,
    averaged as PES's and DivideMix's code, for which their ``lambda_u`` are calibrated). Empty batch: 0."""
    if logits.shape[0] == 0:
        return logits.sum() * 0.0
    return (torch.softmax(logits.float(), dim=1) - targets).pow(2).mean()


def linear_rampup(epoch_progress: float, start_epoch: float, length: float = 16.0) -> float:
    """``clip((epoch_progress - start_epoch) / length, 0, 1)``: the unlabeled loss weight's ramp, with a
    fractional ``epoch_progress`` (``epoch + batch_idx / batches_per_epoch``)."""
    if not length > 0:
        raise ValueError(f"`length` must be > 0, got {length!r}. Fix: use 16 (PES, DivideMix).")
    return float(min(max((epoch_progress - start_epoch) / length, 0.0), 1.0))


def agreement_split(probs: Tensor, noisy_labels: Tensor) -> Tensor:
    """PES's split: True (labeled) where the prediction ``probs`` ``(N, C)`` agrees with ``noisy_labels``
    ``(N,)``; output ``(N,)`` bool."""
    if probs.dim() != 2 or noisy_labels.shape != (probs.shape[0],):
        raise ValueError(f"`probs` must be (N, C) and `noisy_labels` (N,), got {tuple(probs.shape)} and "
                         f"{tuple(noisy_labels.shape)}.")
    return probs.argmax(dim=1) == noisy_labels.to(probs.device)


def class_balance_weights(labels: Tensor, num_classes: int, cap: float = 3.0) -> Tensor:
    """Per-class loss weights that balance a labeled set (PES): ``mean(nonzero counts) / count_c``, 0 for
    a class without a sample, at most ``cap``.

    Example:
        >>> class_balance_weights(torch.tensor([0, 0, 0, 1]), 3)
        tensor([0.6667, 2.0000, 0.0000])
    """
    counts = torch.bincount(labels.long().cpu(), minlength=num_classes).float()
    present = counts > 0
    weights = torch.zeros(num_classes)
    if bool(present.any()):
        weights[present] = counts[present].mean() / counts[present]
    return weights.clamp(max=cap)


def split_two_view_batch(batch: Any) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(x_view1, x_view2, noisy_labels, indices)`` of a noisy-label training batch; any other layout is
    refused (ValueError naming the expected one and the fix)."""
    if isinstance(batch, Sequence) and len(batch) == 4 and all(isinstance(t, Tensor) for t in batch):
        return batch[0], batch[1], batch[2], batch[3]
    described = f"{type(batch).__name__} of length {len(batch)}" if isinstance(batch, Sequence) else \
        type(batch).__name__
    raise ValueError(
        f"PES and DivideMix need batches (x_view1, x_view2, noisy_label, index), got {described}. Fix: use "
        "`lpa3_lightning.data.NoisyLabelDataModule`, or a dataset that returns two augmented views of each "
        "image, its noisy label and its dataset index."
    )


def noisy_sizes(module: LPA3ModuleMixin, method: str) -> tuple[int, int]:
    """``(lpa3_num_samples, lpa3_num_classes)`` of ``module``; a ValueError naming ``method`` and the fix
    if either is unset."""
    num_samples, num_classes = getattr(module, "lpa3_num_samples", None), module.lpa3_num_classes
    if num_samples is None or num_classes is None:
        raise ValueError(f"{method} needs `lpa3_num_samples` (training set size) and `lpa3_num_classes` set on the "
                         "module. Fix: set both in __init__ (the data module's num_train and num_classes).")
    return int(num_samples), int(num_classes)


def check_noisy_batch(indices: Tensor, labels: Tensor, sizes: tuple[int, int]) -> None:
    """Refuse dataset indices or noisy labels out of ``sizes`` (``(num_samples, num_classes)``)."""
    check_dataset_indices(indices, sizes[0], name="noisy-label batch indices")
    check_class_labels(labels, sizes[1], name="noisy labels")


@torch.no_grad()
def sum_over_training_set(models: Sequence[nn.Module], loader: Iterable[Any], sizes: tuple[int, int], width: int,
                          values: Callable[[Tensor, Tensor, Tensor], Tensor],
                          begin_method: str) -> tuple[Tensor, Tensor, Tensor]:
    """``(sums (N, width), visits (N,), noisy labels (N,) long)`` per training sample of ``values(x1, x2,
    y)`` ``(B, width)`` over ``loader``'s two-view batches, ``models`` in eval mode, summed over the ranks
    under DDP; a ValueError for indices or labels out of ``sizes`` or a sample left out (naming
    ``begin_method``)."""
    device = next(models[0].parameters()).device
    sums = torch.zeros(sizes[0], width, device=device)
    visits = torch.zeros(sizes[0], device=device)
    label_sums = torch.zeros(sizes[0], device=device)
    modes = [m.training for m in models]
    for m in models:
        m.eval()
    try:
        for batch in loader:
            x1, x2, y, idx = (t.to(device) for t in split_two_view_batch(batch))
            check_noisy_batch(idx, y, sizes)
            sums.index_add_(0, idx, values(x1, x2, y))
            visits.index_add_(0, idx, torch.ones_like(idx, dtype=visits.dtype))
            label_sums.index_add_(0, idx, y.to(label_sums.dtype))
    finally:
        for m, mode in zip(models, modes):
            m.train(mode)
    if dist.is_available() and dist.is_initialized():
        for total in (sums, visits, label_sums):
            dist.all_reduce(total)
    check_split_loader_covered(visits, begin_method)
    # a sample seen twice (a padded distributed sampler) carries its one label twice
    return sums, visits, (label_sums / visits).round().long()


def two_view_logits(module: LPA3ModuleMixin, model: nn.Module, v1: Tensor, v2: Tensor, per_view: bool,
                    frozen: bool) -> tuple[Tensor, Tensor]:
    """The no-grad float logits of two views of the same rows: one forward per view (``per_view``) or one
    of both, the BatchNorm running statistics left alone where ``frozen`` (and on a rank with no rows,
    which forwards only to join SyncBatchNorm's collective)."""
    kept = batchnorm_buffers_kept(model) if v1.shape[0] == 0 else contextlib.nullcontext()
    with torch.no_grad(), kept, module.lpa3_forward_context():
        if per_view:
            return module.lpa3_logits(model(v1)).float(), module.lpa3_logits(model(v2)).float()
        with BatchNormStatisticsFrozen(model) if frozen else contextlib.nullcontext():
            logits = module.lpa3_logits(model(torch.cat([v1, v2]))).float()
    return logits[: v1.shape[0]], logits[v1.shape[0]:]


def mixmatch_forward(module: LPA3ModuleMixin, model: nn.Module, x1: Tensor, x2: Tensor, labeled: Tensor,
                     labeled_targets: Tensor, guess: Tensor, lam: float,
                     class_weights: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The training forward of a MixMatch step: both views of the labeled rows (``labeled_targets``
    ``(L, C)``) and of the others (``guess``), mixed up with ``lam`` and a fresh ``torch.randperm``; returns
    ``(logits, soft cross-entropy of the mixed labeled rows, probability MSE of the mixed unlabeled rows)``."""
    inputs = torch.cat([x1[labeled], x2[labeled], x1[~labeled], x2[~labeled]])
    targets = torch.cat([labeled_targets, labeled_targets, guess, guess]).to(inputs.device)
    mixed_x, mixed_t = mixup(inputs, targets, lam, torch.randperm(inputs.shape[0], device=inputs.device))
    logits = module.lpa3_logits(model(mixed_x))
    rows = 2 * labeled_targets.shape[0]
    return (logits, soft_cross_entropy(logits[:rows], mixed_t[:rows], class_weights),
            probability_mse(logits[rows:], mixed_t[rows:]))


def augmented_mixmatch_loss(module: LPA3ModuleMixin, augmented: AugmentedBatch, targets_adv: Tensor,
                            labeled_views: Tensor, labeled_targets: Tensor, lam: float, mix: bool = True) -> Tensor:
    """The LP-A3 term of a MixMatch step, as the LP-A3 authors' PES code: the hard positives ``augmented``
    (targets ``targets_adv`` ``(M, C)``) in a second mixup with ``labeled_views`` (targets ``labeled_targets``
    ``(L, C)``; the clean mixup's ``lam``, a fresh permutation), their rows through the solver's verified
    forward, a probability MSE against their mixed targets; ``mix=False`` trains them unmixed."""
    if not mix:
        return probability_mse(module.lpa3_forward_augmented(augmented), targets_adv)
    x_adv = augmented.inputs.to(labeled_views.dtype)
    inputs = torch.cat([labeled_views, x_adv])
    targets = torch.cat([labeled_targets, targets_adv.to(labeled_targets)])
    mixed_x, mixed_t = mixup(inputs, targets, lam, torch.randperm(inputs.shape[0], device=inputs.device))
    rows = slice(labeled_views.shape[0], None)
    logits = module.lpa3_forward_augmented(augmented, mixed_x[rows])
    if module.lpa3_settings.train_forward == "verified":  # lpa3/label_preserved: the unmixed x' in the same forward
        with torch.no_grad():  # (in "batch_stats" it would move the running statistics once more)
            module.lpa3_forward_augmented(augmented)
    return probability_mse(logits, mixed_t[rows])
