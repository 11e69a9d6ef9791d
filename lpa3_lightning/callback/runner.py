"""One network's LP-A3 state and its per-batch path: request -> selection -> hard positives -> hand-over ->
(training step) -> memory update; and its checkpoint state.

A module with one network has one runner; a module that names several (DivideMix's two) has one per name,
each with its own memory, selection, twins, solver noise and cache. Each stage returns what the next needs:
:meth:`NetworkRunner.prepare` gives a :class:`Prepared`, the step's one reduction (:func:`agree`) agrees on
it over the ranks, :meth:`NetworkRunner.hand_over` hands it to the module and :meth:`NetworkRunner.finish` updates the
memory after the step.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from lpa3_lightning.callback.hard_positives import FitPlan, HardPositives, batch_noise_seed, make_hard_positives
from lpa3_lightning.callback.logging import EpochLog, log_grid
from lpa3_lightning.callback.settings import RunSettings
from lpa3_lightning.core.cache import AugmentationCache
from lpa3_lightning.core.checks import check_class_labels, check_dataset_indices
from lpa3_lightning.core.distributed import gather_rows, max_over_ranks
from lpa3_lightning.core.tcs import TimeConsistency
from lpa3_lightning.core.tcs_shards import ShardedTimeConsistency
from lpa3_lightning.methods.base import LPA3Request

__all__ = ["NetworkRunner", "Prepared", "SelectRule", "agree", "check_request"]

#: The selection rule the runner calls (the callback's overridable :meth:`~lpa3_lightning.LPA3Callback.select`):
#: ``(memory, request, finite rows, epoch) -> (the memory's own (B,) mask, the rows that get an x')``.
SelectRule = Callable[[TimeConsistency, LPA3Request, Tensor, int], tuple[Tensor, Tensor]]


@dataclass
class Prepared:
    """One network's local part of a batch, before the step's one reduction: whether the module trains ``x'``
    this epoch (the ranks must agree), the error this rank met, the request, the TCS-selected count and the
    hard positives (None when nothing was solved)."""

    consumes: bool = False
    error: Exception | None = None
    request: LPA3Request | None = None
    tcs_selected: int = 0
    made: HardPositives | None = None


def _not_a_row_mask(value: Any, n: int, device: torch.device | None = None) -> str | None:
    """None for a bool tensor of shape ``(n,)`` (on ``device`` when given), else what ``value`` is instead."""
    if isinstance(value, Tensor) and value.dtype == torch.bool and value.shape == (n,) and \
            (device is None or value.device == device):
        return None
    if not isinstance(value, Tensor):
        return type(value).__name__
    return f"dtype {value.dtype}, shape {tuple(value.shape)} on {value.device}"


def check_request(request: Any, num_classes: int, num_samples: int) -> None:
    """Refuse a request of the wrong type, shapes or values.

    Raises:
        TypeError, ValueError: naming the field and the fix.
    """
    if not isinstance(request, LPA3Request):
        raise TypeError(f"`lpa3_request` must return an LPA3Request, got {type(request).__name__}. Fix: return "
                        "LPA3Request(inputs=x, targets=y, indices=idx).")
    inputs = request.inputs
    if not isinstance(inputs, Tensor) or not inputs.is_floating_point() or inputs.dim() < 2:
        what = f"dtype {inputs.dtype} and shape {tuple(inputs.shape)}" if isinstance(inputs, Tensor) else \
            type(inputs).__name__
        raise ValueError(f"LPA3Request.inputs must be a floating tensor of shape (N, ...) with at least 2 dims, got "
                         f"{what}. Fix: return the batch's inputs as the network takes them (x.float() for integer "
                         "data; x[:, None] for one feature a row).")
    n = inputs.shape[0]
    if request.targets.shape != (n,) or request.indices.shape != (n,):
        raise ValueError(
            f"LPA3Request needs targets and indices of shape ({n},) for {n} inputs, got "
            f"{tuple(request.targets.shape)} and {tuple(request.indices.shape)}. Fix: return one label and one "
            "dataset index per sample."
        )
    check_dataset_indices(request.indices, num_samples, name="LPA3Request.indices")
    what = None if request.train_mask is None else _not_a_row_mask(request.train_mask, n)
    if what is not None:
        raise ValueError(f"LPA3Request.train_mask must be a bool tensor of shape ({n},) (one flag per input), got "
                         f"{what}. Fix: pass e.g. `confidence >= threshold`, or None to solve every selected row.")
    check_class_labels(request.targets, num_classes, name="LPA3Request.targets")


def check_selection(by_memory: Any, mask: Any, n: int, device: torch.device) -> None:
    """Refuse what a ``select`` rule (an override's too) returned unless both are ``(n,)`` bool tensors on the
    inputs' device.

    Raises:
        ValueError: naming the value and the fix.
    """
    for name, value in (("the memory's mask", by_memory), ("the rows to solve", mask)):
        what = _not_a_row_mask(value, n, device)
        if what is not None:
            raise ValueError(f"LPA3Callback.select returned {name} as {what}; it must be a bool tensor of shape "
                             f"({n},) on {device}. Fix: return (by_memory, mask) as bool masks over the request's rows.")


def agree(trainer: pl.Trainer, pl_module: pl.LightningModule, prepared: list[Prepared],
          networks: list[str | None]) -> None:
    """The step's one reduction: every rank's failure and every network's consumes answer.

    Raises:
        The rank's own error; RuntimeError when another rank failed; ValueError when the
        ranks answered ``lpa3_consumes_augmented`` differently.
    """
    flags = [float(any(p.error is not None for p in prepared))]
    for p in prepared:
        flags += [float(p.consumes), float(not p.consumes)]
    if trainer.world_size > 1:
        flags = max_over_ranks(flags)
    own = next((p.error for p in prepared if p.error is not None), None)
    if own is not None:
        raise own
    if flags[0] > 0:
        raise RuntimeError("LPA3Callback stopped because another process failed in this step; that process's log "
                           "has the reason and the fix.")
    for k, name in enumerate(networks):
        if flags[1 + 2 * k] > 0 and flags[2 + 2 * k] > 0:
            network = "" if name is None else f" (network {name!r})"
            raise ValueError(
                f"{type(pl_module).__name__}.lpa3_consumes_augmented({trainer.current_epoch}){network} answered "
                "True on some processes and False on others. It decides whether the step solves x' (and joins "
                "the x' cache's exchange), so it must answer the same on every rank. Fix: decide from the epoch "
                "(or another value every rank shares), not from the rank or the batch."
            )


class NetworkRunner:
    """The LP-A3 path of one network (``name`` None for a module's only one).

    Read after a fit (or in ``on_augmented``): :attr:`tcs` (the TCS memory), :attr:`store` (the ``x'`` cache,
    with ``cache.regenerate_every_n_epochs > 1``), :attr:`last_grid`, :attr:`last` (the last batch's
    :class:`~lpa3_lightning.callback.hard_positives.HardPositives`: its ``stats`` are the solver's diagnostics).

    Args:
        name: the network's name, or None.
        position: its place in ``lpa3_networks()``: offsets its noise seed and first random selection.
        networks: how many networks the module has (each network's cache keeps to its share of ``max_bytes``).
    """

    NETWORK_SEED_STRIDE = 7919  # seed offset between the networks of a module with several

    def __init__(self, name: str | None = None, position: int = 0, networks: int = 1) -> None:
        self.name, self.networks = name, networks
        self.offset = self.NETWORK_SEED_STRIDE * position
        self.prefix = "lpa3/" if name is None else f"lpa3/{name}/"
        self.settings: RunSettings | None = None
        self.plan: FitPlan | None = None
        self.log: EpochLog | None = None
        self.tcs: TimeConsistency | None = None
        self.store: AugmentationCache | None = None
        self.last_grid: Tensor | None = None
        self.last: HardPositives | None = None  # the last batch's hard positives, the solver's diagnostics included
        self.augment_start: int | None = None  # the first epoch that augmented: the cache's windows start there
        self.pending_state: dict[str, Any] | None = None  # a checkpoint's state, applied when the fit starts
        self._restored_layers: list[str] | None = None  # the layers a resumed checkpoint's fit resolved
        self._coverage_checked = False
        self._warned = {"grid": [False], "nonfinite_inputs": False, "nonfinite_predictions": False}
        self._step: tuple[Prepared, bool] | None = None  # this step's hand-over and whether it is measured
        self._generator: torch.Generator | None = None

    # ------------------------------------------------------------------ the fit
    def start(self, settings: RunSettings, trainer: pl.Trainer, module: Any, num_samples: int,
              num_classes: int) -> None:
        """Allocate (or adopt the restored, or keep the earlier fit's) memory and cache for a fit."""
        self.settings, s = settings, settings
        self.plan = FitPlan(settings)
        state, self.pending_state = self.pending_state, None
        sel = s.selection
        options = dict(divergence=sel.divergence, initial_memory=sel.initial_memory, criterion=sel.criterion,
                       initial_selection=sel.initial_selection, seed=s.seed + self.offset,
                       threshold_rule=sel.threshold_rule, storage_dtype=sel.memory_dtype)
        if sel.sharded(num_samples, num_classes, s.world_size):
            fresh: TimeConsistency = ShardedTimeConsistency(num_samples, num_classes, s.ratio, num_shards=s.world_size,
                                                            shard=s.rank, **options)
        else:
            fresh = TimeConsistency(num_samples, num_classes, s.ratio, **options)
        saved = state.get("settings") if state is not None else None
        layers = [s.layers] if isinstance(s.layers, str) else None if s.layers is None else list(s.layers)
        # the feature layers the checkpoint's fit resolved for this `layers` setting, until this fit resolves its own
        same = saved is not None and saved.get("layers_setting", "unknown") == layers
        self._restored_layers = saved.get("layers") if same else None
        if state is not None:
            fresh.load_state_dict(state["tcs"])  # refuses a data set of another size
            self.augment_start = state["augment_start"]
        else:
            self.augment_start = None
            if self.tcs is not None:  # a second fit with the same callback keeps the memory, from epoch 0 again
                fresh = _kept(self.tcs, fresh)
        self.tcs = fresh
        self.log = EpochLog(self.prefix, s)
        self.log.to(module.device)
        self.store = None
        c = s.cache
        if c.regenerate_every_n_epochs > 1:
            folder = c.dir or Path(trainer.default_root_dir) / "lpa3_cache"
            AugmentationCache.check_directory(folder, "cache.dir" if c.dir else
                                              "cache.dir (None: <trainer.default_root_dir>/lpa3_cache)")
            self.store = AugmentationCache(num_samples, c.regenerate_every_n_epochs, c.max_bytes // self.networks,
                                           folder, device=module.device if c.on_device else "cpu")
            if state is not None and state["cache"] is not None:
                self.store.load_state_dict(state["cache"])

    def memory(self) -> TimeConsistency:
        if self.tcs is None or self.settings is None:
            raise RuntimeError("LPA3Callback's TCS memory is not allocated: on_train_start did not run for it. Fix: add the "
                               "callback to the Trainer that fits, not to a loop of your own.")
        return self.tcs

    def teardown(self) -> None:
        if self.store is not None:
            self.store.close()
            self.store.offload()  # the GPU memory is free for what follows the fit
        self._step = None
        if self.last is not None:  # its diagnostics stay readable; the verified forward (the model, the clean
            self.last.forward = self.last.augmented.verified = None  # batch) is let go


    # ------------------------------------------------------------------ a batch
    def prepare(self, trainer: pl.Trainer, module: Any, batch: Any, batch_idx: int, consumes: bool,
                select: SelectRule, measure: bool) -> Prepared:
        """This rank's part of the batch, no collective: the request and its checks and, when the module trains
        ``x'`` this epoch, the selection and the hard positives. Every exception is kept for the step's one
        reduction (a rank must not leave the others in a collective)."""
        s, memory, epoch = self.settings, self.memory(), trainer.current_epoch
        prepared = Prepared()
        try:
            request = prepared.request = module.lpa3_request(batch)
            check_request(request, memory.num_classes, memory.num_samples)
            finite = torch.isfinite(request.inputs.flatten(1)).all(dim=1) if request.inputs.numel() else \
                torch.ones(request.inputs.shape[0], dtype=torch.bool, device=request.inputs.device)
            self.log.count_nonfinite(request, finite)  # type: ignore[union-attr]
            prepared.consumes = epoch >= s.warmup_epochs and bool(consumes)  # type: ignore[union-attr]
            if not prepared.consumes:
                return prepared
            if self.augment_start is None:
                self.augment_start = epoch
            by_memory, mask = select(memory, request, finite, epoch)
            check_selection(by_memory, mask, request.inputs.shape[0], request.inputs.device)
            prepared.tcs_selected = int(by_memory.sum())
            prepared.made = make_hard_positives(self.plan, s, module, request, mask, int(mask.sum()),  # type: ignore
                                                self.store, epoch, self._solver_runs(epoch), measure,
                                                self._generator_for(request.inputs, epoch, batch_idx), finite)
        except Exception as exc:  # reaches every rank through the step's one reduction
            prepared.error = exc
        return prepared

    def hand_over(self, trainer: pl.Trainer, module: Any, prepared: Prepared, measure: bool,
                  on_augmented: Any) -> None:
        """After the step's reduction (every rank agreed): the cache's exchange, the one hand-over, the logs."""
        self._step = (prepared, measure)
        made = self.last = prepared.made
        if made is not None and self.store is not None:  # a collective: every rank stores every rank's new x'
            self.store.put(*gather_rows(*made.new_rows), epoch=trainer.current_epoch)  # type: ignore[misc]
        module.lpa3_set_augmented(None if made is None else made.augmented)
        if made is not None:
            on_augmented(trainer, module, made.augmented)
            self.log.count_moves(made)  # type: ignore[union-attr]
        if measure:  # (without x' too: the same logged keys on every rank and epoch)
            self.log.batch(module, prepared.request.inputs.shape[0], made, prepared.tcs_selected)  # type: ignore

    def _solver_runs(self, epoch: int) -> bool:
        """Whether the solver runs this epoch for rows without a fresh cached ``x'``."""
        return self.store is None or self.settings.cache.attack_new_selections or self.regeneration_epoch(epoch)

    def regeneration_epoch(self, epoch: int) -> bool:
        """Every K epochs from the first epoch that augments (the callback's warm-up, or the module's); also when
        nothing from earlier epochs is left to reuse (a file cache restarts empty on resume; K or the warm-up
        changed)."""
        s = self.settings
        start = s.warmup_epochs if self.augment_start is None else self.augment_start
        if (epoch - start) % s.cache.regenerate_every_n_epochs == 0:
            return True
        return self.store is not None and not self.store.reusable_from_before(epoch)

    def _generator_for(self, x: Tensor, epoch: int, batch_idx: int) -> torch.Generator:
        """The solver's generator for this batch, seeded by (seed, rank, epoch, batch index)."""
        if self._generator is None or self._generator.device != x.device:
            self._generator = torch.Generator(device=x.device)
        s = self.settings
        return self._generator.manual_seed(batch_noise_seed(s.seed + self.offset, s.rank, epoch, batch_idx))

    def finish(self, trainer: pl.Trainer, module: Any, deferred: Exception | None = None) -> None:
        """After ``training_step``: log how the trained ``x'`` kept their label, then apply every process's
        predictions of this step to the memory (a collective under DDP; a rank whose module recorded nothing
        usable withdraws from it, and every rank stops)."""
        s, memory = self.settings, self.memory()
        error = deferred
        try:  # every failure before the exchange withdraws this rank from it: no rank waits there
            predictions = module.lpa3_pop_predictions()
            step, self._step = self._step, None
            if step is not None and step[1]:
                self.log.trained_preservation(module, step[0].made, s.sigma, s.solver.temperature)  # type: ignore
            error = error or _recorded_error(module, predictions, memory.num_classes)
        except Exception as exc:
            error = error or exc
        if error is not None:
            memory.update(torch.zeros(0, dtype=torch.long), torch.zeros(0, memory.num_classes), abort=True)
            raise error
        indices, logits, targets = predictions  # type: ignore[misc]
        memory.update(indices, torch.softmax(logits.float() / s.solver.temperature, dim=1), targets,
                      epoch=trainer.current_epoch)

    def epoch_end(self, trainer: pl.Trainer, module: Any, pass_over: bool = True) -> None:
        """Refresh the threshold when the epoch's pass is over; log the epoch's counts (and the grid when due). A
        fit stopped mid-epoch (``max_steps``, ``should_stop``) keeps the last pass's threshold, unlogged."""
        s, memory = self.settings, self.memory()
        nonfinite = int(memory.nonfinite_rows)
        memory.nonfinite_rows.zero_()
        if nonfinite and not self._warned["nonfinite_predictions"]:
            self._warned["nonfinite_predictions"] = True
            rank_zero_warn(
                f"LPA3Callback: {nonfinite} recorded predictions this epoch were NaN or Inf: they stay out of the TCS "
                "memory, but the model that made them may have diverged (NaN weights or inputs). Fix: check the loss "
                "and the inputs (lpa3/nonfinite_inputs), lower the learning rate (this warning is given once a fit)."
            )
        self._check_coverage()
        if pass_over:
            memory.refresh_threshold()
        every = s.logging.images_every_n_epochs
        if every and trainer.current_epoch % every == 0:
            grid = log_grid(trainer, module, self, s.logging.num_images, self._warned["grid"])
            self.last_grid = grid if grid is not None else self.last_grid
        threshold = float(memory.threshold) if memory.has_threshold and pass_over else None
        self.log.epoch_end(module, nonfinite, threshold, s.sigma, self.plan.bn_mode)  # type: ignore[union-attr]

    def _check_coverage(self) -> None:
        """Once the memory was fed three times its size in rows, warn once when it saw far fewer distinct indices
        than it has rows (``num_samples`` larger than the set the indices come from; drawn with replacement, a
        set of N rows shows 95% of its indices by then)."""
        memory = self.memory()
        if self._coverage_checked or memory.rows_recorded < 3 * memory.num_samples:
            return
        self._coverage_checked = True
        seen = int(memory.seen.sum())
        if seen < 0.8 * memory.num_samples:
            rank_zero_warn(
                f"LPA3Callback's TCS memory has {memory.num_samples} rows, but {memory.rows_recorded} recorded "
                f"predictions named only {seen} distinct dataset indices: the rows never seen keep their first score. "
                "Fix: set `selection.num_samples` (or the module's `lpa3_num_samples`) to the size of the set the "
                "recorded indices come from."
            )

    # ------------------------------------------------------------------ checkpoint state
    def state_dict(self, assemble: bool) -> dict[str, Any]:
        """The memory (whole: assembled over the processes when split and ``assemble``, a collective), the cache,
        the first augmenting epoch and the solver's settings; a state never applied (a finished run launched
        again returns before ``on_train_start``) goes on whole."""
        if self.tcs is None:
            return dict(self.pending_state) if self.pending_state is not None else \
                {"tcs": None, "cache": None, "augment_start": None, "settings": None}
        tcs_state = self.tcs.local_state_dict() if isinstance(self.tcs, ShardedTimeConsistency) and not assemble \
            else self.tcs.state_dict()
        include = self.settings is not None and self.settings.cache.in_checkpoint
        return {"tcs": tcs_state, "cache": None if self.store is None else self.store.state_dict(include_inputs=include),
                "augment_start": self.augment_start, "settings": self.solver_settings()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Keep a checkpoint's state, applied when the fit starts (a state written before any fit started leaves
        the fit to start afresh)."""
        self.pending_state = None if state["tcs"] is None else \
            {"tcs": state["tcs"], "cache": state["cache"], "augment_start": state["augment_start"],
             "settings": state.get("settings")}

    def solver_settings(self) -> dict[str, Any] | None:
        """The settings the solver ran with, as plain values (in checkpoints, so that ``lpa3 show`` draws the
        ``x'`` training made)."""
        if self.settings is None:
            return None
        s, solver = self.settings, self.settings.solver
        layers = [s.layers] if isinstance(s.layers, str) else None if s.layers is None else list(s.layers)
        resolved = self.plan.layer_names if self.plan is not None and self.plan.layer_names else None
        return {"sigma": s.sigma, "steps": s.steps, "lam": solver.lam, "temperature": solver.temperature,
                "max_step": solver.max_step, "attack_bn": solver.attack_bn, "project": solver.project,
                "fast": solver.fast, "allow_tf32": solver.allow_tf32, "augment": s.augment, "noise_norm": s.noise_norm,
                "layers": list(resolved or self._restored_layers or layers or []) or None, "layers_setting": layers}


def _kept(earlier: TimeConsistency, fresh: TimeConsistency) -> TimeConsistency:
    """An earlier fit's memory carried into a new fit (which counts its epochs from 0 again).

    Raises:
        ValueError: when the layout or the world size changed under a split memory.
    """
    if isinstance(earlier, ShardedTimeConsistency) or isinstance(fresh, ShardedTimeConsistency):
        if type(earlier) is not type(fresh) or earlier.num_samples != fresh.num_samples \
                or getattr(earlier, "num_shards", 1) != getattr(fresh, "num_shards", 1):
            raise ValueError(
                "An earlier fit left this callback a TCS memory laid out another way (selection.memory_layout or the "
                "world size changed). Fix: save a checkpoint and resume from it (a checkpoint holds the whole memory "
                "and loads into any layout and world size), or keep the layout and the world size."
            )
        kept = earlier
    else:
        fresh.load_state_dict(earlier.state_dict())
        kept = fresh
    kept.last_update_epoch.fill_(-1)
    return kept


def _recorded_error(module: Any, predictions: Any, num_classes: int) -> Exception | None:
    """What is wrong with the predictions ``training_step`` recorded, or None."""
    if predictions is None:
        return RuntimeError(
            f"{type(module).__name__}.training_step did not record its predictions. Fix: call "
            "`self.lpa3_record_predictions(indices, logits)` with the clean logits (the TCS memory needs them)."
        )
    indices, logits, _ = predictions
    if logits.dim() != 2 or logits.shape[1] != num_classes:
        return ValueError(f"The recorded logits have shape {tuple(logits.shape)} but lpa3_num_classes is {num_classes}. "
                          "Fix: set `self.lpa3_num_classes` to the width of the model's logits.")
    if indices.dim() != 1 or indices.shape[0] != logits.shape[0]:
        return ValueError(f"The recorded indices have shape {tuple(indices.shape)} for {logits.shape[0]} rows of "
                          "logits. Fix: pass `self.lpa3_record_predictions(indices, logits)` one dataset index per row.")
    return None
