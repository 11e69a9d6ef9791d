"""LPA3Callback inside a real Trainer: data path, logging, checkpointing, refusals."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lpa3_lightning.callback.hard_positives as lpa3_lightning_callback
from lpa3_lightning import LPA3Callback, TimeConsistency
from lpa3_lightning.core.dual_bn import convert_dual_bn
from lpa3_lightning.mixins import SupervisedLPA3Mixin
from tests.helpers import GlobalRandomState, indexed_images, lpa3_state, small_cnn, snapshot


class TinyClassifier(SupervisedLPA3Mixin, pl.LightningModule):
    """The supervised mixin on a small CNN; remembers what reached training_step."""

    def __init__(self, twin_bn: bool = True, num_classes: int = 3) -> None:
        super().__init__()
        self.model = small_cnn(num_classes=num_classes)
        if twin_bn:
            convert_dual_bn(self.model)
        self.lpa3_num_classes = num_classes
        self.seen_augmented: list[int] = []

    def lpa3_model(self) -> nn.Module:
        return self.model

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss, _, parts = self.lpa3_supervised_loss(batch)
        self.seen_augmented.append(int(parts["num_augmented"]))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _trainer(tmp_path, callbacks, max_epochs: int = 2, **kwargs) -> pl.Trainer:
    return pl.Trainer(
        default_root_dir=tmp_path, max_epochs=max_epochs, accelerator="cpu", devices=1, callbacks=callbacks,
        logger=pl.loggers.CSVLogger(tmp_path), enable_progress_bar=False, enable_model_summary=False,
        log_every_n_steps=1, **kwargs,
    )


def _loader(n: int = 48, batch_size: int = 16, shuffle: bool = True) -> DataLoader:
    return DataLoader(indexed_images(n), batch_size=batch_size, shuffle=shuffle)


class RecordsEvalPreservation(LPA3Callback):
    """Re-measures, for the last epoch's x', the eval-mode constraint with its own forward."""

    def on_augmented(self, trainer, pl_module, augmented):
        if trainer.current_epoch == trainer.max_epochs - 1 and len(augmented):
            model = pl_module.lpa3_model()
            was = [(m, m.training) for m in model.modules()]
            model.eval()
            with torch.no_grad():
                x = augmented.verified.reference_inputs
                clean = F.log_softmax(model(x), 1).gather(1, augmented.targets[:, None]).flatten()
                adv = F.log_softmax(model(augmented.inputs), 1).gather(1, augmented.targets[:, None]).flatten()
            for m, training in was:
                m.training = training
            self.eval_records.append((adv >= clean - self.sigma).tolist())

    eval_records: list = []


def test_fit_runs_the_whole_data_path(tmp_path):
    pl.seed_everything(0)
    module = TinyClassifier()
    callback = RecordsEvalPreservation(ratio=0.5, sigma=0.02, steps=3, seed=0)
    callback.eval_records = []
    trainer = _trainer(tmp_path, [callback], max_epochs=3)
    trainer.fit(module, _loader())

    tcs = callback.runner().tcs
    assert tcs is not None and tcs.num_samples == 48 and tcs.num_classes == 3
    assert bool(tcs.seen.all())
    assert tcs.has_threshold
    # epoch 0: no threshold yet, a random half (a lone selection in a batch waits); later by TCS
    per_epoch = [sum(module.seen_augmented[i * 3:(i + 1) * 3]) for i in range(3)]
    assert 20 <= per_epoch[0] <= 24
    assert 0 < per_epoch[2] <= 24
    metrics = trainer.callback_metrics
    for key in ("lpa3/selected_fraction_epoch", "lpa3/perceptual_distance_epoch", "lpa3/label_preserved_epoch",
                "lpa3/solver_seconds_epoch", "lpa3/projected_epoch", "lpa3/threshold"):
        assert key in metrics, key
    # measured in the training forward; tests/test_label_preserved_as_trained.py re-checks it independently
    assert 0.99 <= float(metrics["lpa3/label_preserved_epoch"]) <= 1.0
    # the deployed-model diagnostic against its definition, recomputed from the last epoch's x'
    # (eval mode, main BN): the logged epoch mean equals the share recomputed here
    kept = [bool(k) for r in callback.eval_records for k in r]
    logged = float(metrics["lpa3/label_preserved_eval_epoch"])
    # (one sample's margin may round differently in another batch composition)
    assert kept and abs(logged - sum(kept) / len(kept)) <= 1 / len(kept) + 1e-6
    assert float(metrics["lpa3/perceptual_distance_epoch"]) > 0
    # the memory holds the model's last predictions: rows are distributions
    torch.testing.assert_close(tcs.memory.sum(1), torch.ones(48))


def test_selected_fraction_follows_ratio_after_first_pass(tmp_path):
    pl.seed_everything(0)
    module = TinyClassifier()
    callback = LPA3Callback(ratio=0.25, steps=1, seed=0)
    trainer = _trainer(tmp_path, [callback], max_epochs=2)
    trainer.fit(module, _loader(64, 64))
    # round(ratio * N) least consistent samples (the authors' rule selects one fewer)
    assert module.seen_augmented[1] == 16
    module = TinyClassifier()
    callback = LPA3Callback(ratio=0.25, steps=1, seed=0,
                            selection={"threshold_rule": "authors", "initial_selection": "all"})
    _trainer(tmp_path, [callback], max_epochs=2).fit(module, _loader(64, 64))
    assert module.seen_augmented == [64, 64 - int(0.75 * 64) - 1]


def test_seed_none_without_seed_everything_takes_a_64_bit_initial_seed(tmp_path):
    """A script that never seeds has ``torch.initial_seed()`` 67280421310721; ``seed=None`` fixes the
    callback's seed from it, and the first pass's random share is drawn from that (its seed times
    1000003 overflowed the generator's 64 bits)."""
    torch.manual_seed(67280421310721)  # torch's initial seed in a process that never seeds
    module = TinyClassifier()
    callback = LPA3Callback(ratio=0.5, steps=1)
    _trainer(tmp_path, [callback], max_epochs=1).fit(module, _loader(48, 16))
    assert sum(module.seen_augmented) == 24  # the random half of the first pass


class RecordsSelections(LPA3Callback):
    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.selected: dict[int, list[int]] = {}

    def on_augmented(self, trainer, pl_module, augmented):
        self.selected.setdefault(trainer.current_epoch, []).extend(augmented.indices.tolist())


def test_random_criterion_selects_a_seeded_random_share_instead_of_the_lowest_scores(tmp_path):
    from lpa3_lightning.core.tcs import random_selection

    picks = {}
    for criterion in ("tcs", "random"):
        pl.seed_everything(0)
        callback = RecordsSelections(ratio=0.25, steps=1, seed=3, selection={"criterion": criterion})
        _trainer(tmp_path / criterion, [callback], max_epochs=3).fit(TinyClassifier(), _loader(64, 64))
        picks[criterion] = callback
    for epoch in (1, 2):  # after the first pass: a threshold exists
        chosen = sorted(picks["random"].selected[epoch])
        expected = random_selection(64, 0.25, seed=3, epoch=epoch).nonzero().squeeze(1).tolist()
        assert chosen == expected
        assert len(chosen) == len(picks["tcs"].selected[epoch]) == 16
    assert sorted(picks["tcs"].selected[2]) != sorted(picks["random"].selected[2])


def test_warmup_epochs_skip_augmentation_but_update_tcs(tmp_path):
    pl.seed_everything(0)
    module = TinyClassifier()
    callback = LPA3Callback(ratio=0.5, steps=1, warmup_epochs=1)
    trainer = _trainer(tmp_path, [callback], max_epochs=2)
    trainer.fit(module, _loader())
    assert module.seen_augmented[:3] == [0, 0, 0]
    assert sum(module.seen_augmented[3:]) > 0
    assert bool(callback.runner().tcs.seen.all())


@pytest.mark.parametrize("twin_bn", [True, False], ids=["twin", "batch_mode"])
def test_callback_never_moves_main_bn_statistics_during_the_attack(tmp_path, twin_bn):
    """The attack itself is invisible: a module whose training_step ignores x' ends bitwise
    equal to the same run without the callback, with twins and without them (``attack_bn``
    'batch': the solver normalises with the model's own BatchNorms, buffers untouched)."""

    class IgnoresAugmentation(TinyClassifier):
        def training_step(self, batch, batch_idx):
            x, y, idx = batch
            logits = self.model(x)
            self.lpa3_record_predictions(idx, logits)
            self.lpa3_take_augmented()
            return F.cross_entropy(logits, y)

    def run(with_callback: bool) -> dict[str, torch.Tensor]:
        pl.seed_everything(0)
        module = IgnoresAugmentation(twin_bn=twin_bn)
        callbacks = [LPA3Callback(ratio=1.0, steps=2, seed=0)] if with_callback else []
        pl.seed_everything(0)
        _trainer(tmp_path, callbacks, max_epochs=1, deterministic=True).fit(module, _loader(shuffle=False))
        return snapshot(module.model)

    plain, attacked = run(False), run(True)
    for key in plain:
        assert torch.equal(plain[key], attacked[key]), key


class RecordsStartState(LPA3Callback):
    """Remembers the TCS state as training (re)starts, and the x' of every batch by epoch."""

    def on_train_start(self, trainer, pl_module):
        super().on_train_start(trainer, pl_module)
        self.start_state = self.runner().tcs.state_dict()
        self.start_written = None if self.runner().store is None else self.runner().store.written.clone()
        self.x_prime: dict[int, list[torch.Tensor]] = {}

    def on_augmented(self, trainer, pl_module, augmented):
        self.x_prime.setdefault(trainer.current_epoch, []).append(augmented.inputs.clone())


def test_resume_restores_tcs_and_the_solver_noise_then_keeps_training(tmp_path):
    # a resumable loader: a plain DataLoader's order and its draw from the global generator are not
    # part of a checkpoint (tests/test_resume.py: the whole run bitwise)
    from lpa3_lightning.data import train_loader

    def loader():
        return train_loader(indexed_images(48), batch_size=16, seed=0)

    # the model has dropout: the run keeps torch's global generator itself (the callback never touches it)
    pl.seed_everything(0)
    uninterrupted = RecordsStartState(ratio=0.5, steps=1, seed=0)
    _trainer(tmp_path / "full", [uninterrupted, GlobalRandomState()], max_epochs=3,
             deterministic=True).fit(TinyClassifier(), loader())

    pl.seed_everything(0)
    callback = RecordsStartState(ratio=0.5, steps=1, seed=0)  # (the class resumed below: its checkpoint key)
    trainer = _trainer(tmp_path, [callback, GlobalRandomState()], max_epochs=2, deterministic=True)
    trainer.fit(TinyClassifier(), loader())
    ckpt = tmp_path / "epoch2.ckpt"
    trainer.save_checkpoint(ckpt)
    saved = lpa3_state(ckpt)
    torch.testing.assert_close(saved["tcs"]["memory"], callback.runner().tcs.memory)

    resumed = RecordsStartState(ratio=0.5, steps=1, seed=0)
    module2 = TinyClassifier()
    trainer2 = _trainer(tmp_path, [resumed, GlobalRandomState()], max_epochs=3, deterministic=True)
    trainer2.fit(module2, loader(), ckpt_path=ckpt)
    for key in ("memory", "scores", "seen", "threshold"):
        assert torch.equal(resumed.start_state[key], saved["tcs"][key]), key
    # the third epoch's x' (solver noise included) are the uninterrupted run's
    assert len(resumed.x_prime[2]) == len(uninterrupted.x_prime[2]) == 3
    for got, expected in zip(resumed.x_prime[2], uninterrupted.x_prime[2]):
        assert got.shape[0] > 0
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    # the third epoch ran with the restored threshold: about half selected, not everything
    assert 0 < sum(module2.seen_augmented) < 48
    assert not torch.equal(resumed.runner().tcs.scores, saved["tcs"]["scores"])


def test_attack_through_the_twin_in_a_trainer(tmp_path):
    pl.seed_everything(0)
    module = TinyClassifier()
    callback = LPA3Callback(ratio=0.5, steps=2, seed=0, solver={"attack_bn": "twin"})
    trainer = _trainer(tmp_path, [callback], max_epochs=2)
    trainer.fit(module, _loader())
    # every x' keeps its label in the forward that trains it (re-measured independently in
    # tests/test_label_preserved_as_trained.py)
    assert float(trainer.callback_metrics["lpa3/label_preserved_epoch"]) >= 0.99
    assert sum(module.seen_augmented) > 0


def test_auto_attack_mode_picks_twin_then_the_models_own_batchnorms_then_eval(tmp_path, monkeypatch):
    import lpa3_lightning.callback.hard_positives as callback_module

    seen_modes = []
    original = callback_module.solve

    def spy(*args, **kwargs):
        seen_modes.append(kwargs["bn_mode"])
        return original(*args, **kwargs)

    monkeypatch.setattr(callback_module, "solve", spy)
    for twin in (True, False):
        _trainer(tmp_path, [LPA3Callback(steps=1)], max_epochs=1, limit_train_batches=1).fit(
            TinyClassifier(twin_bn=twin), _loader())
    no_batchnorm = TinyClassifier(twin_bn=False)
    no_batchnorm.model = nn.Sequential(*[m for m in no_batchnorm.model if not isinstance(m, nn.BatchNorm2d)])
    _trainer(tmp_path, [LPA3Callback(steps=1)], max_epochs=1, limit_train_batches=1).fit(no_batchnorm, _loader())
    assert seen_modes == ["twin", "batch", "eval"]


def test_a_lone_selected_sample_is_dropped_for_batch_statistics(tmp_path):
    class BN1dClassifier(TinyClassifier):
        def __init__(self):
            super().__init__()
            self.model = convert_dual_bn(nn.Sequential(nn.Flatten(), nn.Linear(784, 16), nn.BatchNorm1d(16), nn.ReLU(),
                                                       nn.Linear(16, 3)))

    class SelectOne(LPA3Callback):
        def on_train_start(self, trainer, pl_module):
            super().on_train_start(trainer, pl_module)
            self.runner().tcs.scores[:] = 0.0
            self.runner().tcs.scores[0] = -1.0  # only sample 0 below the threshold
            self.runner().tcs.seen[:] = True
            self.runner().tcs.threshold = torch.tensor(-0.5)

    module = BN1dClassifier()
    trainer = _trainer(tmp_path, [SelectOne(steps=1)], max_epochs=1)
    trainer.fit(module, DataLoader(indexed_images(8), batch_size=8))
    assert module.seen_augmented == [0]


@pytest.mark.parametrize("layout", ["replicated", "sharded"])
def test_resume_on_a_data_set_of_another_size_is_refused(tmp_path, layout):
    pl.seed_everything(0)
    callback = LPA3Callback(ratio=0.5, steps=1, selection={"memory_layout": layout})
    trainer = _trainer(tmp_path, [callback], max_epochs=1)
    trainer.fit(TinyClassifier(), _loader(48))
    ckpt = tmp_path / "a.ckpt"
    trainer.save_checkpoint(ckpt)
    trainer2 = _trainer(tmp_path, [LPA3Callback(ratio=0.5, steps=1, selection={"memory_layout": layout})],
                        max_epochs=2)
    with pytest.raises(ValueError, match="same training data"):
        trainer2.fit(TinyClassifier(), _loader(30), ckpt_path=ckpt)


def test_a_16_bit_sharded_memory_resumes_into_a_replicated_float32_one(tmp_path):
    """One process can run the sharded layout too (one shard); its checkpoint holds the whole
    memory in its storage dtype and resumes into another layout and dtype."""
    pl.seed_everything(0)
    callback = RecordsStartState(ratio=0.5, steps=1, selection={"memory_layout": "sharded", "memory_dtype": "bfloat16"})
    trainer = _trainer(tmp_path, [callback], max_epochs=1)
    trainer.fit(TinyClassifier(), _loader(48))
    assert type(callback.runner().tcs).__name__ == "ShardedTimeConsistency"
    assert callback.runner().tcs.local_rows.dtype == torch.bfloat16
    ckpt = tmp_path / "half.ckpt"
    trainer.save_checkpoint(ckpt)
    saved = lpa3_state(ckpt)["tcs"]
    assert saved["memory"].shape == (48, 3) and saved["memory"].dtype == torch.bfloat16
    assert saved["storage_dtype"] == "bfloat16"
    resumed = RecordsStartState(ratio=0.5, steps=1, selection={"memory_layout": "replicated"})
    _trainer(tmp_path, [resumed], max_epochs=2).fit(TinyClassifier(), _loader(48), ckpt_path=ckpt)
    assert type(resumed.runner().tcs) is TimeConsistency and resumed.runner().tcs.memory.dtype == torch.float32
    assert torch.equal(resumed.start_state["memory"], saved["memory"].float())  # the rows as stored, widened
    assert torch.equal(resumed.start_state["scores"], saved["scores"])


# ---------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"ratio": 0.0}, "ratio"),
        ({"ratio": 1.5}, "ratio"),
        ({"sigma": -0.1}, "sigma"),
        ({"steps": 0}, "steps"),
        ({"solver": {"lam": -1}}, "solver.lam"),
        ({"warmup_epochs": -1}, "warmup_epochs"),
        ({"solver": {"attack_bn": "train"}}, "solver.attack_bn"),
        ({"solver": {"temperature": 0}}, "solver.temperature"),
        ({"selection": {"num_samples": 0}}, "selection.num_samples"),
        ({"selection": {"divergence": "js"}}, "selection.divergence"),
        ({"selection": {"initial_memory": "zeros"}}, "selection.initial_memory"),
        ({"selection": {"memory_layout": "split"}}, "selection.memory_layout"),
        ({"selection": {"memory_dtype": "float64"}}, "selection.memory_dtype"),
        ({"selection": {"criterion": "lowest"}}, "selection.criterion"),
        ({"input_range": 3}, "input_range"),
        ({"cache": {"regenerate_every_n_epochs": 0}}, "cache.regenerate_every_n_epochs"),
        ({"logging": {"num_images": 0}}, "logging.num_images"),
        ({"preset": "paper"}, "preset"),
    ],
)
def test_constructor_refuses_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LPA3Callback(**kwargs)


