"""LPA3Callback: label-preserving adversarial auto-augmentation inside any Lightning Trainer."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn
from torch.utils.data import default_collate
from torchmetrics import SumMetric

from lpa3_lightning.attack import (
    InputRange, MaxStep, check_max_step, check_solver_arguments, label_log_prob, lpa3_attack, parameter_dtype,
    resolve_input_range,
)
from lpa3_lightning.augmented import AugmentedBatch, LPA3Request, selected_positions
from lpa3_lightning.augmented_forward import running_statistics
from lpa3_lightning.batch_plan import assemble_inputs, plan_rows
from lpa3_lightning.cache import DEFAULT_MAX_BYTES, AugmentationCache
from lpa3_lightning.checks import check_class_labels, check_dataset_indices, count_out_of_range
from lpa3_lightning.distributed import all_equal, any_rank_failed, gather_predictions, gather_rows
from lpa3_lightning.dual_bn import DualSyncBatchNorm, anchor_twin_parameters, has_dual_bn
from lpa3_lightning.features import eval_mode, resolve_layers, unwrap_compiled
from lpa3_lightning.metrics import NanIgnoringMean
from lpa3_lightning.mixins.base import REQUIRED_METHODS
from lpa3_lightning.networks import NetworkView, module_networks
from lpa3_lightning.selection import check_initial_selection, check_ratio, check_threshold_rule
from lpa3_lightning.solver_graphs import SolverGraphs
from lpa3_lightning.tcs import TimeConsistency
from lpa3_lightning.visualize import comparison_grid

__all__ = ["LPA3Callback"]

_NETWORK_SEED_STRIDE = 7919  # seed offset between the networks of a module with several
# 2 added the x' cache, the global RNG and the per-epoch update record; 3 the cache's labels; 4 dropped the
# solver's generator state (its seed is derived per batch: batch_noise_seed)
_STATE_VERSION = 4

#: Per-epoch diagnostics, each a torchmetrics aggregate synced across processes at epoch end.
_EPOCH_MEANS = ("selected_fraction", "tcs_selected_fraction", "skipped_fraction", "reused_fraction",
                "perceptual_distance", "projected", "solver_seconds", "label_preserved", "label_preserved_eval")


def batch_noise_seed(seed: int, rank: int, epoch: int, batch_idx: int) -> int:
    """The seed of one batch's solver noise on one process: a hash of the four numbers.

    Derived, not carried: a resumed run (from any checkpoint, on any number of processes) draws
    on every rank the noise that an uninterrupted run draws there, and no generator state has to
    be saved per rank.

    Example:
        >>> batch_noise_seed(0, 0, 3, 7) == batch_noise_seed(0, 0, 3, 7) != batch_noise_seed(0, 1, 3, 7)
        True
    """
    digest = hashlib.blake2b(f"{seed}/{rank}/{epoch}/{batch_idx}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _drop_selected(mask: Tensor, drop: Tensor) -> Tensor:
    """A copy of the batch mask ``mask`` without the selected rows flagged in ``drop`` (one flag per selected row)."""
    mask = mask.clone()
    mask[mask.nonzero().flatten()[drop]] = False
    return mask


def _global_rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_global_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


class LPA3Callback(Callback):
    r"""Generate LP-A3 hard positives for the least time-consistent samples of each batch.

    On every training batch the callback asks the module for its inputs, labels and dataset
    indices (:class:`~lpa3_lightning.mixins.LPA3ModuleMixin`), selects the samples whose
    time-consistency score is below the threshold of the last pass, runs
    :func:`~lpa3_lightning.attack.lpa3_attack` on them and hands the result to the module
    before ``training_step``. After the step it updates the TCS memory from the clean
    logits the module recorded; after each epoch it refreshes the threshold.

    Logged (through the Trainer's logger, ``<name>_step`` per step on each process and
    ``<name>_epoch`` per epoch, averaged over all processes): ``lpa3/selected_fraction`` (the
    share of the batch that got an ``x'``), ``lpa3/perceptual_distance``,
    ``lpa3/label_preserved`` (share of the trained ``x'`` with ``log p(y|x') >= log p(y|x) -
    sigma``, measured on the logits of the forward that trained on them, i.e. the module's
    :meth:`~lpa3_lightning.mixins.LPA3ModuleMixin.lpa3_forward_augmented`, against the clean
    ``log p(y|x)`` under the same normalisation), ``lpa3/label_preserved_eval`` (the same
    constraint in the deployed model: eval mode, main BN; a diagnostic),
    ``lpa3/projected`` (fraction pulled back by the bisection), ``lpa3/solver_seconds``,
    ``lpa3/reused_fraction`` (with a cache), ``lpa3/tcs_selected_fraction`` (the share TCS
    selected, before a lone sample or, with ``attack_new_selections=False``, an uncached one is
    left out), ``lpa3/skipped_fraction`` (the share selected but not solved because the
    request's ``train_mask`` says the module will not train their ``x'``); per epoch ``lpa3/threshold``, ``lpa3/nonfinite_inputs`` and
    ``lpa3/nonfinite_predictions``.

    Args:
        ratio: fraction of samples given LP-A3 (tau), in (0, 1].
        sigma: label-preserving margin on ``log p`` (0.02 for MedMNIST in the paper).
        steps: solver iterations (paper: 5).
        lam: Lagrange multiplier scale (authors: 1).
        warmup_epochs: epochs at the start without augmentation (TCS still updates). A module
            may also say in which epochs its loss trains ``x'``
            (:meth:`~lpa3_lightning.mixins.LPA3ModuleMixin.lpa3_consumes_augmented`: PES's semi
            phase, DivideMix after its warm-up, FixMatch after its LP-A3 loss warm-up): the
            callback solves only in those.
        layers: feature layers (names or glob patterns of ``module.lpa3_model()``); None
            for the documented default.
        input_range: valid input bounds for the solver's clamp: ``"auto"`` (default) takes
            ``trainer.datamodule.normalization`` (``{"mean", "std"}`` of [0, 1] data) when
            the data module has one, else no clamping; ``None`` never clamps; or give
            ``(low, high)`` / ``{"mean": ..., "std": ...}``.
        project: keep the label-preserving constraint on every sample (default) or run the
            authors' unconstrained loop (False).
        attack_bn: ``"auto"`` (default): through the twin BatchNorms when the model has
            them (the authors' choice), else ``"eval"``: the model in eval mode, BN on its
            running statistics. ``"twin"`` requires twins. No running statistic moves in
            any mode (see :func:`~lpa3_lightning.attack.lpa3_attack`).
        temperature: softmax temperature for TCS and ``log p``.
        num_samples: training-set size for the TCS memory; None infers it from the train
            dataloader's dataset.
        tcs_divergence: ``"code"`` (authors' code) or ``"paper"``.
        tcs_initial_memory: ``"uniform"`` (a distribution; default) or ``"authors"`` (1.01).
        seed: seed of the solver's initial noise (reproducible runs): each batch's noise comes
            from a generator seeded by (seed, rank, epoch, batch index)
            (:func:`batch_noise_seed`), so every rank draws its own noise and a resumed run draws
            on each rank what an uninterrupted run draws there. None draws from torch's global
            generator.
        regenerate_every_n_epochs: ``K`` of the paper's appendix: a sample's ``x'`` is kept
            and reused for ``K`` epochs before it is generated again (1: no cache).
        attack_new_selections: with a cache (``K > 1``), whether a selected sample that has no
            cached ``x'`` is attacked in any epoch (True, default) or only in the regeneration
            epochs ``warmup_epochs + m K`` (False): between those it gets no ``x'``, so the
            solver runs once every ``K`` epochs and the epochs between cost at most
            ``1 + ratio`` times a plain one. TCS selection changes from epoch to epoch, so with
            True the solver also runs between regenerations, for the newly selected samples;
            with False the share of a batch that gets ``x'`` shrinks over each window (only
            samples selected now and in the regeneration epoch; ``lpa3/selected_fraction``
            logs that share). An epoch with nothing left to reuse from earlier ones (a file
            cache restarts empty on resume) regenerates too.
        cache_max_bytes: largest in-memory cache; beyond it a memory-mapped file is used.
        cache_dir: folder of that file; None uses ``<trainer.default_root_dir>/lpa3_cache``.
            Under DDP every rank holds the whole cache (new ``x'`` are all-gathered).
        cache_on_device: keep an in-memory cache on the model's device (GPU memory on a GPU:
            a reused ``x'`` costs no host-to-device copy; it falls back to host memory, with a
            warning, when the GPU has less than twice the cache free); False: host memory.
        restore_rng: save torch's global random state (CPU and CUDA) with the callback's state
            and restore it on resume, so that a resumed run continues the same random stream
            (needed for a bitwise-equal resume; Lightning does not checkpoint it). Single
            process only: under DDP the checkpoint holds rank 0's state, which is not restored.
        log_images_every_n_epochs: every N epochs (0: never) log a grid of the first
            ``num_logged_images`` training images, their ``x'`` and ``|x' - x|`` (stretched) to
            the Trainer's logger (TensorBoard ``add_image``, or a logger's ``log_image``). The
            grid's ``x'`` come from the model in eval mode (each image on its own), with random
            draws that do not touch the training run's.
        num_logged_images: how many images the grid shows.
        fast: the cheaper solver of :func:`~lpa3_lightning.attack.lpa3_attack` (``fast=True``):
            one finite-difference forward in all, farthest feasible iterate instead of a bisection.
        max_step: largest L2 length of one solver step (see
            :func:`~lpa3_lightning.attack.lpa3_attack`): ``"auto"`` (default) 2% of the input
            box's diagonal; None is the authors' unbounded step, which turns samples the model
            is saturated on into clipped noise; or a number.
        allow_tf32: let the solver use TF32 on CUDA; False (default) computes it in full
            float32 (see :func:`~lpa3_lightning.attack.lpa3_attack`).
        initial_selection: before the first threshold exists (the first pass over the data),
            ``"random"`` (default) selects a seeded random ``ratio`` share, the same on every
            rank; ``"all"`` selects every sample (the authors').
        threshold_rule: ``"count"`` (default) selects the ``round(ratio * N)`` least consistent
            samples; ``"authors"`` the authors' rule, one fewer (see
            :func:`~lpa3_lightning.selection.selection_threshold`).
        checkpoint_cache: save the ``x'`` cache in checkpoints (up to ``cache_max_bytes``; a
            file cache is never saved). False (default): checkpoints stay small and a resumed
            run regenerates the ``x'`` it would have reused (its first epoch is a regeneration).
        log_eval_preservation: log ``lpa3/label_preserved_eval`` (one extra no-grad forward of
            the selected ``x`` and ``x'`` per step).
        sync_free: the per-batch path without host reads of device values (each one is a GPU
            synchronisation): ``"auto"`` (default) on any accelerator, not on the CPU. The TCS
            memory then lives on the module's device; selection, solver (``sync_free=True`` of
            :func:`~lpa3_lightning.attack.lpa3_attack`: a bisection over all rows), statistics
            and the TCS update run on the device, and the one host read of a step fetches,
            in one copy, the number of selected samples together with the counts of bad
            indices, labels and non-finite inputs (a bad value then raises the same named
            error as the default path). ``lpa3/solver_seconds`` is not logged (timing the
            solver needs a synchronisation). With ``regenerate_every_n_epochs > 1`` the cache's
            reuse plan still reads on the host. Same ``x'`` as the default path up to float
            rounding; True on the CPU only costs compute (tests, counting reads).
        cuda_graphs: on the sync-free path, run the solver as a CUDA graph captured once per
            padded number of selected rows (:class:`~lpa3_lightning.solver_graphs.SolverGraphs`:
            rows padded to a multiple of 8, inputs copied into the graph's buffers, captured
            again when the model's parameters move to other memory). Off by default: on an H100
            it halved the steady-state LP-A3 step but each new padded size costs a capture, so
            it pays in long runs (``docs/results.md``). On the CPU it solves the padded rows eagerly. Needs the sync-free path; a model whose
            forward reads the host or branches on data cannot be captured.

    Raises:
        ValueError: on an argument out of range, naming it and the fix.

    Example::

        trainer = Trainer(callbacks=[LPA3Callback(ratio=0.5, sigma=0.02)])
        trainer.fit(LPA3Classifier(num_classes=2), datamodule=MedMNISTDataModule("breastmnist"))
    """

    def __init__(
        self,
        ratio: float = 0.5,
        sigma: float = 0.02,
        steps: int = 5,
        lam: float = 1.0,
        warmup_epochs: int = 0,
        layers: str | Sequence[str] | None = None,
        input_range: InputRange | Literal["auto"] = "auto",
        project: bool = True,
        attack_bn: Literal["eval", "twin", "auto"] = "auto",
        temperature: float = 1.0,
        num_samples: int | None = None,
        tcs_divergence: Literal["code", "paper"] = "code",
        tcs_initial_memory: Literal["uniform", "authors"] = "uniform",
        seed: int | None = None,
        regenerate_every_n_epochs: int = 1,
        attack_new_selections: bool = True,
        cache_max_bytes: int = DEFAULT_MAX_BYTES,
        cache_dir: str | None = None,
        cache_on_device: bool = True,
        restore_rng: bool = True,
        log_images_every_n_epochs: int = 0,
        num_logged_images: int = 8,
        fast: bool = False,
        max_step: MaxStep = "auto",
        allow_tf32: bool = False,
        initial_selection: Literal["random", "all"] = "random",
        threshold_rule: Literal["count", "authors"] = "count",
        checkpoint_cache: bool = False,
        log_eval_preservation: bool = True,
        sync_free: bool | Literal["auto"] = "auto",
        cuda_graphs: bool = False,
    ) -> None:
        # the settings, for the per-network callbacks of a module with several networks
        self._settings = {k: v for k, v in locals().items() if k not in ("self", "__class__")}
        self.ratio = check_ratio(ratio)
        check_solver_arguments(sigma, steps, lam, temperature)
        if isinstance(warmup_epochs, bool) or not isinstance(warmup_epochs, int) or warmup_epochs < 0:
            raise ValueError(f"`warmup_epochs` must be an int >= 0, got {warmup_epochs!r}. Fix: use 0 (no warm-up).")
        if attack_bn not in ("eval", "twin", "auto"):
            raise ValueError(f"`attack_bn` must be 'eval', 'twin' or 'auto', got {attack_bn!r}. Fix: use 'auto'.")
        if num_samples is not None and (not isinstance(num_samples, int) or num_samples < 1):
            raise ValueError(f"`num_samples` must be None or a positive int, got {num_samples!r}. Fix: use None to "
                             "infer it from the train dataloader's dataset.")
        if tcs_divergence not in ("code", "paper"):
            raise ValueError(f"`tcs_divergence` must be 'code' or 'paper', got {tcs_divergence!r}. Fix: use 'code'.")
        if tcs_initial_memory not in ("uniform", "authors"):
            raise ValueError(f"`tcs_initial_memory` must be 'uniform' or 'authors', got {tcs_initial_memory!r}. "
                             "Fix: use 'uniform'.")
        if not isinstance(project, bool):
            raise ValueError(f"`project` must be True or False, got {project!r}.")
        if not isinstance(fast, bool):
            raise ValueError(f"`fast` must be True or False, got {fast!r}.")
        self.fast = fast
        check_initial_selection(initial_selection)
        self.initial_selection = initial_selection
        check_threshold_rule(threshold_rule)
        self.threshold_rule = threshold_rule
        for name, value in (("checkpoint_cache", checkpoint_cache), ("log_eval_preservation", log_eval_preservation)):
            if not isinstance(value, bool):
                raise ValueError(f"`{name}` must be True or False, got {value!r}.")
        self.checkpoint_cache = checkpoint_cache
        self.log_eval_preservation = log_eval_preservation
        if sync_free not in (True, False, "auto"):
            raise ValueError(f"`sync_free` must be True, False or 'auto', got {sync_free!r}. Fix: use 'auto' "
                             "(no host reads on an accelerator, the default path on the CPU).")
        self.sync_free = sync_free
        self._sync_free = False  # resolved for the module's device in on_train_start
        if not isinstance(cuda_graphs, bool):
            raise ValueError(f"`cuda_graphs` must be True or False, got {cuda_graphs!r}. Fix: use False.")
        if cuda_graphs and sync_free is False:
            raise ValueError("`cuda_graphs=True` needs the sync-free path, but `sync_free=False`. Fix: use "
                             "sync_free='auto' (on a GPU) or True, or cuda_graphs=False.")
        self.cuda_graphs = cuda_graphs
        self.solver_graphs: SolverGraphs | None = None  # made in on_train_start when cuda_graphs and sync-free
        self._solver_range: tuple[tuple[Any, ...], InputRange] | None = None  # (key, range as device tensors)
        self._bad_recorded_indices = torch.zeros((), dtype=torch.long)  # sync-free: refused at the next read
        check_max_step(max_step)
        self.max_step = max_step
        if not isinstance(allow_tf32, bool):
            raise ValueError(f"`allow_tf32` must be True or False, got {allow_tf32!r}. Fix: use False.")
        self.allow_tf32 = allow_tf32
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"`seed` must be None or an int, got {seed!r}.")
        if layers is not None and not isinstance(layers, (str, Sequence)):
            raise ValueError(f"`layers` must be None, a name/pattern or a list of them, got {layers!r}.")
        if input_range not in ("auto", None) and not isinstance(input_range, (Mapping, Sequence)):
            raise ValueError(f"`input_range` must be 'auto', None, (low, high) or {{'mean', 'std'}}, got "
                             f"{input_range!r}.")
        self.sigma = float(sigma)
        self.steps = steps
        self.lam = float(lam)
        self.warmup_epochs = warmup_epochs
        self.layers = layers
        self.input_range = input_range
        self.project = project
        self.attack_bn = attack_bn
        self.temperature = float(temperature)
        self.num_samples = num_samples
        self.tcs_divergence = tcs_divergence
        self.tcs_initial_memory = tcs_initial_memory
        self.seed = seed
        AugmentationCache(1, regenerate_every_n_epochs, cache_max_bytes)  # validates the cache arguments
        if isinstance(log_images_every_n_epochs, bool) or not isinstance(log_images_every_n_epochs, int) \
                or log_images_every_n_epochs < 0:
            raise ValueError(f"`log_images_every_n_epochs` must be an int >= 0 (0: off), got "
                             f"{log_images_every_n_epochs!r}.")
        if isinstance(num_logged_images, bool) or not isinstance(num_logged_images, int) or num_logged_images < 1:
            raise ValueError(f"`num_logged_images` must be an int >= 1, got {num_logged_images!r}.")
        self.log_images_every_n_epochs = log_images_every_n_epochs
        self.num_logged_images = num_logged_images
        self.last_grid: Tensor | None = None
        self._warned_grid = False
        self.regenerate_every_n_epochs = regenerate_every_n_epochs
        if not isinstance(attack_new_selections, bool):
            raise ValueError(f"`attack_new_selections` must be True or False, got {attack_new_selections!r}.")
        self.attack_new_selections = attack_new_selections
        self.cache_max_bytes = cache_max_bytes
        self.cache_dir = cache_dir
        if not isinstance(cache_on_device, bool):
            raise ValueError(f"`cache_on_device` must be True or False, got {cache_on_device!r}.")
        self.cache_on_device = cache_on_device
        self.cache: AugmentationCache | None = None
        self.tcs: TimeConsistency | None = None
        self._generator: torch.Generator | None = None
        self._batch_key = (0, 0)  # (epoch, batch index) of the batch being augmented: its noise seed
        self._resolved_range: InputRange = None
        self._nonfinite = 0
        self._rng_to_restore: dict[str, Any] | None = None
        self._rank = 0
        self._last_update_epoch = torch.zeros(0, dtype=torch.long)  # per sample: epoch of its last TCS update
        self._nonfinite_predictions = 0
        self.restore_rng = restore_rng
        self._restored = False  # load_state_dict ran since the last fit started (a resume)
        self._pending: tuple[Tensor, Tensor] | None = None  # (clean log p(y|x), y) of this batch's x'
        self._rows_recorded, self._coverage_checked = 0, False  # the memory-coverage check (once a fit)
        self._augment_start: int | None = None  # the first epoch that augmented (the cache's windows start there)
        self._warned_unmeasured = False
        self._eval_preserved: Tensor | None = None
        self._layer_names: list[str] | None = None  # resolved once, by a probe forward for the default
        self._last_solver_seconds: float | None = 0.0
        self._warned_no_range = False
        self._epoch_metrics: dict[str, NanIgnoringMean] = {}
        self._nonfinite_inputs_metric = SumMetric(nan_strategy="disable")  # host counts: never NaN
        # several networks (module.lpa3_networks()): one callback of these settings per network
        self._log_prefix = "lpa3/"
        self._tcs_seed_offset = 0
        self._metric_prefix = "_lpa3_"
        self._networks: dict[str, LPA3Callback] = {}
        self._views: dict[str, NetworkView] = {}
        self._network_states: dict[str, Any] | None = None  # loaded before setup created the networks

    def _tcs_seed(self) -> int:
        return self.seed if self.seed is not None else self._tcs_seed_offset

    @property
    def networks(self) -> dict[str, LPA3Callback]:
        """The per-network callbacks (each with its ``tcs`` and ``cache``) of a module that
        declares several networks; empty for a single network (this callback holds the state).

        Each is an ``LPA3Callback`` with this callback's settings as they are at ``setup`` (a
        subclass's overridden methods do not carry over); ``cache_max_bytes`` bounds each
        network's cache."""
        return dict(self._networks)

    def _network_callback(self, name: str, position: int) -> LPA3Callback:
        """A callback with this one's current settings (also those changed after construction) for
        one network; its solver noise and first random selection are offset by its position."""
        child = LPA3Callback(**self._settings)
        for key, value in vars(self).items():
            if not key.startswith("_") and key not in ("tcs", "cache", "last_grid"):
                setattr(child, key, value)
        if child.seed is not None:
            child.seed = child.seed + _NETWORK_SEED_STRIDE * position
        child._tcs_seed_offset = _NETWORK_SEED_STRIDE * position  # also without a seed: independent first picks
        child._log_prefix = f"lpa3/{name}/"
        child._metric_prefix = f"_lpa3_{name}_"
        return child

    def _each_network(self, pl_module: pl.LightningModule) -> list[tuple[LPA3Callback, Any]]:
        """(callback, view) per declared network, in the declared order (the same on every rank)."""
        return [(child, self._views[name]) for name, child in self._networks.items()]

    @property
    def state_key(self) -> str:
        # One fixed key: a resumed run with other settings (or a subclass) still finds its
        # time-consistency memory; the memory does not depend on ratio or sigma.
        return "LPA3Callback"

    # ------------------------------------------------------------------ setup and validation
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        names = None if isinstance(pl_module, NetworkView) else module_networks(pl_module)
        if names is not None:
            if list(self._networks) != list(names):
                self._networks = {name: self._network_callback(name, k) for k, name in enumerate(names)}
            self._views = {name: NetworkView(pl_module, name) for name in names}
            if self._network_states is not None:
                self._load_network_states(self._network_states)
            for child, view in self._each_network(pl_module):
                child.setup(trainer, view, stage)  # type: ignore[arg-type]
            return
        self._networks, self._views = {}, {}
        missing = [name for name in REQUIRED_METHODS if not callable(getattr(pl_module, name, None))]
        if missing:
            raise TypeError(
                f"{type(pl_module).__name__} does not implement the LP-A3 protocol (missing {missing}). Fix: inherit "
                "`lpa3_lightning.mixins.LPA3ModuleMixin` (or `SupervisedLPA3Mixin`) and implement `lpa3_request`; "
                "see the README section 'Use it in your own LightningModule'."
            )
        if getattr(type(pl_module).lpa3_model, "__qualname__", "") == "LPA3ModuleMixin.lpa3_model" \
                and type(pl_module).forward in (nn.Module.forward, pl.LightningModule.forward):
            raise TypeError(
                f"{type(pl_module).__name__} neither overrides `lpa3_model()` nor defines `forward()`, so LP-A3 has no "
                "network to attack (the default `lpa3_model()` returns the module itself). Fix: return the network "
                "from `lpa3_model()` (e.g. `def lpa3_model(self): return self.net`), or define `forward()`."
            )
        check_settings = getattr(pl_module, "lpa3_check_settings", None)
        if callable(check_settings):
            check_settings()  # a misspelled mixin setting fails here, not after a run on the defaults
        model = unwrap_compiled(pl_module.lpa3_model())
        resolve_layers(model, self.layers)  # fails early, listing the available layer names
        if self.attack_bn == "twin" and not has_dual_bn(model):
            raise ValueError("`attack_bn='twin'` needs twin BatchNorms in the model. Fix: call "
                             "`convert_dual_bn(model)` in the module, or use attack_bn='eval'.")
        self._resolved_range = self._resolve_range(trainer)
        # aggregated per epoch across processes; every rank logs every key at every step
        self._epoch_metrics = {name: NanIgnoringMean() for name in _EPOCH_MEANS
                               if name != "reused_fraction" or self.regenerate_every_n_epochs > 1}
        if not self.log_eval_preservation:
            self._epoch_metrics.pop("label_preserved_eval")

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._networks:
            for child, view in self._each_network(pl_module):
                child.on_fit_start(trainer, view)  # type: ignore[arg-type]
            return
        # After the strategy's setup: Trainer(sync_batchnorm=True) converts BN only now.
        model = unwrap_compiled(pl_module.lpa3_model())
        self._refuse_dropped_twins(model)
        # Under DDP every twin parameter joins every step's graph (a zero gradient in steps
        # without x'), whatever the module's loss does: no "Expected to have finished reduction".
        anchor_twin_parameters(model, trainer.world_size > 1)
        if trainer.world_size > 1:
            synced = [m for m in model.modules() if isinstance(m, nn.SyncBatchNorm)
                      and not isinstance(m, DualSyncBatchNorm)]
            if synced:
                raise ValueError(
                    "Under DDP the x' forward would pass through SyncBatchNorm, whose collectives only the ranks "
                    "with selected samples would reach (a deadlock). Fix: call `convert_dual_bn(model)` after "
                    "`nn.SyncBatchNorm.convert_sync_batchnorm(model)` (x' then uses local twins), or drop "
                    "SyncBatchNorm."
                )

    @staticmethod
    def _refuse_dropped_twins(model: nn.Module) -> None:
        if any(isinstance(m, nn.SyncBatchNorm) and not isinstance(m, DualSyncBatchNorm) and hasattr(m, "twin")
               for m in model.modules()):
            raise ValueError(
                "SyncBatchNorm replaced the model's twin BatchNorms (Trainer(sync_batchnorm=True) converts after "
                "the module converted its BN), so x' would go through the synced main BN. Fix: drop "
                "`sync_batchnorm=True` and call `nn.SyncBatchNorm.convert_sync_batchnorm(model)` before "
                "`convert_dual_bn(model)` in the module."
            )

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._teardown(pl_module)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._teardown(pl_module)

    def _teardown(self, pl_module: pl.LightningModule) -> None:
        if self._networks:
            for child, view in self._each_network(pl_module):
                child._teardown(view)  # type: ignore[arg-type]
            return
        # the twin anchor is for the DDP fit only; a file cache is deleted with its run
        if callable(getattr(pl_module, "lpa3_model", None)):
            # (a fit that failed before setup may hold a module with several networks)
            names = None if isinstance(pl_module, NetworkView) else module_networks(pl_module)
            models = [pl_module.lpa3_model()] if names is None else [pl_module.lpa3_model(network=n) for n in names]
            for model in models:
                anchor_twin_parameters(unwrap_compiled(model), False)
        if self.cache is not None:
            self.cache.close()
            self.cache.offload()  # the GPU memory is free for what follows the fit
        if self.solver_graphs is not None:
            self.solver_graphs.reset()  # the graphs' memory pool too
        self._pending = None

    def _resolve_range(self, trainer: pl.Trainer) -> InputRange:
        if self.input_range != "auto":
            return self.input_range
        datamodule = getattr(trainer, "datamodule", None)
        normalization = getattr(datamodule, "normalization", None)
        if isinstance(normalization, Mapping):
            return dict(normalization)
        if not self._warned_no_range:
            rank_zero_warn(
                "LPA3Callback(input_range='auto') found no `normalization` on the data module, so the solver clamps "
                "x' to no input box: x' may leave the valid range of your inputs (e.g. pixels outside [0, 1]). Fix: "
                "pass input_range=(low, high) or {'mean': [...], 'std': [...]} (the normalisation of [0, 1] data), "
                "give the data module a `normalization` attribute, or pass input_range=None for unbounded inputs."
            )
            self._warned_no_range = True
        return None

    def _infer_num_samples(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> int:
        if self.num_samples is not None:
            return self.num_samples
        declared = getattr(pl_module, "lpa3_num_samples", None)  # e.g. FixMatch: the unlabeled set's size
        if isinstance(declared, int) and not isinstance(declared, bool) and declared > 0:
            return declared
        loader = trainer.train_dataloader
        dataset = getattr(loader, "dataset", None)
        try:
            return len(dataset)  # type: ignore[arg-type]
        except TypeError:
            raise ValueError(
                "LPA3Callback could not infer the training-set size from the train dataloader "
                f"({type(loader).__name__}). Fix: pass `num_samples=` (the number of dataset indices), or set "
                "`lpa3_num_samples` on the module."
            ) from None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._networks:
            for child, view in self._each_network(pl_module):
                child.on_train_start(trainer, view)  # type: ignore[arg-type]
            return
        if self._network_states is not None:
            raise ValueError(
                f"The checkpoint holds LPA3Callback state for the networks {sorted(self._network_states)}, but "
                f"{type(pl_module).__name__} declares one network. Fix: resume with the module the checkpoint was "
                "written with (its `lpa3_networks()`)."
            )
        self._rank = trainer.global_rank
        if self._rng_to_restore is not None and self.restore_rng and trainer.world_size == 1:
            # Dropout, random transforms and un-seeded attacks continue the interrupted run's
            # random stream, so a resumed run equals an uninterrupted one.
            _set_global_rng_state(self._rng_to_restore)
        self._rng_to_restore = None
        num_classes = getattr(pl_module, "lpa3_num_classes", None)
        if not isinstance(num_classes, int) or num_classes < 2:
            raise ValueError(
                f"{type(pl_module).__name__}.lpa3_num_classes must be the number of classes (int >= 2), got "
                f"{num_classes!r}. Fix: set `self.lpa3_num_classes = num_classes` in __init__."
            )
        num_samples = self._infer_num_samples(trainer, pl_module)
        if not all_equal(num_samples) or not all_equal(num_classes):
            raise ValueError(
                "The processes disagree on the training-set size or the number of classes. Fix: give every rank "
                "the same dataset with global indices (Lightning's DistributedSampler does this), not per-rank shards."
            )
        self._sync_free = pl_module.device.type != "cpu" if self.sync_free == "auto" else bool(self.sync_free)
        if self.cuda_graphs and not self._sync_free:
            raise ValueError("`cuda_graphs=True` needs the sync-free path, which sync_free='auto' runs on an "
                             "accelerator only and this module is on the CPU. Fix: sync_free=True, or cuda_graphs=False.")
        self.solver_graphs = SolverGraphs() if self.cuda_graphs else None
        self._solver_range = None
        # sync-free: the memory lives beside the model, so selecting and updating read nothing back
        memory_device = pl_module.device if self._sync_free else torch.device("cpu")
        self._bad_recorded_indices = torch.zeros((), dtype=torch.long, device=memory_device)
        fresh = TimeConsistency(num_samples, num_classes, self.ratio, divergence=self.tcs_divergence,
                                initial_memory=self.tcs_initial_memory, initial_selection=self.initial_selection,
                                seed=self._tcs_seed(), threshold_rule=self.threshold_rule, device=memory_device)
        if self.tcs is not None:  # restored from a checkpoint (or kept from an earlier fit)
            fresh.load_state_dict(self.tcs.state_dict())  # refuses a data set of another size
        self.tcs = fresh
        if not self._restored:
            self._augment_start = None
        if self._last_update_epoch.numel() != num_samples or not self._restored:
            # A new fit counts epochs from 0 again: the record of the last one must not make it
            # skip the updates of its first epochs. Only a resume continues the record.
            self._last_update_epoch = torch.full((num_samples,), -1, dtype=torch.long)
        self._last_update_epoch = self._last_update_epoch.to(memory_device)
        if self._sync_free:
            self._epoch_metrics.pop("solver_seconds", None)  # not timed: that would synchronise
        for metric in [*self._epoch_metrics.values(), self._nonfinite_inputs_metric]:
            metric.to(pl_module.device)
        if self.regenerate_every_n_epochs > 1:
            cache = AugmentationCache(num_samples, self.regenerate_every_n_epochs, self.cache_max_bytes,
                                      self.cache_dir or Path(trainer.default_root_dir) / "lpa3_cache",
                                      device=pl_module.device if self.cache_on_device else "cpu")
            if self.cache is not None and self._restored:  # an earlier fit's x' are not reused
                cache.load_state_dict(self.cache.state_dict(include_inputs=True))
            self.cache = cache
        self._restored = False
        self._layer_names = None  # the model may differ from an earlier fit's
        self._rows_recorded, self._coverage_checked = 0, False

    # ------------------------------------------------------------------ per batch
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self._networks:
            for child, view in self._each_network(pl_module):
                child.on_train_batch_start(trainer, view, batch, batch_idx)  # type: ignore[arg-type]
            return
        error: Exception | None = None
        request: LPA3Request | None = None
        memory = self._memory()
        try:
            request = pl_module.lpa3_request(batch)
            # sync-free: the values are checked with the selection's one host read below
            self._check_request(request, memory.num_classes, memory.num_samples, values=not self._sync_free)
        except Exception as exc:  # any refusal reaches every rank before the next collective
            error = exc
        self._raise_together(error)
        pl_module.lpa3_set_augmented(None)
        self._pending = None
        self._batch_key = (trainer.current_epoch, batch_idx)
        if trainer.current_epoch < self.warmup_epochs or not self._module_consumes(pl_module, trainer.current_epoch):
            if self._sync_free:  # nothing is selected, but the values are checked: the warm-up step's one read
                try:
                    self._raise_bad_values(request, memory, torch.stack(self._bad_value_counts(request)).tolist())
                except Exception as exc:
                    error = exc
                self._raise_together(error)
            return
        if self._augment_start is None:  # the first epoch that augments: the cache's windows start here
            self._augment_start = trainer.current_epoch
        augmented, tcs_selected, new_rows = None, 0, None
        try:  # the local work: a failure on one rank must reach the others before the cache's gather
            select = self._select_sync_free if self._sync_free else self._select
            mask, tcs_selected, count, trained = select(request, trainer.current_epoch)  # type: ignore[arg-type]
            augmented, new_rows = self._augment(trainer, pl_module, request, mask, count,  # type: ignore[arg-type]
                                                trained)
        except Exception as exc:
            error = exc
        self._raise_together(error)
        if self.cache is not None:  # collective under DDP: every rank stores every rank's new x'
            self.cache.put(*self._gather_new(new_rows, request), epoch=trainer.current_epoch)  # type: ignore[arg-type]
        pl_module.lpa3_set_augmented(augmented)
        self._log_batch(pl_module, request, augmented, tcs_selected)  # type: ignore[arg-type]

    @staticmethod
    def _module_consumes(pl_module: pl.LightningModule, epoch: int) -> bool:
        """The module's word on whether its loss trains ``x'`` in ``epoch`` (a module without
        :meth:`~lpa3_lightning.mixins.LPA3ModuleMixin.lpa3_consumes_augmented` always does)."""
        consumes = getattr(pl_module, "lpa3_consumes_augmented", None)
        return True if not callable(consumes) else bool(consumes(epoch))

    @staticmethod
    def _gather_new(new_rows: tuple[Tensor, Tensor, Tensor] | None, request: LPA3Request
                    ) -> tuple[Tensor, Tensor, Tensor]:
        """Every rank's freshly solved (indices, x', labels); a rank without any sends empty rows."""
        if new_rows is None:
            x = request.inputs
            new_rows = (request.indices[:0], x[:0].detach(), request.targets[:0])
        idx, x_new, labels = gather_rows(*new_rows)
        return idx, x_new, labels

    @staticmethod
    def _raise_together(error: Exception | None) -> None:
        # Under DDP a rank that refuses its batch must not leave the others waiting in the
        # next collective: every rank learns of the failure and stops.
        if any_rank_failed(error is not None):
            if error is not None:
                raise error
            raise RuntimeError("LPA3Callback stopped because another process refused its batch; that process's "
                               "log has the reason and the fix.")

    def _select(self, request: LPA3Request, epoch: int) -> tuple[Tensor, int, int, int | None]:
        """The samples to augment (mask), how many TCS selected before the filters below, how many
        remain, and (sync-free path only; None here) how many of those the request's ``train_mask`` keeps."""
        mask = self._memory().select(request.indices, epoch).to(request.inputs.device)
        tcs_selected = int(mask.sum())
        finite = torch.isfinite(request.inputs.flatten(1)).all(dim=1) if request.inputs.numel() else mask
        self._nonfinite = int((~finite).sum())
        mask = mask & finite  # NaN / Inf inputs are never attacked (counted in lpa3/nonfinite_inputs)
        count = int(mask.sum())
        if count == 1:
            # Batch statistics (twin BN in train mode) need two samples; a lone selection is
            # dropped for this batch rather than crashing BatchNorm1d models.
            mask, count = torch.zeros_like(mask), 0
        return mask, tcs_selected, count, None

    def _select_sync_free(self, request: LPA3Request, epoch: int) -> tuple[Tensor, int, int, int]:
        """:meth:`_select` with one host read: the counts (the rows the ``train_mask`` keeps among
        them too) and the request's value checks in one copy."""
        memory = self._memory()
        device = request.inputs.device
        # clamped: an out-of-range index must reach the named error below, not fail in the lookup
        safe = request.indices.clamp(0, memory.num_samples - 1)
        tcs_mask = memory.select(safe, epoch, check_values=False).to(device)
        finite = torch.isfinite(request.inputs.flatten(1)).all(dim=1) if request.inputs.numel() else tcs_mask
        mask = tcs_mask & finite
        trained = mask if request.train_mask is None else mask & request.train_mask.to(device)
        counts = torch.stack([mask.sum(), tcs_mask.sum(), (~finite).sum(), trained.sum(),
                              *(c.to(device) for c in self._bad_value_counts(request))])
        count, tcs_selected, nonfinite, num_trained, *bad = counts.tolist()  # the step's one host read
        self._raise_bad_values(request, memory, bad)
        self._nonfinite = nonfinite
        if count == 1:  # as in _select: a lone selection is dropped
            mask, count, num_trained = torch.zeros_like(mask), 0, 0
        return mask, tcs_selected, count, num_trained

    def _bad_value_counts(self, request: LPA3Request) -> list[Tensor]:
        """Device counts of the request's out-of-range indices and labels, and of the out-of-range
        indices recorded with the predictions of earlier steps (sync-free path; read with its one copy)."""
        memory = self._memory()
        return [count_out_of_range(request.indices, memory.num_samples),
                count_out_of_range(request.targets, memory.num_classes).to(request.indices.device),
                self._bad_recorded_indices.to(request.indices.device)]

    def _raise_bad_values(self, request: LPA3Request, memory: TimeConsistency, bad: Sequence[int]) -> None:
        """The named errors of the default path, for the counts of :meth:`_bad_value_counts` read on the host."""
        bad_indices, bad_labels, bad_recorded = bad
        if bad_indices or bad_labels:
            self._check_request(request, memory.num_classes, memory.num_samples, values=True)
        if bad_recorded:
            raise ValueError(
                f"{int(bad_recorded)} dataset indices recorded with `lpa3_record_predictions` were outside the "
                f"training set [0, {memory.num_samples}). Fix: record the batch's indices of the training set itself "
                "(the ones the dataset returns), not positions in the batch or in a subset."
            )

    def _check_request(self, request: LPA3Request, num_classes: int, num_samples: int, values: bool = True) -> None:
        if not isinstance(request, LPA3Request):
            raise TypeError(f"`lpa3_request` must return an LPA3Request, got {type(request).__name__}.")
        n = request.inputs.shape[0]
        if request.targets.shape != (n,) or request.indices.shape != (n,):
            raise ValueError(
                f"LPA3Request needs targets and indices of shape ({n},) for {n} inputs, got "
                f"{tuple(request.targets.shape)} and {tuple(request.indices.shape)}. Fix: return one label and one "
                "dataset index per sample."
            )
        check_dataset_indices(request.indices, num_samples, name="LPA3Request.indices", values=values)
        train_mask = request.train_mask
        if train_mask is not None and (not isinstance(train_mask, Tensor) or train_mask.dtype != torch.bool
                                       or train_mask.shape != (n,)):
            what = (f"dtype {train_mask.dtype} and shape {tuple(train_mask.shape)}" if isinstance(train_mask, Tensor)
                    else type(train_mask).__name__)
            raise ValueError(f"LPA3Request.train_mask must be a bool tensor of shape ({n},) (one flag per input), got "
                             f"{what}. Fix: pass e.g. `confidence >= threshold`, or None to solve every selected row.")
        check_class_labels(request.targets, num_classes, name="LPA3Request.targets", values=values)

    def _augment(self, trainer: pl.Trainer, pl_module: pl.LightningModule, request: LPA3Request,
                 mask: Tensor, count: int, num_trained: int | None = None,
                 ) -> tuple[AugmentedBatch, tuple[Tensor, Tensor, Tensor] | None]:
        """This rank's hard positives (no collective), and its newly solved rows for the cache:
        plan (:func:`plan_rows`), reference forward, solve, assemble (:func:`assemble_inputs`)."""
        if self._sync_free and self.cache is None:
            trained = count if num_trained is None else num_trained
            return self._augment_uncached(pl_module, request, mask, count, trained), None
        x, y, idx = request.inputs[mask], request.targets[mask], request.indices[mask]
        epoch = trainer.current_epoch
        # a cached x' is reused only for the label it was solved for (pseudo-labels change)
        cached = self.cache.fresh(idx, epoch, y) if self.cache is not None else torch.zeros_like(mask[mask])
        solver_runs = self.cache is None or self.attack_new_selections or self._regeneration_epoch(epoch)
        plan = plan_rows(cached, solver_runs)
        if not bool(plan.keep.all()):
            mask = _drop_selected(mask, ~plan.keep)
            x, y, idx = x[plan.keep], y[plan.keep], idx[plan.keep]
        reuse, solve = plan.reuse[plan.keep], plan.solve[plan.keep]
        # the clean selected rows set the twin statistics (and the training forward's), whether or not
        # the module trains their x'; rows it will not train (request.train_mask) are not solved
        # With a cache every selected row is solved: a row skipped now could not be reused in a
        # later epoch where the module trains it, which would change that epoch's loss.
        reference_x, reference_y, skipped = x, y, 0
        trained = None if request.train_mask is None or self.cache is not None \
            else request.train_mask.to(mask.device)[mask]
        if trained is not None and not bool(trained.all()):
            skipped = int((~trained).sum())
            mask = _drop_selected(mask, ~trained)
            x, y, idx, reuse, solve = x[trained], y[trained], idx[trained], reuse[trained], solve[trained]
        model, bn_mode = self._attack_model(pl_module, reference_x)
        stats, twin_statistics, bn_statistics = None, None, None
        self._last_solver_seconds = 0.0
        if x.shape[0]:
            twin_statistics, bn_statistics = self._reference_forward(
                pl_module, model, reference_x, reference_y, bn_mode,
                trained.nonzero().flatten() if skipped else None)  # type: ignore[union-attr]
        solved = x[solve]
        if solved.shape[0]:
            solved, stats = self._attack(pl_module, model, solved, y[solve], bn_mode, twin_statistics)
        from_cache = self.cache.get(idx[reuse]) if self.cache is not None and bool(reuse.any()) else None
        x_out = assemble_inputs(x, solve, solved, reuse, from_cache)
        new_rows = (idx[solve], solved.detach(), y[solve]) if self.cache is not None else None
        self._eval_preserved = None
        if self.log_eval_preservation and x.shape[0]:
            self._eval_preserved = self._preserved_in_eval_mode(pl_module, model, x, x_out, y)
        augmented = AugmentedBatch(
            inputs=x_out, targets=y, indices=idx, mask=mask, stats=stats, reused=int(reuse.sum()), bn_mode=bn_mode,
            bn_statistics=bn_statistics, allow_tf32=self.allow_tf32,
            reference_inputs=reference_x.detach() if bn_mode == "twin" and x.shape[0] else None, skipped=skipped)
        return augmented, new_rows

    def _augment_uncached(self, pl_module: pl.LightningModule, request: LPA3Request, mask: Tensor,
                          count: int, num_trained: int) -> AugmentedBatch:
        """Without a cache: the sync-free path (no host read). The ``count`` selected rows set the
        twin statistics; the ``num_trained`` of them that the request's ``train_mask`` keeps (all
        without a mask) are solved, the others counted in ``skipped``, as on the default path.

        Rows are gathered by position (:func:`selected_positions`) instead of by boolean
        indexing, whose output size the host would have to read; both counts came with the
        selection's one host read.
        """
        rows = selected_positions(mask, count)
        x, y, idx = (t.index_select(0, rows.to(t.device)) for t in (request.inputs, request.targets, request.indices))
        skipped = count - num_trained
        keep: Tensor | None = None  # positions of the trained rows among the selected ones
        if skipped:
            trained = request.train_mask.to(mask.device).index_select(0, rows)  # type: ignore[union-attr]
            keep = selected_positions(trained, num_trained)
            mask = mask & request.train_mask.to(mask.device)  # type: ignore[union-attr]
        model, bn_mode = self._attack_model(pl_module, x)
        x_solve, y_solve, idx_solve = (x, y, idx) if keep is None else \
            (t.index_select(0, keep.to(t.device)) for t in (x, y, idx))
        x_out, stats, bn_statistics = x_solve.detach().clone(), None, None
        self._last_solver_seconds = None
        self._eval_preserved = None
        if num_trained:
            twin_statistics, bn_statistics = self._reference_forward(pl_module, model, x, y, bn_mode, keep)
            # not timed: the solver's seconds would need a synchronisation
            x_out, stats = self._solve(pl_module, model, x_solve, y_solve, self._generator_for(x), bn_mode,
                                       twin_statistics)
            if self.log_eval_preservation:
                self._eval_preserved = self._preserved_in_eval_mode(pl_module, model, x_solve, x_out, y_solve)
        return AugmentedBatch(
            inputs=x_out, targets=y_solve, indices=idx_solve, mask=mask, stats=stats, reused=0, bn_mode=bn_mode,
            bn_statistics=bn_statistics, allow_tf32=self.allow_tf32,
            reference_inputs=x.detach() if bn_mode == "twin" and num_trained else None, skipped=skipped)

    def _attack_model(self, pl_module: pl.LightningModule, x: Tensor) -> tuple[nn.Module, str]:
        """The network the solver attacks and its BatchNorm mode; the default feature layers are
        those whose hooks fire in the solver's forwards, probed once with the first selected rows."""
        model = unwrap_compiled(pl_module.lpa3_model())
        if self._layer_names is None and x.shape[0]:
            self._check_logit_width(pl_module, model, x)
            self._layer_names = resolve_layers(model, self.layers, example_input=x)
        return model, self._bn_mode(model)

    def _check_logit_width(self, pl_module: pl.LightningModule, model: nn.Module, x: Tensor) -> None:
        """Once per fit, before the first solve: the model's logits must have ``lpa3_num_classes``
        columns (narrower ones would fail deep inside the solver's gather; wider ones would
        size the TCS memory wrongly). One no-grad forward of one row in eval mode, flags restored."""
        with torch.no_grad(), eval_mode(model):
            width = pl_module.lpa3_logits(model(x[:1])).shape[-1]  # type: ignore[operator]
        expected = self._memory().num_classes
        if width != expected:
            raise ValueError(
                f"{type(pl_module).__name__}'s model gives logits of {width} classes but lpa3_num_classes is {expected}. "
                "Fix: set `self.lpa3_num_classes` to the width of the model's logits (the number of classes), or "
                "make `lpa3_logits` return one column per class."
            )

    def _reference_forward(self, pl_module: pl.LightningModule, model: nn.Module, x: Tensor, y: Tensor,
                           bn_mode: str, trained: Tensor | None = None) -> tuple[Any, Any]:
        """The clean ``log p(y|x)`` of the selected rows under the normalisation that the solver
        checks and the training forward of x' uses (kept, for the rows at the positions
        ``trained`` or all, to measure ``lpa3/label_preserved`` after the step). Returns the twin BatchNorms' batch
        statistics of all these clean rows (captured here and frozen; None without twins) and the
        statistics x' is trained under."""
        reference, twin_statistics = label_log_prob(
            model, x, y, bn_mode=bn_mode, logits_fn=pl_module.lpa3_logits,  # type: ignore[arg-type]
            temperature=self.temperature, allow_tf32=self.allow_tf32)
        self._pending = (reference, y) if trained is None else \
            (reference.index_select(0, trained.to(reference.device)), y.index_select(0, trained.to(y.device)))
        return twin_statistics, twin_statistics if bn_mode == "twin" else running_statistics(model)

    def _preserved_in_eval_mode(self, pl_module: pl.LightningModule, model: nn.Module, x: Tensor, x_adv: Tensor,
                                y: Tensor) -> Tensor:
        """Whether each x' keeps the constraint in the deployed model (eval mode, main BN)."""
        logp, _ = label_log_prob(model, torch.cat([x, x_adv]), torch.cat([y, y]), bn_mode="eval",
                                 logits_fn=pl_module.lpa3_logits, temperature=self.temperature,  # type: ignore[arg-type]
                                 allow_tf32=self.allow_tf32)
        clean, adv = logp.chunk(2)
        return adv >= clean - self.sigma

    def _bn_mode(self, model: nn.Module) -> str:
        if self.attack_bn == "auto":
            return "twin" if has_dual_bn(model) else "eval"
        return self.attack_bn

    def _regeneration_epoch(self, epoch: int) -> bool:
        # every K epochs from the first epoch that augments (the callback's warm-up, or the
        # module's, lpa3_consumes_augmented); also when nothing from earlier epochs is left to
        # reuse (a file cache restarts empty on resume; K or warmup_epochs changed)
        start = self.warmup_epochs if self._augment_start is None else self._augment_start
        if (epoch - start) % self.regenerate_every_n_epochs == 0:
            return True
        return self.cache is not None and not self.cache.reusable_from_before(epoch)

    def _attack(self, pl_module: pl.LightningModule, model: nn.Module, x: Tensor, y: Tensor, bn_mode: str,
                twin_statistics: Any) -> tuple[Tensor, Any]:
        start = time.perf_counter()
        x_adv, stats = self._solve(pl_module, model, x, y, self._generator_for(x), bn_mode, twin_statistics)
        if self._sync_free:
            self._last_solver_seconds = None  # timing would need a synchronisation
            return x_adv, stats
        if x.is_cuda:
            torch.cuda.synchronize(x.device)
        self._last_solver_seconds = time.perf_counter() - start
        return x_adv, stats

    def _solve(self, pl_module: pl.LightningModule, model: nn.Module, x: Tensor, y: Tensor,
               generator: torch.Generator | None, bn_mode: str, twin_statistics: Any = None,
               graphs: bool = True) -> tuple[Tensor, Any]:
        """The solver with this callback's settings (training batches and logged grids alike;
        ``graphs=False``: never through a CUDA graph, for a one-off solve such as a grid)."""
        return lpa3_attack(
            model, x, y, sigma=self.sigma, steps=self.steps, lam=self.lam,
            layers=self._layer_names if self._layer_names is not None else self.layers,
            input_range=self._range_for(x, parameter_dtype(model, x.dtype)), temperature=self.temperature,
            generator=generator,
            project=self.project, bn_mode=bn_mode, logits_fn=pl_module.lpa3_logits, fast=self.fast,  # type: ignore[arg-type]
            max_step=self.max_step, allow_tf32=self.allow_tf32, twin_statistics=twin_statistics,
            return_stats=True, sync_free=self._sync_free,
            graphs=self.solver_graphs if graphs else None,  # made only on the sync-free path
        )

    def _range_for(self, x: Tensor, dtype: torch.dtype) -> InputRange:
        """The input range as ``(low, high)`` tensors on ``x``'s device in the solver's ``dtype``,
        resolved (its values checked on the host) once per device, dtype and input shape instead
        of at every solve: building them from Python numbers is a host-to-device copy."""
        if self._resolved_range is None:
            return None
        key = (x.device, dtype, tuple(x.shape[1:]))
        if self._solver_range is None or self._solver_range[0] != key:
            self._solver_range = (key, resolve_input_range(self._resolved_range, x[:1].to(dtype)))
        return self._solver_range[1]

    def _generator_for(self, x: Tensor) -> torch.Generator | None:
        """The solver's generator for this batch, seeded by (seed, rank, epoch, batch index)."""
        if self.seed is None:
            return None
        if self._generator is None or self._generator.device != x.device:
            self._generator = torch.Generator(device=x.device)
        self._generator.manual_seed(batch_noise_seed(self.seed, self._rank, *self._batch_key))
        return self._generator

    def _log_mean(self, pl_module: pl.LightningModule, name: str, value: Tensor | float | None,
                  weight: int) -> None:
        """Per step on this process (when there is a value), per epoch over all processes.

        Every process logs the epoch aggregate at every step, also without a value, so the
        metric's cross-process sync at epoch end meets every process.
        """
        metric = self._epoch_metrics.get(name)
        if metric is None:
            return
        key = f"{self._log_prefix}{name}"
        if value is not None and weight > 0:
            # a Python number becomes a device tensor by a fill, not a host-to-device copy (a sync)
            value = value.float() if isinstance(value, Tensor) else \
                torch.full((), float(value), device=pl_module.device)
            metric.update(value, weight)
            pl_module.log(f"{key}_step", value, on_step=True, on_epoch=False, batch_size=weight)
        pl_module.log(f"{key}_epoch", metric, on_step=False, on_epoch=True, metric_attribute=f"{self._metric_prefix}{name}")

    def _log_batch(self, pl_module: pl.LightningModule, request: LPA3Request, augmented: AugmentedBatch,
                   tcs_selected: int) -> None:
        n = request.inputs.shape[0]
        self._log_mean(pl_module, "selected_fraction", len(augmented) / max(n, 1), n)
        self._log_mean(pl_module, "tcs_selected_fraction", tcs_selected / max(n, 1), n)
        self._log_mean(pl_module, "skipped_fraction", augmented.skipped / max(n, 1), n)
        self._nonfinite_inputs_metric.update(torch.full((), float(self._nonfinite), device=pl_module.device))
        pl_module.log(f"{self._log_prefix}nonfinite_inputs", self._nonfinite_inputs_metric, on_step=False,
                      on_epoch=True, metric_attribute=f"{self._metric_prefix}nonfinite_inputs")
        self._log_mean(pl_module, "reused_fraction", augmented.reused / max(len(augmented), 1), len(augmented))
        stats = augmented.stats
        solved = 0 if stats is None else len(stats.preserved)
        # per-sample statistics: averaged over the solved samples, not the whole batch;
        # tensors, not floats: Lightning accumulates them without a host copy here
        self._log_mean(pl_module, "perceptual_distance", None if stats is None else stats.perceptual_distance.mean(),
                       solved)
        self._log_mean(pl_module, "projected", None if stats is None else stats.projected.float().mean(), solved)
        seconds = self._last_solver_seconds  # None on the sync-free path (not timed)
        self._log_mean(pl_module, "solver_seconds", seconds if solved and seconds is not None else None,
                       1 if solved and seconds is not None else 0)
        eval_kept = self._eval_preserved
        self._log_mean(pl_module, "label_preserved_eval", None if eval_kept is None else eval_kept.float().mean(),
                       0 if eval_kept is None else len(eval_kept))

    def _log_trained_preservation(self, pl_module: pl.LightningModule, untaken: bool = False) -> None:
        """``lpa3/label_preserved`` from the logits of the forward that trained on x'."""
        logits = pl_module.lpa3_pop_augmented_logits() if hasattr(pl_module, "lpa3_pop_augmented_logits") else None
        pending, self._pending = self._pending, None
        kept: Tensor | None = None
        if pending is not None:
            reference, y = pending
            if logits is not None and logits.shape[0] == y.shape[0]:
                logp = F.log_softmax(logits.float() / self.temperature, dim=1).gather(1, y[:, None].long()).squeeze(1)
                kept = logp >= reference.to(logp.device) - self.sigma
            elif not untaken and not self._warned_unmeasured:
                rank_zero_warn(
                    f"{type(pl_module).__name__} trained on x' without `self.lpa3_forward_augmented(augmented)`, so "
                    "LPA3Callback cannot measure whether x' keeps its label in the forward that trains on it "
                    "(lpa3/label_preserved is not logged). Fix: compute the logits of x' with "
                    "`self.lpa3_forward_augmented(augmented)`, which also trains them under the normalisation the "
                    "solver verified."
                )
                self._warned_unmeasured = True
        self._log_mean(pl_module, "label_preserved", None if kept is None else kept.float().mean(),
                       0 if kept is None else len(kept))

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._networks:
            for child, view in self._each_network(pl_module):
                child.on_train_batch_end(trainer, view, outputs, batch, batch_idx)  # type: ignore[arg-type]
            return
        predictions = pl_module.lpa3_pop_predictions()
        pending = getattr(pl_module, "lpa3_augmented_pending", None)
        untaken = bool(pending()) if callable(pending) else False  # the module chose not to train on x'
        pl_module.lpa3_set_augmented(None)
        if trainer.current_epoch >= self.warmup_epochs:
            self._log_trained_preservation(pl_module, untaken)
        memory = self._memory()
        error: Exception | None = None
        if predictions is None:
            error = RuntimeError(
                f"{type(pl_module).__name__}.training_step did not record its predictions. Fix: call "
                "`self.lpa3_record_predictions(indices, logits)` with the clean logits (the TCS memory needs them)."
            )
        elif predictions[1].dim() != 2 or predictions[1].shape[1] != memory.num_classes:
            error = ValueError(
                f"The recorded logits have shape {tuple(predictions[1].shape)} but lpa3_num_classes is "
                f"{memory.num_classes}. Fix: set `self.lpa3_num_classes` to the width of the model's logits."
            )
        self._raise_together(error)
        indices, logits, targets = predictions  # type: ignore[misc]
        probs = torch.softmax(logits.float() / self.temperature, dim=1)
        # Every rank applies every rank's predictions, so the memory (and with it the
        # threshold and the selection) is identical everywhere; a no-op on one process.
        indices, probs, targets = gather_predictions(indices.to(probs.device), probs,
                                                     None if targets is None else targets.to(probs.device))
        self._rows_recorded += int(indices.shape[0])  # (a shape: no host read)
        self._update_memory(memory, indices.to(memory.device), probs, targets, trainer.current_epoch)

    def _update_memory(self, memory: TimeConsistency, indices: Tensor, probs: Tensor, targets: Tensor | None,
                       epoch: int) -> None:
        """Apply every process's predictions of this step to the TCS memory (the update step)."""
        # Non-finite predictions would poison a sample's score for good; DistributedSampler's
        # padding repeats samples in a later step of the epoch: apply each sample once an epoch.
        finite = torch.isfinite(probs).all(dim=1).to(memory.device)
        if self._sync_free:  # the same update, selected with torch.where: no host read
            self._nonfinite_predictions = self._nonfinite_predictions + (~finite).sum()
            # out-of-range indices are counted (refused with the next host read) and never applied
            in_range = (indices >= 0) & (indices < memory.num_samples)
            self._bad_recorded_indices = self._bad_recorded_indices + (~in_range).sum()
            indices = indices.clamp(0, memory.num_samples - 1)
            keep = finite & in_range & (self._last_update_epoch[indices] != epoch)
            self._last_update_epoch[indices] = torch.where(keep, epoch, self._last_update_epoch[indices])
            memory.update(indices, probs, targets, keep=keep, check_values=False)
            return
        keep = finite & (self._last_update_epoch[indices] != epoch)
        self._nonfinite_predictions += int((~finite).sum())
        self._last_update_epoch[indices[keep]] = epoch
        keep_dev = keep.to(probs.device)
        memory.update(indices[keep], probs[keep_dev], None if targets is None else targets[keep_dev])

    def _memory(self) -> TimeConsistency:
        if self.tcs is None:
            raise RuntimeError("LPA3Callback's TCS memory is not allocated: on_train_start did not run for it.")
        return self.tcs

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._networks:
            for child, view in self._each_network(pl_module):
                child.on_train_epoch_end(trainer, view)  # type: ignore[arg-type]
            return
        if self.tcs is None:
            return
        if self._sync_free and int(self._bad_recorded_indices):  # the last steps' recorded indices (once an epoch)
            self._raise_bad_values(None, self.tcs, (0, 0, int(self._bad_recorded_indices)))  # type: ignore[arg-type]
        self._check_memory_coverage()
        self.tcs.refresh_threshold()
        if self.log_images_every_n_epochs and trainer.current_epoch % self.log_images_every_n_epochs == 0:
            # on every rank: the grid's request forwards the module in train mode (FixMatch's weak
            # view), a collective under SyncBatchNorm; rank 0 logs it
            self._log_grid(trainer, pl_module)
        # the counts are of all ranks' gathered predictions: equal on every rank, like the threshold
        pl_module.log(f"{self._log_prefix}nonfinite_predictions", float(self._nonfinite_predictions), sync_dist=True,
                      reduce_fx="max")
        self._nonfinite_predictions = 0
        if self.tcs.has_threshold:
            pl_module.log(f"{self._log_prefix}threshold", float(self.tcs.threshold), sync_dist=True, reduce_fx="max")

    def _check_memory_coverage(self) -> None:
        """Once the memory was fed three times its size in rows, warn once when it saw far fewer
        distinct indices than it has rows (``num_samples`` / ``lpa3_num_samples`` larger than
        the set the indices come from): the rows never seen keep their first score, and the
        threshold ranks them with the rest. (Three times: drawn with replacement, a set of N
        rows shows 95% of its indices by then.)"""
        if self._coverage_checked or self.tcs is None or self._rows_recorded < 3 * self.tcs.num_samples:
            return
        self._coverage_checked = True
        seen, total = int(self.tcs.seen.sum()), self.tcs.num_samples  # one host read, once a fit
        if seen < 0.8 * total:
            rank_zero_warn(
                f"LPA3Callback's TCS memory has {total} rows, but {self._rows_recorded} recorded predictions named only "
                f"{seen} distinct dataset indices: the rows never seen keep their first score and take part in the "
                "selection threshold. Fix: set `num_samples=` (or the module's `lpa3_num_samples`) to the size of the "
                "set the recorded indices come from."
            )

    def _log_grid(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        dataset = getattr(trainer.train_dataloader, "dataset", None)
        logger = trainer.logger
        # decided by the logger's class, the same on every rank (a non-zero rank's `experiment` is
        # Lightning's dummy, which answers every attribute: the ranks would disagree on the forward)
        can_log = hasattr(type(logger), "log_image") or isinstance(logger, pl.loggers.TensorBoardLogger)
        if dataset is None or not can_log:
            if not self._warned_grid:
                rank_zero_warn("LPA3Callback cannot log image grids here (no train dataset, or a logger without "
                               "images). Fix: use TensorBoardLogger (or a logger with `log_image`), or set "
                               "log_images_every_n_epochs=0.")
                self._warned_grid = True
            return
        # The picture must not change the run: its random draws (transforms, solver noise)
        # come from a forked global generator and a generator of its own.
        with torch.random.fork_rng(devices=[]):
            count = min(self.num_logged_images, len(dataset))
            batch = pl_module.transfer_batch_to_device(default_collate([dataset[i] for i in range(count)]),
                                                       pl_module.device, 0)
            request = pl_module.lpa3_request(batch)
            if request.inputs.shape[0] == 0 or request.inputs.dim() != 4 or request.inputs.shape[1] not in (1, 3):
                return  # not images: the logged perceptual distance is the picture
            model = unwrap_compiled(pl_module.lpa3_model())
            x_adv, _ = self._solve(pl_module, model, request.inputs, request.targets,
                                   torch.Generator(device=request.inputs.device).manual_seed(0), "eval",
                                   graphs=False)  # a one-off solve: a graph would hold memory for the fit
        normalization = self._resolved_range if isinstance(self._resolved_range, Mapping) else None
        self.last_grid = comparison_grid(request.inputs, x_adv, normalization)
        if not trainer.is_global_zero:
            return
        if hasattr(logger, "log_image"):
            logger.log_image(key=f"{self._log_prefix}examples", images=[self.last_grid], step=trainer.global_step)
        else:
            logger.experiment.add_image(f"{self._log_prefix}examples (rows: x, x', |x'-x| stretched)", self.last_grid,
                                        trainer.global_step)

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        if self._networks:  # several networks: one single-network state per name
            return {"version": _STATE_VERSION,
                    "networks": {name: child.state_dict() for name, child in self._networks.items()}}
        tcs_state = self.tcs.state_dict() if self.tcs is not None else None
        cache_state = self.cache.state_dict(include_inputs=self.checkpoint_cache) if self.cache is not None else None
        return {"version": _STATE_VERSION, "tcs": tcs_state,
                "augmentation_cache": cache_state, "global_rng": _global_rng_state(),
                "last_update_epoch": self._last_update_epoch.cpu().clone(), "settings": self.solver_settings(),
                "augment_start": self._augment_start}

    def solver_settings(self) -> dict[str, Any]:
        """The settings the solver ran with, as plain values (saved in checkpoints, so that
        ``lpa3 show`` draws the ``x'`` that training made)."""
        layers = self._layer_names if self._layer_names is not None else self.layers
        return {"sigma": self.sigma, "steps": self.steps, "lam": self.lam, "temperature": self.temperature,
                "max_step": self.max_step, "attack_bn": self.attack_bn, "project": self.project, "fast": self.fast,
                "allow_tf32": self.allow_tf32, "layers": None if layers is None else
                ([layers] if isinstance(layers, str) else list(layers))}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        networks = state_dict.get("networks")
        if networks is not None:
            if self._networks:
                self._load_network_states(networks)
            else:  # restored before setup saw the module: applied when the networks exist
                self._network_states = dict(networks)
            return
        if self._networks:
            raise ValueError(
                f"The checkpoint holds LPA3Callback state for one network, but the module declares "
                f"{list(self._networks)}. Fix: resume with the module the checkpoint was written with."
            )
        self._restored = True
        tcs_state = state_dict.get("tcs")
        if tcs_state is not None:
            # Rebuilt from the checkpoint alone, so the state is there before training starts;
            # on_train_start checks it against the current data set and module.
            self.tcs = TimeConsistency(
                int(tcs_state["num_samples"]), int(tcs_state["num_classes"]), self.ratio,
                divergence=self.tcs_divergence, initial_memory=self.tcs_initial_memory,
                initial_selection=self.initial_selection, seed=self._tcs_seed(),
                threshold_rule=self.threshold_rule,
            )
            self.tcs.load_state_dict(tcs_state)
        # (a "generator_state" of a version-3 checkpoint is not needed: the noise seed is derived per batch)
        self._last_update_epoch = state_dict.get("last_update_epoch", torch.zeros(0, dtype=torch.long)).clone()
        self._augment_start = state_dict.get("augment_start")
        # Applied in on_train_start, after the model was built (which draws random numbers).
        self._rng_to_restore = state_dict.get("global_rng")
        cache_state = state_dict.get("augmentation_cache")  # absent in checkpoints of older versions
        if cache_state is not None and self.regenerate_every_n_epochs > 1:
            self.cache = AugmentationCache(int(cache_state["num_samples"]), self.regenerate_every_n_epochs,
                                           self.cache_max_bytes)
            self.cache.load_state_dict(cache_state)

    def _load_network_states(self, states: Mapping[str, Any]) -> None:
        if set(states) != set(self._networks):
            raise ValueError(
                f"The checkpoint holds LPA3Callback state for the networks {sorted(states)}, but the module declares "
                f"{list(self._networks)}. Fix: resume with the module the checkpoint was written with."
            )
        for name, child in self._networks.items():
            child.load_state_dict(states[name])
        self._network_states = None
