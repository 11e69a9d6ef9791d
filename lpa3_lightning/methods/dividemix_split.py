"""DivideMix's co-divide (Li, Socher, Hoi, ICLR 2020) and the per-epoch state it keeps.

At the start of every semi-supervised epoch each network's per-sample cross-entropy on the noisy
labels (eval mode, the evaluation view), min-max normalised (averaged over the last
``loss_history`` epochs; the authors use 5 at 90% noise, 1 otherwise), is fitted by a
two-component Gaussian mixture, and the posterior ``w`` of its low-loss component is the
probability that a label is clean
(:func:`~lpa3_lightning.methods.dividemix_parts.clean_probability`). Each network then trains
with the split of the *other* (:class:`~lpa3_lightning.methods.dividemix.DivideMixLPA3Mixin`).
This module holds that refresh, the networks' names and phases it needs, and its state (clean
probabilities, loss histories, the noisy labels, the stratified split's counts), saved in
checkpoints so a resumed run continues on the same split. The settings it reads are
:class:`~lpa3_lightning.methods.settings.DivideMixSettings`'.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from lpa3_lightning.core.checks import check_class_labels, check_dataset_indices, check_split_loader_covered
from lpa3_lightning.methods.base import LPA3ModuleMixin
from lpa3_lightning.methods.dividemix_parts import (
    clean_probability,
    clean_probability_per_class,
    normalized_losses,
    stratified_selection,
)
from lpa3_lightning.methods.pes import split_two_view_batch
from lpa3_lightning.methods.settings import DivideMixSettings

__all__ = ["DivideMixPhase", "DivideMixSplitMixin"]

DivideMixPhase = Literal["warmup", "semi"]


class DivideMixSplitMixin(LPA3ModuleMixin):
    """The co-divide half of :class:`~lpa3_lightning.methods.dividemix.DivideMixLPA3Mixin` (its base):
    the networks, the phases and, every semi-supervised epoch, each network's clean probabilities.

    The state lives in the module's ``__dict__`` (``_dm_state()``: ``clean_prob``, ``history``,
    ``labels``, ``stratified_count``, and the guesses' cache of the loss), out of ``nn.Module``'s
    attribute machinery.
    """

    lpa3_settings_class = DivideMixSettings
    lpa3_settings: DivideMixSettings = DivideMixSettings()
    lpa3_num_samples: int | None = None

    # ------------------------------------------------------------------ networks and phases
    def lpa3_networks(self) -> tuple[str, ...]:
        return tuple(self.lpa3_settings.networks)

    def dividemix_model(self, network: str) -> nn.Module:
        """The network named ``network``; override (the ready module returns ``self.net1`` / ``self.net2``)."""
        raise NotImplementedError("Return the network named `network` from `dividemix_model` (e.g. self.net1).")

    def dividemix_phase(self, epoch: int) -> DivideMixPhase:
        return "warmup" if epoch < self.lpa3_settings.warmup_epochs else "semi"

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
        # the noisy classes of the set each network trains on as labeled (the other's split), for
        # the collapse check of the guessed labels
        num_classes = self._dm_sizes()[1]
        state["labeled_counts"] = {
            name: torch.bincount(state["labels"][(state["clean_prob"][self._dm_partner(name)]
                                                  > settings.threshold).cpu()], minlength=num_classes)
            for name in losses if self._dm_partner(name) in state["clean_prob"]}
        return dict(state["clean_prob"])

    def _dm_partner(self, network: str) -> str:
        """The other of the two networks (co-divide: its split trains ``network``)."""
        first, second = self.lpa3_networks()
        return second if network == first else first

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

    # ------------------------------------------------------------------ checkpoint
    def dividemix_state_dict(self) -> dict[str, Any]:
        """The clean probabilities and loss histories (a resume continues on the same split)."""
        state = self._dm_state()
        return {"clean_prob": {k: v.cpu() for k, v in state["clean_prob"].items()},
                "history": {k: [h.cpu() for h in v] for k, v in state["history"].items()},
                "stratified_count": dict(state.get("stratified_count", {})),
                "labeled_counts": dict(state.get("labeled_counts", {}))}

    def dividemix_load_state_dict(self, saved: dict[str, Any]) -> None:
        state = self._dm_state()
        state["clean_prob"] = dict(saved.get("clean_prob", {}))
        state["history"] = {k: list(v) for k, v in saved.get("history", {}).items()}
        state["stratified_count"] = {k: [int(c) for c in v] if isinstance(v, (list, tuple)) else int(v)
                                     for k, v in saved.get("stratified_count", {}).items()}
        state["guess"] = {}
        state.pop("partner", None)
        state["labeled_counts"] = dict(saved.get("labeled_counts", {}))
