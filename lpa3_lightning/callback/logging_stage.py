"""Stage 4 and the epoch's end: what the callback logs (per step, per epoch over all processes)
and the grid of images, their ``x'`` and ``|x' - x|``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from torch.utils.data import default_collate
from torchmetrics import SumMetric

from lpa3_lightning.callback.augment_stage import Augmenter
from lpa3_lightning.callback.epoch_mean import NanIgnoringMean
from lpa3_lightning.core.augmented import AugmentedBatch
from lpa3_lightning.core.model_outputs import unwrap_compiled
from lpa3_lightning.core.visualize import comparison_grid

__all__ = ["EPOCH_MEANS", "EpochLog", "log_grid"]

#: Per-epoch diagnostics, each a torchmetrics aggregate synced across processes at epoch end.
EPOCH_MEANS = ("selected_fraction", "tcs_selected_fraction", "skipped_fraction", "reused_fraction",
               "perceptual_distance", "projected", "solver_seconds", "label_preserved", "label_preserved_eval")


class EpochLog:
    """One network's logged statistics (``lpa3/<name>`` or ``lpa3/<network>/<name>``).

    Args:
        prefix: the log keys' prefix (``"lpa3/"``, ``"lpa3/net1/"``).
        metric_prefix: the metrics' attribute names' prefix (Lightning keys their state by it).
        names: the per-epoch means this run logs (a subset of :data:`EPOCH_MEANS`).
    """

    def __init__(self, prefix: str, metric_prefix: str, names: tuple[str, ...]) -> None:
        self.prefix, self.metric_prefix = prefix, metric_prefix
        self.means = {name: NanIgnoringMean() for name in names}
        self.nonfinite_inputs = SumMetric(nan_strategy="disable")  # host counts: never NaN
        self._warned_unmeasured = False

    def to(self, device: torch.device) -> None:
        for metric in [*self.means.values(), self.nonfinite_inputs]:
            metric.to(device)

    def mean(self, module: Any, name: str, value: Tensor | float | None, weight: int) -> None:
        """Per step on this process (when there is a value), per epoch over all processes.

        Every process logs the epoch aggregate at every step, also without a value, so the
        metric's cross-process sync at epoch end meets every process.
        """
        metric = self.means.get(name)
        if metric is None:
            return
        key = f"{self.prefix}{name}"
        if value is not None and weight > 0:
            # a Python number becomes a device tensor by a fill, not a host-to-device copy (a sync)
            value = value.float() if isinstance(value, Tensor) else torch.full((), float(value), device=module.device)
            metric.update(value, weight)
            module.log(f"{key}_step", value, on_step=True, on_epoch=False, batch_size=weight)
        module.log(f"{key}_epoch", metric, on_step=False, on_epoch=True, metric_attribute=f"{self.metric_prefix}{name}")

    def batch(self, module: Any, batch_size: int, augmented: AugmentedBatch, tcs_selected: int, nonfinite: int,
              augmenter: Augmenter) -> None:
        """The statistics of one batch's hard positives."""
        n = batch_size
        self.mean(module, "selected_fraction", len(augmented) / max(n, 1), n)
        self.mean(module, "tcs_selected_fraction", tcs_selected / max(n, 1), n)
        self.mean(module, "skipped_fraction", augmented.skipped / max(n, 1), n)
        self.nonfinite_inputs.update(torch.full((), float(nonfinite), device=module.device))
        module.log(f"{self.prefix}nonfinite_inputs", self.nonfinite_inputs, on_step=False, on_epoch=True,
                   metric_attribute=f"{self.metric_prefix}nonfinite_inputs")
        self.mean(module, "reused_fraction", augmented.reused / max(len(augmented), 1), len(augmented))
        stats = augmented.stats
        solved = 0 if stats is None else len(stats.preserved)
        # per-sample statistics: averaged over the solved samples, not the whole batch;
        # tensors, not floats: Lightning accumulates them without a host copy here
        self.mean(module, "perceptual_distance", None if stats is None else stats.perceptual_distance.mean(), solved)
        self.mean(module, "projected", None if stats is None else stats.projected.float().mean(), solved)
        seconds = augmenter.solver_seconds  # None on the sync-free path (not timed)
        self.mean(module, "solver_seconds", seconds if solved and seconds is not None else None,
                  1 if solved and seconds is not None else 0)
        kept = augmenter.eval_preserved
        self.mean(module, "label_preserved_eval", None if kept is None else kept.float().mean(),
                  0 if kept is None else len(kept))

    def trained_preservation(self, module: Any, pending: tuple[Tensor, Tensor] | None, sigma: float,
                             temperature: float, untaken: bool) -> None:
        """``lpa3/label_preserved`` from the logits of the forward that trained on x'."""
        logits = module.lpa3_pop_augmented_logits() if hasattr(module, "lpa3_pop_augmented_logits") else None
        kept: Tensor | None = None
        if pending is not None:
            reference, y = pending
            if logits is not None and logits.shape[0] == y.shape[0]:
                logp = F.log_softmax(logits.float() / temperature, dim=1).gather(1, y[:, None].long()).squeeze(1)
                kept = logp >= reference.to(logp.device) - sigma
            elif not untaken and not self._warned_unmeasured:
                rank_zero_warn(
                    f"{type(module).__name__} trained on x' without `self.lpa3_forward_augmented(augmented)`, so "
                    "LPA3Callback cannot measure whether x' keeps its label in the forward that trains on it "
                    "(lpa3/label_preserved is not logged). Fix: compute the logits of x' with "
                    "`self.lpa3_forward_augmented(augmented)`, which also trains them under the normalisation the "
                    "solver verified."
                )
                self._warned_unmeasured = True
        self.mean(module, "label_preserved", None if kept is None else kept.float().mean(), 0 if kept is None else len(kept))

    def epoch_end(self, module: Any, nonfinite_predictions: Tensor | int, threshold: float | None) -> None:
        # the counts are of all ranks' gathered predictions: equal on every rank, like the threshold
        module.log(f"{self.prefix}nonfinite_predictions", float(nonfinite_predictions), sync_dist=True,
                   reduce_fx="max")
        if threshold is not None:
            module.log(f"{self.prefix}threshold", threshold, sync_dist=True, reduce_fx="max")


