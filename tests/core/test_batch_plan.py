"""The plan step: reuse / solve / wait for the selected rows of one step, and the assembled x'."""

from __future__ import annotations

import pytest
import torch

from lpa3_lightning.core.batch_plan import assemble_inputs, plan_rows

T, F = True, False


@pytest.mark.parametrize(("cached", "solver_runs", "keep", "reuse", "solve"), [
    ([F, F, F], T, [T, T, T], [F, F, F], [T, T, T]),  # no cache: every row is solved
    ([T, F, F, T], T, [T, T, T, T], [T, F, F, T], [F, T, T, F]),
    ([T, F, T], T, [T, F, T], [T, F, T], [F, F, F]),  # a lone row to solve waits (solver's batch statistics)
    ([T, F, F], F, [F, F, F], [F, F, F], [F, F, F]),  # solver off and one cached x': a lone x' is not trained
    ([T, T, F], F, [T, T, F], [T, T, F], [F, F, F]),  # solver off: the cached rows only
    ([F], T, [F], [F], [F]),  # one selected row gets nothing
    ([], T, [], [], []),
])
def test_each_row_is_reused_solved_or_left_out(cached, solver_runs, keep, reuse, solve):
    plan = plan_rows(torch.tensor(cached, dtype=torch.bool), solver_runs)
    assert plan.keep.tolist() == keep and plan.reuse.tolist() == reuse and plan.solve.tolist() == solve
    assert not (plan.reuse & plan.solve).any() and torch.equal(plan.reuse | plan.solve, plan.keep)


def test_a_mask_of_another_kind_is_refused():
    with pytest.raises(ValueError, match="1-D bool mask"):
        plan_rows(torch.tensor([1, 0]))


def test_assembled_inputs_take_solved_and_cached_rows_in_place_and_copy_the_rest():
    x = torch.arange(12.0, requires_grad=True).view(4, 3)
    solve, reuse = torch.tensor([T, F, F, T]), torch.tensor([F, T, F, F])
    solved, cached = torch.full((2, 3), -1.0), torch.full((1, 3), -2.0, dtype=torch.float64)
    out = assemble_inputs(x, solve, solved, reuse, cached)
    assert out[[0, 3]].eq(-1).all() and out[1].eq(-2).all() and torch.equal(out[2], x[2].detach())
    assert out.dtype == x.dtype and not out.requires_grad
    assert x[0, 0] == 0  # the batch itself is left alone
