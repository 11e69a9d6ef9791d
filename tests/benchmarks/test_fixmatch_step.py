"""benchmarks/fixmatch_step.py --designs: each design of the request's pseudo-labels runs the step and is timed."""

from __future__ import annotations

from benchmarks.fixmatch_step import design_step_times


def test_every_design_of_the_request_runs_its_step_and_is_timed():
    times = design_step_times("mnist5k", reps=1)
    assert set(times) == {"reference", "extra_forward", "reused_forward"}
    assert all(t > 0 for t in times.values())
