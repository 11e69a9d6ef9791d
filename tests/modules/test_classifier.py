"""LPA3Classifier (supervised mixin, MedMNIST metrics) and the README's custom-module example."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from sklearn.metrics import roc_auc_score
from torch.utils.data import DataLoader

from lpa3_lightning import LPA3Callback, LPA3Classifier
from lpa3_lightning.core.dual_bn import has_dual_bn
from lpa3_lightning.mixins import SupervisedSettings, split_indexed_batch
from tests.helpers import handed_over, indexed_images, small_cnn

ROOT = Path(__file__).resolve().parents[2]


def test_builds_the_paper_backbones_with_twin_bn():
    module = LPA3Classifier(arch="resnet18", in_channels=3, num_classes=5)
    assert has_dual_bn(module.model) and module.lpa3_num_classes == 5
    assert tuple(module(torch.zeros(2, 3, 28, 28)).shape) == (2, 5)
    assert not has_dual_bn(LPA3Classifier(twin_bn=False).model)
    with pytest.raises(ValueError, match="arch"):
        LPA3Classifier(arch="vgg")
    with pytest.raises(ValueError, match="lr"):
        LPA3Classifier(lr=0)


def test_loss_is_clean_plus_augmented_cross_entropy_through_the_twin():
    torch.manual_seed(0)
    module = LPA3Classifier(model=small_cnn(num_classes=3), num_classes=3)
    module.train()
    x, y, idx = torch.randn(4, 1, 28, 28), torch.tensor([0, 1, 2, 0]), torch.arange(4)
    from lpa3_lightning.core.forward_modes import label_log_prob

    x_adv = x[:2] + 0.1
    _, statistics = label_log_prob(module.model, x[:2], y[:2], bn_mode="twin")  # as the callback captures them
    module.lpa3_set_augmented(handed_over(module, x_adv, y[:2], idx[:2], torch.tensor([True, True, False, False]),
                                          bn_mode="twin", statistics=statistics))
    main_mean = module.model[1].running_mean.clone()
    twin_mean = module.model[1].twin.running_mean.clone()
    loss, logits, parts = module.lpa3_supervised_loss((x, y, idx))
    clean = torch.nn.functional.cross_entropy(logits, y)
    torch.testing.assert_close(parts["loss_clean"], clean.detach())
    torch.testing.assert_close(loss.detach(), parts["loss_clean"] + parts["loss_aug"])
    assert int(parts["num_augmented"]) == 2 and float(parts["loss_aug"]) > 0
    # x' trained through the twins on the clean selected samples' statistics: an eval-mode copy
    # whose twins carry those statistics as running statistics gives the same loss (no dropout)
    import copy

    ref = copy.deepcopy(module.model).eval()
    for layer, (mean, var) in zip([m for m in ref.modules() if hasattr(m, "twin")], statistics.values):
        layer.twin.running_mean.copy_(mean)
        layer.twin.running_var.copy_(var)
        layer._route_twin = True
    with torch.no_grad():
        expected = torch.nn.functional.cross_entropy(ref(x_adv), y[:2])
    torch.testing.assert_close(parts["loss_aug"], expected, atol=1e-5, rtol=1e-5)
    # main BN moved once (clean batch only); the twins' running statistics stay (frozen statistics)
    assert not torch.equal(module.model[1].running_mean, main_mean)
    assert torch.equal(module.model[1].twin.running_mean, twin_mean)
    assert module.lpa3_take_augmented() is None  # consumed
    recorded = module.lpa3_pop_predictions()
    assert recorded is not None and torch.equal(recorded[0], idx)


def test_the_supervised_settings_weigh_the_hard_positives_and_come_back_from_a_checkpoint(tmp_path):
    torch.manual_seed(0)
    module = LPA3Classifier(model=small_cnn(num_classes=3), num_classes=3, supervised=SupervisedSettings(weight=0.25))
    assert module.hparams["supervised"] == {"train_forward": "verified", "weight": 0.25}  # the fields, plain values
    from lpa3_lightning.core.forward_modes import label_log_prob

    x, y, idx = torch.randn(4, 1, 28, 28), torch.tensor([0, 1, 2, 0]), torch.arange(4)
    _, statistics = label_log_prob(module.model, x[:2], y[:2], bn_mode="twin")
    module.lpa3_set_augmented(handed_over(module, x[:2] + 0.1, y[:2], idx[:2], torch.tensor([True, True, False, False]),
                                          bn_mode="twin", statistics=statistics))
    loss, _, parts = module.lpa3_supervised_loss((x, y, idx))
    torch.testing.assert_close(loss.detach(), parts["loss_clean"] + 0.25 * parts["loss_aug"])
    trainer = pl.Trainer(max_epochs=1, limit_train_batches=1, accelerator="cpu", default_root_dir=tmp_path,
                         logger=False, enable_progress_bar=False, enable_checkpointing=False)
    trainer.fit(module, DataLoader(indexed_images(8), batch_size=4))
    trainer.save_checkpoint(tmp_path / "m.ckpt")
    restored = LPA3Classifier.load_from_checkpoint(tmp_path / "m.ckpt", model=small_cnn(num_classes=3))
    assert restored.lpa3_settings == SupervisedSettings(weight=0.25)
    with pytest.raises(ValueError, match="`supervised.weight` must be a finite number >= 0, got -1"):
        LPA3Classifier(supervised={"weight": -1})


def test_validation_metrics_are_medmnist_acc_and_auc(tmp_path):
    pl.seed_everything(0)
    module = LPA3Classifier(model=small_cnn(num_classes=3), num_classes=3, milestones=[1])
    data = indexed_images(30)
    trainer = pl.Trainer(max_epochs=1, accelerator="cpu", default_root_dir=tmp_path, logger=False,
                         enable_progress_bar=False, enable_checkpointing=False,
                         callbacks=[LPA3Callback(steps=1)])
    trainer.fit(module, DataLoader(data, batch_size=10, shuffle=True))
    results = trainer.validate(module, DataLoader(data, batch_size=7))[0]
    module.eval()
    with torch.no_grad():
        batch = next(iter(DataLoader(data, batch_size=30)))
        x, y, _ = split_indexed_batch(batch)
        probs = module(x).softmax(1)
    assert results["val/acc"] == pytest.approx(float((probs.argmax(1) == y).float().mean()), abs=1e-6)
    assert results["val/auc"] == pytest.approx(roc_auc_score(y.numpy(), probs.numpy(), multi_class="ovr"), abs=1e-4)


def test_split_indexed_batch_accepts_dicts_and_refuses_pairs():
    x, y, i = torch.zeros(2, 1), torch.zeros(2), torch.arange(2)
    assert split_indexed_batch({"input": x, "target": y, "index": i})[2] is i
    with pytest.raises(ValueError, match="IndexedDataset"):
        split_indexed_batch((x, y))
    with pytest.raises(ValueError, match="IndexedDataset"):
        split_indexed_batch({"input": x, "target": y})


def test_readme_custom_module_example_runs(tmp_path):
    spec = importlib.util.spec_from_file_location("custom_module", ROOT / "examples" / "custom_module.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    logged = example.main(max_epochs=2, limit_train_batches=2, default_root_dir=str(tmp_path))
    assert logged["lpa3/label_preserved_epoch"] >= 0.99  # measured in the training forward
    assert 0 < logged["lpa3/selected_fraction_epoch"] <= 1.0
