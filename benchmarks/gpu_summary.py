"""One JSON of a GPU session: the machine, each part's exit status and seconds, and every figure.

    python benchmarks/gpu_summary.py OUT [OUT2 ...] [--summary docs/gpu/<YYYY-MM-DD>.json]
    python benchmarks/gpu_summary.py --env --call ID      # the machine record gpu_session.sh starts with

``benchmarks/gpu_session.sh`` appends to ``OUT/session.jsonl`` one record per line: ``env`` (the
machine and the versions, once per call), ``part`` (a part's name, exit status, seconds, limit,
log file and call) and ``result`` (the JSON a part's script wrote with ``--json``). A second call
that reruns some parts (``STEPS="..."``) appends to the same file, and several folders (the
calls' OUT folders, in the order they ran) may be given: the last record of a part wins, so the
summary merges the calls. Figures come from the parts' JSON; where a part has none (a script
stopped by its time limit before writing it) they are read from its log where the log has them:
``step_cost.py ratios`` prints each configuration's result as a ``config: {json}`` line as it
finishes, and the tests' counts are pytest's last line. The ``profile`` and ``host`` parts are
both ``step_cost.py profile`` (the second with the Python tracer), read alike. The summary is
written (strict JSON: NaN as null) to ``--summary`` (default ``docs/gpu/<date of the first
call>.json``; ``gpu_session.sh`` passes ``$SUMMARY``, e.g. ``$OUT/summary.json`` on a machine whose
only returned folder is ``$OUT``), and its figures printed. Needs no GPU: it reads files only
(``--env`` imports torch).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import re
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SESSION = "session.jsonl"


def environment(call: str) -> dict:
    """The machine and the versions (the ``env`` record); ``lpa3_lightning`` holds its import error, if any."""
    import os
    import platform

    record: dict[str, Any] = {"kind": "env", "call": call, "time": _now(), "python": platform.python_version(),
                              "cpus": os.cpu_count()}
    for name in ("torch", "lightning", "torchmetrics", "torchvision"):
        try:
            record[name] = __import__(name).__version__
        except Exception as error:  # noqa: BLE001 - recorded, not raised
            record[name] = f"not importable: {error}"
    try:
        import torch

        record["cuda"] = torch.version.cuda
        record["cudnn"] = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            record.update(device=props.name, memory_gib=round(props.total_memory / 2**30, 1),
                          devices=torch.cuda.device_count())
        else:
            record["device"] = f"cpu ({platform.machine()})"
    except Exception as error:  # noqa: BLE001
        record["device"] = f"unknown: {error}"
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        if smi.returncode == 0 and smi.stdout.strip():
            name, memory, driver = (s.strip() for s in smi.stdout.strip().splitlines()[0].split(","))
            record.update(nvidia_smi_name=name, nvidia_smi_memory=memory, driver=driver)
    except (OSError, subprocess.SubprocessError, ValueError):
        record["driver"] = None
    try:
        sys.path.insert(0, str(ROOT))
        import lpa3_lightning

        record["lpa3_lightning"] = getattr(lpa3_lightning, "__version__", "imports")
    except Exception as error:  # noqa: BLE001
        record["lpa3_lightning"] = f"does not import: {error!r}"
    return record


def read_records(folders: list[Path]) -> list[dict]:
    """Every record of the folders' ``session.jsonl``, folder by folder, in file order (each with
    the folder it came from)."""
    records = []
    for folder in folders:
        path = folder / SESSION
        if not path.is_file():
            raise SystemExit(f"{path} not found: pass the OUT folder of a gpu_session.sh call")
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                print(f"{path}:{number}: not JSON, skipped (a line cut by a time limit?)", file=sys.stderr)
                continue
            record["folder"] = str(folder)
            records.append(record)
    return records


def log_section(folder: str, log: str, name: str, call: str) -> str:
    """The part of ``log`` one run of part ``name`` in call ``call`` wrote (after its ``### name call:`` line)."""
    path = Path(folder) / log
    if not path.is_file():
        return ""
    text, header = path.read_text(errors="replace"), f"### {name} {call}:"
    start = text.rfind(header)
    if start < 0:
        return ""
    end = text.find("\n### ", start + len(header))
    return text[start:] if end < 0 else text[start:end]


def test_counts(text: str) -> dict:
    """pytest's counts from its last summary line, and the failed tests' ids."""
    counts: dict[str, Any] = {}
    for line in reversed(text.splitlines()):
        found = re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)", line)
        if found and (" in " in line or line.startswith("=")):
            counts = {kind if kind != "error" else "errors": int(n) for n, kind in found}
            break
    counts["failed_tests"] = re.findall(r"^(?:FAILED|ERROR) (\S+)", text, flags=re.M)
    return counts


