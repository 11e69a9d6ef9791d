"""benchmarks/harness.py's sweep main on a made-up table: it starts a worker process per missing run
with the flags given to it, repeats no finished run, summarises, reports a failed run and refuses
bad input naming the flag."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: a table whose worker records each call and writes ``seed * --scale``; ``--fail NAME`` makes that run exit 3
TOY = f'''
import sys
from pathlib import Path
sys.path.insert(0, {str(ROOT)!r})
from benchmarks.harness import Table, sweep_main, write_result

def arguments(parser):
    parser.add_argument("--names", nargs="+", default=["a", "b"])
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--fail", default=None)

def worker(args, name, seed):
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "calls.log", "a") as log:
        log.write(f"{{name}} {{seed}}\\n")
    if name == args.fail:
        sys.exit(3)
    write_result(args.out / f"{{name}}_{{seed}}.json", {{"name": name, "seed": seed, "value": seed * args.scale}})

def summarize(args, results):
    return "\\n".join(f"row {{r['name']}} {{r['seed']}} {{r['value']}}" for r in results)

TABLE = Table(script=__file__, description="a toy sweep", keys=(("name", str), ("seed", int)), arguments=arguments,
              runs=lambda args: [(n, s) for n in args.names for s in args.seeds],
              result_path=lambda args, name, seed: args.out / f"{{name}}_{{seed}}.json", worker=worker,
              summarize=summarize, out=Path("unused"), keep=lambda args, r: r["name"] in args.names)

if __name__ == "__main__":
    sweep_main(TABLE)
'''


def _sweep(script: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=300)


def _calls(out: Path) -> list[str]:
    return (out / "calls.log").read_text().splitlines() if (out / "calls.log").exists() else []


def test_the_sweep_runs_each_missing_run_once_in_a_worker_and_summarises(tmp_path):
    script, out = tmp_path / "toy_table.py", tmp_path / "out"
    script.write_text(TOY)
    done = _sweep(script, "--seeds", "0", "1", "--scale", "2", "--jobs", "2", "--out", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    assert sorted(_calls(out)) == ["a 0", "a 1", "b 0", "b 1"]  # one worker per run, in its own process
    assert json.loads((out / "b_1.json").read_text()) == {"name": "b", "seed": 1, "value": 2.0}  # --scale reached it
    assert done.stdout.splitlines() == ["row a 0 0.0", "row a 1 2.0", "row b 0 0.0", "row b 1 2.0"]

    again = _sweep(script, "--seeds", "0", "1", "--scale", "2", "--out", str(out))
    assert again.returncode == 0 and again.stdout == done.stdout
    assert len(_calls(out)) == 4  # every run had its JSON: none started

    only = _sweep(script, "--names", "a", "c", "--seeds", "0", "--out", str(out), "--summary-only")
    assert only.returncode == 0 and only.stdout.splitlines() == ["row a 0 0.0", "row a 1 2.0"]
    assert len(_calls(out)) == 4 and not (out / "c_0.json").exists()  # summary only: c was not run


def test_a_failed_run_is_named_and_the_sweep_exits_with_status_1(tmp_path):
    script, out = tmp_path / "toy_table.py", tmp_path / "out"
    script.write_text(TOY)
    done = _sweep(script, "--names", "a", "z", "--seeds", "0", "--fail", "z", "--out", str(out))
    assert done.returncode == 1
    assert "run z 0 failed (exit status 3" in done.stderr
    assert done.stdout.splitlines() == ["row a 0 0.0"]  # the runs that finished are still summarised


def test_bad_input_is_refused_naming_the_flag(tmp_path):
    script = tmp_path / "toy_table.py"
    script.write_text(TOY)
    jobs = _sweep(script, "--jobs", "0", "--out", str(tmp_path))
    assert jobs.returncode == 2 and "--jobs" in jobs.stderr and "1 or more" in jobs.stderr
    worker = _sweep(script, "--worker", "a", "first", "--out", str(tmp_path))
    assert worker.returncode == 2 and "seed must parse as int, got 'first'" in worker.stderr
    assert _calls(tmp_path) == []


def test_a_worker_gets_the_flags_that_differ_from_their_defaults():
    sys.path.insert(0, str(ROOT))
    from benchmarks.harness import worker_options

    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--lpa3-confidence", type=float, default=None)
    parser.add_argument("--solve-trained-only", action="store_true")
    parser.add_argument("--sources", nargs="+", default=["mnist5k"])
    parser.add_argument("--jobs", type=int, default=1)
    args = parser.parse_args(["--steps", "10", "--solve-trained-only", "--sources", "a", "b", "--jobs", "4"])
    # --steps given at its default is the worker's default too; --jobs is the sweep's alone
    assert worker_options(parser, args) == {"--solve-trained-only": True, "--sources": ["a", "b"]}
