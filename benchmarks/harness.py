"""The harness every benchmark script runs on: the shared arguments (seeds, torch threads,
parallel runs, output folder), one process per run with its result in one JSON file, the
summary's mean +- std, and the timing (device synchronisation, a per-step timer).

A table script (``medmnist_table.py``, ``ssl_table.py``, ``noisy_table.py``) declares its
arguments with :func:`sweep_arguments`, runs each missing run as ``script --worker <fields>``
through :func:`run_sweep` (a run whose JSON exists is not repeated), and reads the JSON files
back with :func:`load_results` for its summary. A single-run script declares its shared
arguments with :func:`run_arguments` (``--threads``, and as it needs ``--seed``, ``--accelerator``,
``--json``), applies them with :func:`apply_threads` and writes its result with
:func:`write_result`; :func:`device_label` names the machine in its header. A script with one
process per configuration runs each as ``script --worker ...`` (:func:`worker_command`) and reads
its result back with :func:`run_worker`; :func:`median_seconds` times a function after a device
synchronisation, :class:`ProfiledSteps` profiles a window of training steps and
:func:`cuda_activity` counts its kernel launches, synchronisations, allocations and copies; the
multi-process CPU scripts share :func:`free_port` and :func:`max_over_ranks`. Imported by the
scripts in this folder (each puts the repository root on ``sys.path``).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import re
import socket
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Callback

__all__ = ["ProfiledSteps", "StepTimer", "apply_threads", "cuda_activity", "device_label", "free_port", "git_commit",
           "load_results", "max_over_ranks", "mean_std", "median_seconds", "on_gpu", "paired_difference",
           "run_arguments", "run_processes", "run_sweep", "run_worker", "sweep_arguments", "sync", "worker_command",
           "write_result"]

ROOT = Path(__file__).resolve().parents[1]


def sweep_arguments(parser: argparse.ArgumentParser, out: Path, seeds: Sequence[int] = (0, 1, 2)) -> None:
    """``--seeds``, ``--out`` (one JSON file per run), ``--jobs`` (runs at once, each in its own
    process) and ``--threads`` (torch threads per run)."""
    parser.add_argument("--seeds", nargs="+", type=int, default=list(seeds))
    parser.add_argument("--out", type=Path, default=out)
    parser.add_argument("--jobs", type=int, default=1, help="runs at once, each in its own process")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per run (default: torch's)")


def run_arguments(parser: argparse.ArgumentParser, *, threads: int | None = None, seed: int | None = None,
                  accelerator: str | None = None, json_out: bool = False) -> None:
    """A single-run script's shared arguments: ``--threads`` (torch threads, default ``threads``:
    None keeps torch's); ``--seed`` when a default ``seed`` is given; ``--accelerator`` (Lightning's:
    cpu or gpu) when a default is given; ``--json PATH`` (the result as one JSON file) with ``json_out``."""
    parser.add_argument("--threads", type=int, default=threads,
                        help="torch threads (default: " + ("torch's)" if threads is None else f"{threads})"))
    if seed is not None:
        parser.add_argument("--seed", type=int, default=seed)
    if accelerator is not None:
        parser.add_argument("--accelerator", default=accelerator, help="Lightning accelerator: cpu or gpu")
    if json_out:
        parser.add_argument("--json", type=Path, default=None, metavar="PATH",
                            help="also write the result to this JSON file")


def on_gpu(accelerator: str) -> bool:
    """Whether a Lightning ``accelerator`` (or a torch device type) is a CUDA GPU."""
    return accelerator in ("gpu", "cuda") or str(accelerator).startswith("cuda:")


def device_label(accelerator: str) -> str:
    """The machine a run times, for a script's header: the GPU's name, or the CPU and its threads."""
    import torch

    if on_gpu(accelerator):
        return torch.cuda.get_device_name(torch.device(accelerator) if ":" in str(accelerator) else 0)
    return f"{platform.machine()}, {torch.get_num_threads()} threads"


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


def run_worker(command: list[str], what: str) -> dict:
    """Run one ``--worker`` process and return the JSON its last line of output printed; exit
    naming ``what`` and the end of its error output when it fails."""
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        sys.exit(f"{what} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def write_result(path: Path, result: Mapping[str, Any]) -> None:
    """One run's result as JSON (the folder made when missing)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))


