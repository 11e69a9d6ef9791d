"""What the callback logs and says: per step and per epoch over all processes, the grid of images, their
``x'`` and ``|x' - x|``, and the console's account of LP-A3's phase and cost."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.utils.data import default_collate
from torchmetrics import MeanMetric

from lpa3_lightning.core.forward_modes import label_logp
from lpa3_lightning.core.visualize import comparison_grid, difference_peak

__all__ = ["BARELY_MOVED", "ConsoleReport", "EPOCH_MEANS", "EpochLog", "NanIgnoringMean", "log_grid", "measured_step"]

#: Per-epoch diagnostics, each a torchmetrics aggregate synced across processes at epoch end.
EPOCH_MEANS = ("selected_fraction", "tcs_selected_fraction", "skipped_fraction", "reused_fraction",
               "perceptual_distance", "input_distance", "projected", "solver_seconds", "label_preserved",
               "label_preserved_eval")
#: An ``x'`` closer than this to its ``x`` in feature space (each layer's block has norm 1 a sample, so
#: distances run up to ``2 sqrt(layers)``) barely moved.
BARELY_MOVED = 1e-3


def measured_step(trainer: pl.Trainer, every_n_steps: int | None, batch_idx: int) -> bool:
    """Whether a batch's diagnostics are measured: every ``every_n_steps`` (None: the Trainer's
    ``log_every_n_steps``, counted as Lightning's logger counts: batches that stepped) and each epoch's first."""
    every = every_n_steps or max(1, int(trainer.log_every_n_steps))
    stepped = getattr(trainer.fit_loop.epoch_loop, "_batches_that_stepped", trainer.global_step)
    return (int(stepped) + 1) % every == 0 or batch_idx == 0


class NanIgnoringMean(MeanMetric):
    """A weighted :class:`~torchmetrics.MeanMetric` that leaves NaN values out on the device (a NaN value or
    weight gets weight 0), not by a host read as ``nan_strategy="ignore"`` does.

    Example:
        >>> mean = NanIgnoringMean()
        >>> mean.update(torch.tensor([1.0, float("nan"), 3.0]), torch.tensor([1.0, 5.0, 1.0]))
        >>> float(mean.compute())
        2.0
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(nan_strategy="disable", **kwargs)

    def update(self, value: float | Tensor, weight: float | Tensor | None = None) -> None:
        value = value.to(self.device, self.dtype) if isinstance(value, Tensor) else \
            torch.full((), float(value), dtype=self.dtype, device=self.device)
        weight = torch.ones_like(value) if weight is None else weight.to(self.device, self.dtype) \
            if isinstance(weight, Tensor) else torch.full_like(value, float(weight))
        weight = torch.broadcast_to(weight, value.shape)
        bad = torch.isnan(value) | torch.isnan(weight)
        self.mean_value += torch.where(bad, torch.zeros_like(value), value * weight).sum()
        self.weight += torch.where(bad, torch.zeros_like(weight), weight).sum()


