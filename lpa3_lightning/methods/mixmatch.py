"""The MixMatch pieces that PES and DivideMix share: sharpening, mixup, the two losses, the ramp-up.

MixMatch (Berthelot et al., NeurIPS 2019) trains on a mixup of labeled samples (with their
labels) and unlabeled samples (with a sharpened guess of their label); noisy-label methods
reuse it after splitting the training set into a "clean" labeled part and an unlabeled rest:
PES (Bai et al., NeurIPS 2021) by agreement between the noisy label and the model's
prediction, DivideMix (Li et al., ICLR 2020) by a two-component Gaussian mixture on the loss.
Pure functions on tensors, no Lightning, so a plain PyTorch loop can use them too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "agreement_split",
    "class_balance_weights",
    "linear_rampup",
    "mixup",
    "mixup_lambda",
    "probability_mse",
    "sharpen",
    "soft_cross_entropy",
]


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
    """``l ~ Beta(alpha, alpha)``, then ``max(l, 1 - l)``: each mixed sample stays closer to its own row.

    ``alpha = 4`` in PES and DivideMix (PES switches to 0.75 in the second half of training).
    Drawn from torch's global generator (``seed_everything`` seeds it).
    """
    if not alpha > 0:
        raise ValueError(f"`alpha` must be > 0, got {alpha!r}. Fix: use 4 (PES, DivideMix) or 0.75 (MixMatch).")
    lam = float(torch.distributions.Beta(float(alpha), float(alpha)).sample())
    return max(lam, 1.0 - lam)


def mixup(inputs: Tensor, targets: Tensor, lam: float, permutation: Tensor) -> tuple[Tensor, Tensor]:
    """``lam * row + (1 - lam) * row[permutation]`` for the inputs and the (soft) targets.

    Shape:
        - inputs: ``(N, ...)``; targets: ``(N, C)`` probabilities; permutation: ``(N,)``.
    """
    if permutation.shape != (inputs.shape[0],) or targets.shape[0] != inputs.shape[0]:
        raise ValueError(f"`mixup` needs one target row and one permutation entry per input: inputs "
                         f"{tuple(inputs.shape)}, targets {tuple(targets.shape)}, permutation {tuple(permutation.shape)}.")
    mixed_x = lam * inputs + (1.0 - lam) * inputs[permutation]
    mixed_t = lam * targets + (1.0 - lam) * targets[permutation]
    return mixed_x, mixed_t


def soft_cross_entropy(logits: Tensor, targets: Tensor, class_weights: Tensor | None = None) -> Tensor:
    """``-sum_c w_c * mean_i(t_ic * log p_ic)``: cross-entropy against soft targets.

    With ``class_weights`` None every ``w_c = 1`` (the batch mean of the per-sample soft
    cross-entropy, DivideMix's ``Lx``); PES weighs the classes to balance the labeled set
    (:func:`class_balance_weights`). An empty batch gives 0.
    """
    if logits.shape[0] == 0:
        return logits.sum() * 0.0
    per_class = -(targets * F.log_softmax(logits.float(), dim=1)).mean(dim=0)
    if class_weights is not None:
        per_class = per_class * class_weights.to(per_class)
    return per_class.sum()


def probability_mse(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean over samples *and* classes of ``(softmax(logits) - targets)^2`` (MixMatch's unlabeled loss).

    Averaging over classes too is what PES's and DivideMix's code do; their ``lambda_u``
    values (e.g. 150, 25) are calibrated for it. An empty batch gives 0.
    """
    if logits.shape[0] == 0:
        return logits.sum() * 0.0
    return (torch.softmax(logits.float(), dim=1) - targets).pow(2).mean()


def linear_rampup(epoch_progress: float, start_epoch: float, length: float = 16.0) -> float:
    """``clip((epoch_progress - start_epoch) / length, 0, 1)``: the unlabeled loss weight's ramp.

    ``epoch_progress`` is fractional (``epoch + batch_idx / batches_per_epoch``); PES starts the
    ramp at the end of its early-stopping stage, DivideMix at the end of its warm-up; both
    ramp over 16 epochs.
    """
    if not length > 0:
        raise ValueError(f"`length` must be > 0, got {length!r}. Fix: use 16 (PES, DivideMix).")
    return float(min(max((epoch_progress - start_epoch) / length, 0.0), 1.0))


def agreement_split(probs: Tensor, noisy_labels: Tensor) -> Tensor:
    """PES's split: True where the model's prediction equals the noisy label (treated as labeled).

    Shape:
        - probs: ``(N, C)`` predicted probabilities (PES averages two augmented views).
        - noisy_labels: ``(N,)``; output ``(N,)`` bool.
    """
    if probs.dim() != 2 or noisy_labels.shape != (probs.shape[0],):
        raise ValueError(f"`probs` must be (N, C) and `noisy_labels` (N,), got {tuple(probs.shape)} and "
                         f"{tuple(noisy_labels.shape)}.")
    return probs.argmax(dim=1) == noisy_labels.to(probs.device)


def class_balance_weights(labels: Tensor, num_classes: int, cap: float = 3.0) -> Tensor:
    """Per-class loss weights that balance a labeled set (PES): ``mean(nonzero counts) / count_c``.

    A class with no labeled sample gets 0; a weight is at most ``cap`` (PES: 3).

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
