"""FixMatch with LP-A3 (semi-supervised; Sohn et al., NeurIPS 2020; Yang et al., NeurIPS 2022).

Each training batch holds a labeled batch ``(x, y, index)`` and an unlabeled batch
``(x_weak, x_strong, index)`` (``{"labeled": ..., "unlabeled": ...}``, as
:class:`~lpa3_lightning.data.SemiSupervisedDataModule` yields it). FixMatch's loss is::

    CE(F(x), y) + lambda_u * mean_u 1[max p(weak) >= 0.95] * CE(F(strong), argmax p(weak))

LP-A3 attacks the weak view of the unlabeled samples with the model's pseudo-label as the label
to preserve; the time-consistency memory runs over the unlabeled set, from the weak-view
predictions. The mixin adds ``weight * mean over the x' of 1[confidence >= 0.9] * CE(F(x'),
pseudo-label)`` (the authors' second threshold) once ``lpa3_loss_warmup_epochs`` have passed
(the settings: :class:`~lpa3_lightning.methods.settings.FixMatchSettings`).

One weak forward per step: :meth:`FixMatchLPA3Mixin.lpa3_request` (called by the callback in
``on_train_batch_start``) forwards the weak view once, without gradient and in train mode (as
FixMatch's own weak branch, whose logits it detaches), and keeps the logits for this batch;
``training_step`` reuses them for the pseudo-labels, their confidences and the TCS record.
Without the callback the step makes that forward itself. Departure from FixMatch's reference
code, which forwards the labeled, weak and strong views in one batch: here the pseudo-labels
must exist before the step (the callback attacks with them), so the weak view is forwarded on
its own, normalised by its own batch statistics, without moving the BatchNorm running
statistics (those move once a step, in the forward of the labeled and strong views). Because the pseudo-labels are fixed
before the attack, the label the solver preserves is exactly the one the loss trains ``x'``
with, in the forward the solver verified (:meth:`~LPA3ModuleMixin.lpa3_forward_augmented`).
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
    """

    lpa3_settings_class = FixMatchSettings
    lpa3_settings: FixMatchSettings = FixMatchSettings()
    lpa3_num_samples: int | None = None
    _fixmatch_weak: tuple[Tensor, Tensor] | None = None  # (weak inputs, their detached logits)

    def lpa3_split_batch(self, batch: Any) -> tuple[Tensor, Tensor, Tensor]:
        """The unlabeled weak view with its pseudo-labels and dataset indices (what LP-A3 attacks)."""
        _, _, _, x_weak, _, idx = split_semi_supervised_batch(batch)
        return x_weak, self._pseudo_labels(self.fixmatch_weak_logits(batch))[1], idx

    def lpa3_request(self, batch: Any) -> LPA3Request:
        x_weak, pseudo, idx = self.lpa3_split_batch(batch)
        settings = self.lpa3_settings
        train_mask = None
        # the x' that fixmatch_loss will weigh above zero; under the authors' "batch_stats" forward
        # the x' batch's own statistics depend on every solved row, so all are solved there
        if settings.solve_trained_only and settings.train_forward == "verified":
            confidence = self._pseudo_labels(self.fixmatch_weak_logits(batch))[0]  # the logits are cached
            train_mask = (confidence >= settings.lpa3_confidence_threshold) & self._lpa3_term_on()
        return LPA3Request(inputs=x_weak, targets=pseudo, indices=idx, train_mask=train_mask)

    def lpa3_consumes_augmented(self, epoch: int) -> bool:
        """The LP-A3 term counts from ``lpa3_loss_warmup_epochs`` on: the callback solves nothing
        before (with ``solve_trained_only=False``, the authors' cost, it solves in the warm-up too)."""
        return epoch >= self.lpa3_settings.lpa3_loss_warmup_epochs or not self.lpa3_settings.solve_trained_only

    def _lpa3_term_on(self) -> bool:
        """Whether the LP-A3 term counts in this epoch (after ``lpa3_loss_warmup_epochs``)."""
        trainer = getattr(self, "_trainer", None)
        return (trainer.current_epoch if trainer is not None else 0) >= self.lpa3_settings.lpa3_loss_warmup_epochs

    def fixmatch_weak_logits(self, batch: Any) -> Tensor:
        """Detached logits of the weak unlabeled view: forwarded once per batch, then reused.

        The forward runs in the module's mode (train) without gradient, like FixMatch's weak
        branch, with BatchNorm on the weak batch's statistics; the running statistics are left
        as they were (they move once a step, in the labeled + strong forward).
        """
        _, _, _, x_weak, _, _ = split_semi_supervised_batch(batch)
        cached = self._fixmatch_weak
        if cached is not None and cached[0] is x_weak:
            return cached[1]
        model = self.lpa3_model()
        with BatchNormStatisticsFrozen(model), torch.no_grad():
            logits = self.lpa3_logits(model(x_weak)).detach()
        self._fixmatch_weak = (x_weak, logits)
        return logits

    def _pseudo_labels(self, weak_logits: Tensor) -> tuple[Tensor, Tensor]:
        probs = torch.softmax(weak_logits.float() / self.lpa3_settings.temperature, dim=1)
        confidence, pseudo = probs.max(dim=1)
        return confidence, pseudo

    def fixmatch_loss(self, batch: Any) -> tuple[Tensor, dict[str, Tensor]]:
        """FixMatch's loss plus the LP-A3 term for one training batch.

        Returns:
            ``(loss, parts)``; ``parts`` holds ``loss_labeled``, ``loss_unlabeled``,
            ``loss_lpa3``, ``mask_rate`` (share of pseudo-labels above the threshold),
            ``num_augmented`` (the ``x'`` in the term's forward: with ``solve_trained_only``
            only those above the second threshold) and ``lpa3_kept_rate`` (share of the selected
            rows above the second threshold).
        """
        self.lpa3_check_settings()
        settings = self.lpa3_settings
        x, y, _, x_weak, x_strong, idx_u = split_semi_supervised_batch(batch)
        classes = self.lpa3_num_classes
        if classes is not None:
            check_class_labels(y, classes, name="labeled batch targets")
        model = self.lpa3_model()
        weak_logits = self.fixmatch_weak_logits(batch)
        self._fixmatch_weak = None  # this batch's logits are used up
        self.lpa3_record_predictions(idx_u, weak_logits)  # TCS runs over the unlabeled set
        confidence, pseudo = self._pseudo_labels(weak_logits)
        # one forward of the labeled and strong views together (FixMatch also adds the weak view)
        logits = self.lpa3_logits(model(torch.cat([x, x_strong])))
        logits_l, logits_s = logits[: x.shape[0]], logits[x.shape[0]:]
        loss_l = F.cross_entropy(logits_l, y)
        mask = (confidence >= settings.threshold).float()
        loss_u = (F.cross_entropy(logits_s, pseudo, reduction="none") * mask).mean()
        loss_a, num_aug, kept_rate = logits.new_zeros(()), 0, logits.new_zeros(())
        if self._lpa3_term_on():
            augmented = self.lpa3_take_augmented()
            if augmented is not None and len(augmented):
                kept = (confidence.index_select(0, augmented.positions()) >= settings.lpa3_confidence_threshold).float()
                per_sample = F.cross_entropy(self.lpa3_forward_augmented(augmented), augmented.targets,
                                             reduction="none")
                # the mean over the selected rows, as the authors' term: rows left unsolved
                # (train_mask) would have weighed zero and still count in the denominator
                selected = len(augmented) + augmented.skipped
                loss_a = (per_sample * kept).sum() / selected
                num_aug, kept_rate = len(augmented), kept.sum() / selected
        loss = loss_l + settings.lambda_u * loss_u + settings.lpa3_weight * loss_a
        parts = {"loss_labeled": loss_l.detach(), "loss_unlabeled": loss_u.detach(), "loss_lpa3": loss_a.detach(),
                 "mask_rate": mask.mean(), "num_augmented": torch.tensor(float(num_aug)),
                 "lpa3_kept_rate": kept_rate.detach()}
        return loss, parts
