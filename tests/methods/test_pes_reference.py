"""PES's training step against transcriptions of its references, on the same batch, weights and draws.

References, each transcribed here in the test's own words (never imported), line by line:

- tmllab/PES at 5466238, ``PES_semi.py``: the early stage (lines 266-267, which call ``train`` of
  ``common/tools.py`` lines 85-104), the split at the start of every semi-supervised epoch
  (``update_trainloader``, lines 167-195, with ``predict_softmax`` of ``common/tools.py`` lines 177-191
  and ``splite_confident``, lines 145-164) and the MixMatch step (``MixMatch_train``, lines 70-136).
- The LP-A3 authors' PES script, CausalLearning/LPA3 at 7059ca3, ``PES/PES_LPA3.py``: the LP-A3 term
  inside that step (lines 204-263), the network's ``adv`` BatchNorms as ``PES/networks/ResNet.py``
  routes them (momentum 0.01, ``PES_LPA3.py:162``).

Each step is compared on losses, every parameter's gradient and every BatchNorm buffer after the
step (running mean, variance and batch count), to :data:`~tests.methods.reference_helpers.RTOL` /
``ATOL`` (1e-5 relative, 1e-6 absolute). The mixup ``l`` and the permutations are the package's own
draws, recorded and handed to the transcription. Where the package departs on purpose, the test runs
with the switch that restores the reference (``PESSettings(guess_forward="reference")``,
``train_forward="batch_stats"``), and the package's default is tested separately against what
``docs/method.md`` section 5 says it does.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader

from lpa3_lightning.methods.base import AugmentedBatch
from lpa3_lightning.core.dual_bn import convert_dual_bn
from lpa3_lightning.mixins import PESLPA3Mixin, PESSettings
from tests.helpers import handed_over
from tests.methods.reference_helpers import (
    NUM_CLASSES,
    AuthorsTwinNet,
    Draws,
    assert_close,
    assert_same_buffers,
    assert_same_gradients,
    authors_name,
    bn_buffers,
    clone,
    small_net,
    two_view_batch,
)

N = 16  # the batch is the whole (planted) training set: indices 0..15


class PESStep(PESLPA3Mixin, nn.Module):
    """The mixin on one network, no Lightning, at the epoch the test sets."""

    def __init__(self, net: nn.Module, **settings) -> None:
        super().__init__()
        self.net = net
        self.lpa3_settings = PESSettings(**settings)
        self.lpa3_num_classes, self.lpa3_num_samples = NUM_CLASSES, N
        self.epoch = 0

    def lpa3_model(self) -> nn.Module:
        return self.net

    def pes_current_epoch(self) -> int:
        return self.epoch


def _planted(module: PESStep) -> tuple[Tensor, Tensor]:
    """Half the rows labeled (every other one, so both parts interleave in the batch), and class weights
    with a capped and a zero class, as ``update_trainloader`` can give them."""
    labeled = torch.arange(N) % 2 == 0
    weights = torch.tensor([1.0, 2.5, 0.0, 3.0])
    module._pes_labeled, module._pes_class_weights = labeled, weights
    return labeled, weights


# ---------------------------------------------------------------------------------------- transcriptions
def reference_early_step(model: nn.Module, images: Tensor, labels: Tensor) -> Tensor:
    """tools.py ``train``: L85 ``model.train()``; L95 one forward of the batch (``Train_Dataset`` gives one
    augmented view); L96 ``ceriation`` = ``nn.CrossEntropyLoss()`` (PES_semi.py:251); L102-103 backward."""
    model.train()
    logits = model(images)
    loss = nn.CrossEntropyLoss()(logits, labels)
    loss.backward()
    return loss


def reference_split(model: nn.Module, loader, noisy: Tensor) -> tuple[Tensor, Tensor]:
    """PES_semi.py ``update_trainloader`` (L167-195): ``predict_softmax`` (tools.py L177-191: eval mode,
    the mean of the softmax of the two augmented views), ``splite_confident`` (L145-164: labeled where the
    argmax equals the noisy label) and the class weights (L183-193: ``mean(counts[counts != 0]) / counts``,
    ``inf`` -> 0, above 3 -> 3)."""
    model.eval()
    outs = []
    with torch.no_grad():
        for images1, images2, _, _ in loader:
            outs.append((F.softmax(model(images1), dim=1) + F.softmax(model(images2), dim=1)) / 2)
    _, preds = torch.max(torch.cat(outs), 1)
    confident = preds == noisy
    train_nums = torch.zeros(NUM_CLASSES, dtype=torch.float64)
    for item in noisy[confident]:
        train_nums[item] += 1
    cw = train_nums[train_nums != 0].mean() / train_nums  # a zero count gives inf (numpy: divide warning)
    cw[torch.isinf(cw)] = 0
    cw[cw > 3] = 3
    return confident, cw.float()


def reference_guess(net: nn.Module, inputs_u: Tensor, inputs_u2: Tensor, T: float) -> Tensor:
    """PES_semi.py L100-108 (PES_LPA3.py L204-212): ``net(inputs_u)`` and ``net(inputs_u2)`` in train mode
    (``net.train()`` at L71), one forward each, each moving the running statistics; mean of the softmax,
    ``** (1 / T)``, normalised."""
    with torch.no_grad():
        outputs_u11 = net(inputs_u)
        outputs_u12 = net(inputs_u2)
        pu = (torch.softmax(outputs_u11, dim=1) + torch.softmax(outputs_u12, dim=1)) / 2
        ptu = pu ** (1 / T)
        return (ptu / ptu.sum(dim=1, keepdim=True)).detach()


def reference_mixmatch_loss(net: nn.Module, inputs_x: Tensor, inputs_x2: Tensor, labels_x: Tensor,
                            inputs_u: Tensor, inputs_u2: Tensor, targets_u: Tensor, class_weights: Tensor,
                            lam: float, idx: Tensor, ramp: float) -> dict[str, Tensor]:
    """PES_semi.py L95-132 after the guess: one-hot labels (L96), the four view sets and their targets
    (L110-111), mixup with ``idx`` and ``l`` (L113-121), one train-mode forward of the mixed batch (L123),
    ``Lx`` class-weighted (L127-128), ``Lu`` the probability MSE (L130-131), ``loss = Lx + ramp * Lu`` (L132)."""
    batch_size = inputs_x.size(0)
    targets_x = torch.zeros(batch_size, NUM_CLASSES).scatter_(1, labels_x.view(-1, 1), 1)
    all_inputs = torch.cat([inputs_x, inputs_x2, inputs_u, inputs_u2], dim=0)
    all_targets = torch.cat([targets_x, targets_x, targets_u, targets_u], dim=0)
    input_a, input_b = all_inputs, all_inputs[idx]
    target_a, target_b = all_targets, all_targets[idx]
    mixed_input = lam * input_a + (1 - lam) * input_b
    mixed_target = lam * target_a + (1 - lam) * target_b
    logits = net(mixed_input)
    logits_x, logits_u = logits[:batch_size * 2], logits[batch_size * 2:]
    Lx_mean = -torch.mean(F.log_softmax(logits_x, dim=1) * mixed_target[:batch_size * 2], 0)
    Lx = torch.sum(Lx_mean * class_weights)
    probs_u = torch.softmax(logits_u, dim=1)
    Lu = torch.mean((probs_u - mixed_target[batch_size * 2:]) ** 2)
    return {"loss": Lx + ramp * Lu, "Lx": Lx, "Lu": Lu, "mixed_target": mixed_target, "targets_x": targets_x}


def reference_ramp(current: float, warm_up: int, lambda_u: float, rampup_length: float = 16) -> float:
    """PES_semi.py L64-66 ``linear_rampup``: ``lambda_u * clip((current - warm_up) / rampup_length, 0, 1)``."""
    return lambda_u * float(min(max((current - warm_up) / rampup_length, 0.0), 1.0))


#: the names tests/methods/test_dividemix_reference.py imports from this file (the network is in
#: reference_helpers, shared with the FixMatch transcription)
_authors_name = authors_name


# ---------------------------------------------------------------------------------------- tests
def test_the_early_stage_step_is_the_references_cross_entropy_step():
    """tmllab/PES PES_semi.py:266-267 -> common/tools.py:85-104 (``train``): cross-entropy of one train-mode
    forward of one augmented view on the noisy labels. Same loss, gradients and BatchNorm buffers."""
    net = small_net(0)
    reference = clone(net)
    module = PESStep(net, early_epochs=3)
    module.epoch = 1
    batch = two_view_batch(N, seed=1)
    loss, parts = module.pes_loss(batch)
    loss.backward()
    expected = reference_early_step(reference, batch[0], batch[2])
    assert_close(loss, expected, "early-stage loss")
    assert_close(parts["loss_labeled"], expected.detach(), "loss_labeled")
    assert_same_gradients(net, reference)
    assert_same_buffers(net, reference)


def test_the_split_and_the_class_weights_are_update_trainloaders():
    """tmllab/PES PES_semi.py:167-195 (with tools.py:177-191 and PES_semi.py:145-164): eval-mode prediction
    averaged over two augmented views, labeled where it equals the noisy label, class weights
    ``mean(nonzero counts) / count`` capped at 3, 0 for a class without labeled sample. Equal mask,
    weights to float tolerance, no BatchNorm buffer moved."""
    net = small_net(1)
    reference = clone(net)
    x1, x2, _, idx = two_view_batch(24, seed=2)
    with torch.no_grad():  # noisy labels: the prediction on every third row, another class elsewhere
        pred = ((F.softmax(clone(net).eval()(x1), 1) + F.softmax(clone(net).eval()(x2), 1)) / 2).argmax(1)
    noisy = torch.where(idx % 3 == 0, pred, (pred + 1 + idx % 2) % NUM_CLASSES)
    data = list(zip(x1, x2, noisy, idx))
    module = PESStep(net, early_epochs=1, refine_epochs=0)
    module.lpa3_num_samples = 24
    before = bn_buffers(net)
    labeled = module.pes_refresh_split(DataLoader(data, batch_size=7))  # any batch size: eval mode
    expected_labeled, expected_weights = reference_split(reference, DataLoader(data, batch_size=48), noisy)
    assert 0 < int(expected_labeled.sum()) < 24
    assert torch.equal(labeled, expected_labeled)
    assert_close(module._pes_class_weights, expected_weights, "class weights")
    assert all(torch.equal(before[k], v) for k, v in bn_buffers(net).items())


def _semi_module(guess_forward: str | None, seed: int = 2, **settings) -> tuple[PESStep, nn.Module, list, dict]:
    net = small_net(seed)
    reference = clone(net)
    chosen = {} if guess_forward is None else {"guess_forward": guess_forward}
    module = PESStep(net, early_epochs=3, refine_epochs=2, lambda_u=30.0, **chosen, **settings)
    module.epoch = 3 + 2 + 1  # the second semi-supervised epoch: the ramp is under way
    batch = two_view_batch(N, seed=3)
    labeled, weights = _planted(module)
    return module, reference, batch, {"labeled": labeled, "weights": weights}


def test_the_semi_step_with_the_reference_guess_forward_is_mixmatch_train(monkeypatch):
    """tmllab/PES PES_semi.py:95-132 (``MixMatch_train``) with ``PESSettings(guess_forward="reference")``:
    the guess from two train-mode forwards, u1 then u2, each moving the running statistics (L100-102),
    sharpened at T = 0.5; mixup of the four view sets; class-weighted ``Lx``, ``Lu``, the ramp. The
    ramp maps the epochs: the package counts the T2 refine epochs as epochs of the run (docs/method.md
    section 5, PES departure 2), so the reference's epoch is the package's minus T2. Same loss and its
    parts, gradients, and BatchNorm buffers (moved three times: u1, u2, the mixed batch)."""
    module, reference, batch, planted = _semi_module("reference")
    draws = Draws(monkeypatch, "lpa3_lightning.methods.pes")
    loss, parts = module.pes_loss(batch, batch_idx=3, batches_per_epoch=8)
    loss.backward()
    x1, x2, y, _ = batch
    lab = planted["labeled"]
    [(alpha, lam)], [idx] = draws.lams, draws.perms
    assert alpha == 4.0  # PES_semi.py:35 (0.75 from half the run, L72-73)
    ramp = reference_ramp((module.epoch - 2) + 3 / 8, warm_up=3, lambda_u=30.0)
    reference.train()  # L71
    targets_u = reference_guess(reference, x1[~lab], x2[~lab], T=0.5)
    expected = reference_mixmatch_loss(reference, x1[lab], x2[lab], y[lab], x1[~lab], x2[~lab], targets_u,
                                       planted["weights"], lam, idx, ramp)
    expected["loss"].backward()
    assert float(parts["unlabeled_weight"]) == pytest.approx(ramp, rel=1e-12)
    assert_close(loss, expected["loss"], "loss")
    assert_close(parts["loss_labeled"], expected["Lx"].detach(), "Lx")
    assert_close(parts["loss_unlabeled"], expected["Lu"].detach(), "Lu")
    assert_same_gradients(module.net, reference)
    assert_same_buffers(module.net, reference)


def test_the_default_guess_forward_is_one_frozen_forward_of_both_views_as_documented(monkeypatch):
    """The package's default (docs/method.md section 5, PES departure 8; ``pes_guess``'s docstring): the
    two unlabeled views in ONE train-mode forward (each normalised by the statistics of both views
    together), the running statistics left alone, so only the mixed forward moves them. Equal to that
    transcription; and it is a departure: its loss differs from the reference step's
    (``guess_forward="reference"``) on the same draws."""
    module, reference, batch, planted = _semi_module(None)
    assert module.lpa3_settings.guess_forward == "joint_frozen"
    draws = Draws(monkeypatch, "lpa3_lightning.methods.pes")
    loss, _ = module.pes_loss(batch, batch_idx=3, batches_per_epoch=8)
    loss.backward()
    x1, x2, y, _ = batch
    lab = planted["labeled"]
    [(_, lam)], [idx] = draws.lams, draws.perms
    ramp = reference_ramp((module.epoch - 2) + 3 / 8, warm_up=3, lambda_u=30.0)
    reference.train()
    saved = [(m.momentum, m.num_batches_tracked.clone()) for m in reference.modules() if isinstance(m, nn.BatchNorm2d)]
    with torch.no_grad():  # the documented default: one forward, running statistics untouched
        for m in reference.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.momentum = 0.0
        p1, p2 = torch.softmax(reference(torch.cat([x1[~lab], x2[~lab]])), 1).chunk(2)
        pu = (p1 + p2) / 2
        targets_u = pu ** 2 / (pu ** 2).sum(1, keepdim=True)
    for m, (momentum, tracked) in zip([m for m in reference.modules() if isinstance(m, nn.BatchNorm2d)], saved):
        m.momentum = momentum
        m.num_batches_tracked.copy_(tracked)
    expected = reference_mixmatch_loss(reference, x1[lab], x2[lab], y[lab], x1[~lab], x2[~lab], targets_u,
                                       planted["weights"], lam, idx, ramp)
    expected["loss"].backward()
    assert_close(loss, expected["loss"], "loss")
    assert_same_gradients(module.net, reference)
    assert_same_buffers(module.net, reference)

    # the reference's step on the same weights and draws
    authors, _, _, _ = _semi_module("reference")
    monkeypatch.setattr("lpa3_lightning.methods.pes.mixup_lambda", lambda alpha: lam)
    monkeypatch.setattr(torch, "randperm", lambda *a, **k: idx.clone())
    loss_reference, _ = authors.pes_loss(batch, batch_idx=3, batches_per_epoch=8)
    assert abs(float(loss) - float(loss_reference)) > 1e-4, (float(loss), float(loss_reference))


@pytest.mark.parametrize("phase, guess_forward", [("early", None), ("semi", "reference"), ("semi", None)],
                         ids=["early", "semi_reference_guess_forward", "semi_default_guess_forward"])
def test_the_tcs_memory_is_fed_the_view_1_logits_of_the_forward_that_made_them(phase, guess_forward):
    """What the module hands the callback's TCS memory (``lpa3_pop_predictions``; ``pes.py``'s docstring:
    every row's logits in the first two phases, the unlabeled rows' guessing forward after). In the semi
    phase: the view-1 logits of the guessing forward, the view the request hands the solver
    (``lpa3_request``: ``x1[unlabeled]``), so each sample's score is of the image its ``x'`` is solved
    from. Transcribed: with ``guess_forward="reference"`` the first of the two train-mode forwards
    (``net(inputs_u)``, PES_semi.py L100), by default the first half of one train-mode forward of
    ``cat([u1, u2])``; in the early phase the cross-entropy step's train-mode forward of view 1. The
    authors' PES script keeps no TCS memory (it attacks every unlabeled sample): the view is the
    package's choice, tested here. The view-2 logits of the same forward differ from the view-1 ones by
    far more than the tolerance, so a memory fed view 2 fails."""
    if phase == "early":
        net = small_net(2)
        reference = clone(net)
        module = PESStep(net, early_epochs=3)
        module.epoch = 1
        batch = two_view_batch(N, seed=3)
        rows = torch.ones(N, dtype=torch.bool)
    else:
        module, reference, batch, planted = _semi_module(guess_forward)
        rows = ~planted["labeled"]
    x1, x2, _, index = batch
    module.pes_loss(batch, batch_idx=3, batches_per_epoch=8)
    recorded = module.lpa3_pop_predictions()
    assert recorded is not None
    indices, logits, targets = recorded
    reference.train()
    with torch.no_grad():
        if phase == "early" or guess_forward == "reference":
            view_1, view_2 = reference(x1[rows]), reference(x2[rows])  # one forward each (tools.py L95; L100-101)
        else:
            view_1, view_2 = reference(torch.cat([x1[rows], x2[rows]])).chunk(2)
    assert torch.equal(indices, index[rows]) and targets is None
    assert_close(logits, view_1, "the logits fed to the TCS memory")
    assert float((view_2 - view_1).abs().max()) > 0.1, float((view_2 - view_1).abs().max())


def _lpa3_step(module: PESStep, batch: list) -> tuple[AugmentedBatch, Tensor]:
    """The request's rows (every unlabeled row, view 1: ``lpa3_confidence=None``) and an ``x'`` for each,
    handed over as the callback would with ``ratio=1`` (the authors attack every unlabeled sample). The
    solver is transcribed and tested on its own (tests/core/authors_attack.py): here ``x'`` is given."""
    request = module.lpa3_request(batch)
    g = torch.Generator().manual_seed(11)
    x_adv = request.inputs + 0.2 * torch.randn(request.inputs.shape, generator=g)
    mask = torch.ones(len(request.indices), dtype=torch.bool)
    augmented = handed_over(module, x_adv, request.targets, request.indices, mask, bn_mode="twin",
                            reference_inputs=request.inputs.clone())
    module.lpa3_set_augmented(augmented)
    return augmented, request.targets


