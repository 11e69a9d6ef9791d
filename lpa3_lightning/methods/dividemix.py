"""DivideMix (Li, Socher, Hoi, ICLR 2020) with LP-A3 hard positives for each of its two networks.

DivideMix trains two networks on noisy labels:

1. ``"warmup"`` (``warmup_epochs``): each network with cross-entropy on the noisy
   labels (plus the negative-entropy penalty for asymmetric noise,
   ``negative_entropy``); here the first network trains on each batch's first view,
   the second on its second view.
2. ``"semi"``: at the start of every epoch each network's per-sample losses on the noisy labels
   are fitted by a two-component Gaussian mixture, whose low-loss posterior ``w`` is the
   probability that a label is clean (:mod:`lpa3_lightning.methods.dividemix_split`). Each
   network trains with the split of the *other* (co-divide): ``w > threshold``
   labeled, the rest unlabeled. A labeled target is co-refined with the network's own mean
   prediction over both views, ``sharpen(w y + (1 - w) p)``; an unlabeled target is co-guessed by
   both networks over both views; all four view sets are mixed up with one permutation; the loss
   is ``soft CE (labeled) + lambda_u * ramp * MSE (unlabeled) + prior_weight * KL(prior || mean
   prediction)``, the prior uniform (the authors') unless ``class_prior`` gives the class shares.
   Evaluation adds both networks' logits.

**LP-A3** (the paper's DivideMix rows; the authors released no code or command for them): each network has
its own time-consistency memory, selection, twin BatchNorms and ``x'`` cache in one
:class:`~lpa3_lightning.LPA3Callback` (the module names the networks in
:meth:`lpa3_networks`); each network's unlabeled samples are attacked on that network with the
co-guessed label (its argmax) as the label to preserve, and the ``x'`` are used as PES uses them
(:func:`~lpa3_lightning.methods.mixmatch_lpa3.augmented_mixmatch_loss`): mixed up with the
labeled views, a probability MSE against the guess with the unlabeled weight. Each memory is fed
with its network's clean logits: every row in the warm-up, the unlabeled rows' guessing forward
after.

Departures from the authors' code, each with its reason: both networks train on every batch,
the two losses summed into one backward (their parameters are disjoint and the guesses carry no
gradient, so each network's update is its own; the authors train one network for a whole epoch,
then the other): one pass over the data per epoch instead of two, and one backward per step
under DDP. Guesses and refinements use the networks as they are at the start of the step. Each
batch is split by the per-sample labeled mask; the authors iterate over the labeled set and draw
as many unlabeled samples, and :meth:`noisy_split_mask` lets the data module do likewise
(``NoisyLabelDataModule(balance_split=True)``, the default: half of each batch from the samples
labeled for either network, half from the rest, for a pass's number of steps). Each network's own
guessing and refinement forwards take both views in one forward and leave the BatchNorm running
statistics alone (the authors forward each view alone, in train mode, moving them four times a step;
``guess_bn_updates="reference"`` does as they do, ``True`` keeps the pooled forwards and moves them);
the other network's eval-mode predictions for the guesses are made at the batch's first guess, before
any train-mode forward of the step. The GMM's initialisation
is seeded (theirs is not). A split with fewer than two labeled or unlabeled samples is kept
(the authors' code crashes on an empty unlabeled set): its empty part contributes zero. The
settings named here are the fields of :class:`~lpa3_lightning.methods.settings.DivideMixSettings`.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lpa3_lightning.core.augmented import LPA3Request
from lpa3_lightning.core.checks import check_class_labels, check_dataset_indices
from lpa3_lightning.core.distributed import batchnorm_buffers_kept, needs_every_rank
from lpa3_lightning.methods.base import BatchNormStatisticsFrozen
from lpa3_lightning.methods.dividemix_parts import co_guess, co_refine, negative_entropy, prior_penalty
from lpa3_lightning.methods.dividemix_split import DivideMixPhase, DivideMixSplitMixin
from lpa3_lightning.methods.guess_tally import GuessTally, warn_on_collapse
from lpa3_lightning.methods.mixmatch import linear_rampup, mixup, mixup_lambda, probability_mse, soft_cross_entropy
from lpa3_lightning.methods.mixmatch_lpa3 import augmented_mixmatch_loss
from lpa3_lightning.methods.pes import split_two_view_batch

__all__ = ["DivideMixLPA3Mixin", "DivideMixPhase"]


class DivideMixLPA3Mixin(DivideMixSplitMixin):
    """DivideMix's co-divide and MixMatch loss for two networks, with LP-A3 hard positives for each.

    Set :attr:`lpa3_num_classes` and :attr:`lpa3_num_samples` (training-set size), return the two
    networks from :meth:`dividemix_model`, call :meth:`dividemix_begin_epoch` with a loader over
    the whole training set (every sample, no ``drop_last``) at the start of every epoch and
    :meth:`dividemix_losses` in ``training_step`` (it makes both co-guesses before either network's
    training forward; the ready :class:`~lpa3_lightning.DivideMixClassifier` does it all).

    Attributes:
        lpa3_settings: a :class:`~lpa3_lightning.methods.settings.DivideMixSettings` (the networks'
            names, the warm-up, the MixMatch weights, the split's options, the prior penalty, the
            ``x'`` options; its docstring gives each default and its source); set
            ``self.lpa3_settings = DivideMixSettings(...)``. Declared, with ``lpa3_num_samples``
            (the training-set size, a fact about the data), by the co-divide base
            :class:`~lpa3_lightning.methods.dividemix_split.DivideMixSplitMixin`.
    """

    # ------------------------------------------------------------------ networks
    def lpa3_model(self, network: str | None = None) -> nn.Module:
        if network is None:
            raise ValueError(f"{type(self).__name__} has two networks {self.lpa3_networks()}; name one: "
                             "`lpa3_model(network='net1')`.")
        self._dm_check_name(network)
        return self.dividemix_model(network)

    def dividemix_other(self, network: str) -> str:
        """The network whose split trains ``network`` (co-divide); an unknown name is refused by name."""
        self._dm_check_name(network)
        return self._dm_partner(network)

    def _dm_check_name(self, network: str) -> tuple[str, str]:
        names = self.lpa3_networks()
        if len(names) != 2 or network not in names:
            raise ValueError(f"DivideMix has the networks {names}, got network={network!r}.")
        return names  # type: ignore[return-value]

    #: batch composition rule of :class:`~lpa3_lightning.data.split_batches.SplitBalancedSampler`
    noisy_batch_rule: str = "half"

    def noisy_split_mask(self) -> Tensor | None:
        """In the semi-supervised phase, the samples labeled for either network (``(N,)`` bool);
        else None. A data module draws the phase's batches half from them, half from the rest."""
        probs = self._dm_state()["clean_prob"]
        if self.dividemix_phase(self.dividemix_current_epoch()) != "semi" or len(probs) < 2:
            return None
        return torch.stack([p > self.lpa3_settings.threshold for p in probs.values()]).any(0)

    def lpa3_consumes_augmented(self, epoch: int) -> bool:
        """DivideMix trains ``x'`` after its warm-up only (the callback solves nothing before)."""
        return epoch >= self.lpa3_settings.warmup_epochs

    def _dm_labeled(self, network: str, idx: Tensor) -> tuple[Tensor, Tensor]:
        """(labeled mask, w) of the rows ``idx`` for training ``network``: the other network's split."""
        w = self.dividemix_clean_probability(self.dividemix_other(network)).to(idx.device)[idx]
        return w > self.lpa3_settings.threshold, w

    # ------------------------------------------------------------------ guesses
    @torch.no_grad()
    def dividemix_guess(self, batch: Any, network: str) -> Tensor:
        """Co-guessed targets of the rows unlabeled for ``network``: sharpened mean of both
        networks' predictions of both views (``network`` in train mode, its BatchNorm running
        statistics as ``guess_bn_updates`` says; the other in eval mode, as the authors).
        Forwarded once per batch and network, then reused by the request and the loss."""
        x1 = split_two_view_batch(batch)[0]
        cached = self._dm_state()["guess"].get(network)
        if cached is not None and cached[0] is x1:
            return cached[1]
        u1, u2, p_other = self._dm_partner_predictions(batch, network)
        classes = int(self.lpa3_num_classes or 0)
        own = self.dividemix_model(network)
        if u1.shape[0] == 0 and not needs_every_rank(own):
            guess, logits_u1 = u1.new_zeros(0, classes), u1.new_zeros(0, classes)
        else:  # (a rank without unlabeled rows still forwards its empty batch where SyncBatchNorm syncs)
            logits_u1, logits_u2 = self._dm_own_forward(own, u1, u2)
            p_own = torch.stack([torch.softmax(logits_u1, 1), torch.softmax(logits_u2, 1)])
            guess = co_guess(p_own, p_other.to(p_own.device), self.lpa3_settings.temperature)
        self._dm_state()["guess"][network] = (x1, guess, logits_u1)
        return guess

    @torch.no_grad()
    def _dm_partner_predictions(self, batch: Any, network: str) -> tuple[Tensor, Tensor, Tensor]:
        """The two views ``u1``, ``u2`` of the rows unlabeled for ``network`` and its partner's
        eval-mode predictions of them ``(2, U, C)``. Made for every network at the first guess of a
        batch, before any train-mode forward of the step (``guess_bn_updates`` True or ``"reference"`` moves the running
        statistics the partner's eval forward reads), so each guess takes its partner as it is at
        the start of the step; each network's are handed out once (to its guess), then dropped."""
        x1, x2, _, idx = split_two_view_batch(batch)
        state = self._dm_state()
        cached = state.get("partner")
        if cached is None or cached[0] is not x1 or network not in cached[1]:
            cached = state["partner"] = (x1, self._dm_all_partner_predictions(x1, x2, idx))
        predictions = cached[1].pop(network)
        if not cached[1]:
            del state["partner"]
        return predictions

    def _dm_all_partner_predictions(self, x1: Tensor, x2: Tensor,
                                    idx: Tensor) -> dict[str, tuple[Tensor, Tensor, Tensor]]:
        classes = int(self.lpa3_num_classes or 0)
        per_view = self.lpa3_settings.guess_bn_updates == "reference"
        predictions = {}
        for network in self.lpa3_networks():
            unlabeled = ~self._dm_labeled(network, idx)[0]
            u1, u2 = x1[unlabeled], x2[unlabeled]
            if u1.shape[0] == 0:  # an eval-mode forward is no collective: nothing to join
                predictions[network] = (u1, u2, u1.new_zeros(2, 0, classes).float())
                continue
            other = self.dividemix_model(self.dividemix_other(network))
            was_training = other.training
            other.eval()
            try:
                with self.lpa3_forward_context():
                    if per_view:  # Train_cifar.py:66-67: one forward per view
                        logits = [self.lpa3_logits(other(u)).float() for u in (u1, u2)]
                    else:
                        logits = list(self.lpa3_logits(other(torch.cat([u1, u2]))).float().split(u1.shape[0]))
            finally:
                other.train(was_training)
            predictions[network] = (u1, u2, torch.stack([torch.softmax(v, 1) for v in logits]))
        return predictions

    def _dm_own_forward(self, model: nn.Module, v1: Tensor, v2: Tensor) -> tuple[Tensor, Tensor]:
        """The no-grad train-mode logits of two views of the same rows, for a guess or a
        refinement, with the BatchNorm handling of ``guess_bn_updates``: one pooled forward with the
        running statistics frozen (False) or moving (True), or one forward per view, each moving
        them (``"reference"``). A rank with no rows (SyncBatchNorm's collective) keeps its buffers."""
        kept = batchnorm_buffers_kept(model) if v1.shape[0] == 0 else contextlib.nullcontext()
        mode = self.lpa3_settings.guess_bn_updates
        with torch.no_grad(), kept, self.lpa3_forward_context():
            if mode == "reference":  # Train_cifar.py:64-65 and 76-77: each view alone
                return self.lpa3_logits(model(v1)).float(), self.lpa3_logits(model(v2)).float()
            with contextlib.nullcontext() if mode else BatchNormStatisticsFrozen(model):
                logits = self.lpa3_logits(model(torch.cat([v1, v2]))).float()
        return logits[: v1.shape[0]], logits[v1.shape[0]:]

    def _dm_prior(self, device: torch.device) -> Tensor | None:
        """The prior penalty's class frequencies on ``device`` (None: uniform), built once per
        setting (prior, number of classes) and device, not every step. Their values were checked
        by :class:`~lpa3_lightning.methods.settings.DivideMixSettings`; their number is checked here
        against the module's classes.

        Raises:
            ValueError: if ``class_prior`` does not hold one frequency per class.
        """
        prior = self.lpa3_settings.class_prior
        if prior is None:
            return None
        num_classes = self._dm_sizes()[1]
        key = (tuple(prior), num_classes, str(device))
        cached = self._dm_state().get("prior")
        if cached is None or cached[0] != key:
            if len(prior) != num_classes:
                raise ValueError(f"`dividemix.class_prior` holds {len(prior)} class frequencies, but the module has "
                                 f"lpa3_num_classes={num_classes}. Fix: one frequency per class, or None (uniform).")
            cached = (key, torch.tensor(prior, dtype=torch.float32, device=device))
            self._dm_state()["prior"] = cached
        return cached[1]

    # ------------------------------------------------------------------ request
    def lpa3_request(self, batch: Any, network: str | None = None) -> LPA3Request:
        """Semi phase: the rows unlabeled for ``network`` (first view) with their co-guessed label;
        in the warm-up, the view that network trains on with its noisy label (the callback's
        ``warmup_epochs`` should cover the warm-up: no ``x'`` is trained there)."""
        if network is None:
            raise ValueError("DivideMix's LP-A3 request is per network: the callback passes `network=`.")
        x1, x2, y, idx = split_two_view_batch(batch)
        first, _ = self._dm_check_name(network)
        if self.dividemix_phase(self.dividemix_current_epoch()) == "warmup":
            return LPA3Request(inputs=x1 if network == first else x2, targets=y, indices=idx)
        unlabeled = ~self._dm_labeled(network, idx)[0]
        guess = self.dividemix_guess(batch, network)
        return LPA3Request(inputs=x1[unlabeled], targets=guess.argmax(1), indices=idx[unlabeled])

    # ------------------------------------------------------------------ loss
    def dividemix_loss(self, batch: Any, network: str, batch_idx: int = 0,
                       batches_per_epoch: int | None = None) -> tuple[Tensor, dict[str, Tensor]]:
        """DivideMix's loss of ``network`` on this batch in the current phase; ``batches_per_epoch``
        (None: the trainer's) sets how far the ramp-up moves per step.

        Returns:
            ``(loss, parts)``; ``parts`` holds ``loss_labeled``, ``loss_unlabeled``, ``loss_prior``,
            ``loss_lpa3``, ``unlabeled_weight``, ``labeled_share`` and ``num_augmented``.
        """
        self.lpa3_check_settings()
        settings = self.lpa3_settings
        x1, x2, y, idx = split_two_view_batch(batch)
        num_samples, num_classes = self._dm_sizes()
        check_dataset_indices(idx, num_samples, name="noisy-label batch indices")
        check_class_labels(y, num_classes, name="noisy labels")
        first, _ = self._dm_check_name(network)
        model = self.dividemix_model(network)
        epoch = self.dividemix_current_epoch()
        zero = x1.new_zeros(())
        if self.dividemix_phase(epoch) == "warmup":
            logits = self.lpa3_logits(model(x1 if network == first else x2))
            self.lpa3_record_predictions(idx, logits, network=network)
            loss = F.cross_entropy(logits, y.long())
            if settings.negative_entropy:
                loss = loss + negative_entropy(logits)
            # no x' is trained in the warm-up: left untaken, so the callback counts it as not trained on
            parts = {"loss_labeled": loss.detach(), "loss_unlabeled": zero, "loss_prior": zero, "loss_lpa3": zero,
                     "unlabeled_weight": zero, "labeled_share": torch.ones(()), "num_augmented": zero}
            return loss, parts
        labeled, w = self._dm_labeled(network, idx)
        guess = self.dividemix_guess(batch, network)
        # device work: the classes of the guessed labels, read once an epoch by dividemix_guess_report
        self._dm_state().setdefault("tally", {}).setdefault(network, GuessTally()).add(guess)
        logits_u1 = self._dm_state()["guess"].pop(network)[2]
        self.lpa3_record_predictions(idx[~labeled], logits_u1, network=network)  # TCS: the unlabeled rows
        n_lab = int(labeled.sum())
        refined = x1.new_zeros(0, num_classes).float()
        if n_lab or needs_every_rank(model):  # (an empty forward where SyncBatchNorm syncs: every rank makes it)
            logits_x1, logits_x2 = self._dm_own_forward(model, x1[labeled], x2[labeled])
            if n_lab:
                probs = torch.stack([torch.softmax(logits_x1, 1), torch.softmax(logits_x2, 1)])
                refined = co_refine(y[labeled], probs, w[labeled], settings.temperature)
        inputs = torch.cat([x1[labeled], x2[labeled], x1[~labeled], x2[~labeled]])
        targets = torch.cat([refined, refined, guess, guess]).to(inputs.device)
        lam = mixup_lambda(settings.alpha)
        mixed_x, mixed_t = mixup(inputs, targets, lam, torch.randperm(inputs.shape[0], device=inputs.device))
        logits = self.lpa3_logits(model(mixed_x))
        loss_l = soft_cross_entropy(logits[: 2 * n_lab], mixed_t[: 2 * n_lab])
        loss_u = probability_mse(logits[2 * n_lab:], mixed_t[2 * n_lab:])
        loss_p = (settings.prior_weight * prior_penalty(logits, self._dm_prior(logits.device))
                  if settings.prior_weight else zero)
        progress = epoch + batch_idx / self.lpa3_batches_per_epoch(batches_per_epoch)
        ramp = linear_rampup(progress, settings.warmup_epochs, settings.rampup_epochs)
        weight_a = settings.lambda_u if settings.lpa3_weight is None else settings.lpa3_weight
        loss_a, num_aug = zero, 0
        augmented = self.lpa3_take_augmented(network=network)
        if augmented is not None and len(augmented):
            guess_adv = guess.index_select(0, augmented.positions().to(guess.device))
            loss_a = augmented_mixmatch_loss(self, augmented, guess_adv,
                                             torch.cat([x1[labeled], x2[labeled]]), torch.cat([refined, refined]),
                                             lam, mix=settings.lpa3_mixup)
            num_aug = len(augmented)
        loss = loss_l + ramp * (settings.lambda_u * loss_u + weight_a * loss_a) + loss_p
        parts = {"loss_labeled": loss_l.detach(), "loss_unlabeled": loss_u.detach(), "loss_prior": loss_p.detach(),
                 "loss_lpa3": loss_a.detach(), "unlabeled_weight": torch.tensor(settings.lambda_u * ramp),
                 "labeled_share": labeled.float().mean(), "num_augmented": torch.tensor(float(num_aug))}
        return loss, parts

    def dividemix_guess_report(self) -> dict[str, float]:
        """Read this epoch's guessed labels of each network (once: one host read per network, an
        all-reduce under DDP, which every rank must join) and start new tallies. Returns the largest
        class's share of each network's guessed labels (``dividemix/<network>/guess_top_class_share``)
        and of both together (``dividemix/guess_top_class_share``), empty when none was guessed, and
        warns (``rank_zero_warn``) for each network whose guesses are mostly of one class while its
        labeled set holds several (:func:`~lpa3_lightning.methods.guess_tally.guess_collapse_warning`).
        Call it at the end of every semi-supervised epoch (the ready
        :class:`~lpa3_lightning.DivideMixClassifier` does, and logs the shares)."""
        state = self._dm_state()
        tallies, state["tally"] = state.get("tally", {}), {}
        labeled_counts = state.get("labeled_counts", {})
        classes = self._dm_sizes()[1]
        report: dict[str, float] = {}
        together = None
        for name in self.lpa3_networks():  # the declared order on every rank (the all-reduces match)
            device = next(self.dividemix_model(name).parameters()).device
            counts = tallies.get(name, GuessTally()).take(classes, device)
            if counts is None:
                continue
            together = counts if together is None else together + counts
            report[f"dividemix/{name}/guess_top_class_share"] = warn_on_collapse(
                "DivideMix", counts, labeled_counts.get(name), f" ({name})",
                history=self.__dict__.setdefault("_collapse_history", {}))
        if together is not None:
            report["dividemix/guess_top_class_share"] = float(together.max() / together.sum())
        return report

    def dividemix_losses(self, batch: Any, batch_idx: int = 0,
                         batches_per_epoch: int | None = None) -> dict[str, tuple[Tensor, dict[str, Tensor]]]:
        """:meth:`dividemix_loss` of every network, with every co-guess made before the first
        network's training forward (which moves its BatchNorm statistics): with or without the
        callback, the guesses come from the networks as they are at the start of the step."""
        self.lpa3_check_settings()  # before the phase is read from them
        if self.dividemix_phase(self.dividemix_current_epoch()) == "semi":
            for name in self.lpa3_networks():
                self.dividemix_guess(batch, name)
        return {name: self.dividemix_loss(batch, name, batch_idx, batches_per_epoch) for name in self.lpa3_networks()}
