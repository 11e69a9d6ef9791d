"""The small protocol between :class:`~lpa3_lightning.LPA3Callback` and a LightningModule.

A module adopts LP-A3 by inheriting :class:`LPA3ModuleMixin` (its default
:meth:`~LPA3ModuleMixin.lpa3_request` reads ``(x, y, index)`` batches); in ``training_step``
it calls :meth:`~LPA3ModuleMixin.lpa3_record_predictions` with its clean logits (they feed
the time-consistency memory, so no extra forward is spent on it),
:meth:`~LPA3ModuleMixin.lpa3_take_augmented` to get the hard positives, and
:meth:`~LPA3ModuleMixin.lpa3_forward_augmented` for their logits: the forward under which
the solver verified that every ``x'`` keeps its label (the callback measures it there). Each
mixin reads its settings from one attribute, ``lpa3_settings``, a frozen dataclass of
:mod:`lpa3_lightning.methods.settings`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any, ClassVar

from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from lpa3_lightning.core.augmented import AugmentedBatch, LPA3Request
from lpa3_lightning.core.augmented_forward import augmented_logits
from lpa3_lightning.core.model_outputs import output_to_logits
from lpa3_lightning.methods.settings import LPA3Settings

__all__ = ["BatchNormStatisticsFrozen", "LPA3ModuleMixin", "split_indexed_batch"]


def split_indexed_batch(batch: Any) -> tuple[Tensor, Tensor, Tensor]:
    """``(inputs, targets, indices)`` of a batch from an index-returning dataset.

    Accepts a ``(x, y, index)`` tuple/list or a mapping with keys ``input``/``target``/``index``.

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
    """Leave every BatchNorm's running statistics (and batch count) as they are during a forward
    in train mode (momentum 0), e.g. the no-grad pseudo-label forwards of FixMatch and PES."""

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
            (:class:`~lpa3_lightning.methods.settings.LPA3Settings` here: ``train_forward``);
            set ``self.lpa3_settings = LPA3Settings(...)`` in ``__init__`` to change them.
        lpa3_num_classes: number of classes of the model's logits (sizes the TCS memory);
            set it in ``__init__``. A fact about the data, not a setting.
    """

    #: the class :attr:`lpa3_settings` must be an instance of (each mixin names its own)
    lpa3_settings_class: ClassVar[type[LPA3Settings]] = LPA3Settings
    lpa3_settings: LPA3Settings = LPA3Settings()
    lpa3_num_classes: int | None = None
    _lpa3_augmented: AugmentedBatch | None = None
    _lpa3_predictions: tuple[Tensor, Tensor, Tensor | None] | None = None
    _lpa3_augmented_logits: Tensor | None = None

    def lpa3_batches_per_epoch(self, given: int | None = None) -> int:
        """``given``, or the attached trainer's training batches per epoch (1 when unknown): the
        step count that makes a loss's ramp-up advance within an epoch
        (``epoch + batch_idx / batches_per_epoch``)."""
        if given is not None:
            return max(1, int(given))
        batches = getattr(getattr(self, "_trainer", None), "num_training_batches", None)
        return int(batches) if isinstance(batches, (int, float)) and 1 <= batches < float("inf") else 1

    def lpa3_split_batch(self, batch: Any) -> tuple[Tensor, Tensor, Tensor]:
        """``(inputs, targets, indices)`` of a training batch; the default reads ``(x, y, index)``
        tuples or ``{"input", "target", "index"}`` dicts and names the fix for a batch without
        indices (:func:`split_indexed_batch`). Override for another batch layout."""
        return split_indexed_batch(batch)

    def lpa3_request(self, batch: Any) -> LPA3Request:
        """The inputs, labels to preserve and dataset indices of ``batch`` (default: from
        :meth:`lpa3_split_batch`, the true labels). Override to preserve other labels
        (pseudo-labels) or to offer another view of the batch."""
        x, y, idx = self.lpa3_split_batch(batch)
        return LPA3Request(inputs=x, targets=y, indices=idx)

    def lpa3_model(self, network: str | None = None) -> nn.Module:
        """The network to attack and whose layers give the perceptual features.

        Defaults to the module itself; override to return the backbone (e.g. ``self.model``)
        so that layer names are the backbone's. A module with several networks
        (:meth:`lpa3_networks`) returns the one named ``network``.
        """
        return self  # type: ignore[return-value]

    def lpa3_check_settings(self) -> None:
        """Refuse an :attr:`lpa3_settings` that is not an instance of this mixin's settings class
        (the fields themselves were validated when it was built). The callback calls it in
        ``setup``, and the mixins' losses on every call (an ``isinstance``: it also catches
        settings replaced after the first step).

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

    def lpa3_consumes_augmented(self, epoch: int) -> bool:
        """Whether this module's loss trains ``x'`` in ``epoch`` (default: always).

        The callback solves only in the epochs where this is True (and after its own
        ``warmup_epochs``): a method that trains ``x'`` only in some phases (PES's semi-supervised
        phase, DivideMix after its warm-up, FixMatch after its LP-A3 loss warm-up) says so here,
        and no solve is spent on ``x'`` nobody trains. The TCS memory keeps updating either way.
        """
        return True

    def lpa3_networks(self) -> tuple[str, ...] | None:
        """Names of the networks LP-A3 runs on, each with its own memory, selection, twin BN and
        cache (e.g. DivideMix's ``("net1", "net2")``); None (default): one network.

        With names, the callback calls :meth:`lpa3_request`, :meth:`lpa3_model` and the hand-over
        methods with ``network=<name>`` (see :mod:`lpa3_lightning.callback.networks`)."""
        return None

    # The hand-over slots: plain attributes for the single network (network=None), a dict for named ones.
    def _lpa3_slot(self, attr: str, network: str | None) -> Any:
        if network is None:
            return getattr(self, attr)
        return self.__dict__.get("_lpa3_named_slots", {}).get((attr, network))

    def _lpa3_set_slot(self, attr: str, network: str | None, value: Any) -> None:
        if network is None:
            setattr(self, attr, value)
        else:
            self.__dict__.setdefault("_lpa3_named_slots", {})[(attr, network)] = value

    def lpa3_forward_context(self) -> Any:
        """The run's precision for a forward made outside ``training_step``: Lightning's
        precision plugin's forward context (autocast under ``"bf16-mixed"`` / ``"16-mixed"``) when
        a trainer is attached, else a no-op.

        The callback calls :meth:`lpa3_request` in ``on_train_batch_start``, outside the autocast
        Lightning puts around ``training_step``: a request that forwards the model to make its
        labels (FixMatch's pseudo-labels, PES's and DivideMix's guesses) forwards inside this, so
        the labels it hands the solver and the loss are those the run's precision gives."""
        precision = getattr(getattr(self, "_trainer", None), "precision_plugin", None)
        return precision.forward_context() if precision is not None else contextlib.nullcontext()

    def lpa3_logits(self, output: Any) -> Tensor:
        """Map ``lpa3_model()``'s output to logits (the adapter for tuple / dict / dataclass outputs).

        The default accepts a tensor and refuses anything else with a message; override,
        e.g. ``return output["logits"]`` or ``return output[0]`` or ``return output.logits``.
        """
        return output_to_logits(output, fix=f"override `lpa3_logits(output)` in {type(self).__name__} to return the "
                                            "(N, classes) logits, e.g. `return output[0]` or `return output['logits']`")

    def lpa3_set_augmented(self, augmented: AugmentedBatch | None, network: str | None = None) -> None:
        """Called by the callback before ``training_step`` with this batch's hard positives."""
        self._lpa3_set_slot("_lpa3_augmented", network, augmented)

    def lpa3_augmented_pending(self, network: str | None = None) -> bool:
        """Whether this batch's hard positives were handed over and not taken (yet)."""
        return self._lpa3_slot("_lpa3_augmented", network) is not None

    def lpa3_take_augmented(self, network: str | None = None) -> AugmentedBatch | None:
        """The hard positives of the current batch (None during warm-up or without callback)."""
        augmented = self._lpa3_slot("_lpa3_augmented", network)
        self._lpa3_set_slot("_lpa3_augmented", network, None)
        return augmented

    def lpa3_forward_augmented(self, augmented: AugmentedBatch) -> Tensor:
        """Logits of the hard positives for the loss, in the forward the solver verified.

        Uses :func:`~lpa3_lightning.core.augmented_forward.augmented_logits` with the batch's BN
        mode, the clean selected samples (twins: reference-batch normalisation) or the
        running-statistics snapshot, and ``lpa3_settings.train_forward``; the logits are
        handed to the callback, which measures ``lpa3/label_preserved`` in this very forward.
        With several networks the batch's own (``augmented.network``) is used.
        """
        network = augmented.network
        model = self.lpa3_model() if network is None else self.lpa3_model(network=network)
        logits = augmented_logits(
            model, augmented.inputs, bn_mode=augmented.bn_mode,  # type: ignore[arg-type]
            bn_statistics=augmented.bn_statistics, reference_inputs=augmented.reference_inputs,
            logits_fn=self.lpa3_logits,
            train_forward=self.lpa3_settings.train_forward, allow_tf32=augmented.allow_tf32,
        )
        self._lpa3_set_slot("_lpa3_augmented_logits", network, logits.detach())
        return logits

    def lpa3_pop_augmented_logits(self, network: str | None = None) -> Tensor | None:
        """Called by the callback after ``training_step``: the logits of ``x'`` as trained, if any."""
        logits = self._lpa3_slot("_lpa3_augmented_logits", network)
        self._lpa3_set_slot("_lpa3_augmented_logits", network, None)
        return logits

    def lpa3_record_predictions(self, indices: Tensor, logits: Tensor, targets: Tensor | None = None,
                                network: str | None = None) -> None:
        """Hand the clean logits of this batch to the callback's time-consistency memory (of
        ``network`` when the module has several)."""
        self._lpa3_set_slot("_lpa3_predictions", network,
                            (indices.detach(), logits.detach(), None if targets is None else targets.detach()))

    def lpa3_pop_predictions(self, network: str | None = None) -> tuple[Tensor, Tensor, Tensor | None] | None:
        """Called by the callback after ``training_step``."""
        predictions = self._lpa3_slot("_lpa3_predictions", network)
        self._lpa3_set_slot("_lpa3_predictions", network, None)
        return predictions
