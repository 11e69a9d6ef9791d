"""PES (Progressive Early Stopping, Bai et al., NeurIPS 2021) with LP-A3 hard positives.

PES trains on noisy labels in three phases (by epoch):

1. ``"early"`` (``early_epochs``, T1): the whole network with cross-entropy on the noisy
   labels, stopped early, before it memorises the noise.
2. ``"refine"`` (``refine_epochs``, T2): the classifier head is re-initialised and trained
   alone on the noisy labels (the other weights stay; BatchNorm running statistics still follow
   the batches, as the forward runs in train mode). With T2 = 0 the head is not re-initialised.
   PES's paper re-trains later blocks in stages too; the authors' semi-supervised code (the one
   LP-A3 was published with) re-initialises the head only, and so does this mixin.
3. ``"semi"``: every epoch, the training set is split by agreement: a sample whose noisy
   label equals the model's prediction (eval mode, mean over two augmented views) is
   labeled, the rest unlabeled; then MixMatch (Berthelot et al., 2019): the labeled views
   keep their one-hot label, the unlabeled views get the sharpened mean prediction of their
   two views (temperature 0.5; by default from one forward of both views that leaves the
   BatchNorm running statistics alone, ``guess_forward="reference"`` forwards each view alone,
   moving them, as PES's code), everything is mixed up (``l ~ Beta(alpha, alpha)``,
   ``max(l, 1-l)``), and the loss is the class-balanced soft cross-entropy on the mixed
   labeled rows plus ``lambda_u * ramp`` times the probability MSE on the mixed unlabeled rows.

**LP-A3** (the authors' PES code): the unlabeled samples are attacked with their guessed
label (the argmax of the sharpened guess) as the label to preserve; each ``x'`` joins a second
mixup batch (the labeled views and the ``x'``, with the same ``l``) whose mixed ``x'`` rows add
a probability MSE against the guess, with the unlabeled loss's weight and ramp (a fresh
permutation pairs them: the authors reuse the clean mixup's, over a batch of another size here,
as only the selected ``x'`` are in it). Departures, each
with its reason: one view of each unlabeled sample is attacked (the authors attack both: twice
the solver's cost for a second view of the same image); the ``x'`` go through the solver's
verified forward (see :mod:`lpa3_lightning.core.augmented_forward`), and ``lpa3/label_preserved`` is
measured on the unmixed ``x'`` in that forward (a no-grad pass); the callback's TCS selection
applies (the authors attack every unlabeled sample: ``ratio=1.0`` does the same);
``lpa3_mixup=False`` trains the unmixed ``x'`` against the guess instead;
``lpa3_confidence`` (ours, off by default) attacks only the unlabeled samples whose sharpened
guess is sure enough. The TCS memory
is fed by every row's logits in the first two phases and by the unlabeled rows' guessing
forward after, so its threshold is over the whole training set (the labeled rows' scores keep
their last value).

Batches are ``(x_view1, x_view2, noisy_label, index)``; the module splits each batch with its
per-sample labeled mask. The authors' loaders give each semi-supervised step a labeled and an
unlabeled part (the unlabeled half the batch when unlabeled samples outnumber labeled ones, else
its share of the set), so a small labeled set is revisited
many times an epoch; :meth:`noisy_split_mask` lets the data module do the same
(:class:`~lpa3_lightning.data.NoisyLabelDataModule`'s ``balance_split``, on by default). With
batches drawn from the whole set instead, the labeled share follows the set's (a seventh or
less at 80% noise). The settings named here are the fields of
:class:`~lpa3_lightning.methods.settings.PESSettings`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from lpa3_lightning.core.augmented import LPA3Request
from lpa3_lightning.core.checks import check_class_labels, check_dataset_indices, check_split_loader_covered
from lpa3_lightning.core.distributed import batchnorm_buffers_kept, needs_every_rank
from lpa3_lightning.methods.base import BatchNormStatisticsFrozen, LPA3ModuleMixin
from lpa3_lightning.methods.guess_tally import GuessTally, warn_on_collapse
from lpa3_lightning.methods.mixmatch import (
    agreement_split,
    class_balance_weights,
    linear_rampup,
    mixup,
    mixup_lambda,
    probability_mse,
    sharpen,
    soft_cross_entropy,
)
from lpa3_lightning.methods.mixmatch_lpa3 import augmented_mixmatch_loss
from lpa3_lightning.methods.settings import PESSettings

__all__ = ["PESLPA3Mixin", "split_two_view_batch"]

PESPhase = Literal["early", "refine", "semi"]


def split_two_view_batch(batch: Any) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(x_view1, x_view2, noisy_labels, indices)`` of a noisy-label training batch.

    Raises:
        ValueError: for any other layout, naming the expected one and the fix.
    """
    if isinstance(batch, Sequence) and len(batch) == 4 and all(isinstance(t, Tensor) for t in batch):
        return batch[0], batch[1], batch[2], batch[3]
    described = f"{type(batch).__name__} of length {len(batch)}" if isinstance(batch, Sequence) else \
        type(batch).__name__
    raise ValueError(
        f"PES and DivideMix need batches (x_view1, x_view2, noisy_label, index), got {described}. Fix: use "
        "`lpa3_lightning.data.NoisyLabelDataModule`, or a dataset that returns two augmented views of each "
        "image, its noisy label and its dataset index."
    )


