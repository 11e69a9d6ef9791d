"""``lpa3 compare``: does LP-A3 help on your data, at what cost? One config, run with LP-A3 and with it
off, on paired seeds; a JSON per run; the paired difference of every test metric with its interval.

    lpa3 compare --config my.yaml --seeds 0 1 2 3 4 --out runs/compare [--jobs 2] [--threads 1]
                 [fit overrides, e.g. --trainer.max_epochs 20]

Each seed runs the config twice: as given (arm ``lpa3``) and with every ``LPA3Callback`` switched off
(arm ``off``: ``augment="off"``, which spends no forward and leaves every batch untouched, so the run is
the config without LP-A3). The seed is the run's ``seed_everything`` (the initial weights) and, where the
data module takes one, its ``seed`` (the labeled split, the label noise): both arms of a seed share them,
and the difference of the two arms on a seed cancels what the seed changes. Each run is ``lpa3 fit``
followed by a test of the checkpoint ``lpa3 fit --test_after_fit`` tests (the best one, or the final
weights), in a process of its own with ``--threads`` torch threads, ``--jobs`` at a time; it writes
``<out>/<arm>_seed<S>.json`` (the config files and overrides, the seed, the arm, every test metric, the
fit's and the test's wall seconds, the package's version and commit) and its log ``<out>/logs/``. A run
whose JSON exists is not run again, so a stopped comparison resumes; a run that fails is named with its
log and the others go on (the command then exits 1). The summary: each seed's metrics, then per test
metric the mean difference ``lpa3 - off`` with its 95% Student-t interval and verdict
(:mod:`lpa3_lightning.cli.paired`: none for fewer than 3 seeds or no spread), the seeds a 1- and a
2-point difference would need at the printed spread, and the wall-time ratio.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import inspect
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lpa3_lightning.cli.paired import paired_difference, seeds_needed

__all__ = ["ARMS", "main", "run_name", "summarize"]

#: the arms: the config as given, and the same with LP-A3 off
ARMS = ("lpa3", "off")


def run_name(arm: str, seed: int) -> str:
    """The name of one run's JSON (``<name>.json``), log and folder."""
    return f"{arm}_seed{seed}"


# ---------------------------------------------------------------------------------------- one run
def _yaml_configs(configs: Sequence[str]) -> dict[str, Any]:
    """The configs' top-level keys merged in order (later files win, as LightningCLI merges them)."""
    import yaml

    merged: dict[str, Any] = {}
    for path in configs:
        loaded = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(loaded, dict):
            raise SystemExit(f"lpa3 compare: error: --config {path} holds no mapping of settings. Fix: pass a YAML "
                             "config of `lpa3 fit`.")
        for key, value in loaded.items():
            if isinstance(value, dict) and isinstance(merged.get(key), dict):
                merged[key] = {**merged[key], **value}
            else:
                merged[key] = value
    return merged


def _data_parameters(config: dict[str, Any], overrides: Sequence[str]) -> set[str]:
    """The ``__init__`` parameters of the run's data module class (from the overrides' ``--data``, else the
    config's ``data.class_path``); empty when it names none or does not import."""
    path = None
    data = config.get("data")
    if isinstance(data, dict):
        path = data.get("class_path")
    for k, item in enumerate(overrides):
        if item.startswith("--data="):
            path = item.split("=", 1)[1]
        elif item in ("--data", "--data.class_path") and k + 1 < len(overrides):
            path = overrides[k + 1]
    if not isinstance(path, str) or "." not in path:
        return set()
    module, _, name = path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return set()
    return set(inspect.signature(cls.__init__).parameters) - {"self"}


