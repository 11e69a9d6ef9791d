"""Tests for lpa3_lightning.core.tcs: time-consistency memory against the authors' formulas."""

from __future__ import annotations

import io
import math

import pytest
import torch
import torch.nn.functional as F

from lpa3_lightning.core.tcs import TimeConsistency, check_ratio, selection_threshold, tcs_divergence, tcs_update

# --------------------------------------------------------------------------- references


def _ref_code_divergence(prev: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The authors' code: a = F.kl_div(log(prev), p, reduction='none').mean(1)."""
    return F.kl_div(torch.log(prev), p, reduction="none").mean(1)


def _ref_paper_divergence(prev: torch.Tensor, cur: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The paper: KL(prev || cur) + |log prev[y] - log cur[y]|, by hand with loops."""
    out = []
    for i in range(prev.shape[0]):
        kl = sum(float(prev[i, k]) * (math.log(float(prev[i, k])) - math.log(float(cur[i, k])))
                 for k in range(prev.shape[1]))
        yi = int(y[i])
        out.append(kl + abs(math.log(float(prev[i, yi])) - math.log(float(cur[i, yi]))))
    return torch.tensor(out, dtype=prev.dtype)


class _RefTCS:
    """Plain transcription of the authors' per-sample loop."""

    def __init__(self, n: int, c: int, init: float) -> None:
        self.mem = torch.full((n, c), init)
        self.c = torch.zeros(n)
        self.seen = torch.zeros(n, dtype=torch.bool)

    def update(self, idx: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        a = _ref_code_divergence(self.mem[idx], p)
        for j, i in enumerate(idx.tolist()):
            self.c[i] = 0.01 * self.c[i] - 0.99 * a[j]
            self.mem[i] = p[j]
            self.seen[i] = True
        return a

    def threshold(self, ratio: float) -> float:
        vals = sorted(self.c[self.seen].tolist(), reverse=True)
        return vals[int(math.floor((1 - ratio) * len(vals)))]


def _probs(b: int, c: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(b, c, generator=g) * 2.0, dim=1)


# --------------------------------------------------------------------------- initial state


def test_uniform_initial_memory_is_a_distribution() -> None:
    tcs = TimeConsistency(num_samples=5, num_classes=4, ratio=0.5)
    assert tcs.memory.shape == (5, 4)
    torch.testing.assert_close(tcs.memory.sum(1), torch.ones(5))
    torch.testing.assert_close(tcs.memory, torch.full((5, 4), 0.25))
    assert torch.equal(tcs.scores, torch.zeros(5))
    assert not tcs.seen.any()
    assert not tcs.has_threshold
    assert tcs.device == torch.device("cpu")


def test_authors_initial_memory_is_1_01() -> None:
    tcs = TimeConsistency(num_samples=3, num_classes=4, ratio=0.5, initial_memory="authors")
    assert torch.equal(tcs.memory, torch.full((3, 4), 1.01))


# --------------------------------------------------------------------------- update


@pytest.mark.parametrize(("initial_memory", "init"), [("uniform", 1 / 3), ("authors", 1.01)])
def test_update_matches_reference_over_steps_with_repeated_indices(initial_memory: str, init: float) -> None:
    n, c = 8, 3
    tcs = TimeConsistency(num_samples=n, num_classes=c, ratio=0.5, initial_memory=initial_memory)
    ref = _RefTCS(n, c, init)
    steps = [
        torch.tensor([0, 1, 2, 3]),
        torch.tensor([2, 3, 4, 5]),  # 2, 3 revisited
        torch.tensor([7, 0, 2]),  # 0, 2 revisited (2 for the third time)
        torch.tensor([6, 5, 1, 3, 0]),
    ]
    for s, idx in enumerate(steps):
        p = _probs(len(idx), c, seed=s)
        div = tcs.update(idx, p)
        ref_div = ref.update(idx, p)
        torch.testing.assert_close(div, ref_div)
        torch.testing.assert_close(tcs.scores, ref.c)
        torch.testing.assert_close(tcs.memory, ref.mem)
        assert torch.equal(tcs.seen, ref.seen)


def test_authors_memory_first_divergence_can_be_negative() -> None:
    # documents why 1.01 is not a distribution: a confident first prediction gets a < 0
    tcs = TimeConsistency(num_samples=1, num_classes=2, ratio=0.5, initial_memory="authors")
    div = tcs.update(torch.tensor([0]), torch.tensor([[0.999, 0.001]]))
    assert float(div[0]) < 0
    tcs_u = TimeConsistency(num_samples=1, num_classes=2, ratio=0.5)
    assert float(tcs_u.update(torch.tensor([0]), torch.tensor([[0.999, 0.001]]))[0]) > 0


def test_update_detaches_and_converts_probs() -> None:
    tcs = TimeConsistency(num_samples=3, num_classes=2, ratio=0.5)
    logits = torch.randn(2, 2, dtype=torch.float64, requires_grad=True)
    tcs.update(torch.tensor([0, 2], dtype=torch.int32), torch.softmax(logits, 1))
    assert tcs.memory.dtype == torch.float32 and not tcs.memory.requires_grad
    assert not tcs.scores.requires_grad
    assert tcs.seen.tolist() == [True, False, True]


def test_tcs_update_formula() -> None:
    c = torch.tensor([-1.0, 0.0, 2.0])
    a = torch.tensor([0.5, 0.1, 0.0])
    torch.testing.assert_close(tcs_update(c, a), 0.01 * c - 0.99 * a)
    torch.testing.assert_close(tcs_update(c, a, gamma=0.5), 0.5 * c - 0.5 * a)
    torch.testing.assert_close(tcs_update(c, a, gamma=1.0), -a)


def test_code_divergence_is_kl_cur_prev_over_classes() -> None:
    prev = _probs(4, 5, seed=10)
    cur = _probs(4, 5, seed=11)
    expected = (cur * (cur.log() - prev.log())).sum(1) / 5
    torch.testing.assert_close(tcs_divergence(prev, cur), expected)
    torch.testing.assert_close(tcs_divergence(prev, cur, divergence="code"), _ref_code_divergence(prev, cur))


def test_paper_divergence_matches_hand_reference_with_targets() -> None:
    prev = _probs(5, 4, seed=1).double()
    cur = _probs(5, 4, seed=2).double()
    y = torch.tensor([0, 3, 1, 2, 3])
    out = tcs_divergence(prev, cur, targets=y, divergence="paper")
    torch.testing.assert_close(out, _ref_paper_divergence(prev, cur, y))


def test_paper_divergence_defaults_to_previous_argmax() -> None:
    prev = _probs(5, 4, seed=3).double()
    cur = _probs(5, 4, seed=4).double()
    out = tcs_divergence(prev, cur, divergence="paper")
    torch.testing.assert_close(out, _ref_paper_divergence(prev, cur, prev.argmax(1)))
    # a different label changes the |log ratio| term
    other = (prev.argmax(1) + 1) % 4
    assert not torch.allclose(out, tcs_divergence(prev, cur, targets=other, divergence="paper"))


def test_paper_divergence_in_memory_with_targets() -> None:
    n, c = 4, 3
    tcs = TimeConsistency(num_samples=n, num_classes=c, ratio=0.5, divergence="paper")
    mem = torch.full((n, c), 1 / c)
    scores = torch.zeros(n)
    for s, (idx, y) in enumerate([([0, 1, 2], [0, 1, 2]), ([1, 3, 2], [2, 2, 0])]):
        idx_t, y_t = torch.tensor(idx), torch.tensor(y)
        p = _probs(len(idx), c, seed=20 + s)
        div = tcs.update(idx_t, p, targets=y_t)
        ref = _ref_paper_divergence(mem[idx_t].double(), p.double(), y_t).float()
        torch.testing.assert_close(div, ref)
        scores[idx_t] = 0.01 * scores[idx_t] - 0.99 * ref
        mem[idx_t] = p
        torch.testing.assert_close(tcs.scores, scores)


def test_divergence_errors() -> None:
    with pytest.raises(ValueError, match=r"must both be \(N, C\)"):
        tcs_divergence(torch.rand(2, 3), torch.rand(2, 4))
    with pytest.raises(ValueError, match=r"must both be \(N, C\)"):
        tcs_divergence(torch.rand(3), torch.rand(3))
    with pytest.raises(ValueError, match="'code', 'paper'.*'js'"):
        tcs_divergence(torch.rand(2, 3), torch.rand(2, 3), divergence="js")  # type: ignore[arg-type]


# --------------------------------------------------------------------------- selection


def test_select_before_threshold_is_all_true_with_the_authors_initial_selection() -> None:
    tcs = TimeConsistency(num_samples=6, num_classes=3, ratio=0.3, initial_selection="all")
    assert tcs.select(torch.arange(6)).tolist() == [True] * 6
    tcs.update(torch.arange(6), _probs(6, 3, seed=0))
    assert tcs.select(torch.tensor([5, 0, 3])).tolist() == [True] * 3  # updated but not refreshed
    tcs.refresh_threshold()
    assert not tcs.select(torch.arange(6)).all()


def test_refresh_without_seen_samples_keeps_the_initial_selection() -> None:
    tcs = TimeConsistency(num_samples=4, num_classes=2, ratio=0.5, initial_selection="all")
    tcs.refresh_threshold()
    assert not tcs.has_threshold
    assert tcs.select(torch.arange(4)).all()
    random = TimeConsistency(num_samples=40, num_classes=2, ratio=0.25)
    random.refresh_threshold()
    assert int(random.select(torch.arange(40)).sum()) == 10  # a random quarter, not everything


def test_random_initial_selection_until_the_first_threshold() -> None:
    tcs = TimeConsistency(num_samples=40, num_classes=3, ratio=0.25, seed=3)
    first = tcs.select(torch.arange(40), epoch=0)
    assert int(first.sum()) == 10
    assert torch.equal(first[torch.tensor([7, 2, 30])], tcs.select(torch.tensor([7, 2, 30]), epoch=0))
    tcs.update(torch.arange(40), _probs(40, 3, seed=0))
    tcs.refresh_threshold()
    after = tcs.select(torch.arange(40), epoch=1)
    assert int(after.sum()) == 10
    assert torch.equal(after, tcs.scores < tcs.threshold)  # from now on by TCS


@pytest.mark.parametrize("ratio", [0.2, 0.5, 0.9])
def test_selection_after_refresh_matches_reference(ratio: float) -> None:
    n, c = 20, 4
    tcs = TimeConsistency(num_samples=n, num_classes=c, ratio=ratio, threshold_rule="authors")
    ref = _RefTCS(n, c, 1 / c)
    for epoch in range(3):
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(epoch))
        for s, idx in enumerate(perm.split(6)):
            p = _probs(len(idx), c, seed=100 * epoch + s)
            tcs.update(idx, p)
            ref.update(idx, p)
        tcs.refresh_threshold()
        thr = ref.threshold(ratio)
        assert tcs.has_threshold
        torch.testing.assert_close(tcs.threshold, torch.tensor(thr))
        idx = torch.arange(n)
        expected = ref.c < thr
        assert torch.equal(tcs.select(idx), expected)
        # and in a shuffled subset order
        sub = torch.tensor([19, 3, 7, 0])
        assert torch.equal(tcs.select(sub), expected[sub])
        # the least consistent ~ratio fraction is selected
        assert int(expected.sum()) == n - int(math.floor((1 - ratio) * n)) - 1


def test_threshold_only_over_seen_samples() -> None:
    n, c = 10, 3
    tcs = TimeConsistency(num_samples=n, num_classes=c, ratio=0.5, threshold_rule="authors")
    ref = _RefTCS(n, c, 1 / c)
    idx = torch.tensor([1, 4, 6, 8])
    p = _probs(4, c, seed=5)
    tcs.update(idx, p)
    ref.update(idx, p)
    tcs.refresh_threshold()
    seen_thr = ref.threshold(0.5)
    all_scores = sorted(ref.c.tolist(), reverse=True)
    all_thr = all_scores[int(math.floor(0.5 * n))]
    assert seen_thr != pytest.approx(all_thr)  # the fixture distinguishes the two
    torch.testing.assert_close(tcs.threshold, torch.tensor(seen_thr))
    assert torch.equal(tcs.select(idx), ref.c[idx] < seen_thr)


# --------------------------------------------------------------------------- checkpoint


def test_state_dict_round_trip_reproduces_state_and_selection() -> None:
    n, c = 12, 3
    tcs = TimeConsistency(num_samples=n, num_classes=c, ratio=0.4)
    for s in range(3):
        idx = torch.randperm(n, generator=torch.Generator().manual_seed(s))[:8]
        tcs.update(idx, _probs(8, c, seed=s))
    tcs.refresh_threshold()
    buf = io.BytesIO()
    torch.save(tcs.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf)

    fresh = TimeConsistency(num_samples=n, num_classes=c, ratio=0.4)
    fresh.load_state_dict(state)
    assert torch.equal(fresh.memory, tcs.memory)
    assert torch.equal(fresh.scores, tcs.scores)
    assert torch.equal(fresh.seen, tcs.seen)
    assert torch.equal(fresh.threshold, tcs.threshold)
    assert fresh.has_threshold
    idx = torch.arange(n)
    assert torch.equal(fresh.select(idx), tcs.select(idx))
    # continuing from the restored state gives the same results
    more_idx, more_p = torch.tensor([0, 5, 11]), _probs(3, c, seed=99)
    torch.testing.assert_close(fresh.update(more_idx, more_p), tcs.update(more_idx, more_p))
    assert torch.equal(fresh.scores, tcs.scores)


def test_state_dict_is_a_snapshot() -> None:
    tcs = TimeConsistency(num_samples=3, num_classes=2, ratio=0.5)
    state = tcs.state_dict()
    tcs.update(torch.tensor([0]), torch.tensor([[0.9, 0.1]]))
    assert torch.equal(state["memory"], torch.full((3, 2), 0.5))
    assert torch.equal(state["scores"], torch.zeros(3))
    assert not state["seen"].any()


def test_load_state_for_other_num_samples_raises() -> None:
    state = TimeConsistency(num_samples=5, num_classes=3, ratio=0.5).state_dict()
    other = TimeConsistency(num_samples=6, num_classes=3, ratio=0.5)
    with pytest.raises(ValueError, match=r"for 5 samples.*data set"):
        other.load_state_dict(state)
    other_c = TimeConsistency(num_samples=5, num_classes=4, ratio=0.5)
    with pytest.raises(ValueError, match=r"3 classes.*data set"):
        other_c.load_state_dict(state)


# --------------------------------------------------------------------------- input validation


@pytest.mark.parametrize(
    ("indices", "match"),
    [
        (torch.tensor([0, 4]), r"out of range.*\[0, 4\].*4 samples"),
        (torch.tensor([-1, 2]), r"out of range.*\[-1, 2\]"),
        (torch.tensor([0.0, 1.0]), "1-D integer tensor"),
        (torch.tensor([[0, 1]]), "1-D integer tensor"),
        ([0, 1], "1-D integer tensor"),
    ],
)
def test_bad_indices_raise(indices, match: str) -> None:
    tcs = TimeConsistency(num_samples=4, num_classes=2, ratio=0.5)
    with pytest.raises(ValueError, match=match):
        tcs.update(indices, torch.full((2, 2), 0.5))
    with pytest.raises(ValueError, match=match):
        tcs.select(indices)
    assert not tcs.seen.any()


@pytest.mark.parametrize("shape", [(2, 3), (3, 2), (2,), (2, 2, 1)])
def test_wrong_probs_shape_raises(shape: tuple[int, ...]) -> None:
    tcs = TimeConsistency(num_samples=4, num_classes=2, ratio=0.5)
    with pytest.raises(ValueError, match=r"`probs` must have shape \(2, 2\)"):
        tcs.update(torch.tensor([0, 1]), torch.rand(*shape))
    assert not tcs.seen.any()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"ratio": 0}, "`ratio`"),
        ({"ratio": 1.5}, "`ratio`"),
        ({"ratio": -0.2}, "`ratio`"),
        ({"num_classes": 1}, "`num_classes` must be an int >= 2"),
        ({"num_samples": 0}, "`num_samples` must be a positive int"),
        ({"num_samples": 4.0}, "`num_samples` must be a positive int"),
        ({"gamma": 0}, r"`gamma` must be in \(0, 1\]"),
        ({"gamma": 1.2}, r"`gamma` must be in \(0, 1\]"),
        ({"divergence": "js"}, "`divergence` must be one of 'code', 'paper'"),
        ({"initial_memory": "zeros"}, "`initial_memory` must be one of 'uniform', 'authors'"),
    ],
)
def test_bad_constructor_args_raise(kwargs: dict, match: str) -> None:
    args = {"num_samples": 4, "num_classes": 3, "ratio": 0.5} | kwargs
    with pytest.raises(ValueError, match=match):
        TimeConsistency(**args)