class EpochLog:
    """One network's logged statistics (``lpa3/<name>`` or ``lpa3/<network>/<name>``), measured on the steps
    ``logging.every_n_steps`` picks; the counts behind the warnings on every step (one host read of the non-finite count a step)."""

    def __init__(self, prefix: str, settings: Any) -> None:
        self.prefix = prefix
        self.metric_prefix = "_lpa3_" if prefix == "lpa3/" else "_lpa3_" + prefix[5:-1] + "_"
        skip = {"reused_fraction"} if settings.cache.regenerate_every_n_epochs == 1 else set()
        skip |= set() if settings.logging.eval_preservation else {"label_preserved_eval"}
        self.means = {name: NanIgnoringMean() for name in EPOCH_MEANS if name not in skip}
        self.nonfinite_inputs = 0
        self._moved: Tensor | None = None  # (solved, barely moved, of those projected) this epoch, on the device
        self._warned = {"unmeasured": False, "nonfinite": False}

    def to(self, device: torch.device) -> None:
        for metric in self.means.values():
            metric.to(device)
        self._moved = torch.zeros(3, dtype=torch.long, device=device)

    def mean(self, module: Any, name: str, value: Tensor | float | None, weight: int) -> None:
        """One measured step's value (NaN where there is none) and the epoch mean (logged at every measured step
        by every process, so the metric's sync at the epoch's end meets every process)."""
        metric = self.means.get(name)
        if metric is None:
            return
        if value is not None and weight > 0:
            value = value.float() if isinstance(value, Tensor) else torch.full((), float(value), device=module.device)
            metric.update(value, weight)
        else:  # an update that adds nothing: an epoch without any value computes NaN, without a warning
            value = torch.full((), float("nan"), device=module.device)
            metric.update(value, 0)
        module.log(f"{self.prefix}{name}_step", value, on_step=True, on_epoch=False, batch_size=max(weight, 1))
        module.log(f"{self.prefix}{name}_epoch", metric, on_step=False, on_epoch=True,
                   metric_attribute=f"{self.metric_prefix}{name}")

    def count_nonfinite(self, request: Any, finite: Tensor) -> None:
        """Every step: count the rows with NaN or Inf inputs (never attacked), and warn once naming them."""
        bad = int((~finite).sum())
        self.nonfinite_inputs += bad
        if bad and not self._warned["nonfinite"]:
            self._warned["nonfinite"] = True
            named = request.indices[~finite.to(request.indices.device)][:10].tolist()
            rank_zero_warn(
                f"LPA3Callback: {bad} training inputs hold NaN or Inf (dataset indices {named}"
                f"{', ...' if bad > len(named) else ''}). They get no x' and their predictions stay out "
                "of the TCS memory, but a loss that trains on them turns the weights to NaN. Fix: clean or drop those "
                "samples in the dataset (this warning is given once a fit; lpa3/nonfinite_inputs counts them)."
            )

    def count_moves(self, made: Any) -> None:
        """Every step: how many solved ``x'`` barely moved, and how many of those the bisection pulled back."""
        stats = made.stats
        if stats is None or self._moved is None or not len(stats.preserved):
            return
        barely = ~(stats.perceptual_distance >= BARELY_MOVED)  # (a NaN distance: x' came back as x)
        self._moved += torch.stack([torch.ones_like(barely).sum(), barely.sum(), (barely & stats.projected).sum()])

    def batch(self, module: Any, batch_size: int, made: Any, tcs_selected: int) -> None:
        """The statistics of one measured batch's hard positives; an epoch that trains none (``made`` None) logs
        NaN, so that its epoch means exist and compute without torchmetrics' update-less warning."""
        if made is None:
            for name in self.means:
                if name != "label_preserved":  # (logged after the step, by trained_preservation)
                    self.mean(module, name, None, 0)
            return
        n, m = max(batch_size, 1), len(made.augmented)
        self.mean(module, "selected_fraction", m / n, batch_size)
        self.mean(module, "tcs_selected_fraction", tcs_selected / n, batch_size)
        self.mean(module, "skipped_fraction", made.augmented.skipped / n, batch_size)
        cached = made.augmented.from_cache
        self.mean(module, "reused_fraction", None if cached is None else cached.float().mean(), m)
        stats = made.stats
        solved = 0 if stats is None else len(stats.preserved)
        # per-sample statistics: averaged over the solved samples, as tensors (no host copy here)
        self.mean(module, "perceptual_distance", None if stats is None else stats.perceptual_distance.mean(), solved)
        self.mean(module, "projected", None if stats is None else stats.projected.float().mean(), solved)
        self.mean(module, "input_distance", made.input_distance, 0 if made.input_distance is None else m)
        seconds = made.solver_seconds
        self.mean(module, "solver_seconds", seconds, 1 if solved and seconds is not None else 0)
        kept = made.eval_preserved
        self.mean(module, "label_preserved_eval", None if kept is None else kept.float().mean(),
                  0 if kept is None else len(kept))

    def trained_preservation(self, module: Any, made: Any, sigma: float, temperature: float) -> None:
        """``lpa3/label_preserved`` on a measured step, from the logits of the forward that trained on ``x'``."""
        logits = made.forward.logits if made is not None and made.forward is not None else None
        kept: Tensor | None = None
        if made is None:
            pass
        elif made.reference is not None and logits is not None and logits.shape[0] == made.reference.shape[0]:
            logp = label_logp(logits, made.augmented.targets.long(), temperature)
            kept = logp >= made.reference.to(logp.device) - sigma
        elif made.augmented._taken and len(made.augmented) and not self._warned["unmeasured"]:
            self._warned["unmeasured"] = True
            rank_zero_warn(
                f"{type(module).__name__} trained on x' without `self.lpa3_forward_augmented(augmented)`, so "
                "LPA3Callback cannot measure whether x' keeps its label in the forward that trains on it "
                "(lpa3/label_preserved is not logged). Fix: compute the logits of x' with "
                "`self.lpa3_forward_augmented(augmented)`, which also trains them under the normalisation the "
                "solver verified."
            )
        self.mean(module, "label_preserved", None if kept is None else kept.float().mean(), 0 if kept is None else len(kept))

    def epoch_end(self, module: Any, nonfinite_predictions: int, threshold: float | None, sigma: float,
                  bn_mode: str) -> None:
        """The epoch's counts and threshold; one warning when most of its ``x'`` barely moved."""
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
            where = "" if self.prefix == "lpa3/" else ", " + self.prefix[5:-1]
            rank_zero_warn(
                f"LPA3Callback: {100 * barely / solved:.0f}% of this epoch's {solved} x' barely moved (perceptual "
                f"distance < {BARELY_MOVED:g}{where}); {100 * projected / max(barely, 1):.0f}% of those were pulled "
                "back to x by the bisection that keeps log p(y|x') >= log p(y|x) - sigma. Training gets its clean "
                f"inputs back. Likely causes: the model's log-probability changes by more than sigma={sigma:g} within "
                "the smallest move (a saturated or steep model), or the solver's BatchNorm normalisation "
                f"(solver.attack_bn resolved to {bn_mode!r}) is not the one the model trains with. Fix: raise sigma "
                "(e.g. 0.05 or 0.1), check solver.attack_bn ('batch' for a model without twin BatchNorms), and check "
                "input_range against the inputs."
            )


