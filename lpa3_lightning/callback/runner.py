"""One network's LP-A3 state and its per-batch path: request -> selection -> hard positives ->
hand-over -> (training step) -> memory update; and its checkpoint state.

A module with one network has one runner; a module that names several (DivideMix's two) has
one per name, each with its own memory, selection, twin BatchNorms, solver noise and cache. A
runner receives the fit's :class:`~lpa3_lightning.callback.settings.RunSettings`; it never reads
the callback.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from lpa3_lightning.callback.augment_stage import Augmenter, NewRows
from lpa3_lightning.callback.logging_stage import EPOCH_MEANS, EpochLog, log_grid
from lpa3_lightning.callback.request_checks import bad_value_counts, check_request, raise_bad_values
from lpa3_lightning.callback.selection_stage import Selection, finite_rows, select
from lpa3_lightning.callback.settings import RunSettings
from lpa3_lightning.core.augmented import AugmentedBatch, LPA3Request
from lpa3_lightning.core.batch_statistics import resolve_bn_mode
from lpa3_lightning.core.cache import AugmentationCache
from lpa3_lightning.core.distributed import gather_rows
from lpa3_lightning.core.model_outputs import unwrap_compiled
from lpa3_lightning.core.tcs import TimeConsistency
from lpa3_lightning.core.tcs_shards import ShardedTimeConsistency

__all__ = ["NetworkRunner", "Prepared"]


@dataclass
class Prepared:
    """What a runner's local work left for the step's hand-over (after the one reduction).

    Attributes:
        consumes: whether this rank's module trains ``x'`` in this epoch (the ranks must agree).
        error: the exception this rank's local work raised, if any.
        request: the module's request.
        selection: the rows selected (None when nothing was solved).
        augmented: the hard positives handed to the module.
        new_rows: with a cache, the rows solved now (for every rank's copy of the cache).
        nonfinite: rows whose inputs hold NaN or Inf (counted on every step, augmenting or not).
    """

    consumes: bool = False
    error: Exception | None = None
    request: LPA3Request | None = None
    selection: Selection | None = None
    augmented: AugmentedBatch | None = None
    new_rows: NewRows | None = None
    nonfinite: int = 0


class NetworkRunner:
    """The LP-A3 path of one network (``name`` None for a module's only network).

    Read after a fit: :attr:`tcs` (the TCS memory), :attr:`store` (the ``x'`` cache store, with
    ``cache.regenerate_every_n_epochs > 1``), :attr:`solver_graphs` and :attr:`last_grid`.

    Args:
        name: the network's name, or None.
        position: the network's place in the module's ``lpa3_networks()``: offsets its noise
            seed and its first random selection, so that two networks draw independently.
        networks: how many networks the module has: each network's ``x'`` cache keeps to its
            share of ``cache.max_bytes``.
    """

    NETWORK_SEED_STRIDE = 7919  # seed offset between the networks of a module with several

    def __init__(self, name: str | None = None, position: int = 0, networks: int = 1) -> None:
        self.name = name
        self.networks = networks
        self.offset = self.NETWORK_SEED_STRIDE * position
        self.prefix = "lpa3/" if name is None else f"lpa3/{name}/"
        self.metric_prefix = "_lpa3_" if name is None else f"_lpa3_{name}_"
        self.settings: RunSettings | None = None
        self.augmenter: Augmenter | None = None
        self.log: EpochLog | None = None
        self.tcs: TimeConsistency | None = None
        self.store: AugmentationCache | None = None
        self.last_grid: Tensor | None = None
        self.augment_start: int | None = None  # the first epoch that augmented: the cache's windows start there
        self.pending_state: dict[str, Any] | None = None  # a checkpoint's state, applied when the fit starts
        self._coverage_checked = False
        self._measuring = False  # whether this batch's diagnostics are measured (decided at its start)
        self._warned = {"grid": [False], "nonfinite_inputs": False, "nonfinite_predictions": False}
        self._deferred: Exception | None = None  # a hand-over failure, raised at the step's memory exchange
        self._restored_layers: list[str] | None = None  # the feature layers a resumed checkpoint's fit resolved

    @property
    def solver_graphs(self) -> Any:
        """The CUDA graphs of the solver (``runtime.cuda_graphs``; None otherwise)."""
        return None if self.augmenter is None else self.augmenter.graphs

    def _settings(self) -> RunSettings:
        if self.settings is None:
            raise RuntimeError("LPA3Callback's runner has no fit settings: on_train_start did not run for it.")
        return self.settings

    # ------------------------------------------------------------------ the fit
    def start(self, settings: RunSettings, trainer: pl.Trainer, module: Any, num_samples: int,
              num_classes: int) -> None:
        """Allocate (or adopt the restored, or keep the earlier fit's) memory and cache for a fit."""
        self.settings, s = settings, settings
        self.augmenter = Augmenter(settings, self.offset)
        # sync-free: the memory lives beside the model, so selecting and updating read nothing back
        device = module.device if s.sync_free else torch.device("cpu")
        state, self.pending_state = self.pending_state, None
        earlier, fresh = self.tcs, self._new_memory(num_samples, num_classes, device)
        # the feature layers the checkpoint's fit resolved for this `layers` setting: its state keeps
        # naming them until this fit resolves its own (at its first solve; a resume into an epoch's
        # end may have none)
        saved = state.get("settings") if state is not None else None
        same = saved is not None and saved.get("layers_setting", "unknown") == _as_list(s.layers)
        self._restored_layers = saved.get("layers") if same else None
        if state is not None:
            fresh.load_state_dict(state["tcs"])  # refuses a data set of another size
            self.augment_start = state["augment_start"]
        else:
            self.augment_start = None
            if earlier is not None:  # a second fit with the same callback keeps the memory, from epoch 0 again
                fresh = _kept(earlier, fresh)
        self.tcs = fresh
        names = tuple(n for n in EPOCH_MEANS if (n != "reused_fraction" or s.cache.regenerate_every_n_epochs > 1)
                      and (n != "label_preserved_eval" or s.logging.eval_preservation)
                      and (n != "solver_seconds" or not s.sync_free))  # (not timed: that would synchronise)
        self.log = EpochLog(self.prefix, self.metric_prefix, names)
        self.log.to(module.device)
        c = s.cache
        self.store = None
        if c.regenerate_every_n_epochs > 1:
            folder = c.dir or Path(trainer.default_root_dir) / "lpa3_cache"
            # now, by name, not at the first x' written (after the warm-up) as the OS's error
            AugmentationCache.check_directory(folder, "cache.dir" if c.dir else
                                              "cache.dir (None: <trainer.default_root_dir>/lpa3_cache)")
            # max_bytes bounds the whole cache of a process: each network's store keeps to its share
            self.store = AugmentationCache(num_samples, c.regenerate_every_n_epochs, c.max_bytes // self.networks,
                                           folder, device=module.device if c.on_device else "cpu")
            if state is not None and state["cache"] is not None:
                self.store.load_state_dict(state["cache"])

    def _new_memory(self, num_samples: int, num_classes: int, device: torch.device) -> TimeConsistency:
        s = self._settings()
        sel = s.selection
        kwargs = dict(divergence=sel.divergence, initial_memory=sel.initial_memory,
                      initial_selection=sel.initial_selection, seed=s.seed + self.offset,
                      threshold_rule=sel.threshold_rule, device=device, storage_dtype=sel.memory_dtype,
                      criterion=sel.criterion)
        if sel.sharded(num_samples, num_classes, s.world_size):
            return ShardedTimeConsistency(num_samples, num_classes, s.ratio, num_shards=s.world_size, shard=s.rank,
                                          **kwargs)
        return TimeConsistency(num_samples, num_classes, s.ratio, **kwargs)

    def memory(self) -> TimeConsistency:
        if self.tcs is None or self.settings is None:
            raise RuntimeError("LPA3Callback's TCS memory is not allocated: on_train_start did not run for it.")
        return self.tcs

    def teardown(self) -> None:
        if self.store is not None:
            self.store.close()
            self.store.offload()  # the GPU memory is free for what follows the fit
        if self.solver_graphs is not None:
            self.solver_graphs.reset()  # the graphs' memory pool too
        if self.augmenter is not None:
            self.augmenter.pending = None

    # ------------------------------------------------------------------ a batch
    def prepare(self, trainer: pl.Trainer, module: Any, batch: Any, batch_idx: int, consumes: Any) -> Prepared:
        """This rank's part of the batch, no collective: the request and its checks, whether the
        module trains ``x'`` now, and, if so, the selection and the hard positives. Every exception
        is kept for the step's one reduction (a rank must not leave the others in a collective)."""
        s, memory, epoch = self._settings(), self.memory(), trainer.current_epoch
        prepared = Prepared()
        self._measuring = self._measured(trainer, batch_idx)
        self.augmenter.pending = None  # type: ignore[union-attr]
        self.augmenter.batch_key = (epoch, batch_idx)  # type: ignore[union-attr]
        try:
            module.lpa3_set_augmented(None)
            request = prepared.request = module.lpa3_request(batch)
            # sync-free: the values are checked with the selection's one host read below
            check_request(request, memory.num_classes, memory.num_samples, values=not s.sync_free)
            prepared.consumes = epoch >= s.warmup_epochs and bool(consumes(epoch))
            if not prepared.consumes:
                # nothing is selected, but the inputs are counted (and, sync-free, the values checked):
                # the step's one host read
                finite = finite_rows(request)
                counts = [(~finite).sum()]
                if s.sync_free:
                    counts += [c.to(finite.device) for c in bad_value_counts(request, memory.num_samples,
                                                                              memory.num_classes, memory.refused_rows)]
                prepared.nonfinite, *bad = (int(c) for c in torch.stack(counts).tolist())
                if s.sync_free:
                    raise_bad_values(request, memory.num_samples, memory.num_classes, bad)
                self._warn_nonfinite_inputs(request, finite, prepared.nonfinite)
                return prepared
            if self.augment_start is None:
                self.augment_start = epoch
            selection = prepared.selection = select(memory, request, epoch, s.sync_free, memory.refused_rows)
            prepared.nonfinite = selection.nonfinite
            self._warn_nonfinite_inputs(request, selection.finite, selection.nonfinite)
            prepared.augmented, prepared.new_rows = self.augmenter.augment(  # type: ignore[union-attr]
                module, request, selection, self.store, epoch, self._solver_runs(epoch), self._measuring)
        except Exception as exc:  # reaches every rank through the step's one reduction
            prepared.error = exc
        return prepared

    def hand_over(self, trainer: pl.Trainer, module: Any, prepared: Prepared, on_augmented: Any) -> None:
        """After the step's reduction (every rank agreed): the cache's exchange, the hand-over and the logs."""
        self.log.nonfinite_inputs += prepared.nonfinite  # type: ignore[union-attr]
        if not prepared.consumes:
            return
        request, augmented = prepared.request, prepared.augmented
        gathered = None
        if self.store is not None:  # collective under DDP: every rank stores every rank's new x'
            new_rows = prepared.new_rows
            if new_rows is None:
                new_rows = (request.indices[:0], request.inputs[:0].detach(), request.targets[:0])  # type: ignore
            gathered = gather_rows(*new_rows)
        try:
            if gathered is not None:  # (a failed write, a full disk, stops every rank with its reason)
                self.store.put(*gathered, epoch=trainer.current_epoch)
            module.lpa3_set_augmented(augmented)
            on_augmented(trainer, module, augmented)
            log = self.log
            log.count_moves(augmented)  # type: ignore[union-attr,arg-type]
            if self._measuring:
                log.batch(module, request.inputs.shape[0], augmented, prepared.selection.tcs_selected,  # type: ignore
                          self.augmenter)
        except Exception as exc:
            if trainer.world_size <= 1:
                raise
            # Under DDP the other ranks go on into the step (DDP's backward is a collective): this rank
            # does too, and withdraws from the memory's exchange after it, which stops every rank
            self._deferred = exc

    def _warn_nonfinite_inputs(self, request: LPA3Request, finite: Tensor, nonfinite: int) -> None:
        if nonfinite and not self._warned["nonfinite_inputs"]:
            self._warned["nonfinite_inputs"] = True
            bad = request.indices[~finite.to(request.indices.device)][:10].tolist()  # (only when counted)
            rank_zero_warn(
                f"LPA3Callback: {nonfinite} training inputs hold NaN or Inf (dataset indices {bad}"
                f"{', ...' if nonfinite > len(bad) else ''}). They get no x' and their predictions stay out "
                "of the TCS memory, but a loss that trains on them turns the weights to NaN. Fix: clean or drop those "
                "samples in the dataset (this warning is given once a fit; lpa3/nonfinite_inputs counts them)."
            )

    def _measured(self, trainer: pl.Trainer, batch_idx: int) -> bool:
        """Whether a batch's diagnostics are measured: on the steps ``logging.every_n_steps`` picks
        (by default the Trainer's ``log_every_n_steps``: the steps Lightning writes to its logger,
        so a written step value is always this step's), and on every epoch's first batch (so each
        epoch has its means)."""
        every = self._settings().logging.every_n_steps or max(1, int(trainer.log_every_n_steps))
        # Lightning's own rule (its logger connector): the batches that stepped, not optimizer steps,
        # which a module stepping two optimizers a batch counts twice
        stepped = getattr(trainer.fit_loop.epoch_loop, "_batches_that_stepped", trainer.global_step)
        return (int(stepped) + 1) % every == 0 or batch_idx == 0

    def _solver_runs(self, epoch: int) -> bool:
        """Whether the solver runs this epoch for rows without a fresh cached ``x'``."""
        return self.store is None or self._settings().cache.attack_new_selections or self.regeneration_epoch(epoch)

    def regeneration_epoch(self, epoch: int) -> bool:
        """Every K epochs from the first epoch that augments (the callback's warm-up, or the
        module's, ``lpa3_consumes_augmented``); also when nothing from earlier epochs is left to
        reuse (a file cache restarts empty on resume; K or the warm-up changed)."""
        s = self._settings()
        start = s.warmup_epochs if self.augment_start is None else self.augment_start
        if (epoch - start) % s.cache.regenerate_every_n_epochs == 0:
            return True
        return self.store is not None and not self.store.reusable_from_before(epoch)

    def finish(self, trainer: pl.Trainer, module: Any) -> None:
        """After ``training_step``: log how the trained ``x'`` kept their label, then apply every
        process's predictions of this step to the memory (a collective under DDP; a rank whose
        module recorded nothing usable withdraws from it, and every rank stops)."""
        s, memory = self._settings(), self.memory()
        error, self._deferred = self._deferred, None
        try:  # every failure before the exchange withdraws this rank from it: no rank waits there
            predictions = module.lpa3_pop_predictions()
            pending = getattr(module, "lpa3_augmented_pending", None)
            untaken = bool(pending()) if callable(pending) else False  # the module chose not to train on x'
            module.lpa3_set_augmented(None)
            if trainer.current_epoch >= s.warmup_epochs and self._measuring:
                self.log.trained_preservation(module, self.augmenter.pending, s.sigma,  # type: ignore[union-attr]
                                              s.solver.temperature, untaken)
            self.augmenter.pending = None  # type: ignore[union-attr]
            error = error or _recorded_error(module, predictions, memory.num_classes)
        except Exception as exc:
            error = error or exc
        if error is not None:
            memory.update(torch.zeros(0, dtype=torch.long), torch.zeros(0, memory.num_classes), abort=True)
            raise error
        indices, logits, targets = predictions  # type: ignore[misc]
        probs = torch.softmax(logits.float() / s.solver.temperature, dim=1)
        memory.update(indices, probs, targets, epoch=trainer.current_epoch, check_values=not s.sync_free)

    def epoch_end(self, trainer: pl.Trainer, module: Any, pass_over: bool = True) -> None:
        """Refresh the selection threshold when the epoch's pass is over; log the epoch's counts
        (and the grid when due). A fit stopped mid-epoch (``max_steps``, ``trainer.should_stop``)
        ends an epoch whose pass is not over: its threshold stays the last pass's, unlogged."""
        s, memory = self._settings(), self.memory()
        refused, nonfinite = (int(v) for v in torch.stack([memory.refused_rows, memory.nonfinite_rows]).tolist())
        memory.refused_rows.zero_()
        memory.nonfinite_rows.zero_()
        if refused:  # (the sync-free path's recorded indices: refused once an epoch)
            raise_bad_values(None, memory.num_samples, memory.num_classes, (0, 0, refused))
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
            grid = log_grid(trainer, module, self.augmenter, self.prefix, s.logging.num_images,  # type: ignore[arg-type]
                            self._warned["grid"])
            self.last_grid = grid if grid is not None else self.last_grid
        model = unwrap_compiled(module.lpa3_model())
        threshold = float(memory.threshold) if memory.has_threshold and pass_over else None
        self.log.epoch_end(module, nonfinite, threshold,  # type: ignore[union-attr]
                           s.sigma, resolve_bn_mode(model, s.solver.attack_bn))

    def _check_coverage(self) -> None:
        """Once the memory was fed three times its size in rows, warn once when it saw far fewer
        distinct indices than it has rows (``num_samples`` / ``lpa3_num_samples`` larger than the
        set the indices come from): the rows never seen keep their first score. (Three times:
        drawn with replacement, a set of N rows shows 95% of its indices by then.)"""
        memory = self.memory()
        total = memory.num_samples
        if self._coverage_checked or memory.rows_recorded < 3 * total:
            return
        self._coverage_checked = True
        seen = int(memory.seen.sum())  # one host read, once a fit
        if seen < 0.8 * total:
            rank_zero_warn(
                f"LPA3Callback's TCS memory has {total} rows, but {memory.rows_recorded} recorded predictions named "
                f"only {seen} distinct dataset indices: the rows never seen keep their first score. Fix: set "
                "`selection.num_samples` (or the module's `lpa3_num_samples`) to the size of the set the recorded "
                "indices come from."
            )

    # ------------------------------------------------------------------ checkpoint state
    def state_dict(self, assemble: bool) -> dict[str, Any]:
        """The memory (its whole stored predictions, assembled over the processes when split and
        ``assemble``: a collective), the cache, the first augmenting epoch and the solver's settings."""
        if self.tcs is None:
            # never started (a finished run launched again returns before on_train_start): the checkpoint's
            # state goes on whole, not only its memory
            return dict(self.pending_state) if self.pending_state is not None else \
                {"tcs": None, "cache": None, "augment_start": None, "settings": None}
        if isinstance(self.tcs, ShardedTimeConsistency) and not assemble:
            tcs_state = self.tcs.local_state_dict()
        else:
            tcs_state = self.tcs.state_dict()
        include = self.settings is not None and self.settings.cache.in_checkpoint
        return {"tcs": tcs_state, "cache": None if self.store is None else self.store.state_dict(include_inputs=include),
                "augment_start": self.augment_start, "settings": self.solver_settings()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Keep a checkpoint's state; it is applied to the data set and module when the fit starts.
        A state written before any fit started (no memory yet) leaves the fit to start afresh."""
        if state["tcs"] is None:
            self.pending_state = None
            return
        self.pending_state = {"tcs": state["tcs"], "cache": state["cache"], "augment_start": state["augment_start"],
                              "settings": state.get("settings")}

    def solver_settings(self) -> dict[str, Any] | None:
        """The settings the solver ran with, as plain values (saved in checkpoints, so that
        ``lpa3 show`` draws the ``x'`` that training made)."""
        if self.settings is None:
            return None
        s, solver = self.settings, self.settings.solver
        layers = self.augmenter.layer_names if self.augmenter is not None and self.augmenter.layer_names else None
        return {"sigma": s.sigma, "steps": s.steps, "lam": solver.lam, "temperature": solver.temperature,
                "max_step": solver.max_step, "attack_bn": solver.attack_bn, "project": solver.project,
                "fast": solver.fast, "allow_tf32": solver.allow_tf32, "augment": s.augment, "noise_norm": s.noise_norm,
                "layers": _as_list(layers or self._restored_layers or s.layers), "layers_setting": _as_list(s.layers)}


def _as_list(layers: Any) -> list[str] | None:
    return None if layers is None else ([layers] if isinstance(layers, str) else list(layers))


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
        return ValueError(
            f"The recorded logits have shape {tuple(logits.shape)} but lpa3_num_classes is {num_classes}. Fix: set "
            "`self.lpa3_num_classes` to the width of the model's logits."
        )
    if indices.dim() != 1 or indices.shape[0] != logits.shape[0]:
        return ValueError(
            f"The recorded indices have shape {tuple(indices.shape)} for {logits.shape[0]} rows of logits. Fix: pass "
            "`self.lpa3_record_predictions(indices, logits)` one dataset index per logits row."
        )
    return None
