"""The harness every benchmark script runs on: the shared arguments (seeds, torch threads,
parallel runs, output folder), one process per run with its result in one JSON file, the
summary's mean +- std, and the timing (device synchronisation, a per-step timer).

A sweep table (``ssl_table.py``, ``noisy_table.py``, ``medmnist_table.py``, ``tabular_table.py``,
``hardness.py``) is a :class:`Table`: its run keys, its worker function, the path of a run's JSON
and its summary; :func:`sweep_main` gives every table the same command line: it declares the
shared arguments (:func:`sweep_arguments`), runs each missing run as ``script --worker <fields>``
through :func:`run_sweep` (a run whose JSON exists is not repeated), reads the JSON files back
with :func:`load_results` and prints the table's summary. A single-run script declares its shared
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# StepTimer and ProfiledSteps come from callbacks.py through __getattr__ below
__all__ = [  # noqa: F822 (StepTimer and ProfiledSteps are defined by __getattr__)
    "ProfiledSteps", "StepTimer", "Table", "apply_threads", "cuda_activity", "curve_mean", "device_label", "free_port",
    "git_commit", "load_results", "max_over_ranks", "mean_std", "mean_std_of_known", "median_seconds", "on_gpu",
    "paired_difference", "run_arguments", "run_processes", "run_sweep", "run_worker", "sweep_arguments", "sweep_main",
    "sync", "worker_command", "worker_options", "write_result"]

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
              jobs: int, stop_at: float | None = None) -> list[tuple[list[str], int]]:
    """Run ``command(*run)`` for every run whose ``result_path(*run)`` does not exist yet, at most
    ``jobs`` at once (each writes its own JSON file); none starts after ``stop_at`` (a
    ``time.time()``). Returns the commands that failed, with their exit status."""
    return run_processes((command(*run) for run in runs if not result_path(*run).exists()), jobs, ROOT, stop_at)


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
    """The repository's commit (``+dirty`` when the package's or the benchmarks' tracked files differ from
    it), recorded in each run's JSON."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "lpa3_lightning", "benchmarks"],
                           cwd=ROOT).returncode != 0
    return head.stdout.strip() + ("+dirty" if dirty else "") if head.returncode == 0 else "unknown"


def paired_difference(base: Mapping[int, float], other: Mapping[int, float], confidence: float = 0.95) -> dict:
    """:func:`lpa3_lightning.cli.paired.paired_difference`, the package's one implementation (imported
    here when called: importing the harness imports no Lightning, and the statistics need none)."""
    from lpa3_lightning.cli.paired import paired_difference as package_paired_difference

    return package_paired_difference(base, other, confidence)


def load_results(out: Path, keep: Callable[[dict], bool] = lambda result: True) -> list[dict]:
    """The results in ``out`` (sorted by file name) that ``keep`` accepts."""
    if not out.exists():
        return []
    return [r for r in (json.loads(p.read_text()) for p in sorted(out.glob("*.json"))) if keep(r)]


@dataclass(frozen=True)
class Table:
    """A sweep table, for :func:`sweep_main`: what one run is, how one runs, where its JSON goes
    and how the runs are summarised. A run is a tuple of the ``keys`` fields (name, type), e.g.
    ``(("source", str), ("labels", int), ("method", str), ("seed", int))``; every hook takes the
    parsed arguments first.

    * ``script``: the table's file; each missing run runs as ``script --worker <run fields>``.
    * ``arguments(parser)``: the table's own flags (the shared ones are added after them).
    * ``runs(args)``: the runs the flags ask for, in the order they start.
    * ``result_path(args, *run)``: the run's JSON file; a run whose file exists is not repeated.
    * ``worker(args, *run)``: trains one run and writes its JSON (in the worker's process).
    * ``summarize(args, results)``: the text printed at the end.
    * ``out``, ``seeds``: the defaults of ``--out`` and ``--seeds``.
    * ``keep(args, result)``: which JSON files in ``--out`` the summary reads (default: all).
    * ``results(args, runs)``: the results to summarise, in place of ``keep`` over ``--out``.
    * ``deadline``: adds ``--deadline SECONDS``: no run starts after it, and each worker gets the
      moment as ``--stop-at`` (a ``time.time()``) to stop itself.
    """

    script: str | Path
    description: str
    keys: tuple[tuple[str, type], ...]
    arguments: Callable[[argparse.ArgumentParser], None]
    runs: Callable[[argparse.Namespace], Iterable[tuple]]
    result_path: Callable[..., Path]
    worker: Callable[..., Any]
    summarize: Callable[[argparse.Namespace, list[dict]], str]
    out: Path
    seeds: Sequence[int] = (0, 1, 2)
    keep: Callable[[argparse.Namespace, dict], bool] | None = None
    results: Callable[[argparse.Namespace, list[tuple]], list[dict]] | None = None
    deadline: bool = False


#: flags a sweep's process does not pass on to its workers (the worker's own, or the sweep's alone)
_SWEEP_ONLY = {"help", "worker", "jobs", "deadline", "summary_only"}


