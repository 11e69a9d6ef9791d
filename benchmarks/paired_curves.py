"""The pre-registered statistic of E1-E3 (docs/results.md) over a folder of ``ssl_table.py`` or
``noisy_table.py`` run JSONs: per pair of arms, seed by seed, the difference of (a) the mean of the
last three evaluations of the raw test accuracy and (b) the curve mean, with the paired Student-t
95% interval, the verdict and the seeds needed for +1 / +2 points (``lpa3_lightning.cli.paired``,
the statistics ``lpa3 compare`` prints).

    python benchmarks/paired_curves.py docs/ssl_runs/e1 \
        --pairs fixmatch_lpa3:fixmatch fixmatch_null:fixmatch fixmatch_lpa3:fixmatch_null

``--equal-compute ARM:BASE:RATIO`` adds E3's reading at equal compute: an arm whose step costs RATIO times
the base's (``benchmarks/fixmatch_step.py``) is read at its last evaluation step s with RATIO s <= the base's
last step, against the base's curve at step RATIO s (linear between its evaluations), seed by seed.

Prints one markdown table; ``--json`` writes the rows too. Reads only the JSONs, trains nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

from lpa3_lightning.cli.paired import paired_difference, seeds_needed, seeds_needed_text

#: the curve key of each table's accuracy (ssl_table: the raw weights; noisy_table: the test accuracy)
ACCURACY_KEYS = ("raw_test_acc", "test_acc")


def accuracy_curve(run: dict) -> list[float]:
    """The run's accuracy curve: ``raw_test_acc`` where the run has it (ssl_table), else ``test_acc``."""
    points = run["curve"]
    key = next(k for k in ACCURACY_KEYS if points and k in points[0])
    return [float(p[key]) for p in points]


def run_measures(run: dict, last: int = 3) -> dict[str, float]:
    """(a) the mean of the last ``last`` evaluations, (b) the mean over all of them."""
    curve = accuracy_curve(run)
    if len(curve) < last:
        raise ValueError(f"run {run.get('method')} seed {run.get('seed')} has {len(curve)} evaluations, "
                         f"fewer than {last}. Fix: let it finish.")
    return {"last3": statistics.mean(curve[-last:]), "curve_mean": statistics.mean(curve)}


def arm_name(run: dict) -> str:
    """A run's arm: its ``method``, with ``_k<K>`` where LP-A3 reused ``x'`` from a cache for K epochs (the
    suffix of ssl_table.py's file names; plain FixMatch has no cache), so that a cached and an uncached run of one
    method stay apart."""
    regenerate = int(run.get("regenerate_every_n_epochs") or 1)
    return run["method"] + (f"_k{regenerate}" if regenerate > 1 and run["method"] != "fixmatch" else "")


#: the settings that make two runs of one arm and seed different experiments (named when a folder mixes them)
PROTOCOL_KEYS = ("source", "labels", "steps", "eval_every", "rate", "epochs", "solve_trained_only", "lpa3_confidence",
                 "commit")


def load_runs(folder: Path) -> dict[str, dict[int, dict]]:
    """``{arm: {seed: run}}`` of every finished run JSON in ``folder`` (``*.partial.json`` skipped; the arm is
    :func:`arm_name`); two runs of one arm and seed are refused."""
    runs: dict[str, dict[int, dict]] = {}
    files: dict[tuple[str, int], str] = {}
    for path in sorted(folder.glob("*.json")):
        if path.name.endswith(".partial.json"):
            continue
        run = json.loads(path.read_text())
        if "curve" not in run:
            continue
        arm, seed = arm_name(run), int(run["seed"])
        by_seed = runs.setdefault(arm, {})
        if seed in by_seed:
            other = by_seed[seed]
            differ = [k for k in PROTOCOL_KEYS if other.get(k) != run.get(k)]
            raise SystemExit(f"{folder}: two runs of arm {arm} seed {seed} ({files[(arm, seed)]} and {path.name}; "
                             f"they differ in {', '.join(differ) or 'nothing recorded'}). The statistic pairs the "
                             "runs of one protocol. Fix: point at a folder of one protocol (e.g. an --out of one "
                             "ssl_table.py command).")
        by_seed[seed], files[(arm, seed)] = run, path.name
    return runs


