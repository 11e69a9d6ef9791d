"""The protocol between :class:`~lpa3_lightning.LPA3Callback` and a LightningModule, and what travels in it.

The callback asks, the module answers: for each training batch the callback asks the module for an
:class:`LPA3Request` (inputs, labels to preserve, dataset indices; :meth:`LPA3ModuleMixin.lpa3_request`),
selects and solves, and hands the module one :class:`AugmentedBatch` per network before ``training_step``
(:meth:`~LPA3ModuleMixin.lpa3_set_augmented`). In ``training_step`` the module records its clean logits
(:meth:`~LPA3ModuleMixin.lpa3_record_predictions`: they feed the time-consistency memory, no extra forward),
takes the hard positives (:meth:`~LPA3ModuleMixin.lpa3_take_augmented`) and gets their logits from
:meth:`~LPA3ModuleMixin.lpa3_forward_augmented`: the forward under which the solver verified that every
``x'`` keeps its label (the callback measures ``lpa3/label_preserved`` there). After the step the callback
asks for the recorded predictions (:meth:`~LPA3ModuleMixin.lpa3_pop_predictions`). Each mixin reads its
settings from one attribute, ``lpa3_settings`` (:mod:`lpa3_lightning.methods.settings`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from lpa3_lightning.core.checks import output_to_logits
from lpa3_lightning.methods.settings import LPA3Settings

__all__ = ["AugmentedBatch", "BatchNormStatisticsFrozen", "CALLBACK_MARKER", "LPA3ModuleMixin", "LPA3Request",
           "REQUIRED_METHODS", "consumes_augmented", "lpa3_callbacks", "selected_positions", "split_indexed_batch"]

#: Methods the callback calls on a module (checked when the callback sets up).
REQUIRED_METHODS = ("lpa3_request", "lpa3_model", "lpa3_logits", "lpa3_set_augmented", "lpa3_pop_predictions")
#: The attribute (True) that marks an LP-A3 callback: a module finds the Trainer's without importing it.
CALLBACK_MARKER = "is_lpa3_callback"


def lpa3_callbacks(callbacks: Iterable[Any]) -> list[Any]:
    """The LP-A3 callbacks among ``callbacks`` (e.g. ``trainer.callbacks``)."""
    return [c for c in callbacks if getattr(c, CALLBACK_MARKER, False) is True]


def consumes_augmented(module: Any, epoch: int) -> bool:
    """The module's word on whether its loss trains ``x'`` in ``epoch`` (a module without
    :meth:`LPA3ModuleMixin.lpa3_consumes_augmented` always does)."""
    consumes = getattr(module, "lpa3_consumes_augmented", None)
    return bool(consumes(epoch)) if callable(consumes) else True


def selected_positions(mask: Tensor, count: int) -> Tensor:
    """The positions of the ``count`` True entries of ``mask``, in order (a stable sort: no host read of the
    count, which the caller knows).

    Example:
        >>> selected_positions(torch.tensor([False, True, False, True]), 2).tolist()
        [1, 3]
    """
    return torch.sort((~mask).to(torch.uint8), stable=True).indices[:count]


@dataclass
class LPA3Request:
    """What a module offers for augmentation on one training batch.

    Attributes:
        inputs: ``(B, ...)`` inputs in the space the model takes.
        targets: ``(B,)`` labels to preserve (true labels or pseudo-labels).
        indices: ``(B,)`` dataset indices (the key of the TCS memory).
        train_mask: optional ``(B,)`` bool: the rows whose ``x'`` the loss will weigh above zero (FixMatch: the
            pseudo-label's confidence above its second threshold). A selected row outside it is not solved; it
            is counted in ``AugmentedBatch.skipped`` (the loss's denominator) and its clean input still sets
            the twin statistics, so the loss is the one of solving every selected row, provided ``x'`` trains
            in the verified forward (``train_forward="verified"``). With a cache every selected row is solved
            (a later epoch may reuse a row not trained now). None: every selected row is solved.
    """

    inputs: Tensor
    targets: Tensor
    indices: Tensor
    train_mask: Tensor | None = None


@dataclass
class AugmentedBatch:
    """The hard positives of one batch (of one network), handed to the module before ``training_step``.

    Attributes:
        inputs: ``(M, ...)`` the augmented inputs ``x'`` (detached).
        targets: ``(M,)`` their labels (the request's).
        indices: ``(M,)`` their dataset indices.
        mask: ``(B,)`` which rows of the request got an ``x'`` (``M = mask.sum()``).
        skipped: selected rows not solved because the request's ``train_mask`` left them out; ``M +
            skipped`` is the number selected, the denominator of a loss averaged as the authors average it.
        from_cache: ``(M,)`` bool, with a cache: which ``x'`` were taken from it; None without one.
    """

    inputs: Tensor
    targets: Tensor
    indices: Tensor
    mask: Tensor
    skipped: int = 0
    from_cache: Tensor | None = None
    #: the forward the solver verified, which :meth:`forward` calls (set by the callback; its attributes, the BN
    #: mode, the reference rows, the statistics and the last logits of ``x'``, are the callback's diagnostics)
    verified: Any = field(default=None, repr=False)
    _taken: bool = field(default=False, repr=False)

    def __len__(self) -> int:
        return int(self.inputs.shape[0])

    def positions(self) -> Tensor:
        """The request's positions of the ``M`` rows, in order (pick per-sample values of the batch with
        ``confidence.index_select(0, augmented.positions())``, without the host read of a boolean index)."""
        return selected_positions(self.mask, len(self))

    def forward(self, inputs: Tensor | None = None, train_forward: str = "verified") -> Tensor:
        """Logits of ``x'`` (or of other ``inputs`` built from them, e.g. mixed with labeled rows), with
        autograd, in the forward the solver verified the label under (``"verified"``: its BatchNorm
        normalisation, eval mode, full precision) or the authors' (``"batch_stats"``); see
        :func:`~lpa3_lightning.core.forward_modes.augmented_logits`.

        Raises:
            RuntimeError: for a batch the callback did not make (no forward attached).
        """
        if self.verified is None:
            raise RuntimeError("This AugmentedBatch carries no forward: only the batches LPA3Callback hands over do. "
                               "Fix: forward x' with lpa3_lightning.core.forward_modes.augmented_logits.")
        return self.verified(self.inputs if inputs is None else inputs, train_forward, of_x_prime=inputs is None)


def split_indexed_batch(batch: Any) -> tuple[Tensor, Tensor, Tensor]:
    """``(inputs, targets, indices)`` of a ``(x, y, index)`` tuple/list or an ``{"input", "target", "index"}`` dict.

    Raises:
        ValueError: if the batch carries no dataset indices, naming the fix.
    """
    if isinstance(batch, dict):
        if {"input", "target", "index"} <= set(batch):
            return batch["input"], batch["target"], batch["index"]
    elif isinstance(batch, Sequence) and len(batch) == 3:
        return batch[0], batch[1], batch[2]
    described = sorted(batch) if isinstance(batch, dict) else f"{type(batch).__name__} of length {len(batch)}" \
        if isinstance(batch, Sequence) else type(batch).__name__
    raise ValueError(
        f"LP-A3 needs the dataset index of every sample, but the batch is {described}. Fix: wrap the training "
        "dataset in `lpa3_lightning.data.IndexedDataset` so batches are (x, y, index), or return a dict with "
        "keys 'input', 'target', 'index'."
    )


class BatchNormStatisticsFrozen:
    """Every BatchNorm's running statistics (and batch count) left as they are during a train-mode forward
    (momentum 0): the no-grad guessing forwards of PES and DivideMix, FixMatch's diagnostic request."""

    def __init__(self, model: nn.Module) -> None:
        self.norms = [m for m in model.modules() if isinstance(m, _BatchNorm) and m.training and m.track_running_stats]

    def __enter__(self) -> None:
        self.saved = [(m.momentum, None if m.num_batches_tracked is None else m.num_batches_tracked.clone())
                      for m in self.norms]
        for m in self.norms:
            m.momentum = 0.0  # running = (1 - 0) * running

    def __exit__(self, *exc: Any) -> None:
        for m, (momentum, tracked) in zip(self.norms, self.saved):
            m.momentum = momentum
            if tracked is not None:
                m.num_batches_tracked.copy_(tracked)


class LPA3ModuleMixin:
    """Mixin for a LightningModule trained with :class:`~lpa3_lightning.LPA3Callback`.

    Attributes:
        lpa3_settings: the mixin's settings, an instance of :attr:`lpa3_settings_class`
            (:class:`~lpa3_lightning.methods.settings.LPA3Settings` here: ``train_forward``).
        lpa3_num_classes: the number of classes of the model's logits (sizes the TCS memory); set it in
            ``__init__``. A fact about the data, not a setting.
    """

    #: the class :attr:`lpa3_settings` must be an instance of (each mixin names its own)
    lpa3_settings_class: ClassVar[type[LPA3Settings]] = LPA3Settings
    lpa3_settings: LPA3Settings = LPA3Settings()
    lpa3_num_classes: int | None = None

    # ------------------------------------------------------------------ what the callback asks
    def lpa3_model(self, network: str | None = None) -> nn.Module:
        """The network to attack, whose layers give the perceptual features (default: the module itself;
        return the backbone so that layer names are the backbone's). A module with several networks
        (:meth:`lpa3_networks`) returns the one named ``network``."""
        return self  # type: ignore[return-value]

    def lpa3_request(self, batch: Any) -> LPA3Request:
        """The inputs, labels to preserve and dataset indices of ``batch`` (default: :meth:`lpa3_split_batch`, the
        true labels). Override to preserve other labels (pseudo-labels) or offer another view of the batch."""
        x, y, idx = self.lpa3_split_batch(batch)
        return LPA3Request(inputs=x, targets=y, indices=idx)

    def lpa3_logits(self, output: Any) -> Tensor:
        """``lpa3_model()``'s output as logits (default: a tensor, else refused with the fix); override for
        tuple / dict / dataclass outputs, e.g. ``return output["logits"]``."""
        return output_to_logits(output, fix=f"override `lpa3_logits(output)` in {type(self).__name__} to return the "
                                            "(N, classes) logits, e.g. `return output[0]` or `return output['logits']`")

    def lpa3_consumes_augmented(self, epoch: int) -> bool:
        """Whether this module's loss trains ``x'`` in ``epoch`` (default: always). The callback solves only in
        those epochs (after its own ``warmup_epochs``): PES's semi phase, DivideMix after its warm-up, FixMatch
        after its LP-A3 term's warm-up. The TCS memory keeps updating either way."""
        return True

    def lpa3_networks(self) -> tuple[str, ...] | None:
        """The networks LP-A3 runs on, each with its own memory, selection, twins and cache (DivideMix's
        ``("net1", "net2")``); None (default): one network. With names, the callback passes ``network=<name>``
        to :meth:`lpa3_request`, :meth:`lpa3_model` and the hand-over methods."""
        return None

    def lpa3_check_settings(self) -> None:
        """Refuse an :attr:`lpa3_settings` that is not an instance of this mixin's settings class (the callback
        calls it in ``setup``, the losses at each call).

        Raises:
            TypeError: naming the expected class and the fix.
        """
        expected = self.lpa3_settings_class
        settings = getattr(self, "lpa3_settings", None)
        if not isinstance(settings, expected):
            raise TypeError(
                f"{type(self).__name__}.lpa3_settings must be a {expected.__name__}, got {type(settings).__name__}"
                f" ({settings!r}). Fix: set `self.lpa3_settings = {expected.__name__}(...)` in __init__ (from "
                "lpa3_lightning.mixins); its fields are the mixin's settings (docs/mixins.md)."
            )

    def lpa3_set_augmented(self, augmented: AugmentedBatch | None, network: str | None = None) -> None:
        """The callback hands over this batch's hard positives (None: none), once per network before the step."""
        self._lpa3_set_slot("augmented", network, augmented)

    def lpa3_pop_predictions(self, network: str | None = None) -> tuple[Tensor, Tensor, Tensor | None] | None:
        """The callback takes the predictions ``training_step`` recorded (after the step)."""
        predictions = self._lpa3_slot("predictions", network)
        self._lpa3_set_slot("predictions", network, None)
        return predictions

    # ------------------------------------------------------------------ what the module's loss calls
    def lpa3_split_batch(self, batch: Any) -> tuple[Tensor, Tensor, Tensor]:
        """``(inputs, targets, indices)`` of a training batch (:func:`split_indexed_batch`); override for another
        layout."""
        return split_indexed_batch(batch)

    def lpa3_take_augmented(self, network: str | None = None) -> AugmentedBatch | None:
        """This batch's hard positives (None in warm-up epochs or without the callback)."""
        augmented = self._lpa3_slot("augmented", network)
        self._lpa3_set_slot("augmented", network, None)
        if augmented is not None:
            augmented._taken = True
        return augmented

    def lpa3_forward_augmented(self, augmented: AugmentedBatch, inputs: Tensor | None = None) -> Tensor:
        """Logits of the hard positives (or of ``inputs`` made from them) for the loss, in the forward the
        solver verified (``lpa3_settings.train_forward``; :meth:`AugmentedBatch.forward`)."""
        return augmented.forward(inputs, self.lpa3_settings.train_forward)

    def lpa3_record_predictions(self, indices: Tensor, logits: Tensor, targets: Tensor | None = None,
                                network: str | None = None) -> None:
        """The clean logits of this batch for the TCS memory (of ``network`` when the module has several)."""
        self._lpa3_set_slot("predictions", network,
                            (indices.detach(), logits.detach(), None if targets is None else targets.detach()))

    def lpa3_forward_context(self) -> Any:
        """The run's precision for a forward outside ``training_step`` (Lightning's precision plugin's forward
        context, e.g. autocast under ``"bf16-mixed"``; a no-op without a trainer): a request that forwards the
        model to make its labels (pseudo-labels, guesses) runs inside it, so they are the run's precision's."""
        precision = getattr(getattr(self, "_trainer", None), "precision_plugin", None)
        return precision.forward_context() if precision is not None else contextlib.nullcontext()

    def lpa3_batches_per_epoch(self, given: int | None = None) -> int:
        """``given``, or the attached trainer's training batches per epoch (1 when unknown): the step count that
        advances a loss's ramp-up within an epoch (``epoch + batch_idx / batches_per_epoch``)."""
        if given is not None:
            return max(1, int(given))
        batches = getattr(getattr(self, "_trainer", None), "num_training_batches", None)
        return int(batches) if isinstance(batches, (int, float)) and 1 <= batches < float("inf") else 1

    def _lpa3_slot(self, slot: str, network: str | None) -> Any:
        return self.__dict__.get("_lpa3_slots", {}).get((slot, network))

    def _lpa3_set_slot(self, slot: str, network: str | None, value: Any) -> None:
        self.__dict__.setdefault("_lpa3_slots", {})[(slot, network)] = value