def test_bool_indices_rejected() -> None:
    tcs = TimeConsistency(num_samples=4, num_classes=2, ratio=0.5)
    with pytest.raises(ValueError, match="1-D integer tensor"):
        tcs.update(torch.tensor([True, False, True, True]), torch.full((4, 2), 0.5))


def test_an_update_applies_the_first_finite_row_of_each_index_once_an_epoch() -> None:
    """The one keep rule of every update: a repeated index (DistributedSampler's padding) counts
    once, at its first row; a non-finite prediction never; with ``epoch``, a sample once an epoch.
    Checked against updates of the kept rows alone."""
    g = torch.Generator().manual_seed(0)
    a, b = TimeConsistency(10, 3, 0.5), TimeConsistency(10, 3, 0.5)
    probs = torch.softmax(torch.randn(6, 3, generator=g), 1)
    probs[4] = float("nan")
    indices = torch.tensor([3, 1, 3, 7, 5, 1])  # 3 and 1 repeat; 5's row is NaN
    divergence = a.update(indices, probs, epoch=0)
    b.update(indices[[0, 1, 3]], probs[[0, 1, 3]])
    assert torch.equal(a.memory, b.memory) and torch.equal(a.scores, b.scores) and torch.equal(a.seen, b.seen)
    assert divergence[[2, 4, 5]].eq(0).all() and int(a.nonfinite_rows) == 1
    assert a.last_update_epoch[[3, 1, 7]].eq(0).all() and a.last_update_epoch[5] == -1
    later = torch.softmax(torch.randn(2, 3, generator=g), 1)
    a.update(torch.tensor([7, 2]), later, epoch=0)  # 7 again in epoch 0: left out
    b.update(torch.tensor([2]), later[1:])
    assert torch.equal(a.memory, b.memory) and torch.equal(a.scores, b.scores)


