"""What :class:`~lpa3_lightning.LPA3Callback` tells the console: its phase when it changes, the
step's ``x'`` and LP-A3's share of the step time on the progress bar, and a summary at the end.

Without it the bar slows three-fold when the warm-up ends with no word, and the cost is only in the
logger. Times are host seconds (``time.perf_counter``) around the callback's work in a training
step and around the whole step; on a GPU a kernel may finish after the host moved on, so the share
is the host's.
"""

from __future__ import annotations

import time
from typing import Any

from lightning.pytorch.utilities import rank_zero_info

__all__ = ["ConsoleReport"]


class ConsoleReport:
    """One fit's console account of LP-A3 (rank 0 prints; every rank counts its own steps)."""

    def __init__(self) -> None:
        self.on: bool | None = None  # the phase of the last epoch: None before the first
        self.epochs = self.lpa3_epochs = 0
        self.first_lpa3_epoch: int | None = None
        self.x_prime = self.rows = 0
        self.step_seconds = self.lpa3_seconds = 0.0
        self._step_start: float | None = None
        self._lpa3_step = 0.0

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
        """Host seconds the callback spent in this step (its request, selection, solver, memory update)."""
        self._lpa3_step += seconds

    def step_end(self, module: Any, x_prime: int, rows: int) -> None:
        """After the step: count it and put the step's ``x'`` and LP-A3's share so far on the bar."""
        if self._step_start is None:
            return
        self.step_seconds += time.perf_counter() - self._step_start
        self.lpa3_seconds += self._lpa3_step
        self._step_start, self._lpa3_step = None, 0.0
        if not self.on:
            return
        self.x_prime += x_prime
        self.rows += rows
        share = 100 * self.lpa3_seconds / self.step_seconds if self.step_seconds > 0 else 0.0
        module.log_dict({"lpa3_x'": float(x_prime), "lpa3_time": round(share, 1)}, prog_bar=True, logger=False,
                        on_step=True, on_epoch=False, batch_size=1)

    def summary(self) -> None:
        """The fit's summary (rank 0), once it trained a step."""
        if not self.step_seconds:
            return
        share = 100 * self.lpa3_seconds / self.step_seconds
        where = f"LP-A3 in {self.lpa3_epochs}" + (f" (from epoch {self.first_lpa3_epoch})" if self.lpa3_epochs else "")
        trained = (f"{self.x_prime:,} x' trained ({self.x_prime / self.rows:.0%} of the {self.rows:,} rows of those "
                   "epochs' steps)") if self.rows else "no x' trained"
        rank_zero_info(f"LPA3Callback: {self.epochs} epochs, {where}; {trained}; LP-A3 took {share:.1f}% of the "
                       f"training steps' time ({self.lpa3_seconds:.1f} s of {self.step_seconds:.1f} s, host time: the "
                       "request, selection, solver and memory update).")