def overhead_figures(result: dict | None, log_text: str) -> dict:
    """``step_cost.py ratios``'s figures: from its ``--json`` result, else from its ``config: {json}`` lines (the
    last line of a configuration: its last run)."""
    configs = (result or {}).get("results")
    source = "json"
    if not configs:
        source = "log lines"
        configs = {}
        for match in re.finditer(r"^(\w+): (\{.*\})$", log_text, flags=re.M):
            try:
                configs[match.group(1)] = json.loads(match.group(2))
            except json.JSONDecodeError:
                continue
    out: dict[str, Any] = {"source": source, "configs": {}}
    base = configs.get("baseline")
    if not base:
        return out
    base_epoch = statistics.median(base["epochs_s"].values())
    for config, r in configs.items():
        epoch = statistics.median(r["epochs_s"].values())
        row = {"step_s": r["step_s"], "step_x_baseline": r["step_s"] / base["step_s"], "epoch_s": epoch,
               "epoch_x_baseline": epoch / base_epoch, "peak_mb": r["peak_mb"],
               "peak_x_baseline": r["peak_mb"] / base["peak_mb"] if base["peak_mb"] else None}
        if "mean_step_s" in r and "mean_step_s" in base:
            row.update(mean_step_s=r["mean_step_s"], mean_step_x_baseline=r["mean_step_s"] / base["mean_step_s"])
        out["configs"][config] = row
    lp = configs.get("lpa3")
    if lp and "attack_s" in lp:
        floor = base["step_s"] + lp["attack_s"] + lp["x_adv_pass_s"]
        out["floor_step_s"] = floor
        out["floor_x_baseline"] = floor / base["step_s"]
        for config, row in out["configs"].items():
            if config != "baseline":
                row["step_x_floor"] = row["step_s"] / floor
    for config in [c for c in out["configs"] if c.startswith("lpa3_cached")]:
        cached = {int(k): v for k, v in configs[config]["epochs_s"].items()}
        window = sorted(cached)[:10]
        reuse = [cached[e] for e in window[1:]]
        if reuse:
            amortized = (cached[window[0]] + 9 * statistics.mean(reuse)) / 10
            row = out["configs"][config]
            row.update(amortized_epoch_s=amortized, amortized_x_baseline=amortized / base_epoch,
                       reuse_epochs=len(reuse))
            if lp and "attack_s" in lp:
                floor_epoch = base_epoch + lp["steps_per_epoch"] * (lp["x_adv_pass_s"] + lp["attack_s"] / 10)
                row["amortized_x_floor"] = amortized / floor_epoch
    return out


def fixmatch_figures(result: dict | None) -> dict:
    if not result:
        return {}
    keep = ("step_s", "step_x_fixmatch", "step_x_floor", "epoch_x_fixmatch", "peak_mb", "peak_x_fixmatch",
            "amortized_x_fixmatch", "amortized_x_floor")
    return {"complete": result.get("complete"), "setting": result.get("setting"),
            "floor_step_s": result.get("floor_step_s"),
            "configs": {c: {k: r[k] for k in keep if k in r} for c, r in result.get("configs", {}).items()}}


def profile_figures(result: dict | None) -> dict:
    """``step_cost.py profile``'s figures per step, with its five largest operators by self CPU and CUDA time."""
    if not result:
        return {}
    keep = ("steps", "with_stack", "wall_ms_per_step", "host_self_ms_per_step", "operators_per_step",
            "top_host_places", "kernel_launches_per_step", "syncs_per_step", "syncs_per_step_by_call",
            "cuda_malloc_per_step", "cuda_free_per_step", "h2d_per_step", "h2d_bytes_per_step", "d2h_per_step",
            "d2h_bytes_per_step", "gpu_busy_ms_per_step", "peak_mb")
    figures = {k: result[k] for k in keep if k in result}
    for kind in ("cpu", "cuda"):
        figures[f"top5_self_{kind}_ms_per_step"] = dict(
            list((result.get(f"self_{kind}_ms_per_step_by_operator") or {}).items())[:5])
    return figures


def table_figures(log_text: str) -> dict:
    lines = [line.strip() for line in log_text.splitlines()
             if "time-to-baseline" in line or line.startswith("| ") or "reached it" in line]
    return {"lines": lines} if lines else {}