def run_arguments(configs: Sequence[str], overrides: Sequence[str], arm: str, seed: int, folder: Path) -> list[str]:
    """The ``lpa3 fit`` arguments of one run: the configs and overrides, then the seed, the run's folder for
    the logs, checkpoints and the data module's split or noise file, and no test after the fit (the worker
    tests, as ``--test_after_fit`` would)."""
    config = _yaml_configs(configs)
    args = [item for path in configs for item in ("--config", str(path))] + list(overrides)
    args += [f"--seed_everything={seed}", f"--trainer.default_root_dir={folder}", "--test_after_fit=false"]
    logger = (config.get("trainer") or {}).get("logger")
    if isinstance(logger, dict) and isinstance(logger.get("init_args"), dict) and "save_dir" in logger["init_args"]:
        args.append(f"--trainer.logger.init_args.save_dir={folder}")
    parameters = _data_parameters(config, overrides)
    if "seed" in parameters:
        args.append(f"--data.init_args.seed={seed}")
    for name, file in (("split_file", "labeled_split.json"), ("noise_file", "noisy_labels.json")):
        if name in parameters:
            args.append(f"--data.init_args.{name}={folder / file}")
    return args


def fingerprint(configs: Sequence[str], overrides: Sequence[str]) -> str:
    """A hash of the configs' text and the overrides: the runs of one comparison share it."""
    digest = hashlib.sha256()
    for path in configs:
        digest.update(Path(path).read_bytes())
    digest.update(json.dumps(list(overrides)).encode())
    return digest.hexdigest()[:16]


def worker(configs: Sequence[str], overrides: Sequence[str], arm: str, seed: int, out: Path, threads: int) -> None:
    """One run in this process: fit, test, and (rank 0) its JSON."""
    import torch

    from lpa3_lightning import LPA3Callback, __version__
    from lpa3_lightning.cli.command import build_cli

    torch.set_num_threads(threads)
    folder = out / "runs" / run_name(arm, seed)
    cli = build_cli(run_arguments(configs, overrides, arm, seed, folder), run=False)
    trainer = cli.trainer
    callbacks = [c for c in trainer.callbacks if isinstance(c, LPA3Callback)]
    if not callbacks:
        raise SystemExit("lpa3 compare: error: the config has no LPA3Callback in trainer.callbacks, so both arms would "
                         "be the same run. Fix: add `- class_path: lpa3_lightning.LPA3Callback` under "
                         "trainer.callbacks.")
    if arm == "off":
        for callback in callbacks:  # nothing else of the callback acts once it is off
            callback.augment, callback.noise_norm = "off", None
    started = time.perf_counter()
    trainer.fit(cli.model, datamodule=cli.datamodule)
    fit_seconds = time.perf_counter() - started
    checkpoint = getattr(trainer, "checkpoint_callback", None)
    best = getattr(checkpoint, "best_model_path", "") if checkpoint is not None else ""
    started = time.perf_counter()
    results = trainer.test(cli.model, datamodule=cli.datamodule, ckpt_path=best or None, verbose=False)
    test_seconds = time.perf_counter() - started
    if trainer.is_global_zero:
        record = {"arm": arm, "seed": seed, "configs": [str(c) for c in configs], "overrides": list(overrides),
                  "metrics": {k: float(v) for k, v in (results[0] if results else {}).items()},
                  "wall_seconds": fit_seconds, "test_seconds": test_seconds, "tested": best or "final weights",
                  "world_size": trainer.world_size, "torch_threads": torch.get_num_threads(),
                  "lpa3_lightning": __version__, "commit": _commit(), "fingerprint": fingerprint(configs, overrides)}
        path = out / f"{run_name(arm, seed)}.json"
        partial = path.with_name(f".{path.name}.partial")
        partial.write_text(json.dumps(record, indent=1))
        os.replace(partial, path)  # a JSON is whole or absent: a run stopped while writing runs again


def _commit() -> str | None:
    """The package's git commit (``+dirty`` with local changes) when it runs from a checkout, else None."""
    folder = Path(__file__).resolve().parents[2]
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=folder)
    if head.returncode != 0:
        return None
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "lpa3_lightning"], cwd=folder).returncode != 0
    return head.stdout.strip() + ("+dirty" if dirty else "")