def test_select_compares_with_the_threshold_and_has_threshold_follows_it() -> None:
    tcs = TimeConsistency(12, 3, 0.5)
    tcs.update(torch.arange(12), torch.softmax(torch.randn(12, 3), 1))
    tcs.update(torch.arange(12), torch.softmax(torch.randn(12, 3), 1))
    before = tcs.select(torch.arange(12), epoch=0)
    assert int(before.sum()) == 6  # the random share
    tcs.refresh_threshold()
    assert tcs.has_threshold
    assert torch.equal(tcs.select(torch.arange(12), epoch=1), tcs.scores < tcs.threshold)
    tcs.threshold = torch.tensor(float("nan"))  # assigning the threshold updates the host flag
    assert not tcs.has_threshold


def test_a_sample_without_a_score_yet_is_selected_as_before_the_first_threshold() -> None:
    """After a pass over part of the data (``limit_train_batches``), the samples never scored are
    selected by the rule of the first pass (a seeded ``ratio`` share), not left out for good."""
    tcs = TimeConsistency(num_samples=400, num_classes=2, ratio=0.5, seed=0)
    seen = torch.arange(40)
    # two passes whose predictions agree for the first half and flip for the second: the seen
    # samples get two distinct scores, so the threshold splits them
    first = torch.tensor([[0.9, 0.1]]).repeat(40, 1)
    second = torch.cat([first[:20], first[20:].flip(1)])
    tcs.update(seen, first)
    tcs.update(seen, second)
    tcs.refresh_threshold()
    assert tcs.has_threshold
    unseen = torch.arange(40, 400)
    share = float(tcs.select(unseen, epoch=3).float().mean())
    assert 0.4 <= share <= 0.6
    # the scored samples follow the threshold: the flipped (least consistent) half only
    chosen = tcs.select(seen)
    assert chosen[20:].all() and not chosen[:20].any(), chosen


