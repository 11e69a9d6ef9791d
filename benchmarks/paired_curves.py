"""The pre-registered statistic of E1-E3 (docs/results.md) over a folder of ``ssl_table.py`` or
``noisy_table.py`` run JSONs: per pair of arms, seed by seed, the difference of (a) the mean of the
last three evaluations of the raw test accuracy and (b) the curve mean, with the paired Student-t
95% interval, the verdict and the seeds needed for +1 / +2 points (``lpa3_lightning.cli.paired``,
the statistics ``lpa3 compare`` prints).

    python benchmarks/paired_curves.py docs/ssl_runs/e1 --base fixmatch \
        --pairs fixmatch_lpa3:fixmatch fixmatch_null:fixmatch fixmatch_lpa3:fixmatch_null

Prints one markdown table; ``--json`` writes the rows too. Reads only the JSONs, trains nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

from lpa3_lightning.cli.paired import paired_difference, seeds_needed

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


def load_runs(folder: Path) -> dict[str, dict[int, dict]]:
    """``{method: {seed: run}}`` of every finished run JSON in ``folder`` (``*.partial.json`` skipped)."""
    runs: dict[str, dict[int, dict]] = {}
    for path in sorted(folder.glob("*.json")):
        if path.name.endswith(".partial.json"):
            continue
        run = json.loads(path.read_text())
        if "curve" not in run:
            continue
        runs.setdefault(run["method"], {})[int(run["seed"])] = run
    return runs


def pair_rows(runs: dict[str, dict[int, dict]], pairs: list[tuple[str, str]]) -> list[dict]:
    """One row per (arm, base, measure) over the seeds both arms finished."""
    rows = []
    for arm, base in pairs:
        if arm not in runs or base not in runs:
            continue
        measured = {m: {s: run_measures(r) for s, r in runs[m].items()} for m in (arm, base)}
        for measure in ("last3", "curve_mean"):
            stats = paired_difference({s: v[measure] for s, v in measured[base].items()},
                                      {s: v[measure] for s, v in measured[arm].items()})
            spread = stats["std"] if math.isfinite(stats["std"]) else math.nan
            rows.append({"arm": arm, "base": base, "measure": measure, **stats,
                         "seeds_for_1pt": seeds_needed(0.01, spread) if math.isfinite(spread) else None,
                         "seeds_for_2pt": seeds_needed(0.02, spread) if math.isfinite(spread) else None})
    return rows


def points(value: float) -> str:
    return "nan" if not math.isfinite(value) else f"{100 * value:+.1f}"


def spread_points(value: float) -> str:
    return "nan" if not math.isfinite(value) else f"{100 * value:.1f}"


def seeds_cell(needed: int | None, std: float) -> str:
    # None means no spread to size from (one seed) or, with one, that even the cap (1,000 seeds) falls short
    if not math.isfinite(std):
        return "n/a"
    return "> 1000" if needed is None else str(needed)


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
                     f"{seeds_cell(row['seeds_for_1pt'], row['std'])} / {seeds_cell(row['seeds_for_2pt'], row['std'])} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--pairs", nargs="+", required=True, help="ARM:BASE, e.g. fixmatch_lpa3:fixmatch")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args()
    pairs = []
    for text in args.pairs:
        arm, sep, base = text.partition(":")
        if not sep or not arm or not base:
            raise SystemExit(f"--pairs: {text!r} is not ARM:BASE. Fix: e.g. fixmatch_lpa3:fixmatch.")
        pairs.append((arm, base))
    runs = load_runs(args.folder)
    if not runs:
        raise SystemExit(f"{args.folder}: no finished run JSON. Fix: point at an --out folder of ssl_table.py.")
    rows = pair_rows(runs, pairs)
    print(markdown(runs, rows))
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
