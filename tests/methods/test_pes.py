"""PES + LP-A3: phases, the agreement split, the loss terms, and fits of the ready module with the callback."""

from __future__ import annotations

import copy
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lpa3_lightning import LPA3Callback, PESClassifier
from lpa3_lightning.methods.mixmatch import mixup, mixup_lambda, probability_mse, sharpen, soft_cross_entropy
from lpa3_lightning.mixins import PESSettings, split_two_view_batch
from tests.helpers import handed_over, independent_logp_drop, indexed_images

NUM_CLASSES = 3


def _net() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, NUM_CLASSES))


class NoisyTwoViews(Dataset):
    """Synthetic images with a third of the labels moved to the next class; two noisy views each."""

    def __init__(self, n: int = 48) -> None:
        self.data = indexed_images(n)
        self.clean = torch.stack([self.data[i][1] for i in range(n)])
        self.noisy = self.clean.clone()
        self.noisy[::3] = (self.noisy[::3] + 1) % NUM_CLASSES

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int):
        x, _, idx = self.data[i]
        g = torch.Generator().manual_seed(i * 7 + int(torch.randint(0, 1000, ())))
        return x + 0.05 * torch.randn(x.shape, generator=g), x + 0.05 * torch.randn(x.shape, generator=g), \
            self.noisy[i], idx