def test_random_criterion_ignores_the_scores_and_draws_a_fresh_share_each_epoch() -> None:
    """The paper's selection ablation: the same count as TCS, drawn at random every epoch."""
    from lpa3_lightning.core.tcs import random_selection

    n, everyone = 40, torch.arange(40)
    random_tcs = TimeConsistency(n, 3, 0.25, seed=5, criterion="random")
    scored = TimeConsistency(n, 3, 0.25, seed=5)
    probs = torch.softmax(torch.randn(n, 3, generator=torch.Generator().manual_seed(0)), 1)
    for memory in (random_tcs, scored):
        memory.update(everyone, probs)
        memory.update(everyone, probs.flip(1))
        memory.refresh_threshold()
    assert random_tcs.has_threshold and torch.equal(random_tcs.scores, scored.scores)  # the memory still learns
    for epoch in (1, 2):
        expected = random_selection(n, 0.25, seed=5, epoch=epoch)
        assert torch.equal(random_tcs.select(everyone, epoch), expected)
        assert int(expected.sum()) == int(scored.select(everyone, epoch).sum()) == 10
    assert not torch.equal(random_tcs.select(everyone, 1), random_tcs.select(everyone, 2))
    assert not torch.equal(random_tcs.select(everyone, 1), scored.select(everyone, 1))
    with pytest.raises(ValueError, match="criterion"):
        TimeConsistency(n, 3, 0.25, criterion="lowest")


