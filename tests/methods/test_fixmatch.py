"""FixMatch + LP-A3: the loss terms, one weak forward per step, and a fit with the callback."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities.combined_loader import CombinedLoader
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lpa3_lightning import LPA3Callback
from lpa3_lightning.methods.base import AugmentedBatch
from lpa3_lightning.core.dual_bn import convert_dual_bn
from lpa3_lightning.methods.fixmatch import split_semi_supervised_batch
from lpa3_lightning.mixins import FixMatchLPA3Mixin, FixMatchSettings
from tests.helpers import handed_over, indexed_images

NUM_CLASSES = 3


def _net() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, NUM_CLASSES))


class UserFixMatch(FixMatchLPA3Mixin, pl.LightningModule):
    """A FixMatch module written by a user: the mixin's loss, their own network and optimizer."""

    def __init__(self, num_unlabeled: int, loss_warmup: int = 0, confidence: float = 0.9) -> None:
        super().__init__()
        # the fits below use 0.4: an untrained 3-class network reaches 0.9 on no row, and the
        # callback solves only the rows the loss will weigh (solve_trained_only)
        self.lpa3_settings = FixMatchSettings(lpa3_confidence_threshold=confidence, lpa3_loss_warmup_epochs=loss_warmup)
        self.net = convert_dual_bn(_net())
        self.lpa3_num_classes = NUM_CLASSES
        self.lpa3_num_samples = num_unlabeled
        self.parts: list[dict[str, float]] = []

    def lpa3_model(self) -> nn.Module:
        return self.net

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss, parts = self.fixmatch_loss(batch)
        self.parts.append({k: float(v) for k, v in parts.items()})
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.03, momentum=0.9, nesterov=True)


class TwoViews(Dataset):
    """Unlabeled views of the synthetic images: a small shift (weak) and noise on top (strong)."""

    def __init__(self, n: int) -> None:
        self.data = indexed_images(n)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int):
        x, _, idx = self.data[i]
        weak = torch.roll(x, shifts=int(i % 3) - 1, dims=2)
        return weak, weak + 0.3 * torch.randn_like(weak), idx


def _loaders(n_unlabeled: int = 64, n_labeled: int = 12, batch: int = 4, mu: int = 4) -> CombinedLoader:
    labeled = DataLoader(indexed_images(n_labeled, seed=5), batch_size=batch, shuffle=True, drop_last=True)
    unlabeled = DataLoader(TwoViews(n_unlabeled), batch_size=batch * mu, shuffle=True, drop_last=True)
    return CombinedLoader({"labeled": labeled, "unlabeled": unlabeled}, mode="max_size_cycle")


def _trainer(tmp_path, callbacks, max_epochs: int = 2, **kwargs) -> pl.Trainer:
    return pl.Trainer(default_root_dir=tmp_path, max_epochs=max_epochs, accelerator="cpu", devices=1,
                      callbacks=callbacks, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, **kwargs)


# ------------------------------------------------------------------ the loss terms on a tiny batch
def _given_pseudo_labels(module: UserFixMatch, probs: torch.Tensor) -> None:
    """Make the weak slice's pseudo-label probabilities ``probs`` (the request's and the loss's)."""
    module.fixmatch_pseudo_labels = lambda weak_logits: probs.max(dim=1)  # type: ignore[method-assign]


def _tiny_batch() -> dict:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(2, 1, 28, 28, generator=g), torch.tensor([0, 2])
    weak, strong = torch.randn(4, 1, 28, 28, generator=g), torch.randn(4, 1, 28, 28, generator=g)
    return {"labeled": (x, y, torch.tensor([0, 1])), "unlabeled": (weak, strong, torch.tensor([5, 6, 7, 8]))}