def test_the_lpa3_term_with_the_authors_forward_is_pes_lpa3s_term(monkeypatch):
    """CausalLearning/LPA3 PES/PES_LPA3.py:204-263 with ``PESSettings(guess_forward="reference",
    train_forward="batch_stats")``: the ``x'`` and the labeled views mixed with the clean mixup's ``l``
    (L229-239), the mixed ``x'`` rows through the ``adv`` BatchNorms in train mode, normalised by their own
    batch and moving the ``adv`` running statistics (L241), ``Ladv`` their probability MSE against the mixed
    guess (L244), ``loss = Lx + ramp * (Lu + Ladv)`` (L263). Same loss, ``loss_lpa3``, gradients (main and
    twin BatchNorm parameters included) and buffers of both BatchNorms.

    Departures kept (docs/method.md section 5, PES 3 and 10), substituted into the authors' lines: the
    ``x'`` are of view 1 only (theirs: ``inputs_ori = cat([u1, u2])``, L215, so ``targets_ori`` is the guess
    once, not twice, L216), and the ``x'`` mixup's permutation is the package's own draw over its smaller
    batch (theirs reuses the clean mixup's ``idx``, L235-236). Not transcribed: L214-223, the attack (its
    label, the ``adv`` forward of the clean views, which moves the ``adv`` statistics once more, and
    ``get_attack``): the package's solver moves no running statistic (docs/method.md section 7,
    "BatchNorm in the solver")."""
    module, _, batch, planted = _semi_module("reference", seed=4, train_forward="batch_stats")
    module.net = convert_dual_bn(module.net)
    authors = AuthorsTwinNet(module.net)
    draws = Draws(monkeypatch, "lpa3_lightning.methods.pes")
    augmented, _ = _lpa3_step(module, batch)
    loss, parts = module.pes_loss(batch, batch_idx=3, batches_per_epoch=8)
    loss.backward()
    assert float(parts["num_augmented"]) == len(augmented) == int((~planted["labeled"]).sum())
    x1, x2, y, _ = batch
    lab = planted["labeled"]
    [(_, lam)], [idx, idx_adv] = draws.lams, draws.perms
    ramp = reference_ramp((module.epoch - 2) + 3 / 8, warm_up=3, lambda_u=30.0)
    authors.train()
    targets_u = reference_guess(authors, x1[~lab], x2[~lab], T=0.5)  # L204-212
    clean = reference_mixmatch_loss(authors, x1[lab], x2[lab], y[lab], x1[~lab], x2[~lab], targets_u,
                                    planted["weights"], lam, idx, ramp)  # L226-262
    batch_size = int(lab.sum())
    targets_x = clean["targets_x"]
    all_inputsadv = torch.cat([x1[lab], x2[lab], augmented.inputs], dim=0)  # L232 (one view of x')
    all_targetsadv = torch.cat([targets_x, targets_x, targets_u], dim=0)  # L233 (targets_ori: the guess)
    mixed_inputadv = lam * all_inputsadv + (1 - lam) * all_inputsadv[idx_adv]  # L235-238
    mixed_targetadv = lam * all_targetsadv + (1 - lam) * all_targetsadv[idx_adv]  # L236-239
    logits_adv = authors(mixed_inputadv[batch_size * 2:], adv=True)  # L241
    prob_adv = torch.softmax(logits_adv, dim=-1)  # L242
    Ladv = torch.mean((prob_adv - mixed_targetadv[batch_size * 2:]) ** 2)  # L244
    expected = clean["Lx"] + ramp * (clean["Lu"] + Ladv)  # L263
    expected.backward()
    assert_close(loss, expected, "loss")
    assert_close(parts["loss_lpa3"], Ladv.detach(), "Ladv")
    assert_same_gradients(module.net, authors, authors_name)
    assert_same_buffers(module.net, authors, authors_name)


