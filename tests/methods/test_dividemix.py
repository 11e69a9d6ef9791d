"""DivideMix + LP-A3: co-divide, the loss against an independent computation, the per-network request."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from lpa3_lightning.methods.dividemix_split import (
    clean_probability,
    clean_probability_per_class,
    normalized_losses,
)
from lpa3_lightning.mixins import DivideMixLPA3Mixin, DivideMixSettings
from tests.methods.test_pes import NUM_CLASSES, NoisyTwoViews, _net

N = 48


class TwoNets(DivideMixLPA3Mixin, nn.Module):
    """The mixin on two plain networks, no Lightning."""

    def __init__(self, warmup: int = 0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = _net(), _net()
        self.lpa3_num_classes, self.lpa3_num_samples = NUM_CLASSES, N
        self.lpa3_settings = DivideMixSettings(warmup_epochs=warmup)
        self.epoch = 0

    def dividemix_model(self, network: str) -> nn.Module:
        return {"net1": self.a, "net2": self.b}[network]

    def dividemix_current_epoch(self) -> int:
        return self.epoch


def _set(module: DivideMixLPA3Mixin, **changes) -> None:
    """Change some of the module's DivideMix settings (a frozen dataclass: replaced, not mutated)."""
    module.lpa3_settings = replace(module.lpa3_settings, **changes)


def _batch(n: int = 12):
    return next(iter(DataLoader(NoisyTwoViews(N), batch_size=n, shuffle=False)))


def _planted_split(module: TwoNets) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    w1, w2 = torch.rand(N, generator=g), torch.rand(N, generator=g)
    module._dm_state()["clean_prob"].update({"net1": w1, "net2": w2})
    return w1, w2


def test_each_network_trains_on_the_split_of_the_other():
    module = TwoNets()
    w1, w2 = _planted_split(module)
    idx = torch.arange(N)
    assert torch.equal(module._dm_labeled("net1", idx)[0], w2 > 0.5)
    assert torch.equal(module._dm_labeled("net2", idx)[0], w1 > 0.5)
    request = module.lpa3_request(_batch(), network="net2")
    assert torch.equal(request.indices, torch.arange(12)[w1[:12] <= 0.5])


class _IndexOracle(nn.Module):
    """Answers each image's clean label (each image carries its index), except on the indices in
    ``wrong`` (the next class): a network whose per-sample losses are planted."""

    def __init__(self, data: NoisyTwoViews, wrong: torch.Tensor) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))
        self.data, self.wrong = data, wrong

    def forward(self, x):
        i = x[:, 0, 0, 0].round().long()
        label = torch.where(self.wrong[i], (self.data.clean[i] + 1) % NUM_CLASSES, self.data.clean[i])
        return self.scale * 6.0 * F.one_hot(label, NUM_CLASSES).float()


def _oracles(wrong1: torch.Tensor, wrong2: torch.Tensor) -> tuple[TwoNets, NoisyTwoViews, list]:
    """Two oracle networks and the images that carry their index, with the noisy labels."""
    data = NoisyTwoViews(N)
    by_index = [(torch.full((1, 4, 4), float(i)), torch.full((1, 4, 4), float(i)), data.noisy[i], i) for i in range(N)]
    module = TwoNets()
    module.a, module.b = _IndexOracle(data, wrong1), _IndexOracle(data, wrong2)
    return module, data, by_index


def test_the_split_marks_the_samples_whose_noisy_label_has_a_high_loss():
    """A network that predicts the clean labels: the flipped samples get a low clean probability."""
    data = NoisyTwoViews(N)
    flipped = data.noisy != data.clean
    # network 1 knows every clean label; network 2 is wrong on the even indices that are not flipped
    even = torch.arange(N) % 2 == 0
    module, data, by_index = _oracles(torch.zeros(N, dtype=torch.bool), even & ~flipped)
    prob = module.dividemix_refresh_split(DataLoader(by_index, batch_size=10, shuffle=True))
    assert bool((prob["net1"][flipped] < 0.1).all()) and bool((prob["net1"][~flipped] > 0.9).all())
    suspicious = flipped | even  # for network 2 the even clean samples look noisy too
    assert bool((prob["net2"][suspicious] < 0.1).all()) and bool((prob["net2"][~suspicious] > 0.9).all())


