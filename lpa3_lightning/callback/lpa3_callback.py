"""LPA3Callback: label-preserving adversarial auto-augmentation inside any Lightning Trainer.

This file holds the Lightning hooks; each hands its work to the runner of every network of the
module (:mod:`~lpa3_lightning.callback.runner`), whose stages are modules of their own: the
request's checks, the selection, the hard positives, the logs and the memory update.
"""

from __future__ import annotations

import inspect
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lpa3_lightning.callback.checkpoint_io import AtomicCheckpointIO
from lpa3_lightning.callback.console import ConsoleReport
from lpa3_lightning.callback.module_checks import (
    check_module,
    check_synced_batchnorm,
    infer_num_samples,
    input_range_of,
)
from lpa3_lightning.callback.networks import NetworkView, module_networks
from lpa3_lightning.callback.rank_agreement import (
    agree,
    agreed_seed,
    consumes_of,
    fail_together,
    same_on_every_rank,
)
from lpa3_lightning.callback.resume_point import ResumePoint, last_batch_checkpoint, resume_into_epoch_end
from lpa3_lightning.callback.runner import NetworkRunner
from lpa3_lightning.callback.settings import (
    Augment,
    CacheSettings,
    LoggingSettings,
    RunSettings,
    RuntimeSettings,
    SelectionSettings,
    SolverSettings,
    check_augment,
    preset_groups,
    unknown_argument,
)
from lpa3_lightning.core.arguments import check_int
from lpa3_lightning.core.attack import check_solver_arguments
from lpa3_lightning.core.augmented import AugmentedBatch
from lpa3_lightning.core.dual_bn import anchor_twin_parameters
from lpa3_lightning.core.input_box import InputRange
from lpa3_lightning.core.model_outputs import unwrap_compiled
from lpa3_lightning.core.selection import check_ratio

__all__ = ["LPA3Callback", "is_lpa3_state"]

#: The version of :meth:`LPA3Callback.state_dict`; a checkpoint of another is refused by name.
STATE_VERSION = 5


