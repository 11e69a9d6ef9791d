"""The harness every benchmark script runs on: the shared arguments (seeds, torch threads,
parallel runs, output folder), one process per run with its result in one JSON file, the
summary's mean +- std, and the timing (device synchronisation, a per-step timer).

A table script (``medmnist_table.py``, ``ssl_table.py``, ``noisy_table.py``) declares its
arguments with :func:`sweep_arguments`, runs each missing run as ``script --worker <fields>``
through :func:`run_sweep` (a run whose JSON exists is not repeated), and reads the JSON files
back with :func:`load_results` for its summary. Imported by the scripts in this folder (each
puts the repository root on ``sys.path``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Callback

__all__ = ["StepTimer", "apply_threads", "load_results", "mean_std", "run_processes", "run_sweep", "sweep_arguments",
           "sync", "worker_command", "write_result"]

ROOT = Path(__file__).resolve().parents[1]


def sweep_arguments(parser: argparse.ArgumentParser, out: Path, seeds: Sequence[int] = (0, 1, 2)) -> None:
    """``--seeds``, ``--out`` (one JSON file per run), ``--jobs`` (runs at once, each in its own
    process) and ``--threads`` (torch threads per run)."""
    parser.add_argument("--seeds", nargs="+", type=int, default=list(seeds))
    parser.add_argument("--out", type=Path, default=out)
    parser.add_argument("--jobs", type=int, default=1, help="runs at once, each in its own process")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per run (default: torch's)")


def apply_threads(threads: int | None) -> None:
    """``torch.set_num_threads(threads)`` when given (two 2-thread runs on 2 cores slow each other many times)."""
    if threads:
        import torch

        torch.set_num_threads(threads)


def worker_command(script: str | Path, fields: Iterable[Any], options: Mapping[str, Any]) -> list[str]:
    """``python script --worker <fields> <options>``: an option given None or False is left out,
    True is a bare flag, a list gives several values."""
    command = [sys.executable, str(script), "--worker", *map(str, fields)]
    for flag, value in options.items():
        if value is None or value is False:
            continue
        if value is True:
            command.append(flag)
        elif isinstance(value, (list, tuple)):
            command += [flag, *map(str, value)] if value else []
        else:
            command += [flag, str(value)]
    return command


def run_sweep(runs: Iterable[tuple], result_path: Callable[..., Path], command: Callable[..., list[str]],
              jobs: int) -> None:
    """Run ``command(*run)`` for every run whose ``result_path(*run)`` does not exist yet, at most
    ``jobs`` at once (each writes its own JSON file)."""
    run_processes((command(*run) for run in runs if not result_path(*run).exists()), jobs, ROOT)


def write_result(path: Path, result: Mapping[str, Any]) -> None:
    """One run's result as JSON (the folder made when missing)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))


def load_results(out: Path, keep: Callable[[dict], bool] = lambda result: True) -> list[dict]:
    """The results in ``out`` (sorted by file name) that ``keep`` accepts."""
    if not out.exists():
        return []
    return [r for r in (json.loads(p.read_text()) for p in sorted(out.glob("*.json"))) if keep(r)]


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
