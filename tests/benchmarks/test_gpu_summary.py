"""benchmarks/gpu_summary.py on a made-up session folder (two calls, the second rerunning a part), and the
harness's counts of a made-up CUDA trace. (The scripts the session runs: test_step_cost.py.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SUMMARY = ROOT / "benchmarks" / "gpu_summary.py"


def _records(*records: dict) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


def _env(call: str) -> dict:
    return {"kind": "env", "call": call, "time": "2026-11-28T10:00:00Z", "device": "NVIDIA H200", "memory_gib": 139.8,
            "driver": "580.1", "torch": "2.11.0", "lightning": "2.6.6", "cuda": "13.0", "lpa3_lightning": "0.2.0"}


def _part(name: str, call: str, exit_code: int, log: str, seconds: int = 10, limit: int = 60) -> dict:
    return {"kind": "part", "name": name, "call": call, "exit": exit_code, "seconds": seconds, "limit": limit,
            "log": log}


def _overhead(step: float, peak: float, epochs: dict, **extra) -> dict:
    return {"step_s": step, "epochs_s": epochs, "reused": {}, "device": "NVIDIA H200", "peak_mb": peak, **extra}


def _session(folder: Path) -> None:
    """Call 1: every part; the overhead part stopped by its limit (no JSON: its log lines only),
    profile failed. Call 2 (in the same folder): profile again, now passing."""
    c1, c2 = "20261128T100000Z", "20261128T101000Z"
    base = _overhead(0.016, 700.0, {"1": 0.2, "2": 0.22})
    lpa3 = _overhead(0.25, 1400.0, {"1": 1.3, "2": 1.4}, attack_s=0.03, x_adv_pass_s=0.018, steps_per_epoch=5)
    cached = _overhead(0.18, 1410.0, {str(e): (1.8 if e == 1 else 1.0) for e in range(1, 12)})
    (folder / "step_cost.log").write_text(
        f"### overhead {c1}: python benchmarks/step_cost.py ratios ...\ntorch 2.11, NVIDIA H200; ...\n"
        f"baseline: {json.dumps(base)}\nlpa3: {json.dumps(lpa3)}\nlpa3_cached: {json.dumps(cached)}\n")
    (folder / "test_gpu.log").write_text(
        f"### tests {c1}: python -m pytest ...\n..F....s\nFAILED tests/test_gpu.py::test_x - AssertionError\n"
        "9 passed, 1 failed, 1 skipped in 41.20s\n")
    (folder / "profile.log").write_text(f"### profile {c1}: ...\nTraceback\n### host {c1}: ...\nper step\n"
                                        f"### profile {c2}: ...\nok\n")
    fixmatch = {"complete": True, "setting": "wrn28_2_32px", "floor_step_s": 0.146, "configs": {
        "fixmatch": {"step_s": 0.0466, "step_x_fixmatch": 1.0, "peak_mb": 2903.0},
        "fixmatch_lpa3_all": {"step_s": 0.41, "step_x_fixmatch": 8.79, "step_x_floor": 2.8, "peak_mb": 10632.0}}}
    by_operator = {f"aten::op{i}": 6.0 - i for i in range(6)}
    profile = {"steps": 2, "with_stack": False, "wall_ms_per_step": 135.0, "kernel_launches_per_step": 1498.0,
               "syncs_per_step": 68.0, "gpu_busy_ms_per_step": 41.0, "self_cpu_ms_per_step_by_operator": by_operator,
               "self_cuda_ms_per_step_by_operator": {"a": 1.0}}
    places = [{"kind": "python", "name": f"f{i}", "ms_per_step": 10.0 - i} for i in range(5)]
    host = {"steps": 20, "with_stack": True, "wall_ms_per_step": 300.0, "top_host_places": places,
            "kernel_launches_per_step": 3172.0,
            "syncs_per_step": 1.0, "syncs_per_step_by_call": {"cudaStreamSynchronize": 1.0},
            "cuda_malloc_per_step": 0.0,
            "cuda_free_per_step": 0.0, "h2d_per_step": 2.0, "h2d_bytes_per_step": 401408.0, "d2h_per_step": 1.0,
            "d2h_bytes_per_step": None, "gpu_busy_ms_per_step": 44.0, "peak_mb": 1442.0}
    (folder / "session.jsonl").write_text(_records(
        _env(c1),
        _part("tests", c1, 1, "test_gpu.log"),
        _part("overhead", c1, 124, "step_cost.log", 145, 145),
        _part("fixmatch", c1, 0, "fixmatch_step.log"),
        {"kind": "result", "name": "fixmatch", "call": c1, "result": fixmatch},
        _part("profile", c1, 1, "profile.log"),
        _part("host", c1, 0, "profile.log"),
        {"kind": "result", "name": "host", "call": c1, "result": host},
    ) + "{cut by a time lim\n" + _records(
        _env(c2),
        _part("profile", c2, 0, "profile.log"),
        {"kind": "result", "name": "profile", "call": c2, "result": profile},
    ))


def test_the_summary_merges_the_calls_and_reads_every_figure(tmp_path):
    _session(tmp_path)
    out = tmp_path / "summary.json"
    done = subprocess.run([sys.executable, str(SUMMARY), str(tmp_path), "--summary", str(out)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    summary = json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(f"not strict JSON: {c}"))
    assert summary["date"] == "2026-11-28"
    machine = summary["machine"]
    assert (machine["device"], machine["driver"], machine["torch"], machine["cuda"]) == (
        "NVIDIA H200", "580.1", "2.11.0", "13.0")
    assert [c["call"] for c in machine["calls"]] == ["20261128T100000Z", "20261128T101000Z"]
    parts = summary["parts"]
    assert parts["tests"]["status"] == "failed" and parts["overhead"]["status"] == "timed out"
    assert parts["profile"] == {"status": "ok", "exit": 0, "seconds": 10, "limit": 60,
                                "call": "20261128T101000Z", "log": "profile.log"}  # the rerun replaced it
    figures = summary["figures"]
    assert figures["tests"] == {"passed": 9, "failed": 1, "skipped": 1, "failed_tests": ["tests/test_gpu.py::test_x"]}
    overhead = figures["overhead"]
    assert overhead["source"] == "log lines"
    assert overhead["configs"]["lpa3"]["step_x_baseline"] == pytest.approx(0.25 / 0.016, rel=1e-5)
    assert overhead["configs"]["lpa3"]["peak_x_baseline"] == pytest.approx(2.0)
    assert overhead["floor_step_s"] == pytest.approx(0.016 + 0.03 + 0.018)
    assert overhead["configs"]["lpa3_cached"]["amortized_epoch_s"] == pytest.approx((1.8 + 9 * 1.0) / 10)
    assert figures["fixmatch"]["configs"]["fixmatch_lpa3_all"]["step_x_fixmatch"] == 8.79
    profile = figures["profile"]  # the second call's
    assert (profile["wall_ms_per_step"], profile["kernel_launches_per_step"]) == (135, 1498)
    assert profile["top5_self_cpu_ms_per_step"] == {f"aten::op{i}": 6 - i for i in range(5)}
    assert profile["top5_self_cuda_ms_per_step"] == {"a": 1}
    host = figures["host"]
    assert [p["ms_per_step"] for p in host["top_host_places"]] == [10, 9, 8, 7, 6]
    assert (host["kernel_launches_per_step"], host["syncs_per_step"], host["peak_mb"]) == (3172, 1, 1442)
    assert host["d2h_bytes_per_step"] is None and host["top5_self_cuda_ms_per_step"] == {}
    assert "overhead lpa3: step 0.250 s" in done.stdout
    assert "profile: 135 ms/step (profiled), 1498 launches" in done.stdout and "host: 300 ms/step" in done.stdout


def test_the_summary_prefers_a_parts_json_and_merges_folders(tmp_path):
    first, second = tmp_path / "call1", tmp_path / "call2"
    first.mkdir()
    second.mkdir()
    _session(first)
    c3 = "20261129T090000Z"
    base = _overhead(0.02, 700.0, {"1": 0.2, "2": 0.2})
    lpa3 = _overhead(0.2, 1400.0, {"1": 1.0, "2": 1.0})
    (second / "step_cost.log").write_text(f"### overhead {c3}: ...\n")
    (second / "session.jsonl").write_text(_records(
        _env(c3), _part("overhead", c3, 0, "step_cost.log"),
        {"kind": "result", "name": "overhead", "call": c3,
         "result": {"torch": "2.11", "where": "H200", "ratio": 0.3, "results": {"baseline": base, "lpa3": lpa3}}}))
    done = subprocess.run([sys.executable, str(SUMMARY), str(first), str(second), "--summary",
                           str(tmp_path / "s.json")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["date"] == "2026-11-28"  # the first call's
    assert summary["parts"]["overhead"]["status"] == "ok"
    assert summary["figures"]["overhead"]["source"] == "json"
    assert summary["figures"]["overhead"]["configs"]["lpa3"]["step_x_baseline"] == pytest.approx(10.0)
    assert summary["figures"]["tests"]["passed"] == 9  # kept from the first folder


def test_cuda_activity_counts_a_made_up_trace():
    """The harness's counts of launches, synchronisations, allocations and copies (with bytes from
    the structured metadata of newer torch versions or the JSON fragment of older ones)."""
    from types import SimpleNamespace

    sys.path.insert(0, str(ROOT))
    from benchmarks.harness import cuda_activity

    def event(name, device="CPU", us=1.0, **extra):
        return SimpleNamespace(name=name, device_type=SimpleNamespace(name=device),
                               time_range=SimpleNamespace(elapsed_us=lambda: us), **extra)

    trace = [event("cudaLaunchKernel")] * 5 + [event("cudaGraphLaunch"), event("cudaStreamSynchronize"),
                                               event("cudaDeviceSynchronize"), event("cudaMalloc"), event("cudaFree"),
                                               event("aten::add"), event("cudaMemcpyAsync")]
    trace += [event("void kernel<float>()", "CUDA", 10.0),
              event("Memcpy HtoD (Pageable -> Device)", "CUDA", 2.0, event_metadata=SimpleNamespace(bytes=512)),
              event("Memcpy DtoH (Device -> Pageable)", "CUDA", 3.0, event_metadata=None, metadata=None,
                    _metadata_json='"device": 0, "bytes": 4, "memory bandwidth (GB/s)": 0.01')]
    counts = cuda_activity(trace)
    assert (counts["kernel_launches"], counts["graph_launches"]) == (5, 1)
    assert (counts["cuda_malloc"], counts["cuda_free"]) == (1, 1)
    assert counts["synchronisations"] == 2
    assert counts["synchronisations_by_call"] == {"cudaStreamSynchronize": 1, "cudaDeviceSynchronize": 1}
    assert counts["copies"] == {"h2d": {"count": 1, "bytes": 512}, "d2h": {"count": 1, "bytes": 4},
                                "d2d": {"count": 0, "bytes": 0}}
    assert counts["gpu_busy_us"] == 15.0
    unsized = cuda_activity([event("Memcpy HtoD (Pageable -> Device)", "CUDA")])
    assert unsized["copies"]["h2d"] == {"count": 1, "bytes": None}  # this torch did not say
