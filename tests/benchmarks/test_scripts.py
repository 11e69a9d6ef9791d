"""Every benchmark script imports, parses ``--help`` and names only what the package still has.

One subprocess imports each script in ``benchmarks/`` and calls its ``main()`` with ``--help``
(argparse exits before any work), and resolves every ``from lpa3_lightning... import ...``,
``from benchmarks... import ...`` and ``from tests... import ...`` in it, also those inside
functions (a removed name there would surface only when the script runs). Also: no script uses
a name the API removed (nor a core module path that only a shim keeps), ``gpu_session.sh`` parses,
and ``benchmarks/README.md`` has a row for every script there and none for a script that is gone.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
SCRIPTS = sorted(p for p in BENCHMARKS.glob("*.py") if p.name != "__init__.py")

#: what 0.2.0 removed, then the sync-free path and CUDA graphs (see CHANGELOG), and the core modules merged
#: since (their old names are shims to be deleted): any of these in a script is a use of a removed API
REMOVED = [r"\bgather_predictions\b", r"\bMemoryFeed\b", r"\bupdate_owned\b", r"\btwin_statistics\s*=",
           r"\brestore_rng\b", r"\bResumableDataLoader\b", r"\bresumable\s*=", r"\bcache_settings\b",
           r"lpa3_lightning\.(attack|tcs|features|dual_bn|callback\.memory_stage)\b",
           r"\bruntime\s*=", r"\bsync_free\b", r"\bsync-free\b", r"\bcuda_graphs\b", r"\bSolverGraphs\b",
           r"\bsolver_graphs\b", r"\bcore\.host_reads\b", r"\bcheck_values\s*=",
           r"\bcore\.(attack|arguments|seeds|model_outputs|batch_statistics|solver_forward|augmented_forward|tcs_scores"
           r"|selection|shard_exchange|batch_plan)\b"]

_CHECK = r'''
import ast, contextlib, importlib, importlib.util, io, json, sys
from pathlib import Path

root = Path(sys.argv[1])
sys.path.insert(0, str(root))
report = {}
for path in map(Path, sys.argv[2:]):
    problems = []
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and \
                node.module.split(".")[0] in ("lpa3_lightning", "benchmarks", "tests"):
            try:
                module = importlib.import_module(node.module)
            except Exception as error:
                problems.append(f"line {node.lineno}: import {node.module}: {error!r}")
                continue
            for alias in node.names:
                if alias.name != "*" and not hasattr(module, alias.name):
                    try:
                        importlib.import_module(f"{node.module}.{alias.name}")
                    except Exception:
                        problems.append(f"line {node.lineno}: {node.module} has no {alias.name}")
    spec = importlib.util.spec_from_file_location(f"benchmarks.{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as error:
        problems.append(f"import: {error!r}")
    else:
        if hasattr(module, "main"):
            sys.argv[0] = str(path)
            out = io.StringIO()
            saved, sys.argv = sys.argv, [str(path), "--help"]
            try:
                with contextlib.redirect_stdout(out):
                    module.main()
                problems.append("--help did not exit")
            except SystemExit as done:
                if done.code not in (0, None):
                    problems.append(f"--help exited with {done.code}")
                elif "usage" not in out.getvalue():
                    problems.append("--help printed no usage")
            except Exception as error:
                problems.append(f"--help: {error!r}")
            finally:
                sys.argv = saved
    report[path.name] = problems
print(json.dumps(report))
'''


def test_every_script_imports_and_parses_help():
    done = subprocess.run([sys.executable, "-c", _CHECK, str(ROOT), *map(str, SCRIPTS)], capture_output=True,
                          text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(report) == {p.name for p in SCRIPTS}
    assert {name: problems for name, problems in report.items() if problems} == {}


def test_no_script_uses_a_removed_api():
    uses = [f"{path.name}: {match.group(0)}" for path in [*SCRIPTS, BENCHMARKS / "gpu_session.sh"]
            for pattern in REMOVED for match in re.finditer(pattern, path.read_text())]
    assert uses == []


def test_the_gpu_session_parses_and_its_default_limits_fit_in_480_seconds():
    script = BENCHMARKS / "gpu_session.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    text = script.read_text()
    budget = re.search(r"^# The default STEPS: ([\d +x]+) = (\d+) s <= 480 s", text, flags=re.M)
    assert budget, "the header must sum the default parts' limits"
    terms = [math.prod(int(factor) for factor in term.split("x")) for term in budget.group(1).split("+")]
    assert sum(terms) == int(budget.group(2)) <= 480
    # the limits the header sums are the ones the script passes
    default = re.search(r'^STEPS=\$\{STEPS:-([^}]*)\}', text, flags=re.M).group(1).split()
    limits = {m.group(1): int(m.group(2)) for m in re.finditer(r"^part (\S+) (\d+) ", text, flags=re.M)}
    used = [limit for name, limit in limits.items() if name.split(":")[0] in default]
    env = int(re.search(r"timeout (\d+) \$PY benchmarks/gpu_summary.py --env", text).group(1))
    summary = int(re.search(r"^SUMMARY_LIMIT=(\d+)", text, flags=re.M).group(1))
    assert sum(used) + env + summary == int(budget.group(2))


def test_the_readme_has_a_row_for_every_script_and_only_for_those():
    rows = re.findall(r"^\| `([\w.]+\.(?:py|sh))` \|", (BENCHMARKS / "README.md").read_text(), flags=re.M)
    assert len(rows) == len(set(rows))
    shared = {"harness.py", "callbacks.py"}  # modules the scripts import, listed under "Shared code"
    assert set(rows) == {p.name for p in BENCHMARKS.iterdir() if p.suffix in (".py", ".sh")} - shared