def log_grid(trainer: pl.Trainer, module: Any, augmenter: Augmenter, prefix: str, num_images: int,
             warned: list[bool]) -> Tensor | None:
    """The grid of the first training images, their ``x'`` and ``|x' - x|``, made on every rank
    (its request may forward the module in train mode, a collective under SyncBatchNorm) and
    logged by rank 0; returned (None when nothing could be drawn). ``warned``: a one-item list,
    set once the cannot-log warning was given."""
    dataset = getattr(trainer.train_dataloader, "dataset", None)
    logger = trainer.logger
    # decided by the logger's class, the same on every rank (a non-zero rank's `experiment` is
    # Lightning's dummy, which answers every attribute: the ranks would disagree on the forward)
    can_log = hasattr(type(logger), "log_image") or isinstance(logger, pl.loggers.TensorBoardLogger)
    if dataset is None or not can_log:
        if not warned[0]:
            rank_zero_warn("LPA3Callback cannot log image grids here (no train dataset, or a logger without "
                           "images). Fix: use TensorBoardLogger (or a logger with `log_image`), or set "
                           "logging.images_every_n_epochs=0.")
            warned[0] = True
        return None
    # The picture must not change the run: its random draws (transforms, solver noise) come from
    # a forked global generator and a generator of its own.
    with torch.random.fork_rng(devices=[]):
        count = min(num_images, len(dataset))
        batch = module.transfer_batch_to_device(default_collate([dataset[i] for i in range(count)]), module.device, 0)
        request = module.lpa3_request(batch)
        if request.inputs.shape[0] == 0 or request.inputs.dim() != 4 or request.inputs.shape[1] not in (1, 3):
            return None  # not images: the logged perceptual distance is the picture
        model = unwrap_compiled(module.lpa3_model())
        x_adv, _ = augmenter.solve(module, model, request.inputs, request.targets,
                                   torch.Generator(device=request.inputs.device).manual_seed(0), "eval",
                                   graphs=False)  # a one-off solve: a graph would hold memory for the fit
    normalization = augmenter.input_range if isinstance(augmenter.input_range, Mapping) else None
    grid = comparison_grid(request.inputs, x_adv, normalization)
    if trainer.is_global_zero:
        if hasattr(logger, "log_image"):
            logger.log_image(key=f"{prefix}examples", images=[grid], step=trainer.global_step)
        else:
            logger.experiment.add_image(f"{prefix}examples (rows: x, x', |x'-x| stretched)", grid, trainer.global_step)
    return grid
