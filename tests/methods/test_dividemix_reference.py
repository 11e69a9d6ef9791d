"""DivideMix's training step and co-divide against transcriptions of its reference, on the same batch,
weights and draws.

Reference: LiJunnan1992/DivideMix at d9d3058, ``Train_cifar.py``, transcribed here in the test's own
words (never imported), line by line: ``warmup`` (lines 124-138, with ``NegEntropy``, lines 205-208),
``train`` (lines 41-117: co-guessing with both networks, label refinement of the labeled rows,
sharpening, mixup, ``SemiLoss`` of lines 196-203, the prior penalty), ``eval_train`` (lines 165-190:
per-sample losses in eval mode, min-max normalisation, the 5-epoch mean at 90% noise, the
two-component GMM) and the co-divide of the main loop (lines 261-273: each network trains on the
other's split).

Each step is compared on both networks' losses, every parameter's gradient and every BatchNorm buffer
after the step, to :data:`~tests.methods.reference_helpers.RTOL` / ``ATOL`` (1e-5 relative, 1e-6
absolute); the co-divide's probabilities to 1e-5 (the reference fits its GMM on float32 losses, the
package on float64). The mixup ``l`` and the permutations are the package's own draws, recorded and
handed to the transcription. The package trains both networks on every batch, each with the networks
as they are at the start of the step (docs/method.md section 5, DivideMix departure 1); so each
network's step is compared with the reference's ``train(epoch, net, net2, ...)`` on that batch with both
networks at the start of the step.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from sklearn.mixture import GaussianMixture
from torch import Tensor, nn
from torch.utils.data import DataLoader

from lpa3_lightning.methods.settings import settings_from
from lpa3_lightning.mixins import DivideMixLPA3Mixin, DivideMixSettings
from tests.helpers import handed_over
from tests.methods.reference_helpers import (
    NUM_CLASSES,
    Draws,
    assert_close,
    assert_same_buffers,
    assert_same_gradients,
    bn_buffers,
    clone,
    small_net,
    two_view_batch,
)

N = 16


class DMStep(DivideMixLPA3Mixin, nn.Module):
    """The mixin on two networks, no Lightning, at the epoch the test sets."""

    def __init__(self, net1: nn.Module, net2: nn.Module, num_samples: int = N, **settings) -> None:
        super().__init__()
        self.a, self.b = net1, net2
        self.lpa3_num_classes, self.lpa3_num_samples = NUM_CLASSES, num_samples
        self.lpa3_settings = DivideMixSettings(**settings)
        self.epoch = 0

    def dividemix_model(self, network: str) -> nn.Module:
        return {"net1": self.a, "net2": self.b}[network]

    def dividemix_current_epoch(self) -> int:
        return self.epoch


# ---------------------------------------------------------------------------------------- transcriptions
def reference_warmup_loss(net: nn.Module, inputs: Tensor, labels: Tensor, asym: bool) -> Tensor:
    """Train_cifar.py ``warmup`` L125-137: ``net.train()``, one forward, ``CEloss`` (L236), plus
    ``conf_penalty`` for asymmetric noise (L132-134; ``NegEntropy`` L205-208: ``mean(sum(log(p) * p))``)."""
    net.train()
    outputs = net(inputs)
    loss = nn.CrossEntropyLoss()(outputs, labels)
    if asym:
        probs = torch.softmax(outputs, dim=1)
        loss = loss + torch.mean(torch.sum(probs.log() * probs, dim=1))
    return loss


def reference_train_step(net: nn.Module, net2: nn.Module, inputs_x: Tensor, inputs_x2: Tensor, labels_x: Tensor,
                         w_x: Tensor, inputs_u: Tensor, inputs_u2: Tensor, lam: float, idx: Tensor,
                         lamb: float, T: float = 0.5) -> dict[str, Tensor]:
    """Train_cifar.py ``train`` L42-113 on one batch (``l`` and ``idx`` given: the package's draws)."""
    net.train()  # L42
    net2.eval()  # L43
    batch_size = inputs_x.size(0)  # L53
    labels_x = torch.zeros(batch_size, NUM_CLASSES).scatter_(1, labels_x.view(-1, 1), 1)  # L56
    w_x = w_x.view(-1, 1).type(torch.FloatTensor)  # L57
    with torch.no_grad():
        outputs_u11 = net(inputs_u)  # L64-67: four forwards, one view each; net in train mode moves its
        outputs_u12 = net(inputs_u2)  # running statistics with each, net2 in eval mode on its own
        outputs_u21 = net2(inputs_u)
        outputs_u22 = net2(inputs_u2)
        pu = (torch.softmax(outputs_u11, dim=1) + torch.softmax(outputs_u12, dim=1)
              + torch.softmax(outputs_u21, dim=1) + torch.softmax(outputs_u22, dim=1)) / 4  # L69
        ptu = pu ** (1 / T)  # L70
        targets_u = (ptu / ptu.sum(dim=1, keepdim=True)).detach()  # L72-73
        outputs_x = net(inputs_x)  # L76-77: label refinement, two more train-mode forwards
        outputs_x2 = net(inputs_x2)
        px = (torch.softmax(outputs_x, dim=1) + torch.softmax(outputs_x2, dim=1)) / 2  # L79
        px = w_x * labels_x + (1 - w_x) * px  # L80
        ptx = px ** (1 / T)  # L81
        targets_x = (ptx / ptx.sum(dim=1, keepdim=True)).detach()  # L83-84
    all_inputs = torch.cat([inputs_x, inputs_x2, inputs_u, inputs_u2], dim=0)  # L90
    all_targets = torch.cat([targets_x, targets_x, targets_u, targets_u], dim=0)  # L91
    input_a, input_b = all_inputs, all_inputs[idx]  # L95
    target_a, target_b = all_targets, all_targets[idx]  # L96
    mixed_input = lam * input_a + (1 - lam) * input_b  # L98
    mixed_target = lam * target_a + (1 - lam) * target_b  # L99
    logits = net(mixed_input)  # L101
    logits_x, logits_u = logits[:batch_size * 2], logits[batch_size * 2:]  # L102-103
    probs_u = torch.softmax(logits_u, dim=1)  # SemiLoss L198
    Lx = -torch.mean(torch.sum(F.log_softmax(logits_x, dim=1) * mixed_target[:batch_size * 2], dim=1))  # L200
    Lu = torch.mean((probs_u - mixed_target[batch_size * 2:]) ** 2)  # L201
    prior = torch.ones(NUM_CLASSES) / NUM_CLASSES  # L108
    pred_mean = torch.softmax(logits, dim=1).mean(0)  # L110
    penalty = torch.sum(prior * torch.log(prior / pred_mean))  # L111
    return {"loss": Lx + lamb * Lu + penalty, "Lx": Lx, "Lu": Lu, "penalty": penalty, "targets_u": targets_u,
            "targets_x": targets_x}


def reference_rampup(current: float, warm_up: int, lambda_u: float, rampup_length: float = 16) -> float:
    """Train_cifar.py L192-194 ``linear_rampup``."""
    return lambda_u * float(min(max((current - warm_up) / rampup_length, 0.0), 1.0))


def reference_eval_train(model: nn.Module, eval_loader, all_loss: list, r: float, n: int,
                         seed: int) -> tuple[Tensor, Tensor, list]:
    """Train_cifar.py ``eval_train`` L165-190; the GMM's ``random_state`` is the package's seed (the
    reference leaves it unseeded: docs/method.md section 5, DivideMix departure 5). Returns the raw
    per-sample losses too."""
    model.eval()  # L166
    losses = torch.zeros(n)  # L167
    with torch.no_grad():
        for inputs, targets, index in eval_loader:
            outputs = model(inputs)  # L171
            loss = nn.CrossEntropyLoss(reduction="none")(outputs, targets)  # L172 (CE, L235)
            for b in range(inputs.size(0)):
                losses[index[b]] = loss[b]  # L173-174
    raw = losses.clone()
    losses = (losses - losses.min()) / (losses.max() - losses.min())  # L175
    all_loss.append(losses)  # L176
    if r == 0.9:  # L178-181: the mean of the last 5 epochs' normalised losses
        history = torch.stack(all_loss)
        input_loss = history[-5:].mean(0)
        input_loss = input_loss.reshape(-1, 1)
    else:
        input_loss = losses.reshape(-1, 1)  # L183
    gmm = GaussianMixture(n_components=2, max_iter=10, tol=1e-2, reg_covar=5e-4, random_state=seed)  # L186
    gmm.fit(input_loss.numpy())  # L187 (the tensor as numpy takes it: float32)
    prob = gmm.predict_proba(input_loss.numpy())  # L188
    prob = prob[:, gmm.means_.argmin()]  # L189
    return torch.as_tensor(prob, dtype=torch.float32), raw, all_loss


# ---------------------------------------------------------------------------------------- set-up
def _planted(module: DMStep) -> dict[str, Tensor]:
    """Clean probabilities of both networks' GMMs, so that each network's split (the other's) has
    labeled and unlabeled rows of several sizes."""
    g = torch.Generator().manual_seed(3)
    prob1, prob2 = torch.rand(N, generator=g), torch.rand(N, generator=g)
    module._dm_state()["clean_prob"].update({"net1": prob1, "net2": prob2})
    return {"net1": prob1, "net2": prob2}


def _two_networks(**settings) -> tuple[DMStep, dict[str, tuple[nn.Module, nn.Module]], list, dict]:
    """The module in its third semi-supervised epoch, and for each network the reference's ``(net, net2)``
    pair: copies of both networks as they are at the start of the step."""
    net1, net2 = small_net(5), small_net(6)
    module = DMStep(net1, net2, warmup_epochs=2, lambda_u=25.0, **settings)
    module.epoch = 4
    pairs = {"net1": (clone(net1), clone(net2)), "net2": (clone(net2), clone(net1))}
    return module, pairs, two_view_batch(N, seed=4), _planted(module)


def _reference_steps(module: DMStep, pairs, batch, probs, draws: Draws, batch_idx: int, batches: int):
    """For each network, the reference's ``train`` step on the batch with the other's split (L264-273)."""
    x1, x2, y, _ = batch
    expected = {}
    for k, (name, other) in enumerate((("net1", "net2"), ("net2", "net1"))):
        net, net2 = pairs[name]
        w = probs[other]  # co-divide: net1 trains on net2's split (L268-269), net2 on net1's (L272-273)
        lab = w > 0.5  # L264-265 (p_threshold 0.5, L22)
        (alpha, lam), idx = draws.lams[k], draws.perms[k]
        assert alpha == 4.0  # L20
        lamb = reference_rampup(module.epoch + batch_idx / batches, warm_up=2, lambda_u=25.0)
        expected[name] = reference_train_step(net, net2, x1[lab], x2[lab], y[lab], w[lab], x1[~lab], x2[~lab],
                                              lam, idx, lamb)
        expected[name]["lamb"] = lamb
        expected[name]["loss"].backward()
    return expected


def _check_step(module: DMStep, pairs, losses, expected) -> None:
    for name, model in (("net1", module.a), ("net2", module.b)):
        loss, parts = losses[name]
        assert_close(loss, expected[name]["loss"], f"{name} loss")
        assert_close(parts["loss_labeled"], expected[name]["Lx"].detach(), f"{name} Lx")
        assert_close(parts["loss_unlabeled"], expected[name]["Lu"].detach(), f"{name} Lu")
        assert_close(parts["loss_prior"], expected[name]["penalty"].detach(), f"{name} penalty")
        assert float(parts["unlabeled_weight"]) == pytest.approx(expected[name]["lamb"], rel=1e-12)
        assert_same_gradients(model, pairs[name][0])
        assert_same_buffers(model, pairs[name][0])


# ---------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("asym", [False, True])
def test_the_warmup_step_is_the_references_warmup_for_each_network(asym):
    """Train_cifar.py:124-138 (and NegEntropy, L205-208, for asymmetric noise): each network's
    cross-entropy on one train-mode forward of its view (net1 view 1, net2 view 2: docs/method.md
    section 5, DivideMix departure 7). Same losses, gradients, buffers."""
    net1, net2 = small_net(5), small_net(6)
    module = DMStep(net1, net2, warmup_epochs=2, negative_entropy=asym)
    module.epoch = 1
    ref1, ref2 = clone(net1), clone(net2)
    x1, x2, y, _ = batch = two_view_batch(N, seed=4)
    losses = module.dividemix_losses(batch)
    (losses["net1"][0] + losses["net2"][0]).backward()
    for name, model, reference, view in (("net1", net1, ref1, x1), ("net2", net2, ref2, x2)):
        expected = reference_warmup_loss(reference, view, y, asym)
        expected.backward()
        assert_close(losses[name][0], expected, f"{name} warm-up loss")
        assert_same_gradients(model, reference)
        assert_same_buffers(model, reference)


def test_the_co_divide_is_eval_train_and_each_network_trains_on_the_others_split():
    """Train_cifar.py:165-190 (``eval_train``) and L261-273 (co-divide), over 6 epochs with
    ``loss_history=5`` (the reference's 90%-noise branch, L178-181) and one epoch with ``loss_history=1``:
    the per-sample losses (eval mode, no BatchNorm buffer moved) to 1e-6, the normalised losses to 1e-6,
    the GMM's clean probabilities to 1e-5, and the labeled rows and ``w`` each network trains with are
    the other network's ``prob > threshold`` and ``prob``."""
    n = 40
    net1, net2 = small_net(7), small_net(8)
    module = DMStep(net1, net2, num_samples=n, warmup_epochs=1, loss_history=5, seed=3)
    x1, _, _, idx = two_view_batch(n, seed=5)
    with torch.no_grad():  # noisy labels: the prediction on 60% of the rows, another class on the rest
        pred = clone(net1).eval()(x1).argmax(1)
    noisy = torch.where(idx % 5 < 3, pred, (pred + 1 + idx % 3) % NUM_CLASSES)
    histories: dict[str, list] = {"net1": [], "net2": []}
    g = torch.Generator().manual_seed(9)
    for epoch in range(1, 7):
        with torch.no_grad():  # the networks move between epochs
            for p in list(net1.parameters()) + list(net2.parameters()):
                p.add_(0.05 * torch.randn(p.shape, generator=g))
        references = {"net1": clone(net1), "net2": clone(net2)}
        before = bn_buffers(module)
        package_losses = module.dividemix_per_sample_losses(DataLoader(list(zip(x1, x1, noisy, idx)), batch_size=12))
        probs = module.dividemix_refresh_split(DataLoader(list(zip(x1, x1, noisy, idx)), batch_size=12))
        assert all(torch.equal(before[k], v) for k, v in bn_buffers(module).items())
        for name in ("net1", "net2"):
            expected, raw, histories[name] = reference_eval_train(
                references[name], DataLoader(list(zip(x1, noisy, idx)), batch_size=32), histories[name], r=0.9,
                n=n, seed=3)
            torch.testing.assert_close(package_losses[name], raw, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(module._dm_state()["history"][name][-1], histories[name][-1], rtol=0, atol=1e-6)
            torch.testing.assert_close(probs[name], expected, rtol=0, atol=1e-5)
            assert 0 < int((expected > 0.5).sum()) < n, (name, epoch)
        for name, other in (("net1", "net2"), ("net2", "net1")):
            labeled, w = module._dm_labeled(name, idx)
            assert torch.equal(labeled, probs[other] > 0.5) and torch.equal(w, probs[other])
    module.lpa3_settings = DivideMixSettings(warmup_epochs=1, loss_history=1, seed=3)  # L183: this epoch's losses
    probs = module.dividemix_refresh_split(DataLoader(list(zip(x1, x1, noisy, idx)), batch_size=12))
    expected, _, _ = reference_eval_train(clone(net1), DataLoader(list(zip(x1, noisy, idx)), batch_size=32), [],
                                          r=0.5, n=n, seed=3)
    torch.testing.assert_close(probs["net1"], expected, rtol=0, atol=1e-5)


def test_the_semi_step_with_reference_bn_updates_is_train_for_both_networks(monkeypatch):
    """Train_cifar.py:41-117 with ``DivideMixSettings(guess_bn_updates="reference")``: per network, four
    no-grad co-guessing forwards of one view each (its own in train mode, moving its running statistics;
    the other's in eval mode), two refinement forwards of the labeled views (train mode, moving them),
    sharpening at T = 0.5, the four view sets mixed with one permutation, ``Lx + lamb * Lu + penalty``.
    Both networks as they are at the start of the step (net2's guess takes net1's running statistics as
    they were before net1's own guessing forwards moved them). Same losses and parts, gradients, and
    buffers (each network's moved five times: u1, u2, x1, x2, the mixed batch)."""
    module, pairs, batch, probs = _two_networks(guess_bn_updates="reference")
    draws = Draws(monkeypatch, "lpa3_lightning.methods.dividemix")
    losses = module.dividemix_losses(batch, batch_idx=5, batches_per_epoch=8)
    (losses["net1"][0] + losses["net2"][0]).backward()
    expected = _reference_steps(module, pairs, batch, probs, draws, batch_idx=5, batches=8)
    _check_step(module, pairs, losses, expected)


def _documented_pooled_step(pairs, batch, probs, draws, moving: bool, batch_idx: int, batches: int):
    """The package's documented guessing and refinement forwards (docs/method.md section 5, DivideMix
    departure 4): both views of a row set in ONE train-mode forward (normalised by the statistics of both
    views), the running statistics left alone (``moving=False``, the default) or moved once by each such
    forward (``guess_bn_updates=True``); the other network's guess in eval mode, at the start of the step.
    Then the reference's mixup, loss and penalty (Train_cifar.py:87-113)."""
    x1, x2, y, _ = batch
    expected = {}
    for k, (name, other) in enumerate((("net1", "net2"), ("net2", "net1"))):
        net, net2 = pairs[name]
        w = probs[other]
        lab = w > 0.5
        n_u, n_l = int((~lab).sum()), int(lab.sum())
        net.train()
        net2.eval()
        norms = [m for m in net.modules() if isinstance(m, nn.BatchNorm2d)]
        with torch.no_grad():
            for m in norms:
                m.momentum = 0.1 if moving else 0.0
            tracked = [m.num_batches_tracked.clone() for m in norms]
            p_own = torch.softmax(net(torch.cat([x1[~lab], x2[~lab]])), 1)
            p_other = torch.softmax(net2(torch.cat([x1[~lab], x2[~lab]])), 1)
            pu = (p_own[:n_u] + p_own[n_u:] + p_other[:n_u] + p_other[n_u:]) / 4
            targets_u = pu ** 2 / (pu ** 2).sum(1, keepdim=True)
            px = torch.softmax(net(torch.cat([x1[lab], x2[lab]])), 1)
            wx = w[lab][:, None]
            px = wx * F.one_hot(y[lab], NUM_CLASSES) + (1 - wx) * (px[:n_l] + px[n_l:]) / 2
            targets_x = px ** 2 / (px ** 2).sum(1, keepdim=True)
            for m, count in zip(norms, tracked):
                m.momentum = 0.1
                if not moving:
                    m.num_batches_tracked.copy_(count)
        (_, lam), idx = draws.lams[k], draws.perms[k]
        all_inputs = torch.cat([x1[lab], x2[lab], x1[~lab], x2[~lab]])
        all_targets = torch.cat([targets_x, targets_x, targets_u, targets_u])
        mixed_input = lam * all_inputs + (1 - lam) * all_inputs[idx]
        mixed_target = lam * all_targets + (1 - lam) * all_targets[idx]
        logits = net(mixed_input)
        Lx = -torch.mean(torch.sum(F.log_softmax(logits[:2 * n_l], 1) * mixed_target[:2 * n_l], 1))
        Lu = torch.mean((torch.softmax(logits[2 * n_l:], 1) - mixed_target[2 * n_l:]) ** 2)
        prior = torch.ones(NUM_CLASSES) / NUM_CLASSES
        penalty = torch.sum(prior * torch.log(prior / torch.softmax(logits, 1).mean(0)))
        lamb = reference_rampup(4 + batch_idx / batches, warm_up=2, lambda_u=25.0)
        expected[name] = {"loss": Lx + lamb * Lu + penalty, "Lx": Lx, "Lu": Lu, "penalty": penalty, "lamb": lamb}
        expected[name]["loss"].backward()
    return expected


@pytest.mark.parametrize("guess_bn_updates", [False, True])
def test_the_pooled_guessing_forwards_are_as_documented(monkeypatch, guess_bn_updates):
    """The default (``guess_bn_updates=False``) and ``True`` against what docs/method.md section 5 says
    (DivideMix departure 4): one forward of both views for the guess and one for the refinement, the
    running statistics left alone (False) or moved by each (True), the networks as they are at the
    start of the step. And both depart from the reference step (``"reference"``) on the same draws."""
    module, pairs, batch, probs = _two_networks(guess_bn_updates=guess_bn_updates)
    draws = Draws(monkeypatch, "lpa3_lightning.methods.dividemix")
    losses = module.dividemix_losses(batch, batch_idx=5, batches_per_epoch=8)
    (losses["net1"][0] + losses["net2"][0]).backward()
    expected = _documented_pooled_step(pairs, batch, probs, draws, guess_bn_updates, batch_idx=5, batches=8)
    _check_step(module, pairs, losses, expected)

    reference_module, _, _, _ = _two_networks(guess_bn_updates="reference")
    lams, perms = iter([lam for _, lam in draws.lams]), iter(draws.perms)
    monkeypatch.setattr("lpa3_lightning.methods.dividemix.mixup_lambda", lambda alpha: next(lams))
    monkeypatch.setattr(torch, "randperm", lambda *a, **k: next(perms).clone())
    reference_losses = reference_module.dividemix_losses(batch, batch_idx=5, batches_per_epoch=8)
    for name in ("net1", "net2"):
        assert abs(float(losses[name][0]) - float(reference_losses[name][0])) > 1e-4, name


def test_guess_bn_updates_takes_false_true_or_reference_and_names_the_fix():
    assert DivideMixSettings().guess_bn_updates is False
    assert settings_from(DivideMixSettings, {"guess_bn_updates": "reference"}, "dividemix").guess_bn_updates == \
        "reference"
    for bad in ("per_view", 1, None):
        with pytest.raises(ValueError, match=r"`dividemix.guess_bn_updates` must be False, True or 'reference', got "
                                             f"{bad!r}. Fix:"):
            DivideMixSettings(guess_bn_updates=bad)


def test_the_lpa3_term_is_pes_lpa3s_term_on_each_network_as_documented(monkeypatch):
    """No reference exists for DivideMix + LP-A3 (the authors released none; docs/method.md section 5,
    DivideMix). What the docs say it is: the ``x'`` of a network's unlabeled rows, mixed with that
    network's labeled views (their co-refined targets) with the clean mixup's ``l`` and a fresh
    permutation, the probability MSE of the mixed ``x'`` rows against the mixed co-guess, weighted by
    ``lpa3_weight`` (None: ``lambda_u``) times the ramp: the LP-A3 term of PES_LPA3.py:232-244 on
    Train_cifar.py's step. Checked with ``train_forward="batch_stats"`` (the ``adv`` BatchNorms in train
    mode, as PES_LPA3.py:241) and ``guess_bn_updates="reference"``: the same loss, ``loss_lpa3``,
    gradients and buffers (main and twin) for the network with ``x'``; the other network unchanged."""
    from lpa3_lightning.methods.base import AugmentedBatch
    from lpa3_lightning.core.dual_bn import convert_dual_bn
    from tests.methods.test_pes_reference import AuthorsTwinNet, _authors_name

    net1, net2 = convert_dual_bn(small_net(5)), convert_dual_bn(small_net(6))
    module = DMStep(net1, net2, warmup_epochs=2, lambda_u=25.0, lpa3_weight=10.0, guess_bn_updates="reference",
                    train_forward="batch_stats")
    module.epoch = 4
    authors = {"net1": (AuthorsTwinNet(net1), AuthorsTwinNet(net2)), "net2": (AuthorsTwinNet(net2), AuthorsTwinNet(net1))}
    x1, x2, y, _ = batch = two_view_batch(N, seed=4)
    probs = _planted(module)
    request = module.lpa3_request(batch, network="net1")  # net1's unlabeled rows (view 1), co-guessed labels
    g = torch.Generator().manual_seed(11)
    mask = torch.arange(len(request.indices)) % 3 != 0  # the callback picked two rows in three
    x_adv = request.inputs[mask] + 0.2 * torch.randn(request.inputs[mask].shape, generator=g)
    module.lpa3_set_augmented(handed_over(module, x_adv, request.targets[mask], request.indices[mask], mask,
                                          bn_mode="twin", reference_inputs=request.inputs[mask].clone(),
                                          network="net1"), network="net1")
    draws = Draws(monkeypatch, "lpa3_lightning.methods.dividemix")
    losses = module.dividemix_losses(batch, batch_idx=5, batches_per_epoch=8)
    (losses["net1"][0] + losses["net2"][0]).backward()
    (_, lam1), (_, lam2) = draws.lams
    idx1, idx1_adv, idx2 = draws.perms
    lamb = reference_rampup(4 + 5 / 8, warm_up=2, lambda_u=25.0)
    ramp = lamb / 25.0

    lab = probs["net2"] > 0.5  # net1 trains on net2's split
    net, partner = authors["net1"]
    step = reference_train_step(net, partner, x1[lab], x2[lab], y[lab], probs["net2"][lab], x1[~lab], x2[~lab],
                                lam1, idx1, lamb)
    batch_size = int(lab.sum())
    all_inputsadv = torch.cat([x1[lab], x2[lab], x_adv])
    all_targetsadv = torch.cat([step["targets_x"], step["targets_x"], step["targets_u"][mask]])
    mixed_inputadv = lam1 * all_inputsadv + (1 - lam1) * all_inputsadv[idx1_adv]
    mixed_targetadv = lam1 * all_targetsadv + (1 - lam1) * all_targetsadv[idx1_adv]
    prob_adv = torch.softmax(net(mixed_inputadv[batch_size * 2:], adv=True), dim=-1)
    Ladv = torch.mean((prob_adv - mixed_targetadv[batch_size * 2:]) ** 2)
    expected1 = step["loss"] + ramp * 10.0 * Ladv
    expected1.backward()
    assert torch.equal(request.targets, step["targets_u"].argmax(1))  # the label preserved: the co-guess's argmax
    assert_close(losses["net1"][0], expected1, "net1 loss")
    assert_close(losses["net1"][1]["loss_lpa3"], Ladv.detach(), "net1 loss_lpa3")
    assert float(losses["net1"][1]["num_augmented"]) == int(mask.sum())
    assert_same_gradients(net1, net, _authors_name)
    assert_same_buffers(net1, net, _authors_name)

    lab = probs["net1"] > 0.5
    net, partner = authors["net2"]
    step = reference_train_step(net, partner, x1[lab], x2[lab], y[lab], probs["net1"][lab], x1[~lab], x2[~lab],
                                lam2, idx2, lamb)
    step["loss"].backward()
    assert_close(losses["net2"][0], step["loss"], "net2 loss")
    assert float(losses["net2"][1]["loss_lpa3"]) == 0.0
    assert_same_gradients(net2, net, _authors_name)
    assert_same_buffers(net2, net, _authors_name)