class PESLPA3Mixin(LPA3ModuleMixin):
    """PES's phases, split and MixMatch loss, with LP-A3 hard positives of the unlabeled samples.

    Set :attr:`lpa3_num_classes` and :attr:`lpa3_num_samples` (training set size), return the
    network from ``lpa3_model()`` (and its classifier head from :meth:`pes_head` when it is not
    the last ``nn.Linear``), call :meth:`pes_begin_epoch` with a loader over the whole training
    set (every sample, no ``drop_last``) at the start of every epoch, and :meth:`pes_loss` in
    ``training_step``. The optimizer of the refine phase must update the head only (the ready
    :class:`~lpa3_lightning.PESClassifier` does it all).

    Attributes:
        lpa3_settings: a :class:`~lpa3_lightning.methods.settings.PESSettings` (T1, T2, the
            MixMatch weights and mixup, the class-weight cap, the ``x'`` options; its docstring
            gives each default and its source); set ``self.lpa3_settings = PESSettings(...)``.
        lpa3_num_samples: the training set's size (the split and the TCS memory are over it). A
            fact about the data, not a setting.
    """

    lpa3_settings_class = PESSettings
    lpa3_settings: PESSettings = PESSettings()
    lpa3_num_samples: int | None = None
    _pes_labeled: Tensor | None = None  # (N,) bool, the current split
    _pes_class_weights: Tensor | None = None
    _pes_labeled_counts: Tensor | None = None  # (C,) the labeled set's noisy classes, on the host
    _pes_tally: GuessTally | None = None  # the classes of this epoch's guessed labels, on the device
    # (the batch's view-1 inputs, the unlabeled rows' sharpened guess, their view-1 logits)
    _pes_guess: tuple[Tensor, Tensor, Tensor] | None = None

    #: batch composition rule of :class:`~lpa3_lightning.data.split_batches.SplitBalancedSampler`
    noisy_batch_rule: str = "pes"

    def noisy_split_mask(self) -> Tensor | None:
        """The current split (``(N,)`` bool, True = labeled) in the semi-supervised phase, else
        None; a data module draws the phase's batches with PES's labeled share from it."""
        if self._pes_labeled is None or self.pes_phase(self.pes_current_epoch()) != "semi":
            return None
        return self._pes_labeled

    # ------------------------------------------------------------------ phases
    def pes_phase(self, epoch: int) -> PESPhase:
        """``"early"`` before T1, ``"refine"`` for the next T2 epochs, ``"semi"`` after."""
        settings = self.lpa3_settings
        if epoch < settings.early_epochs:
            return "early"
        if epoch < settings.early_epochs + settings.refine_epochs:
            return "refine"
        return "semi"

    def lpa3_consumes_augmented(self, epoch: int) -> bool:
        """PES trains ``x'`` in its semi-supervised phase only (the callback solves nothing before it)."""
        return self.pes_phase(epoch) == "semi"

    @property
    def pes_semi_start(self) -> int:
        """First epoch of the semi-supervised phase (T1 + T2), where the ramp starts."""
        return self.lpa3_settings.early_epochs + self.lpa3_settings.refine_epochs

    def pes_alpha_late_start(self) -> int | None:
        """The first epoch of mixup's ``alpha_late`` (None: never): the setting's
        ``alpha_late_epoch``, None or negative meaning never. The ready
        :class:`~lpa3_lightning.PESClassifier` overrides it to resolve None to half of its run."""
        start = self.lpa3_settings.alpha_late_epoch
        return None if start is None or start < 0 else start

    def pes_head(self) -> nn.Module:
        """The classifier head that the refine phase re-initialises: the model's last ``nn.Linear``.

        Override when the head is another module.

        Raises:
            ValueError: if the model has no ``nn.Linear``.
        """
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
        """Phase changes at the start of ``epoch``: re-initialise the head when the refine
        phase starts; in the semi phase, refresh the labeled/unlabeled split with ``loader``:
        ``(view1, view2, noisy_label, index)`` batches that cover every training sample (no
        ``drop_last``, not the balanced semi-phase sampler, which skips rows; the ready module
        passes ``noisy_training.whole_training_set_loader``). A sample it leaves out is refused."""
        if epoch == self.lpa3_settings.early_epochs and self.lpa3_settings.refine_epochs > 0:
            head = self.pes_head()
            for module in head.modules():
                if hasattr(module, "reset_parameters"):
                    module.reset_parameters()  # in place: optimizers keep the same parameters
        if self.pes_phase(epoch) == "semi":
            self.pes_refresh_split(loader)

    @torch.no_grad()
    def pes_refresh_split(self, loader: Any) -> Tensor:
        """Predict the whole training set (eval mode, mean of the two views' probabilities),
        mark as labeled the samples whose noisy label agrees, and set the class weights.

        Under DDP every rank predicts its share and the sums are all-reduced, so the split is
        the same on every rank. Returns the labeled mask ``(N,)``.
        """
        model = self.lpa3_model()
        num_samples, num_classes = self._pes_sizes()
        device = next(model.parameters()).device
        sums = torch.zeros(num_samples, num_classes, device=device)
        counts = torch.zeros(num_samples, device=device)
        noisy = torch.full((num_samples,), -1, dtype=torch.long, device=device)
        was_training = model.training
        model.eval()
        try:
            for batch in loader:
                x1, x2, y, idx = (t.to(device) for t in split_two_view_batch(batch))
                check_dataset_indices(idx, num_samples, name="noisy-label batch indices")
                check_class_labels(y, num_classes, name="noisy labels")
                probs = (torch.softmax(self.lpa3_logits(model(x1)).float(), 1)
                         + torch.softmax(self.lpa3_logits(model(x2)).float(), 1)) / 2
                sums.index_add_(0, idx, probs)
                counts.index_add_(0, idx, torch.ones_like(idx, dtype=counts.dtype))
                noisy[idx] = y.long()
        finally:
            model.train(was_training)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(sums)
            dist.all_reduce(counts)
            dist.all_reduce(noisy, op=dist.ReduceOp.MAX)
        check_split_loader_covered(counts, "pes_begin_epoch")
        labeled = agreement_split(sums / counts[:, None], noisy)
        self._pes_labeled = labeled
        self._pes_class_weights = class_balance_weights(noisy[labeled], num_classes,
                                                       self.lpa3_settings.class_weight_cap)
        self._pes_labeled_counts = torch.bincount(noisy[labeled].long().cpu(), minlength=num_classes)
        return labeled

    def _pes_sizes(self) -> tuple[int, int]:
        if self.lpa3_num_samples is None or self.lpa3_num_classes is None:
            raise ValueError("PES needs `lpa3_num_samples` (training set size) and `lpa3_num_classes` set on the "
                             "module. Fix: set both in __init__ (the data module's num_train and num_classes).")
        return int(self.lpa3_num_samples), int(self.lpa3_num_classes)

    # ------------------------------------------------------------------ request
    def _pes_split_rows(self, idx: Tensor) -> Tensor:
        if self._pes_labeled is None:
            raise RuntimeError("The PES split is not computed yet: call `pes_begin_epoch(epoch, loader)` at the start "
                               "of every epoch (the ready PESClassifier does).")
        return self._pes_labeled.to(idx.device)[idx]

    @torch.no_grad()
    def pes_guess(self, batch: Any) -> Tensor:
        """Sharpened mean prediction of the two views of this batch's unlabeled rows.

        Forwarded once per batch (train mode, as MixMatch), then reused by the loss and the
        request. ``guess_forward="joint_frozen"`` (default): both views in one forward, the
        BatchNorm running statistics left alone; ``"reference"``: each view in a forward of its
        own, each moving the running statistics (PES's code).
        """
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
            kept = batchnorm_buffers_kept(model) if u1.shape[0] == 0 else contextlib.nullcontext()
            if self.lpa3_settings.guess_forward == "reference":  # PES_semi.py:100-102: u1, then u2
                with kept, self.lpa3_forward_context():
                    logits_u1 = self.lpa3_logits(model(u1)).float()
                    logits_u2 = self.lpa3_logits(model(u2)).float()
                probs_u1, probs_u2 = torch.softmax(logits_u1, 1), torch.softmax(logits_u2, 1)
            else:
                with BatchNormStatisticsFrozen(model), kept, self.lpa3_forward_context():
                    logits = self.lpa3_logits(model(torch.cat([u1, u2]))).float()
                probs = torch.softmax(logits, 1)
                logits_u1, probs_u1, probs_u2 = logits[: u1.shape[0]], probs[: u1.shape[0]], probs[u1.shape[0]:]
            guess = sharpen((probs_u1 + probs_u2) / 2, self.lpa3_settings.temperature)
        self._pes_guess = (x1, guess, logits_u1)
        return guess

    def lpa3_request(self, batch: Any) -> LPA3Request:
        """Semi phase: the unlabeled rows' first view with their guessed label; before it, every
        row with its noisy label (the callback's warm-up should cover those epochs)."""
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
        """The unlabeled rows offered to the attack (``lpa3_confidence``), None for all: the
        request and the loss pick the same rows of the guess with it."""
        confidence = self.lpa3_settings.lpa3_confidence
        return None if confidence is None else guess.max(1).values >= confidence

    # ------------------------------------------------------------------ loss
    def pes_loss(self, batch: Any, batch_idx: int = 0,
                 batches_per_epoch: int | None = None) -> tuple[Tensor, dict[str, Tensor]]:
        """PES's loss for this batch in the current phase (see the module docstring).

        ``batches_per_epoch`` (None: the trainer's) sets how far the unlabeled weight's ramp-up
        moves per step (``epoch + batch_idx / batches_per_epoch``).

        Returns:
            ``(loss, parts)``; ``parts`` holds ``loss_labeled``, ``loss_unlabeled``,
            ``loss_lpa3``, ``unlabeled_weight``, ``labeled_share`` and ``num_augmented``.
        """
        self.lpa3_check_settings()
        settings = self.lpa3_settings
        x1, x2, y, idx = split_two_view_batch(batch)
        num_samples, num_classes_ = self._pes_sizes()
        check_dataset_indices(idx, num_samples, name="noisy-label batch indices")
        check_class_labels(y, num_classes_, name="noisy labels")
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
        n_lab = int(labeled.sum())
        one_hot = F.one_hot(y[labeled].long(), num_classes).float()
        inputs = torch.cat([x1[labeled], x2[labeled], x1[~labeled], x2[~labeled]])
        targets = torch.cat([one_hot, one_hot, guess, guess]).to(inputs.device)
        late = self.pes_alpha_late_start()
        alpha = settings.alpha_late if late is not None and epoch >= late else settings.alpha
        lam = mixup_lambda(alpha)
        mixed_x, mixed_t = mixup(inputs, targets, lam, torch.randperm(inputs.shape[0], device=inputs.device))
        logits = self.lpa3_logits(model(mixed_x))
        weights = self._pes_class_weights.to(logits.device) if self._pes_class_weights is not None else None
        loss_l = soft_cross_entropy(logits[: 2 * n_lab], mixed_t[: 2 * n_lab], weights)
        loss_u = probability_mse(logits[2 * n_lab:], mixed_t[2 * n_lab:])
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
        """Read this epoch's guessed labels (once: one host read, an all-reduce under DDP, which
        every rank must join) and start a new tally. Returns ``{"pes/guess_top_class_share": share}``,
        the largest class's share of the guessed labels (empty when none was guessed), and warns
        (``rank_zero_warn``) when most of them are of one class while the labeled set holds several
        (:func:`~lpa3_lightning.methods.guess_tally.guess_collapse_warning`). Call it at the end of
        every semi-supervised epoch (the ready :class:`~lpa3_lightning.PESClassifier` does, and logs
        the share)."""
        tally = self._pes_tally if self._pes_tally is not None else GuessTally()
        self._pes_tally = None
        model = self.lpa3_model()
        counts = tally.take(int(self.lpa3_num_classes or 0), next(model.parameters()).device)
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
