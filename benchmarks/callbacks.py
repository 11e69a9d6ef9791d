"""The Lightning callbacks the timing benchmarks register: :class:`StepTimer` (the wall time of
every training step and epoch) and :class:`ProfiledSteps` (``torch.profiler`` over a window of
steps). Reached as ``benchmarks.harness.StepTimer`` / ``ProfiledSteps`` too; they live here so
that importing the harness does not import Lightning."""

from __future__ import annotations

import time
from typing import Any

from lightning.pytorch.callbacks import Callback

from benchmarks.harness import sync

__all__ = ["ProfiledSteps", "StepTimer"]


class StepTimer(Callback):
    """Wall time of every training step (``on_train_batch_start`` to ``on_train_batch_end``, so the
    LP-A3 callback's work in between is inside when this callback is registered first) and of every
    epoch, and the callback's ``lpa3/reused_fraction_epoch`` (``reused``) and
    ``lpa3/selected_fraction_epoch`` (``solved``: the share of the batch given an ``x'``) per epoch."""

    def __init__(self) -> None:
        self.steps: dict[int, list[float]] = {}
        self.epochs: dict[int, float] = {}
        self.reused: dict[int, float] = {}
        self.solved: dict[int, float] = {}

    def on_train_epoch_start(self, trainer, pl_module):
        self._epoch_start = time.perf_counter()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        sync(pl_module.device)
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        sync(pl_module.device)
        self.steps.setdefault(trainer.current_epoch, []).append(time.perf_counter() - self._start)

    def on_train_epoch_end(self, trainer, pl_module):
        sync(pl_module.device)
        self.epochs[trainer.current_epoch] = time.perf_counter() - self._epoch_start
        for name, record in (("reused", self.reused), ("selected", self.solved)):
            value = trainer.callback_metrics.get(f"lpa3/{name}_fraction_epoch")
            if value is not None:
                record[trainer.current_epoch] = float(value)


class ProfiledSteps(Callback):
    """``torch.profiler`` over ``steps`` training steps, from batch ``first_batch`` of epoch
    ``epoch`` on, then stops the fit. Register it first: the window opens at the start of the
    first step, before any other callback's work, and closes at the start of the step after the
    last (or at the end of the epoch, when it ends first), so it holds whole steps and what the
    loop does between them (loading the next batch). It closes after a device synchronisation,
    inside the window: one ``cudaDeviceSynchronize`` of its own. ``seconds``: the window's wall
    time; ``count``: steps profiled; ``prof``: the profiler (None until the window opened).
    ``profile_kwargs`` go to ``torch.profiler.profile`` (``activities`` defaults to the CPU, and
    CUDA on a GPU)."""

    def __init__(self, epoch: int, steps: int, first_batch: int = 0, **profile_kwargs: Any) -> None:
        self.epoch, self.steps, self.first_batch = epoch, steps, first_batch
        self.profile_kwargs = profile_kwargs
        self.prof: Any = None
        self.count = 0
        self.seconds: float | None = None

    def window_opens(self, trainer, pl_module) -> None:
        """Called just before the profiler starts (a subclass takes its snapshots here)."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.prof is None and trainer.current_epoch == self.epoch and batch_idx >= self.first_batch:
            from torch.profiler import ProfilerActivity, profile

            self.window_opens(trainer, pl_module)
            kwargs = dict(self.profile_kwargs)
            kwargs.setdefault("activities", [ProfilerActivity.CPU] + (
                [ProfilerActivity.CUDA] if pl_module.device.type == "cuda" else []))
            sync(pl_module.device)
            self.prof = profile(**kwargs)
            self.prof.__enter__()
            self._start = time.perf_counter()
        elif self.prof is not None and self.seconds is None and self.count == self.steps:
            self._stop(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.prof is not None and self.seconds is None:
            self.count += 1

    def on_train_epoch_end(self, trainer, pl_module):
        if self.prof is not None and self.seconds is None:
            self._stop(trainer, pl_module)  # the epoch ended (before ``steps`` steps, or right after them)

    def _stop(self, trainer, pl_module) -> None:
        sync(pl_module.device)
        self.seconds = time.perf_counter() - self._start
        self.prof.__exit__(None, None, None)
        trainer.should_stop = True
