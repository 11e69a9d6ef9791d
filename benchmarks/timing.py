"""What the benchmark scripts share: device synchronisation, a per-step timer, mean +- std, a process pool.

Imported by the scripts in this folder (each puts the repository root on ``sys.path``).
"""

from __future__ import annotations

import statistics
import subprocess
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from lightning.pytorch.callbacks import Callback

__all__ = ["StepTimer", "mean_std", "run_processes", "sync"]


def sync(device) -> None:
    """Wait for the device (a no-op on the CPU), so a wall-clock reading covers the work queued."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


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


def mean_std(values: Sequence[float]) -> str:
    """``"mean +- sample std"`` with three decimals (std 0 for one value)."""
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.3f} +- {sd:.3f}"


def run_processes(commands: Iterable[list[str]], jobs: int, cwd: Path) -> None:
    """Run the commands as subprocesses, at most ``jobs`` at once, and wait for all."""
    running: list[subprocess.Popen] = []
    for cmd in commands:
        running.append(subprocess.Popen(cmd, cwd=cwd))
        while len(running) >= jobs:
            running = [p for p in running if p.poll() is None]
            time.sleep(1)
    for p in running:
        p.wait()