@pytest.mark.parametrize("epoch, warmup", [(3, 0), (0, 1)], ids=["after_warmup", "in_warmup"])
def test_loss_terms_on_a_tiny_batch(epoch, warmup):
    module = UserFixMatch(num_unlabeled=10, loss_warmup=warmup)
    module.eval()  # no BN statistics, no randomness: the reference below recomputes the same forwards
    batch = _tiny_batch()
    x, y, _, weak, strong, _ = split_semi_supervised_batch(batch)
    # pseudo-label confidences 0.97 (kept), 0.92 (below 0.95, above 0.9), 0.5, 0.96 (kept)
    probs = torch.tensor([[0.97, 0.02, 0.01], [0.04, 0.92, 0.04], [0.25, 0.25, 0.5], [0.02, 0.02, 0.96]])
    _given_pseudo_labels(module, probs)
    x_adv = torch.randn(3, 1, 28, 28, generator=torch.Generator().manual_seed(1))
    mask = torch.tensor([True, True, False, True])
    from lpa3_lightning.core.forward_modes import running_statistics

    augmented = handed_over(module, x_adv, torch.tensor([0, 1, 2]), torch.tensor([5, 6, 8]), mask,
                            statistics=running_statistics(module.net))
    module.lpa3_set_augmented(augmented)

    class FakeTrainer:
        current_epoch = epoch

    module._trainer = FakeTrainer()  # type: ignore[assignment]
    loss, parts = module.fixmatch_loss(batch)
    # independent reference
    with torch.no_grad():
        ce_l = F.cross_entropy(module.net(x), y)
        pseudo = torch.tensor([0, 1, 2, 2])
        keep_u = torch.tensor([1.0, 0.0, 0.0, 1.0])  # 0.95 masking
        ce_u = (F.cross_entropy(module.net(strong), pseudo, reduction="none") * keep_u).mean()
        expected = ce_l + ce_u
        if epoch >= warmup:
            keep_a = torch.tensor([1.0, 1.0, 1.0])  # confidences 0.97, 0.92, 0.96 >= 0.9
            ce_a = F.cross_entropy(module.net(x_adv), augmented.targets, reduction="none")
            expected = expected + (ce_a * keep_a).mean()
    torch.testing.assert_close(loss.detach(), expected, atol=1e-5, rtol=1e-5)
    assert float(parts["mask_rate"]) == 0.5
    assert float(parts["num_augmented"]) == (3.0 if epoch >= warmup else 0.0)
    if epoch < warmup:  # the x' of a warm-up step are left untaken
        assert module._lpa3_slot("augmented", None) is augmented


def test_the_second_threshold_drops_low_confidence_x_prime():
    module = UserFixMatch(num_unlabeled=10)
    module.eval()
    batch = _tiny_batch()
    probs = torch.tensor([[0.97, 0.02, 0.01], [0.05, 0.89, 0.06], [0.25, 0.25, 0.5], [0.02, 0.02, 0.96]])
    from lpa3_lightning.core.forward_modes import running_statistics

    x_adv = torch.randn(2, 1, 28, 28, generator=torch.Generator().manual_seed(1))
    augmented = handed_over(module, x_adv, torch.tensor([0, 1]), torch.tensor([5, 6]),
                            torch.tensor([True, True, False, False]), statistics=running_statistics(module.net))
    _given_pseudo_labels(module, probs)
    module.lpa3_set_augmented(augmented)
    _, parts = module.fixmatch_loss(batch)
    with torch.no_grad():
        ce = F.cross_entropy(module.net(x_adv), augmented.targets, reduction="none")
    torch.testing.assert_close(parts["loss_lpa3"], ce[0] / 2, atol=1e-6, rtol=1e-5)  # 0.89 < 0.9 dropped
    assert float(parts["lpa3_kept_rate"]) == 0.5


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_the_pseudo_labels_are_the_softmax_at_the_settings_temperature(temperature):
    """``fixmatch_pseudo_labels``: the top probability and argmax of ``softmax(weak_logits / T)`` with
    ``T = FixMatchSettings.temperature`` (kekmodel train.py L368, the authors' fixmatch_LPA3.py L465); the
    confidences the 0.95 mask and the 0.9 second threshold read are those at ``T``, not at 1."""
    module = UserFixMatch(num_unlabeled=10)
    module.lpa3_settings = replace(module.lpa3_settings, temperature=temperature)
    logits = torch.tensor([[2.0, 0.5, -1.0], [0.2, 0.1, 0.4], [-3.0, 1.0, 1.5], [4.0, 0.0, 0.0]])
    confidence, pseudo = module.fixmatch_pseudo_labels(logits)
    expected = torch.exp(logits / temperature) / torch.exp(logits / temperature).sum(1, keepdim=True)
    torch.testing.assert_close(confidence, expected.max(1).values, atol=1e-6, rtol=1e-6)
    assert pseudo.tolist() == [0, 2, 2, 0]
    at_1 = torch.softmax(logits, 1).max(1).values
    assert float((confidence - at_1).abs().min()) > 0.02, (confidence.tolist(), at_1.tolist())


