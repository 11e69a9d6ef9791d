"""Watch the classes of the labels a method makes for itself (pseudo-labels, guessed labels).

A semi-supervised or noisy-label method trains on labels it computes from its own predictions. When
those collapse onto one class (measured here once: FixMatch's weak view forwarded apart from the
batch that trains put 224 of 224 confident pseudo-labels in one class, 8.5% of them right, beside a
test accuracy of 0.75), the loss still falls and nothing else in the logs says so. :class:`LabelShareWatch`
keeps, on the device and without a host read per step, the class counts of the confident made
labels and of the true labels seen beside them, and reads them once an epoch: a warning when the
made labels sit almost all in one class while the true labels hold several.
"""

from __future__ import annotations

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

__all__ = ["LabelShareWatch", "top_class_share"]


def top_class_share(labels: Tensor, num_classes: int) -> Tensor:
    """The largest class's share of ``labels`` (a device scalar; NaN for no labels).

    Example:
        >>> float(top_class_share(torch.tensor([1, 1, 1, 0]), 3))
        0.75
    """
    counts = torch.bincount(labels.reshape(-1).long(), minlength=num_classes).float()
    return counts.max() / counts.sum()  # 0 / 0 = NaN when nothing is counted


class LabelShareWatch:
    """Class counts of the confident made labels and of the true labels, read once an epoch.

    Args:
        num_classes: the classes of the labels.
        what: how the warning names the made labels (``"confident pseudo-labels"``).
        where: the logged key to look at, named in the warning.
        causes: the likely causes and fixes, named in the warning.
        share: warn when the largest class holds at least this share of the made labels ...
        minimum: ... of at least this many made labels, while the true labels seen hold two classes
            or more and their own largest class stays below ``share``.
        check_after: steps of an epoch after which it reads the counts (once an epoch; an epoch
            shorter than this is read at the next epoch's first step).
    """

    def __init__(self, num_classes: int, what: str, where: str, causes: str, share: float = 0.9,
                 minimum: int = 50, check_after: int = 50) -> None:
        self.num_classes, self.what, self.where, self.causes = num_classes, what, where, causes
        self.share, self.minimum, self.check_after = share, minimum, check_after
        self.epoch: int | None = None
        self.steps = 0
        self.checked = False
        self.made: Tensor | None = None
        self.true: Tensor | None = None

    def update(self, epoch: int, made: Tensor, true: Tensor) -> None:
        """Count one step's confident made labels and the true labels beside them."""
        if epoch != self.epoch:
            if not self.checked:
                self._check()  # an epoch shorter than check_after
            self.epoch, self.steps, self.checked = epoch, 0, False
            self.made = self.true = None
        made_counts = torch.bincount(made.reshape(-1).long(), minlength=self.num_classes)
        true_counts = torch.bincount(true.reshape(-1).long(), minlength=self.num_classes)
        self.made = made_counts if self.made is None else self.made + made_counts
        self.true = true_counts if self.true is None else self.true + true_counts
        self.steps += 1
        if not self.checked and self.steps >= self.check_after:
            self._check()

    def _check(self) -> None:
        self.checked = True
        if self.made is None or self.true is None:
            return
        made, true = (c.tolist() for c in torch.stack([self.made, self.true]).cpu())  # the epoch's one host read
        total, true_total = sum(made), sum(true)
        if total < self.minimum or true_total == 0:
            return
        top = max(range(self.num_classes), key=made.__getitem__)
        true_classes = sum(1 for c in true if c)
        if made[top] / total >= self.share and true_classes >= 2 and max(true) / true_total < self.share:
            rank_zero_warn(
                f"{made[top] / total:.0%} of the {total} {self.what} of epoch {self.epoch} ({self.steps} steps) "
                f"are class {top}, while the labeled data seen beside them hold {true_classes} classes: the "
                f"method is training on labels of one class. Likely causes: {self.causes} Look at `{self.where}` "
                "over the steps (this warning is given at most once an epoch)."
            )
