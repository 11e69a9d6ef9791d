"""benchmarks/fixmatch_step.py --designs: each design of the request's pseudo-labels runs its step and is timed."""

from __future__ import annotations

from benchmarks.fixmatch_step import design_step_times


def test_each_design_makes_its_forwards_of_the_joint_batch_and_is_timed():
    times, forwards, memory = design_step_times("mnist5k", reps=1)
    assert set(times) == {"reference", "extra_forward", "shared_forward"} and all(t > 0 for t in times.values())
    # the package's design (shared), as the reference, forwards the joint batch once; 0.3.0's twice
    assert forwards == {"reference": 1, "shared_forward": 1, "extra_forward": 2}
    # the joint batch (32 + 2 x 224 rows) saves more for backward than one solver pass on 202 rows
    assert memory["joint_graph_bytes"] > memory["solver_pass_bytes"] > 0