class Recording(PESClassifier):
    """Records, before each optimizer step, what an independent check of x' needs."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.records: list[dict[str, Any]] = []
        self.parts: list[dict[str, float]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        augmented = self._lpa3_slot("augmented", None)
        if augmented is not None and len(augmented) and augmented.verified.reference_inputs is not None:
            self.records.append({"model": copy.deepcopy(self.model), "x": augmented.verified.reference_inputs.clone(),
                                 "x_adv": augmented.inputs.clone(), "y": augmented.targets.clone()})
        loss = super().training_step(batch, batch_idx)
        self.parts.append({k: float(v) for k, v in self.trainer.callback_metrics.items() if k.startswith("train/")})
        return loss


def _fit(module: PESClassifier, epochs: int, callback: LPA3Callback | None = None, tmp_path=None) -> pl.Trainer:
    trainer = pl.Trainer(max_epochs=epochs, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                         callbacks=[callback] if callback is not None else [], num_sanity_val_steps=0)
    trainer.fit(module, DataLoader(NoisyTwoViews(), batch_size=16, shuffle=True))
    return trainer


def test_phases_and_the_refine_phase_reinitialises_the_head_in_place():
    module = PESClassifier(num_classes=NUM_CLASSES, num_samples=48, model=_net(),
                           pes=PESSettings(early_epochs=2, refine_epochs=1))
    assert [module.pes_phase(e) for e in range(5)] == ["early", "early", "refine", "semi", "semi"]
    head = module.pes_head()
    before = head.weight.detach().clone()
    weight_object = head.weight
    module.pes_begin_epoch(1, loader=[])  # not yet
    assert torch.equal(head.weight, before)
    torch.manual_seed(3)
    module.pes_begin_epoch(2, loader=[])
    assert head.weight is weight_object and not torch.equal(head.weight.detach(), before)


def test_the_split_marks_samples_whose_noisy_label_the_model_predicts_on_both_views_on_average():
    module = PESClassifier(num_classes=NUM_CLASSES, num_samples=48, model=_net(), twin_bn=False)
    data = NoisyTwoViews()
    loader = DataLoader(data, batch_size=10, shuffle=True)
    torch.manual_seed(0)
    labeled = module.pes_refresh_split(loader)
    # independent: eval-mode predictions of the same views (seeded the same way by the dataset)
    torch.manual_seed(0)
    expected = torch.zeros(48, dtype=torch.bool)
    model = copy.deepcopy(module.model).eval()
    with torch.no_grad():
        for x1, x2, y, idx in loader:
            probs = (torch.softmax(model(x1), 1) + torch.softmax(model(x2), 1)) / 2
            expected[idx] = probs.argmax(1) == y
    assert torch.equal(labeled.cpu(), expected)
    counts = torch.bincount(data.noisy[expected], minlength=NUM_CLASSES).float()
    present = counts > 0
    weights = torch.zeros(NUM_CLASSES)
    weights[present] = (counts[present].mean() / counts[present]).clamp(max=3.0)
    assert torch.allclose(module._pes_class_weights, weights)


def test_a_split_loader_that_leaves_samples_out_is_refused_with_the_fix():
    """A row the split never saw would be trained as unlabeled without a word (e.g. the training
    loader's dropped last batch, or the balanced sampler, which skips rows)."""
    module = PESClassifier(num_classes=NUM_CLASSES, num_samples=48, model=_net(), twin_bn=False)
    with pytest.raises(ValueError, match="left 8 training samples out.*whole training set"):
        module.pes_refresh_split(DataLoader(NoisyTwoViews(), batch_size=10, drop_last=True))  # 40 of 48


def test_lambda_u_zero_with_the_callback_is_refused_at_fit_start(tmp_path):
    module = PESClassifier(num_classes=NUM_CLASSES, num_samples=48, model=_net(),
                           pes=PESSettings(early_epochs=1, refine_epochs=0, lambda_u=0.0))
    with pytest.raises(ValueError, match="lambda_u=0"):
        _fit(module, 1, LPA3Callback(steps=1, warmup_epochs=1), tmp_path)


def test_loss_terms_in_the_early_and_semi_phases():
    torch.manual_seed(0)
    module = PESClassifier(num_classes=NUM_CLASSES, num_samples=48, model=_net(), twin_bn=False,
                           pes=PESSettings(early_epochs=1, refine_epochs=0, lambda_u=10.0, rampup_epochs=4))
    batch = next(iter(DataLoader(NoisyTwoViews(), batch_size=24)))
    x1, x2, y, idx = batch
    loss, parts = module.pes_loss(batch)  # epoch 0: early
    assert torch.allclose(loss, F.cross_entropy(module.model(x1), y))
    # semi phase at epoch 1 + 2/4 of an epoch: ramp = 10 * clip((1.5 - 1) / 4) = 1.25
    module.pes_current_epoch = lambda: 1  # type: ignore[method-assign]
    labeled = torch.zeros(48, dtype=torch.bool)
    labeled[idx[:10]] = True
    module._pes_labeled, module._pes_class_weights = labeled, torch.tensor([1.0, 2.0, 0.5])
    torch.manual_seed(5)
    loss, parts = module.pes_loss(batch, batch_idx=2, batches_per_epoch=4)
    # independent recomputation with the same random draws (lam first, then the permutation)
    torch.manual_seed(5)
    model = module.model
    lab = labeled[idx]
    with torch.no_grad():
        probs = torch.softmax(model(torch.cat([x1[~lab], x2[~lab]])), 1)
    n_u = int((~lab).sum())
    guess = sharpen((probs[:n_u] + probs[n_u:]) / 2, 0.5)
    one_hot = F.one_hot(y[lab], NUM_CLASSES).float()
    inputs = torch.cat([x1[lab], x2[lab], x1[~lab], x2[~lab]])
    targets = torch.cat([one_hot, one_hot, guess, guess])
    lam = mixup_lambda(4.0)
    mixed_x, mixed_t = mixup(inputs, targets, lam, torch.randperm(inputs.shape[0]))
    logits = model(mixed_x)
    lx = soft_cross_entropy(logits[:20], mixed_t[:20], torch.tensor([1.0, 2.0, 0.5]))
    lu = probability_mse(logits[20:], mixed_t[20:])
    assert abs(float(parts["unlabeled_weight"]) - 1.25) < 1e-6
    assert torch.allclose(loss, lx + 1.25 * lu, atol=1e-5)
    assert float(parts["labeled_share"]) == pytest.approx(10 / 24)


def test_the_ramp_up_reads_the_trainers_batches_per_epoch_when_not_given():
    """A module that calls pes_loss(batch, batch_idx) under a trainer ramps per step, not per batch."""
    module, batch = _semi_phase_module_and_batch()
    module.lpa3_settings = replace(module.lpa3_settings, lambda_u=10.0, rampup_epochs=4)
    torch.manual_seed(5)
    _, explicit = module.pes_loss(batch, batch_idx=2, batches_per_epoch=8)
    module._trainer = SimpleNamespace(num_training_batches=8)  # what Lightning attaches
    torch.manual_seed(5)
    _, read = module.pes_loss(batch, batch_idx=2)
    assert float(read["unlabeled_weight"]) == pytest.approx(10 * (1 + 2 / 8 - 1) / 4)
    assert float(read["unlabeled_weight"]) == float(explicit["unlabeled_weight"])
    module._trainer = None  # unattached: one batch an epoch, as before
    torch.manual_seed(5)
    _, alone = module.pes_loss(batch, batch_idx=2)
    assert float(alone["unlabeled_weight"]) == pytest.approx(10 * min(1.0, (1 + 2 - 1) / 4))


def _semi_phase_module_and_batch() -> tuple[PESClassifier, list]:
    """A PES module in its semi phase (epoch 1) on a 24-row batch whose first 10 rows are labeled."""
    torch.manual_seed(0)
    module = PESClassifier(num_classes=NUM_CLASSES, num_samples=48, model=_net(), twin_bn=False,
                           pes=PESSettings(early_epochs=1, refine_epochs=0))
    module.pes_current_epoch = lambda: 1  # type: ignore[method-assign]
    batch = next(iter(DataLoader(NoisyTwoViews(), batch_size=24)))
    labeled = torch.zeros(48, dtype=torch.bool)
    labeled[batch[3][:10]] = True
    module._pes_labeled, module._pes_class_weights = labeled, torch.ones(NUM_CLASSES)
    return module, batch


@pytest.mark.parametrize("threshold", [False, True])
def test_the_request_holds_the_unlabeled_rows_whose_guess_is_sure_enough(threshold):
    module, batch = _semi_phase_module_and_batch()
    x1, x2, _, idx = batch
    # independently: the sharpened mean of both views' predictions, the unlabeled rows only
    with torch.no_grad():  # one forward of both views (train-mode BatchNorm: batch statistics of the 28 rows)
        p1, p2 = torch.softmax(module.model(torch.cat([x1[10:], x2[10:]])), 1).chunk(2)
    guess = sharpen((p1 + p2) / 2, 0.5)
    sure = guess.max(1).values
    keep = torch.ones(14, dtype=torch.bool)
    if threshold:  # a threshold between the guesses' confidences, so that it bites
        module.lpa3_settings = replace(module.lpa3_settings, lpa3_confidence=float(sure.median()))
        keep = sure >= module.lpa3_settings.lpa3_confidence
        assert 0 < int(keep.sum()) < 14
    request = module.lpa3_request(batch)
    assert torch.equal(request.indices, idx[10:][keep]) and torch.equal(request.targets, guess.argmax(1)[keep])
    assert torch.equal(request.inputs, x1[10:][keep])


def test_with_a_confidence_each_x_prime_is_trained_against_its_own_rows_guess(monkeypatch):
    import lpa3_lightning.methods.pes as pes_module
    from lpa3_lightning.methods.base import AugmentedBatch

    module, batch = _semi_phase_module_and_batch()
    guess = module.pes_guess(batch).clone()  # the step's guess (forwarded once, reused by the loss)
    sure = guess.max(1).values
    module.lpa3_settings = replace(module.lpa3_settings, lpa3_confidence=float(sure.median()))
    request = module.lpa3_request(batch)
    mask = torch.zeros(len(request.indices), dtype=torch.bool)
    mask[1::2] = True  # the callback picked every other offered row
    module.lpa3_set_augmented(AugmentedBatch(inputs=request.inputs[mask], targets=request.targets[mask],
                                             indices=request.indices[mask], mask=mask))
    seen = {}

    def capture(module_, augmented, target_adv, *args, **kwargs):
        seen["target"] = target_adv
        return torch.zeros(())

    monkeypatch.setattr(pes_module, "augmented_mixmatch_loss", capture)
    module.pes_loss(batch)
    offered = sure >= module.lpa3_settings.lpa3_confidence
    assert torch.equal(seen["target"].argmax(1), request.targets[mask])  # each x' with the label it kept
    assert torch.equal(seen["target"], guess[offered][mask])


def test_a_confidence_outside_0_1_is_refused():
    with pytest.raises(ValueError, match=r"`pes.lpa3_confidence` must be None or a number in \(0, 1\], got 1.5"):
        PESSettings(lpa3_confidence=1.5)
    with pytest.raises(ValueError, match="`pes.lpa3_confidence`"):  # a mapping is built into the same dataclass
        PESClassifier(num_classes=NUM_CLASSES, num_samples=48, pes={"lpa3_confidence": 1.5})


def test_a_batch_of_another_layout_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="NoisyLabelDataModule"):
        split_two_view_batch((torch.zeros(2, 1, 4, 4), torch.zeros(2)))


