"""PES (Progressive Early Stopping, Bai et al., NeurIPS 2021) with LP-A3 hard positives.

Phases by epoch: ``"early"`` (T1, cross-entropy on the noisy labels), ``"refine"`` (T2, the head
re-initialised and trained alone), ``"semi"`` (each epoch the rows whose noisy label agrees with the
prediction are labeled, then MixMatch). LP-A3 (the authors' PES code): the unlabeled rows' first view is
attacked with the guessed label, the ``x'`` mixed up with the labeled views. The TCS memory is fed every
row's logits in the first two phases and the unlabeled rows' guessing forward after. Departures from the
authors' code, each with its reason: docs/method.md, section 5.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lpa3_lightning.core.distributed import needs_every_rank
from lpa3_lightning.methods.base import LPA3ModuleMixin, LPA3Request
from lpa3_lightning.methods.guess_tally import GuessTally, warn_on_collapse
from lpa3_lightning.methods.mixmatch import (
    agreement_split,
    augmented_mixmatch_loss,
    check_noisy_batch,
    class_balance_weights,
    linear_rampup,
    mixmatch_forward,
    mixup_lambda,
    noisy_sizes,
    sharpen,
    split_two_view_batch,
    sum_over_training_set,
    two_view_logits,
)
from lpa3_lightning.methods.settings import PESSettings

__all__ = ["PESLPA3Mixin", "split_two_view_batch"]

PESPhase = Literal["early", "refine", "semi"]


class PESLPA3Mixin(LPA3ModuleMixin):
    """PES's phases, split and MixMatch loss with LP-A3 hard positives, on ``(x_view1, x_view2, noisy_label,
    index)`` batches. Set ``lpa3_settings`` (:class:`~lpa3_lightning.methods.settings.PESSettings`),
    ``lpa3_num_classes`` and ``lpa3_num_samples``, return the network from ``lpa3_model()``, call
    :meth:`pes_begin_epoch` every epoch and :meth:`pes_loss` in ``training_step``; the refine phase's
    optimizer must update :meth:`pes_head` only."""

    lpa3_settings_class = PESSettings
    lpa3_settings: PESSettings = PESSettings()
    lpa3_num_samples: int | None = None
    _pes_labeled: Tensor | None = None  # (N,) bool, the current split
    _pes_class_weights: Tensor | None = None
    _pes_labeled_counts: Tensor | None = None  # (C,) the labeled set's noisy classes, on the host
    _pes_tally: GuessTally | None = None  # the classes of this epoch's guessed labels, on the device
    # (the batch's view-1 inputs, the unlabeled rows' sharpened guess, their view-1 logits)
    _pes_guess: tuple[Tensor, Tensor, Tensor] | None = None

    #: batch composition rule of :class:`~lpa3_lightning.data.sampling.SplitBalancedSampler`
    noisy_batch_rule: str = "pes"

    def noisy_split_mask(self) -> Tensor | None:
        """The split (``(N,)`` bool, True = labeled) in the semi phase, else None: the data module's draw."""
        if self._pes_labeled is None or self.pes_phase(self.pes_current_epoch()) != "semi":
            return None
        return self._pes_labeled

    # ------------------------------------------------------------------ phases
    def pes_phase(self, epoch: int) -> PESPhase:
        """``"early"`` before T1, ``"refine"`` for the next T2 epochs, ``"semi"`` after."""
        if epoch < self.lpa3_settings.early_epochs:
            return "early"
        return "refine" if epoch < self.pes_semi_start else "semi"

    def lpa3_consumes_augmented(self, epoch: int) -> bool:
        """PES trains ``x'`` in its semi-supervised phase only (the callback solves nothing before it)."""
        return self.pes_phase(epoch) == "semi"

    @property
    def pes_semi_start(self) -> int:
        """First epoch of the semi-supervised phase (T1 + T2), where the ramp starts."""
        return self.lpa3_settings.early_epochs + self.lpa3_settings.refine_epochs

    def pes_alpha_late_start(self) -> int | None:
        """The first epoch of mixup's ``alpha_late``: ``alpha_late_epoch``, None or negative meaning
        never (None returned). The ready :class:`~lpa3_lightning.PESClassifier` resolves None to half
        of its run."""
        start = self.lpa3_settings.alpha_late_epoch
        return None if start is None or start < 0 else start

    def pes_head(self) -> nn.Module:
        """The classifier head that the refine phase re-initialises: the model's last ``nn.Linear`` (a
        ValueError without one); override for another head."""
        linears = [m for m in self.lpa3_model().modules() if isinstance(m, nn.Linear)]
        if not linears:
            raise ValueError("PES re-initialises the classifier head, but the model has no nn.Linear. Fix: override "
                             "`pes_head()` to return the head module.")
        return linears[-1]

    def pes_current_epoch(self) -> int:
        trainer = getattr(self, "_trainer", None)
        return int(trainer.current_epoch) if trainer is not None else 0

    # ------------------------------------------------------------------ per epoch
    def pes_begin_epoch(self, epoch: int, loader: Any) -> None:
        """Re-initialise the head when the refine phase starts; in the semi phase, refresh the split with
        ``loader``, two-view batches over every training sample (a sample left out is refused;
        ``noisy_training.whole_training_set_loader``)."""
        if epoch == self.lpa3_settings.early_epochs and self.lpa3_settings.refine_epochs > 0:
            for module in self.pes_head().modules():
                if hasattr(module, "reset_parameters"):
                    module.reset_parameters()  # in place: optimizers keep the same parameters
        if self.pes_phase(epoch) == "semi":
            self.pes_refresh_split(loader)

    @torch.no_grad()
    def pes_refresh_split(self, loader: Any) -> Tensor:
        """Predict the whole training set (eval mode, mean of the two views' probabilities), mark as
        labeled the samples whose noisy label agrees, and set the class weights; the same on every
        rank under DDP. Returns the labeled mask ``(N,)``."""
        model = self.lpa3_model()
        sizes = self._pes_sizes()

        def mean_probs(x1: Tensor, x2: Tensor, _: Tensor) -> Tensor:
            return (torch.softmax(self.lpa3_logits(model(x1)).float(), 1)
                    + torch.softmax(self.lpa3_logits(model(x2)).float(), 1)) / 2

        sums, visits, noisy = sum_over_training_set([model], loader, sizes, sizes[1], mean_probs, "pes_begin_epoch")
        labeled = agreement_split(sums / visits[:, None], noisy)
        self._pes_labeled = labeled
        self._pes_class_weights = class_balance_weights(noisy[labeled], sizes[1], self.lpa3_settings.class_weight_cap)
        self._pes_labeled_counts = torch.bincount(noisy[labeled].long().cpu(), minlength=sizes[1])
        return labeled

    def _pes_sizes(self) -> tuple[int, int]:
        return noisy_sizes(self, "PES")

    # ------------------------------------------------------------------ request
    def _pes_split_rows(self, idx: Tensor) -> Tensor:
        if self._pes_labeled is None:
            raise RuntimeError("The PES split is not computed yet: call `pes_begin_epoch(epoch, loader)` at the start "
                               "of every epoch (the ready PESClassifier does).")
        return self._pes_labeled.to(idx.device)[idx]

    @torch.no_grad()
    def pes_guess(self, batch: Any) -> Tensor:
        """Sharpened mean prediction of the two views of this batch's unlabeled rows, forwarded once per
        batch in train mode as ``guess_forward`` says (``"joint_frozen"``: both views in one forward,
        the BatchNorm running statistics left alone), then reused by the loss and the request."""
        x1, x2, _, idx = split_two_view_batch(batch)
        u1, u2 = x1[~self._pes_split_rows(idx)], x2[~self._pes_split_rows(idx)]
        cached = self._pes_guess
        if cached is not None and cached[0] is x1:
            return cached[1]
        model = self.lpa3_model()
        classes = int(self.lpa3_num_classes or 0)
        if u1.shape[0] == 0 and not needs_every_rank(model):
            guess, logits_u1 = u1.new_zeros(0, classes), u1.new_zeros(0, classes)
        else:  # (a rank without unlabeled rows still forwards its empty batch where SyncBatchNorm syncs)
            per_view = self.lpa3_settings.guess_forward == "reference"  # PES_semi.py:100-102: u1, then u2
            logits_u1, logits_u2 = two_view_logits(self, model, u1, u2, per_view=per_view, frozen=not per_view)
            probs_u1, probs_u2 = torch.softmax(logits_u1, 1), torch.softmax(logits_u2, 1)
            guess = sharpen((probs_u1 + probs_u2) / 2, self.lpa3_settings.temperature)
        self._pes_guess = (x1, guess, logits_u1)
        return guess

    def lpa3_request(self, batch: Any) -> LPA3Request:
        """Semi phase: the unlabeled rows' first view with their guessed label; before it, every row with
        its noisy label (no ``x'`` is trained there)."""
        x1, _, y, idx = split_two_view_batch(batch)
        if self.pes_phase(self.pes_current_epoch()) != "semi":
            return LPA3Request(inputs=x1, targets=y, indices=idx)
        unlabeled = ~self._pes_split_rows(idx)
        guess = self.pes_guess(batch)
        x_u, idx_u = x1[unlabeled], idx[unlabeled]
        sure = self._pes_sure(guess)
        if sure is not None:  # only confident guesses are preserved
            x_u, idx_u, guess = x_u[sure.to(x_u.device)], idx_u[sure.to(idx_u.device)], guess[sure]
        return LPA3Request(inputs=x_u, targets=guess.argmax(1), indices=idx_u)

    def _pes_sure(self, guess: Tensor) -> Tensor | None:
        """The unlabeled rows offered to the attack (``lpa3_confidence``; None: all), for request and loss."""
        confidence = self.lpa3_settings.lpa3_confidence
        return None if confidence is None else guess.max(1).values >= confidence

    # ------------------------------------------------------------------ loss
    def pes_loss(self, batch: Any, batch_idx: int = 0,
                 batches_per_epoch: int | None = None) -> tuple[Tensor, dict[str, Tensor]]:
        """``(loss, parts)`` of this batch in the current phase (``parts``: ``loss_labeled``, ``loss_unlabeled``,
        ``loss_lpa3``, ``unlabeled_weight``, ``labeled_share``, ``num_augmented``); ``batches_per_epoch``
        (None: the trainer's) paces the ramp-up within an epoch."""
        self.lpa3_check_settings()
        settings = self.lpa3_settings
        x1, x2, y, idx = split_two_view_batch(batch)
        check_noisy_batch(idx, y, self._pes_sizes())
        model = self.lpa3_model()
        epoch = self.pes_current_epoch()
        zero = x1.new_zeros(())
        if self.pes_phase(epoch) != "semi":
            logits = self.lpa3_logits(model(x1))
            self.lpa3_record_predictions(idx, logits)
            loss = F.cross_entropy(logits, y)
            parts = {"loss_labeled": loss.detach(), "loss_unlabeled": zero, "loss_lpa3": zero,
                     "unlabeled_weight": zero, "labeled_share": torch.ones(()), "num_augmented": zero}
            # nothing is trained on x' before the semi phase: left untaken, so the callback counts it as not trained on
            return loss, parts
        labeled = self._pes_split_rows(idx)
        guess = self.pes_guess(batch)
        if self._pes_tally is None:
            self._pes_tally = GuessTally()
        self._pes_tally.add(guess)  # device work: read once an epoch, by pes_guess_report
        logits_u1 = self._pes_guess[2] if self._pes_guess is not None else guess
        self._pes_guess = None
        # TCS runs over the unlabeled samples, on the guessing forward's view-1 predictions
        self.lpa3_record_predictions(idx[~labeled], logits_u1)
        num_classes = guess.shape[1] if guess.numel() else int(self.lpa3_num_classes or 0)
        one_hot = F.one_hot(y[labeled].long(), num_classes).float()
        late = self.pes_alpha_late_start()
        lam = mixup_lambda(settings.alpha_late if late is not None and epoch >= late else settings.alpha)
        _, loss_l, loss_u = mixmatch_forward(self, model, x1, x2, labeled, one_hot, guess, lam, self._pes_class_weights)
        progress = epoch + batch_idx / self.lpa3_batches_per_epoch(batches_per_epoch)
        ramp = settings.lambda_u * linear_rampup(progress, self.pes_semi_start, settings.rampup_epochs)
        loss_a, num_aug = zero, 0
        augmented = self.lpa3_take_augmented()
        if augmented is not None and len(augmented):
            sure = self._pes_sure(guess)  # the x' rows are positions among the rows offered to the attack
            offered = guess if sure is None else guess[sure]
            target_adv = offered.index_select(0, augmented.positions().to(guess.device))
            loss_a = augmented_mixmatch_loss(self, augmented, target_adv, torch.cat([x1[labeled], x2[labeled]]),
                                             torch.cat([one_hot, one_hot]), lam, mix=settings.lpa3_mixup)
            num_aug = len(augmented)
        loss = loss_l + ramp * (loss_u + loss_a)
        parts = {"loss_labeled": loss_l.detach(), "loss_unlabeled": loss_u.detach(), "loss_lpa3": loss_a.detach(),
                 "unlabeled_weight": torch.tensor(ramp), "labeled_share": labeled.float().mean(),
                 "num_augmented": torch.tensor(float(num_aug))}
        return loss, parts

    # ------------------------------------------------------------------ per epoch: the guesses' classes
    def pes_guess_report(self) -> dict[str, float]:
        """``{"pes/guess_top_class_share": share}`` of this epoch's guesses (empty without any), warning on a
        collapse; one host read, an all-reduce under DDP that every rank must join, at each semi epoch's end."""
        tally, self._pes_tally = self._pes_tally or GuessTally(), None
        counts = tally.take(int(self.lpa3_num_classes or 0), next(self.lpa3_model().parameters()).device)
        if counts is None:
            return {}
        return {"pes/guess_top_class_share": warn_on_collapse("PES", counts, self._pes_labeled_counts,
                                                              history=self.__dict__.setdefault("_collapse_history", {}))}

    # ------------------------------------------------------------------ checkpoint
    def pes_state_dict(self) -> dict[str, Any]:
        """The current split and class weights (a resume mid-epoch continues on the same split)."""
        return {"labeled": None if self._pes_labeled is None else self._pes_labeled.cpu(),
                "class_weights": self._pes_class_weights, "labeled_counts": self._pes_labeled_counts}

    def pes_load_state_dict(self, state: dict[str, Any]) -> None:
        self._pes_labeled = state.get("labeled")
        self._pes_class_weights = state.get("class_weights")
        self._pes_labeled_counts = state.get("labeled_counts")