def test_the_per_class_split_fits_each_noisy_class_on_the_losses_the_loader_gives():
    """split_per_class: the mixture is fitted per noisy label as the loader carries it (by
    index, whatever the order), on the same normalised losses as the global split."""
    data = NoisyTwoViews(N)
    fixed = [data[i] for i in range(N)]  # the views drawn once, so the check sees the same images
    module = TwoNets()
    _set(module, split_per_class=True)
    loader = DataLoader(fixed, batch_size=10, shuffle=True, generator=torch.Generator().manual_seed(0))
    prob = module.dividemix_refresh_split(loader)
    x1 = torch.stack([row[0] for row in fixed])
    for name, net in (("net1", module.a), ("net2", module.b)):
        with torch.no_grad():
            losses = F.cross_entropy(net.eval()(x1), data.noisy, reduction="none")
        expected = clean_probability_per_class(normalized_losses(losses), data.noisy, NUM_CLASSES)
        assert torch.allclose(prob[name], expected, atol=1e-4)
        assert not torch.allclose(prob[name], clean_probability(normalized_losses(losses)), atol=1e-2)


def test_the_stratified_split_keeps_the_first_splits_count_and_each_class_lowest_losses():
    """stratified_split: the first refresh fixes the count at the GMM's labeled count; a later
    refresh (other losses) keeps that count; each class's rows are its lowest-loss ones; the
    count survives the module's state dict."""
    data = NoisyTwoViews(N)
    fixed = [data[i] for i in range(N)]
    module = TwoNets()
    _set(module, stratified_split=True)
    loader = DataLoader(fixed, batch_size=10, shuffle=False)
    x1 = torch.stack([row[0] for row in fixed])

    def gmm_count_and_losses(net):
        with torch.no_grad():
            losses = normalized_losses(F.cross_entropy(net.eval()(x1), data.noisy, reduction="none"))
        return int((clean_probability(losses) > 0.5).sum()), losses

    first = module.dividemix_refresh_split(loader)
    counts = {}
    for name, net in (("net1", module.a), ("net2", module.b)):
        counts[name], losses = gmm_count_and_losses(net)
        assert 0 < counts[name] < N and int(first[name].sum()) == counts[name]
        for c in range(NUM_CLASSES):  # within a class, no unselected row has a lower loss than a selected one
            rows = data.noisy == c
            chosen, left = losses[rows & (first[name] == 1)], losses[rows & (first[name] == 0)]
            assert chosen.numel() == 0 or left.numel() == 0 or float(chosen.max()) <= float(left.min())
    with torch.no_grad():  # the networks change: the GMM's count changes, the split's does not
        for p in module.parameters():
            p.add_(0.5 * torch.randn_like(p))
    assert any(gmm_count_and_losses(net)[0] != counts[name] for name, net in (("net1", module.a), ("net2", module.b)))
    second = module.dividemix_refresh_split(loader)
    assert all(int(second[name].sum()) == counts[name] for name in counts)
    saved = module.dividemix_state_dict()
    resumed = TwoNets()
    _set(resumed, stratified_split=True)
    resumed.dividemix_load_state_dict(saved)
    assert resumed._dm_state()["stratified_count"] == counts
    resumed.a.load_state_dict(module.a.state_dict())
    resumed.b.load_state_dict(module.b.state_dict())
    after_resume = resumed.dividemix_refresh_split(loader)  # the restored count, not a fresh GMM's
    assert all(int(after_resume[name].sum()) == counts[name] for name in counts)


