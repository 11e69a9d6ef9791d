"""benchmarks/fixmatch_step.py --designs: each design of the request's pseudo-labels runs its step and is timed."""

from __future__ import annotations

from benchmarks.fixmatch_step import design_step_times


def test_each_design_makes_its_forwards_of_the_joint_batch_and_is_timed():
    times, forwards = design_step_times("mnist5k", reps=1)
    assert set(times) == {"reference", "extra_forward", "reused_forward"} and all(t > 0 for t in times.values())
    # the package's request forwards the joint batch once more; the reused design, as the reference, once
    assert forwards == {"reference": 1, "extra_forward": 2, "reused_forward": 1}
