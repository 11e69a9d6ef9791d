"""FixMatch with LP-A3 (semi-supervised; Sohn et al., NeurIPS 2020; Yang et al., NeurIPS 2022).

FixMatch's loss, ``CE(F(x), y) + lambda_u * mean_u 1[max p(weak) >= 0.95] * CE(F(strong), argmax
p(weak))``, from ONE forward of the labeled, weak and strong views in the module's mode, as FixMatch's
reference (kekmodel/FixMatch-pytorch ``train.py``, lines 356-363); LP-A3 attacks the weak view with its
pseudo-label and adds ``lpa3_weight * mean over the x' of 1[confidence >= 0.9] * CE(F(x'), pseudo-label)``
once ``lpa3_loss_warmup_epochs`` have passed. The callback needs the pseudo-labels before the step, so
the request makes the step's joint forward and the step reuses it. Why the views are forwarded
together: docs/method.md, section 5.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from lpa3_lightning.core.checks import check_class_labels
from lpa3_lightning.methods.base import BatchNormStatisticsFrozen, LPA3ModuleMixin, LPA3Request
from lpa3_lightning.methods.guess_tally import GuessTally, warn_on_collapse
from lpa3_lightning.methods.settings import FixMatchSettings

__all__ = ["FixMatchLPA3Mixin", "split_semi_supervised_batch"]


def split_semi_supervised_batch(batch: Any) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(x, y, idx_labeled, x_weak, x_strong, idx_unlabeled)`` of a ``{"labeled": (x, y, index),
    "unlabeled": (x_weak, x_strong, index)}`` batch (a ``CombinedLoader``'s); any other layout is refused
    (ValueError naming the expected one and the fix)."""
    if isinstance(batch, Sequence) and len(batch) == 3 and isinstance(batch[0], Mapping):
        batch = batch[0]  # (batch, batch_idx, dataloader_idx) from a CombinedLoader iterated by hand
    if not (isinstance(batch, Mapping) and {"labeled", "unlabeled"} <= set(batch)):
        raise ValueError(
            "FixMatch needs batches {'labeled': (x, y, index), 'unlabeled': (x_weak, x_strong, index)}, got "
            f"{type(batch).__name__}{' with keys ' + str(sorted(batch)) if isinstance(batch, Mapping) else ''}. Fix: "
            "use `lpa3_lightning.data.SemiSupervisedDataModule`, or a CombinedLoader({'labeled': ..., 'unlabeled': "
            "...}) whose unlabeled dataset returns (weak view, strong view, dataset index).")
    for part, views, dataset in (("labeled", "x, y", "LabeledDataset"), ("unlabeled", "x_weak, x_strong",
                                                                          "UnlabeledDataset")):
        value = batch[part]
        if not (isinstance(value, Sequence) and len(value) == 3):
            got = f"{type(value).__name__} of {len(value)} items" if isinstance(value, Sequence) else \
                type(value).__name__
            raise ValueError(
                f"FixMatch's {part} batch is {got}, e.g. ({views}) without the dataset index; the {part} part needs "
                f"({views}, index) (the TCS memory and the x' cache key their rows by it). Fix: wrap the {part} "
                f"dataset in `lpa3_lightning.data.{dataset}` (it adds the index), or use "
                "`lpa3_lightning.data.SemiSupervisedDataModule`.")
    return (*batch["labeled"], *batch["unlabeled"])  # type: ignore[return-value]


