"""SolverGraphs on the CPU: the padding, the buffers and the keys a captured solve relies on.

The capture itself needs CUDA (tests/test_gpu.py). Here the same padded buffers are solved
eagerly, so what is checked is everything but the replay: padding changes no real row's x',
buffers are reused per bucket and dropped when the model's memory moves, the solve reads no
device value on the host and runs the same operators whatever the data, and the attack's
invariants hold.
"""

from __future__ import annotations

import pytest
import torch

from lpa3_lightning.core.attack import lpa3_attack
from lpa3_lightning.core.dual_bn import convert_dual_bn
from lpa3_lightning.core.feature_layers import resolve_layers
from lpa3_lightning.core.host_reads import HostReadCounter
from lpa3_lightning.core.solver_forward import label_log_prob
from lpa3_lightning.core.solver_graphs import SolverGraphs
from tests.helpers import confident_batch, confident_cnn, dispatched_ops, independent_logp_drop, snapshot


def _solve(net, x, y, graphs=None, **kwargs):
    return lpa3_attack(net, x, y, sync_free=True, graphs=graphs, return_stats=True,
                       generator=torch.Generator().manual_seed(0), **kwargs)


@pytest.mark.parametrize("twin", [False, True])
@pytest.mark.parametrize("n", [5, 8, 11])
def test_padded_solve_gives_the_unpadded_x_adv(twin, n):
    net = confident_cnn().double()
    if twin:
        convert_dual_bn(net)
    x, y = confident_batch(n)
    x = x.double()  # float64: batches of 8 and of n agree far below any bisection decision
    kwargs = dict(bn_mode="twin" if twin else "eval", max_step=None)
    x_ref, ref = _solve(net, x, y, **kwargs)
    graphs = SolverGraphs(bucket=8, capture=False)
    x_adv, stats = _solve(net, x, y, graphs, **kwargs)
    torch.testing.assert_close(x_adv, x_ref, rtol=0, atol=1e-10)
    torch.testing.assert_close(stats.logp_drop, ref.logp_drop, rtol=0, atol=1e-10)
    assert torch.equal(stats.projected, ref.projected) and torch.equal(stats.preserved, ref.preserved)
    assert x_adv.shape == x.shape
    if n == 5:
        assert int(ref.projected.sum()) > 0  # the bisection ran on real rows beside padding rows


def test_padding_rows_repeat_the_first_row_and_reach_the_bucket():
    net = confident_cnn()
    x, y = confident_batch(5)
    graphs = SolverGraphs(bucket=8, capture=False)
    layers = resolve_layers(net, None, example_input=x)  # given: no probe forward of 2 rows
    seen = []

    def spy(module, inputs, output):  # the batch every solver forward runs on
        seen.append(inputs[0].detach().clone())

    handle = net[0].register_forward_hook(spy)
    try:
        _solve(net, x, y, graphs, layers=layers)
    finally:
        handle.remove()
    assert {t.shape[0] for t in seen} == {8}
    first = seen[0]  # the clean forward
    torch.testing.assert_close(first[:5], x, rtol=0, atol=0)
    torch.testing.assert_close(first[5:], x[:1].expand(3, -1, -1, -1), rtol=0, atol=0)


def test_the_graph_keeps_the_constraint_when_remeasured_in_float32():
    net = confident_cnn()
    x, y = confident_batch(13)
    x_adv, stats = _solve(net, x, y, SolverGraphs(capture=False), max_step=None)
    assert int(stats.projected.sum()) > 0
    assert bool((independent_logp_drop(net, x, x_adv, y) <= 0.02 + 1e-5).all())


