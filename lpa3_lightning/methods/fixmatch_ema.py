"""FixMatch's EMA model: Lightning's ``EMAWeightAveraging`` with the BatchNorm buffers copied."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import EMAWeightAveraging
from lightning.pytorch.trainer.states import TrainerFn

__all__ = ["FixMatchEMA"]


class FixMatchEMA(EMAWeightAveraging):
    """An exponential moving average of the parameters whose buffers (BatchNorm's running
    statistics) are the live model's, copied at every update, as FixMatch's reference keeps its
    EMA model (kekmodel/FixMatch-pytorch ``models/ema.py``: parameters averaged from the initial
    weights on, buffers copied; the LP-A3 authors' copy is the same).

    Lightning's ``EMAWeightAveraging`` averages the buffers too by default (``use_buffers=True``);
    with ``use_buffers=False`` it leaves them as they were when the average was created. Pass
    ``copy_buffers=False`` here for Lightning's averaging. Validation, the final weights of a fit and
    the checkpoint's ``state_dict`` are the average (the raw weights are its ``current_model_state``),
    and a test of a checkpoint tests the average, in the process that trained it as in a new one
    (``lpa3 fit --test_after_fit`` and ``lpa3 test`` print the same accuracy).

    Args:
        decay: the average's decay per update (FixMatch: 0.999).
        copy_buffers: copy the buffers at every update (True, FixMatch's reference) or average
            them (False, Lightning's default).
        **kwargs: passed to ``EMAWeightAveraging`` (``update_every_n_steps``, ``device``, ...).

    Example::

        trainer = Trainer(callbacks=[LPA3Callback(ratio=0.9, sigma=0.002), FixMatchEMA(decay=0.999)])
    """

    def __init__(self, decay: float = 0.999, copy_buffers: bool = True, **kwargs: Any) -> None:
        if not isinstance(copy_buffers, bool):
            raise ValueError(f"`copy_buffers` must be True or False, got {copy_buffers!r}. Fix: use True "
                             "(FixMatch's reference) or False (Lightning's averaged buffers).")
        if "use_buffers" in kwargs:
            raise ValueError("FixMatchEMA sets `use_buffers` from `copy_buffers`. Fix: pass copy_buffers=True (copy) "
                             "or False (average), not use_buffers.")
        super().__init__(decay=decay, use_buffers=not copy_buffers, **kwargs)
        self.copy_buffers = copy_buffers

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if stage == "fit" and self._average_model is not None:
            # the reference's average starts at the initial weights and decays from the first step;
            # AveragedModel would copy the weights of the first step instead (a resume restores the
            # checkpoint's count over this)
            self._average_model.n_averaged.fill_(1)

    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
        """Resuming a fit: the average and the live weights come back as Lightning's ``WeightAveraging``
        restores them. Outside a fit (``trainer.test(ckpt_path=...)``, also after a fit in the same process)
        the module keeps the checkpoint's ``state_dict``, the average: Lightning's would load the raw weights
        (``current_model_state``) whenever an average exists, so a test after the fit ran on other weights than
        the same test in a new process."""
        if trainer.state.fn == TrainerFn.FITTING:
            super().on_load_checkpoint(trainer, pl_module, checkpoint)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        updated_before = self._latest_update_step
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if self._latest_update_step != updated_before:
            self._copy_buffers(pl_module)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        updated_before = self._latest_update_epoch
        super().on_train_epoch_end(trainer, pl_module)
        if self._latest_update_epoch != updated_before:
            self._copy_buffers(pl_module)

    @torch.no_grad()
    def _copy_buffers(self, pl_module: pl.LightningModule) -> None:
        if not self.copy_buffers or self._average_model is None:
            return
        for average, live in zip(self._average_model.module.buffers(), pl_module.buffers()):
            average.copy_(live)