# ---------------------------------------------------------------- the selection rules
def _ref_threshold(scores: list[float], ratio: float) -> float:
    """Sorted-descending value at rank floor((1 - ratio) * N), as in the authors' code."""
    ordered = sorted(scores, reverse=True)
    return ordered[int(math.floor((1 - ratio) * len(ordered)))]


@pytest.mark.parametrize("n", [1, 2, 3, 7, 10, 64, 101])
@pytest.mark.parametrize("ratio", [0.01, 0.2, 0.3, 0.5, 0.7, 0.9, 0.99])
def test_threshold_matches_reference(n: int, ratio: float) -> None:
    g = torch.Generator().manual_seed(1000 * n + int(ratio * 100))
    scores = torch.randn(n, generator=g, dtype=torch.float64)
    thr = selection_threshold(scores, ratio, rule="authors")
    assert thr.dim() == 0 and thr.dtype == torch.float64
    ref = _ref_threshold(scores.tolist(), ratio)
    assert float(thr) == ref
    mask = scores < thr
    assert mask.tolist() == [s < ref for s in scores.tolist()]


def test_threshold_with_ties_and_float32() -> None:
    scores = torch.tensor([-1.0, -1.0, -1.0, 0.0, -2.0, -2.0], dtype=torch.float32)
    for ratio in (0.2, 0.5, 0.8):
        thr = selection_threshold(scores, ratio, rule="authors")
        assert thr.dtype == torch.float32
        assert float(thr) == _ref_threshold(scores.tolist(), ratio)
    # rank floor(0.5*6)=3 of [0,-1,-1,-1,-2,-2] is -1: only the -2s are strictly below
    assert (scores < selection_threshold(scores, 0.5, rule="authors")).tolist() == [
        False, False, False, False, True, True,
    ]


