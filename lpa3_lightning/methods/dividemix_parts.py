"""DivideMix's own pieces (Li, Socher, Hoi, ICLR 2020): the loss-based split, co-refinement, co-guessing.

DivideMix trains two networks. At the start of every epoch after the warm-up, each network's
per-sample cross-entropy on the noisy labels (eval mode, no augmentation), min-max normalised,
is fitted by a two-component Gaussian mixture; the posterior of the low-loss component is the
probability ``w`` that a label is clean, and the *other* network trains with the samples whose
``w`` exceeds a threshold as labeled (co-divide). In its MixMatch step a labeled target is
refined with the network's own prediction (``sharpen(w y + (1 - w) p)``) and an unlabeled
target is guessed by both networks together (``sharpen`` of their mean over both views); a
prior penalty keeps the mean prediction near a prior (uniform in DivideMix; the class shares
where they are known and unequal, see ``check_class_prior``). The mixup and the two losses are
:mod:`lpa3_lightning.methods.mixmatch`'s. Pure functions, no Lightning.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from lpa3_lightning.core.checks import check_class_labels, check_class_prior
from lpa3_lightning.methods.mixmatch import sharpen

__all__ = ["clean_probability", "clean_probability_per_class", "co_guess", "co_refine", "negative_entropy",
           "normalized_losses", "prior_penalty", "stratified_selection"]


def normalized_losses(losses: Tensor) -> Tensor:
    """Min-max normalised per-sample losses, in ``[0, 1]`` (a constant vector gives zeros)."""
    if losses.dim() != 1 or losses.numel() == 0:
        raise ValueError(f"`losses` must be a non-empty 1-D tensor of per-sample losses, got shape {tuple(losses.shape)}.")
    low, high = losses.min(), losses.max()
    return (losses - low) / (high - low).clamp_min(torch.finfo(losses.dtype).tiny)


def clean_probability(losses: Tensor, seed: int = 0, max_iter: int = 10, tol: float = 1e-2,
                      reg_covar: float = 5e-4) -> Tensor:
    """Per-sample probability that the label is clean: a 2-component GMM on the losses.

    Fits scikit-learn's ``GaussianMixture`` (DivideMix's settings: 10 EM iterations, tolerance
    0.01, covariance regularisation 5e-4) to the losses as given (normalise them first, see
    :func:`normalized_losses`; DivideMix averages the last 5 epochs' normalised losses at 90%
    noise) and returns the posterior of the component with the smaller mean. ``seed`` fixes
    the k-means initialisation (DivideMix's code leaves it unseeded).

    Shape:
        - losses: ``(N,)``; output ``(N,)`` float32 on the losses' device.

    Example:
        >>> losses = torch.cat([torch.full((50,), 0.1), torch.full((50,), 0.9)]) + torch.linspace(0, 0.01, 100)
        >>> w = clean_probability(losses)
        >>> bool(w[:50].min() > 0.9), bool(w[50:].max() < 0.1)
        (True, True)
    """
    from sklearn.mixture import GaussianMixture  # a dependency of medmnist; imported where it is used

    if losses.dim() != 1 or losses.numel() < 2:
        raise ValueError(f"`losses` must be a 1-D tensor of at least 2 per-sample losses, got shape "
                         f"{tuple(losses.shape)}.")
    values = losses.detach().double().cpu().numpy().reshape(-1, 1)
    if not np.isfinite(values).all():
        raise ValueError("`losses` holds NaN or Inf. Fix: check the model's outputs before the split.")
    gmm = GaussianMixture(n_components=2, max_iter=max_iter, tol=tol, reg_covar=reg_covar, random_state=seed)
    gmm.fit(values)
    clean = int(np.argmin(gmm.means_.reshape(-1)))
    return torch.as_tensor(gmm.predict_proba(values)[:, clean], dtype=torch.float32, device=losses.device)


def clean_probability_per_class(losses: Tensor, labels: Tensor, num_classes: int, seed: int = 0) -> Tensor:
    """:func:`clean_probability` fitted once per (noisy) class instead of once over the whole set.

    DivideMix's single mixture puts one loss threshold on every class, so a class the network
    finds hard (higher losses on its clean labels too) gets few labeled samples, most of them
    noisy, and can collapse in the semi-supervised phase (measured in the project's results on
    MNIST-5k, 80% noise: one digit's test recall fell from 0.48 to 0.03 in the first
    semi-supervised epoch). A mixture per class gives each class a threshold of its own, as the
    class-wise selections of later work do (e.g. UNICON, Karim et al., CVPR 2022, selects a
    uniform number per class). Not in the DivideMix paper or code: an option, off by default.
    Classes with fewer than 4 samples take the global mixture's posterior.

    Shape:
        - losses: ``(N,)``; labels: ``(N,)`` noisy labels in ``[0, num_classes)``; output ``(N,)``.
    """
    if labels.shape != losses.shape:
        raise ValueError(f"`labels` must have the losses' shape {tuple(losses.shape)}, got {tuple(labels.shape)}.")
    check_class_labels(labels, num_classes, name="labels")
    labels = labels.to(losses.device).long()
    prob = clean_probability(losses, seed=seed)
    for c in range(num_classes):
        rows = (labels == c).nonzero().flatten()
        if rows.numel() >= 4 and bool(losses[rows].max() > losses[rows].min()):
            prob[rows] = clean_probability(losses[rows], seed=seed)
    return prob


def stratified_selection(losses: Tensor, labels: Tensor, num_classes: int,
                         count: int | list[int] | tuple[int, ...]) -> Tensor:
    """``count`` rows marked clean (1.0, the rest 0.0), each noisy class's lowest-loss rows.

    An int ``count`` is shared out over the noisy classes in proportion to their sizes (largest
    remainder, ties to the lower class); a list (or tuple) gives each class its own count. Each class
    fills its share with its own lowest-loss rows (ties to the lower index); every share fits
    its class, so exactly ``sum`` of the shares rows are marked. Ours, not DivideMix's (see
    ``DivideMixSettings.stratified_split``): the loss ranks the labels of one class
    well, while one threshold over every class starves the classes the network finds hard.

    Shape:
        - losses: ``(N,)``; labels: ``(N,)`` noisy labels in ``[0, num_classes)``; output ``(N,)``
          float32 on the losses' device.

    Example:
        >>> losses = torch.tensor([0.1, 0.9, 0.2, 0.8, 0.5, 0.6])
        >>> labels = torch.tensor([0, 0, 0, 1, 1, 1])
        >>> stratified_selection(losses, labels, num_classes=2, count=2).tolist()
        [1.0, 0.0, 0.0, 0.0, 1.0, 0.0]
        >>> stratified_selection(losses, labels, num_classes=2, count=[2, 0]).tolist()
        [1.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    """
    if losses.dim() != 1 or labels.shape != losses.shape:
        raise ValueError(f"`losses` and `labels` must be 1-D of one shape, got {tuple(losses.shape)} and "
                         f"{tuple(labels.shape)}. Fix: one loss and one noisy label per training sample.")
    per_class = isinstance(count, (list, tuple))
    if not per_class and (isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= losses.numel()):
        raise ValueError(f"`count` must be an int in [0, {losses.numel()}] or a list of one int per class, got "
                         f"{count!r}. Fix: the number of rows to mark clean, at most the number of samples.")
    check_class_labels(labels, num_classes, name="labels")
    labels = labels.to(losses.device).long()
    sizes = torch.bincount(labels.cpu(), minlength=num_classes)
    if per_class:
        shares = _class_counts(count, sizes)
    else:
        quota = count * sizes.double() / max(1, labels.numel())
        shares = quota.floor().long()
        remainder = count - int(shares.sum())
        if remainder > 0:  # largest fractional parts first; a stable sort sends ties to the lower class
            order = torch.sort(quota - shares.double(), descending=True, stable=True).indices
            shares[order[:remainder]] += 1
    selected = torch.zeros_like(losses, dtype=torch.float32)
    for c in range(num_classes):
        rows = (labels == c).nonzero().flatten()
        take = int(shares[c])  # a share never exceeds its class (see above)
        if take:
            selected[rows[torch.sort(losses[rows], stable=True).indices[:take]]] = 1.0
    return selected


def co_refine(labels: Tensor, probs_views: Tensor, w: Tensor, temperature: float = 0.5) -> Tensor:
    """DivideMix's label co-refinement: ``sharpen(w * onehot(y) + (1 - w) * mean_views(p), T)``.

    Shape:
        - labels: ``(B,)`` noisy labels; probs_views: ``(V, B, C)`` the network's predictions of
          the ``V`` augmented views; w: ``(B,)`` clean probabilities. Output ``(B, C)``.
    """
    if probs_views.dim() != 3 or probs_views.shape[1:2] != labels.shape or w.shape != labels.shape:
        raise ValueError(f"`probs_views` must be (V, B, C) with B = len(labels) = len(w), got "
                         f"{tuple(probs_views.shape)}, {tuple(labels.shape)}, {tuple(w.shape)}.")
    one_hot = F.one_hot(labels.long(), probs_views.shape[2]).to(probs_views.dtype)
    w = w.to(probs_views.dtype)[:, None]
    return sharpen(w * one_hot + (1 - w) * probs_views.mean(0), temperature)


def co_guess(probs_net1: Tensor, probs_net2: Tensor, temperature: float = 0.5) -> Tensor:
    """DivideMix's co-guessing: ``sharpen`` of both networks' predictions averaged over the views.

    Shape:
        - probs_net1, probs_net2: ``(V, B, C)``; output ``(B, C)``.
    """
    if probs_net1.shape != probs_net2.shape or probs_net1.dim() != 3:
        raise ValueError(f"both networks' predictions must be (V, B, C) of one shape, got {tuple(probs_net1.shape)} "
                         f"and {tuple(probs_net2.shape)}.")
    return sharpen(torch.cat([probs_net1, probs_net2]).mean(0), temperature)


def prior_penalty(logits: Tensor, prior: Tensor | None = None) -> Tensor:
    """``KL(prior || mean softmax)`` over the batch: DivideMix's regulariser against collapse.

    ``prior`` None is DivideMix's uniform prior, right for balanced classes. On an imbalanced set
    it pulls the mean prediction towards balance, away from the classes' true frequencies; pass
    the class frequencies ``(C,)`` (summing to 1) there. A prior on the host is checked here; the
    values of one already on an accelerator are the caller's to check (reading them back would
    synchronise the step), its shape is checked here.
    """
    mean_probs = torch.softmax(logits.float(), dim=1).mean(0)
    if prior is None:
        prior = torch.full_like(mean_probs, 1.0 / mean_probs.numel())
    else:
        if prior.shape != mean_probs.shape:  # metadata: checked on every device, no synchronisation
            raise ValueError(f"`prior` must hold {mean_probs.numel()} class frequencies (shape "
                             f"{tuple(mean_probs.shape)}), got shape {tuple(prior.shape)}.")
        if prior.device.type == "cpu":
            # a host prior's values are checked here; a prior already on an accelerator was checked
            # by its owner (reading its values back would synchronise the step)
            check_class_prior(prior, mean_probs.numel(), name="prior")
        prior = prior.to(mean_probs)
    return (prior * (prior.log() - mean_probs.clamp_min(1e-12).log())).sum()


def negative_entropy(logits: Tensor) -> Tensor:
    """Mean over the batch of ``sum_c p_c log p_c`` (DivideMix's warm-up penalty for asymmetric noise)."""
    log_p = F.log_softmax(logits.float(), dim=1)
    return (log_p.exp() * log_p).sum(1).mean()


def _class_counts(counts: list[int] | tuple[int, ...], sizes: Tensor) -> Tensor:
    """``counts`` as a ``(C,)`` tensor, refused unless it holds one int per class within the class's size."""
    values = list(counts)
    if len(values) != len(sizes) or any(isinstance(v, bool) or not isinstance(v, int) for v in values):
        raise ValueError(f"`count` as a list must hold one int per class ({len(sizes)}), got {values!r}. Fix: "
                         "each noisy class's number of rows to mark clean.")
    shares = torch.tensor(values, dtype=torch.long)
    if bool((shares < 0).any()) or bool((shares > sizes).any()):
        raise ValueError(f"`count` per class must lie in [0, class size] (sizes {sizes.tolist()}), got {values}. "
                         "Fix: no class can mark more rows than it holds.")
    return shares
