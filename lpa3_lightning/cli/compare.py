"""``lpa3 compare``: does LP-A3 help on your data, at what cost? One config, run with LP-A3 and with it
off, on paired seeds; a JSON per run; the paired difference of every test metric with its interval.

Each seed runs the config as given (arm ``lpa3``) and with every ``LPA3Callback`` off (arm ``off``:
``augment="off"``, the config without LP-A3); ``--arms lpa3 null off`` adds the control ``null``
(``augment="null"``: the LP-A3 term's rows, labels and weights with ``x' = x``, no solver), whose difference
from ``lpa3`` is the solver's part of a gain. Every arm seeds ``seed_everything`` and the data module's ``seed``
(the split, the noise) with it, so their difference cancels what the seed changes. A run (``lpa3 fit``, then a
test as ``--test_after_fit``'s) is a process of its own, ``--jobs`` at a time with ``--threads`` torch threads,
and writes ``<out>/<arm>_seed<S>.json`` (configs, overrides, seed, arm, test metrics, wall seconds, version,
commit) and ``<out>/logs/<arm>_seed<S>.log``. A run whose JSON exists is not run again (a stopped comparison
resumes); a failed one is named with its log and the command exits 1. The summary: each seed's metrics, per
test metric and pair of arms (each arm against ``off``, and ``lpa3`` against ``null``) the mean difference, its
95% Student-t interval and verdict (:mod:`lpa3_lightning.cli.paired`),
the seeds a 1- and a 2-point difference need, and the wall-time ratios.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from lpa3_lightning.cli.paired import paired_difference, seeds_needed, seeds_needed_text

__all__ = ["ARMS", "DEFAULT_ARMS", "comparisons", "main", "run_name", "summarize"]

#: the arms a comparison can run, in the order it reports them: the config as given (its callbacks at
#: augment="lpa3"), its LP-A3 term with x' = x (augment="null"), the config without LP-A3 (augment="off")
ARMS = ("lpa3", "null", "off")
#: the arms run when --arms is not given
DEFAULT_ARMS = ("lpa3", "off")


def comparisons(arms: Sequence[str]) -> list[tuple[str, str]]:
    """The ``(arm, base)`` pairs a summary reports: each arm against ``off``, then ``lpa3`` against ``null``
    (the solver's part), of the arms given, in :data:`ARMS`'s order whatever the order given."""
    pairs = [(arm, "off") for arm in ARMS if arm in arms and arm != "off" and "off" in arms]
    return pairs + [("lpa3", "null")] if "lpa3" in arms and "null" in arms else pairs


def run_name(arm: str, seed: int) -> str:
    """The name of one run's JSON (``<name>.json``), log and folder."""
    return f"{arm}_seed{seed}"


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
            both = isinstance(value, dict) and isinstance(merged.get(key), dict)
            merged[key] = {**merged[key], **value} if both else value
    return merged


def _data_parameters(config: dict[str, Any], overrides: Sequence[str]) -> set[str]:
    """The ``__init__`` parameters of the run's data module class (the overrides' ``--data``, else the config's
    ``data.class_path``); empty when it names none or does not import."""
    from lpa3_lightning.cli.parser import import_class

    data = config.get("data")
    path = data.get("class_path") if isinstance(data, dict) else None
    for k, item in enumerate(overrides):
        if item.startswith("--data="):
            path = item.split("=", 1)[1]
        elif item in ("--data", "--data.class_path") and k + 1 < len(overrides):
            path = overrides[k + 1]
    cls = import_class(path) if isinstance(path, str) else None
    return set(inspect.signature(cls.__init__).parameters) - {"self"} if cls is not None else set()


def run_arguments(configs: Sequence[str], overrides: Sequence[str], arm: str, seed: int, folder: Path) -> list[str]:
    """The ``lpa3 fit`` arguments of one run: the configs and overrides, then the seed, the run's folder (logs,
    checkpoints, the data module's split or noise file), and no test after the fit (the worker tests)."""
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
    """One run in this process: fit, test, and (rank 0) its JSON, written whole or not at all."""
    import torch

    from lpa3_lightning import LPA3Callback, __version__
    from lpa3_lightning.callback.settings import check_augment
    from lpa3_lightning.cli.command import build_cli, run_best_test

    torch.set_num_threads(threads)
    cli = build_cli(run_arguments(configs, overrides, arm, seed, out / "runs" / run_name(arm, seed)), run=False)
    trainer = cli.trainer
    callbacks = [c for c in trainer.callbacks if isinstance(c, LPA3Callback)]
    if not callbacks:
        raise SystemExit("lpa3 compare: error: the config has no LPA3Callback in trainer.callbacks, so every arm would "
                         "be the same run. Fix: add `- class_path: lpa3_lightning.LPA3Callback` under "
                         "trainer.callbacks.")
    controls = sorted({c.augment for c in callbacks} - {"lpa3"})
    if arm == "lpa3" and controls:  # the arm would be labelled lpa3 and train a control
        raise SystemExit(f"lpa3 compare: error: arm lpa3 runs the config as given, but its LPA3Callback has augment="
                         f"{controls[0]!r}. Fix: set augment: lpa3 in the config (the other arms set their own), or "
                         "drop lpa3 from --arms.")
    for callback in callbacks if arm != "lpa3" else ():  # (set before the fit: nothing is built from it earlier)
        try:
            callback.augment, callback.noise_norm = check_augment(arm, None, callback.cache.regenerate_every_n_epochs)
        except ValueError as error:  # (the null control with a cache: nothing to cache)
            raise SystemExit(f"lpa3 compare: error: arm {arm} cannot run this config: {error} Fix for the comparison: "
                             f"cache.regenerate_every_n_epochs=1 for every arm, or drop {arm} from --arms.") from None
    started = time.perf_counter()
    trainer.fit(cli.model, datamodule=cli.datamodule)
    fit_seconds, started = time.perf_counter() - started, time.perf_counter()
    # what the callbacks measured in the fit's last epoch (x' distances, shares selected): what the arm did
    logged = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("lpa3/") and not k.endswith("_step")}
    results, best = run_best_test(trainer, cli.model, cli.datamodule, verbose=False)
    test_seconds = time.perf_counter() - started
    if trainer.is_global_zero:
        record = {"arm": arm, "seed": seed, "configs": [str(c) for c in configs], "overrides": list(overrides),
                  "metrics": {k: float(v) for k, v in (results[0] if results else {}).items()},
                  "lpa3_last_epoch": logged,
                  "wall_seconds": fit_seconds, "test_seconds": test_seconds, "tested": best or "final weights",
                  "world_size": trainer.world_size, "torch_threads": torch.get_num_threads(),
                  "lpa3_lightning": __version__, "commit": _commit(), "fingerprint": fingerprint(configs, overrides)}
        path = out / f"{run_name(arm, seed)}.json"
        partial = path.with_name(f".{path.name}.partial")
        partial.write_text(json.dumps(record, indent=1))
        os.replace(partial, path)  # (a run stopped while writing runs again)