def test_the_stratified_split_with_a_mixture_per_class_keeps_each_class_first_count():
    """split_per_class and stratified_split: each class keeps the count its own first mixture
    labeled (not one total shared by class size), through a change of the networks and a resume."""
    data = NoisyTwoViews(N)
    flipped, idx = data.noisy != data.clean, torch.arange(N)
    # every class needs rows on both sides: the oracles also err on some clean rows of each class
    def errs_in_each_class(period: int, a: int, b: int) -> torch.Tensor:
        # the noisy labels run 1, 1, 2, ...: a row with idx % 3 == 1 is in class 1, == 2 in class 2
        return ~flipped & ((idx % period == a) | (idx % period == b))

    module, data, by_index = _oracles(errs_in_each_class(6, 1, 2), errs_in_each_class(9, 4, 5))
    _set(module, stratified_split=True, split_per_class=True)
    loader = DataLoader(by_index, batch_size=10, shuffle=False)
    first = module.dividemix_refresh_split(loader)
    expected = {}
    for name, net in (("net1", module.a), ("net2", module.b)):
        labeled = ~(flipped | net.wrong)  # the rows the oracle answers with their noisy label
        expected[name] = torch.bincount(data.noisy[labeled], minlength=NUM_CLASSES).tolist()
        assert torch.equal(first[name], labeled.float()), name  # each class's lowest-loss rows, that many
    assert expected["net1"] != expected["net2"]
    module.a.wrong, module.b.wrong = errs_in_each_class(12, 1, 2), errs_in_each_class(6, 4, 5)  # the networks change
    for name, net in (("net1", module.a), ("net2", module.b)):  # a fresh mixture would label other numbers
        assert torch.bincount(data.noisy[~(flipped | net.wrong)], minlength=NUM_CLASSES).tolist() != expected[name]
    second = module.dividemix_refresh_split(loader)
    for name in expected:  # the counts held
        assert torch.bincount(data.noisy[second[name] == 1], minlength=NUM_CLASSES).tolist() == expected[name]
    saved = module.dividemix_state_dict()
    resumed, _, _ = _oracles(module.a.wrong, module.b.wrong)
    _set(resumed, stratified_split=True, split_per_class=True)
    resumed.dividemix_load_state_dict(saved)
    assert resumed._dm_state()["stratified_count"] == expected
    after_resume = resumed.dividemix_refresh_split(loader)  # the restored counts are the ones used
    for name in expected:
        assert torch.bincount(data.noisy[after_resume[name] == 1], minlength=NUM_CLASSES).tolist() == expected[name]
    other_flags, _, _ = _oracles(module.a.wrong, module.b.wrong)  # per-class counts without split_per_class
    _set(other_flags, stratified_split=True)
    other_flags.dividemix_load_state_dict(saved)
    with pytest.raises(ValueError, match="one count per class.*`dividemix.split_per_class` is False"):
        other_flags.dividemix_refresh_split(loader)


def test_the_per_class_count_waits_for_a_split_with_both_sides_in_every_class():
    """A class whose first mixture labels all (or none) of its rows would be frozen that way for
    the run: the counts are taken from the first split where every class has both sides."""
    data = NoisyTwoViews(N)
    flipped, idx = data.noisy != data.clean, torch.arange(N)
    assert not bool(flipped[data.noisy == 2].any())  # class 2: every label clean
    module, data, by_index = _oracles(torch.zeros(N, dtype=torch.bool), torch.zeros(N, dtype=torch.bool))
    _set(module, stratified_split=True, split_per_class=True)
    loader = DataLoader(by_index, batch_size=10, shuffle=False)
    module.dividemix_refresh_split(loader)  # perfect oracles: class 2 is all clean, one side only
    assert module._dm_state().get("stratified_count", {}) == {}
    wrong = ~flipped & (idx % 6 == 2)
    module.a.wrong = module.b.wrong = wrong  # now some rows of class 2 look noisy
    module.dividemix_refresh_split(loader)
    kept = module._dm_state()["stratified_count"]
    # the counts of this split, per noisy class: the rows the oracles find clean (neither flipped nor
    # made to look noisy)
    expected = torch.bincount(data.noisy[~(flipped | wrong)], minlength=NUM_CLASSES).tolist()
    sizes = torch.bincount(data.noisy, minlength=NUM_CLASSES).tolist()
    assert all(0 < expected[c] < sizes[c] for c in range(NUM_CLASSES) if sizes[c])  # both sides in every class
    assert kept == {"net1": expected, "net2": expected}


def test_a_restored_count_of_another_number_type_is_read_as_a_count():
    module = TwoNets()
    module.dividemix_load_state_dict({"stratified_count": {"net1": torch.tensor(7), "net2": (1, 2, 3, 4)}})
    assert module._dm_state()["stratified_count"] == {"net1": 7, "net2": [1, 2, 3, 4]}


def test_the_split_refuses_a_loader_that_leaves_samples_out():
    module = TwoNets()
    with pytest.raises(ValueError, match="left 8 training samples out"):
        module.dividemix_refresh_split(DataLoader(NoisyTwoViews(N), batch_size=10, drop_last=True))


