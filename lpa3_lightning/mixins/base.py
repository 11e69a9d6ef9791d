"""The small protocol between :class:`~lpa3_lightning.LPA3Callback` and a LightningModule.

A module adopts LP-A3 by inheriting :class:`LPA3ModuleMixin` and implementing
:meth:`~LPA3ModuleMixin.lpa3_request`; in ``training_step`` it calls
:meth:`~LPA3ModuleMixin.lpa3_record_predictions` with its clean logits (they feed the
time-consistency memory, so no extra forward is spent on it) and
:meth:`~LPA3ModuleMixin.lpa3_take_augmented` to get the hard positives for its loss.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from lpa3_lightning.augmented import AugmentedBatch, LPA3Request
from lpa3_lightning.features import output_to_logits

__all__ = ["LPA3ModuleMixin", "REQUIRED_METHODS"]

#: Methods the callback calls; checked in ``LPA3Callback.setup``.
REQUIRED_METHODS = ("lpa3_request", "lpa3_model", "lpa3_logits", "lpa3_set_augmented", "lpa3_pop_predictions")


class LPA3ModuleMixin:
    """Mixin for a LightningModule trained with :class:`~lpa3_lightning.LPA3Callback`.

    Attributes:
        lpa3_num_classes: number of classes of the model's logits (sizes the TCS memory);
            set it in ``__init__``.
    """

    lpa3_num_classes: int | None = None
    _lpa3_augmented: AugmentedBatch | None = None
    _lpa3_predictions: tuple[Tensor, Tensor, Tensor | None] | None = None

    def lpa3_request(self, batch: Any) -> LPA3Request:
        """Return the inputs, labels to preserve and dataset indices of ``batch``."""
        raise NotImplementedError(
            f"{type(self).__name__} must implement `lpa3_request(batch) -> LPA3Request` for LPA3Callback."
        )

    def lpa3_model(self) -> nn.Module:
        """The network to attack and whose layers give the perceptual features.

        Defaults to the module itself; override to return the backbone (e.g. ``self.model``)
        so that layer names are the backbone's.
        """
        return self  # type: ignore[return-value]

    def lpa3_logits(self, output: Any) -> Tensor:
        """Map ``lpa3_model()``'s output to logits (the adapter for tuple / dict / dataclass outputs).

        The default accepts a tensor and refuses anything else with a message; override,
        e.g. ``return output["logits"]`` or ``return output[0]`` or ``return output.logits``.
        """
        return output_to_logits(output)

    def lpa3_set_augmented(self, augmented: AugmentedBatch | None) -> None:
        """Called by the callback before ``training_step`` with this batch's hard positives."""
        self._lpa3_augmented = augmented

    def lpa3_take_augmented(self) -> AugmentedBatch | None:
        """The hard positives of the current batch (None during warm-up or without callback)."""
        augmented, self._lpa3_augmented = self._lpa3_augmented, None
        return augmented

    def lpa3_record_predictions(self, indices: Tensor, logits: Tensor, targets: Tensor | None = None) -> None:
        """Hand the clean logits of this batch to the callback's time-consistency memory."""
        self._lpa3_predictions = (indices.detach(), logits.detach(), None if targets is None else targets.detach())

    def lpa3_pop_predictions(self) -> tuple[Tensor, Tensor, Tensor | None] | None:
        """Called by the callback after ``training_step``."""
        predictions, self._lpa3_predictions = self._lpa3_predictions, None
        return predictions
