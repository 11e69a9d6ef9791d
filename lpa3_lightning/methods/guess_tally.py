"""The classes of the labels a method makes for its unlabeled rows over an epoch (FixMatch's confident
pseudo-labels, PES's and DivideMix's guesses; LP-A3 preserves them in every ``x'``), counted on the
device each step, read once an epoch, and the warning when they collapse onto one class or a few (which
the losses do not show). The thresholds' measurements: docs/semi-supervised.md.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["COLLAPSE_MARGIN", "COLLAPSE_MIN_GUESSES", "COLLAPSE_SHARE", "GuessTally", "STARVED_FRACTION",
           "STARVED_MIN_CLASSES", "guess_collapse_warning", "partially_collapsed", "starved_classes", "warn_on_collapse"]

#: the largest class's share of the epoch's made labels above which they are called collapsed (not lower:
#: healthy runs cross a half)
COLLAPSE_SHARE = 0.9
#: ... provided it also exceeds that class's share of the labeled set by this much
COLLAPSE_MARGIN = 0.25
#: fewer made labels in an epoch than this say nothing either way
COLLAPSE_MIN_GUESSES = 20
#: a partial collapse: a labeled class is starved when it gets under this fraction of its labeled share of the
#: made labels, and at least half of the labeled classes (STARVED_MIN_CLASSES or more) are starved two epochs
#: in a row (one such epoch is seen in healthy runs)
STARVED_FRACTION = 0.2
STARVED_MIN_CLASSES = 3


class GuessTally:
    """Counts of the made labels' classes since the last :meth:`take`, on their device (no host read)."""

    def __init__(self) -> None:
        self.counts: Tensor | None = None

    def add(self, guess: Tensor) -> None:
        """Count the argmax of each row of ``guess`` ``(B, C)`` (a sharpened guess, or logits)."""
        self.add_labels(guess.argmax(1), guess.shape[1])

    def add_labels(self, labels: Tensor, classes: int, counted: Tensor | None = None) -> Tensor:
        """Count ``labels`` ``(N,)`` of ``classes`` classes where ``counted`` (bool ``(N,)``; None: all; a
        weight, as a boolean index would read the count on the host). Returns this call's counts ``(C,)``."""
        weights = torch.ones_like(labels, dtype=torch.float32) if counted is None else counted.float()
        step = torch.zeros(classes, device=labels.device).index_add_(0, labels.long(), weights)
        if self.counts is None or self.counts.shape[0] != classes or self.counts.device != labels.device:
            self.counts = torch.zeros(classes, device=labels.device)
        self.counts += step
        return step

    def take(self, classes: int, device: torch.device | str) -> Tensor | None:
        """The counts ``(C,)`` on the host, summed over the ranks under DDP (a collective every rank must
        join; one that counted nothing joins with zeros of ``classes`` on ``device``), then reset; None
        when nothing was counted on any rank."""
        counts = self.counts if self.counts is not None else torch.zeros(classes, device=device)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(counts)
        self.counts = None
        host = counts.cpu()
        return host if float(host.sum()) > 0 else None


def starved_classes(counts: Tensor, labeled_counts: Tensor) -> list[int]:
    """The labeled classes that got under :data:`STARVED_FRACTION` of their labeled share of the made
    labels ``counts`` ``(C,)`` (``labeled_counts`` ``(C,)``: the labeled set's, or batches')."""
    counts, labeled_counts = counts.double().cpu(), labeled_counts.double().cpu()
    made, labeled = float(counts.sum()), float(labeled_counts.sum())
    if made <= 0 or labeled <= 0:
        return []
    starved = (labeled_counts > 0) & (counts / made < STARVED_FRACTION * labeled_counts / labeled)
    return starved.nonzero().flatten().tolist()


def partially_collapsed(counts: Tensor, labeled_counts: Tensor | None) -> bool:
    """Whether at least half of the labeled classes, :data:`STARVED_MIN_CLASSES` or more of them, are
    starved (:func:`starved_classes`) in an epoch of at least :data:`COLLAPSE_MIN_GUESSES` made labels."""
    if labeled_counts is None or float(counts.sum()) < COLLAPSE_MIN_GUESSES:
        return False
    labeled_classes = int((labeled_counts > 0).sum())
    return labeled_classes >= STARVED_MIN_CLASSES and 2 * len(starved_classes(counts, labeled_counts)) >= labeled_classes


