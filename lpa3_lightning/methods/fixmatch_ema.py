"""FixMatch's EMA model: Lightning's ``EMAWeightAveraging`` with the BatchNorm buffers copied."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import EMAWeightAveraging
from lightning.pytorch.trainer.states import TrainerFn

from lpa3_lightning.core.checks import check_flag

__all__ = ["FixMatchEMA"]


class FixMatchEMA(EMAWeightAveraging):
    """An exponential moving average of the parameters from the initial weights on, whose buffers
    (BatchNorm's running statistics) are the live model's, as FixMatch's reference keeps its EMA model
    (kekmodel/FixMatch-pytorch ``models/ema.py``). Validation, the final weights and the checkpoint's
    ``state_dict`` are the average (the raw weights: its ``current_model_state``), so is a checkpoint's test.

    Args:
        decay: the average's decay per update (FixMatch: 0.999).
        copy_buffers: copy the buffers at every update (True, FixMatch's) or average them (False, Lightning's).
        **kwargs: passed to ``EMAWeightAveraging`` (``update_every_n_steps``, ``device``, ...).
    """

    def __init__(self, decay: float = 0.999, copy_buffers: bool = True, **kwargs: Any) -> None:
        check_flag(copy_buffers, "copy_buffers",
                   "use True (FixMatch's reference) or False (Lightning's averaged buffers).")
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
        """Resuming a fit: as Lightning's ``WeightAveraging``. Outside a fit (``trainer.test(ckpt_path=...)``)
        the module keeps the checkpoint's ``state_dict``, the average (Lightning's would load the raw weights
        whenever an average exists, e.g. in a test after the fit in the same process)."""
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