@pytest.mark.parametrize("mixed", [True, False])
def test_ready_module_fits_with_the_callback_and_x_prime_keeps_its_guessed_label_as_trained(mixed, tmp_path):
    pl.seed_everything(0)
    module = Recording(num_classes=NUM_CLASSES, num_samples=48, model=_net(),
                       pes=PESSettings(early_epochs=2, refine_epochs=1, lambda_u=5.0, rampup_epochs=1,
                                       lpa3_mixup=mixed))
    callback = LPA3Callback(ratio=0.9, sigma=0.02, steps=2, warmup_epochs=3, seed=0)
    trainer = _fit(module, epochs=5, callback=callback, tmp_path=tmp_path)
    semi = [p for p in module.parts if p.get("train/unlabeled_weight", 0.0) > 0]
    assert semi and sum(p["train/num_augmented"] for p in semi) > 0
    assert any(p["train/loss_lpa3"] > 0 for p in semi)
    # independent re-check of the constraint in the forward that trains the unmixed x'
    assert module.records
    kept = total = 0
    for r in module.records:
        drop = independent_logp_drop(r["model"], r["x"], r["x_adv"], r["y"], twin_bn=True)
        kept += int((drop <= 0.02 + 1e-5).sum())
        total += drop.numel()
    assert kept == total
    assert float(trainer.callback_metrics["lpa3/label_preserved_epoch"]) == pytest.approx(1.0)
    assert "val/acc" not in trainer.callback_metrics  # no val loader given


