"""LPA3Callback inside a real Trainer: data path, logging, checkpointing, refusals."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lpa3_lightning.callback.augment_stage as lpa3_lightning_callback
from lpa3_lightning import LPA3Callback, TimeConsistency
from lpa3_lightning.core.dual_bn import convert_dual_bn
from lpa3_lightning.mixins import SupervisedLPA3Mixin
from tests.helpers import indexed_images, small_cnn, snapshot


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
                x = augmented.reference_inputs
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

    tcs = callback.tcs
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


def test_warmup_epochs_skip_augmentation_but_update_tcs(tmp_path):
    pl.seed_everything(0)
    module = TinyClassifier()
    callback = LPA3Callback(ratio=0.5, steps=1, warmup_epochs=1)
    trainer = _trainer(tmp_path, [callback], max_epochs=2)
    trainer.fit(module, _loader())
    assert module.seen_augmented[:3] == [0, 0, 0]
    assert sum(module.seen_augmented[3:]) > 0
    assert bool(callback.tcs.seen.all())


def test_callback_never_moves_main_bn_statistics_during_the_attack(tmp_path):
    """The attack itself is invisible: a module whose training_step ignores x' ends bitwise
    equal to the same run without the callback."""

    class IgnoresAugmentation(TinyClassifier):
        def training_step(self, batch, batch_idx):
            x, y, idx = batch
            logits = self.model(x)
            self.lpa3_record_predictions(idx, logits)
            self.lpa3_take_augmented()
            return F.cross_entropy(logits, y)

    def run(with_callback: bool) -> dict[str, torch.Tensor]:
        pl.seed_everything(0)
        module = IgnoresAugmentation()
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
        self.start_state = self.tcs.state_dict()
        self.start_written = None if self.cache is None else self.cache.written.clone()
        self.x_prime: dict[int, list[torch.Tensor]] = {}

    def on_augmented(self, trainer, pl_module, augmented):
        self.x_prime.setdefault(trainer.current_epoch, []).append(augmented.inputs.clone())


def test_resume_restores_tcs_and_the_solver_noise_then_keeps_training(tmp_path):
    # a resumable loader: a plain DataLoader's order and its draw from the global generator are not
    # part of a checkpoint (tests/test_resume.py: the whole run bitwise)
    from lpa3_lightning.data import ResumableDataLoader

    def loader():
        return ResumableDataLoader(indexed_images(48), batch_size=16, shuffle=True, seed=0)

    pl.seed_everything(0)
    uninterrupted = RecordsStartState(ratio=0.5, steps=1, seed=0)
    _trainer(tmp_path / "full", [uninterrupted], max_epochs=3, deterministic=True).fit(TinyClassifier(), loader())

    pl.seed_everything(0)
    callback = LPA3Callback(ratio=0.5, steps=1, seed=0)
    trainer = _trainer(tmp_path, [callback], max_epochs=2, deterministic=True)
    trainer.fit(TinyClassifier(), loader())
    ckpt = tmp_path / "epoch2.ckpt"
    trainer.save_checkpoint(ckpt)
    saved = torch.load(ckpt, weights_only=False)["callbacks"][callback.state_key]
    torch.testing.assert_close(saved["tcs"]["memory"], callback.tcs.memory)

    resumed = RecordsStartState(ratio=0.5, steps=1, seed=0)
    module2 = TinyClassifier()
    trainer2 = _trainer(tmp_path, [resumed], max_epochs=3, deterministic=True)
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
    assert not torch.equal(resumed.tcs.scores, saved["tcs"]["scores"])


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


def test_auto_attack_mode_picks_twin_only_when_present(tmp_path, monkeypatch):
    import lpa3_lightning.callback.augment_stage as callback_module

    seen_modes = []
    original = callback_module.lpa3_attack

    def spy(*args, **kwargs):
        seen_modes.append(kwargs["bn_mode"])
        return original(*args, **kwargs)

    monkeypatch.setattr(callback_module, "lpa3_attack", spy)
    for twin in (True, False):
        _trainer(tmp_path, [LPA3Callback(steps=1)], max_epochs=1, limit_train_batches=1).fit(
            TinyClassifier(twin_bn=twin), _loader())
    assert seen_modes == ["twin", "eval"]


def test_a_lone_selected_sample_is_dropped_for_batch_statistics(tmp_path):
    class BN1dClassifier(TinyClassifier):
        def __init__(self):
            super().__init__()
            self.model = convert_dual_bn(nn.Sequential(nn.Flatten(), nn.Linear(784, 16), nn.BatchNorm1d(16), nn.ReLU(),
                                                       nn.Linear(16, 3)))

    class SelectOne(LPA3Callback):
        def on_train_start(self, trainer, pl_module):
            super().on_train_start(trainer, pl_module)
            self.tcs.scores[:] = 0.0
            self.tcs.scores[0] = -1.0  # only sample 0 below the threshold
            self.tcs.seen[:] = True
            self.tcs.threshold = torch.tensor(-0.5)

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
    callback = LPA3Callback(ratio=0.5, steps=1, selection={"memory_layout": "sharded", "memory_dtype": "bfloat16"})
    trainer = _trainer(tmp_path, [callback], max_epochs=1)
    trainer.fit(TinyClassifier(), _loader(48))
    assert type(callback.tcs).__name__ == "ShardedTimeConsistency" and callback.tcs.memory.dtype == torch.bfloat16
    ckpt = tmp_path / "half.ckpt"
    trainer.save_checkpoint(ckpt)
    saved = torch.load(ckpt, weights_only=False)["callbacks"]["LPA3Callback"]["tcs"]
    assert saved["memory"].shape == (48, 3) and saved["memory"].dtype == torch.bfloat16
    assert saved["storage_dtype"] == "bfloat16"
    resumed = RecordsStartState(ratio=0.5, steps=1, selection={"memory_layout": "replicated"})
    _trainer(tmp_path, [resumed], max_epochs=2).fit(TinyClassifier(), _loader(48), ckpt_path=ckpt)
    assert type(resumed.tcs) is TimeConsistency and resumed.tcs.memory.dtype == torch.float32
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
        ({"input_range": 3}, "input_range"),
        ({"cache": {"regenerate_every_n_epochs": 0}}, "cache.regenerate_every_n_epochs"),
        ({"logging": {"num_images": 0}}, "logging.num_images"),
        ({"runtime": {"sync_free": True, "cuda_graphs": 1}}, "runtime.cuda_graphs"),
        ({"cache": {"regenerate": 2}}, "`cache` has no setting \\['regenerate'\\]"),
        ({"preset": "paper"}, "preset"),
    ],
)
def test_constructor_refuses_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LPA3Callback(**kwargs)


@pytest.mark.parametrize("name, group, field", [("regenerate_every_n_epochs", "cache", "regenerate_every_n_epochs"),
                                                ("cache_dir", "cache", "dir"), ("sync_free", "runtime", "sync_free"),
                                                ("tcs_divergence", "selection", "divergence"),
                                                ("max_step", "solver", "max_step")])
def test_a_former_keyword_names_its_new_group(name, group, field):
    with pytest.raises(TypeError, match=f"`{name}` moved to the `{group}` group.*{group}=.*{field}"):
        LPA3Callback(**{name: 1})


def test_groups_take_dataclasses_or_mappings_over_the_preset(tmp_path):
    from lpa3_lightning.callback import CacheSettings, SolverSettings

    by_class = LPA3Callback(cache=CacheSettings(regenerate_every_n_epochs=3), solver=SolverSettings(max_step=0.5))
    by_mapping = LPA3Callback(cache={"regenerate_every_n_epochs": 3}, solver={"max_step": 0.5})
    assert by_class.cache_settings == by_mapping.cache_settings and by_class.solver == by_mapping.solver
    authors = LPA3Callback(preset="authors")
    # the authors' behaviour everywhere a switch restores it (docs/method.md section 7)
    assert (authors.solver.project, authors.solver.max_step, authors.solver.allow_tf32) == (False, None, True)
    assert (authors.selection.initial_selection, authors.selection.threshold_rule,
            authors.selection.initial_memory) == ("all", "authors", "authors")
    # a mapping changes the preset's group only where it says
    mixed = LPA3Callback(preset="authors", solver={"max_step": 1.0})
    assert (mixed.solver.project, mixed.solver.max_step) == (False, 1.0)
    # so does a dataclass (as LightningCLI builds a group from YAML): the fields it changes
    by_dataclass = LPA3Callback(preset="authors", solver=SolverSettings(max_step=1.0))
    assert by_dataclass.solver == mixed.solver
    assert LPA3Callback(cache={"dir": tmp_path}).cache_settings.dir == str(tmp_path)  # a Path is accepted


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
@pytest.mark.parametrize("sync_free", [False, True])
def test_indices_out_of_range_are_refused(tmp_path, sync_free, warmup_epochs):
    callback = LPA3Callback(steps=1, warmup_epochs=warmup_epochs, selection={"num_samples": 10},
                            runtime={"sync_free": sync_free})
    trainer = _trainer(tmp_path, [callback], max_epochs=1)
    with pytest.raises(ValueError, match="LPA3Request.indices` out of range"):
        trainer.fit(TinyClassifier(), _loader())


def test_input_range_auto_uses_the_datamodule_normalization(tmp_path):
    class DM(pl.LightningDataModule):
        normalization = {"mean": [0.5], "std": [0.5]}

        def train_dataloader(self):
            return _loader()

    ranges: list = []
    solve = lpa3_lightning_callback.lpa3_attack

    def spy(model, x, y, **kwargs):
        ranges.append(kwargs["input_range"])
        return solve(model, x, y, **kwargs)

    callback = LPA3Callback(steps=1, seed=0)
    trainer = _trainer(tmp_path, [callback], max_epochs=1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("lpa3_lightning.callback.augment_stage.lpa3_attack", spy)
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


@pytest.mark.parametrize("sync_free", [False, True])
def test_nonfinite_inputs_are_skipped_and_counted(tmp_path, sync_free):
    pl.seed_everything(0)
    module = NanTolerant()
    callback = LPA3Callback(ratio=1.0, steps=1, seed=0, runtime={"sync_free": sync_free})
    trainer = _trainer(tmp_path, [callback], max_epochs=1)
    trainer.fit(module, _with_bad_rows())
    assert float(trainer.callback_metrics["lpa3/nonfinite_inputs"]) == 2.0
    assert sum(module.seen_augmented) == 48 - 2  # ratio 1 before any threshold: all finite rows


@pytest.mark.parametrize("warmup_epochs", [0, 1])
@pytest.mark.parametrize("sync_free", [False, True])
def test_labels_out_of_range_are_refused(tmp_path, sync_free, warmup_epochs):
    data = indexed_images(8)
    xs = torch.stack([data[i][0] for i in range(8)])
    from lpa3_lightning.data import IndexedDataset

    loader = DataLoader(IndexedDataset(TensorDataset(xs, torch.full((8,), 5))), batch_size=4)
    trainer = _trainer(tmp_path, [LPA3Callback(steps=1, warmup_epochs=warmup_epochs, runtime={"sync_free": sync_free})],
                       max_epochs=1)
    with pytest.raises(ValueError, match="Labels out of range"):
        trainer.fit(TinyClassifier(), loader)


def test_batch_of_size_one_trains_without_augmentation(tmp_path):
    module = TinyClassifier()
    callback = LPA3Callback(steps=1)
    trainer = _trainer(tmp_path, [callback], max_epochs=1, limit_train_batches=4)
    trainer.fit(module, DataLoader(indexed_images(8), batch_size=1))
    assert module.seen_augmented == [0, 0, 0, 0]  # a lone selection is dropped
    assert int(callback.tcs.seen.sum()) == 4


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
    assert bool(callback.tcs.seen.all()) and callback.tcs.has_threshold


# ------------------------------------------------------------------- cached augmentations
class RecordsAugmented(TinyClassifier):
    def __init__(self) -> None:
        super().__init__()
        self.received: dict[int, list[torch.Tensor]] = {}

    def training_step(self, batch, batch_idx):
        augmented = self._lpa3_augmented
        if augmented is not None:
            for i, x_adv in zip(augmented.indices.tolist(), augmented.inputs):
                self.received.setdefault(i, []).append(x_adv.clone())
        return super().training_step(batch, batch_idx)


def test_regenerate_every_n_epochs_reuses_x_prime(tmp_path, monkeypatch):
    import lpa3_lightning.callback.augment_stage as callback_module

    attacked: list[int] = []
    original = callback_module.lpa3_attack

    def counting(model, x, y, **kwargs):
        attacked.append(x.shape[0])
        return original(model, x, y, **kwargs)

    monkeypatch.setattr(callback_module, "lpa3_attack", counting)
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
    state = torch.load(ckpt, weights_only=False)["callbacks"]["LPA3Callback"]["augmentation_cache"]
    assert torch.equal(state["storage"], callback.cache.storage) and int(state["written"].min()) == 3


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
        assert torch.equal(received[0], callback.cache.get(torch.tensor([i]))[0])


def test_checkpoint_of_the_first_state_version_still_resumes(tmp_path):
    """A checkpoint written before the cache, RNG and per-epoch keys existed (version 1 state
    with only 'tcs' and 'generator_state') resumes with its TCS memory."""
    pl.seed_everything(0)
    callback = LPA3Callback(ratio=0.5, steps=1, seed=0)
    trainer = _trainer(tmp_path, [callback], max_epochs=1)
    trainer.fit(TinyClassifier(), _loader())
    ckpt = tmp_path / "new.ckpt"
    trainer.save_checkpoint(ckpt)
    checkpoint = torch.load(ckpt, weights_only=False)
    state = checkpoint["callbacks"]["LPA3Callback"]
    checkpoint["callbacks"]["LPA3Callback"] = {"version": 1, "tcs": state["tcs"], "generator_state": None}
    old = tmp_path / "old.ckpt"
    torch.save(checkpoint, old)
    resumed = RecordsStartState(ratio=0.5, steps=1, seed=0, cache={"regenerate_every_n_epochs": 2})
    _trainer(tmp_path, [resumed], max_epochs=2).fit(TinyClassifier(), _loader(), ckpt_path=old)
    assert torch.equal(resumed.start_state["memory"], state["tcs"]["memory"])
    assert bool((resumed.start_written == -1).all())  # the cache starts empty


def test_over_large_cache_goes_to_a_file_under_the_root_dir(tmp_path):
    callback = LPA3Callback(ratio=1.0, steps=1, cache={"regenerate_every_n_epochs": 2, "max_bytes": 0})
    trainer = _trainer(tmp_path, [callback], max_epochs=1)
    seen: list = []

    class WatchesTheFile(pl.Callback):
        def on_train_epoch_end(self, trainer, pl_module):
            path = callback.cache.file
            seen.append((path, path.stat().st_size if path is not None and path.exists() else None))

    trainer = _trainer(tmp_path, [callback, WatchesTheFile()], max_epochs=1)
    trainer.fit(TinyClassifier(), _loader())
    path, size = seen[0]
    assert path is not None and path.parent == tmp_path / "lpa3_cache"
    assert size == 48 * 28 * 28 * 4
    assert path.name.startswith("lpa3_augmentation_cache_")
    assert not path.exists() and callback.cache.file is None  # deleted at the end of fit


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
        state = torch.load(tmp_path / f"{asked}.ckpt", weights_only=False)["callbacks"]["LPA3Callback"]
        sizes[asked] = state["augmentation_cache"]["storage"]
    assert sizes[False] is None
    assert sizes[True] is not None and tuple(sizes[True].shape) == (48, 1, 28, 28)


def test_a_second_fit_with_the_same_callback_updates_tcs_from_its_first_epoch(tmp_path):
    callback = LPA3Callback(ratio=0.5, steps=1, seed=0)
    _trainer(tmp_path, [callback], max_epochs=2).fit(TinyClassifier(), _loader())
    scores_after_first = callback.tcs.scores.clone()
    updates: list[int] = []
    original = callback.tcs.update

    class CountsUpdates(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            def counting(indices, probs, targets=None):
                updates.append(int(indices.numel()))
                return callback.tcs.__class__.update(callback.tcs, indices, probs, targets)
            callback.tcs.update = counting

    second = _trainer(tmp_path, [callback, CountsUpdates()], max_epochs=1)
    second.fit(TinyClassifier(), _loader())
    assert sum(updates) == 48  # every sample of the second fit's epoch 0 reached the memory
    assert not torch.equal(callback.tcs.scores, scores_after_first)
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
    assert bool(torch.isfinite(callback.tcs.scores).all()) and bool(torch.isfinite(callback.tcs.memory).all())
    assert int(callback.tcs.seen.sum()) == 48 - 3 and callback.tcs.has_threshold
    assert float(trainer.callback_metrics["lpa3/nonfinite_predictions"]) == 3.0  # per epoch


def test_compiled_model_with_named_layers_in_a_trainer(tmp_path):
    module = TinyClassifier(twin_bn=False)
    module.model = torch.compile(module.model)

    x, y = torch.randn(4, 1, 28, 28), torch.tensor([0, 1, 2, 0])

    def solve(model, layers):
        callback = LPA3Callback(steps=1, layers=layers, seed=0, input_range=None)
        # the callback resolves names on the eager module behind the compiled wrapper
        callback.setup(_trainer(tmp_path, [], max_epochs=1), module, "fit")
        generator = torch.Generator().manual_seed(0)
        return callback._runners[None].augmenter.solve(module, model, x, y, generator, "eval")[0]

    x_adv = solve(module.model, ["4"])
    eager = module.model._orig_mod
    torch.testing.assert_close(x_adv, solve(eager, ["4"]), rtol=0, atol=1e-5)  # the compiled model's x'
    assert float((x_adv - solve(eager, ["0"])).abs().max()) > 1e-4  # the named layer is the one used


def _augment_rows(callback, trainer, module, request):
    """The augment stage alone on every row of ``request`` (as if TCS had selected them all)."""
    from lpa3_lightning.callback.selection_stage import Selection

    runner, n, epoch = callback._runners[None], request.inputs.shape[0], trainer.current_epoch
    selection = Selection(torch.ones(n, dtype=torch.bool), n, n, n, 0)
    return runner.augmenter.augment(module, request, selection, runner.cache, epoch, runner._solver_runs(epoch))


def test_one_new_sample_among_cached_ones_waits(tmp_path):
    callback = LPA3Callback(ratio=1.0, steps=1, cache={"regenerate_every_n_epochs": 3})
    module = TinyClassifier()
    trainer = _trainer(tmp_path, [callback], max_epochs=1, limit_train_batches=1)
    trainer.fit(module, _loader(16, 16, shuffle=False))
    callback.cache.written[1:16] = 0
    callback.cache.labels[1:16] = 0  # solved for the labels of the request below
    callback.cache.written[0] = -1  # only sample 0 would need the solver
    from lpa3_lightning.core.augmented import LPA3Request

    request = LPA3Request(torch.randn(16, 1, 28, 28), torch.zeros(16, dtype=torch.long), torch.arange(16))
    augmented, _ = _augment_rows(callback, trainer, module, request)
    assert len(augmented) == 15 and augmented.reused == 15 and not bool(augmented.mask[0])


def test_a_cached_x_prime_is_reused_only_for_the_label_it_was_solved_for(tmp_path):
    callback = LPA3Callback(ratio=1.0, steps=1, cache={"regenerate_every_n_epochs": 3})
    module = TinyClassifier()
    trainer = _trainer(tmp_path, [callback], max_epochs=1, limit_train_batches=1)
    trainer.fit(module, _loader(16, 16, shuffle=False))
    callback.cache.written[:16] = 0
    callback.cache.labels[:16] = 0  # every entry solved for label 0
    from lpa3_lightning.core.augmented import LPA3Request

    targets = torch.tensor([0, 1] * 8)  # pseudo-labels moved on for half of them
    request = LPA3Request(torch.randn(16, 1, 28, 28), targets, torch.arange(16))
    augmented, new_rows = _augment_rows(callback, trainer, module, request)
    assert augmented.reused == 8  # only the label-0 entries were reused
    assert new_rows is not None and sorted(new_rows[0].tolist()) == list(range(1, 16, 2))  # the others re-solved
    assert torch.equal(new_rows[2], torch.ones(8, dtype=torch.long))


def test_fast_solver_in_a_trainer_reaches_the_attack(tmp_path, monkeypatch):
    import lpa3_lightning.callback.augment_stage as callback_module

    seen = []
    original = callback_module.lpa3_attack
    monkeypatch.setattr(callback_module, "lpa3_attack",
                        lambda *a, **k: seen.append(k["fast"]) or original(*a, **k))
    pl.seed_everything(0)
    module = TinyClassifier()
    trainer = _trainer(tmp_path, [LPA3Callback(ratio=0.5, steps=3, seed=0, solver={"fast": True})], max_epochs=2)
    trainer.fit(module, _loader())
    assert seen and all(seen) and sum(module.seen_augmented) > 0
    with pytest.raises(ValueError, match="fast"):
        LPA3Callback(solver={"fast": "yes"})


def test_max_step_reaches_the_solver(tmp_path, monkeypatch):
    import lpa3_lightning.callback.augment_stage as callback_module

    seen = []
    real = callback_module.lpa3_attack

    def spy(*args, **kwargs):
        seen.append((kwargs["max_step"], kwargs["allow_tf32"]))
        return real(*args, **kwargs)

    monkeypatch.setattr(callback_module, "lpa3_attack", spy)
    pl.seed_everything(0)
    trainer = _trainer(tmp_path, [LPA3Callback(ratio=1.0, steps=1, solver={"max_step": 0.25, "allow_tf32": True})], max_epochs=1)
    trainer.fit(TinyClassifier(), _loader())
    assert seen and set(seen) == {(0.25, True)}


@pytest.mark.parametrize("attack_new", [True, False])
def test_attack_new_selections_false_runs_the_solver_in_regeneration_epochs_only(tmp_path, monkeypatch, attack_new):
    import lpa3_lightning.callback.augment_stage as callback_module

    attacked_per_epoch: dict[int, int] = {}
    original = callback_module.lpa3_attack

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

    def counting(model, x, y, **kwargs):
        attacked_per_epoch[counter.epoch] = attacked_per_epoch.get(counter.epoch, 0) + x.shape[0]
        return original(model, x, y, **kwargs)

    monkeypatch.setattr(callback_module, "lpa3_attack", counting)
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
    assert int(callback.cache.written.max()) == 0  # written in the regeneration epoch 0 only
    assert not callback._runners[None].regeneration_epoch(1) and not callback._runners[None].regeneration_epoch(3)
    assert callback._runners[None].regeneration_epoch(4)
    callback.cache.written.fill_(-1)  # what a restarted file cache holds
    assert callback._runners[None].regeneration_epoch(2)
    callback.cache.written[:5] = 2  # entries of the current epoch do not count as reusable
    assert callback._runners[None].regeneration_epoch(2) and not callback._runners[None].regeneration_epoch(3)


def test_a_lone_cached_x_prime_is_not_trained_alone(tmp_path):
    callback = LPA3Callback(ratio=1.0, steps=1, cache={"regenerate_every_n_epochs": 3})
    module = TinyClassifier()
    trainer = _trainer(tmp_path, [callback], max_epochs=1, limit_train_batches=1)
    trainer.fit(module, _loader(16, 16, shuffle=False))
    callback.cache.written[:] = -1
    callback.cache.written[0] = 0  # sample 0 cached, sample 1 new (a lone new one waits)
    from lpa3_lightning.core.augmented import LPA3Request

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

    import lpa3_lightning.callback.augment_stage as callback_module

    real = callback_module.lpa3_attack
    monkeypatch.setattr(callback_module, "lpa3_attack", lambda *a, **k: solved.append(1) or real(*a, **k))
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