def test_a_batch_of_another_layout_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="SemiSupervisedDataModule"):
        split_semi_supervised_batch((torch.zeros(2, 1), torch.zeros(2), torch.arange(2)))


def test_a_labeled_batch_without_its_index_is_named_as_the_labeled_part():
    unlabeled = (torch.zeros(2, 1), torch.zeros(2, 1), torch.arange(2))
    with pytest.raises(ValueError, match=r"labeled.*\(x, y\).*needs \(x, y, index\).*LabeledDataset") as info:
        split_semi_supervised_batch({"labeled": (torch.zeros(2, 1), torch.zeros(2)), "unlabeled": unlabeled})
    assert "unlabeled dataset" not in str(info.value)
    with pytest.raises(ValueError, match=r"unlabeled.*needs \(x_weak, x_strong, index\).*UnlabeledDataset"):
        split_semi_supervised_batch({"labeled": (torch.zeros(2, 1), torch.zeros(2), torch.arange(2)),
                                     "unlabeled": unlabeled[:2]})


# ------------------------------------------------------------------ a fit with the callback
def test_user_fixmatch_module_fits_with_the_callback_and_forwards_the_joint_batch_once_a_step(tmp_path):
    """With the callback as without it, one forward of FixMatch's joint batch a step, the reference's: the
    request's pseudo-labels come from the forward the loss trains (made at the request, kept for the step)."""
    joint_forwards: dict[str, int] = {}
    steps: list[int] = []

    class CountsJointForwards(pl.Callback):
        def __init__(self, name: str) -> None:
            self.name = name

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            rows = batch["labeled"][0].shape[0] + 2 * batch["unlabeled"][0].shape[0]
            steps.append(0)

            def hook(_module, inputs, _output):
                if inputs[0].shape[0] == rows:
                    joint_forwards[self.name] = joint_forwards.get(self.name, 0) + 1

            self.handle = pl_module.net.register_forward_hook(hook)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.handle.remove()

    for name in ("plain", "lpa3", "lpa3_unshared"):
        pl.seed_everything(0)
        module = UserFixMatch(num_unlabeled=64, loss_warmup=1, confidence=0.4)
        if name == "lpa3_unshared":  # share_forward=False: the request forwards once more, without gradient
            module.lpa3_settings = replace(module.lpa3_settings, share_forward=False)
        callback = LPA3Callback(ratio=0.5, sigma=0.02, steps=2, seed=0, input_range=None)
        # the counter runs first: its hook sees the callback's request forward too
        trainer = _trainer(tmp_path, [CountsJointForwards(name), *([callback] if name != "plain" else [])],
                           max_epochs=2)
        trainer.fit(module, _loaders())
    assert len(steps) == 24
    # the solver's forwards take the selected weak rows only; unshared, the 4 steps of the epoch that trains x'
    # (after the loss warm-up) forward the joint batch twice
    assert joint_forwards == {"plain": 8, "lpa3": 8, "lpa3_unshared": 12}
    tcs = callback.runner().tcs
    assert tcs is not None and tcs.num_samples == 64 and bool(tcs.seen.all())  # TCS over the unlabeled set
    assert sum(p["num_augmented"] for p in module.parts) > 0
    assert "lpa3/label_preserved_epoch" in trainer.callback_metrics