# ---------------------------------------------------------------------------------------- the comparison
def _launch(configs: Sequence[str], overrides: Sequence[str], arm: str, seed: int, out: Path,
            threads: int) -> subprocess.Popen:
    command = [sys.executable, "-m", "lpa3_lightning.cli.compare", "--worker", arm, str(seed), "--out", str(out),
               "--threads", str(threads), *[item for path in configs for item in ("--config", str(path))],
               "--", *overrides]
    log = (out / "logs" / f"{run_name(arm, seed)}.log").open("w")
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    job = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=os.getcwd())
    job.log = log  # type: ignore[attr-defined]
    return job


def load_runs(out: Path) -> dict[tuple[str, int], dict]:
    """Every run's JSON in ``out``, by (arm, seed)."""
    runs = {}
    for path in sorted(out.glob("*_seed*.json")):
        record = json.loads(path.read_text())
        runs[(record["arm"], int(record["seed"]))] = record
    return runs


def summarize(runs: dict[tuple[str, int], dict], seeds: Sequence[int]) -> str:
    """The per-seed table and the paired rows (``lpa3 - off``) of every test metric, and the wall-time ratio."""
    metrics = sorted({m for record in runs.values() for m in record["metrics"]})
    lines = ["seed  " + "  ".join(f"{arm}:{m}" for m in metrics for arm in ARMS) + "  lpa3:s  off:s"]
    for seed in seeds:
        row = [f"{seed:<4}"]
        for metric in metrics:
            for arm in ARMS:
                value = runs.get((arm, seed), {}).get("metrics", {}).get(metric)
                row.append(f"{value:.4f}" if value is not None else "-")
        row += [f"{runs[(arm, seed)]['wall_seconds']:.0f}" if (arm, seed) in runs else "-" for arm in ARMS]
        lines.append("  ".join(row))
    lines.append("")
    for metric in metrics:
        values = {arm: {s: runs[(arm, s)]["metrics"][metric] for s in seeds
                        if (arm, s) in runs and metric in runs[(arm, s)]["metrics"]} for arm in ARMS}
        d = paired_difference(values["off"], values["lpa3"])
        if not d["n"]:
            continue
        low, high = d["ci"]
        need = [seeds_needed(effect, d["std"]) if d["n"] > 1 else None for effect in (0.01, 0.02)]
        lines.append(f"{metric}: lpa3 - off over {d['n']} seeds: mean {d['mean']:+.4f}"
                     + (f" +- {d['std']:.4f} (sd), 95% interval [{low:+.4f}, {high:+.4f}]" if d["n"] > 1 else "")
                     + f", lpa3 above on {d['above']} of {d['n']}: {d['verdict']}"
                     + (f"; at this spread +1 point (0.01) needs {need[0] or '>1000'} seeds, +2 points "
                        f"{need[1] or '>1000'}" if d["n"] > 1 else ""))
    paired = [s for s in seeds if all((arm, s) in runs for arm in ARMS)]
    if paired:
        ratios = [runs[("lpa3", s)]["wall_seconds"] / max(runs[("off", s)]["wall_seconds"], 1e-9) for s in paired]
        lines.append(f"fit wall time: lpa3 / off = {statistics.mean(ratios):.2f}x (per seed "
                     f"{', '.join(f'{r:.2f}' for r in ratios)}; runs side by side with --jobs > 1 share the machine)")
    lines.append("How to read it: a seed fixes the initial weights (and the split or noise) for both arms, so each "
                 "difference is paired; the interval is where the mean difference lies with 95% confidence given the "
                 "spread between seeds; 'no difference found' means it holds 0, not that there is none.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lpa3 compare", description=__doc__.split("\n\n")[0],
                                     usage="lpa3 compare --config FILE [--config FILE ...] --seeds S [S ...] --out DIR "
                                           "[--jobs N] [--threads T] [lpa3 fit overrides ...]")
    parser.add_argument("--config", action="append", required=True, help="an `lpa3 fit` YAML config (repeatable)")
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="the paired seeds (3 or more for a verdict)")
    parser.add_argument("--out", type=Path, required=True, help="folder of the runs' JSON, logs and checkpoints")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (each in its own process)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each run")
    parser.add_argument("--summary-only", action="store_true", help="print the summary of the runs in --out")
    parser.add_argument("--worker", nargs=2, metavar=("ARM", "SEED"), help=argparse.SUPPRESS)
    argv = list(sys.argv[1:] if argv is None else argv)
    # everything after "--", or any option this parser does not know, goes to `lpa3 fit`
    own, fit_overrides = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    args, unknown = parser.parse_known_args(own)
    overrides = [*unknown, *fit_overrides]
    for path in args.config:
        if not Path(path).is_file():
            parser.error(f"--config {path} does not exist. Fix: pass the YAML config of an `lpa3 fit` run.")
    if args.worker is not None:
        worker(args.config, overrides, args.worker[0], int(args.worker[1]), args.out, args.threads)
        return 0
    if not args.seeds:
        parser.error("--seeds is needed: the paired seeds, e.g. --seeds 0 1 2 3 4 (3 or more give a verdict).")
    if len(set(args.seeds)) != len(args.seeds):
        parser.error(f"--seeds {args.seeds} repeats a seed. Fix: give each seed once.")
    for name in ("jobs", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}.")
    (args.out / "logs").mkdir(parents=True, exist_ok=True)
    if args.summary_only:
        print(summarize(load_runs(args.out), args.seeds))
        return 0
    planned = [(arm, seed) for seed in args.seeds for arm in ARMS]
    done = load_runs(args.out)
    mine = fingerprint(args.config, overrides)
    foreign = sorted(f"{run_name(*run)}.json" for run, record in done.items() if record.get("fingerprint") != mine)
    if foreign:
        parser.error(f"--out {args.out} holds runs of another config or other overrides ({', '.join(foreign[:4])}"
                     f"{', ...' if len(foreign) > 4 else ''}), which this comparison would count as its own. Fix: "
                     "pass a new --out, or the configs and overrides those runs were made with.")
    todo = [run for run in planned if run not in done]
    print(f"lpa3 compare: {len(planned)} runs ({len(args.seeds)} seeds x arms {', '.join(ARMS)}), "
          f"{len(planned) - len(todo)} already in {args.out}, {len(todo)} to run, {args.jobs} at a time, "
          f"{args.threads} thread(s) each", flush=True)
    failed: list[str] = []
    running: list[tuple[subprocess.Popen, str, int, float, int]] = []
    position = len(planned) - len(todo)
    queue = list(todo)
    while queue or running:
        while queue and len(running) < args.jobs:
            arm, seed = queue.pop(0)
            position += 1
            print(f"[{position}/{len(planned)}] start: arm {arm}, seed {seed}", flush=True)
            running.append((_launch(args.config, overrides, arm, seed, args.out, args.threads), arm, seed,
                            time.perf_counter(), position))
        time.sleep(0.5)
        for entry in list(running):
            job, arm, seed, started, at = entry
            if job.poll() is None:
                continue
            running.remove(entry)
            job.log.close()  # type: ignore[attr-defined]
            log = args.out / "logs" / f"{run_name(arm, seed)}.log"
            result = args.out / f"{run_name(arm, seed)}.json"
            if job.returncode != 0 or not result.exists():
                failed.append(f"arm {arm}, seed {seed} (exit {job.returncode}; log: {log})")
                print(f"[{at}/{len(planned)}] FAILED: arm {arm}, seed {seed}, exit {job.returncode}; its log: {log}",
                      flush=True)
                continue
            metrics = json.loads(result.read_text())["metrics"]
            shown = ", ".join(f"{k} {v:.4f}" for k, v in sorted(metrics.items()))
            print(f"[{at}/{len(planned)}] done: arm {arm}, seed {seed} in {time.perf_counter() - started:.0f} s: "
                  f"{shown or 'no test metric'}", flush=True)
    print("\n" + summarize(load_runs(args.out), args.seeds))
    if failed:
        print(f"\n{len(failed)} run(s) failed: " + "; ".join(failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":  # the worker's entry (python -m lpa3_lightning.cli.compare --worker ...)
    sys.exit(main())