def git_commit() -> str:
    """The repository's commit (with ``+dirty`` when its tracked files differ), recorded in each run's JSON."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "lpa3_lightning"], cwd=ROOT).returncode != 0
    return head.stdout.strip() + ("+dirty" if dirty else "") if head.returncode == 0 else "unknown"


def paired_difference(base: Mapping[int, float], other: Mapping[int, float], confidence: float = 0.95) -> dict:
    """Paired statistics of ``other - base`` over the seeds both have (same seed: same split, noise
    and initial weights): the per-seed differences, their mean and standard deviation, the two-sided
    Student-t interval of the mean at ``confidence``, the seeds where ``other`` is above, and the
    verdict the interval gives: ``"helps"`` (all above 0), ``"hurts"`` (all below 0) or ``"no
    difference found"``.

    Example:
        >>> paired_difference({0: 0.80, 1: 0.82, 2: 0.81}, {0: 0.85, 1: 0.86, 2: 0.87})["verdict"]
        'helps'
    """
    from scipy import stats

    seeds = sorted(set(base) & set(other))
    diffs = [other[s] - base[s] for s in seeds]
    n = len(diffs)
    mean = statistics.mean(diffs) if diffs else math.nan
    std = statistics.stdev(diffs) if n > 1 else math.nan
    half = float(stats.t.ppf(0.5 + confidence / 2, n - 1)) * std / math.sqrt(n) if n > 1 else math.nan
    low, high = mean - half, mean + half
    verdict = "helps" if low > 0 else "hurts" if high < 0 else "no difference found"
    return {"seeds": seeds, "diffs": diffs, "mean": mean, "std": std, "ci": (low, high), "confidence": confidence,
            "above": sum(d > 0 for d in diffs), "n": n, "verdict": verdict if n > 1 else "one seed: no interval"}


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


def median_seconds(fn: Callable[[], Any], device, reps: int = 3) -> float:
    """Median wall time of ``fn()`` over ``reps`` calls after one untimed call, each between
    device synchronisations."""
    fn()
    times = []
    for _ in range(reps):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


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


#: CUDA runtime and driver calls by what they do (their names in a torch.profiler trace)
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx",
            "cudaLaunchCooperativeKernel")
GRAPH_LAUNCHES = ("cudaGraphLaunch", "cuGraphLaunch")
SYNCHRONISATIONS = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize", "cudaMemcpy",
                    "cuCtxSynchronize", "cuStreamSynchronize", "cuEventSynchronize")
ALLOCATIONS = ("cudaMalloc", "cudaMallocAsync", "cudaHostAlloc", "cudaMallocHost")
FREES = ("cudaFree", "cudaFreeAsync", "cudaFreeHost")
_COPY_KINDS = {"HtoD": "h2d", "DtoH": "d2h", "DtoD": "d2d"}


def cuda_activity(events: Iterable[Any]) -> dict[str, Any]:
    """What a profile's host asked of the GPU, from its raw events (``prof.events()``): kernel
    launches (and CUDA graph launches), synchronisations by call (``cudaDeviceSynchronize``,
    ``cudaStreamSynchronize``, ``cudaEventSynchronize``, the blocking ``cudaMemcpy``; a tensor's
    value read on the host is a ``cudaMemcpyAsync`` device to host then a stream synchronisation),
    ``cudaMalloc``/``cudaFree`` calls, and the device's copies by direction with their bytes (None
    where the profiler does not expose a copy's size). The GPU's busy time is the sum of the
    durations of its kernels, copies and memsets (streams that overlap count twice). All zero
    for a CPU-only profile."""
    launches = graph_launches = mallocs = frees = 0
    syncs: dict[str, int] = {}
    copies = {kind: {"count": 0, "bytes": 0} for kind in _COPY_KINDS.values()}
    sized = True
    busy_us = 0.0
    for e in events:
        name = e.name
        if name in LAUNCHES:  # the runtime's calls, by name (the host's side of the trace)
            launches += 1
        elif name in GRAPH_LAUNCHES:
            graph_launches += 1
        elif name in SYNCHRONISATIONS:
            syncs[name] = syncs.get(name, 0) + 1
        elif name in ALLOCATIONS:
            mallocs += 1
        elif name in FREES:
            frees += 1
        if e.device_type.name == "CPU":
            continue
        busy_us += e.time_range.elapsed_us()  # the device's kernels, copies and memsets
        if name.startswith("Memcpy"):
            kind = next((k for key, k in _COPY_KINDS.items() if key in name), None)
            if kind is None:
                continue
            copies[kind]["count"] += 1
            size = _copy_bytes(e)
            if size is None:
                sized = False
            else:
                copies[kind]["bytes"] += size
    if not sized:
        for record in copies.values():
            record["bytes"] = None
    return {"kernel_launches": launches, "graph_launches": graph_launches, "synchronisations": sum(syncs.values()),
            "synchronisations_by_call": syncs, "cuda_malloc": mallocs, "cuda_free": frees, "copies": copies,
            "gpu_busy_us": busy_us}


def _copy_bytes(event: Any) -> int | None:
    """A device copy's size from the profiler's activity metadata (structured in newer torch
    versions, a JSON fragment in older ones); None where this torch does not expose it."""
    try:
        size = getattr(getattr(event, "event_metadata", None), "bytes", None)
        if size is None:
            metadata = getattr(event, "metadata", None)
            size = metadata.get("bytes") if isinstance(metadata, Mapping) else None
        if size is not None:
            return int(size)
        text = getattr(event, "_metadata_json", None)
        if text is None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # deprecated in newer versions, where the above answers
                text = getattr(event, "metadata_json", None)
    except Exception:  # an accessor this torch version does not support
        return None
    found = re.search(r'"bytes"\s*:\s*(\d+)', str(text or ""))
    return int(found.group(1)) if found else None


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (for a process group's ``MASTER_PORT``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def max_over_ranks(value: float) -> float:
    """The largest ``value`` over the ranks of the process group (a collective)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def mean_std(values: Sequence[float]) -> str:
    """``"mean +- sample std"`` with three decimals (std 0 for one value); a run that measured
    NaN (a diverged model) shows as ``nan (k of n)`` rather than hiding in a mean."""
    bad = sum(not math.isfinite(v) for v in values)
    if bad:
        return f"nan ({bad} of {len(values)})"
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
