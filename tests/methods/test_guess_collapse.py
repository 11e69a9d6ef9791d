"""PES and DivideMix say when their guessed labels collapse to one class, and log the largest class's share.

The networks here are oracles: each image has a bright quadrant, whose position is its class, and the
network reads the four quadrant means. Guesses are then right and spread over the four classes; a
large bias on one class of the head makes every guess that class (a collapse), while the split, made
before it, holds labeled samples of every class.
"""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from lpa3_lightning import DivideMixClassifier, PESClassifier
from tests.helpers import HostReadCounter
from lpa3_lightning.methods.guess_tally import GuessTally, guess_collapse_warning, warn_on_collapse
from lpa3_lightning.mixins import DivideMixSettings, PESSettings
from tests.methods.reference_helpers import NUM_CLASSES, SIDE
from tests.methods.test_dividemix_reference import DMStep
from tests.methods.test_pes_reference import PESStep

N = 48


def _oracle() -> nn.Sequential:
    net = nn.Sequential(nn.AvgPool2d(SIDE // 2), nn.Flatten(), nn.Linear(4, NUM_CLASSES))
    with torch.no_grad():
        net[-1].weight.copy_(8.0 * torch.eye(NUM_CLASSES))
        net[-1].bias.zero_()
    return net


def _collapse(net: nn.Sequential, to: int = 2) -> None:
    with torch.no_grad():
        net[-1].bias[to] = 100.0


def _data() -> list:
    """``(x1, x2, noisy_label, index)`` rows: class ``i % 4``, its quadrant bright; the labels of half the rows
    (each class's every other row: ``(i // 4) % 2 == 0``) moved to the next class."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(N):
        label = i % NUM_CLASSES
        base = torch.zeros(1, SIDE, SIDE)
        r, c = divmod(label, 2)
        base[:, r * SIDE // 2:(r + 1) * SIDE // 2, c * SIDE // 2:(c + 1) * SIDE // 2] = 1.0
        views = [base + 0.1 * torch.randn(base.shape, generator=g) for _ in range(2)]
        noisy = (label + 1) % NUM_CLASSES if (i // NUM_CLASSES) % 2 == 0 else label
        rows.append((views[0], views[1], torch.tensor(noisy), torch.tensor(i)))
    return rows


def _pes(collapsed: bool) -> PESStep:
    module = PESStep(_oracle(), early_epochs=1, refine_epochs=0)
    module.lpa3_num_samples = N
    module.epoch = 1
    module.pes_begin_epoch(1, DataLoader(_data(), batch_size=16))
    assert int((module._pes_labeled_counts > 0).sum()) == NUM_CLASSES  # the split: labeled rows of every class
    if collapsed:
        _collapse(module.net)
    for batch in DataLoader(_data(), batch_size=16):
        module.pes_loss(batch)
    return module


def _dividemix(collapsed: bool) -> DMStep:
    module = DMStep(_oracle(), _oracle(), num_samples=N, warmup_epochs=1)
    module.epoch = 1
    module.dividemix_begin_epoch(1, DataLoader(_data(), batch_size=16))
    for name in ("net1", "net2"):
        counts = module._dm_state()["labeled_counts"][name]
        assert int((counts > 0).sum()) == NUM_CLASSES, counts
    if collapsed:
        _collapse(module.a)
        _collapse(module.b)
    for batch in DataLoader(_data(), batch_size=16):
        module.dividemix_losses(batch)
    return module


def test_a_collapsed_pes_guess_is_warned_about_naming_the_causes_and_its_share_reported():
    module = _pes(collapsed=True)
    with pytest.warns(UserWarning, match=r"PES: 100% of this epoch's \d+ guessed labels of unlabeled rows are class "
                                         r"2, while the labeled set holds 4 classes .*`pes.guess_forward`.*"
                                         r"`pes/guess_top_class_share`"):
        report = module.pes_guess_report()
    assert report == {"pes/guess_top_class_share": 1.0}
    assert module.pes_guess_report() == {}  # read once: the next epoch counts afresh


def _partial_collapse(net: nn.Sequential) -> None:
    with torch.no_grad():  # every guess class 1 or 2: classes 0 and 3, half of the labeled ones, get none
        net[-1].bias[1] = net[-1].bias[2] = 100.0


def test_a_partial_pes_collapse_is_warned_about_on_its_second_epoch():
    module = _pes(collapsed=False)
    _partial_collapse(module.net)
    module._pes_tally = None
    for epoch in range(2):
        for batch in DataLoader(_data(), batch_size=16):
            module.pes_loss(batch)
        if epoch == 0:
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                module.pes_guess_report()
        else:
            with pytest.warns(UserWarning, match=r"PES: two epochs in a row, 2 of the 4 labeled classes \(classes "
                                                 r"\[0, 3\]\) got under a fifth"):
                module.pes_guess_report()


def test_a_partial_dividemix_collapse_is_warned_about_for_each_network_on_its_second_epoch():
    module = _dividemix(collapsed=False)
    _partial_collapse(module.a)
    _partial_collapse(module.b)
    module._dm_state()["tally"] = {}
    for epoch in range(2):
        for batch in DataLoader(_data(), batch_size=16):
            module.dividemix_losses(batch)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            module.dividemix_guess_report()
        messages = [str(w.message) for w in caught if "two epochs in a row" in str(w.message)]
        assert len(messages) == (0 if epoch == 0 else 2), messages


def test_a_healthy_pes_guess_is_silent_and_its_share_reported():
    module = _pes(collapsed=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = module.pes_guess_report()
    assert report["pes/guess_top_class_share"] == pytest.approx(0.25)  # the oracle's guesses: 6 of each class


def test_a_collapsed_dividemix_guess_is_warned_about_for_each_network():
    module = _dividemix(collapsed=True)
    with pytest.warns(UserWarning) as caught:
        report = module.dividemix_guess_report()
    messages = [str(w.message) for w in caught]
    for name in ("net1", "net2"):
        assert any(m.startswith(f"DivideMix ({name}): 100% of this epoch's") and "class 2" in m
                   and "`dividemix.guess_bn_updates`" in m for m in messages), messages
    assert report == {"dividemix/net1/guess_top_class_share": 1.0, "dividemix/net2/guess_top_class_share": 1.0,
                      "dividemix/guess_top_class_share": 1.0}


def test_a_healthy_dividemix_guess_is_silent():
    module = _dividemix(collapsed=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = module.dividemix_guess_report()
    assert report["dividemix/guess_top_class_share"] == pytest.approx(0.25, abs=0.05)


def test_the_tally_reads_nothing_on_the_host_per_step():
    """The counts are device work in the step (``index_add_``); only the epoch's report reads them."""
    tally = GuessTally()
    guess = torch.softmax(torch.randn(10, NUM_CLASSES), 1)
    with HostReadCounter() as reads:
        for _ in range(3):
            tally.add(guess)
            tally.add(guess[:0])  # a step without unlabeled rows
    assert reads.total == 0, dict(reads.counts)
    assert torch.equal(tally.take(NUM_CLASSES, "cpu"), 3 * torch.bincount(guess.argmax(1), minlength=NUM_CLASSES).float())
    assert tally.take(NUM_CLASSES, "cpu") is None  # taken: empty again


@pytest.mark.parametrize("counts, labeled, fires", [
    ([37, 1, 1, 1], [10, 10, 10, 10], True),  # 92% in one class, a quarter of the labeled set
    ([224] + [0] * 9, [4] * 10, True),  # FixMatch 0.2's weak-alone forward under its own strong view
    ([30, 5, 5, 0], [10, 10, 10, 10], False),  # 75%: not collapsed
    # healthy FixMatch epochs, measured (ready FixMatchClassifier, package defaults, seed 0):
    ([55, 5, 5, 5, 5, 5, 5, 5, 6, 6], [4] * 10, False),  # MNIST-5k, 40 labels, epoch 1: 54% of 102 made
    ([18, 82], [51, 49], False),  # PneumoniaMNIST, 100 labels (balanced), epoch 1: the unlabeled set is 74% class 1
    ([95, 5], [74, 26], False),  # the majority class of an imbalanced set: 95% < 74% + 25%
    ([5, 95], [74, 26], True),  # the minority class: 95% > 26% + 25%
    ([40, 0, 0, 0], [10, 0, 0, 0], False),  # the labeled set holds one class
    ([10, 0, 0, 0], [10, 10, 10, 10], False),  # too few guesses to say
])
def test_the_collapse_rule(counts, labeled, fires):
    share, message = guess_collapse_warning("PES", torch.tensor(counts), torch.tensor(labeled))
    assert share == pytest.approx(max(counts) / sum(counts))
    assert (message is not None) == fires
    # the partial-collapse rule, given its second epoch in a row, is silent on every row the first rule spares
    _, message = guess_collapse_warning("PES", torch.tensor(counts), torch.tensor(labeled), starved_before=True)
    assert (message is not None) == fires


@pytest.mark.parametrize("counts, labeled", [
    ([50, 50] + [0] * 8, [4] * 10),  # every made label in 2 of 10 classes: the top share 0.50
    ([60, 40] + [0] * 8, [4] * 10),  # 0.60
    ([34, 33, 33] + [0] * 7, [4] * 10),  # 3 of 10 classes: 0.34
    ([50, 50, 0, 0], [10, 10, 10, 10]),  # 2 of 4
    ([0, 13, 11, 0], [6, 6, 6, 6]),  # PES end to end: half of the labeled classes get no guess
], ids=["2of10_half", "2of10_60", "3of10", "2of4", "pes_end_to_end"])
def test_a_partial_collapse_is_warned_about_on_its_second_epoch_in_a_row(counts, labeled):
    """At least half of the labeled classes (3 or more of them) get under a fifth of their labeled share of the
    made labels, in two epochs in a row (one epoch like it is seen in healthy runs: 4 of 10 classes without a
    confident pseudo-label in FixMatch's first epoch)."""
    share, first = guess_collapse_warning("PES", torch.tensor(counts), torch.tensor(labeled))
    assert first is None and share <= 0.6
    _, second = guess_collapse_warning("PES", torch.tensor(counts), torch.tensor(labeled), starved_before=True)
    assert second is not None and "under a fifth of their share of the labeled set" in second


def test_a_healthy_first_fixmatch_epoch_with_four_empty_classes_is_not_a_partial_collapse():
    counts, labeled = [30, 25, 20, 15, 10, 6, 0, 0, 0, 0], [4] * 10  # 4 of 10 classes without a made label
    _, message = guess_collapse_warning("FixMatch", torch.tensor(counts), torch.tensor(labeled), starved_before=True)
    assert message is None


def test_warn_on_collapse_remembers_the_last_epoch_in_the_history_it_is_given():
    history: dict = {}
    counts, labeled = torch.tensor([0, 13, 11, 0]), torch.tensor([6, 6, 6, 6])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_on_collapse("PES", counts, labeled, history=history)  # the first epoch: silent
        warn_on_collapse("PES", torch.tensor([6, 6, 6, 6]), labeled, history=history)  # healthy: the streak ends
        warn_on_collapse("PES", counts, labeled, history=history)
    with pytest.warns(UserWarning, match="under a fifth of their share"):
        warn_on_collapse("PES", counts, labeled, history=history)


def _trainer(tmp_path) -> pl.Trainer:
    return pl.Trainer(max_epochs=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                      num_sanity_val_steps=0)


def test_the_ready_modules_log_the_share_each_semi_supervised_epoch(tmp_path):
    loader = DataLoader(_data(), batch_size=16)
    pes = PESClassifier(num_classes=NUM_CLASSES, num_samples=N, model=_oracle(), twin_bn=False,
                        pes=PESSettings(early_epochs=1, refine_epochs=0))
    trainer = _trainer(tmp_path)
    trainer.fit(pes, loader)
    assert 0.25 <= float(trainer.logged_metrics["pes/guess_top_class_share"]) <= 1.0
    torch.manual_seed(0)
    dividemix = DivideMixClassifier(num_classes=NUM_CLASSES, num_samples=N, in_channels=1,
                                    dividemix=DivideMixSettings(warmup_epochs=1))
    trainer = _trainer(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the split's losses on the augmented views: a data module without an eval view)
        trainer.fit(dividemix, loader)
    for key in ("dividemix/guess_top_class_share", "dividemix/net1/guess_top_class_share",
                "dividemix/net2/guess_top_class_share"):
        assert 0.25 <= float(trainer.logged_metrics[key]) <= 1.0, key


def test_a_partial_fixmatch_collapse_is_warned_about_on_its_second_epoch():
    from tests.methods.test_fixmatch import UserFixMatch

    module = UserFixMatch(num_unlabeled=64)
    pseudo = torch.tensor([1, 2] * 15)  # every confident pseudo-label class 1 or 2 of 3: class 0 starved...
    labeled = torch.tensor([0, 1, 2] * 4)
    for epoch in range(2):
        module._count_pseudo_labels(pseudo, torch.ones_like(pseudo, dtype=torch.bool), labeled, 3)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            module.fixmatch_pseudo_label_report()
        # ... but 1 of 3 classes is under half: no partial collapse; now with 4 classes, 2 of them starved
        assert not [w for w in caught if "two epochs in a row" in str(w.message)]
    module.lpa3_num_classes = 4
    pseudo, labeled = torch.tensor([1, 2] * 15), torch.tensor([0, 1, 2, 3] * 4)
    for epoch in range(2):
        module._count_pseudo_labels(pseudo, torch.ones_like(pseudo, dtype=torch.bool), labeled, 4)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            module.fixmatch_pseudo_label_report()
        assert len([w for w in caught if "FixMatch: two epochs in a row" in str(w.message)]) == epoch
