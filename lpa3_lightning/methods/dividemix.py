"""DivideMix (Li, Socher, Hoi, ICLR 2020) with LP-A3 hard positives for each of its two networks.

DivideMix trains two networks on noisy labels:

1. ``"warmup"`` (``warmup_epochs``): each network with cross-entropy on the noisy
   labels (plus the negative-entropy penalty for asymmetric noise,
   ``negative_entropy``); here the first network trains on each batch's first view,
   the second on its second view.
2. ``"semi"``: at the start of every epoch each network's per-sample cross-entropy on the noisy
   labels (eval mode, the evaluation view), min-max normalised (averaged over the last
   ``loss_history`` epochs; the authors use 5 at 90% noise, 1 otherwise), is fitted by a
   two-component Gaussian mixture, and the posterior ``w`` of its low-loss component is the
   probability that a label is clean (:func:`~lpa3_lightning.methods.dividemix_parts.clean_probability`). Each
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
labeled for either network, half from the rest, for a pass's number of steps). The guessing forwards
leave the BatchNorm running statistics alone (the authors' move them;
``guess_bn_updates=True`` does as they do). The GMM's initialisation
is seeded (theirs is not). A split with fewer than two labeled or unlabeled samples is kept
(the authors' code crashes on an empty unlabeled set): its empty part contributes zero. The
settings named here are the fields of :class:`~lpa3_lightning.methods.settings.DivideMixSettings`.
"""

from __future__ import annotations

import contextlib
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from lpa3_lightning.core.augmented import LPA3Request
from lpa3_lightning.core.checks import check_class_labels, check_dataset_indices, check_split_loader_covered
from lpa3_lightning.core.distributed import batchnorm_buffers_kept, needs_every_rank
from lpa3_lightning.methods.base import BatchNormStatisticsFrozen, LPA3ModuleMixin
from lpa3_lightning.methods.dividemix_parts import (
    clean_probability,
    clean_probability_per_class,
    co_guess,
    co_refine,
    negative_entropy,
    normalized_losses,
    prior_penalty,
    stratified_selection,
)
from lpa3_lightning.methods.mixmatch import linear_rampup, mixup, mixup_lambda, probability_mse, soft_cross_entropy
from lpa3_lightning.methods.mixmatch_lpa3 import augmented_mixmatch_loss
from lpa3_lightning.methods.pes import split_two_view_batch
from lpa3_lightning.methods.settings import DivideMixSettings

__all__ = ["DivideMixLPA3Mixin"]

DivideMixPhase = Literal["warmup", "semi"]