def summarize(records: list[dict]) -> dict:
    """The summary of the records (later records of a part replace earlier ones)."""
    envs = [r for r in records if r.get("kind") == "env"]
    parts: dict[str, dict] = {}
    results: dict[str, dict] = {}
    for r in records:
        if r.get("kind") == "part":
            parts[r["name"]] = r
        elif r.get("kind") == "result":
            results[(r["name"], r.get("call"))] = r["result"]  # type: ignore[index]
    machine = dict(envs[-1]) if envs else {}
    machine.pop("kind", None)
    machine.pop("folder", None)
    machine["calls"] = [{"call": e.get("call"), "time": e.get("time"), "device": e.get("device")} for e in envs]
    summary: dict[str, Any] = {
        "date": (envs[0].get("time") or _now())[:10] if envs else _now()[:10],
        "written": _now(), "machine": machine, "parts": {}, "figures": {}}
    figures = summary["figures"]
    for name, r in parts.items():
        exit_code = r.get("exit")
        status = "ok" if exit_code == 0 else "timed out" if exit_code in (124, 137) else "failed"
        summary["parts"][name] = {
            "status": f"skipped: {r['skipped']}" if r.get("skipped") else status,
            "exit": exit_code, "seconds": r.get("seconds"), "limit": r.get("limit"), "call": r.get("call"),
            "log": r.get("log")}
        result = results.get((name, r.get("call")))
        text = log_section(r["folder"], r.get("log", ""), name, r.get("call", "")) if r.get("log") else ""
        if name == "tests":
            figures["tests"] = test_counts(text)
        elif name == "overhead":
            figures["overhead"] = overhead_figures(result, text)
        elif name == "fixmatch":
            figures["fixmatch"] = fixmatch_figures(result)
        elif name in ("profile", "host"):
            figures[name] = profile_figures(result)
        elif name == "table":
            figures["table"] = table_figures(text)
        elif result:
            figures[name] = result
    return _strict(summary)


def _strict(value: Any) -> Any:
    """NaN and infinities as None, so the JSON is strict; floats to 6 significant digits."""
    if isinstance(value, float):
        return float(f"{value:.6g}") if math.isfinite(value) else None  # 6 significant digits
    if isinstance(value, dict):
        return {str(k): _strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(v) for v in value]
    return value


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _f(value: Any, spec: str = ".2f") -> str:
    """A figure for the printout ("n/a" where the summary has none)."""
    return "n/a" if not isinstance(value, (int, float)) else format(value, spec)


def print_summary(summary: dict) -> None:
    m = summary["machine"]
    print(f"{m.get('device')}, {m.get('memory_gib')} GiB, driver {m.get('driver')}, torch {m.get('torch')}, "
          f"lightning {m.get('lightning')}, CUDA {m.get('cuda')}")
    for name, p in summary["parts"].items():
        print(f"  {name}: {p['status']} (exit {p['exit']}) in {p['seconds']} s of {p['limit']}")
    f = summary["figures"]
    if "tests" in f:
        print("tests: " + ", ".join(f"{v} {k}" for k, v in f["tests"].items() if k != "failed_tests")
              + (f"; failed: {f['tests']['failed_tests']}" if f["tests"].get("failed_tests") else ""))
    for config, row in f.get("overhead", {}).get("configs", {}).items():
        print(f"overhead {config}: step {_f(row.get('step_s'), '.3f')} s = {_f(row.get('step_x_baseline'))}x baseline"
              + (f", {_f(row['step_x_floor'])}x floor" if "step_x_floor" in row else "")
              + f", peak {_f(row.get('peak_mb'), '.0f')} MB"
              + (f", amortized K=10 {_f(row['amortized_x_baseline'])}x" if "amortized_x_baseline" in row else ""))
    for config, row in f.get("fixmatch", {}).get("configs", {}).items():
        print(f"fixmatch {config}: step {_f(row.get('step_s'), '.3f')} s = {_f(row.get('step_x_fixmatch'))}x FixMatch"
              + (f", {_f(row['step_x_floor'])}x floor" if "step_x_floor" in row else ""))
    for name in ("profile", "host"):
        row = f.get(name)
        if row:
            print(f"{name}: {_f(row.get('wall_ms_per_step'), '.0f')} ms/step (profiled), "
                  f"{_f(row.get('kernel_launches_per_step'), '.0f')} launches, {_f(row.get('syncs_per_step'))} syncs, "
                  f"peak {_f(row.get('peak_mb'), '.0f')} MB; top host places (ms/step): "
                  + "; ".join(f"{p['name']} {_f(p['ms_per_step'])}" for p in row.get("top_host_places", [])))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folders", nargs="*", type=Path, help="OUT folders of gpu_session.sh calls, oldest first")
    parser.add_argument("--summary", type=Path, default=None,
                        help="where to write the summary (default docs/gpu/<date of the first call>.json)")
    parser.add_argument("--env", action="store_true", help="print the machine record (one JSON line) and exit")
    parser.add_argument("--call", default="", help="with --env: the call's id")
    args = parser.parse_args()
    if args.env:
        print(json.dumps(environment(args.call)))
        return
    if not args.folders:
        parser.error("give at least one OUT folder")
    summary = summarize(read_records(args.folders))
    summary["sources"] = [str(f) for f in args.folders]
    path = args.summary or ROOT / "docs" / "gpu" / f"{summary['date']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=1, allow_nan=False) + "\n")
    print_summary(summary)
    print(f"summary: {path}")


if __name__ == "__main__":
    main()