class NoProtocol(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(2, 2)

    def training_step(self, batch, batch_idx):
        return self.net(batch[0]).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_module_without_the_protocol_is_refused_at_setup(tmp_path):
    trainer = _trainer(tmp_path, [LPA3Callback()], max_epochs=1)
    data = DataLoader(TensorDataset(torch.randn(4, 2)), batch_size=2)
    with pytest.raises(TypeError, match="LPA3ModuleMixin"):
        trainer.fit(NoProtocol(), data)


def test_batch_without_indices_is_refused(tmp_path):
    trainer = _trainer(tmp_path, [LPA3Callback(steps=1)], max_epochs=1)
    data = DataLoader(TensorDataset(torch.randn(8, 1, 28, 28), torch.randint(0, 3, (8,))), batch_size=4)
    with pytest.raises(ValueError, match="IndexedDataset"):
        trainer.fit(TinyClassifier(), data)


def test_unknown_feature_layer_is_refused_at_setup(tmp_path):
    trainer = _trainer(tmp_path, [LPA3Callback(layers=["layer9"])], max_epochs=1)
    with pytest.raises(ValueError, match="matches no module"):
        trainer.fit(TinyClassifier(), _loader())


def test_twin_attack_without_twins_is_refused(tmp_path):
    trainer = _trainer(tmp_path, [LPA3Callback(solver={"attack_bn": "twin"})], max_epochs=1)
    with pytest.raises(ValueError, match="convert_dual_bn"):
        trainer.fit(TinyClassifier(twin_bn=False), _loader())


def test_module_that_does_not_record_predictions_is_told_how(tmp_path):
    class Forgetful(TinyClassifier):
        def training_step(self, batch, batch_idx):
            x, y, _ = batch
            return F.cross_entropy(self.model(x), y)

    trainer = _trainer(tmp_path, [LPA3Callback(steps=1)], max_epochs=1)
    with pytest.raises(RuntimeError, match="lpa3_record_predictions"):
        trainer.fit(Forgetful(), _loader())


def test_module_without_num_classes_is_told_how(tmp_path):
    module = TinyClassifier()
    module.lpa3_num_classes = None
    trainer = _trainer(tmp_path, [LPA3Callback(steps=1)], max_epochs=1)
    with pytest.raises(ValueError, match="lpa3_num_classes"):
        trainer.fit(module, _loader())


@pytest.mark.parametrize("warmup_epochs", [0, 1])
def test_indices_out_of_range_are_refused(tmp_path, warmup_epochs):
    callback = LPA3Callback(steps=1, warmup_epochs=warmup_epochs, selection={"num_samples": 10})
    trainer = _trainer(tmp_path, [callback], max_epochs=1)
    with pytest.raises(ValueError, match="LPA3Request.indices` out of range"):
        trainer.fit(TinyClassifier(), _loader())


def test_input_range_auto_uses_the_datamodule_normalization(tmp_path):
    class DM(pl.LightningDataModule):
        normalization = {"mean": [0.5], "std": [0.5]}

        def train_dataloader(self):
            return _loader()

    ranges: list = []
    solve = lpa3_lightning_callback.solve

    def spy(*args, **kwargs):
        ranges.append(kwargs["bounds"])
        return solve(*args, **kwargs)

    callback = LPA3Callback(steps=1, seed=0)
    trainer = _trainer(tmp_path, [callback], max_epochs=1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("lpa3_lightning.callback.hard_positives.solve", spy)
        trainer.fit(TinyClassifier(), datamodule=DM())
    # what reached the solver: the box of [0, 1] pixels normalised by mean 0.5, std 0.5
    assert ranges and all(low.flatten().tolist() == [-1.0] and high.flatten().tolist() == [1.0]
                          for low, high in ranges)


def test_sync_batchnorm_over_twins_is_refused(tmp_path):
    module = TinyClassifier()
    module.model = nn.SyncBatchNorm.convert_sync_batchnorm(module.model)
    trainer = _trainer(tmp_path, [LPA3Callback(steps=1)], max_epochs=1)
    with pytest.raises(ValueError, match="SyncBatchNorm"):
        trainer.fit(module, _loader())


def test_logits_width_must_match_num_classes(tmp_path):
    module = TinyClassifier()
    module.lpa3_num_classes = 4  # the model has 3 outputs
    trainer = _trainer(tmp_path, [LPA3Callback(steps=1)], max_epochs=1)
    with pytest.raises(ValueError, match="lpa3_num_classes"):
        trainer.fit(module, _loader())


@pytest.mark.parametrize(("kwargs", "match"), [({"solver": {"project": "no"}}, "solver.project"),
                                                ({"seed": 1.5}, "seed"), ({"layers": 3}, "layers"),
                                                ({"solver": {"max_step": 0}}, "solver.max_step"),
                                                ({"solver": {"max_step": "1"}}, "solver.max_step"),
                                                ({"solver": {"allow_tf32": 1}}, "solver.allow_tf32")])
def test_constructor_checks_types(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LPA3Callback(**kwargs)


def test_an_unknown_group_setting_is_a_type_error_naming_the_group():
    with pytest.raises(TypeError, match="`cache` has no setting `regenerate`"):
        LPA3Callback(cache={"regenerate": 2})


def test_bf16_mixed_precision_fit(tmp_path):
    pl.seed_everything(0)
    module = TinyClassifier()
    trainer = _trainer(tmp_path, [LPA3Callback(ratio=0.5, steps=2, seed=0)], max_epochs=2, precision="bf16-mixed")
    trainer.fit(module, _loader())
    metrics = trainer.callback_metrics  # re-measured independently in bf16: tests/test_label_preserved_as_trained.py
    assert float(metrics["lpa3/label_preserved_epoch"]) >= 0.99  # the solver runs in float32 under bf16-mixed
    assert all(bool(torch.isfinite(p).all()) for p in module.parameters())
    assert sum(module.seen_augmented) > 0


# ------------------------------------------------------------------- bad input and odd models
class NanTolerant(TinyClassifier):
    """Cleans its own inputs for its loss; the callback must keep NaN rows out of the attack."""

    def training_step(self, batch, batch_idx):
        x, y, idx = batch
        clean = torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)
        return super().training_step((clean, y, idx), batch_idx)


def _with_bad_rows(n: int = 48, nan_rows=(3,), inf_rows=(10,)) -> DataLoader:
    data = indexed_images(n)
    xs = torch.stack([data[i][0] for i in range(n)])
    ys = torch.stack([data[i][1] for i in range(n)])
    xs[list(nan_rows), 0, 0, 0] = float("nan")
    xs[list(inf_rows), 0, 5, 5] = float("inf")
    from lpa3_lightning.data import IndexedDataset

    return DataLoader(IndexedDataset(TensorDataset(xs, ys)), batch_size=16, shuffle=False)


def test_nonfinite_inputs_are_skipped_and_counted(tmp_path):
    pl.seed_everything(0)
    module = NanTolerant()
    callback = LPA3Callback(ratio=1.0, steps=1, seed=0)
    trainer = _trainer(tmp_path, [callback], max_epochs=1)
    trainer.fit(module, _with_bad_rows())
    assert float(trainer.callback_metrics["lpa3/nonfinite_inputs"]) == 2.0
    assert sum(module.seen_augmented) == 48 - 2  # ratio 1 before any threshold: all finite rows


def test_nonfinite_inputs_are_counted_and_warned_in_a_warm_up_epoch_too(tmp_path):
    """A step that solves nothing (the callback's warm-up, a module's own) still counts and names them."""
    callback = LPA3Callback(ratio=1.0, steps=1, seed=0, warmup_epochs=1)
    trainer = _trainer(tmp_path, [callback], max_epochs=1)
    with pytest.warns(UserWarning, match=r"2 training inputs hold NaN or Inf \(dataset indices \[3, 10\]"):
        trainer.fit(NanTolerant(), _with_bad_rows())
    assert float(trainer.callback_metrics["lpa3/nonfinite_inputs"]) == 2.0


class TwoOptimizers(TinyClassifier):
    """Manual optimization stepping two optimizers a batch: two optimizer steps per batch."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        for optimizer in self.optimizers():
            optimizer.zero_grad()
        self.manual_backward(loss)
        for optimizer in self.optimizers():
            optimizer.step()

    def configure_optimizers(self):
        head = list(self.model.parameters())[-2:]
        body = list(self.model.parameters())[:-2]
        return torch.optim.SGD(body, lr=0.05), torch.optim.SGD(head, lr=0.05)


class RecordsMeasured(LPA3Callback):
    measured: list[bool]

    def on_augmented(self, trainer, pl_module, augmented):
        self.__dict__.setdefault("measured", []).append(self.runner()._step[1])  # (the hand-over's step: (prepared, measured))


def test_diagnostics_are_measured_on_the_batches_lightning_logs_with_two_optimizer_steps_a_batch(tmp_path):
    """Lightning logs every log_every_n_steps-th batch; a module stepping two optimizers a batch
    makes global_step even, so a rule on optimizer steps would never measure past batch 0."""
    callback = RecordsMeasured(ratio=1.0, steps=1, seed=0)
    trainer = pl.Trainer(default_root_dir=tmp_path, max_epochs=1, accelerator="cpu", logger=False,
                         enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=2,
                         callbacks=[callback])
    trainer.fit(TwoOptimizers(), _loader(64, 16))
    assert trainer.global_step == 8  # (two optimizer steps a batch)
    assert callback.measured == [True, True, False, True]  # batch 0, and Lightning's logging batches 1 and 3


@pytest.mark.parametrize("warmup_epochs", [0, 1])
def test_labels_out_of_range_are_refused(tmp_path, warmup_epochs):
    data = indexed_images(8)
    xs = torch.stack([data[i][0] for i in range(8)])
    from lpa3_lightning.data import IndexedDataset

    loader = DataLoader(IndexedDataset(TensorDataset(xs, torch.full((8,), 5))), batch_size=4)
    trainer = _trainer(tmp_path, [LPA3Callback(steps=1, warmup_epochs=warmup_epochs)],
                       max_epochs=1)
    with pytest.raises(ValueError, match="Labels out of range"):
        trainer.fit(TinyClassifier(), loader)


def test_batch_of_size_one_trains_without_augmentation(tmp_path):
    module = TinyClassifier()
    callback = LPA3Callback(steps=1)
    trainer = _trainer(tmp_path, [callback], max_epochs=1, limit_train_batches=4)
    trainer.fit(module, DataLoader(indexed_images(8), batch_size=1))
    assert module.seen_augmented == [0, 0, 0, 0]  # a lone selection is dropped
    assert int(callback.runner().tcs.seen.sum()) == 4


@pytest.mark.parametrize(
    ("wrap", "unwrap"),
    [(lambda logits, x: {"logits": logits, "aux": x.mean()}, lambda out: out["logits"]),
     (lambda logits, x: (logits, x.mean()), lambda out: out[0])],
    ids=["dict", "tuple"],
)
def test_non_tensor_outputs_through_the_lpa3_logits_adapter(tmp_path, wrap, unwrap):
    class WrappedNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = small_cnn()

        def forward(self, x):
            return wrap(self.body(x), x)

    class WrappedClassifier(TinyClassifier):
        def __init__(self):
            super().__init__(twin_bn=False)
            self.model = WrappedNet()

        def lpa3_logits(self, output):
            return unwrap(output)

    module = WrappedClassifier()
    trainer = _trainer(tmp_path, [LPA3Callback(steps=1, selection={"initial_selection": "all"})], max_epochs=1)
    trainer.fit(module, _loader())
    assert sum(module.seen_augmented) == 48
    assert "lpa3/label_preserved_epoch" in trainer.callback_metrics  # the adapter reached the training forward


def test_gradient_accumulation_attacks_and_tracks_every_micro_batch(tmp_path):
    module = TinyClassifier()
    callback = LPA3Callback(ratio=0.5, steps=1, selection={"initial_selection": "all"})
    trainer = _trainer(tmp_path, [callback], max_epochs=2, accumulate_grad_batches=3)
    trainer.fit(module, _loader())
    assert len(module.seen_augmented) == 6 and module.seen_augmented[:3] == [16, 16, 16]
    assert bool(callback.runner().tcs.seen.all()) and callback.runner().tcs.has_threshold


# ------------------------------------------------------------------- cached augmentations
class RecordsAugmented(TinyClassifier):
    def __init__(self) -> None:
        super().__init__()
        self.received: dict[int, list[torch.Tensor]] = {}

    def training_step(self, batch, batch_idx):
        augmented = self._lpa3_slot("augmented", None)
        if augmented is not None:
            for i, x_adv in zip(augmented.indices.tolist(), augmented.inputs):
                self.received.setdefault(i, []).append(x_adv.clone())
        return super().training_step(batch, batch_idx)


def test_regenerate_every_n_epochs_reuses_x_prime(tmp_path, monkeypatch):
    import lpa3_lightning.callback.hard_positives as callback_module

    attacked: list[int] = []
    original = callback_module.solve

    def counting(features, x, *args, **kwargs):
        attacked.append(x.shape[0])
        return original(features, x, *args, **kwargs)

    monkeypatch.setattr(callback_module, "solve", counting)
    pl.seed_everything(0)
    module = RecordsAugmented()
    callback = LPA3Callback(ratio=1.0, steps=1, seed=0, cache={"regenerate_every_n_epochs": 3, "in_checkpoint": True})
    trainer = _trainer(tmp_path, [callback], max_epochs=4)
    trainer.fit(module, _loader())
    # ratio 1: every sample selected every epoch; attacked in epochs 0 and 3 only
    assert sum(attacked) == 2 * 48
    for received in module.received.values():
        assert len(received) == 4
        assert torch.equal(received[0], received[1]) and torch.equal(received[1], received[2])
        assert not torch.equal(received[2], received[3])
    assert float(trainer.callback_metrics["lpa3/reused_fraction_epoch"]) == 0.0  # epoch 3 regenerated all
    ckpt = tmp_path / "c.ckpt"
    trainer.save_checkpoint(ckpt)
    state = lpa3_state(ckpt)["cache"]
    assert torch.equal(state["storage"], callback.runner().store.storage) and int(state["written"].min()) == 3


def test_cache_is_restored_on_resume(tmp_path):
    pl.seed_everything(0)
    callback = LPA3Callback(ratio=1.0, steps=1, seed=0, cache={"regenerate_every_n_epochs": 5, "in_checkpoint": True})
    trainer = _trainer(tmp_path, [callback], max_epochs=1)
    trainer.fit(TinyClassifier(), _loader())
    ckpt = tmp_path / "e1.ckpt"
    trainer.save_checkpoint(ckpt)
    module = RecordsAugmented()
    resumed = LPA3Callback(ratio=1.0, steps=1, seed=0, cache={"regenerate_every_n_epochs": 5})
    _trainer(tmp_path, [resumed], max_epochs=2).fit(module, _loader(), ckpt_path=ckpt)
    # epoch 1 after resume: every x' comes from the restored cache
    for i, received in module.received.items():
        assert torch.equal(received[0], callback.runner().store.get(torch.tensor([i]))[0])


def test_a_checkpoint_of_another_state_version_is_refused_naming_the_version(tmp_path):
    """No migration of older states before 1.0: one message naming the version and the fix."""
    pl.seed_everything(0)
    callback = LPA3Callback(ratio=0.5, steps=1, seed=0)
    trainer = _trainer(tmp_path, [callback], max_epochs=1)
    trainer.fit(TinyClassifier(), _loader())
    ckpt = tmp_path / "new.ckpt"
    trainer.save_checkpoint(ckpt)
    checkpoint = torch.load(ckpt, weights_only=False)
    checkpoint["callbacks"][callback.state_key]["version"] = 4
    old = tmp_path / "old.ckpt"
    torch.save(checkpoint, old)
    resumed = LPA3Callback(ratio=0.5, steps=1, seed=0)
    with pytest.raises(ValueError, match="LPA3Callback state of version 4; this lpa3-lightning reads version 5.*Fix"):
        _trainer(tmp_path, [resumed], max_epochs=2).fit(TinyClassifier(), _loader(), ckpt_path=old)


def test_over_large_cache_goes_to_a_file_under_the_root_dir(tmp_path):
    callback = LPA3Callback(ratio=1.0, steps=1, cache={"regenerate_every_n_epochs": 2, "max_bytes": 0})
    trainer = _trainer(tmp_path, [callback], max_epochs=1)
    seen: list = []

    class WatchesTheFile(pl.Callback):
        def on_train_epoch_end(self, trainer, pl_module):
            store = callback.runner().store
            seen.append((store.file, store.nbytes, store.file is not None and store.file.exists()))

    trainer = _trainer(tmp_path, [callback, WatchesTheFile()], max_epochs=1)
    trainer.fit(TinyClassifier(), _loader())
    path, size, named = seen[0]
    assert path is not None and path.parent == tmp_path / "lpa3_cache"
    assert size == 48 * 28 * 28 * 4
    assert path.name.startswith("lpa3_augmentation_cache_")
    assert not named  # mapped, its name already removed (tests/core/test_cache.py)
    assert callback.runner().store.file is None  # released at the end of fit


def test_the_cache_file_is_deleted_when_the_fit_fails(tmp_path):
    callback = LPA3Callback(ratio=1.0, steps=1, cache={"regenerate_every_n_epochs": 2, "max_bytes": 0})

    class FailsLater(TinyClassifier):
        def training_step(self, batch, batch_idx):
            if batch_idx == 1:
                raise RuntimeError("boom")
            return super().training_step(batch, batch_idx)

    with pytest.raises(RuntimeError, match="boom"):
        _trainer(tmp_path, [callback], max_epochs=1).fit(FailsLater(), _loader())
    assert list((tmp_path / "lpa3_cache").glob("*.bin")) == []


def test_checkpoints_hold_no_cache_copy_unless_asked(tmp_path):
    sizes = {}
    for asked in (False, True):
        callback = LPA3Callback(ratio=1.0, steps=1, cache={"regenerate_every_n_epochs": 3, "in_checkpoint": asked})
        trainer = _trainer(tmp_path / str(asked), [callback], max_epochs=1)
        trainer.fit(TinyClassifier(), _loader())
        trainer.save_checkpoint(tmp_path / f"{asked}.ckpt")
        state = lpa3_state(tmp_path / f"{asked}.ckpt")
        sizes[asked] = state["cache"]["storage"]
    assert sizes[False] is None
    assert sizes[True] is not None and tuple(sizes[True].shape) == (48, 1, 28, 28)


def test_a_second_fit_with_the_same_callback_updates_tcs_from_its_first_epoch(tmp_path):
    callback = LPA3Callback(ratio=0.5, steps=1, seed=0)
    _trainer(tmp_path, [callback], max_epochs=2).fit(TinyClassifier(), _loader())
    scores_after_first = callback.runner().tcs.scores.clone()
    updates: list[int] = []
    original = callback.runner().tcs.update

    class CountsUpdates(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            def counting(indices, probs, targets=None, **kwargs):
                updates.append(int(indices.numel()))
                return callback.runner().tcs.__class__.update(callback.runner().tcs, indices, probs, targets, **kwargs)
            callback.runner().tcs.update = counting

    second = _trainer(tmp_path, [callback, CountsUpdates()], max_epochs=1)
    second.fit(TinyClassifier(), _loader())
    assert sum(updates) == 48  # every sample of the second fit's epoch 0 reached the memory
    assert not torch.equal(callback.runner().tcs.scores, scores_after_first)
    del original


def test_input_range_auto_without_a_normalization_warns_with_the_fix(tmp_path):
    with pytest.warns(UserWarning, match="input_range"):
        _trainer(tmp_path, [LPA3Callback(steps=1)], max_epochs=1, limit_train_batches=1).fit(
            TinyClassifier(), _loader())


def test_sync_batchnorm_converted_before_the_twins_trains(tmp_path):
    module = TinyClassifier(twin_bn=False)
    module.model = convert_dual_bn(nn.SyncBatchNorm.convert_sync_batchnorm(small_cnn()))
    trainer = _trainer(tmp_path, [LPA3Callback(steps=1, selection={"initial_selection": "all"})], max_epochs=1)
    trainer.fit(module, _loader())
    assert sum(module.seen_augmented) == 48


def test_nonfinite_predictions_never_reach_the_memory(tmp_path):
    class NanLogits(TinyClassifier):
        def training_step(self, batch, batch_idx):
            x, y, idx = batch
            logits = self.model(x)
            poisoned = logits.detach().clone()
            poisoned[0] = float("nan")  # the first sample of every batch
            self.lpa3_record_predictions(idx, poisoned)
            self.lpa3_take_augmented()
            return F.cross_entropy(logits, y)

    callback = LPA3Callback(ratio=0.5, steps=1)
    trainer = _trainer(tmp_path, [callback], max_epochs=2)
    trainer.fit(NanLogits(), _loader(shuffle=False))
    assert bool(torch.isfinite(callback.runner().tcs.scores).all()) and bool(torch.isfinite(callback.runner().tcs.memory).all())
    assert int(callback.runner().tcs.seen.sum()) == 48 - 3 and callback.runner().tcs.has_threshold
    assert float(trainer.callback_metrics["lpa3/nonfinite_predictions"]) == 3.0  # per epoch


def test_compiled_model_with_named_layers_in_a_trainer(tmp_path):
    module = TinyClassifier(twin_bn=False)
    module.model = torch.compile(module.model)

    x, y = torch.randn(4, 1, 28, 28), torch.tensor([0, 1, 2, 0])

    compiled = module.model

    def solve(model, layers):
        from lpa3_lightning.callback.hard_positives import FitPlan
        from lpa3_lightning.core.solver import solve as solve_rows

        module.model = model
        callback = LPA3Callback(steps=1, layers=layers, seed=0, input_range=None)
        # the callback resolves names on the eager module behind the compiled wrapper
        trainer = _trainer(tmp_path, [], max_epochs=1)
        callback.setup(trainer, module, "fit")
        settings = callback.resolve(trainer)
        features = FitPlan(settings).features_for(module, x)
        generator = torch.Generator().manual_seed(0)
        return solve_rows(features, x, y, settings.sigma, settings.steps, settings.solver, bn_mode="eval", bounds=None,
                          step_bound=None, bn_statistics=None, generator=generator)[0]

    x_adv = solve(compiled, ["4"])
    eager = compiled._orig_mod
    torch.testing.assert_close(x_adv, solve(eager, ["4"]), rtol=0, atol=1e-5)  # the compiled model's x'
    assert float((x_adv - solve(eager, ["0"])).abs().max()) > 1e-4  # the named layer is the one used


def _augment_rows(callback, trainer, module, request):
    """The hard positives alone of every row of ``request`` (as if TCS had selected them all)."""
    from lpa3_lightning.callback.hard_positives import make_hard_positives

    runner, n, epoch = callback.runner(), request.inputs.shape[0], trainer.current_epoch
    every = torch.ones(n, dtype=torch.bool)
    made = make_hard_positives(runner.plan, runner.settings, module, request, every, n, runner.store, epoch,
                               runner._solver_runs(epoch), True, runner._generator_for(request.inputs, epoch, 0), every)
    return made.augmented, made.new_rows


def test_one_new_sample_among_cached_ones_waits(tmp_path):
    callback = LPA3Callback(ratio=1.0, steps=1, cache={"regenerate_every_n_epochs": 3})
    module = TinyClassifier()
    trainer = _trainer(tmp_path, [callback], max_epochs=1, limit_train_batches=1)
    trainer.fit(module, _loader(16, 16, shuffle=False))
    callback.runner().store.written[1:16] = 0
    callback.runner().store.labels[1:16] = 0  # solved for the labels of the request below
    callback.runner().store.written[0] = -1  # only sample 0 would need the solver
    from lpa3_lightning.methods.base import LPA3Request

    request = LPA3Request(torch.randn(16, 1, 28, 28), torch.zeros(16, dtype=torch.long), torch.arange(16))
    augmented, _ = _augment_rows(callback, trainer, module, request)
    assert len(augmented) == 15 and int(augmented.from_cache.sum()) == 15 and not bool(augmented.mask[0])


def test_a_cached_x_prime_is_reused_only_for_the_label_it_was_solved_for(tmp_path):
    callback = LPA3Callback(ratio=1.0, steps=1, cache={"regenerate_every_n_epochs": 3})
    module = TinyClassifier()
    trainer = _trainer(tmp_path, [callback], max_epochs=1, limit_train_batches=1)
    trainer.fit(module, _loader(16, 16, shuffle=False))
    callback.runner().store.written[:16] = 0
    callback.runner().store.labels[:16] = 0  # every entry solved for label 0
    from lpa3_lightning.methods.base import LPA3Request

    targets = torch.tensor([0, 1] * 8)  # pseudo-labels moved on for half of them
    request = LPA3Request(torch.randn(16, 1, 28, 28), targets, torch.arange(16))
    augmented, new_rows = _augment_rows(callback, trainer, module, request)
    assert int(augmented.from_cache.sum()) == 8  # only the label-0 entries were reused
    assert new_rows is not None and sorted(new_rows[0].tolist()) == list(range(1, 16, 2))  # the others re-solved
    assert torch.equal(new_rows[2], torch.ones(8, dtype=torch.long))


def test_fast_solver_in_a_trainer_reaches_the_attack(tmp_path, monkeypatch):
    import lpa3_lightning.callback.hard_positives as callback_module

    seen = []
    original = callback_module.solve
    monkeypatch.setattr(callback_module, "solve", lambda *a, **k: seen.append(a[5].fast) or original(*a, **k))
    pl.seed_everything(0)
    module = TinyClassifier()
    trainer = _trainer(tmp_path, [LPA3Callback(ratio=0.5, steps=3, seed=0, solver={"fast": True})], max_epochs=2)
    trainer.fit(module, _loader())
    assert seen and all(seen) and sum(module.seen_augmented) > 0
    with pytest.raises(ValueError, match="fast"):
        LPA3Callback(solver={"fast": "yes"})


def test_max_step_reaches_the_solver(tmp_path, monkeypatch):
    import lpa3_lightning.callback.hard_positives as callback_module

    seen = []
    real = callback_module.solve

    def spy(*args, **kwargs):
        seen.append((args[5].max_step, args[5].allow_tf32))  # (the solver settings)
        return real(*args, **kwargs)

    monkeypatch.setattr(callback_module, "solve", spy)
    pl.seed_everything(0)
    trainer = _trainer(tmp_path, [LPA3Callback(ratio=1.0, steps=1, solver={"max_step": 0.25, "allow_tf32": True})], max_epochs=1)
    trainer.fit(TinyClassifier(), _loader())
    assert seen and set(seen) == {(0.25, True)}


@pytest.mark.parametrize("attack_new", [True, False])
def test_attack_new_selections_false_runs_the_solver_in_regeneration_epochs_only(tmp_path, monkeypatch, attack_new):
    import lpa3_lightning.callback.hard_positives as callback_module

    attacked_per_epoch: dict[int, int] = {}
    original = callback_module.solve

    class Counter(pl.Callback):
        fractions: dict[int, tuple[float, float]] = {}

        def on_train_epoch_start(self, trainer, pl_module):
            self.epoch = trainer.current_epoch

        def on_train_epoch_end(self, trainer, pl_module):
            metrics = trainer.callback_metrics
            if "lpa3/tcs_selected_fraction_epoch" in metrics:
                self.fractions[self.epoch] = (float(metrics["lpa3/selected_fraction_epoch"]),
                                              float(metrics["lpa3/tcs_selected_fraction_epoch"]))

    counter = Counter()

    def counting(features, x, *args, **kwargs):
        attacked_per_epoch[counter.epoch] = attacked_per_epoch.get(counter.epoch, 0) + x.shape[0]
        return original(features, x, *args, **kwargs)

    monkeypatch.setattr(callback_module, "solve", counting)
    pl.seed_everything(0)
    module = RecordsAugmented()
    # warm-up epoch 0; regeneration epochs 1 and 4 (warmup + m K); half the samples selected
    callback = LPA3Callback(ratio=0.5, steps=1, seed=0, warmup_epochs=1,
                            cache={"regenerate_every_n_epochs": 3, "attack_new_selections": attack_new})
    trainer = _trainer(tmp_path, [counter, callback], max_epochs=5)
    trainer.fit(module, _loader())
    assert attacked_per_epoch.get(1, 0) > 0 and attacked_per_epoch.get(4, 0) > 0
    between = attacked_per_epoch.get(2, 0) + attacked_per_epoch.get(3, 0)
    if attack_new:
        assert between > 0  # the selection moved: newly selected samples were attacked
    else:
        assert between == 0
        # between regenerations a sample trains on the x' made for it in epoch 1 or on none;
        # at most 4 receipts (epochs 1-4), all but the regenerated last one equal to the first
        received_between = 0
        for received in module.received.values():
            assert len(received) <= 4
            same = [torch.equal(x_adv, received[0]) for x_adv in received]
            received_between += sum(same) - 1
            assert all(same[:-1])
        assert received_between > 0  # the cache was used
        # TCS selected as before; fewer of those samples got an x' between regenerations
        for epoch in (2, 3):
            augmented_share, tcs_share = counter.fractions[epoch]
            assert augmented_share < tcs_share
    with pytest.raises(ValueError, match="attack_new_selections"):
        LPA3Callback(cache={"attack_new_selections": "no"})


def test_lazy_cache_regenerates_when_nothing_is_left_to_reuse(tmp_path):
    """A file cache restarts empty on resume: the next epoch must regenerate, not go without x'."""
    callback = LPA3Callback(ratio=1.0, steps=1, seed=0,
                            cache={"regenerate_every_n_epochs": 4, "attack_new_selections": False})
    trainer = _trainer(tmp_path, [callback], max_epochs=2)
    trainer.fit(TinyClassifier(), _loader())
    assert int(callback.runner().store.written.max()) == 0  # written in the regeneration epoch 0 only
    assert not callback._runners[None].regeneration_epoch(1) and not callback._runners[None].regeneration_epoch(3)
    assert callback._runners[None].regeneration_epoch(4)
    callback.runner().store.written.fill_(-1)  # what a restarted file cache holds
    assert callback._runners[None].regeneration_epoch(2)
    callback.runner().store.written[:5] = 2  # entries of the current epoch do not count as reusable
    assert callback._runners[None].regeneration_epoch(2) and not callback._runners[None].regeneration_epoch(3)


def test_a_lone_cached_x_prime_is_not_trained_alone(tmp_path):
    callback = LPA3Callback(ratio=1.0, steps=1, cache={"regenerate_every_n_epochs": 3})
    module = TinyClassifier()
    trainer = _trainer(tmp_path, [callback], max_epochs=1, limit_train_batches=1)
    trainer.fit(module, _loader(16, 16, shuffle=False))
    callback.runner().store.written[:] = -1
    callback.runner().store.written[0] = 0  # sample 0 cached, sample 1 new (a lone new one waits)
    from lpa3_lightning.methods.base import LPA3Request

    request = LPA3Request(torch.randn(2, 1, 28, 28), torch.zeros(2, dtype=torch.long), torch.arange(2))
    augmented, _ = _augment_rows(callback, trainer, module, request)
    assert len(augmented) == 0 and not bool(augmented.mask.any())


# ---------------------------------------------------------------- wrong settings get a named error
@pytest.mark.parametrize("width", [2, 4])
def test_logits_of_another_width_than_lpa3_num_classes_are_refused_before_the_first_solve(tmp_path, monkeypatch,
                                                                                          width):
    class OtherWidth(TinyClassifier):
        def __init__(self) -> None:
            super().__init__()
            self.model = convert_dual_bn(small_cnn(num_classes=width))  # lpa3_num_classes stays 3

    solved: list[int] = []

    import lpa3_lightning.callback.hard_positives as callback_module

    real = callback_module.solve
    monkeypatch.setattr(callback_module, "solve", lambda *a, **k: solved.append(1) or real(*a, **k))
    with pytest.raises(ValueError, match=f"logits of {width} classes but lpa3_num_classes is 3.*Fix"):
        _trainer(tmp_path, [LPA3Callback(ratio=0.5, steps=1, seed=0, input_range=None)], max_epochs=1).fit(
            OtherWidth(), _loader())
    assert not solved  # (narrower logits used to fail inside the solver with torch's IndexError)


def test_a_module_without_a_network_to_attack_is_refused_at_setup(tmp_path):
    class NoNetwork(SupervisedLPA3Mixin, pl.LightningModule):  # neither lpa3_model() nor forward()
        def __init__(self) -> None:
            super().__init__()
            self.net = small_cnn(num_classes=3)
            self.lpa3_num_classes = 3

        def training_step(self, batch, batch_idx):
            return self.lpa3_supervised_loss(batch)[0]

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    with pytest.raises(TypeError, match="neither overrides `lpa3_model\\(\\)` nor defines `forward\\(\\)`.*Fix"):
        _trainer(tmp_path, [LPA3Callback(ratio=0.5, steps=1, input_range=None)], max_epochs=1).fit(
            NoNetwork(), _loader())


def test_a_memory_larger_than_the_data_warns_once_naming_num_samples(tmp_path):
    pl.seed_everything(0)
    with pytest.warns(UserWarning, match="TCS memory has 200 rows, but .* named only 48 distinct") as records:
        _trainer(tmp_path, [LPA3Callback(ratio=0.5, steps=1, seed=0, input_range=None, selection={"num_samples": 200})],
                 max_epochs=14).fit(TinyClassifier(), _loader())
    assert sum("TCS memory has" in str(r.message) for r in records) == 1
    import warnings

    with warnings.catch_warnings():  # the right size: no such warning
        warnings.simplefilter("error", UserWarning)
        warnings.filterwarnings("ignore", message="^(?!LPA3Callback's TCS memory)")
        _trainer(tmp_path, [LPA3Callback(ratio=0.5, steps=1, seed=0, input_range=None)], max_epochs=5).fit(
            TinyClassifier(), _loader())


# ---------------------------------------------------------------------------------- what a run meets
def test_two_callbacks_keep_their_states_under_their_own_keys(tmp_path):
    """Lightning's convention (``_generate_state_key``): two configured instances, or a subclass
    beside the base class, each save and restore their own state."""

    class Subclass(LPA3Callback):
        pass

    first, second, third = LPA3Callback(ratio=0.5, steps=1, seed=0), LPA3Callback(ratio=0.25, steps=1, seed=0), \
        Subclass(ratio=0.5, steps=1, seed=0)
    assert len({first.state_key, second.state_key, third.state_key}) == 3
    trainer = _trainer(tmp_path, [first], max_epochs=1)
    trainer.fit(TinyClassifier(), _loader())
    checkpoint = torch.load(trainer.checkpoint_callback.best_model_path or _saved(trainer, tmp_path), weights_only=False)
    mine = checkpoint["callbacks"][first.state_key]
    other = {**mine, "networks": {"": {**mine["networks"][""], "tcs": {**mine["networks"][""]["tcs"]}}}}
    other["networks"][""]["tcs"]["scores"] = torch.full_like(mine["networks"][""]["tcs"]["scores"], -7.0)
    checkpoint["callbacks"][third.state_key] = other  # a second LP-A3 state beside the first
    both = tmp_path / "both.ckpt"
    torch.save(checkpoint, both)
    for callback, expected in ((LPA3Callback(ratio=0.5, steps=1, seed=0), mine),
                               (Subclass(ratio=0.5, steps=1, seed=0), other)):
        class Probe(pl.Callback):
            def on_train_start(self, trainer, pl_module):
                self.scores = callback.runner().tcs.scores.clone()

        probe = Probe()
        _trainer(tmp_path, [callback, probe], max_epochs=2).fit(TinyClassifier(), _loader(), ckpt_path=both)
        assert torch.equal(probe.scores, expected["networks"][""]["tcs"]["scores"])


def _saved(trainer: pl.Trainer, tmp_path) -> str:
    path = tmp_path / "saved.ckpt"
    trainer.save_checkpoint(path)
    return str(path)


def test_a_checkpoint_of_other_settings_warns_that_its_state_is_not_restored(tmp_path):
    callback = LPA3Callback(ratio=0.5, steps=1, seed=0)
    trainer = _trainer(tmp_path, [callback], max_epochs=1)
    trainer.fit(TinyClassifier(), _loader())
    ckpt = tmp_path / "a.ckpt"
    trainer.save_checkpoint(ckpt)
    other = LPA3Callback(ratio=0.25, steps=1, seed=0)
    with pytest.warns(UserWarning, match="holds LP-A3 state under.*ratio.*0.5"):
        _trainer(tmp_path, [other], max_epochs=2).fit(TinyClassifier(), _loader(), ckpt_path=ckpt)


def test_a_resume_leaves_the_global_random_state_to_the_user(tmp_path):
    """The callback draws its own random numbers from generators of its own: resuming restores
    nothing of torch's global generator (which dropout and transforms of the user's draw from)."""
    callback = LPA3Callback(ratio=0.5, steps=1, seed=0)
    trainer = _trainer(tmp_path, [callback], max_epochs=1)
    trainer.fit(TinyClassifier(), _loader())
    ckpt = tmp_path / "a.ckpt"
    trainer.save_checkpoint(ckpt)

    class GlobalState(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            self.state = torch.get_rng_state()

    states = []
    for user_seed in (1, 2):
        probe = GlobalState()
        trainer = _trainer(tmp_path, [LPA3Callback(ratio=0.5, steps=1, seed=0), probe], max_epochs=2)
        module = TinyClassifier()
        torch.manual_seed(user_seed)
        trainer.fit(module, _loader(), ckpt_path=ckpt)
        states.append(probe.state)
    assert not torch.equal(states[0], states[1])  # each run kept the state its user seeded


def test_an_input_range_that_excludes_the_data_warns_with_the_share_and_the_fix(tmp_path):
    # indexed_images are standardised-like (about N(y - 1, 0.5)): most values lie outside [0, 1]
    callback = LPA3Callback(ratio=0.5, steps=1, seed=0, input_range=(0.0, 1.0))
    with pytest.warns(UserWarning, match=r"\d+(\.\d+)?% of the input values.*outside.*input_range.*Fix"):
        _trainer(tmp_path, [callback], max_epochs=1).fit(TinyClassifier(), _loader())


def test_an_input_range_that_holds_the_data_runs_without_that_warning(tmp_path, recwarn):
    callback = LPA3Callback(ratio=0.5, steps=1, seed=0, input_range=(-10.0, 10.0))
    _trainer(tmp_path, [callback], max_epochs=1).fit(TinyClassifier(), _loader())
    assert not [w for w in recwarn if "outside" in str(w.message)]


def test_the_selected_share_follows_ratio_when_an_epoch_sees_part_of_the_data(tmp_path):
    """limit_train_batches: the samples not seen yet have no score; they are selected as before
    the first threshold (a ratio share), so the batches keep about ratio selected."""
    pl.seed_everything(0)
    module = TinyClassifier()
    callback = LPA3Callback(ratio=0.5, steps=1, seed=0)
    trainer = _trainer(tmp_path, [callback], max_epochs=6, limit_train_batches=2)
    trainer.fit(module, _loader(240, 16))
    later = module.seen_augmented[2:]  # after the first threshold
    assert sum(later) / (16 * len(later)) >= 0.35, module.seen_augmented


def test_a_non_finite_input_warns_once_naming_its_dataset_index(tmp_path):
    pl.seed_everything(0)
    callback = LPA3Callback(ratio=1.0, steps=1, seed=0)
    with pytest.warns(UserWarning, match=r"NaN or Inf.*dataset indices \[3, 10\]") as caught:
        _trainer(tmp_path, [callback], max_epochs=2).fit(NanTolerant(), _with_bad_rows())
    assert len([w for w in caught if "NaN or Inf" in str(w.message)]) == 1


class TupleOutput(TinyClassifier):
    """A model that returns (logits, features), without an ``lpa3_logits`` of its own."""

    def __init__(self) -> None:
        super().__init__()
        inner = self.model
        self.model = nn.Module()
        self.model.inner = inner
        self.model.forward = lambda x: (inner(x), x)


def test_a_model_output_that_is_not_logits_names_lpa3_logits_not_an_argument_the_callback_lacks(tmp_path):
    with pytest.raises(TypeError, match="lpa3_logits") as info:
        _trainer(tmp_path, [LPA3Callback(steps=1)], max_epochs=1).fit(TupleOutput(), _loader())
    assert "logits_fn" not in str(info.value)

    class Unsqueezed(TinyClassifier):
        def lpa3_logits(self, output):
            return output[:, :, None]  # (N, C, 1): not (N, C)

    with pytest.raises(ValueError, match=r"\(N, classes\).*lpa3_logits") as info:
        _trainer(tmp_path, [LPA3Callback(steps=1)], max_epochs=1).fit(Unsqueezed(), _loader())
    assert "logits_fn" not in str(info.value)


def test_a_later_fit_that_keeps_the_memory_another_way_refuses_before_any_collective():
    """A second fit with the same callback keeps its memory; laid out another way (layout or world
    size changed) it refuses on every rank alike, before any collective, naming the fix."""
    from lpa3_lightning.callback.runner import _kept
    from lpa3_lightning.core.tcs_shards import ShardedTimeConsistency

    two = ShardedTimeConsistency(10, 2, 0.5, num_shards=2, shard=1)
    with pytest.raises(ValueError, match="laid out another way.*save a checkpoint and resume from it"):
        _kept(two, TimeConsistency(10, 2, 0.5))
    with pytest.raises(ValueError, match="laid out another way"):
        _kept(two, ShardedTimeConsistency(10, 2, 0.5, num_shards=1, shard=0))
    earlier = TimeConsistency(10, 2, 0.5)
    earlier.update(torch.arange(10), torch.full((10, 2), 0.5), epoch=3)
    kept = _kept(earlier, TimeConsistency(10, 2, 0.5))
    assert torch.equal(kept.scores, earlier.scores) and bool((kept.last_update_epoch == -1).all())


def test_a_state_saved_before_any_fit_loads_and_the_fit_starts_afresh(tmp_path):
    """``state_dict()`` of a callback that never ran holds no memory; loading it into another
    callback must not break the next fit (it starts as a fresh one would)."""
    unused = LPA3Callback(ratio=0.5, steps=1, seed=0).state_dict()
    callback = LPA3Callback(ratio=0.5, steps=1, seed=0)
    callback.load_state_dict(unused)
    module = TinyClassifier()
    _trainer(tmp_path, [callback], max_epochs=1).fit(module, _loader())
    assert callback.runner().tcs.seen.all()