def test_threshold_docstring_example() -> None:
    assert float(selection_threshold(torch.tensor([0.0, -1.0, -2.0, -3.0]), 0.5)) == -1.0
    assert float(selection_threshold(torch.tensor([0.0, -1.0, -2.0, -3.0]), 0.5, rule="authors")) == -2.0


@pytest.mark.parametrize("n", [1, 2, 3, 7, 10, 64, 101])
@pytest.mark.parametrize("ratio", [0.01, 0.2, 0.3, 0.5, 0.7, 0.9, 0.99, 1.0])
def test_count_rule_selects_round_ratio_times_n_lowest(n: int, ratio: float) -> None:
    g = torch.Generator().manual_seed(1000 * n + int(ratio * 100))
    scores = torch.randn(n, generator=g, dtype=torch.float64)
    mask = (scores < selection_threshold(scores, ratio))
    k = max(1, min(n, int(math.floor(ratio * n + 0.5))))  # computed here, not by selected_count
    assert int(mask.sum()) == k
    lowest = set(torch.argsort(scores)[:k].tolist())
    assert set(mask.nonzero().flatten().tolist()) == lowest


def test_authors_rule_selects_one_fewer_than_ceil() -> None:
    scores = torch.randn(64, generator=torch.Generator().manual_seed(0))
    for ratio in (0.25, 0.5, 0.9):
        mask = (scores < selection_threshold(scores, ratio, rule="authors"))
        assert int(mask.sum()) == math.ceil(ratio * 64) - 1