def log_grid(trainer: pl.Trainer, module: Any, runner: Any, num_images: int, warned: list[bool]) -> Tensor | None:
    """The grid of the first training images, their ``x'`` and ``|x' - x|`` (one scale for all, its white value
    and each image's perceptual distance written under it), made on every rank (its request may forward the
    module in train mode, a collective under SyncBatchNorm) and logged by rank 0; None when nothing could be
    drawn, or in an epoch that trains no ``x'`` (the callback's warm-up, or the module's
    ``lpa3_consumes_augmented``). ``warned``: a one-item list, set once the cannot-log warning was given."""
    s, epoch = runner.settings, trainer.current_epoch
    consumes = getattr(module, "lpa3_consumes_augmented", None)
    if epoch < s.warmup_epochs or (callable(consumes) and not consumes(epoch)):
        return None  # (the same answer on every rank)
    dataset = getattr(trainer.train_dataloader, "dataset", None)
    logger = trainer.logger
    # by the logger's class, the same on every rank (a non-zero rank's `experiment` is Lightning's dummy)
    can_log = hasattr(type(logger), "log_image") or isinstance(logger, pl.loggers.TensorBoardLogger)
    if dataset is None or not can_log:
        if not warned[0]:
            rank_zero_warn("LPA3Callback cannot log image grids here (no train dataset, or a logger without images). "
                           "Fix: use TensorBoardLogger (or a logger with `log_image`), or set "
                           "logging.images_every_n_epochs=0.")
            warned[0] = True
        return None
    # the picture must not change the run: a forked global generator, a generator of its own, a request without
    # gradient (a module's request leaves the BatchNorm statistics alone then)
    with torch.random.fork_rng(devices=[]):
        batch = module.transfer_batch_to_device(
            default_collate([dataset[i] for i in range(min(num_images, len(dataset)))]), module.device, 0)
        with torch.no_grad():
            request = module.lpa3_request(batch)
        x = request.inputs
        if x.shape[0] == 0 or x.dim() != 4 or x.shape[1] not in (1, 3):
            return None  # not images: the logged perceptual distance is the picture
        from lpa3_lightning.core.solver import lpa3_attack

        plan = runner.plan
        model = plan.model(module)
        bn_mode = plan.bn_mode if x.shape[0] >= 2 else "eval"  # (batch statistics need two images)
        solver = s.solver
        x_adv, stats = lpa3_attack(model, x, request.targets, sigma=s.sigma, steps=s.steps, lam=solver.lam,
                                   layers=plan.layer_names or s.layers, input_range=s.input_range,
                                   temperature=solver.temperature, project=solver.project, bn_mode=bn_mode,
                                   logits_fn=module.lpa3_logits, fast=solver.fast, max_step=solver.max_step,
                                   allow_tf32=solver.allow_tf32, return_stats=True,
                                   generator=torch.Generator(device=x.device).manual_seed(0))
    normalization = s.input_range if isinstance(s.input_range, Mapping) else None
    peak = difference_peak(x, x_adv, normalization)
    labels = [f"d {float(d):.2f}" for d in stats.perceptual_distance.detach().cpu()]
    caption = (f"epoch {epoch}: x, x', |x'-x| on one scale: white = {peak:.3g} (pixels in [0, 1]); d: perceptual "
               "distance" + (f"; the solver's x', this run trains augment={s.augment!r}" if s.augment != "lpa3" else ""))
    grid = comparison_grid(x, x_adv, normalization, peak=peak if peak > 0 else None, labels=labels, caption=caption)
    if trainer.is_global_zero:
        if hasattr(logger, "log_image"):
            logger.log_image(key=f"{runner.prefix}examples", images=[grid], step=trainer.global_step)
        else:
            logger.experiment.add_image(f"{runner.prefix}examples (rows: x, x', |x'-x| on one scale, its white written "
                                        "under them)", grid, trainer.global_step)
    return grid


