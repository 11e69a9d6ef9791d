"""DivideMix's pieces: the GMM split on losses, co-refinement, co-guessing, the penalties."""

from __future__ import annotations

import doctest
import math

import pytest
import torch

from lpa3_lightning.methods import dividemix_split as dividemix
from lpa3_lightning.methods.dividemix import co_guess, co_refine, negative_entropy, prior_penalty
from lpa3_lightning.methods.dividemix_split import (
    clean_probability,
    clean_probability_per_class,
    normalized_losses,
    stratified_selection,
)
from lpa3_lightning.methods.mixmatch import sharpen


def test_docstring_examples_run():
    assert doctest.testmod(dividemix).failed == 0


def test_the_gmm_finds_the_low_loss_mode_of_a_noisy_set():
    g = torch.Generator().manual_seed(0)
    clean = 0.2 + 0.05 * torch.randn(800, generator=g)  # 80% clean labels: low loss
    noisy = 2.5 + 0.4 * torch.randn(200, generator=g)  # 20% noisy: high loss
    losses = normalized_losses(torch.cat([clean, noisy]))
    assert float(losses.min()) == 0.0 and float(losses.max()) == 1.0
    w = clean_probability(losses)
    assert w.shape == (1000,) and w.dtype == torch.float32
    predicted_clean = w > 0.5
    assert float(predicted_clean[:800].float().mean()) > 0.99 and float(predicted_clean[800:].float().mean()) < 0.01
    assert torch.equal(w, clean_probability(losses))  # seeded: the same split again


def test_the_gmm_refuses_bad_losses():
    with pytest.raises(ValueError, match="1-D"):
        clean_probability(torch.zeros(1))
    with pytest.raises(ValueError, match="NaN"):
        clean_probability(torch.tensor([0.1, float("nan"), 0.3]))


def test_a_mixture_per_class_finds_the_clean_labels_of_a_hard_class_that_the_global_one_misses():
    # class 0 is easy (clean 0.1, noisy 0.9); class 1 is hard: its clean labels' losses are those
    # of the easy class's noisy ones (0.9), its noisy ones higher still (1.6). No single threshold
    # is right on both classes.
    g = torch.Generator().manual_seed(0)
    parts = [(0.1, 300, 0, True), (0.9, 100, 0, False), (0.9, 300, 1, True), (1.6, 100, 1, False)]
    losses = torch.cat([mean + 0.04 * torch.randn(n, generator=g) for mean, n, _, _ in parts])
    labels = torch.cat([torch.full((n,), c) for _, n, c, _ in parts])
    is_clean = torch.cat([torch.full((n,), clean) for _, n, _, clean in parts])
    losses = normalized_losses(losses)
    global_split = clean_probability(losses) > 0.5
    per_class_split = clean_probability_per_class(losses, labels, num_classes=2) > 0.5
    assert int((global_split != is_clean).sum()) >= 100  # one threshold: a group of 100 or 300 rows wrong
    assert bool((per_class_split == is_clean).all())  # one per class: every row right
    # a class too small for a mixture keeps the global posterior
    labels_small = labels.clone()
    labels_small[0] = 2
    w = clean_probability_per_class(losses, labels_small, num_classes=3)
    assert float(w[0]) == float(clean_probability(losses)[0])
    with pytest.raises(ValueError, match="labels"):
        clean_probability_per_class(losses, labels, num_classes=1)


def test_co_refinement_and_co_guessing_against_their_formulas():
    labels = torch.tensor([0, 2])
    views = torch.softmax(torch.randn(2, 2, 3, generator=torch.Generator().manual_seed(1)), dim=2)
    w = torch.tensor([1.0, 0.25])
    refined = co_refine(labels, views, w, temperature=0.5)
    assert torch.allclose(refined[0], torch.tensor([1.0, 0.0, 0.0]))  # w = 1 keeps the label
    mix = 0.25 * torch.tensor([0.0, 0.0, 1.0]) + 0.75 * views[:, 1].mean(0)
    assert torch.allclose(refined[1], mix ** 2 / (mix ** 2).sum())
    other = torch.softmax(torch.randn(2, 2, 3, generator=torch.Generator().manual_seed(2)), dim=2)
    assert torch.allclose(co_guess(views, other), sharpen((views.sum(0) + other.sum(0)) / 4, 0.5))
    with pytest.raises(ValueError, match="one shape"):
        co_guess(views, other[:1])


