"""FixMatch with LP-A3 (semi-supervised; Sohn et al., NeurIPS 2020; Yang et al., NeurIPS 2022).

Each training batch holds a labeled batch ``(x, y, index)`` and an unlabeled batch
``(x_weak, x_strong, index)`` (``{"labeled": ..., "unlabeled": ...}``, as
:class:`~lpa3_lightning.data.SemiSupervisedDataModule` yields it). FixMatch's loss is::

    CE(F(x), y) + lambda_u * mean_u 1[max p(weak) >= 0.95] * CE(F(strong), argmax p(weak))

with the three views forwarded as ONE batch in the module's mode, as FixMatch's reference does
(kekmodel/FixMatch-pytorch ``train.py``, lines 356-363): BatchNorm normalises every view by the
statistics of the batch that trains, and the running statistics move once a step. The weak view's
pseudo-labels are the detached argmax of its slice of that forward. (Forwarding the weak view on its
own normalises it by its own batch's statistics, which under FixMatch's strong view, RandAugment and a
16 px Cutout, differ so much from the joint batch's that the weak forward is in effect another
network: measured, every confident pseudo-label fell in one class.)

LP-A3 attacks the weak view of the unlabeled samples with the pseudo-label as the label to preserve;
the time-consistency memory runs over the unlabeled set, fed by the weak slice's predictions. The
mixin adds ``weight * mean over the x' of 1[confidence >= 0.9] * CE(F(x'), pseudo-label)`` (the
authors' second threshold) once ``lpa3_loss_warmup_epochs`` have passed (the settings:
:class:`~lpa3_lightning.methods.settings.FixMatchSettings`).

The callback needs the pseudo-labels before the step (it solves in ``on_train_batch_start``), so
:meth:`FixMatchLPA3Mixin.lpa3_request` makes one extra forward of the same joint batch: no gradient,
the module's mode and the run's precision, BatchNorm running statistics left as they were. Its
pseudo-labels are those of the training forward that follows (same weights, same batch, same
statistics), so the label the solver preserves is the one the loss trains ``x'`` with, in the forward
the solver verified (:meth:`~LPA3ModuleMixin.lpa3_forward_augmented`). (With dropout in the network the
two forwards draw different masks, so a pseudo-label may differ between them: the ``x'`` term then
trains the label the solver preserved, FixMatch's term its own forward's.) Without the callback the step
is FixMatch's reference step and nothing more; the package's test suite checks both against a
transcription of the reference's step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


import torch
import torch.nn.functional as F
from torch import Tensor

from lpa3_lightning.core.augmented import LPA3Request
from lpa3_lightning.core.checks import check_class_labels
from lpa3_lightning.methods.base import BatchNormStatisticsFrozen, LPA3ModuleMixin
from lpa3_lightning.methods.guess_tally import GuessTally, warn_on_collapse
from lpa3_lightning.methods.settings import FixMatchSettings

__all__ = ["FixMatchLPA3Mixin", "split_semi_supervised_batch"]


def split_semi_supervised_batch(batch: Any) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(x, y, idx_labeled, x_weak, x_strong, idx_unlabeled)`` of a semi-supervised batch.

    Accepts ``{"labeled": (x, y, index), "unlabeled": (x_weak, x_strong, index)}`` (Lightning's
    ``CombinedLoader`` yields it from a dict of loaders).

    Raises:
        ValueError: for any other layout, naming the expected one and the fix.
    """
    if isinstance(batch, Sequence) and len(batch) == 3 and isinstance(batch[0], Mapping):
        batch = batch[0]  # (batch, batch_idx, dataloader_idx) from a CombinedLoader iterated by hand
    if isinstance(batch, Mapping) and {"labeled", "unlabeled"} <= set(batch):
        labeled, unlabeled = batch["labeled"], batch["unlabeled"]
        for part, value, layout, dataset in (("labeled", labeled, "(x, y, index)", "LabeledDataset"),
                                             ("unlabeled", unlabeled, "(x_weak, x_strong, index)", "UnlabeledDataset")):
            if not (isinstance(value, Sequence) and len(value) == 3):
                got = f"{type(value).__name__} of {len(value)} items" if isinstance(value, Sequence) else \
                    type(value).__name__
                raise ValueError(
                    f"FixMatch's {part} batch is {got}, e.g. {'(x, y)' if part == 'labeled' else '(x_weak, x_strong)'} "
                    f"without the dataset index; the {part} part needs {layout} (the TCS memory and the x' cache "
                    f"key their rows by it). Fix: wrap the {part} dataset in `lpa3_lightning.data.{dataset}` (it adds "
                    "the index), or use `lpa3_lightning.data.SemiSupervisedDataModule`."
                )
        return (*labeled, *unlabeled)  # type: ignore[return-value]
    raise ValueError(
        "FixMatch needs batches {'labeled': (x, y, index), 'unlabeled': (x_weak, x_strong, index)}, got "
        f"{type(batch).__name__}{' with keys ' + str(sorted(batch)) if isinstance(batch, Mapping) else ''}. Fix: use "
        "`lpa3_lightning.data.SemiSupervisedDataModule`, or a CombinedLoader({'labeled': ..., 'unlabeled': ...}) "
        "whose unlabeled dataset returns (weak view, strong view, dataset index)."
    )