def accuracy_at(run: dict, step: float) -> float:
    """The run's accuracy curve at ``step``, linear between its two nearest evaluations."""
    steps, curve = [float(p["step"]) for p in run["curve"]], accuracy_curve(run)
    if not steps[0] <= step <= steps[-1]:
        raise ValueError(f"step {step:g} is outside the evaluations of run {run.get('method')} seed "
                         f"{run.get('seed')} ({steps[0]:g} to {steps[-1]:g}). Fix: a RATIO that reads the base "
                         "within its curve (a larger one, below its first evaluation).")
    for (s0, a0), (s1, a1) in zip(zip(steps, curve), zip(steps[1:], curve[1:])):
        if s0 <= step <= s1:
            return a0 + (a1 - a0) * (step - s0) / (s1 - s0) if s1 > s0 else a1
    return curve[-1]


def equal_compute_step(arm_run: dict, base_run: dict, ratio: float) -> float:
    """The arm's last evaluation step s whose cost, ``ratio`` s base steps, the base's curve still covers."""
    reach = float(base_run["curve"][-1]["step"])
    steps = [float(p["step"]) for p in arm_run["curve"] if ratio * float(p["step"]) <= reach]
    if not steps:
        raise ValueError(f"run {arm_run.get('method')} seed {arm_run.get('seed')}: no evaluation step s with "
                         f"{ratio:g} s <= {reach:g}. Fix: evaluate the arm earlier or run the base longer.")
    return max(steps)


def _row(arm: str, base: str, measure: str, base_values: dict, arm_values: dict) -> dict:
    stats = paired_difference(base_values, arm_values)  # (seeds_needed answers None for a non-finite spread)
    return {"arm": arm, "base": base, "measure": measure, **stats,
            "seeds_for_1pt": seeds_needed(0.01, stats["std"]), "seeds_for_2pt": seeds_needed(0.02, stats["std"])}


def equal_compute_row(runs: dict[str, dict[int, dict]], arm: str, base: str, ratio: float) -> dict:
    """The paired difference at equal compute: the arm at step s against the base at ``ratio`` s, per seed."""
    seeds = sorted(set(runs[arm]) & set(runs[base]))
    at = {s: equal_compute_step(runs[arm][s], runs[base][s], ratio) for s in seeds}
    if len(set(at.values())) > 1:
        raise ValueError(f"{arm} against {base}: the seeds' runs give different steps to read at "
                         f"({sorted(set(at.values()))}: their evaluations or lengths differ). Fix: compare runs of "
                         "one protocol.")
    step = next(iter(at.values()), math.nan)
    row = _row(arm, base, f"equal compute ({arm} at step {step:g}, {base} at {ratio * step:g})",
               {s: accuracy_at(runs[base][s], ratio * at[s]) for s in seeds},
               {s: accuracy_at(runs[arm][s], at[s]) for s in seeds})
    return {**row, "ratio": ratio, "arm_step": step, "base_step": ratio * step}


def pair_rows(runs: dict[str, dict[int, dict]], pairs: list[tuple[str, str]]) -> list[dict]:
    """One row per (arm, base, measure) over the seeds both arms finished (``main`` refuses an arm ``runs`` lacks)."""
    rows = []
    for arm, base in pairs:
        measured = {m: {s: run_measures(r) for s, r in runs[m].items()} for m in (arm, base)}
        for measure in ("last3", "curve_mean"):
            rows.append(_row(arm, base, measure, {s: v[measure] for s, v in measured[base].items()},
                             {s: v[measure] for s, v in measured[arm].items()}))
    return rows