class LPA3Callback(Callback):
    r"""Generate LP-A3 hard positives for the least time-consistent samples of each batch.

    On every training batch the callback asks the module for its inputs, labels and dataset
    indices (:class:`~lpa3_lightning.mixins.LPA3ModuleMixin`), selects the samples whose
    time-consistency score is below the threshold of the last pass, solves their hard positives
    with :func:`~lpa3_lightning.core.attack.lpa3_attack` and hands them to the module before
    ``training_step``. After the step it updates the TCS memory from the clean logits the module
    recorded; after each epoch it refreshes the threshold.

    Logged (``<name>_step`` on each process, ``<name>_epoch`` per epoch over all processes), on
    the steps ``logging.every_n_steps`` picks (the Trainer's ``log_every_n_steps`` by default) and
    each epoch's first: ``lpa3/selected_fraction`` (the share of the batch given an ``x'``),
    ``lpa3/perceptual_distance``, ``lpa3/label_preserved`` (the share of the trained ``x'`` with
    ``log p(y|x') >= log p(y|x) - sigma`` in the forward that trained them),
    ``lpa3/label_preserved_eval`` (the same in the deployed model, a diagnostic),
    ``lpa3/input_distance`` (the mean L2 norm of ``x' - x``, in the input space),
    ``lpa3/projected`` (pulled back by the bisection), ``lpa3/solver_seconds`` (not on the
    sync-free path), ``lpa3/reused_fraction`` (with a cache), ``lpa3/tcs_selected_fraction``,
    ``lpa3/skipped_fraction`` (selected but not solved: the request's ``train_mask``); a quantity
    of the ``x'`` is NaN on a step without any. Per epoch ``lpa3/threshold``,
    ``lpa3/nonfinite_inputs`` and ``lpa3/nonfinite_predictions``. A module with several networks
    gets each under ``lpa3/<network>/``. Warned once: inputs or predictions with NaN or Inf (with
    the dataset indices), an ``input_range`` that excludes the data, and (once an epoch) ``x'``
    that barely move.

    Under DDP each step makes one reduction, which carries every rank's failure and its module's
    answer of :meth:`~lpa3_lightning.mixins.LPA3ModuleMixin.lpa3_consumes_augmented`: a rank
    that fails stops every rank, and an answer that differs between ranks is refused on every rank.

    Resuming: a checkpoint written on an epoch's last batch resumes into that epoch's end
    (:mod:`~lpa3_lightning.callback.resume_point`), and where the Trainer uses Lightning's default
    checkpoint writer the callback puts
    :class:`~lpa3_lightning.callback.checkpoint_io.AtomicCheckpointIO` in its place (a kill
    while a checkpoint is written leaves the previous one).

    Args:
        ratio: fraction of samples given LP-A3 (tau), in (0, 1].
        sigma: the label-preserving margin on ``log p`` (0.02 for MedMNIST in the paper).
        steps: solver iterations (the paper: 5).
        warmup_epochs: epochs at the start without augmentation (TCS still updates). A module
            may also say in which epochs its loss trains ``x'``
            (:meth:`~lpa3_lightning.mixins.LPA3ModuleMixin.lpa3_consumes_augmented`: PES's semi
            phase, DivideMix after its warm-up, FixMatch after its LP-A3 loss warm-up): the
            callback solves only in those.
        seed: seed of the solver's initial noise and of the first random selection: each
            batch's noise comes from a generator seeded by (seed, rank, epoch, batch index), so
            every rank draws its own and a resumed run draws on each rank what an uninterrupted
            run draws there. None: a seed fixed at the first fit from ``torch.initial_seed()``
            (the one ``seed_everything`` set; under DDP rank 0's, broadcast to every rank) and
            kept in checkpoints. The callback never draws
            from or restores torch's global random state.
        layers: feature layers (names or glob patterns of ``module.lpa3_model()``); None for the
            documented default.
        input_range: the valid input box for the solver's clamp: ``"auto"`` (the data module's
            ``normalization``, ``{"mean", "std"}`` of [0, 1] data, when it has one; else none),
            None (never clamp), ``(low, high)`` or ``{"mean": ..., "std": ...}``.
        preset: ``"package"`` (this package's defaults) or ``"authors"`` (the LP-A3 authors'
            behaviour where a switch restores it: :data:`~lpa3_lightning.callback.settings.PRESETS`),
            for the groups not given.
        augment: what the selected rows' ``x'`` are: ``"lpa3"`` (the solver's hard positives);
            two controls that spend no solver time and train exactly the rows, labels and weights
            LP-A3 would: ``"null"`` (``x' = x``: the extra loss term alone) and ``"noise"`` (``x``
            plus Gaussian noise of L2 norm ``noise_norm`` per sample, clamped into the input box);
            or ``"off"``: the callback does nothing (no request, no forward, no memory update), so
            one config runs with and without LP-A3, and a checkpoint of either loads into the other.
        noise_norm: the per-sample L2 norm of ``augment="noise"`` (e.g. the mean
            ``lpa3/input_distance`` an ``augment="lpa3"`` run logged); only with ``"noise"``.
        solver: :class:`~lpa3_lightning.callback.settings.SolverSettings` (or a mapping of its
            fields): the multiplier, temperature, projection, step bound, BN mode, TF32.
        selection: :class:`~lpa3_lightning.callback.settings.SelectionSettings`: the memory's
            size, layout and the TCS rules.
        cache: :class:`~lpa3_lightning.callback.settings.CacheSettings`: reusing ``x'`` for K epochs.
        runtime: :class:`~lpa3_lightning.callback.settings.RuntimeSettings`: the sync-free path and CUDA graphs.
        logging: :class:`~lpa3_lightning.callback.settings.LoggingSettings`: how often the
            diagnostics are measured, image grids, the eval-mode check.

    A group given is used as given: its unnamed fields take their defaults, not the preset's.

    Raises:
        ValueError: on a setting out of range, naming it and the fix; TypeError for an argument
            the callback does not take, naming the group that holds a setting of that name or
            the closest argument.

    Example::

        trainer = Trainer(callbacks=[LPA3Callback(ratio=0.5, sigma=0.02, cache={"regenerate_every_n_epochs": 10})])
        trainer.fit(LPA3Classifier(num_classes=2), datamodule=MedMNISTDataModule("breastmnist"))
        callback.runner().tcs  # the TCS memory after the fit
    """

    #: the marker by which modules find the callbacks of a Trainer without importing this one
    #: (:data:`lpa3_lightning.core.protocol.CALLBACK_MARKER`)
    is_lpa3_callback = True

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
        augment: Augment = "lpa3",
        noise_norm: float | None = None,
        solver: SolverSettings | None = None,
        selection: SelectionSettings | None = None,
        cache: CacheSettings | None = None,
        runtime: RuntimeSettings | None = None,
        logging: LoggingSettings | None = None,
        **unknown: Any,
    ) -> None:
        if unknown:
            arguments = [p for p in inspect.signature(LPA3Callback.__init__).parameters if p not in ("self", "unknown")]
            raise TypeError(unknown_argument(next(iter(unknown)), arguments))
        self.ratio = check_ratio(ratio)
        check_solver_arguments(sigma, steps, 1.0, 1.0)
        check_int(warmup_epochs, "warmup_epochs", 0, "use 0 (no warm-up).")
        if seed is not None:
            check_int(seed, "seed", 0, "use None or a non-negative int.")
        if layers is not None and not isinstance(layers, (str, Sequence)):
            raise ValueError(f"`layers` must be None, a name/pattern or a list of them, got {layers!r}.")
        if not _input_range_shaped(input_range):
            raise ValueError(f"`input_range` must be 'auto', None, (low, high) or {{'mean': ..., 'std': ...}}, got "
                             f"{input_range!r}. Fix: e.g. (0.0, 1.0) for pixels in [0, 1], the normalisation's "
                             "{'mean': [...], 'std': [...]}, or None for no box.")
        self.augment, self.noise_norm = check_augment(augment, noise_norm)
        self.sigma, self.steps, self.warmup_epochs, self.seed = float(sigma), steps, warmup_epochs, seed
        self.layers, self.input_range, self.preset = layers, input_range, preset
        groups = preset_groups(preset, solver=solver, selection=selection, cache=cache, runtime=runtime,
                               logging=logging)
        self.solver: SolverSettings = groups["solver"]
        self.selection: SelectionSettings = groups["selection"]
        self.cache: CacheSettings = groups["cache"]
        self.runtime: RuntimeSettings = groups["runtime"]
        self.logging: LoggingSettings = groups["logging"]
        if self.augment in ("null", "noise") and self.cache.regenerate_every_n_epochs > 1:
            raise ValueError(f"`augment={self.augment!r}` makes its x' without the solver, so there is nothing to cache, "
                             f"but cache.regenerate_every_n_epochs={self.cache.regenerate_every_n_epochs}. Fix: "
                             "cache.regenerate_every_n_epochs=1, or augment='lpa3'.")
        self._off_state: dict[str, Any] | None = None  # augment="off": the checkpoint's LP-A3 state, kept as it came
        self._console = ConsoleReport()
        self._runners: dict[str | None, NetworkRunner] = {None: NetworkRunner()}
        self._views: dict[str | None, Any] = {}
        self._base_seed: int | None = seed  # fixed at the first fit when None, then kept in checkpoints
        self._warned_no_range = [False]
        # a fit resumed from a checkpoint of an epoch's last batch: the epoch's end it still owes
        self._resume_point: ResumePoint | None = None  # Lightning runs it (a rewritten checkpoint)
        self._unended_epoch: int | None = None  # Lightning skips it (a loader without state): the threshold

    # ------------------------------------------------------------------ what a user reads back
    def runner(self, network: str | None = None) -> NetworkRunner:
        """The LP-A3 state of one network: ``.tcs`` (its TCS memory), ``.store`` (its ``x'`` cache),
        ``.solver_graphs``, ``.last_grid``. ``network`` names one of a module's
        ``lpa3_networks()``; None for a module with one network.

        Raises:
            KeyError: naming the module's networks, for a name it does not declare (or None for a
                module with several).
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
        # Lightning's convention: two configured instances (or a subclass beside the base) keep
        # their states apart in a checkpoint
        return self._generate_state_key(ratio=self.ratio, sigma=self.sigma, steps=self.steps, layers=self.layers)

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
        if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:  # Lightning's default, nobody else's
            # a kill while a checkpoint is written must leave the previous one (callback/checkpoint_io.py)
            trainer.strategy.checkpoint_io = AtomicCheckpointIO()
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
        for _, module in self._each(pl_module):
            model = unwrap_compiled(module.lpa3_model())
            check_synced_batchnorm(model, trainer.world_size)
            # Under DDP every twin parameter joins every step's graph (a zero gradient in steps
            # without x'), whatever the module's loss does: no "Expected to have finished reduction".
            anchor_twin_parameters(model, trainer.world_size > 1)

    def resolve(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> RunSettings:
        """The settings of a fit: this callback's, with the seed, the input box and the path decided
        for the trainer and module (what every runner and stage receives).

        Raises:
            ValueError: ``runtime.cuda_graphs`` without the sync-free path, naming the fix.
        """
        if self._base_seed is None:
            # (no draw from the global generator; 52 bits, as the seeds of earlier versions)
            self._base_seed = torch.initial_seed() & (2**52 - 1)
            if trainer.world_size > 1:  # the ranks' torch seeds may differ: every rank takes rank 0's
                self._base_seed = agreed_seed(self._base_seed)
        input_range = input_range_of(trainer, self.input_range, self._warned_no_range)
        sync_free = pl_module.device.type != "cpu" if self.runtime.sync_free == "auto" else bool(self.runtime.sync_free)
        if self.runtime.cuda_graphs and not sync_free:
            raise ValueError("`runtime.cuda_graphs=True` needs the sync-free path, which sync_free='auto' runs on an "
                             "accelerator only and this module is on the CPU. Fix: runtime.sync_free=True, or "
                             "cuda_graphs=False.")
        return RunSettings(
            ratio=self.ratio, sigma=self.sigma, steps=self.steps, warmup_epochs=self.warmup_epochs,
            seed=self._base_seed, layers=self.layers, input_range=input_range, sync_free=sync_free,
            world_size=trainer.world_size, rank=trainer.global_rank, solver=self.solver, selection=self.selection,
            cache=self.cache, runtime=self.runtime, logging=self.logging, augment=self.augment,
            noise_norm=self.noise_norm)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.augment == "off":
            return
        _refuse_an_unrestored_loader_position(trainer)
        self._console = ConsoleReport()
        settings = self.resolve(trainer, pl_module)
        for runner, module in self._each(pl_module):
            num_classes = getattr(module, "lpa3_num_classes", None)
            if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 2:
                raise ValueError(
                    f"{type(pl_module).__name__}.lpa3_num_classes must be the number of classes (int >= 2), got "
                    f"{num_classes!r}. Fix: set `self.lpa3_num_classes = num_classes` in __init__."
                )
            num_samples = infer_num_samples(trainer, module, self.selection.num_samples)
            if not same_on_every_rank(trainer, pl_module, [num_samples, num_classes]):
                raise ValueError(
                    "The processes disagree on the training-set size or the number of classes. Fix: give every rank "
                    "the same dataset with global indices (Lightning's DistributedSampler does this), not per-rank "
                    "shards."
                )
            error = None
            try:
                runner.start(settings, trainer, module, num_samples, num_classes)
            except Exception as exc:  # noqa: BLE001 (any failure on one rank, an unusable cache folder: every rank stops)
                error = exc
            fail_together(trainer, error)
        if self._unended_epoch is not None:
            # the pass ended on the checkpoint's batch, and Lightning resumes past its end: its threshold
            # now, so that the next epoch selects by it (as the uninterrupted run did)
            for runner, _ in self._each(pl_module):
                runner.memory().refresh_threshold()
            self._unended_epoch = None

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.augment == "off":
            return
        epoch = trainer.current_epoch
        on = epoch >= self.warmup_epochs and any(consumes_of(module)(epoch) for _, module in self._each(pl_module))
        self._console.epoch_start(epoch, on, self.ratio, self.steps)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self.augment == "off":
            return
        self._console.step_start()
        start = time.perf_counter()
        each = self._each(pl_module)
        prepared = [runner.prepare(trainer, module, batch, batch_idx, consumes_of(module)) for runner, module in each]
        agree(trainer, pl_module, prepared, list(self._runners))
        for (runner, module), ready in zip(each, prepared):
            runner.hand_over(trainer, module, ready, self.on_augmented)
        self._console.lpa3_work(time.perf_counter() - start)
        self._step_counts = (sum(len(p.augmented) for p in prepared if p.augmented is not None),
                             max((p.request.inputs.shape[0] for p in prepared if p.request is not None), default=0))

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.augment == "off":
            return
        start = time.perf_counter()
        for runner, module in self._each(pl_module):
            runner.finish(trainer, module)
        self._console.lpa3_work(time.perf_counter() - start)
        self._console.step_end(pl_module, *getattr(self, "_step_counts", (0, 0)))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.augment != "off":
            self._console.summary()

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._resume_point is not None:
            self._resume_point.epoch_end(trainer)
            self._resume_point = None
        if self.augment == "off":
            return
        pass_over = _pass_over(trainer)
        for runner, module in self._each(pl_module):
            if runner.tcs is not None:
                runner.epoch_end(trainer, module, pass_over)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._teardown(pl_module)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._teardown(pl_module)

    def _teardown(self, pl_module: pl.LightningModule) -> None:
        self._resume_point = self._unended_epoch = None
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
        """The base seed and each network's state (its TCS memory, cache, first augmenting epoch).

        Raises:
            RuntimeError: for a memory split over several processes when called outside
                Lightning's checkpointing (e.g. on rank 0 alone): assembling it is a collective
                that the other ranks would never join.
        """
        if self.augment == "off":  # a checkpoint's LP-A3 state goes on as it came (none: a fresh start)
            return self._off_state or {"version": STATE_VERSION, "seed": self._base_seed, "networks": {}}
        split = [r for r in self._runners.values() if getattr(r.tcs, "num_shards", 1) > 1]
        if split and not _called_by_lightning():
            shards = split[0].tcs.num_shards  # type: ignore[union-attr]
            raise RuntimeError(
                f"LPA3Callback's TCS memory is split over {shards} processes (selection.memory_layout), so its "
                "state_dict() assembles it from every process: a collective, which a call on one process alone "
                "would leave waiting. Fix: let Lightning write it (trainer.save_checkpoint(path), on every rank; "
                "ModelCheckpoint does so), or use selection.memory_layout='replicated'."
            )
        return {"version": STATE_VERSION, "seed": self._base_seed,
                "networks": {"" if name is None else name: runner.state_dict(assemble=True)
                             for name, runner in self._runners.items()}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Keep a checkpoint's state (applied when the fit starts, on the data set and module).

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
        if not networks:  # written with augment="off": nothing to continue, the fit starts afresh
            self._base_seed = state_dict["seed"] if self.seed is None else self.seed
            return
        if set(networks) != set(self._runners):
            def described(names: Any) -> str:
                named = sorted(n for n in names if n is not None)
                return f"the networks {named}" if named else "one network"

            raise ValueError(
                f"The checkpoint holds LPA3Callback state for {described(networks)}, but the module declares "
                f"{described(self._runners)}. Fix: resume with the module the checkpoint was written with (its "
                "`lpa3_networks()`)."
            )
        self._base_seed = state_dict["seed"] if self.seed is None else self.seed
        for name, runner in self._runners.items():
            runner.load_state_dict(networks[name])

    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
        if trainer.state.fn == TrainerFn.FITTING:
            self._resume_into_epoch_end(checkpoint)
        states = checkpoint.get("callbacks", {})
        others = [key for key, state in states.items() if key != self.state_key and is_lpa3_state(state)]
        if others and self.state_key not in states:
            rank_zero_warn(
                f"The checkpoint holds LP-A3 state under {others}, not under this callback's {self.state_key!r} "
                "(its class, ratio, sigma, steps or layers differ): this callback starts with a fresh TCS memory. Fix: "
                "resume with the callback class and settings the checkpoint was written with to continue its memory."
            )

    def _resume_into_epoch_end(self, checkpoint: dict[str, Any]) -> None:
        """A checkpoint of an epoch's last batch (before the epoch's end) resumes into that end
        (:mod:`~lpa3_lightning.callback.resume_point`); with a loader that keeps no state, Lightning
        skips it: the callback ends its own part at the fit's start and says what was skipped."""
        self._resume_point = resume_into_epoch_end(checkpoint)
        if self._resume_point is not None:
            rank_zero_info(f"LPA3Callback: the checkpoint was written on epoch {self._resume_point.epoch}'s last batch, "
                           "before the epoch's end: the fit resumes into that end (its validation and "
                           "on_train_epoch_end), which Lightning would skip.")
        elif last_batch_checkpoint(checkpoint):
            self._unended_epoch = int(checkpoint["loops"]["fit_loop"]["epoch_progress"]["current"]["completed"])
            rank_zero_warn(
                f"The checkpoint was written on epoch {self._unended_epoch}'s last batch, before the epoch's end, and "
                "the training loader keeps no state (or had ended its pass): Lightning resumes as if the epoch had ended, without its "
                "validation, its on_train_epoch_end hooks and the next epoch's on_train_epoch_start (a resume there "
                "would begin a new pass inside the finished epoch). LPA3Callback ends its own part (the selection "
                "threshold). Fix: a training loader that keeps its position (lpa3_lightning.data.train_loader, or "
                "torchdata's StatefulDataLoader): the resume then runs the epoch's end; or resume from a checkpoint "
                "written at an epoch's end."
            )