def sweep_main(table: Table, argv: Sequence[str] | None = None) -> None:
    """The command line of every sweep table: the table's flags and the shared ones (``--seeds``,
    ``--out``, ``--jobs``, ``--threads``, ``--summary-only``; ``--deadline`` where the table has
    one). With ``--worker <run fields>`` it trains that one run; otherwise it starts, as
    ``script --worker ...`` processes, every run of ``table.runs`` whose JSON is missing
    (``--jobs`` at once; each worker gets every flag given here that differs from its default),
    then prints ``table.summarize`` of the results. Exits with status 1 after the summary when a
    run failed."""
    parser = argparse.ArgumentParser(description=table.description)
    table.arguments(parser)
    sweep_arguments(parser, out=table.out, seeds=table.seeds)
    parser.add_argument("--summary-only", action="store_true",
                        help="summarise the runs already in --out, starting none")
    if table.deadline:
        parser.add_argument("--deadline", type=float, default=None, metavar="SECONDS",
                            help="seconds from now after which no run starts and running ones stop after their epoch")
        parser.add_argument("--stop-at", type=float, default=None, help=argparse.SUPPRESS)
    names = tuple(name for name, _ in table.keys)
    parser.add_argument("--worker", nargs=len(names), metavar=names, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs is the number of runs at once: give 1 or more, got {args.jobs}")
    # workers run in the repository root: a relative --out must name the folder this process checks
    args.out = args.out.resolve()
    apply_threads(args.threads)
    if args.worker:
        table.worker(args, *_run_fields(parser, table.keys, args.worker))
        return
    runs = [tuple(run) for run in table.runs(args)]
    failed: list[tuple[list[str], int]] = []
    if not args.summary_only:
        if table.deadline and args.deadline is not None:
            args.stop_at = time.time() + args.deadline
        options = worker_options(parser, args)
        failed = run_sweep(runs, lambda *run: table.result_path(args, *run),
                           lambda *run: worker_command(table.script, run, options), args.jobs,
                           args.stop_at if table.deadline else None)
    if table.results is not None:
        results = table.results(args, runs)
    else:
        results = load_results(args.out, (lambda r: table.keep(args, r)) if table.keep else (lambda r: True))
    print(table.summarize(args, results))
    for command, status in failed:
        fields = " ".join(command[command.index("--worker") + 1:][:len(names)])
        print(f"run {fields} failed (exit status {status}; its error output is above): no JSON for it",
              file=sys.stderr)
    if failed:
        sys.exit(1)


def worker_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, Any]:
    """The flags of ``args`` that differ from their defaults, by long name, for a worker's command
    line (:func:`worker_command`); the sweep's own flags (``--jobs``, ``--worker``, ...) left out."""
    options = {}
    for action in parser._actions:
        if not action.option_strings or action.dest in _SWEEP_ONLY:
            continue
        value = getattr(args, action.dest)
        if value != action.default:
            options[max(action.option_strings, key=len)] = value
    return options


def _run_fields(parser: argparse.ArgumentParser, keys: Sequence[tuple[str, type]], values: Sequence[str]) -> tuple:
    """``--worker``'s strings as the run's fields, by the table's types."""
    fields = []
    for (name, kind), value in zip(keys, values):
        try:
            fields.append(kind(value))
        except ValueError:
            order = " ".join(key for key, _ in keys)
            parser.error(f"--worker: the run's {name} must parse as {kind.__name__}, got {value!r} "
                         f"(give the fields in this order: {order})")
    return tuple(fields)


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


def __getattr__(name: str) -> Any:
    """:class:`StepTimer` and :class:`ProfiledSteps`, from ``callbacks.py`` on first use: they need
    Lightning, whose import takes seconds that a sweep's summary, ``--help`` and a worker of a
    table that times nothing do not need."""
    if name in ("StepTimer", "ProfiledSteps"):
        from benchmarks import callbacks

        return getattr(callbacks, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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


def mean_std_of_known(values: Sequence[float | None]) -> str:
    """:func:`mean_std` of the values that were measured (None: not measured in that run); ``-`` for none."""
    known = [v for v in values if v is not None]
    return mean_std(known) if known else "-"


def curve_mean(result: Mapping[str, Any], key: str) -> float | None:
    """The mean of one column of a run's curve (its rows per interval or epoch) over the rows that
    have a value; None where none has."""
    values = [row[key] for row in result["curve"] if row.get(key) is not None]
    return statistics.mean(values) if values else None


def run_processes(commands: Iterable[list[str]], jobs: int, cwd: Path,
                  stop_at: float | None = None) -> list[tuple[list[str], int]]:
    """Run the commands as subprocesses, at most ``jobs`` at once, and wait for all; none starts
    after ``stop_at`` (a ``time.time()``). Returns the commands that failed, with their exit status."""
    running: list[subprocess.Popen] = []
    failed: list[tuple[list[str], int]] = []

    def reap() -> None:
        for p in [p for p in running if p.poll() is not None]:
            running.remove(p)
            if p.returncode != 0:
                failed.append((list(p.args), p.returncode))

    for cmd in commands:
        if stop_at is not None and time.time() >= stop_at:
            break
        running.append(subprocess.Popen(cmd, cwd=cwd))
        while len(running) >= jobs:
            time.sleep(1)
            reap()
    for p in running:
        p.wait()
    reap()
    return failed
