"""The classes of the guessed labels over an epoch (PES, DivideMix), and a warning when they collapse.

PES and DivideMix train their unlabeled rows towards a sharpened guess of the network (MixMatch), and
LP-A3 preserves that guess's argmax in every ``x'``. If the guesses fall into one class, the loss
teaches the network that class for every unlabeled image and the network's next guesses agree: a
collapse the losses do not show (the unlabeled loss is small when the network agrees with itself).
:class:`GuessTally` counts the classes of the guessed labels on the device, every step, without a
host read; the epoch's end reads it once (all-reduced under DDP) and :func:`guess_collapse_warning`
words the warning when most guessed labels are of one class while the labeled set holds several.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["COLLAPSE_MARGIN", "COLLAPSE_MIN_GUESSES", "COLLAPSE_SHARE", "GuessTally", "guess_collapse_warning"]

#: the largest class's share of the epoch's guessed labels above which they are called collapsed ...
COLLAPSE_SHARE = 0.5
#: ... provided it also exceeds that class's share of the labeled set by this much (a class that
#: holds 74% of the labeled set may hold 74% of the guesses: PneumoniaMNIST's pneumonia class)
COLLAPSE_MARGIN = 0.25
#: fewer guessed labels in an epoch than this say nothing either way
COLLAPSE_MIN_GUESSES = 20


class GuessTally:
    """Counts of the guessed labels' classes since the last :meth:`take`, kept on the guesses' device.

    :meth:`add` is device work only (an ``index_add_``), so a step reads nothing on the host for it.
    """

    def __init__(self) -> None:
        self.counts: Tensor | None = None

    def add(self, guess: Tensor) -> None:
        """Count the argmax of each row of ``guess`` ``(B, C)`` (a sharpened guess, or logits)."""
        classes = guess.shape[1]
        if self.counts is None or self.counts.shape[0] != classes or self.counts.device != guess.device:
            self.counts = torch.zeros(classes, device=guess.device)
        labels = guess.argmax(1)
        self.counts.index_add_(0, labels, torch.ones_like(labels, dtype=self.counts.dtype))

    def take(self, classes: int, device: torch.device | str) -> Tensor | None:
        """The counts ``(C,)`` on the host (summed over the ranks under DDP: a collective every rank
        must join, each with its tally or, where it counted nothing, zeros of ``classes`` on
        ``device``), then zero; None when nothing was counted on any rank."""
        counts = self.counts if self.counts is not None else torch.zeros(classes, device=device)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(counts)
        self.counts = None
        host = counts.cpu()
        return host if float(host.sum()) > 0 else None


def guess_collapse_warning(method: str, counts: Tensor, labeled_counts: Tensor | None,
                           where: str = "") -> tuple[float, str | None]:
    """The largest class's share of the guessed labels ``counts`` ``(C,)``, and the warning to give
    (None: none) when that share is above :data:`COLLAPSE_SHARE` and above the class's share of the
    labeled set ``labeled_counts`` ``(C,)`` by :data:`COLLAPSE_MARGIN`, while the labeled set holds at
    least two classes and the epoch made at least :data:`COLLAPSE_MIN_GUESSES` guesses.

    ``method`` (``"PES"``, ``"DivideMix"``) and ``where`` (e.g. ``" (net1)"``) name the source in the message.
    """
    counts = counts.double()
    total = float(counts.sum())
    top = int(counts.argmax())
    share = float(counts[top]) / total if total > 0 else 0.0
    if labeled_counts is None or total < COLLAPSE_MIN_GUESSES:
        return share, None
    labeled_counts = labeled_counts.double().cpu()
    labeled_total = float(labeled_counts.sum())
    labeled_classes = int((labeled_counts > 0).sum())
    labeled_share = float(labeled_counts[top]) / labeled_total if labeled_total > 0 else 0.0
    if labeled_classes < 2 or share <= COLLAPSE_SHARE or share < labeled_share + COLLAPSE_MARGIN:
        return share, None
    key = method.lower()
    message = (
        f"{method}{where}: {share:.0%} of this epoch's {int(total)} guessed labels of unlabeled rows are class {top}, "
        f"while the labeled set holds {labeled_classes} classes (class {top}: {labeled_share:.0%} of it). The "
        "MixMatch loss trains every unlabeled row towards its guess (and LP-A3 preserves the guessed label in each "
        "x'), so the network is learning one class for the unlabeled images. Likely causes: a guessing forward "
        "whose BatchNorm statistics are not those of the batch that trains (the guess comes from a forward of the "
        "unlabeled views alone; compare "
        + ("`pes.guess_forward`" if key == "pes" else "`dividemix.guess_bn_updates`")
        + "); a labeled set with few samples of the other classes (the split: "
        + ("`train/labeled_share`, the class weights, `pes.class_weight_cap`" if key == "pes" else
           "`train/<network>/labeled_share`, `dividemix.threshold`, `split_per_class`, `stratified_split`")
        + "); an unlabeled weight that ramps up too fast for the data (`lambda_u`, `rampup_epochs`); the learning "
        f"rate. Where to look: `{key}/guess_top_class_share` in the logger (TensorBoard) per epoch, and the "
        "validation accuracy per class."
    )
    return share, message
