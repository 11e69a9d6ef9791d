"""DivideMix (Li, Socher, Hoi, ICLR 2020) with LP-A3 hard positives for each of its two networks.

A cross-entropy ``"warmup"``, then ``"semi"``: each network trains with the other's co-divide split
(:mod:`lpa3_lightning.methods.dividemix_split`) on MixMatch with co-refined labeled and co-guessed
unlabeled targets plus a prior penalty. LP-A3 (the paper's DivideMix rows; the authors released no
code for them): one callback keeps a memory, selection, twins and ``x'`` cache per network; each
network's unlabeled rows are attacked with the co-guessed label and the ``x'`` used as PES uses them.
Departures from the authors' code, each with its reason: docs/method.md, section 5.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lpa3_lightning.core.checks import check_class_prior
from lpa3_lightning.core.distributed import needs_every_rank
from lpa3_lightning.methods.base import LPA3Request
from lpa3_lightning.methods.dividemix_split import DivideMixPhase, DivideMixSplitMixin
from lpa3_lightning.methods.guess_tally import GuessTally, warn_on_collapse
from lpa3_lightning.methods.mixmatch import (
    augmented_mixmatch_loss,
    check_noisy_batch,
    linear_rampup,
    mixmatch_forward,
    mixup_lambda,
    sharpen,
    split_two_view_batch,
    two_view_logits,
)

__all__ = ["DivideMixLPA3Mixin", "DivideMixPhase", "co_guess", "co_refine", "negative_entropy", "prior_penalty"]


def co_refine(labels: Tensor, probs_views: Tensor, w: Tensor, temperature: float = 0.5) -> Tensor:
    """DivideMix's label co-refinement ``(B, C)``: ``sharpen(w * onehot(y) + (1 - w) * mean_views(p), T)``
    of the noisy ``labels`` ``(B,)``, the network's predictions ``probs_views`` ``(V, B, C)`` of ``V``
    views and the clean probabilities ``w`` ``(B,)``."""
    if probs_views.dim() != 3 or probs_views.shape[1:2] != labels.shape or w.shape != labels.shape:
        raise ValueError(f"`probs_views` must be (V, B, C) with B = len(labels) = len(w), got "
                         f"{tuple(probs_views.shape)}, {tuple(labels.shape)}, {tuple(w.shape)}.")
    one_hot = F.one_hot(labels.long(), probs_views.shape[2]).to(probs_views.dtype)
    w = w.to(probs_views.dtype)[:, None]
    return sharpen(w * one_hot + (1 - w) * probs_views.mean(0), temperature)


def co_guess(probs_net1: Tensor, probs_net2: Tensor, temperature: float = 0.5) -> Tensor:
    """DivideMix's co-guessing ``(B, C)``: ``sharpen`` of both networks' predictions ``(V, B, C)``
    averaged over the views."""
    if probs_net1.shape != probs_net2.shape or probs_net1.dim() != 3:
        raise ValueError(f"both networks' predictions must be (V, B, C) of one shape, got {tuple(probs_net1.shape)} "
                         f"and {tuple(probs_net2.shape)}.")
    return sharpen(torch.cat([probs_net1, probs_net2]).mean(0), temperature)


def prior_penalty(logits: Tensor, prior: Tensor | None = None) -> Tensor:
    """``KL(prior || mean softmax)`` over the batch: DivideMix's regulariser against collapse. ``prior``:
    class frequencies ``(C,)`` summing to 1 (None: uniform, DivideMix's); its shape is checked, its values
    only on the host (reading an accelerator's back would synchronise the step: its owner checks them)."""
    mean_probs = torch.softmax(logits.float(), dim=1).mean(0)
    if prior is None:
        prior = torch.full_like(mean_probs, 1.0 / mean_probs.numel())
    else:
        if prior.shape != mean_probs.shape:
            raise ValueError(f"`prior` must hold {mean_probs.numel()} class frequencies (shape "
                             f"{tuple(mean_probs.shape)}), got shape {tuple(prior.shape)}.")
        if prior.device.type == "cpu":
            check_class_prior(prior, mean_probs.numel(), name="prior")
        prior = prior.to(mean_probs)
    return (prior * (prior.log() - mean_probs.clamp_min(1e-12).log())).sum()


def negative_entropy(logits: Tensor) -> Tensor:
    """Mean over the batch of ``sum_c p_c log p_c`` (DivideMix's warm-up penalty for asymmetric noise)."""
    log_p = F.log_softmax(logits.float(), dim=1)
    return (log_p.exp() * log_p).sum(1).mean()


class DivideMixLPA3Mixin(DivideMixSplitMixin):
    """DivideMix's co-divide and MixMatch loss for two networks, with LP-A3 hard positives for each. Set
    ``lpa3_settings`` (:class:`~lpa3_lightning.methods.settings.DivideMixSettings`), ``lpa3_num_classes``
    and ``lpa3_num_samples``, return the networks from :meth:`dividemix_model`, call
    :meth:`dividemix_begin_epoch` every epoch and :meth:`dividemix_losses` in ``training_step``."""

    #: batch composition rule of :class:`~lpa3_lightning.data.sampling.SplitBalancedSampler`
    noisy_batch_rule: str = "half"

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

    def noisy_split_mask(self) -> Tensor | None:
        """In the semi phase, the samples labeled for either network (``(N,)`` bool), else None."""
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
        """Co-guessed targets of the rows unlabeled for ``network`` (``network`` in train mode, its
        BatchNorm as ``guess_bn_updates`` says; the other in eval mode), once per batch and network."""
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
        """The two views ``u1``, ``u2`` of the rows unlabeled for ``network`` and its partner's eval-mode
        predictions of them ``(2, U, C)``, made for both networks at the batch's first guess, before any
        train-mode forward of the step moves the running statistics they read; handed out once each."""
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
            try:  # Train_cifar.py:66-67: one forward per view with "reference"
                logits = two_view_logits(self, other, u1, u2, per_view=per_view, frozen=False)
            finally:
                other.train(was_training)
            predictions[network] = (u1, u2, torch.stack([torch.softmax(v, 1) for v in logits]))
        return predictions

    def _dm_own_forward(self, model: nn.Module, v1: Tensor, v2: Tensor) -> tuple[Tensor, Tensor]:
        """:func:`~lpa3_lightning.methods.mixmatch.two_view_logits` as ``guess_bn_updates`` says
        (``"reference"``: Train_cifar.py:64-65 and 76-77, each view alone)."""
        mode = self.lpa3_settings.guess_bn_updates
        return two_view_logits(self, model, v1, v2, per_view=mode == "reference", frozen=not mode)

    def _dm_prior(self, device: torch.device) -> Tensor | None:
        """The prior penalty's class frequencies on ``device`` (None: uniform), built once per prior, class
        count and device; a ValueError unless ``class_prior`` holds one frequency per class."""
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
        """Semi phase: the rows unlabeled for ``network`` (first view) with their co-guessed label; in the
        warm-up (no ``x'`` is trained), the view that network trains on with its noisy label."""
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
        """``(loss, parts)`` of ``network`` on this batch in the current phase (``parts``: ``loss_labeled``,
        ``loss_unlabeled``, ``loss_prior``, ``loss_lpa3``, ``unlabeled_weight``, ``labeled_share``,
        ``num_augmented``); ``batches_per_epoch`` (None: the trainer's) paces the ramp-up within an epoch."""
        self.lpa3_check_settings()
        settings = self.lpa3_settings
        x1, x2, y, idx = split_two_view_batch(batch)
        sizes = self._dm_sizes()
        check_noisy_batch(idx, y, sizes)
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
        refined = x1.new_zeros(0, sizes[1]).float()
        if n_lab or needs_every_rank(model):  # (an empty forward where SyncBatchNorm syncs: every rank makes it)
            logits_x1, logits_x2 = self._dm_own_forward(model, x1[labeled], x2[labeled])
            if n_lab:
                probs = torch.stack([torch.softmax(logits_x1, 1), torch.softmax(logits_x2, 1)])
                refined = co_refine(y[labeled], probs, w[labeled], settings.temperature)
        lam = mixup_lambda(settings.alpha)
        logits, loss_l, loss_u = mixmatch_forward(self, model, x1, x2, labeled, refined, guess, lam)
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
        """As :meth:`~lpa3_lightning.methods.pes.PESLPA3Mixin.pes_guess_report`, per network
        (``dividemix/<network>/guess_top_class_share``) and for both (``dividemix/guess_top_class_share``)."""
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
        """:meth:`dividemix_loss` of every network, every co-guess made before the first network's training
        forward moves its BatchNorm statistics (the guesses see the networks as at the start of the step)."""
        self.lpa3_check_settings()  # before the phase is read from them
        if self.dividemix_phase(self.dividemix_current_epoch()) == "semi":
            for name in self.lpa3_networks():
                self.dividemix_guess(batch, name)
        return {name: self.dividemix_loss(batch, name, batch_idx, batches_per_epoch) for name in self.lpa3_networks()}