def test_without_the_callback_it_is_plain_pes_and_the_split_is_in_the_checkpoint(tmp_path):
    pl.seed_everything(0)
    module = PESClassifier(num_classes=NUM_CLASSES, num_samples=48, model=_net(),
                           pes=PESSettings(early_epochs=1, refine_epochs=1))
    trainer = pl.Trainer(max_epochs=3, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=tmp_path, num_sanity_val_steps=0)
    data = DataLoader(NoisyTwoViews(), batch_size=16, shuffle=True)
    val = DataLoader(indexed_images(12), batch_size=12)
    trainer.fit(module, data, val)
    x, y, _ = next(iter(val))  # the logged accuracy against the final weights' own
    module.eval()
    with torch.no_grad():
        accuracy = float((module(x).argmax(1) == y).float().mean())
    assert float(trainer.callback_metrics["val/acc"]) == pytest.approx(accuracy)
    assert float(trainer.callback_metrics["train/loss_lpa3"]) == 0.0
    path = tmp_path / "pes.ckpt"
    trainer.save_checkpoint(path)
    restored = PESClassifier.load_from_checkpoint(path, model=_net())
    assert torch.equal(restored._pes_labeled, module._pes_labeled.cpu())
    assert restored.lpa3_settings == module.lpa3_settings  # rebuilt from the hyper-parameters' mapping


class PlainTwoViews(Dataset):
    """Noise-free views (view1 = view2 = x), so the split can be recomputed exactly."""

    def __init__(self, n: int = 48) -> None:
        self.inner = NoisyTwoViews(n)

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int):
        x, _, idx = self.inner.data[i]
        return x, x.clone(), self.inner.noisy[i], idx


class EpochStartSnapshot(pl.Callback):
    """The model as it is at the start of each epoch (callbacks run before the module's hook)."""

    def __init__(self) -> None:
        self.models: dict[int, nn.Module] = {}
        self.lrs: dict[int, float] = {}

    def on_train_epoch_start(self, trainer, pl_module):
        self.models[trainer.current_epoch] = copy.deepcopy(pl_module.model)
        self.lrs[trainer.current_epoch] = trainer.optimizers[0].param_groups[0]["lr"]


def test_refine_changes_the_head_only_and_the_split_covers_samples_the_loader_drops(tmp_path):
    pl.seed_everything(0)
    module = PESClassifier(num_classes=NUM_CLASSES, num_samples=48, model=_net(), twin_bn=False,
                           pes=PESSettings(early_epochs=1, refine_epochs=1))
    snapshots = EpochStartSnapshot()
    trainer = pl.Trainer(max_epochs=3, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[snapshots])
    # batch 10 with drop_last: 8 of the 48 samples are left out of every training epoch
    trainer.fit(module, DataLoader(PlainTwoViews(), batch_size=10, shuffle=True, drop_last=True))
    before, after = snapshots.models[1].state_dict(), snapshots.models[2].state_dict()
    head = {"9.weight", "9.bias"}  # the nn.Linear of _net()
    for name, value in before.items():
        if name in head:
            assert not torch.equal(value, after[name]), name  # re-initialised and trained
        elif "running" not in name and "num_batches" not in name:
            assert torch.equal(value, after[name]), name  # the backbone did not move in the refine phase
    assert snapshots.lrs[1] == snapshots.lrs[2]  # the cosine schedule pauses in the refine phase
    # the split of epoch 2, recomputed from the model at the start of epoch 2 over all 48 samples
    data = PlainTwoViews()
    x = torch.stack([data[i][0] for i in range(48)])
    noisy = torch.stack([data[i][2] for i in range(48)])
    model = snapshots.models[2].eval()
    with torch.no_grad():
        expected = model(x).argmax(1) == noisy
    assert torch.equal(module._pes_labeled.cpu(), expected)