@pytest.mark.parametrize("prior_weight, class_prior", [(1.0, None), (0.5, "skewed"), (0.0, None)])
def test_semi_loss_equals_an_independent_computation(monkeypatch, prior_weight, class_prior):
    module = TwoNets()
    _, w2 = _planted_split(module)
    prior_probs = torch.full((NUM_CLASSES,), 1 / NUM_CLASSES)
    if class_prior == "skewed":
        prior_probs = torch.arange(1, NUM_CLASSES + 1, dtype=torch.float32)
        prior_probs = prior_probs / prior_probs.sum()
        _set(module, class_prior=tuple(prior_probs.tolist()))
    _set(module, prior_weight=prior_weight)
    monkeypatch.setattr("lpa3_lightning.methods.dividemix.mixup_lambda", lambda alpha: 0.7)
    batch = _batch()
    x1, x2, y, idx = batch
    net1, net2 = copy.deepcopy(module.a).train(), copy.deepcopy(module.b).eval()
    torch.manual_seed(5)
    loss, parts = module.dividemix_loss(batch, "net1", batch_idx=8, batches_per_epoch=1)  # ramp 8/16 of 25

    lab = w2[idx] > 0.5
    n_lab = int(lab.sum())
    assert 0 < n_lab < 12
    with torch.no_grad():
        u = torch.cat([x1[~lab], x2[~lab]])
        p_own, p_other = net1(u).softmax(1), net2(u).softmax(1)
        q = torch.stack([p_own[: 12 - n_lab], p_own[12 - n_lab:], p_other[: 12 - n_lab], p_other[12 - n_lab:]]).mean(0)
        q = q ** 2 / (q ** 2).sum(1, keepdim=True)
        p = net1(torch.cat([x1[lab], x2[lab]])).softmax(1)
        w = w2[idx][lab][:, None]
        t = w * F.one_hot(y[lab], NUM_CLASSES) + (1 - w) * (p[:n_lab] + p[n_lab:]) / 2
        t = t ** 2 / (t ** 2).sum(1, keepdim=True)
    inputs = torch.cat([x1[lab], x2[lab], x1[~lab], x2[~lab]])
    targets = torch.cat([t, t, q, q])
    torch.manual_seed(5)
    perm = torch.randperm(12 * 2)
    logits = net1(0.7 * inputs + 0.3 * inputs[perm])
    mixed_t = 0.7 * targets + 0.3 * targets[perm]
    lx = -(mixed_t[: 2 * n_lab] * logits[: 2 * n_lab].log_softmax(1)).sum(1).mean()
    lu = ((logits[2 * n_lab:].softmax(1) - mixed_t[2 * n_lab:]) ** 2).mean()
    mean_p = logits.softmax(1).mean(0)
    prior = (prior_probs * (prior_probs / mean_p).log()).sum()
    expected = lx + 12.5 * lu + prior_weight * prior
    assert torch.allclose(loss, expected, atol=1e-5), (float(loss), float(expected))
    assert float(parts["unlabeled_weight"]) == 12.5
    assert abs(float(parts["labeled_share"]) - n_lab / 12) < 1e-6


def test_the_class_prior_tensor_is_built_once_per_setting_and_a_bad_setting_is_refused_by_name():
    module = TwoNets()
    assert module._dm_prior(torch.device("cpu")) is None  # uniform
    skewed = torch.arange(1, NUM_CLASSES + 1, dtype=torch.float64)
    _set(module, class_prior=tuple((skewed / skewed.sum()).tolist()))
    first = module._dm_prior(torch.device("cpu"))
    assert torch.allclose(first.double(), torch.tensor(module.lpa3_settings.class_prior, dtype=torch.float64))
    assert module._dm_prior(torch.device("cpu")) is first  # reused, not rebuilt every step
    _set(module, class_prior=(1 / NUM_CLASSES,) * NUM_CLASSES)
    second = module._dm_prior(torch.device("cpu"))
    assert second is not first and torch.allclose(second, torch.full((NUM_CLASSES,), 1 / NUM_CLASSES))
    module.lpa3_num_classes = NUM_CLASSES + 1  # the same prior no longer fits: checked again, refused
    with pytest.raises(ValueError, match="`dividemix.class_prior` holds 3 class frequencies, but the module has "
                                         "lpa3_num_classes=4"):
        module._dm_prior(torch.device("cpu"))
    with pytest.raises(ValueError, match="`dividemix.class_prior` must hold num_classes=2 positive frequencies"):
        DivideMixSettings(class_prior=(0.5, 0.6))  # the values are checked once, when the settings are built


def test_prior_penalty_checks_the_shape_of_a_prior_off_the_host_without_reading_its_values(monkeypatch):
    """A prior on another device (here "meta", which has no values to read) gets its shape checked;
    its values are not read on the host (the check that would read them is not called)."""
    from lpa3_lightning.methods import dividemix

    read = []
    monkeypatch.setattr(dividemix, "check_class_prior", lambda *a, **k: read.append(a))
    with pytest.raises(ValueError, match=r"`prior` must hold 3 class frequencies .*got shape \(2,\)"):
        dividemix.prior_penalty(torch.zeros(4, 3), torch.empty(2, device="meta"))
    assert read == []
    dividemix.prior_penalty(torch.zeros(4, 3), torch.full((3,), 1 / 3))  # a host prior is value-checked
    assert len(read) == 1