class FixMatchLPA3Mixin(LPA3ModuleMixin):
    """FixMatch's loss with LP-A3 hard positives from the weak unlabeled view. Set ``lpa3_settings``
    (:class:`~lpa3_lightning.methods.settings.FixMatchSettings`), ``lpa3_num_classes`` and
    ``lpa3_num_samples`` (the unlabeled set's size), return the network from ``lpa3_model()`` and call
    :meth:`fixmatch_loss` in ``training_step``; ``fixmatch_last_pseudo_labels`` holds the last loss's
    detached ``(confidence, pseudo_label)``."""

    lpa3_settings_class = FixMatchSettings
    lpa3_settings: FixMatchSettings = FixMatchSettings()
    lpa3_num_samples: int | None = None
    fixmatch_last_pseudo_labels: tuple[Tensor, Tensor] | None = None
    _fixmatch_tallies: tuple[GuessTally, GuessTally] | None = None  # this epoch's (confident pseudo-labels, labels)
    #: the request's joint forward: (weak view, global step, logits), taken by this step's loss only
    _fixmatch_shared: tuple[Tensor, int, tuple[Tensor, Tensor, Tensor]] | None = None

    def fixmatch_forward(self, batch: Any) -> tuple[Tensor, Tensor, Tensor]:
        """``(logits_labeled, logits_weak, logits_strong)`` of the three views forwarded as one batch in the
        module's mode (the request's forward of this batch, if it made one)."""
        x, _, _, x_weak, x_strong, _ = split_semi_supervised_batch(batch)
        shared = self._fixmatch_shared
        if shared is not None and torch.is_grad_enabled():  # (a forward without gradient leaves it to the loss)
            self._fixmatch_shared = None
            if shared[0] is x_weak and shared[1] == int(getattr(self, "global_step", 0)):  # this step's batch
                return shared[2]
        logits = self.lpa3_logits(self.lpa3_model()(torch.cat([x, x_weak, x_strong])))
        n, u = x.shape[0], x_weak.shape[0]
        return logits[:n], logits[n:n + u], logits[n + u:]

    def fixmatch_pseudo_labels(self, weak_logits: Tensor) -> tuple[Tensor, Tensor]:
        """``(confidence, pseudo_label)``: the top probability and argmax of ``softmax(weak_logits / T)``."""
        probs = torch.softmax(weak_logits.detach().float() / self.lpa3_settings.temperature, dim=1)
        confidence, pseudo = probs.max(dim=1)
        return confidence, pseudo

    def lpa3_request(self, batch: Any) -> LPA3Request:
        """The weak view, its pseudo-labels and indices. In a fit with gradient on (the callback's request) on one
        device or under DDP (:meth:`_fixmatch_shares_forward`), from the step's joint forward, kept for this step's
        :meth:`fixmatch_forward`; otherwise from that forward without gradient or BatchNorm updates; in a fit's
        epoch that trains no ``x'``, label 0 and an all-False ``train_mask``."""
        _, _, _, x_weak, _, idx = split_semi_supervised_batch(batch)
        settings = self.lpa3_settings
        in_fit = bool(getattr(getattr(self, "_trainer", None), "training", False))
        if in_fit and not self.lpa3_consumes_augmented(int(getattr(self, "current_epoch", 0))):
            unused = torch.zeros(x_weak.shape[0], dtype=torch.long, device=x_weak.device)
            return LPA3Request(inputs=x_weak, targets=unused, indices=idx, train_mask=unused.bool())
        if torch.is_grad_enabled() and in_fit and self._fixmatch_shares_forward():
            self._fixmatch_shared = None
            with self.lpa3_forward_context():
                parts = self.fixmatch_forward(batch)
            self._fixmatch_shared = (x_weak, int(getattr(self, "global_step", 0)), parts)
            weak_logits = parts[1]
        else:
            with BatchNormStatisticsFrozen(self.lpa3_model()), torch.no_grad(), self.lpa3_forward_context():
                weak_logits = self.fixmatch_forward(batch)[1]
        confidence, pseudo = self.fixmatch_pseudo_labels(weak_logits)
        train_mask = None
        # the x' that fixmatch_loss will weigh above zero; under the authors' "batch_stats" forward
        # the x' batch's own statistics depend on every solved row, so all are solved there
        if settings.solve_trained_only and settings.train_forward == "verified":
            train_mask = (confidence >= settings.lpa3_confidence_threshold) & self._lpa3_term_on()
        return LPA3Request(inputs=x_weak, targets=pseudo, indices=idx, train_mask=train_mask)

    def _fixmatch_shares_forward(self) -> bool:
        """Whether the request's forward, made outside the strategy's wrapper, may be the step's: on one device,
        and under DDP from torch 2.14 (tested here; DDP's in-place buffer broadcast before the step's forward
        touches the graph's saved BatchNorm buffers, which older releases refuse at backward); never with
        ``share_forward=False``. Elsewhere (FSDP, DeepSpeed, older torch under DDP) the request forwards once
        more without gradient, as in 0.3."""
        from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

        if not self.lpa3_settings.share_forward:
            return False
        strategy = self.trainer.strategy  # (exact types: DeepSpeedStrategy subclasses DDPStrategy)
        if type(strategy) is SingleDeviceStrategy:
            return True
        return type(strategy) is DDPStrategy and (strategy.world_size == 1 or torch.__version__ >= (2, 14))

    def lpa3_consumes_augmented(self, epoch: int) -> bool:
        """The LP-A3 term counts from ``lpa3_loss_warmup_epochs`` on: the callback solves nothing
        before (with ``solve_trained_only=False``, the authors' cost, it solves in the warm-up too)."""
        return epoch >= self.lpa3_settings.lpa3_loss_warmup_epochs or not self.lpa3_settings.solve_trained_only

    def _lpa3_term_on(self) -> bool:
        """Whether the LP-A3 term counts in this epoch (after ``lpa3_loss_warmup_epochs``)."""
        return int(getattr(self, "current_epoch", 0)) >= self.lpa3_settings.lpa3_loss_warmup_epochs

    def _count_pseudo_labels(self, pseudo: Tensor, confident: Tensor, y: Tensor, classes: int) -> Tensor:
        """Count this step's confident pseudo-labels and labeled targets by class (device work); returns
        the step's largest class's share."""
        if self._fixmatch_tallies is None:
            self._fixmatch_tallies = (GuessTally(), GuessTally())
        made, labeled = self._fixmatch_tallies
        step = made.add_labels(pseudo, classes, counted=confident)
        labeled.add_labels(y, classes)
        return step.max() / step.sum()  # NaN (0 / 0) on a step without confident pseudo-labels

    def fixmatch_pseudo_label_report(self) -> dict[str, float]:
        """``{"fixmatch/pseudo_label_top_class_share": share}`` of this epoch's confident pseudo-labels (empty
        without any), warning on a collapse (:func:`~lpa3_lightning.methods.guess_tally.guess_collapse_warning`);
        one host read, an all-reduce under DDP that every rank must join, at each epoch's end."""
        made, labeled = self._fixmatch_tallies or (GuessTally(), GuessTally())
        self._fixmatch_tallies = None
        # a rank that counted nothing joins the all-reduce with zeros of the module's class count
        classes = made.counts.shape[0] if made.counts is not None else int(self.lpa3_num_classes or 0)
        device = next(self.lpa3_model().parameters()).device
        counts, labeled_counts = made.take(classes, device), labeled.take(classes, device)
        if counts is None:
            return {}
        return {"fixmatch/pseudo_label_top_class_share": warn_on_collapse(
            "FixMatch", counts, labeled_counts, history=self.__dict__.setdefault("_collapse_history", {}))}

    def fixmatch_loss(self, batch: Any) -> tuple[Tensor, dict[str, Tensor]]:
        """``(loss, parts)``: FixMatch's loss plus the LP-A3 term; ``parts``: ``loss_labeled``,
        ``loss_unlabeled``, ``loss_lpa3``, ``mask_rate`` (pseudo-labels above the threshold),
        ``pseudo_label_top_class_share`` (the largest class's share of those), ``num_augmented`` and
        ``lpa3_kept_rate`` (the selected rows above the second threshold)."""
        self.lpa3_check_settings()
        settings = self.lpa3_settings
        x, y, _, x_weak, x_strong, idx_u = split_semi_supervised_batch(batch)
        if self.lpa3_num_classes is not None:
            check_class_labels(y, self.lpa3_num_classes, name="labeled batch targets")
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