class ConsoleReport:
    """One fit's console account of LP-A3: its phase when it changes, the step's ``x'`` and LP-A3's share of the
    step time on the progress bar, a summary at the end. Host seconds (``perf_counter``) around the callback's
    work and around the whole step (on a GPU a kernel may finish after the host moved on)."""

    def __init__(self) -> None:
        self.on: bool | None = None  # the phase of the last epoch (None before the first)
        self.epochs = self.lpa3_epochs = self.x_prime = self.rows = 0
        self.first_lpa3_epoch: int | None = None
        self.step_seconds = self.lpa3_seconds = self._lpa3_step = 0.0
        self._step_start: float | None = None

    def epoch_start(self, epoch: int, on: bool, ratio: float, steps: int) -> None:
        """Count the epoch and say the phase when it changes (and at the fit's first epoch)."""
        self.epochs += 1
        if on:
            self.lpa3_epochs += 1
            self.first_lpa3_epoch = epoch if self.first_lpa3_epoch is None else self.first_lpa3_epoch
        if on == self.on:
            return
        if on:
            rank_zero_info(f"LPA3Callback: epoch {epoch}: LP-A3 starts: each step solves hard positives x' for up to "
                           f"{ratio:.0%} of its rows ({steps} solver steps each), so steps take longer from here "
                           "(the progress bar's lpa3_time is LP-A3's share of the step time, lpa3_x' the step's x').")
        elif self.on is None:
            rank_zero_info(f"LPA3Callback: epoch {epoch}: warm-up, no x' (the TCS memory learns the rows); LP-A3 "
                           "starts after the callback's warmup_epochs and when the module's loss trains x' "
                           "(lpa3_consumes_augmented).")
        else:
            rank_zero_info(f"LPA3Callback: epoch {epoch}: no x' in this epoch (the module's loss trains none).")
        self.on = on

    def step_start(self) -> None:
        self._step_start = time.perf_counter()

    def lpa3_work(self, seconds: float) -> None:
        self._lpa3_step += seconds

    def step_end(self, module: Any, x_prime: int, rows: int) -> None:
        """Count the step; put its ``x'`` and LP-A3's share so far on the bar."""
        if self._step_start is None:
            return
        self.step_seconds += time.perf_counter() - self._step_start
        self.lpa3_seconds += self._lpa3_step
        self._step_start, self._lpa3_step = None, 0.0
        if not self.on:
            return
        self.x_prime, self.rows = self.x_prime + x_prime, self.rows + rows
        share = 100 * self.lpa3_seconds / self.step_seconds if self.step_seconds > 0 else 0.0
        module.log_dict({"lpa3_x'": float(x_prime), "lpa3_time": round(share, 1)}, prog_bar=True, logger=False,
                        on_step=True, on_epoch=False, batch_size=1)

    def summary(self) -> None:
        """The fit's summary (rank 0), once it trained a step."""
        if not self.step_seconds:
            return
        where = f"LP-A3 in {self.lpa3_epochs}" + (f" (from epoch {self.first_lpa3_epoch})" if self.lpa3_epochs else "")
        trained = (f"{self.x_prime:,} x' trained ({self.x_prime / self.rows:.0%} of the {self.rows:,} rows of those "
                   "epochs' steps)") if self.rows else "no x' trained"
        rank_zero_info(f"LPA3Callback: {self.epochs} epochs, {where}; {trained}; LP-A3 took "
                       f"{100 * self.lpa3_seconds / self.step_seconds:.1f}% of the training steps' time "
                       f"({self.lpa3_seconds:.1f} s of {self.step_seconds:.1f} s, host time: the request, selection, "
                       "solver and memory update).")