def test_random_initial_share_is_seeded_exact_and_rank_independent() -> None:
    from lpa3_lightning.core.tcs import random_selection

    a = random_selection(100, 0.3, seed=1, epoch=0)
    assert int(a.sum()) == 30
    assert torch.equal(a, random_selection(100, 0.3, seed=1, epoch=0))  # every rank draws the same share
    assert not torch.equal(a, random_selection(100, 0.3, seed=1, epoch=1))  # a new draw per epoch
    for seed in (2**62 - 1, 2**63 + 5):  # seeds fixed from torch.initial_seed() use up to 64 bits
        assert int(random_selection(100, 0.3, seed=seed, epoch=7).sum()) == 30


@pytest.mark.parametrize("ratio", [1, 1.0])
def test_ratio_one_selects_everything(ratio: float) -> None:
    scores = torch.tensor([3.0, -1.0, 0.5, 1e30, -1e30])
    thr = selection_threshold(scores, ratio)
    assert math.isinf(float(thr)) and float(thr) > 0
    assert (scores < thr).all()


@pytest.mark.parametrize("bad", [0, 0.0, -0.5, -1, 1.0001, 2, float("nan"), True, False, "0.5", None])
def test_check_ratio_rejects(bad) -> None:
    with pytest.raises(ValueError, match=r"`ratio`.*must be in \(0, 1\]"):
        check_ratio(bad)
    with pytest.raises(ValueError, match="`ratio`"):
        selection_threshold(torch.tensor([0.0, 1.0]), bad)


@pytest.mark.parametrize(("ratio", "expected"), [(0.3, 0.3), (1, 1.0), (1e-6, 1e-6)])
def test_check_ratio_accepts_and_returns_float(ratio, expected: float) -> None:
    out = check_ratio(ratio)
    assert type(out) is float and out == expected


@pytest.mark.parametrize("shape", [(), (2, 3), (4, 1), (0,)])
def test_non_1d_or_empty_scores_rejected(shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="non-empty 1-D tensor"):
        selection_threshold(torch.zeros(shape), 0.5)


@pytest.mark.parametrize("sampler", ["EpochSampler", "RandomStream"])
def test_the_random_share_does_not_follow_the_data_order_of_the_same_seed(sampler):
    """The data modules' shuffles and the random share are both seeded from (seed, epoch); with one seed
    for both (seed_everything's, the default of each) the share was the first round(ratio N) rows the
    epoch's loader yields: every row of the epoch's first batches selected, none of its last."""
    from lpa3_lightning.core.tcs import random_selection
    from lpa3_lightning.data.sampling import EpochSampler, RandomStream

    n, seed = 546, 0
    for epoch in (0, 1, 2):
        order_source = EpochSampler(range(n), seed=seed) if sampler == "EpochSampler" else RandomStream(n, n, seed=seed)
        order_source.set_epoch(epoch)
        order = torch.tensor(list(iter(order_source)))
        share = random_selection(n, 0.5, seed=seed, epoch=epoch)
        first_batches = share[order[:128]].float().mean()  # the epoch's first four batches of 32
        assert 0.35 < float(first_batches) < 0.65, (epoch, float(first_batches))