def test_the_unmixed_lpa3_term_is_the_mse_of_the_x_prime_against_their_guess():
    torch.manual_seed(0)
    module = PESClassifier(num_classes=NUM_CLASSES, num_samples=48, model=_net(), twin_bn=False,
                           pes=PESSettings(early_epochs=1, refine_epochs=0, lambda_u=2.0, rampup_epochs=1,
                                           lpa3_mixup=False))
    module.pes_current_epoch = lambda: 5  # type: ignore[method-assign]  # ramp done: weight 2
    batch = next(iter(DataLoader(PlainTwoViews(), batch_size=12)))
    x1, _, y, idx = batch
    labeled = torch.zeros(48, dtype=torch.bool)
    labeled[idx[:4]] = True
    module._pes_labeled, module._pes_class_weights = labeled, torch.ones(NUM_CLASSES)
    request = module.lpa3_request(batch)  # the unlabeled rows with their guessed label
    assert torch.equal(request.indices, idx[4:])
    mask = torch.zeros(8, dtype=torch.bool)
    mask[[1, 3, 6]] = True
    from lpa3_lightning.methods.base import AugmentedBatch
    from lpa3_lightning.core.forward_modes import running_statistics

    model = module.model
    x_adv = request.inputs[mask] + 0.01
    module.lpa3_set_augmented(handed_over(module, x_adv, request.targets[mask], request.indices[mask], mask,
                                          statistics=running_statistics(model)))
    guess = module.pes_guess(batch)[mask]
    reference = copy.deepcopy(model).eval()  # BN on the running statistics, as the eval-mode solver
    with torch.no_grad():
        expected = (torch.softmax(reference(x_adv), 1) - guess).pow(2).mean()
    torch.manual_seed(1)
    _, parts = module.pes_loss(batch, batch_idx=0, batches_per_epoch=1)
    assert torch.allclose(parts["loss_lpa3"], expected, atol=1e-6)
    assert float(parts["num_augmented"]) == 3


def test_the_callback_solves_only_in_the_epochs_the_module_trains_x_prime(monkeypatch, tmp_path):
    """PES trains x' in its semi phase only (lpa3_consumes_augmented): a callback without its own
    warm-up used to solve in the early and refine phases too, for nothing."""
    import lpa3_lightning.callback.hard_positives as hard_positives

    solved: dict[int, int] = {}
    solve = hard_positives.solve

    class Counting(LPA3Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self._epoch = trainer.current_epoch
            super().on_train_batch_start(trainer, pl_module, batch, batch_idx)

    callback = Counting(ratio=1.0, steps=1, seed=0, warmup_epochs=0)

    def counted(features, x, *args, **kwargs):
        solved[callback._epoch] = solved.get(callback._epoch, 0) + int(x.shape[0])
        return solve(features, x, *args, **kwargs)

    monkeypatch.setattr("lpa3_lightning.callback.hard_positives.solve", counted)
    pl.seed_everything(0)
    module = PESClassifier(num_classes=NUM_CLASSES, num_samples=48, model=_net(),
                           pes=PESSettings(early_epochs=1, refine_epochs=1, lambda_u=5.0, rampup_epochs=1.0))
    _fit(module, 4, callback, tmp_path)
    assert [module.lpa3_consumes_augmented(e) for e in range(4)] == [False, False, True, True]
    assert set(solved) == {2, 3} and all(n > 0 for n in solved.values())  # the semi phase only


def test_the_cache_windows_start_where_the_module_starts_training_x_prime(monkeypatch, tmp_path):
    """With K = 3 and the semi phase from epoch 2 (the callback's own warm-up 0), the solver runs in
    epochs 2 and 5: the windows count from the first epoch the module trains x' (anchored at the
    callback's warm-up they would regenerate in epoch 3, one epoch into the first window)."""
    solve = __import__("lpa3_lightning.callback.hard_positives", fromlist=["solve"]).solve
    epochs: set[int] = set()
    module = PESClassifier(num_classes=NUM_CLASSES, num_samples=48, model=_net(),
                           pes=PESSettings(early_epochs=1, refine_epochs=1, lambda_u=5.0, rampup_epochs=1.0))

    def counted(*args, **kwargs):
        epochs.add(module.trainer.current_epoch)
        return solve(*args, **kwargs)

    monkeypatch.setattr("lpa3_lightning.callback.hard_positives.solve", counted)
    pl.seed_everything(0)
    callback = LPA3Callback(ratio=1.0, steps=1, seed=0,
                            cache={"regenerate_every_n_epochs": 3, "attack_new_selections": False})
    _fit(module, 6, callback, tmp_path)
    assert epochs == {2, 5}
