"""Stage 4 and the epoch's end: what the callback logs (per step, per epoch over all processes)
and the grid of images, their ``x'`` and ``|x' - x|``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from torch.utils.data import default_collate

from lpa3_lightning.callback.augment_stage import Augmenter
from lpa3_lightning.callback.epoch_mean import NanIgnoringMean
from lpa3_lightning.core.augmented import AugmentedBatch
from lpa3_lightning.core.solver_forward import label_logp
from lpa3_lightning.core.visualize import comparison_grid

__all__ = ["BARELY_MOVED", "EPOCH_MEANS", "EpochLog", "log_grid"]

#: Per-epoch diagnostics, each a torchmetrics aggregate synced across processes at epoch end.
EPOCH_MEANS = ("selected_fraction", "tcs_selected_fraction", "skipped_fraction", "reused_fraction",
               "perceptual_distance", "input_distance", "projected", "solver_seconds", "label_preserved",
               "label_preserved_eval")


#: The per-``x'`` quantities: measured where a step has ``x'``, NaN where it has none.
PER_X_PRIME = ("perceptual_distance", "input_distance", "projected", "solver_seconds", "label_preserved",
               "label_preserved_eval")

#: An ``x'`` closer than this to its ``x`` in the model's feature space (each layer's block has
#: norm 1 per sample, so distances run up to ``2 sqrt(layers)``) barely moved.
BARELY_MOVED = 1e-3


class EpochLog:
    """One network's logged statistics (``lpa3/<name>`` or ``lpa3/<network>/<name>``).

    The per-step values and the epoch means are measured on the steps the fit's
    ``logging.every_n_steps`` picks (the Trainer's ``log_every_n_steps`` by default, the steps
    Lightning writes); the counts behind the warnings on every step, on the device.

    Args:
        prefix: the log keys' prefix (``"lpa3/"``, ``"lpa3/net1/"``).
        metric_prefix: the metrics' attribute names' prefix (Lightning keys their state by it).
        names: the per-epoch means this run logs (a subset of :data:`EPOCH_MEANS`).
    """

    def __init__(self, prefix: str, metric_prefix: str, names: tuple[str, ...]) -> None:
        self.prefix, self.metric_prefix = prefix, metric_prefix
        self.means = {name: NanIgnoringMean() for name in names}
        self.nonfinite_inputs = 0  # host counts of this epoch (the selection reads them anyway)
        self._moved: Tensor | None = None  # (solved, barely moved, of those projected) this epoch, on the device
        self._warned_unmeasured = False

    def to(self, device: torch.device) -> None:
        for metric in self.means.values():
            metric.to(device)
        self._moved = torch.zeros(3, dtype=torch.long, device=device)

    def mean(self, module: Any, name: str, value: Tensor | float | None, weight: int) -> None:
        """One measured step's value (NaN on the step where there is none), and the epoch mean.

        Every process logs the epoch aggregate at every measured step, also without a value, so
        the metric's cross-process sync at epoch end meets every process.
        """
        metric = self.means.get(name)
        if metric is None:
            return
        key = f"{self.prefix}{name}"
        if value is not None and weight > 0:
            # a Python number becomes a device tensor by a fill, not a host-to-device copy (a sync)
            value = value.float() if isinstance(value, Tensor) else torch.full((), float(value), device=module.device)
            metric.update(value, weight)
        else:  # a quantity that does not exist in this step: not the last step's value again
            value = torch.full((), float("nan"), device=module.device)
            # an update that adds nothing (NaN at weight 0): the metric counts as updated, so an epoch
            # without any value computes NaN without torchmetrics' "compute before update" warning
            metric.update(value, 0)
        module.log(f"{key}_step", value, on_step=True, on_epoch=False, batch_size=max(weight, 1))
        module.log(f"{key}_epoch", metric, on_step=False, on_epoch=True, metric_attribute=f"{self.metric_prefix}{name}")

    def count_moves(self, augmented: AugmentedBatch) -> None:
        """Every step: how many of the solved ``x'`` barely moved, and how many of those the
        bisection pulled back (device counts, read once an epoch)."""
        stats = augmented.stats
        if stats is None or self._moved is None or not len(stats.preserved):
            return
        barely = ~(stats.perceptual_distance >= BARELY_MOVED)  # (a NaN distance: x' came back as x)
        self._moved += torch.stack([torch.ones_like(barely).sum(), barely.sum(), (barely & stats.projected).sum()])

    def batch(self, module: Any, batch_size: int, augmented: AugmentedBatch | None, tcs_selected: int,
              augmenter: Augmenter) -> None:
        """The statistics of one measured batch's hard positives (None: the step solved nothing)."""
        n = max(batch_size, 1)
        m = 0 if augmented is None else len(augmented)
        self.mean(module, "selected_fraction", m / n, batch_size)
        self.mean(module, "tcs_selected_fraction", tcs_selected / n, batch_size)
        self.mean(module, "skipped_fraction", 0 if augmented is None else augmented.skipped / n, batch_size)
        self.mean(module, "reused_fraction", None if augmented is None else augmented.reused / max(m, 1), m)
        stats = None if augmented is None else augmented.stats
        solved = 0 if stats is None else len(stats.preserved)
        # per-sample statistics: averaged over the solved samples, not the whole batch;
        # tensors, not floats: Lightning accumulates them without a host copy here
        self.mean(module, "perceptual_distance", None if stats is None else stats.perceptual_distance.mean(), solved)
        self.mean(module, "projected", None if stats is None else stats.projected.float().mean(), solved)
        distance = augmenter.input_distance  # of every x' of the batch (solved, reused, or a control's)
        self.mean(module, "input_distance", distance, 0 if distance is None else m)
        seconds = augmenter.solver_seconds  # None when not timed (the sync-free path)
        self.mean(module, "solver_seconds", seconds if solved else None, 1 if solved and seconds is not None else 0)
        kept = augmenter.eval_preserved
        self.mean(module, "label_preserved_eval", None if kept is None else kept.float().mean(),
                  0 if kept is None else len(kept))

    def trained_preservation(self, module: Any, pending: tuple[Tensor, Tensor] | None, sigma: float,
                             temperature: float, untaken: bool) -> None:
        """``lpa3/label_preserved`` on a measured step, from the logits of the forward that trained on x'."""
        logits = module.lpa3_pop_augmented_logits() if hasattr(module, "lpa3_pop_augmented_logits") else None
        kept: Tensor | None = None
        if pending is not None:
            reference, y = pending
            if logits is not None and logits.shape[0] == y.shape[0]:
                logp = label_logp(logits.detach(), y.long(), temperature)
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

    def epoch_end(self, module: Any, nonfinite_predictions: int, threshold: float | None, sigma: float,
                  bn_mode: str | None) -> None:
        """The epoch's counts and threshold; one warning when most of its ``x'`` barely moved."""
        # the prediction counts are of all ranks' gathered rows: equal on every rank, like the threshold
        module.log(f"{self.prefix}nonfinite_predictions", float(nonfinite_predictions), sync_dist=True,
                   reduce_fx="max")
        module.log(f"{self.prefix}nonfinite_inputs", float(self.nonfinite_inputs), sync_dist=True, reduce_fx="sum")
        self.nonfinite_inputs = 0
        if threshold is not None:
            module.log(f"{self.prefix}threshold", threshold, sync_dist=True, reduce_fx="max")
        if self._moved is None:
            return
        solved, barely, projected = (int(v) for v in self._moved.tolist())  # one host read an epoch
        self._moved.zero_()
        if solved and barely > solved / 2:
            rank_zero_warn(
                f"LPA3Callback: {100 * barely / solved:.0f}% of this epoch's {solved} x' barely moved "
                f"(perceptual distance < {BARELY_MOVED:g}{'' if self.prefix == 'lpa3/' else ', ' + self.prefix[5:-1]}); "
                f"{100 * projected / max(barely, 1):.0f}% of those were pulled back to x by the bisection that keeps "
                f"log p(y|x') >= log p(y|x) - sigma. Training gets its clean inputs back. Likely causes: the model's "
                f"log-probability changes by more than sigma={sigma:g} within the smallest move (a saturated or steep "
                f"model), or the solver's BatchNorm normalisation (solver.attack_bn resolved to {bn_mode!r}) is not "
                "the one the model trains with. Fix: raise sigma (e.g. 0.05 or 0.1), check solver.attack_bn ('batch' "
                "for a model without twin BatchNorms), and check input_range against the inputs."
            )