class FixMatchLPA3Mixin(LPA3ModuleMixin):
    """FixMatch's loss with LP-A3 hard positives from the weak unlabeled view.

    Set :attr:`lpa3_num_classes` and (for the TCS memory over the unlabeled set)
    :attr:`lpa3_num_samples`, return the network from ``lpa3_model()`` and call
    :meth:`fixmatch_loss` in ``training_step``.

    Attributes:
        lpa3_settings: a :class:`~lpa3_lightning.methods.settings.FixMatchSettings` (thresholds,
            weights, the LP-A3 loss warm-up, ``solve_trained_only``; its docstring gives each
            default and its source); set ``self.lpa3_settings = FixMatchSettings(...)``.
        lpa3_num_samples: size of the unlabeled set (the TCS memory's), e.g. the datamodule's
            ``num_unlabeled``; the callback reads it when its ``num_samples`` is None. A fact
            about the data, not a setting.
        fixmatch_last_pseudo_labels: ``(confidence, pseudo_label)`` of the unlabeled rows of the
            last :meth:`fixmatch_loss` (detached): what its unlabeled term trained on, for a
            diagnostic of your own (their accuracy against labels the step never sees).
    """

    lpa3_settings_class = FixMatchSettings
    lpa3_settings: FixMatchSettings = FixMatchSettings()
    lpa3_num_samples: int | None = None
    fixmatch_last_pseudo_labels: tuple[Tensor, Tensor] | None = None
    _fixmatch_tallies: tuple[GuessTally, GuessTally] | None = None  # this epoch's (confident pseudo-labels, labels)

    def fixmatch_forward(self, batch: Any) -> tuple[Tensor, Tensor, Tensor]:
        """FixMatch's one forward: ``(logits_labeled, logits_weak, logits_strong)`` of the labeled,
        weak and strong views forwarded as one batch in the module's mode (every view normalised
        by the statistics of that batch, the running statistics moved once)."""
        x, _, _, x_weak, x_strong, _ = split_semi_supervised_batch(batch)
        logits = self.lpa3_logits(self.lpa3_model()(torch.cat([x, x_weak, x_strong])))
        n, u = x.shape[0], x_weak.shape[0]
        return logits[:n], logits[n:n + u], logits[n + u:]

    def fixmatch_pseudo_labels(self, weak_logits: Tensor) -> tuple[Tensor, Tensor]:
        """``(confidence, pseudo_label)``: the top probability and argmax of ``softmax(weak_logits / T)``."""
        probs = torch.softmax(weak_logits.detach().float() / self.lpa3_settings.temperature, dim=1)
        confidence, pseudo = probs.max(dim=1)
        return confidence, pseudo

    def _request_pseudo_labels(self, batch: Any) -> tuple[Tensor, Tensor]:
        """The pseudo-labels the training forward will compute, before it runs: the same joint
        forward without gradient, in the run's precision, BatchNorm running statistics unchanged."""
        with BatchNormStatisticsFrozen(self.lpa3_model()), torch.no_grad(), self.lpa3_forward_context():
            weak_logits = self.fixmatch_forward(batch)[1]
        return self.fixmatch_pseudo_labels(weak_logits)

    def lpa3_split_batch(self, batch: Any) -> tuple[Tensor, Tensor, Tensor]:
        """The unlabeled weak view with its pseudo-labels and dataset indices (what LP-A3 attacks)."""
        request = self.lpa3_request(batch)
        return request.inputs, request.targets, request.indices

    def lpa3_request(self, batch: Any) -> LPA3Request:
        """The weak view, its pseudo-labels (from the joint forward the step will make) and indices.

        During a fit, in an epoch where :meth:`lpa3_consumes_augmented` says no ``x'`` is trained
        (the LP-A3 term's warm-up, with ``solve_trained_only``), the callback solves nothing and reads
        no label, so no forward is spent: the request carries label 0 for every row, and an all-False
        ``train_mask``. Outside a fit the pseudo-labels are always computed.
        """
        _, _, _, x_weak, _, idx = split_semi_supervised_batch(batch)
        settings = self.lpa3_settings
        in_fit = bool(getattr(getattr(self, "_trainer", None), "training", False))
        if in_fit and not self.lpa3_consumes_augmented(int(getattr(self, "current_epoch", 0))):
            unused = torch.zeros(x_weak.shape[0], dtype=torch.long, device=x_weak.device)
            return LPA3Request(inputs=x_weak, targets=unused, indices=idx, train_mask=unused.bool())
        confidence, pseudo = self._request_pseudo_labels(batch)
        train_mask = None
        # the x' that fixmatch_loss will weigh above zero; under the authors' "batch_stats" forward
        # the x' batch's own statistics depend on every solved row, so all are solved there
        if settings.solve_trained_only and settings.train_forward == "verified":
            train_mask = (confidence >= settings.lpa3_confidence_threshold) & self._lpa3_term_on()
        return LPA3Request(inputs=x_weak, targets=pseudo, indices=idx, train_mask=train_mask)

    def lpa3_consumes_augmented(self, epoch: int) -> bool:
        """The LP-A3 term counts from ``lpa3_loss_warmup_epochs`` on: the callback solves nothing
        before (with ``solve_trained_only=False``, the authors' cost, it solves in the warm-up too)."""
        return epoch >= self.lpa3_settings.lpa3_loss_warmup_epochs or not self.lpa3_settings.solve_trained_only

    def _lpa3_term_on(self) -> bool:
        """Whether the LP-A3 term counts in this epoch (after ``lpa3_loss_warmup_epochs``)."""
        return int(getattr(self, "current_epoch", 0)) >= self.lpa3_settings.lpa3_loss_warmup_epochs

    def _count_pseudo_labels(self, pseudo: Tensor, confident: Tensor, y: Tensor, classes: int) -> Tensor:
        """Count this step's confident pseudo-labels and labeled targets by ``classes`` classes (the
        logits' width: the same on every step and rank; device work, read once an epoch by
        :meth:`fixmatch_pseudo_label_report`); the step's largest class's share."""
        if self._fixmatch_tallies is None:
            self._fixmatch_tallies = (GuessTally(), GuessTally())
        made, labeled = self._fixmatch_tallies
        step = made.add_labels(pseudo, classes, counted=confident)
        labeled.add_labels(y, classes)
        return step.max() / step.sum()  # NaN (0 / 0) on a step without confident pseudo-labels

    def fixmatch_pseudo_label_report(self) -> dict[str, float]:
        """Read this epoch's confident pseudo-labels and labeled targets by class (once: one host read, an
        all-reduce under DDP, which every rank must join) and start new tallies. Returns
        ``{"fixmatch/pseudo_label_top_class_share": share}``, the largest class's share of the epoch's
        confident pseudo-labels (empty when there were none), and warns (``rank_zero_warn``) when most of
        them are of one class while the labeled batches held several
        (:func:`~lpa3_lightning.methods.guess_tally.guess_collapse_warning`). Call it at the end of every
        training epoch (the ready :class:`~lpa3_lightning.FixMatchClassifier` does, and logs the share)."""
        made, labeled = self._fixmatch_tallies or (GuessTally(), GuessTally())
        self._fixmatch_tallies = None
        # the tallies' width (the logits'); a rank that counted nothing joins the all-reduce with
        # zeros of the module's class count
        classes = made.counts.shape[0] if made.counts is not None else int(self.lpa3_num_classes or 0)
        device = next(self.lpa3_model().parameters()).device
        counts, labeled_counts = made.take(classes, device), labeled.take(classes, device)
        if counts is None:
            return {}
        return {"fixmatch/pseudo_label_top_class_share": warn_on_collapse(
            "FixMatch", counts, labeled_counts, history=self.__dict__.setdefault("_collapse_history", {}))}

    def fixmatch_loss(self, batch: Any) -> tuple[Tensor, dict[str, Tensor]]:
        """FixMatch's loss plus the LP-A3 term for one training batch.

        Returns:
            ``(loss, parts)``; ``parts`` holds ``loss_labeled``, ``loss_unlabeled``,
            ``loss_lpa3``, ``mask_rate`` (share of pseudo-labels above the threshold),
            ``pseudo_label_top_class_share`` (the largest class's share of those confident
            pseudo-labels; near 1 while the labeled data hold several classes means the
            pseudo-labels collapsed: :meth:`fixmatch_pseudo_label_report` warns), ``num_augmented`` (the
            ``x'`` in the term's forward: with ``solve_trained_only`` only those above the second
            threshold) and ``lpa3_kept_rate`` (share of the selected rows above the second threshold).
        """
        self.lpa3_check_settings()
        settings = self.lpa3_settings
        x, y, _, x_weak, x_strong, idx_u = split_semi_supervised_batch(batch)
        classes = self.lpa3_num_classes
        if classes is not None:
            check_class_labels(y, classes, name="labeled batch targets")
        logits_l, logits_w, logits_s = self.fixmatch_forward(batch)
        self.lpa3_record_predictions(idx_u, logits_w)  # TCS runs over the unlabeled set
        confidence, pseudo = self.fixmatch_pseudo_labels(logits_w)
        self.fixmatch_last_pseudo_labels = (confidence, pseudo)
        loss_l = F.cross_entropy(logits_l, y)
        mask = (confidence >= settings.threshold).float()
        loss_u = (F.cross_entropy(logits_s, pseudo, reduction="none") * mask).mean()
        loss_a, num_aug, kept_rate = logits_l.new_zeros(()), 0, logits_l.new_zeros(())
        if self._lpa3_term_on():
            augmented = self.lpa3_take_augmented()
            if augmented is not None and len(augmented):
                kept = (confidence.index_select(0, augmented.positions()) >= settings.lpa3_confidence_threshold).float()
                # the x' keep the label the solver preserved: the request's pseudo-labels, those of this
                # forward (the same joint batch, weights and statistics)
                per_sample = F.cross_entropy(self.lpa3_forward_augmented(augmented), augmented.targets,
                                             reduction="none")
                # the mean over the selected rows, as the authors' term: rows left unsolved
                # (train_mask) would have weighed zero and still count in the denominator
                selected = len(augmented) + augmented.skipped
                loss_a = (per_sample * kept).sum() / selected
                num_aug, kept_rate = len(augmented), kept.sum() / selected
        loss = loss_l + settings.lambda_u * loss_u + settings.lpa3_weight * loss_a
        parts = {"loss_labeled": loss_l.detach(), "loss_unlabeled": loss_u.detach(), "loss_lpa3": loss_a.detach(),
                 "mask_rate": mask.mean(),
                 "pseudo_label_top_class_share": self._count_pseudo_labels(pseudo, mask > 0, y, logits_w.shape[1]),
                 "num_augmented": torch.tensor(float(num_aug)), "lpa3_kept_rate": kept_rate.detach()}
        return loss, parts