def test_the_shared_forward_serves_only_its_own_step_and_only_a_forward_with_gradient():
    """The request's kept forward is taken by the loss of the same step and batch; a forward without gradient
    (a diagnostic) neither takes nor drops it; a kept forward of another step is not reused."""
    module = UserFixMatch(num_unlabeled=16)
    weak = torch.randn(4, 1, 4, 4)
    batch = {"labeled": (torch.randn(2, 1, 4, 4), torch.tensor([0, 1]), torch.arange(2)),
             "unlabeled": (weak, weak + 0.1, torch.arange(4))}
    kept = tuple(torch.full((n, 3), 7.0) for n in (2, 4, 4))
    module._fixmatch_shared = (weak, 0, kept)
    with torch.no_grad():
        fresh = module.fixmatch_forward(batch)
    assert not torch.equal(fresh[1], kept[1]) and module._fixmatch_shared is not None
    assert module.fixmatch_forward(batch)[1] is kept[1] and module._fixmatch_shared is None
    module._fixmatch_shared = (weak, 5, kept)  # made at another step: the loss forwards again
    assert module.fixmatch_forward(batch)[1] is not kept[1] and module._fixmatch_shared is None


def test_the_forward_is_shared_by_the_strategys_exact_type_not_a_subclass_of_ddp():
    """One device shares; a strategy that subclasses DDPStrategy (as DeepSpeedStrategy does) does not, though
    isinstance would call it DDP; FSDP does not; share_forward=False never does."""
    from types import SimpleNamespace

    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, SingleDeviceStrategy

    class LikeDeepSpeed(DDPStrategy):  # (DeepSpeedStrategy needs deepspeed installed; its base is the point)
        pass

    module = UserFixMatch(num_unlabeled=16)
    shares = {}
    for name, strategy in (("single", SingleDeviceStrategy(torch.device("cpu"))), ("like_deepspeed", LikeDeepSpeed()),
                           ("fsdp", FSDPStrategy())):
        module._trainer = SimpleNamespace(strategy=strategy)
        shares[name] = module._fixmatch_shares_forward()
    assert shares == {"single": True, "like_deepspeed": False, "fsdp": False}
    module.lpa3_settings = replace(module.lpa3_settings, share_forward=False)
    module._trainer = SimpleNamespace(strategy=SingleDeviceStrategy(torch.device("cpu")))
    assert module._fixmatch_shares_forward() is False


def test_without_the_callback_it_is_plain_fixmatch(tmp_path):
    pl.seed_everything(0)
    module = UserFixMatch(num_unlabeled=64)
    _trainer(tmp_path, [], max_epochs=1).fit(module, _loaders())
    assert all(p["num_augmented"] == 0 for p in module.parts)
    assert all(torch.isfinite(torch.tensor(p["loss_unlabeled"])) for p in module.parts)


def test_a_cached_x_prime_is_reused_only_for_its_pseudo_label(tmp_path):
    """Pseudo-labels change between epochs: a cached x' solved for another label is solved again."""
    rows: list[tuple[int, int, int, torch.Tensor, bool]] = []  # (epoch, index, label, x', solved now)

    class Recording(LPA3Callback):
        def on_augmented(self, trainer, pl_module, augmented):
            for i, label, x, cached in zip(augmented.indices.tolist(), augmented.targets.tolist(), augmented.inputs,
                                           augmented.from_cache.tolist()):
                rows.append((trainer.current_epoch, i, label, x.clone(), not cached))

    pl.seed_everything(0)
    module = UserFixMatch(num_unlabeled=64, confidence=0.4)
    callback = Recording(ratio=1.0, steps=1, seed=0, input_range=None, cache={"regenerate_every_n_epochs": 3})
    _trainer(tmp_path, [callback], max_epochs=2).fit(module, _loaders())
    first = {i: (label, x) for epoch, i, label, x, _ in rows if epoch == 0}
    kept = changed = 0
    for epoch, i, label, x, solved in rows:
        if epoch != 1 or i not in first:
            continue
        label0, x0 = first[i]
        if label == label0:  # the same pseudo-label: the cached x' is reused as it was
            assert not solved and torch.equal(x, x0), i
            kept += 1
        else:  # another pseudo-label: solved again, for it
            assert solved and not torch.equal(x, x0), i
            changed += 1
    assert kept > 0 and changed > 0
    last = {i: label for _, i, label, _, solved in rows if solved}  # the cache remembers the last label solved
    assert all(int(callback.runner().store.labels[i]) == label for i, label in last.items())


def test_labels_out_of_range_are_refused_by_name():
    module = UserFixMatch(num_unlabeled=10)
    batch = _tiny_batch()
    batch["labeled"] = (batch["labeled"][0], torch.tensor([0, 7]), batch["labeled"][2])
    with pytest.raises(ValueError, match="Labels out of range"):
        module.fixmatch_loss(batch)