def test_prior_penalty_is_zero_for_uniform_mean_predictions_and_negative_entropy_is_minus_entropy():
    assert abs(float(prior_penalty(torch.zeros(4, 5)))) < 1e-7
    skewed = torch.tensor([0.1, 0.2, 0.3, 0.15, 0.25])
    at_prior = skewed.log().expand(4, 5)  # every row predicts the prior
    assert abs(float(prior_penalty(at_prior, skewed))) < 1e-6 and float(prior_penalty(at_prior)) > 0.01
    with pytest.raises(ValueError, match="summing to 1"):
        prior_penalty(at_prior, torch.tensor([0.5, 0.5, 0.5, 0.0, 0.0]))
    confident = torch.tensor([[10.0, 0.0], [10.0, 0.0]])  # mean prediction ~ (1, 0)
    assert float(prior_penalty(confident)) > 1.0
    assert abs(float(negative_entropy(torch.zeros(3, 4))) + math.log(4)) < 1e-6


def test_the_stratified_selection_takes_each_class_share_of_its_lowest_losses():
    """Against a plain loop: shares in proportion to the class sizes (largest remainder), and
    within a class exactly its lowest-loss rows."""
    g = torch.Generator().manual_seed(0)
    labels = torch.cat([torch.full((n,), c) for c, n in enumerate((50, 30, 17, 3))])[torch.randperm(100, generator=g)]
    losses = torch.rand(100, generator=g)
    for count in (0, 1, 37, 100):
        selected = stratified_selection(losses, labels, num_classes=5, count=count)
        sizes = [int((labels == c).sum()) for c in range(5)]
        exact = [count * n / 100 for n in sizes]
        shares = [int(q) for q in exact]
        for c in sorted(range(5), key=lambda c: -(exact[c] - shares[c]))[: count - sum(shares)]:
            shares[c] += 1
        assert int(selected.sum()) == count
        for c in range(5):
            rows = [i for i in range(100) if int(labels[i]) == c]
            lowest = sorted(rows, key=lambda i: float(losses[i]))[: shares[c]]
            assert sorted(i for i in rows if selected[i] == 1.0) == sorted(lowest), (count, c)
    for bad in (-1, 101, 2.5, True):
        with pytest.raises(ValueError, match="`count` must be an int"):
            stratified_selection(losses, labels, num_classes=5, count=bad)
    with pytest.raises(ValueError, match="Labels out of range: `labels`.*for 3 classes"):
        stratified_selection(losses, labels, num_classes=3, count=5)
    with pytest.raises(ValueError, match="`losses` and `labels` must be 1-D of one shape.*Fix"):
        stratified_selection(losses, labels[:50], num_classes=5, count=5)


def test_the_stratified_selection_with_a_count_per_class_takes_that_many_of_each_class_lowest_losses():
    g = torch.Generator().manual_seed(1)
    labels = torch.cat([torch.full((n,), c) for c, n in enumerate((50, 30, 17, 3))])[torch.randperm(100, generator=g)]
    losses = torch.rand(100, generator=g)
    for counts in ([0, 0, 0, 0], [50, 0, 5, 3], [7, 30, 1, 0]):
        selected = stratified_selection(losses, labels, num_classes=4, count=counts)
        for c in range(4):  # a plain loop: the class's rows sorted by loss, its count first
            rows = [i for i in range(100) if int(labels[i]) == c]
            lowest = sorted(rows, key=lambda i: float(losses[i]))[: counts[c]]
            assert sorted(i for i in rows if selected[i] == 1.0) == sorted(lowest), (counts, c)
    assert stratified_selection(losses, labels, num_classes=4, count=(1, 2, 3, 0)).sum() == 6  # a tuple too
    for bad, match in (([1, 2, 3], "one int per class"), ([1, 2, 3, 0.5], "one int per class"),
                       ([1, True, 3, 0], "one int per class"), ([51, 0, 0, 0], "class size"),
                       ([0, -1, 0, 0], "class size")):
        with pytest.raises(ValueError, match=match):
            stratified_selection(losses, labels, num_classes=4, count=bad)


def test_the_stratified_selection_breaks_ties_towards_the_lower_class_and_the_lower_index():
    labels = torch.tensor([0, 1, 0, 1, 0, 1])  # two classes of 3: a count of 3 leaves a tie of remainders
    losses = torch.full((6,), 0.5)  # every loss equal: the lower indices win within a class
    assert stratified_selection(losses, labels, num_classes=2, count=3).tolist() == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
