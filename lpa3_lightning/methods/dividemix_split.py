"""DivideMix's co-divide (Li, Socher, Hoi, ICLR 2020): the loss-based split and its per-epoch state.

Every semi-supervised epoch each network's per-sample cross-entropy on the noisy labels (eval mode),
min-max normalised and averaged over the last ``loss_history`` epochs, is fitted by a two-component
Gaussian mixture whose low-loss posterior ``w`` is the probability that a label is clean; each network
trains with the split of the *other*. The state is saved in checkpoints: a resumed run continues on
the same split.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lpa3_lightning.core.checks import check_class_labels
from lpa3_lightning.methods.base import LPA3ModuleMixin
from lpa3_lightning.methods.mixmatch import noisy_sizes, sum_over_training_set
from lpa3_lightning.methods.settings import DivideMixSettings

__all__ = ["DivideMixPhase", "DivideMixSplitMixin", "clean_probability", "clean_probability_per_class",
           "normalized_losses", "stratified_selection"]

DivideMixPhase = Literal["warmup", "semi"]


def normalized_losses(losses: Tensor) -> Tensor:
    """Min-max normalised per-sample losses, in ``[0, 1]`` (a constant vector gives zeros)."""
    if losses.dim() != 1 or losses.numel() == 0:
        raise ValueError(f"`losses` must be a non-empty 1-D tensor of per-sample losses, got shape {tuple(losses.shape)}.")
    low, high = losses.min(), losses.max()
    return (losses - low) / (high - low).clamp_min(torch.finfo(losses.dtype).tiny)


def clean_probability(losses: Tensor, seed: int = 0, max_iter: int = 10, tol: float = 1e-2,
                      reg_covar: float = 5e-4) -> Tensor:
    """Per-sample probability ``(N,)`` (float32, on the losses' device) that the label is clean: the
    posterior of the smaller-mean component of a 2-component ``GaussianMixture`` (DivideMix's settings)
    fitted to ``losses`` ``(N,)`` as given; ``seed`` fixes the k-means initialisation.

    Example:
        >>> losses = torch.cat([torch.full((50,), 0.1), torch.full((50,), 0.9)]) + torch.linspace(0, 0.01, 100)
        >>> w = clean_probability(losses)
        >>> bool(w[:50].min() > 0.9), bool(w[50:].max() < 0.1)
        (True, True)
    """
    from sklearn.mixture import GaussianMixture  # a dependency of medmnist; imported where it is used

    if losses.dim() != 1 or losses.numel() < 2:
        raise ValueError(f"`losses` must be a 1-D tensor of at least 2 per-sample losses, got shape "
                         f"{tuple(losses.shape)}.")
    values = losses.detach().double().cpu().numpy().reshape(-1, 1)
    if not np.isfinite(values).all():
        raise ValueError("`losses` holds NaN or Inf. Fix: check the model's outputs before the split.")
    gmm = GaussianMixture(n_components=2, max_iter=max_iter, tol=tol, reg_covar=reg_covar, random_state=seed)
    gmm.fit(values)
    clean = int(np.argmin(gmm.means_.reshape(-1)))
    return torch.as_tensor(gmm.predict_proba(values)[:, clean], dtype=torch.float32, device=losses.device)


def clean_probability_per_class(losses: Tensor, labels: Tensor, num_classes: int, seed: int = 0) -> Tensor:
    """:func:`clean_probability` fitted once per noisy class of ``labels`` ``(N,)`` (ours:
    ``DivideMixSettings.split_per_class``); classes with fewer than 4 samples, or constant losses, keep
    the global mixture's posterior."""
    if labels.shape != losses.shape:
        raise ValueError(f"`labels` must have the losses' shape {tuple(losses.shape)}, got {tuple(labels.shape)}.")
    check_class_labels(labels, num_classes, name="labels")
    labels = labels.to(losses.device).long()
    prob = clean_probability(losses, seed=seed)
    for c in range(num_classes):
        rows = (labels == c).nonzero().flatten()
        if rows.numel() >= 4 and bool(losses[rows].max() > losses[rows].min()):
            prob[rows] = clean_probability(losses[rows], seed=seed)
    return prob


def stratified_selection(losses: Tensor, labels: Tensor, num_classes: int,
                         count: int | list[int] | tuple[int, ...]) -> Tensor:
    """``count`` rows ``(N,)`` marked clean (1.0, float32), each noisy class's lowest-loss rows (ties to the
    lower index; ours: ``DivideMixSettings.stratified_split``). An int ``count`` is shared over the classes
    by size (largest remainder, ties to the lower class); a list (or tuple) gives each class its own.

    Example:
        >>> losses = torch.tensor([0.1, 0.9, 0.2, 0.8, 0.5, 0.6])
        >>> labels = torch.tensor([0, 0, 0, 1, 1, 1])
        >>> stratified_selection(losses, labels, num_classes=2, count=2).tolist()
        [1.0, 0.0, 0.0, 0.0, 1.0, 0.0]
        >>> stratified_selection(losses, labels, num_classes=2, count=[2, 0]).tolist()
        [1.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    """
    if losses.dim() != 1 or labels.shape != losses.shape:
        raise ValueError(f"`losses` and `labels` must be 1-D of one shape, got {tuple(losses.shape)} and "
                         f"{tuple(labels.shape)}. Fix: one loss and one noisy label per training sample.")
    per_class = isinstance(count, (list, tuple))
    if not per_class and (isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= losses.numel()):
        raise ValueError(f"`count` must be an int in [0, {losses.numel()}] or a list of one int per class, got "
                         f"{count!r}. Fix: the number of rows to mark clean, at most the number of samples.")
    check_class_labels(labels, num_classes, name="labels")
    labels = labels.to(losses.device).long()
    sizes = torch.bincount(labels.cpu(), minlength=num_classes)
    if per_class:
        shares = _class_counts(count, sizes)
    else:
        quota = count * sizes.double() / max(1, labels.numel())
        shares = quota.floor().long()
        remainder = count - int(shares.sum())
        if remainder > 0:  # largest fractional parts first; a stable sort sends ties to the lower class
            order = torch.sort(quota - shares.double(), descending=True, stable=True).indices
            shares[order[:remainder]] += 1
    selected = torch.zeros_like(losses, dtype=torch.float32)
    for c in range(num_classes):
        rows = (labels == c).nonzero().flatten()
        take = int(shares[c])  # a share never exceeds its class (see above)
        if take:
            selected[rows[torch.sort(losses[rows], stable=True).indices[:take]]] = 1.0
    return selected


def _class_counts(counts: list[int] | tuple[int, ...], sizes: Tensor) -> Tensor:
    """``counts`` as a ``(C,)`` tensor, refused unless it holds one int per class within the class's size."""
    values = list(counts)
    if len(values) != len(sizes) or any(isinstance(v, bool) or not isinstance(v, int) for v in values):
        raise ValueError(f"`count` as a list must hold one int per class ({len(sizes)}), got {values!r}. Fix: "
                         "each noisy class's number of rows to mark clean.")
    shares = torch.tensor(values, dtype=torch.long)
    if bool((shares < 0).any()) or bool((shares > sizes).any()):
        raise ValueError(f"`count` per class must lie in [0, class size] (sizes {sizes.tolist()}), got {values}. "
                         "Fix: no class can mark more rows than it holds.")
    return shares


class DivideMixSplitMixin(LPA3ModuleMixin):
    """The co-divide half of :class:`~lpa3_lightning.methods.dividemix.DivideMixLPA3Mixin` (its base): the
    networks, the phases and each network's clean probabilities. The state (``_dm_state()``) lives in the
    module's ``__dict__``, out of ``nn.Module``'s attribute machinery."""

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
        return noisy_sizes(self, "DivideMix")

    def _dm_state(self) -> dict[str, Any]:
        return self.__dict__.setdefault("_dividemix_state", {"clean_prob": {}, "history": {}, "guess": {}})

    def _dm_partner(self, network: str) -> str:
        """The other of the two networks (co-divide: its split trains ``network``)."""
        first, second = self.lpa3_networks()
        return second if network == first else first

    # ------------------------------------------------------------------ per epoch: co-divide
    def dividemix_begin_epoch(self, epoch: int, loader: Any) -> None:
        """In the semi phase, refresh both networks' clean probabilities with ``loader`` (the training set's
        ``(x, x, noisy_label, index)`` batches, evaluation view) before either network trains."""
        self._dm_state()["epoch"] = int(epoch)
        if self.dividemix_phase(epoch) == "semi":
            self.dividemix_refresh_split(loader)

    @torch.no_grad()
    def dividemix_per_sample_losses(self, loader: Any) -> dict[str, Tensor]:
        """Each network's cross-entropy on the noisy label of every training sample (eval mode), the
        same on every rank under DDP (so is the GMM fitted on them)."""
        sizes = self._dm_sizes()
        names = self.lpa3_networks()
        models = [self.dividemix_model(n) for n in names]

        def losses(x: Tensor, _: Tensor, y: Tensor) -> Tensor:
            return torch.stack([F.cross_entropy(self.lpa3_logits(m(x)).float(), y.long(), reduction="none")
                                for m in models], 1)

        sums, visits, labels = sum_over_training_set(models, loader, sizes, len(models), losses,
                                                     "dividemix_begin_epoch")
        self._dm_state()["labels"] = labels.cpu()
        return {n: sums[:, k] / visits for k, n in enumerate(names)}

    def dividemix_refresh_split(self, loader: Any) -> dict[str, Tensor]:
        """Per network, the probability ``(N,)`` that each label is clean (the GMM's low-loss posterior)."""
        state = self._dm_state()
        settings = self.lpa3_settings
        losses = self.dividemix_per_sample_losses(loader)
        num_classes = self._dm_sizes()[1]
        for name, loss in losses.items():
            history = state["history"].setdefault(name, [])
            history.append(normalized_losses(loss).cpu())
            del history[: max(0, len(history) - settings.loss_history)]
            mean_loss = torch.stack(history).mean(0)
            if settings.split_per_class:
                state["clean_prob"][name] = clean_probability_per_class(mean_loss, state["labels"], num_classes,
                                                                        seed=settings.seed)
            else:
                state["clean_prob"][name] = clean_probability(mean_loss, seed=settings.seed)
            if settings.stratified_split:
                self._dm_hold_first_count(name, mean_loss)
        # the noisy classes each network trains on as labeled (the other's split): the guesses' collapse check
        state["labeled_counts"] = {
            name: torch.bincount(state["labels"][(state["clean_prob"][self._dm_partner(name)]
                                                  > settings.threshold).cpu()], minlength=num_classes)
            for name in losses if self._dm_partner(name) in state["clean_prob"]}
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