def log_grid(trainer: pl.Trainer, module: Any, augmenter: Augmenter, prefix: str, num_images: int,
             warned: list[bool]) -> Tensor | None:
    """The grid of the first training images, their ``x'`` and ``|x' - x|``, made on every rank
    (its request may forward the module in train mode, a collective under SyncBatchNorm) and
    logged by rank 0; returned (None when nothing could be drawn). ``warned``: a one-item list,
    set once the cannot-log warning was given.

    Drawn only at the end of an epoch that trained ``x'`` (not in the callback's ``warmup_epochs``
    nor where the module's ``lpa3_consumes_augmented`` says no): before, no training step made
    them, and a module's request may not even name the label it will preserve. The difference row
    has one scale for all images, its white value written under the grid with the epoch; each
    column carries its image's perceptual distance (``d``)."""
    from lpa3_lightning.core.visualize import difference_peak

    epoch = trainer.current_epoch
    consumes = getattr(module, "lpa3_consumes_augmented", None)
    if epoch < augmenter.settings.warmup_epochs or (callable(consumes) and not consumes(epoch)):
        return None  # (the same answer on every rank: the ranks agree on it every step)
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
        # the training's normalisation (twins, the batch's own statistics, or eval), on these images
        model, bn_mode = augmenter.attack_model(module, request.inputs)
        if request.inputs.shape[0] < 2:
            bn_mode = "eval"  # (batch statistics need two images)
        x_adv, stats = augmenter.solve(module, model, request.inputs, request.targets,
                                       torch.Generator(device=request.inputs.device).manual_seed(0), bn_mode,
                                       graphs=False)  # a one-off solve: a graph would hold memory for the fit
    input_range = augmenter.settings.input_range
    normalization = input_range if isinstance(input_range, Mapping) else None
    peak = difference_peak(request.inputs, x_adv, normalization)
    distances = [float(d) for d in stats.perceptual_distance.detach().cpu()] if stats is not None else []
    labels = [f"d {d:.2f}" for d in distances] if len(distances) == request.inputs.shape[0] else None
    control = getattr(augmenter.settings, "augment", "lpa3")
    caption = (f"epoch {epoch}: x, x', |x'-x| on one scale: white = {peak:.3g} (pixels in [0, 1]); "
               f"d: perceptual distance" + (f"; the solver's x', this run trains augment={control!r}"
                                            if control != "lpa3" else ""))
    grid = comparison_grid(request.inputs, x_adv, normalization, peak=peak if peak > 0 else None, labels=labels,
                           caption=caption)
    if trainer.is_global_zero:
        if hasattr(logger, "log_image"):
            logger.log_image(key=f"{prefix}examples", images=[grid], step=trainer.global_step)
        else:
            logger.experiment.add_image(f"{prefix}examples (rows: x, x', |x'-x| on one scale, its white written "
                                        "under them)", grid, trainer.global_step)
    return grid