def test_twin_statistics_are_taken_from_the_real_rows_only():
    """Padding rows must not enter the frozen twin statistics: the same x' whether the caller
    gives the real rows' statistics or lets the graph path take them."""
    net = convert_dual_bn(confident_cnn().double())
    x, y = confident_batch(6)
    x = x.double()
    _, statistics = label_log_prob(net, x, y, bn_mode="twin")
    given, _ = _solve(net, x, y, SolverGraphs(capture=False), bn_mode="twin", bn_statistics=statistics)
    taken, _ = _solve(net, x, y, SolverGraphs(capture=False), bn_mode="twin")
    torch.testing.assert_close(taken, given, rtol=0, atol=1e-12)
    padded_statistics = label_log_prob(net, torch.cat([x, x[:1].expand(2, -1, -1, -1)]),
                                       torch.cat([y, y[:1].expand(2)]), bn_mode="twin")[1]
    wrong, _ = _solve(net, x, y, SolverGraphs(capture=False), bn_mode="twin", bn_statistics=padded_statistics)
    assert (wrong - given).abs().max() > 1e-6  # the statistics do matter: the check could fail


def test_no_host_read_and_the_same_operators_whatever_the_data():
    net = confident_cnn()
    graphs = SolverGraphs(capture=False)
    sequences, outcomes = [], []
    for n, max_step in ((6, 1e3), (7, 1e-4)):  # one bucket; with and without rows to pull back
        x, y = confident_batch(n, seed=n)
        _solve(net, x, y, graphs, max_step=max_step)  # resolves the feature layers (a probe forward)

        def solve():
            with HostReadCounter() as reads:
                _, stats = _solve(net, x, y, graphs, max_step=max_step)
            assert reads.total == 0, dict(reads.sites)
            outcomes.append(int(stats.projected.sum()))

        sequences.append(dispatched_ops(solve))
    assert outcomes[0] > 0 and outcomes[1] == 0
    assert sequences[0] == sequences[1]


def test_buffers_are_shared_within_a_bucket_and_dropped_when_the_model_moves():
    net = confident_cnn()
    graphs = SolverGraphs(bucket=8, capture=False)
    for n in (5, 7, 8):
        _solve(net, *confident_batch(n), graphs)
    assert len(graphs._entries) == 1
    _solve(net, *confident_batch(9), graphs)
    assert len(graphs._entries) == 2
    _solve(net, *confident_batch(5), graphs, sigma=0.01)  # a setting baked into the loop: its own entry
    assert len(graphs._entries) == 3
    first = next(net.parameters())
    first.data = first.data.clone()  # same values, other memory: a captured graph would read the old one
    _solve(net, *confident_batch(5), graphs)
    assert len(graphs._entries) == 1
    assert graphs.padded_size(1) == 8 and graphs.padded_size(16) == 16 and graphs.padded_size(17) == 24


@pytest.mark.parametrize("twin", [False, True])
def test_invariants_parameters_grads_bn_statistics_and_modes(twin):
    net = confident_cnn()
    if twin:
        convert_dual_bn(net)
    net.train()
    net[1].eval()  # a mixed mode must come back as it was
    for p in net.parameters():
        p.grad = torch.full_like(p, 0.5)
    before = snapshot(net)
    grads = [p.grad.clone() for p in net.parameters()]
    modes = [m.training for m in net.modules()]
    _solve(net, *confident_batch(6), SolverGraphs(capture=False), bn_mode="twin" if twin else "eval")
    after = snapshot(net)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, net.parameters()))
    assert [m.training for m in net.modules()] == modes


def test_refusals_name_the_argument_and_the_fix():
    with pytest.raises(ValueError, match="`bucket`.*Fix"):
        SolverGraphs(bucket=0)
    with pytest.raises(ValueError, match="`warmup`.*Fix"):
        SolverGraphs(warmup=True)
    with pytest.raises(ValueError, match="`capture`.*Fix"):
        SolverGraphs(capture="yes")
    net = confident_cnn()
    x, y = confident_batch(4)
    with pytest.raises(ValueError, match="`capture=True` needs CUDA.*Fix"):
        _solve(net, x, y, SolverGraphs(capture=True))
    with pytest.raises(ValueError, match="`graphs`.*sync_free=True.*Fix"):
        lpa3_attack(net, x, y, graphs=SolverGraphs())
    with pytest.raises(ValueError, match="`graphs`.*Fix"):
        lpa3_attack(net, x, y, sync_free=True, graphs=object())