def points(value: float) -> str:
    return "nan" if not math.isfinite(value) else f"{100 * value:+.1f}"


def spread_points(value: float) -> str:
    return "nan" if not math.isfinite(value) else f"{100 * value:.1f}"


def markdown(runs: dict[str, dict[int, dict]], rows: list[dict]) -> str:
    lines = ["| arm | seeds | (a) last 3, mean +- std | (b) curve mean, mean +- std | wall h (sum) |",
             "|---|---|---|---|---|"]
    for method, by_seed in runs.items():
        measured = [run_measures(r) for r in by_seed.values()]
        a, b = [m["last3"] for m in measured], [m["curve_mean"] for m in measured]
        sd = (lambda v: statistics.stdev(v) if len(v) > 1 else math.nan)
        hours = sum(r.get("wall_seconds", 0.0) for r in by_seed.values()) / 3600
        lines.append(f"| {method} | {', '.join(map(str, sorted(by_seed)))} | {statistics.mean(a):.3f} +- {sd(a):.3f} "
                     f"| {statistics.mean(b):.3f} +- {sd(b):.3f} | {hours:.2f} |")
    lines += ["", "| difference (points) | measure | per seed | mean +- std | 95% interval | above / below | verdict "
              "| seeds for +1 / +2 |", "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        low, high = row["ci"]
        lines.append(f"| {row['arm']} minus {row['base']} | {row['measure']} | "
                     f"{' / '.join(points(d) for d in row['diffs'])} | {points(row['mean'])} +- "
                     f"{spread_points(row['std'])} | "
                     f"[{points(low)}, {points(high)}] | {row['above']} / {row['below']} of {row['n']} | "
                     f"**{row['verdict']}** | "
                     f"{seeds_needed_text(row['seeds_for_1pt'], row['std'])} / "
                     f"{seeds_needed_text(row['seeds_for_2pt'], row['std'])} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--pairs", nargs="+", required=True, help="ARM:BASE, e.g. fixmatch_lpa3:fixmatch")
    parser.add_argument("--equal-compute", nargs="+", default=[], metavar="ARM:BASE:RATIO",
                        help="also read ARM at equal compute with BASE, ARM's step costing RATIO x BASE's")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args()
    pairs = []
    for text in args.pairs:
        arm, sep, base = text.partition(":")
        if not sep or not arm or not base:
            raise SystemExit(f"--pairs: {text!r} is not ARM:BASE. Fix: e.g. fixmatch_lpa3:fixmatch.")
        pairs.append((arm, base))
    equal = []
    for text in args.equal_compute:
        parts = text.split(":")
        try:
            ratio = float(parts[2]) if len(parts) == 3 and all(parts) else math.nan
        except ValueError:
            ratio = math.nan
        if not (ratio > 0 and math.isfinite(ratio)):
            raise SystemExit(f"--equal-compute: {text!r} is not ARM:BASE:RATIO with RATIO > 0 (the arm's step "
                             "cost over the base's). Fix: e.g. fixmatch_lpa3:fixmatch:2.5.")
        equal.append((parts[0], parts[1], ratio))
    runs = load_runs(args.folder)
    if not runs:
        raise SystemExit(f"{args.folder}: no finished run JSON. Fix: point at an --out folder of ssl_table.py.")
    missing = sorted({a for pair in pairs + [e[:2] for e in equal] for a in pair} - set(runs))
    if missing:
        raise SystemExit(f"{args.folder} has no run of arm(s) {', '.join(missing)}; its arms are "
                         f"{', '.join(sorted(runs))}. Fix: name arms of this folder.")
    try:
        rows = pair_rows(runs, pairs) + [equal_compute_row(runs, a, b, k) for a, b, k in equal]
    except ValueError as error:
        raise SystemExit(str(error)) from None
    print(markdown(runs, rows))
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
