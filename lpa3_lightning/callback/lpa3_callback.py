"""LPA3Callback: label-preserving adversarial auto-augmentation inside any Lightning Trainer.

The hooks hand each batch to the runner of every network of the module (:mod:`.runner`); the selection rule
is one method a subclass may override (:meth:`LPA3Callback.select`); the step's one reduction over the ranks
is :func:`.runner.agree`.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Sequence
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor

from lpa3_lightning.callback.checkpoint_io import AtomicCheckpointIO
from lpa3_lightning.callback.fit_checks import (
    NetworkView,
    check_module,
    check_synced_batchnorm,
    input_range_of,
    memory_shape,
    module_networks,
)
from lpa3_lightning.callback.logging import ConsoleReport, measured_step
from lpa3_lightning.callback.rank_agreement import agreed_seed, fail_together
from lpa3_lightning.callback.resume_point import (
    ResumeBookkeeping,
    refuse_a_split_memory_outside_lightning,
    refuse_an_unrestored_loader_position,
    warn_of_other_lpa3_states,
)
from lpa3_lightning.callback.runner import NetworkRunner, agree
from lpa3_lightning.callback.settings import (
    Augment,
    CacheSettings,
    LoggingSettings,
    RunSettings,
    SelectionSettings,
    SolverSettings,
    check_augment,
    preset_groups,
    unknown_argument,
)
from lpa3_lightning.core.checks import check_int, check_number, unwrap_compiled
from lpa3_lightning.core.dual_bn import anchor_twin_parameters
from lpa3_lightning.core.input_box import InputRange, is_input_range_form
from lpa3_lightning.core.tcs import TimeConsistency, check_ratio
from lpa3_lightning.methods.base import AugmentedBatch, LPA3Request, consumes_augmented

__all__ = ["LPA3Callback", "lone_rows_dropped"]

#: The version of :meth:`LPA3Callback.state_dict`; a checkpoint of another is refused by name.
STATE_VERSION = 5


def lone_rows_dropped(mask: Tensor) -> Tensor:
    """``mask`` with a lone selected row dropped (batch statistics need two rows; a one-row BatchNorm1d fails)."""
    return torch.zeros_like(mask) if int(mask.sum()) == 1 else mask


class LPA3Callback(Callback):
    r"""Generate LP-A3 hard positives for the least time-consistent samples of each batch.

    On every training batch the callback asks the module for its inputs, labels and dataset indices
    (:class:`~lpa3_lightning.mixins.LPA3ModuleMixin`), selects the rows the rule :meth:`select` gives (the
    least time-consistent), solves their hard positives and hands them to the module before ``training_step``;
    after the step it updates the TCS memory from the clean logits the module recorded; after each epoch it
    refreshes the threshold. It logs ``lpa3/...`` diagnostics (``<name>_step`` and ``<name>_epoch``, the list in
    docs/how-it-works.md; NaN on a step without ``x'``), puts ``lpa3_x'`` and ``lpa3_time`` (LP-A3's share of
    the step time) on the progress bar and sums up at the fit's end. Under DDP each step makes one reduction,
    carrying every rank's failure and its module's ``lpa3_consumes_augmented`` answer: no rank is left waiting.
    A checkpoint of an epoch's last batch resumes into that epoch's end (:mod:`.resume_point`); Lightning's
    default checkpoint writer is replaced by :class:`~lpa3_lightning.callback.checkpoint_io.AtomicCheckpointIO`.

    Args:
        ratio: fraction of samples given LP-A3 (tau), in (0, 1].
        sigma: the label-preserving margin on ``log p`` (0.02 for MedMNIST in the paper).
        steps: solver iterations (the paper: 5).
        warmup_epochs: epochs at the start without augmentation (TCS still updates); the module's
            ``lpa3_consumes_augmented(epoch)`` may exclude more.
        seed: seed of the solver's noise (per (seed, rank, epoch, batch index)) and of the random selection. None:
            ``torch.initial_seed()`` at the first fit (rank 0's), kept in checkpoints. Torch's global generator is
            never drawn from.
        layers: feature layers (names or glob patterns of ``module.lpa3_model()``); None for the default.
        input_range: the solver's input box: ``"auto"`` (the data module's ``normalization``), None (no clamp),
            ``(low, high)`` or ``{"mean": ..., "std": ...}`` of [0, 1] data.
        preset: ``"package"`` (this package's defaults) or ``"authors"`` (the LP-A3 authors' behaviour where a
            switch restores it), for the groups not given.
        augment: ``"lpa3"`` (hard positives); the controls, which train the rows, labels and weights LP-A3 would
            without the solver: ``"null"`` (``x' = x``) and ``"noise"`` (a random direction, ``noise_norm`` long
            inside the input box); ``"off"``: nothing at all (one config runs with and without LP-A3).
        noise_norm: the L2 norm of ``augment="noise"`` (e.g. an LP-A3 run's mean ``lpa3/input_distance``).
        solver: :class:`~lpa3_lightning.core.solver.SolverSettings` (or a mapping of its fields).
        selection: :class:`~lpa3_lightning.callback.settings.SelectionSettings`: the memory and its rules.
        cache: :class:`~lpa3_lightning.callback.settings.CacheSettings`: reusing ``x'`` for K epochs.
        logging: :class:`~lpa3_lightning.callback.settings.LoggingSettings`: how often, grids, the eval check.

    Raises:
        ValueError: a setting out of range; TypeError: an argument it does not take (naming its group).

    Example::

        trainer = Trainer(callbacks=[LPA3Callback(ratio=0.5, sigma=0.02, cache={"regenerate_every_n_epochs": 10})])
    """

    #: the marker by which modules find the callbacks of a Trainer (:data:`lpa3_lightning.methods.base.CALLBACK_MARKER`)
    is_lpa3_callback = True

    def __init__(self, ratio: float = 0.5, sigma: float = 0.02, steps: int = 5, warmup_epochs: int = 0,
                 seed: int | None = None, layers: str | Sequence[str] | None = None,
                 input_range: InputRange | Literal["auto"] = "auto", preset: Literal["package", "authors"] = "package",
                 augment: Augment = "lpa3", noise_norm: float | None = None, solver: SolverSettings | None = None,
                 selection: SelectionSettings | None = None, cache: CacheSettings | None = None,
                 logging: LoggingSettings | None = None, **unknown: Any) -> None:
        if unknown:
            arguments = [p for p in inspect.signature(LPA3Callback.__init__).parameters if p not in ("self", "unknown")]
            raise TypeError(unknown_argument(next(iter(unknown)), arguments))
        self.ratio = check_ratio(ratio)
        self.sigma = check_number(sigma, "sigma", "use 0.002 to 0.02 (paper).", above=0)
        check_int(steps, "steps", 1, "use 5 (the paper's T).")
        check_int(warmup_epochs, "warmup_epochs", 0, "use 0 (no warm-up).")
        if seed is not None:
            check_int(seed, "seed", 0, "use None or a non-negative int.")
        if layers is not None and not isinstance(layers, (str, Sequence)):
            raise ValueError(f"`layers` must be None, a name/pattern or a list of them, got {layers!r}. Fix: e.g. None (the "
                             "default layers) or ['layer3', 'layer4'] (`lpa3 show` lists a model's names).")
        if not is_input_range_form(input_range):
            raise ValueError(f"`input_range` must be 'auto', None, (low, high) or {{'mean': ..., 'std': ...}}, got "
                             f"{input_range!r}. Fix: e.g. (0.0, 1.0) for pixels in [0, 1], the normalisation's "
                             "{'mean': [...], 'std': [...]}, or None for no box.")
        self.steps, self.warmup_epochs, self.seed = steps, warmup_epochs, seed
        self.layers, self.input_range, self.preset = layers, input_range, preset
        groups = preset_groups(preset, solver=solver, selection=selection, cache=cache, logging=logging)
        self.solver: SolverSettings = groups["solver"]
        self.selection: SelectionSettings = groups["selection"]
        self.cache: CacheSettings = groups["cache"]
        self.logging: LoggingSettings = groups["logging"]
        self.augment, self.noise_norm = check_augment(augment, noise_norm, self.cache.regenerate_every_n_epochs)
        self._runners: dict[str | None, NetworkRunner] = {None: NetworkRunner()}
        self._views: dict[str | None, Any] = {}
        self._base_seed: int | None = seed  # fixed at the first fit when None, then kept in checkpoints
        self._off_state: dict[str, Any] | None = None  # augment="off": a checkpoint's LP-A3 state, kept as it came
        self._resume = ResumeBookkeeping()
        self._console = ConsoleReport()
        self._deferred: Exception | None = None  # a rank's hand-over failure under DDP, raised after the step
        self._step_counts = (0, 0)

    # ------------------------------------------------------------------ what a subclass may change
    def select(self, memory: TimeConsistency, request: LPA3Request, finite: Tensor, epoch: int) -> tuple[Tensor, Tensor]:
        """The selection rule: which rows of a batch get an ``x'``.

        Returns ``(the memory's mask, the rows to augment)``, both ``(B,)`` bool: LP-A3's rule is the memory's
        (the scores below the last pass's threshold; a seeded random ``ratio`` share before the first, or
        every epoch with ``selection.criterion="random"``), less the rows with NaN or Inf inputs, and nothing
        when a single row is left (batch statistics need two). Override to select otherwise (on every rank it
        runs on that rank's batch; no collective may depend on it).
        """
        by_memory = memory.select(request.indices, epoch).to(request.inputs.device)
        return by_memory, lone_rows_dropped(by_memory & finite)

    def on_augmented(self, trainer: pl.Trainer, pl_module: pl.LightningModule, augmented: AugmentedBatch) -> None:
        """Called with each batch's hard positives as they are handed to the module; the default does nothing."""

    # ------------------------------------------------------------------ what a user reads back
    def runner(self, network: str | None = None) -> NetworkRunner:
        """The LP-A3 state of one network: ``.tcs`` (its TCS memory), ``.store`` (its ``x'`` cache),
        ``.last_grid`` (``network``: one of the module's ``lpa3_networks()``; None for a single network).

        Raises:
            KeyError: naming the module's networks, for a name it does not declare.
        """
        if network not in self._runners:
            names = [name for name in self._runners if name is not None] or [None]
            raise KeyError(f"LPA3Callback runs on the networks {names}, not {network!r}. Fix: "
                           f"`callback.runner({names[0]!r})`.")
        return self._runners[network]

    @property
    def networks(self) -> dict[str, NetworkRunner]:
        """The runner of each named network of a module that declares several; empty for one."""
        return {name: runner for name, runner in self._runners.items() if name is not None}

    @property
    def state_key(self) -> str:
        # Lightning's convention: two configured instances keep their states apart in a checkpoint
        return self._generate_state_key(ratio=self.ratio, sigma=self.sigma, steps=self.steps, layers=self.layers)

    # ------------------------------------------------------------------ the fit
    def _each(self, pl_module: pl.LightningModule) -> list[tuple[NetworkRunner, Any]]:
        """(runner, module or its network's view) in the declared order (the same on every rank)."""
        return [(runner, self._views.get(name, pl_module)) for name, runner in self._runners.items()]

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:  # Lightning's default, nobody else's
            trainer.strategy.checkpoint_io = AtomicCheckpointIO()  # a kill mid-write leaves the previous one
        if self.augment == "off":
            return
        names = module_networks(pl_module)
        declared: tuple[str | None, ...] = (None,) if names is None else names
        if tuple(self._runners) != declared:
            self._runners = {name: NetworkRunner(name, k, len(declared)) for k, name in enumerate(declared)}
        self._views = {} if names is None else {name: NetworkView(pl_module, name) for name in names}
        for _, module in self._each(pl_module):
            check_module(module, self.layers, self.solver.attack_bn)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.augment == "off":  # no network view was built (a DivideMix module has no lpa3_model()): the
            # module's twins, never trained without x', still join DDP's graph, so "off" runs where "lpa3" does
            anchor_twin_parameters(pl_module, trainer.world_size > 1)
            return
        for _, module in self._each(pl_module):
            model = unwrap_compiled(module.lpa3_model())
            check_synced_batchnorm(model, trainer.world_size)
            # under DDP every twin parameter joins every step's graph (a zero gradient without x')
            anchor_twin_parameters(model, trainer.world_size > 1)

    def resolve(self, trainer: pl.Trainer) -> RunSettings:
        """The settings of a fit, with the seed and the input box decided (what every runner receives)."""
        if self._base_seed is None:
            self._base_seed = torch.initial_seed() & (2**52 - 1)  # (no draw from the global generator)
            if trainer.world_size > 1:  # the ranks' torch seeds may differ: every rank takes rank 0's
                self._base_seed = agreed_seed(self._base_seed)
        return RunSettings(ratio=self.ratio, sigma=self.sigma, steps=self.steps, warmup_epochs=self.warmup_epochs,
                           seed=self._base_seed, layers=self.layers, input_range=input_range_of(trainer, self.input_range),
                           world_size=trainer.world_size, rank=trainer.global_rank, solver=self.solver,
                           selection=self.selection, cache=self.cache, logging=self.logging, augment=self.augment,
                           noise_norm=self.noise_norm)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.augment == "off":
            return
        refuse_an_unrestored_loader_position(trainer)
        self._console = ConsoleReport()
        settings = self.resolve(trainer)
        for runner, module in self._each(pl_module):
            num_samples, num_classes = memory_shape(trainer, module, self.selection.num_samples)
            error = None
            try:
                runner.start(settings, trainer, module, num_samples, num_classes)
            except Exception as exc:  # noqa: BLE001 (any rank's failure stops every rank)
                error = exc
            fail_together(trainer, error)
        self._resume.train_start(self._each(pl_module))

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.augment == "off":
            return
        epoch = trainer.current_epoch
        on = epoch >= self.warmup_epochs and any(consumes_augmented(module, epoch) for _, module in self._each(pl_module))
        self._console.epoch_start(epoch, on, self.ratio, self.steps)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self.augment == "off":
            return
        self._console.step_start()
        start, measure, epoch = time.perf_counter(), measured_step(trainer, self.logging.every_n_steps, batch_idx), trainer.current_epoch
        each = self._each(pl_module)
        prepared = [runner.prepare(trainer, module, batch, batch_idx, consumes_augmented(module, epoch), self.select,
                                  measure)
                    for runner, module in each]
        agree(trainer, pl_module, prepared, list(self._runners))
        self._deferred = None
        for (runner, module), ready in zip(each, prepared):
            try:
                runner.hand_over(trainer, module, ready, measure, self.on_augmented)
            except Exception as exc:
                if trainer.world_size <= 1:
                    raise
                # the other ranks go on into the step (DDP's backward is a collective): this rank does too and
                # withdraws from the memory's exchange after it, which stops every rank
                self._deferred = exc
        self._console.lpa3_work(time.perf_counter() - start)
        self._step_counts = (sum(len(p.made.augmented) for p in prepared if p.made is not None),
                             max((p.request.inputs.shape[0] for p in prepared if p.request is not None), default=0))

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.augment == "off":
            return
        start, deferred = time.perf_counter(), self._deferred
        self._deferred = None
        for runner, module in self._each(pl_module):
            runner.finish(trainer, module, deferred)
        self._console.lpa3_work(time.perf_counter() - start)
        self._console.step_end(pl_module, *self._step_counts)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._resume.epoch_end(trainer)
        if self.augment == "off":
            return
        pass_over = self._resume.pass_over(trainer)
        for runner, module in self._each(pl_module):
            if runner.tcs is not None:
                runner.epoch_end(trainer, module, pass_over)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.augment != "off":
            self._console.summary()

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._teardown(pl_module)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._teardown(pl_module)

    def _teardown(self, pl_module: pl.LightningModule) -> None:
        self._resume.clear()
        # the module's own networks, not the runners: a fit that failed before setup has no runner per network
        if callable(getattr(pl_module, "lpa3_model", None)):
            names = module_networks(pl_module)
            for module in [pl_module] if names is None else [NetworkView(pl_module, name) for name in names]:
                anchor_twin_parameters(unwrap_compiled(module.lpa3_model()), False)
        for runner in self._runners.values():
            runner.teardown()

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        """The base seed and each network's state (its TCS memory, cache, first augmenting epoch).

        Raises:
            RuntimeError: for a memory split over processes, called outside Lightning's checkpointing
                (assembling it is a collective the other ranks would never join).
        """
        if self.augment == "off":  # a checkpoint's LP-A3 state goes on as it came (none: a fresh start)
            return self._off_state or {"version": STATE_VERSION, "seed": self._base_seed, "networks": {}}
        refuse_a_split_memory_outside_lightning([runner.tcs for runner in self._runners.values()])
        return {"version": STATE_VERSION, "seed": self._base_seed,
                "networks": {"" if name is None else name: runner.state_dict(assemble=True)
                             for name, runner in self._runners.items()}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Keep a checkpoint's state (applied when the fit starts).

        Raises:
            ValueError: for a state of another version, or of other networks than the module's.
        """
        if self.augment == "off":
            self._off_state = state_dict
            return
        version = state_dict.get("version")
        if version != STATE_VERSION:
            raise ValueError(f"The checkpoint holds LPA3Callback state of version {version!r}; this lpa3-lightning "
                             f"reads version {STATE_VERSION}. Fix: resume with the version that wrote it, or start a "
                             "new run (drop `ckpt_path`).")
        networks = {None if name == "" else name: state for name, state in state_dict["networks"].items()}
        self._base_seed = state_dict["seed"] if self.seed is None else self.seed
        if not networks:  # written with augment="off": nothing to continue, the fit starts afresh
            return
        if set(networks) != set(self._runners):
            said = [f"the networks {sorted(n for n in names if n is not None)}" if None not in names else "one network"
                    for names in (networks, self._runners)]
            raise ValueError(f"The checkpoint holds LPA3Callback state for {said[0]}, but the module declares {said[1]}. "
                             "Fix: resume with the module the checkpoint was written with (its `lpa3_networks()`).")
        for name, runner in self._runners.items():
            runner.load_state_dict(networks[name])

    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
        if trainer.state.fn == TrainerFn.FITTING:
            self._resume.checkpoint_loaded(checkpoint)
        warn_of_other_lpa3_states(checkpoint, self.state_key)