def test_the_guessing_forwards_move_no_running_statistic_and_feed_the_tcs_record():
    module = TwoNets()
    _planted_split(module)
    bn_before = {k: v.clone() for k, v in module.state_dict().items() if "running" in k or "num_batches" in k}
    batch = _batch()
    request = module.lpa3_request(batch, network="net1")
    after_request = {k: v for k, v in module.state_dict().items() if k in bn_before}
    assert all(torch.equal(bn_before[k], after_request[k]) for k in bn_before)
    module.dividemix_loss(batch, "net1")
    indices, logits, _ = module.lpa3_pop_predictions(network="net1")
    assert torch.equal(indices, request.indices) and logits.shape == (len(request.indices), NUM_CLASSES)
    assert module.lpa3_pop_predictions(network="net2") is None  # each network's record is its own


def test_with_guess_bn_updates_the_guessing_forward_moves_the_running_statistics_as_the_authors():
    module = TwoNets()
    _planted_split(module)
    _set(module, guess_bn_updates=True)
    running = {k: v.clone() for k, v in module.a.state_dict().items() if "running_mean" in k}
    module.lpa3_request(_batch(), network="net1")  # net1's guess: its own train-mode forward of both views
    assert all(not torch.equal(running[k], v) for k, v in module.a.state_dict().items() if k in running)


def test_warmup_trains_each_network_on_its_own_view_with_cross_entropy():
    module = TwoNets(warmup=2)
    batch = _batch()
    x1, x2, y, _ = batch
    loss1, _ = module.dividemix_loss(batch, "net1")
    with torch.no_grad():
        expected = F.cross_entropy(copy.deepcopy(module.a).train()(x1), y)
    assert torch.allclose(loss1, expected, atol=1e-5)
    assert torch.equal(module.lpa3_request(batch, network="net2").inputs, x2)
    _set(module, negative_entropy=True)
    loss_ne, _ = module.dividemix_loss(batch, "net2")
    with torch.no_grad():
        logits = copy.deepcopy(module.b).train()(x2)
        expected_ne = F.cross_entropy(logits, y) + (logits.softmax(1) * logits.log_softmax(1)).sum(1).mean()
    assert torch.allclose(loss_ne, expected_ne, atol=1e-5)


def test_a_network_must_be_named():
    module = TwoNets()
    with pytest.raises(ValueError, match="name one"):
        module.lpa3_model()
    with pytest.raises(ValueError, match="network='net3'"):
        module.lpa3_model(network="net3")
    with pytest.raises(RuntimeError, match="dividemix_begin_epoch"):
        module.lpa3_request(_batch(), network="net1")


def test_every_guess_is_made_before_the_first_networks_training_forward(monkeypatch):
    """dividemix_losses (no callback) equals the callback's order (both requests, then the losses),
    and so does calling the two losses one after the other: network 1's eval-mode prediction for
    network 2's guess is made at the batch's first guess, before network 1's training forward moves
    its running statistics (made lazily, after it, network 2's loss differed by more than 1e-4)."""
    monkeypatch.setattr("lpa3_lightning.methods.dividemix.mixup_lambda", lambda alpha: 0.7)
    module = TwoNets()
    _planted_split(module)
    for net in (module.a, module.b):  # running statistics away from their initial values
        net.train()
        with torch.no_grad():
            net(torch.randn(16, 1, 28, 28) * 2 + 1)
    batch = _batch()
    callback_order, naive = copy.deepcopy(module), copy.deepcopy(module)
    torch.manual_seed(5)
    together = module.dividemix_losses(batch)
    for name in ("net1", "net2"):
        callback_order.lpa3_request(batch, network=name)
    torch.manual_seed(5)
    in_order = {name: callback_order.dividemix_loss(batch, name) for name in ("net1", "net2")}
    torch.manual_seed(5)
    one_after_other = {name: naive.dividemix_loss(batch, name) for name in ("net1", "net2")}
    for name in ("net1", "net2"):
        assert torch.allclose(together[name][0], in_order[name][0], atol=1e-6), name
    for name in ("net1", "net2"):
        assert torch.allclose(together[name][0], one_after_other[name][0], atol=1e-6), name
    # a second step on the same batch object guesses afresh (nothing of the first step is reused)
    torch.manual_seed(5)
    again = naive.dividemix_losses(batch)
    assert not torch.allclose(again["net2"][0], one_after_other["net2"][0], atol=1e-6)