def _refuse_an_unrestored_loader_position(trainer: pl.Trainer) -> None:
    """Refuse a resumed fit whose training loader's saved position Lightning left unloaded.

    Lightning loads a stateful loader's position when it sets the loader up for the fit; when
    something set it up earlier, before the checkpoint's loops were restored (``configure_optimizers``
    reading ``trainer.estimated_stepping_batches``: Lightning issue #20550), the position stays in the
    fit loop unapplied and the resumed epoch trains another pass's batches, silently.

    Raises:
        RuntimeError: naming the cause and the fix.
    """
    loop = trainer.fit_loop
    # (read only; the fit loop clears this list once it has loaded the positions)
    if loop.restarting and getattr(loop, "_combined_loader_states_to_load", None):
        raise RuntimeError(
            "The checkpoint holds the training loader's position, but Lightning did not restore it: the training "
            "loader was set up before the checkpoint was loaded, typically by `trainer.estimated_stepping_batches` "
            "read in `configure_optimizers` (Lightning issue #20550), so the resumed epoch would train other batches "
            "than the uninterrupted run. Fix: read the run's length when the schedule first steps, not in "
            "configure_optimizers (e.g. a LambdaLR whose function reads trainer.estimated_stepping_batches at its "
            "first call with k > 0, as FixMatchClassifier does), or resume from a checkpoint written at an epoch's "
            "end."
        )