def test_the_lpa3_term_by_default_trains_x_prime_in_the_solvers_forward_as_documented(monkeypatch):
    """The package's default (docs/method.md section 5, PES departure 6, and section 7, "forward that
    trains on x'"): the mixed ``x'`` rows go through the twins in eval mode, every row normalised by the
    clean selected samples' batch statistics (``model(cat([x_selected, x']))``, only the ``x'`` rows in
    the loss), moving no running statistic; ``lpa3/label_preserved`` is measured on the unmixed ``x'`` in
    that forward without gradient. Equal loss term, gradients and buffers to that transcription; and it
    departs from the authors' forward (``train_forward="batch_stats"``): another ``loss_lpa3``."""
    module, _, batch, planted = _semi_module(None, seed=4)
    module.net = convert_dual_bn(module.net)
    authors = AuthorsTwinNet(module.net)
    twin_before = {k: v for k, v in bn_buffers(module.net).items() if ".twin." in k}
    draws = Draws(monkeypatch, "lpa3_lightning.methods.pes")
    augmented, _ = _lpa3_step(module, batch)
    loss, parts = module.pes_loss(batch, batch_idx=3, batches_per_epoch=8)
    loss.backward()
    x1, x2, y, _ = batch
    lab = planted["labeled"]
    [(_, lam)], [idx, idx_adv] = draws.lams, draws.perms
    ramp = reference_ramp((module.epoch - 2) + 3 / 8, warm_up=3, lambda_u=30.0)
    authors.train()
    with torch.no_grad():  # the documented default guess: one forward of both views, statistics untouched
        for bn in (authors.bn1, authors.bn2):
            bn.momentum = 0.0
        p1, p2 = torch.softmax(authors(torch.cat([x1[~lab], x2[~lab]])), 1).chunk(2)
        for bn in (authors.bn1, authors.bn2):
            bn.momentum = 0.1
            bn.num_batches_tracked -= 1
        pu = (p1 + p2) / 2
        targets_u = pu ** 2 / (pu ** 2).sum(1, keepdim=True)
    clean = reference_mixmatch_loss(authors, x1[lab], x2[lab], y[lab], x1[~lab], x2[~lab], targets_u,
                                    planted["weights"], lam, idx, ramp)
    batch_size = int(lab.sum())
    all_inputsadv = torch.cat([x1[lab], x2[lab], augmented.inputs])
    all_targetsadv = torch.cat([clean["targets_x"], clean["targets_x"], targets_u])
    mixed_inputadv = lam * all_inputsadv + (1 - lam) * all_inputsadv[idx_adv]
    mixed_targetadv = lam * all_targetsadv + (1 - lam) * all_targetsadv[idx_adv]
    logits_adv = authors.forward_reference_rows(augmented.verified.reference_inputs, mixed_inputadv[batch_size * 2:])
    Ladv = torch.mean((torch.softmax(logits_adv, -1) - mixed_targetadv[batch_size * 2:]) ** 2)
    expected = clean["Lx"] + ramp * (clean["Lu"] + Ladv)
    expected.backward()
    assert_close(parts["loss_lpa3"], Ladv.detach(), "loss_lpa3")
    assert_close(loss, expected, "loss")
    assert_same_gradients(module.net, authors, authors_name)
    assert_same_buffers(module.net, authors, authors_name)
    assert all(torch.equal(v, bn_buffers(module.net)[k]) for k, v in twin_before.items())
    preserved = augmented.verified.logits  # the no-grad forward of the unmixed x', for the tally
    with torch.no_grad():
        assert_close(preserved, authors.forward_reference_rows(augmented.verified.reference_inputs, augmented.inputs),
                     "logits of the unmixed x'")
    # the authors' forward on the same x' and draws gives another term
    with torch.no_grad():
        authors_term = torch.mean((torch.softmax(authors(mixed_inputadv[batch_size * 2:], adv=True), -1)
                                   - mixed_targetadv[batch_size * 2:]) ** 2)
    assert abs(float(authors_term) - float(Ladv)) > 1e-5, (float(authors_term), float(Ladv))


def test_guess_forward_is_validated_by_name():
    with pytest.raises(ValueError, match="`pes.guess_forward` must be one of 'joint_frozen', 'reference', got "
                                         "'joint'. Fix:"):
        PESSettings(guess_forward="joint")
    assert PESSettings().guess_forward == "joint_frozen"