def _commit() -> str | None:
    """The package's git commit (``+dirty`` with local changes) when it runs from a checkout, else None."""
    folder = Path(__file__).resolve().parents[2]
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=folder)
    if head.returncode != 0:
        return None
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "lpa3_lightning"], cwd=folder).returncode != 0
    return head.stdout.strip() + ("+dirty" if dirty else "")


def _run(args: argparse.Namespace, overrides: Sequence[str], arm: str, seed: int, at: int, total: int) -> str:
    """One run in a process of its own, its output in its log; "" when it wrote its JSON, else its failure."""
    name = run_name(arm, seed)
    log, result = args.out / "logs" / f"{name}.log", args.out / f"{name}.json"
    command = [sys.executable, "-m", "lpa3_lightning.cli.compare", "--worker", arm, str(seed), "--out", str(args.out),
               "--threads", str(args.threads), *[item for path in args.config for item in ("--config", str(path))],
               "--", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    print(f"[{at}/{total}] start: arm {arm}, seed {seed}\n", end="", flush=True)  # (one write: runs share stdout)
    started = time.perf_counter()
    with log.open("w") as output:
        code = subprocess.run(command, stdout=output, stderr=subprocess.STDOUT, env=env, cwd=os.getcwd()).returncode
    if code != 0 or not result.exists():
        print(f"[{at}/{total}] FAILED: arm {arm}, seed {seed}, exit {code}; its log: {log}\n", end="", flush=True)
        return f"arm {arm}, seed {seed} (exit {code}; log: {log})"
    shown = ", ".join(f"{k} {v:.4f}" for k, v in sorted(json.loads(result.read_text())["metrics"].items()))
    print(f"[{at}/{total}] done: arm {arm}, seed {seed} in {time.perf_counter() - started:.0f} s: "
          f"{shown or 'no test metric'}\n", end="", flush=True)
    return ""


def load_runs(out: Path) -> dict[tuple[str, int], dict]:
    """Every run's JSON in ``out``, by (arm, seed)."""
    records = [json.loads(path.read_text()) for path in sorted(out.glob("*_seed*.json"))]
    return {(record["arm"], int(record["seed"])): record for record in records}


def summarize(runs: dict[tuple[str, int], dict], seeds: Sequence[int], arms: Sequence[str] = DEFAULT_ARMS) -> str:
    """The per-seed table and, for every test metric, the paired rows of :func:`comparisons` (``lpa3 - off``
    first), and each arm's wall-time ratio to its base."""
    metrics = sorted({m for record in runs.values() for m in record["metrics"]})
    lines = ["seed  " + "  ".join(f"{arm}:{m}" for m in metrics for arm in arms) + "  "
             + "  ".join(f"{arm}:s" for arm in arms)]
    for seed in seeds:
        row = [f"{seed:<4}"]
        for metric in metrics:
            for arm in arms:
                value = runs.get((arm, seed), {}).get("metrics", {}).get(metric)
                row.append(f"{value:.4f}" if value is not None else "-")
        row += [f"{runs[(arm, seed)]['wall_seconds']:.0f}" if (arm, seed) in runs else "-" for arm in arms]
        lines.append("  ".join(row))
    lines.append("")
    for metric in metrics:
        values = {arm: {s: runs[(arm, s)]["metrics"][metric] for s in seeds
                        if (arm, s) in runs and metric in runs[(arm, s)]["metrics"]} for arm in arms}
        for arm, base in comparisons(arms):
            d = paired_difference(values[base], values[arm])
            if not d["n"]:
                continue
            low, high = d["ci"]
            need = [seeds_needed_text(seeds_needed(effect, d["std"]), d["std"]) for effect in (0.01, 0.02)]
            lines.append(f"{metric}: {arm} - {base} over {d['n']} seeds: mean {d['mean']:+.4f}"
                         + (f" +- {d['std']:.4f} (sd), 95% interval [{low:+.4f}, {high:+.4f}]" if d["n"] > 1 else "")
                         + f", {arm} above on {d['above']} of {d['n']}: {d['verdict']}"
                         + (f"; at this spread +1 point (0.01) needs {need[0]} seeds, +2 points {need[1]}"
                            if d["n"] > 1 else ""))
    for arm, base in comparisons(arms):
        paired = [s for s in seeds if (arm, s) in runs and (base, s) in runs]
        if paired:
            ratios = [runs[(arm, s)]["wall_seconds"] / max(runs[(base, s)]["wall_seconds"], 1e-9) for s in paired]
            lines.append(f"fit wall time: {arm} / {base} = {statistics.mean(ratios):.2f}x (per seed "
                         f"{', '.join(f'{r:.2f}' for r in ratios)}; runs side by side with --jobs > 1 share the machine)")
    if "lpa3" in arms and "null" in arms:
        lines.append("lpa3 - null is the solver's part: null trains the same rows, labels and weights with x' = x.")
    lines.append("How to read it: a seed fixes the initial weights (and the split or noise) for every arm, so each "
                 "difference is paired; the interval is where the mean difference lies with 95% confidence given the "
                 "spread between seeds; 'no difference found' means it holds 0, not that there is none.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run ``lpa3 compare`` (or, with ``--worker ARM SEED``, one of its runs); returns the exit code."""
    parser = argparse.ArgumentParser(prog="lpa3 compare", description=__doc__.split("\n\n")[0],
                                     usage="lpa3 compare --config FILE [--config FILE ...] --seeds S [S ...] --out DIR "
                                           "[--arms A [A ...]] [--jobs N] [--threads T] [lpa3 fit overrides ...]")
    add = parser.add_argument
    add("--config", action="append", required=True, help="an `lpa3 fit` YAML config (repeatable)")
    add("--seeds", type=int, nargs="+", default=None, help="the paired seeds (3 or more for a verdict)")
    add("--out", type=Path, required=True, help="folder of the runs' JSON, logs and checkpoints")
    add("--arms", nargs="+", default=None, metavar="ARM",
        help=f"the arms, of {', '.join(ARMS)} (default: {' '.join(DEFAULT_ARMS)}, or with --summary-only the arms "
             "in --out; add null for the solver's part)")
    add("--jobs", type=int, default=1, help="runs at a time (each in its own process)")
    add("--threads", type=int, default=1, help="torch threads of each run")
    add("--summary-only", action="store_true", help="print the summary of the runs in --out")
    add("--worker", nargs=2, metavar=("ARM", "SEED"), help=argparse.SUPPRESS)
    argv = list(sys.argv[1:] if argv is None else argv)
    # everything after "--", or any option this parser does not know, goes to `lpa3 fit`
    own, fit_overrides = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    args, unknown = parser.parse_known_args(own)
    overrides = [*unknown, *fit_overrides]
    for path in args.config:
        if not Path(path).is_file():
            parser.error(f"--config {path} does not exist. Fix: pass the YAML config of an `lpa3 fit` run.")
    for arm in args.arms or ():
        if arm not in ARMS:
            noise = (" The noise control needs its norm: set augment: noise and noise_norm in a config and run it with "
                     "lpa3 fit.") if arm == "noise" else ""
            parser.error(f"--arms: {arm!r} is not an arm; the arms are {', '.join(ARMS)}.{noise}")
    if args.arms is not None and (len(set(args.arms)) != len(args.arms) or len(args.arms) < 2):
        parser.error(f"--arms {' '.join(args.arms)}: give two or more distinct arms of {', '.join(ARMS)}. Fix: e.g. "
                     "--arms lpa3 null off (the null control's difference from lpa3 is the solver's part).")
    if args.worker is not None:
        if args.worker[0] not in ARMS:
            parser.error(f"--worker {args.worker[0]}: not an arm; the arms are {', '.join(ARMS)}.")
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
        runs = load_runs(args.out)
        print(summarize(runs, args.seeds, args.arms or [arm for arm in ARMS if arm in {a for a, _ in runs}]))
        return 0
    args.arms = args.arms or list(DEFAULT_ARMS)
    planned, done = [(arm, seed) for seed in args.seeds for arm in args.arms], load_runs(args.out)
    mine = fingerprint(args.config, overrides)
    foreign = sorted(f"{run_name(*run)}.json" for run, record in done.items() if record.get("fingerprint") != mine)
    if foreign:
        parser.error(f"--out {args.out} holds runs of another config or other overrides ({', '.join(foreign[:4])}"
                     f"{', ...' if len(foreign) > 4 else ''}), which this comparison would count as its own. Fix: "
                     "pass a new --out, or the configs and overrides those runs were made with.")
    todo = [run for run in planned if run not in done]
    print(f"lpa3 compare: {len(planned)} runs ({len(args.seeds)} seeds x arms {', '.join(args.arms)}), "
          f"{len(planned) - len(todo)} already in {args.out}, {len(todo)} to run, {args.jobs} at a time, "
          f"{args.threads} thread(s) each", flush=True)
    with ThreadPoolExecutor(args.jobs) as pool:  # (a run at a time per thread, each in its own process)
        failed = [failure for failure in pool.map(lambda job: _run(args, overrides, *job[1], job[0], len(planned)),
                                                  enumerate(todo, start=len(planned) - len(todo) + 1)) if failure]
    print("\n" + summarize(load_runs(args.out), args.seeds, args.arms))
    if failed:
        print(f"\n{len(failed)} run(s) failed: " + "; ".join(failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":  # the worker's entry (python -m lpa3_lightning.cli.compare --worker ...)
    sys.exit(main())