def _pass_over(trainer: pl.Trainer) -> bool:
    """Whether the ending epoch went through its training batches (not stopped mid-epoch by
    ``max_steps`` or ``trainer.should_stop``; ``limit_train_batches`` counts)."""
    batches = trainer.fit_loop.epoch_loop.batch_progress
    return bool(batches.is_last_batch) or batches.current.ready >= trainer.num_training_batches


def _input_range_shaped(input_range: Any) -> bool:
    """Whether ``input_range`` has one of the accepted forms (its values are checked at the first solve,
    against the inputs' channels)."""
    if isinstance(input_range, str) or input_range is None:
        return input_range in ("auto", None)
    if isinstance(input_range, Mapping):
        return {"mean", "std"} <= set(input_range)
    return isinstance(input_range, Sequence) and not isinstance(input_range, bytes) and len(input_range) == 2


def is_lpa3_state(state: Any) -> bool:
    """Whether a callback state in a checkpoint is an LPA3Callback's (of any class or settings)."""
    return isinstance(state, dict) and "networks" in state and "seed" in state and "version" in state


def _called_by_lightning() -> bool:
    """Whether ``state_dict`` was called by Lightning's checkpointing (which calls it on every
    rank), past the ``state_dict`` frames of this class and its subclasses."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_name == "state_dict":
        frame = frame.f_back
    return frame is not None and frame.f_code.co_name == "_call_callbacks_state_dict" \
        and frame.f_globals.get("__name__", "").startswith(("lightning.pytorch", "pytorch_lightning"))
