"""LPA3Callback: label-preserving adversarial auto-augmentation inside any Lightning Trainer.

This file holds the Lightning hooks; each hands its work to the runner of every network of the
module (:mod:`~lpa3_lightning.callback.runner`), whose stages are modules of their own: the
request's checks, the selection, the hard positives, the logs and the memory update.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor

from lpa3_lightning.callback.module_checks import (
    check_module,
    check_synced_batchnorm,
    infer_num_samples,
    input_range_of,
)
from lpa3_lightning.callback.networks import NetworkView, module_networks
from lpa3_lightning.callback.runner import NetworkRunner
from lpa3_lightning.callback.settings import (
    CacheSettings,
    LoggingSettings,
    RuntimeSettings,
    SelectionSettings,
    SolverSettings,
    moved_setting,
    preset_groups,
)
from lpa3_lightning.core.attack import check_solver_arguments
from lpa3_lightning.core.augmented import AugmentedBatch
from lpa3_lightning.core.distributed import all_equal
from lpa3_lightning.core.dual_bn import anchor_twin_parameters
from lpa3_lightning.core.input_box import InputRange
from lpa3_lightning.core.model_outputs import unwrap_compiled
from lpa3_lightning.core.selection import check_ratio

__all__ = ["LPA3Callback"]

# 2 added the x' cache, the global RNG and the per-epoch update record; 3 the cache's labels; 4 dropped the
# solver's generator state (its seed is derived per batch) and added the solver's settings
_STATE_VERSION = 4


class LPA3Callback(Callback):
    r"""Generate LP-A3 hard positives for the least time-consistent samples of each batch.

    On every training batch the callback asks the module for its inputs, labels and dataset
    indices (:class:`~lpa3_lightning.mixins.LPA3ModuleMixin`), selects the samples whose
    time-consistency score is below the threshold of the last pass, solves their hard positives
    with :func:`~lpa3_lightning.core.attack.lpa3_attack` and hands them to the module before
    ``training_step``. After the step it updates the TCS memory from the clean logits the module
    recorded; after each epoch it refreshes the threshold.

    Logged (``<name>_step`` per step on each process, ``<name>_epoch`` per epoch over all
    processes): ``lpa3/selected_fraction`` (the share of the batch given an ``x'``),
    ``lpa3/perceptual_distance``, ``lpa3/label_preserved`` (the share of the trained ``x'`` with
    ``log p(y|x') >= log p(y|x) - sigma`` in the forward that trained them),
    ``lpa3/label_preserved_eval`` (the same in the deployed model, a diagnostic),
    ``lpa3/projected`` (pulled back by the bisection), ``lpa3/solver_seconds`` (not on the
    sync-free path), ``lpa3/reused_fraction`` (with a cache), ``lpa3/tcs_selected_fraction``,
    ``lpa3/skipped_fraction`` (selected but not solved: the request's ``train_mask``); per epoch
    ``lpa3/threshold``, ``lpa3/nonfinite_inputs`` and ``lpa3/nonfinite_predictions``. A module
    with several networks gets each under ``lpa3/<network>/``.

    Args:
        ratio: fraction of samples given LP-A3 (tau), in (0, 1].
        sigma: the label-preserving margin on ``log p`` (0.02 for MedMNIST in the paper).
        steps: solver iterations (the paper: 5).
        warmup_epochs: epochs at the start without augmentation (TCS still updates). A module
            may also say in which epochs its loss trains ``x'``
            (:meth:`~lpa3_lightning.mixins.LPA3ModuleMixin.lpa3_consumes_augmented`: PES's semi
            phase, DivideMix after its warm-up, FixMatch after its LP-A3 loss warm-up): the
            callback solves only in those.
        seed: seed of the solver's initial noise: each batch's noise comes from a generator
            seeded by (seed, rank, epoch, batch index), so every rank draws its own and a
            resumed run draws on each rank what an uninterrupted run draws there. None draws
            from torch's global generator.
        layers: feature layers (names or glob patterns of ``module.lpa3_model()``); None for the
            documented default.
        input_range: the valid input box for the solver's clamp: ``"auto"`` (the data module's
            ``normalization``, ``{"mean", "std"}`` of [0, 1] data, when it has one; else none),
            None (never clamp), ``(low, high)`` or ``{"mean": ..., "std": ...}``.
        preset: ``"package"`` (this package's defaults) or ``"authors"`` (the LP-A3 authors'
            behaviour where a switch restores it: :data:`~lpa3_lightning.callback.settings.PRESETS`).
        solver: :class:`~lpa3_lightning.callback.settings.SolverSettings` (or a mapping of its
            fields): the multiplier, temperature, projection, step bound, BN mode, TF32.
        selection: :class:`~lpa3_lightning.callback.settings.SelectionSettings`: the memory's
            size and the TCS rules.
        cache: :class:`~lpa3_lightning.callback.settings.CacheSettings`: reusing ``x'`` for K epochs.
        runtime: :class:`~lpa3_lightning.callback.settings.RuntimeSettings`: the sync-free path,
            CUDA graphs, restoring the global random state.
        logging: :class:`~lpa3_lightning.callback.settings.LoggingSettings`: image grids and the
            eval-mode check.

    Raises:
        ValueError: on a setting out of range, naming it and the fix; TypeError for a former
            keyword argument (``regenerate_every_n_epochs=...``), naming its group.

    Example::

        trainer = Trainer(callbacks=[LPA3Callback(ratio=0.5, sigma=0.02, cache={"regenerate_every_n_epochs": 10})])
        trainer.fit(LPA3Classifier(num_classes=2), datamodule=MedMNISTDataModule("breastmnist"))
    """

    def __init__(
        self,
        ratio: float = 0.5,
        sigma: float = 0.02,
        steps: int = 5,
        warmup_epochs: int = 0,
        seed: int | None = None,
        layers: str | Sequence[str] | None = None,
        input_range: InputRange | Literal["auto"] = "auto",
        preset: Literal["package", "authors"] = "package",
        solver: SolverSettings | None = None,
        selection: SelectionSettings | None = None,
        cache: CacheSettings | None = None,
        runtime: RuntimeSettings | None = None,
        logging: LoggingSettings | None = None,
        **moved: Any,
    ) -> None:
        if moved:
            raise TypeError(moved_setting(next(iter(moved))))
        self.ratio = check_ratio(ratio)
        check_solver_arguments(sigma, steps, 1.0, 1.0)
        if isinstance(warmup_epochs, bool) or not isinstance(warmup_epochs, int) or warmup_epochs < 0:
            raise ValueError(f"`warmup_epochs` must be an int >= 0, got {warmup_epochs!r}. Fix: use 0 (no warm-up).")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"`seed` must be None or an int, got {seed!r}.")
        if layers is not None and not isinstance(layers, (str, Sequence)):
            raise ValueError(f"`layers` must be None, a name/pattern or a list of them, got {layers!r}.")
        if input_range not in ("auto", None) and not isinstance(input_range, (Mapping, Sequence)):
            raise ValueError(f"`input_range` must be 'auto', None, (low, high) or {{'mean', 'std'}}, got "
                             f"{input_range!r}.")
        self.sigma, self.steps, self.warmup_epochs, self.seed = float(sigma), steps, warmup_epochs, seed
        self.layers, self.input_range, self.preset = layers, input_range, preset
        groups = preset_groups(preset, solver=solver, selection=selection, cache=cache, runtime=runtime,
                               logging=logging)
        self.solver: SolverSettings = groups["solver"]
        self.selection: SelectionSettings = groups["selection"]
        self.cache_settings: CacheSettings = groups["cache"]
        self.runtime: RuntimeSettings = groups["runtime"]
        self.logging: LoggingSettings = groups["logging"]
        self._runners: dict[str | None, NetworkRunner] = {None: NetworkRunner(self)}
        self._views: dict[str | None, Any] = {}
        self._network_states: dict[str, Any] | None = None  # loaded before setup knew the networks
        self._rng_to_restore: dict[str, Any] | None = None
        self._warned_no_range = [False]

    # ------------------------------------------------------------------ what a user reads back
    @property
    def cache(self) -> Any:
        """The ``x'`` cache of the module's only network (None without one; see :attr:`networks`)."""
        return self._single().cache

    @property
    def tcs(self) -> Any:
        """The TCS memory of the module's only network (see :attr:`networks` for several)."""
        return self._single().tcs

    @property
    def solver_graphs(self) -> Any:
        """The CUDA graphs of the solver (``runtime.cuda_graphs``; None otherwise)."""
        return self._single().solver_graphs

    @property
    def last_grid(self) -> Tensor | None:
        """The last image grid drawn (``logging.images_every_n_epochs``)."""
        return self._single().last_grid

    @property
    def networks(self) -> dict[str, NetworkRunner]:
        """The runner of each named network (each with its ``tcs`` and ``cache``) of a module that
        declares several; empty for a single network."""
        return {name: runner for name, runner in self._runners.items() if name is not None}

    def _single(self) -> NetworkRunner:
        if None not in self._runners:
            raise AttributeError(f"The module has several networks {list(self.networks)}: read them from "
                                 "`callback.networks[name]`.")
        return self._runners[None]

    @property
    def state_key(self) -> str:
        # One fixed key: a resumed run with other settings (or a subclass) still finds its
        # time-consistency memory; the memory does not depend on ratio or sigma.
        return "LPA3Callback"

    def on_augmented(self, trainer: pl.Trainer, pl_module: pl.LightningModule, augmented: AugmentedBatch) -> None:
        """Called with each batch's hard positives as they are handed to the module (before
        ``training_step``; ``augmented.network`` names the network). Override to look at them;
        the default does nothing."""

    # ------------------------------------------------------------------ the fit
    def _each(self, pl_module: pl.LightningModule) -> list[tuple[NetworkRunner, Any]]:
        """(runner, module or its network's view) in the declared order (the same on every rank)."""
        return [(runner, self._views.get(name, pl_module)) for name, runner in self._runners.items()]

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        names = module_networks(pl_module)
        if names is None:
            if None not in self._runners:
                self._runners = {None: NetworkRunner(self)}
            self._views = {}
        else:
            if list(self._runners) != list(names):
                if None in self._runners and self._runners[None].restored:
                    raise ValueError(
                        f"The checkpoint holds LPA3Callback state for one network, but {type(pl_module).__name__} "
                        f"declares {list(names)}. Fix: resume with the module the checkpoint was written with."
                    )
                self._runners = {name: NetworkRunner(self, name, k) for k, name in enumerate(names)}
            self._views = {name: NetworkView(pl_module, name) for name in names}
        if self._network_states is not None:
            self._load_runner_states(self._network_states)
        for _, module in self._each(pl_module):
            check_module(module, self.layers, self.solver.attack_bn)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for _, module in self._each(pl_module):
            model = unwrap_compiled(module.lpa3_model())
            check_synced_batchnorm(model, trainer.world_size)
            # Under DDP every twin parameter joins every step's graph (a zero gradient in steps
            # without x'), whatever the module's loss does: no "Expected to have finished reduction".
            anchor_twin_parameters(model, trainer.world_size > 1)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._rng_to_restore is not None and self.runtime.restore_rng and trainer.world_size == 1:
            # Dropout, random transforms and un-seeded attacks continue the interrupted run's
            # random stream, so a resumed run equals an uninterrupted one.
            _set_global_rng_state(self._rng_to_restore)
        self._rng_to_restore = None
        input_range = input_range_of(trainer, self.input_range, self._warned_no_range)
        for runner, module in self._each(pl_module):
            num_classes = getattr(module, "lpa3_num_classes", None)
            if not isinstance(num_classes, int) or num_classes < 2:
                raise ValueError(
                    f"{type(pl_module).__name__}.lpa3_num_classes must be the number of classes (int >= 2), got "
                    f"{num_classes!r}. Fix: set `self.lpa3_num_classes = num_classes` in __init__."
                )
            num_samples = infer_num_samples(trainer, module, self.selection.num_samples)
            if not all_equal(num_samples) or not all_equal(num_classes):
                raise ValueError(
                    "The processes disagree on the training-set size or the number of classes. Fix: give every rank "
                    "the same dataset with global indices (Lightning's DistributedSampler does this), not per-rank "
                    "shards."
                )
            runner.start(trainer, module, num_samples, num_classes, input_range)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        for runner, module in self._each(pl_module):
            runner.batch_start(trainer, module, batch, batch_idx)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        for runner, module in self._each(pl_module):
            runner.batch_end(trainer, module)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for runner, module in self._each(pl_module):
            if runner.tcs is not None:
                runner.epoch_end(trainer, module)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._teardown(pl_module)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._teardown(pl_module)

    def _teardown(self, pl_module: pl.LightningModule) -> None:
        # the twin anchor is for the DDP fit only; a file cache is deleted with its run. The
        # module's own networks, not the runners: a fit that failed before setup (a missing data
        # file) has no runner per network yet, and the error must stay the user's.
        if callable(getattr(pl_module, "lpa3_model", None)):
            names = module_networks(pl_module)
            for module in [pl_module] if names is None else [NetworkView(pl_module, name) for name in names]:
                anchor_twin_parameters(unwrap_compiled(module.lpa3_model()), False)
        for runner in self._runners.values():
            runner.teardown()

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        if None in self._runners:  # one network: its state at the top level (the layout of every version)
            return {"version": _STATE_VERSION, **self._runners[None].state_dict(), "global_rng": _global_rng_state()}
        return {"version": _STATE_VERSION, "global_rng": _global_rng_state(),
                "networks": {name: runner.state_dict() for name, runner in self._runners.items()}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        networks = state_dict.get("networks")
        # Applied in on_train_start, after the model was built (which draws random numbers); an
        # older checkpoint of several networks kept it in each network's state.
        self._rng_to_restore = state_dict.get("global_rng") or \
            next((s.get("global_rng") for s in (networks or {}).values() if s.get("global_rng")), None)
        if networks is None:
            if None not in self._runners:
                raise ValueError(
                    f"The checkpoint holds LPA3Callback state for one network, but the module declares "
                    f"{list(self._runners)}. Fix: resume with the module the checkpoint was written with."
                )
            self._runners[None].load_state_dict(state_dict)
        elif None in self._runners:  # restored before setup saw the module: applied when the networks exist
            self._network_states = dict(networks)
        else:
            self._load_runner_states(networks)

    def _load_runner_states(self, states: Mapping[str, Any]) -> None:
        if None in self._runners or set(states) != set(self._runners):
            declared = "one network" if None in self._runners else f"the networks {list(self._runners)}"
            raise ValueError(
                f"The checkpoint holds LPA3Callback state for the networks {sorted(states)}, but the module declares "
                f"{declared}. Fix: resume with the module the checkpoint was written with (its `lpa3_networks()`)."
            )
        for name, runner in self._runners.items():
            runner.load_state_dict(states[name])
        self._network_states = None


def _global_rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_global_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])