class DivideMixLPA3Mixin(LPA3ModuleMixin):
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
            ``self.lpa3_settings = DivideMixSettings(...)``.
        lpa3_num_samples: the training-set size (the split and the TCS memories are over it). A
            fact about the data, not a setting.
    """

    lpa3_settings_class = DivideMixSettings
    lpa3_settings: DivideMixSettings = DivideMixSettings()
    lpa3_num_samples: int | None = None

    # ------------------------------------------------------------------ networks
    def lpa3_networks(self) -> tuple[str, ...]:
        return tuple(self.lpa3_settings.networks)

    def dividemix_model(self, network: str) -> nn.Module:
        """The network named ``network``; override (the ready module returns ``self.net1`` / ``self.net2``)."""
        raise NotImplementedError("Return the network named `network` from `dividemix_model` (e.g. self.net1).")

    def lpa3_model(self, network: str | None = None) -> nn.Module:
        if network is None:
            raise ValueError(f"{type(self).__name__} has two networks {self.lpa3_networks()}; name one: "
                             "`lpa3_model(network='net1')`.")
        self._dm_check_name(network)
        return self.dividemix_model(network)

    def dividemix_other(self, network: str) -> str:
        """The network whose split trains ``network`` (co-divide)."""
        first, second = self._dm_check_name(network)
        return second if network == first else first

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

    def dividemix_phase(self, epoch: int) -> DivideMixPhase:
        return "warmup" if epoch < self.lpa3_settings.warmup_epochs else "semi"

    def lpa3_consumes_augmented(self, epoch: int) -> bool:
        """DivideMix trains ``x'`` after its warm-up only (the callback solves nothing before)."""
        return epoch >= self.lpa3_settings.warmup_epochs

    def dividemix_current_epoch(self) -> int:
        """The trainer's epoch; without a trainer, the one last given to :meth:`dividemix_begin_epoch`."""
        trainer = getattr(self, "_trainer", None)
        return int(trainer.current_epoch) if trainer is not None else int(self._dm_state().get("epoch", 0))

    def _dm_sizes(self) -> tuple[int, int]:
        if self.lpa3_num_samples is None or self.lpa3_num_classes is None:
            raise ValueError("DivideMix needs `lpa3_num_samples` (training set size) and `lpa3_num_classes` set on "
                             "the module. Fix: set both in __init__ (the data module's num_train and num_classes).")
        return int(self.lpa3_num_samples), int(self.lpa3_num_classes)

    def _dm_state(self) -> dict[str, Any]:
        # per-module state, kept out of nn.Module's attribute machinery
        return self.__dict__.setdefault("_dividemix_state", {"clean_prob": {}, "history": {}, "guess": {}})

    # ------------------------------------------------------------------ per epoch: co-divide
    def dividemix_begin_epoch(self, epoch: int, loader: Any) -> None:
        """In the semi phase, refresh both networks' clean probabilities with ``loader`` (the
        training set's ``(x, x, noisy_label, index)`` batches, evaluation view), both before
        either network trains this epoch."""
        self._dm_state()["epoch"] = int(epoch)
        if self.dividemix_phase(epoch) == "semi":
            self.dividemix_refresh_split(loader)

    @torch.no_grad()
    def dividemix_per_sample_losses(self, loader: Any) -> dict[str, Tensor]:
        """Each network's cross-entropy on the noisy label of every training sample (eval mode).

        Under DDP every rank computes its share and the sums are all-reduced, so the losses (and
        the GMM fitted on them) are the same on every rank.
        """
        num_samples, num_classes = self._dm_sizes()
        names = self.lpa3_networks()
        models = [self.dividemix_model(n) for n in names]
        device = next(models[0].parameters()).device
        sums = torch.zeros(len(names), num_samples, device=device)
        counts = torch.zeros(num_samples, device=device)
        label_sums = torch.zeros(num_samples, device=device)
        modes = [m.training for m in models]
        for m in models:
            m.eval()
        try:
            for batch in loader:
                x, _, y, idx = (t.to(device) for t in split_two_view_batch(batch))
                check_dataset_indices(idx, num_samples, name="noisy-label batch indices")
                check_class_labels(y, num_classes, name="noisy labels")
                for k, m in enumerate(models):
                    loss = F.cross_entropy(self.lpa3_logits(m(x)).float(), y.long(), reduction="none")
                    sums[k].index_add_(0, idx, loss)
                counts.index_add_(0, idx, torch.ones_like(idx, dtype=counts.dtype))
                label_sums.index_add_(0, idx, y.to(label_sums.dtype))
        finally:
            for m, mode in zip(models, modes):
                m.train(mode)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(sums)
            dist.all_reduce(counts)
            dist.all_reduce(label_sums)
        check_split_loader_covered(counts, "dividemix_begin_epoch")
        # a sample seen twice (a padded distributed sampler) carries its one label twice
        self._dm_state()["labels"] = (label_sums / counts).round().long().cpu()
        return {n: sums[k] / counts for k, n in enumerate(names)}

    def dividemix_refresh_split(self, loader: Any) -> dict[str, Tensor]:
        """Per network, the probability ``(N,)`` that each label is clean (the GMM's low-loss posterior)."""
        state = self._dm_state()
        settings = self.lpa3_settings
        losses = self.dividemix_per_sample_losses(loader)
        for name, loss in losses.items():
            history = state["history"].setdefault(name, [])
            history.append(normalized_losses(loss).cpu())
            del history[: max(0, len(history) - settings.loss_history)]
            mean_loss = torch.stack(history).mean(0)
            if settings.split_per_class:
                state["clean_prob"][name] = clean_probability_per_class(mean_loss, state["labels"],
                                                                        self._dm_sizes()[1], seed=settings.seed)
            else:
                state["clean_prob"][name] = clean_probability(mean_loss, seed=settings.seed)
            if settings.stratified_split:
                self._dm_hold_first_count(name, mean_loss)
        return dict(state["clean_prob"])

    def _dm_hold_first_count(self, name: str, mean_loss: Tensor) -> None:
        """``stratified_split``: keep the first real split's count (one total, or one per class with
        ``split_per_class``) and relabel ``name``'s rows by it."""
        state = self._dm_state()
        per_class_split = self.lpa3_settings.split_per_class
        num_classes = self._dm_sizes()[1]
        labeled = state["clean_prob"][name] > self.lpa3_settings.threshold
        counts = state.setdefault("stratified_count", {})
        if name not in counts:  # the first split's count, kept: later GMMs count the noisy rows the networks fitted
            if per_class_split:
                # each class its own count (where the classes' clean shares differ, one count shared by
                # class size misfills them); a class with an empty side fixes nothing: wait for a real split
                per_class = torch.bincount(state["labels"][labeled.cpu()], minlength=num_classes)
                sizes = torch.bincount(state["labels"], minlength=num_classes)
                present = sizes > 0
                if bool(((per_class[present] > 0) & (per_class[present] < sizes[present])).all()):
                    counts[name] = per_class.tolist()
            elif 0 < (total := int(labeled.sum())) < len(mean_loss):  # a split with an empty side fixes nothing
                counts[name] = total
        if name not in counts:
            return
        if isinstance(counts[name], list) != per_class_split:
            kept = "one count per class" if isinstance(counts[name], list) else "one total count"
            raise ValueError(f"The DivideMix state holds {kept} for {name!r} (from a checkpoint), but "
                             f"`dividemix.split_per_class` is {per_class_split}. Fix: resume with the "
                             "`split_per_class` the checkpoint was trained with.")
        state["clean_prob"][name] = stratified_selection(mean_loss, state["labels"], num_classes, counts[name])

    def dividemix_clean_probability(self, network: str) -> Tensor:
        """The clean probabilities ``(N,)`` estimated by ``network``'s GMM."""
        prob = self._dm_state()["clean_prob"].get(network)
        if prob is None:
            raise RuntimeError("The DivideMix split is not computed yet: call `dividemix_begin_epoch(epoch, loader)` "
                               "at the start of every epoch (the ready DivideMixClassifier does).")
        return prob

    def _dm_labeled(self, network: str, idx: Tensor) -> tuple[Tensor, Tensor]:
        """(labeled mask, w) of the rows ``idx`` for training ``network``: the other network's split."""
        w = self.dividemix_clean_probability(self.dividemix_other(network)).to(idx.device)[idx]
        return w > self.lpa3_settings.threshold, w

    # ------------------------------------------------------------------ guesses
    @torch.no_grad()
    def dividemix_guess(self, batch: Any, network: str) -> Tensor:
        """Co-guessed targets of the rows unlabeled for ``network``: sharpened mean of both
        networks' predictions of both views (``network`` in train mode with its BatchNorm
        statistics left alone, the other in eval mode, as the authors). Forwarded once per batch
        and network, then reused by the request and the loss."""
        x1, x2, _, idx = split_two_view_batch(batch)
        cached = self._dm_state()["guess"].get(network)
        if cached is not None and cached[0] is x1:
            return cached[1]
        unlabeled = ~self._dm_labeled(network, idx)[0]
        u1, u2 = x1[unlabeled], x2[unlabeled]
        classes = int(self.lpa3_num_classes or 0)
        own, other = self.dividemix_model(network), self.dividemix_model(self.dividemix_other(network))
        if u1.shape[0] == 0 and not needs_every_rank(own):
            guess, logits_u1 = u1.new_zeros(0, classes), u1.new_zeros(0, classes)
        else:  # (a rank without unlabeled rows still forwards its empty batch where SyncBatchNorm syncs)
            kept = batchnorm_buffers_kept(own) if u1.shape[0] == 0 else contextlib.nullcontext()
            with self._dm_guess_bn(own), kept:
                logits_own = self.lpa3_logits(own(torch.cat([u1, u2]))).float()
            was_training = other.training
            other.eval()
            try:
                logits_other = self.lpa3_logits(other(torch.cat([u1, u2]))).float()
            finally:
                other.train(was_training)
            n = u1.shape[0]
            p_own, p_other = torch.softmax(logits_own, 1), torch.softmax(logits_other, 1)
            guess = co_guess(torch.stack([p_own[:n], p_own[n:]]), torch.stack([p_other[:n], p_other[n:]]),
                             self.lpa3_settings.temperature)
            logits_u1 = logits_own[:n]
        self._dm_state()["guess"][network] = (x1, guess, logits_u1)
        return guess

    def _dm_guess_bn(self, model: nn.Module) -> Any:
        """The BatchNorm handling of a guessing or refinement forward (see ``guess_bn_updates``)."""
        return contextlib.nullcontext() if self.lpa3_settings.guess_bn_updates else BatchNormStatisticsFrozen(model)

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
        logits_u1 = self._dm_state()["guess"].pop(network)[2]
        self.lpa3_record_predictions(idx[~labeled], logits_u1, network=network)  # TCS: the unlabeled rows
        n_lab = int(labeled.sum())
        refined = x1.new_zeros(0, num_classes).float()
        if n_lab or needs_every_rank(model):  # (an empty forward where SyncBatchNorm syncs: every rank makes it)
            kept = batchnorm_buffers_kept(model) if not n_lab else contextlib.nullcontext()
            with torch.no_grad(), self._dm_guess_bn(model), kept:
                probs = torch.softmax(self.lpa3_logits(model(torch.cat([x1[labeled], x2[labeled]]))).float(), 1)
            if n_lab:
                refined = co_refine(y[labeled], torch.stack([probs[:n_lab], probs[n_lab:]]), w[labeled],
                                    settings.temperature)
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

    # ------------------------------------------------------------------ checkpoint
    def dividemix_state_dict(self) -> dict[str, Any]:
        """The clean probabilities and loss histories (a resume continues on the same split)."""
        state = self._dm_state()
        return {"clean_prob": {k: v.cpu() for k, v in state["clean_prob"].items()},
                "history": {k: [h.cpu() for h in v] for k, v in state["history"].items()},
                "stratified_count": dict(state.get("stratified_count", {}))}

    def dividemix_load_state_dict(self, saved: dict[str, Any]) -> None:
        state = self._dm_state()
        state["clean_prob"] = dict(saved.get("clean_prob", {}))
        state["history"] = {k: list(v) for k, v in saved.get("history", {}).items()}
        state["stratified_count"] = {k: [int(c) for c in v] if isinstance(v, (list, tuple)) else int(v)
                                     for k, v in saved.get("stratified_count", {}).items()}
        state["guess"] = {}