def test_bf16_mixed_fit_keeps_the_pseudo_label_as_trained(tmp_path):
    pl.seed_everything(0)
    module = UserFixMatch(num_unlabeled=64, confidence=0.4)
    callback = LPA3Callback(ratio=0.5, sigma=0.02, steps=2, seed=0, input_range=None)
    trainer = _trainer(tmp_path, [callback], max_epochs=2, precision="bf16-mixed")
    trainer.fit(module, _loaders())
    # measured on the logits the loss used (the independent re-check of this measure:
    # tests/test_label_preserved_as_trained.py)
    assert float(trainer.callback_metrics["lpa3/label_preserved_epoch"]) >= 0.99
    assert all(torch.isfinite(p).all() for p in module.parameters())


# ------------------------------------------------------------------ solving only the x' the loss weighs
def test_skipped_rows_count_in_the_lpa3_term_as_zero_weighted_x_prime():
    """A selected row left unsolved (train_mask) weighs as the authors' zeroed x' would: in the denominator."""
    from lpa3_lightning.core.forward_modes import running_statistics

    module = UserFixMatch(num_unlabeled=10)
    module.eval()
    batch = _tiny_batch()
    probs = torch.tensor([[0.97, 0.02, 0.01], [0.05, 0.89, 0.06], [0.25, 0.25, 0.5], [0.02, 0.02, 0.96]])
    x_adv = torch.randn(3, 1, 28, 28, generator=torch.Generator().manual_seed(1))
    statistics = running_statistics(module.net)
    every_selected = handed_over(module, x_adv, torch.tensor([0, 1, 2]), torch.tensor([5, 6, 8]),
                                 torch.tensor([True, True, False, True]), statistics=statistics)
    # the same selection with row 6 (confidence 0.89 < 0.9) left unsolved
    trained_only = handed_over(module, x_adv[[0, 2]], torch.tensor([0, 2]), torch.tensor([5, 8]),
                               torch.tensor([True, False, False, True]), statistics=statistics, skipped=1)
    parts = {}
    for name, augmented in (("every", every_selected), ("trained", trained_only)):
        _given_pseudo_labels(module, probs)
        module.lpa3_set_augmented(augmented)
        parts[name] = module.fixmatch_loss(batch)[1]
    with torch.no_grad():
        ce = F.cross_entropy(module.net(x_adv), every_selected.targets, reduction="none")
    torch.testing.assert_close(parts["every"]["loss_lpa3"], (ce[0] + ce[2]) / 3, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(parts["trained"]["loss_lpa3"], parts["every"]["loss_lpa3"], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(parts["trained"]["lpa3_kept_rate"], parts["every"]["lpa3_kept_rate"])


def test_the_request_marks_the_rows_the_loss_will_train():
    module = UserFixMatch(num_unlabeled=10, loss_warmup=1)
    batch = _tiny_batch()
    probs = torch.tensor([[0.97, 0.02, 0.01], [0.05, 0.89, 0.06], [0.25, 0.25, 0.5], [0.02, 0.02, 0.96]])

    class FakeTrainer:
        current_epoch = 0

    module._trainer = FakeTrainer()  # type: ignore[assignment]
    _given_pseudo_labels(module, probs)
    assert module.lpa3_request(batch).train_mask.tolist() == [False] * 4  # the LP-A3 term is still warming up
    FakeTrainer.current_epoch = 1
    assert module.lpa3_request(batch).train_mask.tolist() == [True, False, False, True]  # confidence >= 0.9
    module.lpa3_settings = replace(module.lpa3_settings, solve_trained_only=False)
    assert module.lpa3_request(batch).train_mask is None  # the authors' cost: every selected row solved


def _deterministic_solver(calls: list[int]):
    """A stand-in for the solver whose x' depends on each row alone (no noise draw), counting rows."""
    from lpa3_lightning.core.solver import AttackStats

    def solve(features, x, *args, **kwargs):
        calls.append(int(x.shape[0]))
        x_adv = x + 0.1 * torch.tanh(3 * x)
        zeros = torch.zeros(x.shape[0])
        return x_adv, AttackStats(zeros, zeros, zeros.bool(), zeros.bool(), zeros)

    return solve


@pytest.mark.parametrize("train_forward, cache", [("verified", False), ("batch_stats", False), ("verified", True)],
                         ids=["default", "authors_forward", "cache"])
def test_solving_only_the_trained_rows_gives_the_authors_loss_with_fewer_solves(tmp_path, monkeypatch, train_forward,
                                                                                cache):
    """The same fit twice, the solver made row-deterministic: step by step the same LP-A3 term
    (twin statistics from every selected clean row, the skipped rows in the denominator), fewer
    rows solved; under the authors' batch-statistics forward or with a cache, where skipping would
    change the loss, every selected row is solved."""
    runs = {}
    for solve_trained_only in (False, True):
        calls: list[int] = []
        monkeypatch.setattr("lpa3_lightning.callback.hard_positives.solve", _deterministic_solver(calls))
        pl.seed_everything(0)
        # some rows pass, some do not; with a cache no loss warm-up (an x' cached in it would be
        # reused after it, which the run that does not solve in the warm-up cannot do)
        module = UserFixMatch(num_unlabeled=64, loss_warmup=0 if cache else 1, confidence=0.7)
        module.lpa3_settings = replace(module.lpa3_settings, solve_trained_only=solve_trained_only,
                                       train_forward=train_forward)
        callback = LPA3Callback(ratio=1.0, steps=2, seed=0, input_range=None,
                                cache={"regenerate_every_n_epochs": 2, "attack_new_selections": False} if cache else None)
        _trainer(tmp_path, [callback], max_epochs=3).fit(module, _loaders())
        runs[solve_trained_only] = (module.parts, calls)
    (authors, authors_calls), (trained, trained_calls) = runs[False], runs[True]
    assert len(authors) == len(trained) == 12
    for a, t in zip(authors, trained):
        assert t["loss_lpa3"] == pytest.approx(a["loss_lpa3"], rel=1e-4, abs=1e-6)
        assert t["lpa3_kept_rate"] == pytest.approx(a["lpa3_kept_rate"], rel=1e-5, abs=1e-6)
    assert any(a["loss_lpa3"] > 0 for a in authors)  # the term trained
    assert any(0 < a["lpa3_kept_rate"] < 1 for a in authors)  # and some selected rows were below the threshold
    if train_forward == "verified" and not cache:
        # the authors solve in epoch 0 (the loss warm-up) too, and rows the loss ignores after it
        assert sum(trained_calls) < sum(authors_calls)
    elif cache:
        assert trained_calls == authors_calls
    else:
        # every selected row is solved, but not in the loss warm-up (epoch 0, 4 steps of one solve
        # each at ratio 1), where the module says it trains no x' (lpa3_consumes_augmented)
        assert trained_calls == authors_calls[4:] and len(authors_calls) == 12


def test_a_train_mask_of_the_wrong_kind_is_refused_by_name(tmp_path):
    class BadMask(UserFixMatch):
        def lpa3_request(self, batch):
            request = super().lpa3_request(batch)
            request.train_mask = request.train_mask.float() if request.train_mask is not None else None
            return request

    pl.seed_everything(0)
    module = BadMask(num_unlabeled=64)
    with pytest.raises(ValueError, match="train_mask must be a bool tensor"):
        _trainer(tmp_path, [LPA3Callback(ratio=0.5, steps=1, seed=0, input_range=None)], max_epochs=2).fit(
            module, _loaders())


class ReportingFixMatch(UserFixMatch):
    """Reads the epoch's pseudo-label classes at each epoch's end, as the ready module does."""

    def on_train_epoch_end(self) -> None:
        self.reports = [*getattr(self, "reports", []), self.fixmatch_pseudo_label_report()]


def test_pseudo_labels_collapsed_onto_one_class_are_logged_and_warned_about(tmp_path):
    """A network that answers class 1 with certainty for every unlabeled image, while the labeled batches
    hold all three classes: the loss reports a top-class share of 1 each step, the epoch's report too,
    and it warns, naming the cause to look for and the logged key."""
    pl.seed_everything(0)
    module = ReportingFixMatch(num_unlabeled=64)
    with torch.no_grad():
        module.net[-1].weight.zero_()
        module.net[-1].bias.copy_(torch.tensor([0.0, 20.0, 0.0]))
    module.configure_optimizers = lambda: torch.optim.SGD(module.parameters(), lr=0.0)  # type: ignore[method-assign]
    with pytest.warns(UserWarning, match=r"FixMatch: 100% of this epoch's 64 confident pseudo-labels are class 1, "
                                         r"while the labeled set holds 3 classes.*weak view forwarded apart.*"
                                         r"fixmatch/pseudo_label_top_class_share"):
        _trainer(tmp_path, [], max_epochs=2).fit(module, _loaders())
    assert all(p["pseudo_label_top_class_share"] == 1.0 for p in module.parts)
    assert module.reports == [{"fixmatch/pseudo_label_top_class_share": 1.0}] * 2


def test_varied_pseudo_labels_give_no_collapse_warning(tmp_path):
    """An oracle-like network: each class's images are brighter by one step, and the head reads the mean."""
    import warnings

    pl.seed_everything(0)
    module = ReportingFixMatch(num_unlabeled=64)
    with torch.no_grad():  # indexed_images: class c has mean brightness c - 1
        module.net = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(1, NUM_CLASSES))
        module.net[-1].weight.copy_(torch.tensor([[-40.0], [0.0], [40.0]]))
        module.net[-1].bias.copy_(torch.tensor([-20.0, 0.0, -20.0]))
    module.configure_optimizers = lambda: torch.optim.SGD(module.parameters(), lr=0.0)  # type: ignore[method-assign]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _trainer(tmp_path, [], max_epochs=2).fit(module, _loaders())
    assert not [w for w in caught if "confident pseudo-labels are class" in str(w.message)]
    shares = [r["fixmatch/pseudo_label_top_class_share"] for r in module.reports]
    assert len(shares) == 2 and all(s < 0.6 for s in shares), shares  # three classes, each about a third


def test_under_bf16_mixed_the_requests_forward_is_the_training_forward(tmp_path):
    """The callback asks for the pseudo-labels in on_train_batch_start, outside the autocast Lightning puts
    around training_step: the request's joint forward, which the step then trains, runs in the run's precision
    (bfloat16 logits), once a step; the x' get the pseudo-labels of that forward."""
    pl.seed_everything(0)
    module = UserFixMatch(num_unlabeled=64, loss_warmup=0, confidence=0.4)
    rows = 4 + 2 * 16  # _loaders: 4 labeled + 16 weak + 16 strong
    outputs: list[torch.Tensor] = []
    module.net.register_forward_hook(
        lambda _m, inputs, out: outputs.append(out.detach()) if inputs[0].shape[0] == rows else None)
    handed: list[tuple[torch.Tensor, torch.Tensor]] = []

    class Handed(LPA3Callback):
        def on_augmented(self, trainer, pl_module, augmented):
            handed.append((augmented.positions(), augmented.targets.clone()))

    callback = Handed(ratio=0.5, sigma=0.02, steps=1, seed=0, input_range=None)
    _trainer(tmp_path, [callback], max_epochs=1, precision="bf16-mixed", limit_train_batches=3).fit(module, _loaders())
    assert len(outputs) == 3 and all(out.dtype == torch.bfloat16 for out in outputs)  # one a step, in bfloat16
    for out, (positions, targets) in zip(outputs, handed):
        weak = out[4:4 + 16].float()  # (the joint batch: labeled, weak, strong)
        assert torch.equal(weak.argmax(1).index_select(0, positions), targets)


def test_outside_a_fit_the_request_always_gives_the_pseudo_labels():
    """The warm-up's shortcut (no forward, label 0) is for the callback inside a fit only: a request made
    by hand, e.g. to look at the pseudo-labels, gets them."""
    module = UserFixMatch(num_unlabeled=10, loss_warmup=5)  # the LP-A3 term still warming up at epoch 0
    probs = torch.tensor([[0.1, 0.8, 0.1], [0.7, 0.2, 0.1], [0.1, 0.1, 0.8], [0.2, 0.7, 0.1]])
    _given_pseudo_labels(module, probs)
    assert module.lpa3_request(_tiny_batch()).targets.tolist() == [1, 0, 2, 1]