def guess_collapse_warning(method: str, counts: Tensor, labeled_counts: Tensor | None,
                           where: str = "", starved_before: bool = False) -> tuple[float, str | None]:
    """The largest class's share of the made labels ``counts`` ``(C,)`` and the warning to give (None: none):
    in an epoch of :data:`COLLAPSE_MIN_GUESSES` labels or more, that share above :data:`COLLAPSE_SHARE` and
    the class's share of the labeled set ``labeled_counts`` by :data:`COLLAPSE_MARGIN` (two labeled classes
    or more), or :func:`partially_collapsed` now and (``starved_before``) the epoch before. ``method`` and
    ``where`` (``" (net1)"``) name the source."""
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
    key = method.lower()
    what, loss, cause, split, weight = _WORDING[key]
    advice = (f"Likely causes: {cause}; a labeled set with few samples of the other classes ({split}); {weight}; the "
              f"learning rate. Where to look: `{key}/{'pseudo_label' if key == 'fixmatch' else 'guess'}_top_class_share`"
              " in the logger (TensorBoard) per epoch, and the validation accuracy per class.")
    if labeled_classes >= 2 and share > COLLAPSE_SHARE and share >= labeled_share + COLLAPSE_MARGIN:
        return share, (
            f"{method}{where}: {share:.0%} of this epoch's {int(total)} {what} are class {top}, while the labeled set "
            f"holds {labeled_classes} classes (class {top}: {labeled_share:.0%} of it). {loss} (and LP-A3 preserves "
            f"those labels in each x'), so the network is learning one class for the unlabeled images. {advice}"
        )
    if starved_before and partially_collapsed(counts, labeled_counts):
        starved = starved_classes(counts, labeled_counts)
        kept = int((counts > 0).sum())
        return share, (
            f"{method}{where}: two epochs in a row, {len(starved)} of the {labeled_classes} labeled classes (classes "
            f"{starved}) got under a fifth of their share of the labeled set among the {int(total)} {what} of the "
            f"epoch; all of them fell in {kept} classes. {loss} (and LP-A3 preserves those labels in each x'), so the "
            f"network is learning a few classes for all the unlabeled images. {advice}"
        )
    return share, None


def warn_on_collapse(method: str, counts: Tensor, labeled_counts: Tensor | None, where: str = "",
                     history: dict | None = None) -> float:
    """:func:`guess_collapse_warning`, its warning given (``rank_zero_warn``); returns the share.
    ``history``: a dict the caller keeps across epochs, keyed by source, that remembers this epoch's
    partial collapse for the next call (without it the partial rule never fires)."""
    key = (method, where)
    starved_before = bool(history.get(key, False)) if history is not None else False
    share, message = guess_collapse_warning(method, counts, labeled_counts, where, starved_before)
    if history is not None:
        history[key] = partially_collapsed(counts, labeled_counts)
    if message is not None:
        # imported here: the mixins import without Lightning (a plain PyTorch loop may use them)
        from lightning.pytorch.utilities import rank_zero_warn

        rank_zero_warn(message)
    return share


#: per method: what the made labels are, how the loss uses them, the forward to check, the split, the weight
_MIXMATCH = ("guessed labels of unlabeled rows", "The MixMatch loss trains every unlabeled row towards its guess")
_GUESSING = ("a guessing forward whose BatchNorm statistics are not those of the batch that trains (the guess comes "
             "from a forward of the unlabeled views alone; compare `{}`)")
_RAMP = "an unlabeled weight that ramps up too fast for the data (`lambda_u`, `rampup_epochs`)"
_WORDING = {
    "fixmatch": (
        "confident pseudo-labels", "The unlabeled loss trains the strong view of each such row towards it",
        "the weak view forwarded apart from the batch that trains (BatchNorm then normalises it by other statistics: "
        "forward the labeled, weak and strong views together, as `fixmatch_loss` does)",
        "the labeled split: labels per class", "an unlabeled weight too high for the labels (`lambda_u`)"),
    "pes": (*_MIXMATCH, _GUESSING.format("pes.guess_forward"),
            "`train/labeled_share`, the class weights, `pes.class_weight_cap`", _RAMP),
    "dividemix": (*_MIXMATCH, _GUESSING.format("dividemix.guess_bn_updates"),
                  "`train/<network>/labeled_share`, `dividemix.threshold`, `split_per_class`, `stratified_split`",
                  _RAMP),
}
