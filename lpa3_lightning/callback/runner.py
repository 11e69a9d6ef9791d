"""One network's LP-A3 state and its per-batch path: request -> selection -> hard positives ->
hand-over -> (training step) -> memory update; and its checkpoint state.

A module with one network has one runner; a module that names several (DivideMix's two) has
one per name, each with its own memory, selection, twin BatchNorms, solver noise and cache.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor

from lpa3_lightning.callback.augment_stage import Augmenter, NewRows
from lpa3_lightning.callback.logging_stage import EPOCH_MEANS, EpochLog, log_grid
from lpa3_lightning.callback.memory_stage import MemoryFeed
from lpa3_lightning.callback.request_checks import bad_value_counts, check_request, raise_bad_values, raise_together
from lpa3_lightning.callback.selection_stage import select
from lpa3_lightning.core.cache import AugmentationCache
from lpa3_lightning.core.distributed import gather_rows
from lpa3_lightning.core.input_box import InputRange
from lpa3_lightning.core.tcs import TimeConsistency
from lpa3_lightning.core.tcs_shards import ShardedTimeConsistency

__all__ = ["NetworkRunner"]


class NetworkRunner:
    """The LP-A3 path of one network (``name`` None for a module's only network).

    Args:
        callback: the :class:`~lpa3_lightning.LPA3Callback` whose settings it runs.
        name: the network's name, or None.
        position: the network's place in the module's ``lpa3_networks()``: offsets its noise
            seed and its first random selection, so that two networks draw independently.
    """

    NETWORK_SEED_STRIDE = 7919  # seed offset between the networks of a module with several

    def __init__(self, callback: Any, name: str | None = None, position: int = 0) -> None:
        self.callback, self.name = callback, name
        self.offset = self.NETWORK_SEED_STRIDE * position
        self.prefix = "lpa3/" if name is None else f"lpa3/{name}/"
        self.metric_prefix = "_lpa3_" if name is None else f"_lpa3_{name}_"
        self.augmenter = Augmenter(callback, self.offset)
        self.log = self._epoch_log()
        self.tcs: TimeConsistency | None = None
        self.cache: AugmentationCache | None = None
        self.feed: MemoryFeed | None = None
        self.last_grid: Tensor | None = None
        self.sync_free = False
        self.augment_start: int | None = None  # the first epoch that augmented: the cache's windows start there
        self._last_update_epoch = torch.zeros(0, dtype=torch.long)  # restored from a checkpoint until a fit starts
        self._restored = False  # load_state_dict ran since the last fit started (a resume)
        self._warned_grid = [False]

    @property
    def restored(self) -> bool:
        """Whether a checkpoint's state was loaded since the last fit started."""
        return self._restored

    @property
    def tcs_seed(self) -> int:
        """The seed of the first random selection (offset per network, also without a seed)."""
        seed = self.callback.seed
        return seed + self.offset if seed is not None else self.offset

    def _epoch_log(self) -> EpochLog:
        cb = self.callback
        names = tuple(n for n in EPOCH_MEANS if (n != "reused_fraction" or cb.cache_settings.regenerate_every_n_epochs > 1)
                      and (n != "label_preserved_eval" or cb.logging.eval_preservation))
        return EpochLog(self.prefix, self.metric_prefix, names)

    @property
    def solver_graphs(self) -> Any:
        return self.augmenter.graphs

    def memory(self) -> TimeConsistency:
        if self.tcs is None:
            raise RuntimeError("LPA3Callback's TCS memory is not allocated: on_train_start did not run for it.")
        return self.tcs

    # ------------------------------------------------------------------ the fit
    def start(self, trainer: pl.Trainer, module: Any, num_samples: int, num_classes: int, input_range: InputRange
              ) -> None:
        """Allocate (or adopt the restored) memory and cache for a fit on ``module``'s device."""
        cb = self.callback
        sync_free = cb.runtime.sync_free
        self.sync_free = module.device.type != "cpu" if sync_free == "auto" else bool(sync_free)
        if cb.runtime.cuda_graphs and not self.sync_free:
            raise ValueError("`runtime.cuda_graphs=True` needs the sync-free path, which sync_free='auto' runs on an "
                             "accelerator only and this module is on the CPU. Fix: runtime.sync_free=True, or "
                             "cuda_graphs=False.")
        self.augmenter.start_fit(trainer.global_rank, self.sync_free, cb.runtime.cuda_graphs, input_range)
        # sync-free: the memory lives beside the model, so selecting and updating read nothing back
        device = module.device if self.sync_free else torch.device("cpu")
        fresh = self._new_memory(num_samples, num_classes, device, (trainer.world_size, trainer.global_rank))
        if self.tcs is not None:  # restored from a checkpoint (or kept from an earlier fit)
            fresh.adopt(self.tcs)  # refuses a data set of another size
        self.tcs = fresh
        if not self._restored:
            self.augment_start = None
        last = self.feed.last_update_epoch if self.feed is not None else self._last_update_epoch
        if last.numel() != num_samples or not self._restored:
            # A new fit counts epochs from 0 again: the record of the last one must not make it
            # skip the updates of its first epochs. Only a resume continues the record.
            last = torch.full((num_samples,), -1, dtype=torch.long)
        self.feed = MemoryFeed(fresh, self.sync_free, last.to(device))
        self.log = self._epoch_log()  # (the settings may have changed since an earlier fit)
        if self.sync_free:
            self.log.means.pop("solver_seconds", None)  # not timed: that would synchronise
        self.log.to(module.device)
        c = cb.cache_settings
        if c.regenerate_every_n_epochs > 1:
            cache = AugmentationCache(num_samples, c.regenerate_every_n_epochs, c.max_bytes,
                                      c.dir or Path(trainer.default_root_dir) / "lpa3_cache",
                                      device=module.device if c.on_device else "cpu")
            if self.cache is not None and self._restored:  # an earlier fit's x' are not reused
                cache.load_state_dict(self.cache.state_dict(include_inputs=True))
            self.cache = cache
        self._restored = False

    def teardown(self) -> None:
        if self.cache is not None:
            self.cache.close()
            self.cache.offload()  # the GPU memory is free for what follows the fit
        if self.augmenter.graphs is not None:
            self.augmenter.graphs.reset()  # the graphs' memory pool too
        self.augmenter.pending = None

    # ------------------------------------------------------------------ a batch
    def batch_start(self, trainer: pl.Trainer, module: Any, batch: Any, batch_idx: int) -> None:
        """The hard positives of this batch, handed to the module before ``training_step``."""
        cb, memory, epoch = self.callback, self.memory(), trainer.current_epoch
        error: Exception | None = None
        request = None
        try:
            request = module.lpa3_request(batch)
            # sync-free: the values are checked with the selection's one host read below
            check_request(request, memory.num_classes, memory.num_samples, values=not self.sync_free)
        except Exception as exc:  # any refusal reaches every rank before the next collective
            error = exc
        raise_together(error)
        module.lpa3_set_augmented(None)
        self.augmenter.pending = None
        self.augmenter.batch_key = (epoch, batch_idx)
        if epoch < cb.warmup_epochs or not _module_consumes(module, epoch):
            if self.sync_free:  # nothing is selected, but the values are checked: the step's one read
                try:
                    counts = bad_value_counts(request, memory.num_samples, memory.num_classes, self.feed.bad_recorded)
                    raise_bad_values(request, memory.num_samples, memory.num_classes, torch.stack(counts).tolist())
                except Exception as exc:
                    error = exc
                raise_together(error)
            return
        if self.augment_start is None:
            self.augment_start = epoch
        augmented, new_rows, selection = None, None, None
        try:  # the local work: a failure on one rank must reach the others before the cache's gather
            selection = select(memory, request, epoch, self.sync_free, self.feed.bad_recorded)
            augmented, new_rows = self.augmenter.augment(module, request, selection, self.cache, epoch,
                                                         self._solver_runs(epoch))
        except Exception as exc:
            error = exc
        raise_together(error)
        if self.cache is not None:  # collective under DDP: every rank stores every rank's new x'
            self.cache.put(*_gathered(new_rows, request), epoch=epoch)
        module.lpa3_set_augmented(augmented)
        cb.on_augmented(trainer, module, augmented)
        self.log.batch(module, request.inputs.shape[0], augmented, selection.tcs_selected, selection.nonfinite,
                       self.augmenter)

    def _solver_runs(self, epoch: int) -> bool:
        """Whether the solver runs this epoch for rows without a fresh cached ``x'``."""
        return self.cache is None or self.callback.cache_settings.attack_new_selections or self.regeneration_epoch(epoch)

    def regeneration_epoch(self, epoch: int) -> bool:
        """Every K epochs from the first epoch that augments (the callback's warm-up, or the
        module's, ``lpa3_consumes_augmented``); also when nothing from earlier epochs is left to
        reuse (a file cache restarts empty on resume; K or the warm-up changed)."""
        start = self.callback.warmup_epochs if self.augment_start is None else self.augment_start
        if (epoch - start) % self.callback.cache_settings.regenerate_every_n_epochs == 0:
            return True
        return self.cache is not None and not self.cache.reusable_from_before(epoch)

    def batch_end(self, trainer: pl.Trainer, module: Any) -> None:
        """Log how the trained ``x'`` kept their label, then feed this step's predictions to the memory."""
        cb, memory = self.callback, self.memory()
        predictions = module.lpa3_pop_predictions()
        pending = getattr(module, "lpa3_augmented_pending", None)
        untaken = bool(pending()) if callable(pending) else False  # the module chose not to train on x'
        module.lpa3_set_augmented(None)
        if trainer.current_epoch >= cb.warmup_epochs:
            self.log.trained_preservation(module, self.augmenter.pending, cb.sigma, cb.solver.temperature, untaken)
        self.augmenter.pending = None
        error: Exception | None = None
        if predictions is None:
            error = RuntimeError(
                f"{type(module).__name__}.training_step did not record its predictions. Fix: call "
                "`self.lpa3_record_predictions(indices, logits)` with the clean logits (the TCS memory needs them)."
            )
        elif predictions[1].dim() != 2 or predictions[1].shape[1] != memory.num_classes:
            error = ValueError(
                f"The recorded logits have shape {tuple(predictions[1].shape)} but lpa3_num_classes is "
                f"{memory.num_classes}. Fix: set `self.lpa3_num_classes` to the width of the model's logits."
            )
        elif predictions[0].dim() != 1 or predictions[0].shape[0] != predictions[1].shape[0]:
            error = ValueError(
                f"The recorded indices have shape {tuple(predictions[0].shape)} for {predictions[1].shape[0]} rows of "
                "logits. Fix: pass `self.lpa3_record_predictions(indices, logits)` one dataset index per logits row."
            )
        raise_together(error)
        indices, logits, targets = predictions  # type: ignore[misc]
        self.feed.feed(indices, logits, targets, cb.solver.temperature, trainer.current_epoch)  # type: ignore[union-attr]

    def epoch_end(self, trainer: pl.Trainer, module: Any) -> None:
        """Refresh the selection threshold; log the epoch's counts (and the grid when due)."""
        memory, feed = self.memory(), self.feed
        if self.sync_free and int(feed.bad_recorded):  # the last steps' recorded indices (once an epoch)
            raise_bad_values(None, memory.num_samples, memory.num_classes, (0, 0, int(feed.bad_recorded)))
        feed.check_coverage()
        memory.refresh_threshold()
        every = self.callback.logging.images_every_n_epochs
        if every and trainer.current_epoch % every == 0:
            grid = log_grid(trainer, module, self.augmenter, self.prefix, self.callback.logging.num_images,
                            self._warned_grid)
            self.last_grid = grid if grid is not None else self.last_grid
        self.log.epoch_end(module, feed.nonfinite, float(memory.threshold) if memory.has_threshold else None)
        feed.nonfinite = 0

    # ------------------------------------------------------------------ checkpoint state
    def state_dict(self) -> dict[str, Any]:
        cb = self.callback
        last = self.feed.last_update_epoch if self.feed is not None else self._last_update_epoch
        return {"tcs": None if self.tcs is None else self.tcs.state_dict(),
                "augmentation_cache": None if self.cache is None else
                self.cache.state_dict(include_inputs=cb.cache_settings.in_checkpoint),
                "last_update_epoch": last.cpu().clone(), "augment_start": self.augment_start,
                "settings": self.solver_settings()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Adopt a checkpoint's state (applied to the data set and module at the next fit's start).

        (A ``generator_state`` of a version-3 checkpoint is not needed: the noise seed is derived
        per batch.)
        """
        cb = self.callback
        self._restored = True
        tcs_state = state.get("tcs")
        if tcs_state is not None:
            # Rebuilt from the checkpoint alone, so the state is there before training starts;
            # the fit's start checks it against the current data set and module.
            # (the whole memory, whatever layout wrote it, sharing the checkpoint's memory tensor, which
            # Lightning discards after restoring: the fit's start keeps this process's rows if sharded)
            self.tcs = self._new_memory(int(tcs_state["num_samples"]), int(tcs_state["num_classes"]),
                                        torch.device("meta"), None)  # (meta: allocates nothing before the load)
            self.tcs._load(tcs_state, copy=False)
        self.feed = None
        self._last_update_epoch = state.get("last_update_epoch", torch.zeros(0, dtype=torch.long)).clone()
        self.augment_start = state.get("augment_start")
        cache_state = state.get("augmentation_cache")  # absent in checkpoints of older versions
        if cache_state is not None and cb.cache_settings.regenerate_every_n_epochs > 1:
            self.cache = AugmentationCache(int(cache_state["num_samples"]), cb.cache_settings.regenerate_every_n_epochs,
                                           cb.cache_settings.max_bytes)
            self.cache.load_state_dict(cache_state)

    def _new_memory(self, num_samples: int, num_classes: int, device: torch.device,
                    processes: tuple[int, int] | None) -> TimeConsistency:
        """An empty memory with the selection settings: split over the ``(world size, rank)`` processes
        when the layout says so (``processes`` None: a whole one)."""
        world_size, rank = processes or (1, 0)
        cb, s = self.callback, self.callback.selection
        kwargs = dict(divergence=s.divergence, initial_memory=s.initial_memory, initial_selection=s.initial_selection,
                      seed=self.tcs_seed, threshold_rule=s.threshold_rule, device=device, storage_dtype=s.memory_dtype)
        if processes is not None and (s.memory_layout == "sharded" or (s.memory_layout == "auto" and world_size > 1)):
            return ShardedTimeConsistency(num_samples, num_classes, cb.ratio, num_shards=world_size, shard=rank,
                                          **kwargs)
        return TimeConsistency(num_samples, num_classes, cb.ratio, **kwargs)

    def solver_settings(self) -> dict[str, Any]:
        """The settings the solver ran with, as plain values (saved in checkpoints, so that
        ``lpa3 show`` draws the ``x'`` that training made)."""
        cb, s = self.callback, self.callback.solver
        layers = self.augmenter.layer_names if self.augmenter.layer_names is not None else cb.layers
        return {"sigma": cb.sigma, "steps": cb.steps, "lam": s.lam, "temperature": s.temperature,
                "max_step": s.max_step, "attack_bn": s.attack_bn, "project": s.project, "fast": s.fast,
                "allow_tf32": s.allow_tf32,
                "layers": None if layers is None else ([layers] if isinstance(layers, str) else list(layers))}


def _module_consumes(module: Any, epoch: int) -> bool:
    """The module's word on whether its loss trains ``x'`` in ``epoch`` (a module without
    :meth:`~lpa3_lightning.mixins.LPA3ModuleMixin.lpa3_consumes_augmented` always does)."""
    consumes = getattr(module, "lpa3_consumes_augmented", None)
    return True if not callable(consumes) else bool(consumes(epoch))


def _gathered(new_rows: NewRows | None, request: Any) -> NewRows:
    """Every rank's freshly solved (indices, x', labels); a rank without any sends empty rows."""
    if new_rows is None:
        new_rows = (request.indices[:0], request.inputs[:0].detach(), request.targets[:0])
    idx, x_new, labels = gather_rows(*new_rows)
    return idx, x_new, labels
