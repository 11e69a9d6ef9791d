"""The runnable examples of examples/ (FixMatch, PES, DivideMix in a module of one's own) train a few
steps on the CPU with LP-A3, and PES's refine phase trains the head alone.

(examples/custom_module.py is run by tests/modules/test_classifier.py.) Each run uses ``ratio=1.0``: a
4-step run's memory has seen a few hundred of the 4,000 training samples, and the threshold of the
default ratio leaves most of the unseen ones out, so a batch could get no ``x'`` by chance; with
ratio 1 every offered row is attacked, and the assertions test that the callback solved, the loss
trained and the memory learned, not the selection rule.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from types import ModuleType

import lightning.pytorch as pl
import torch

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"lpa3_example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_fixmatch_example_trains_hard_positives_after_its_loss_warm_up(tmp_path):
    # epoch 0: the LP-A3 loss warm-up (nothing solved); epoch 1: x' of every unlabeled row whose
    # pseudo-label is at least 0 sure, i.e. all of them (an untrained net is never 0.9 sure)
    logged = _load("fixmatch").main(max_epochs=2, limit_train_batches=2, default_root_dir=str(tmp_path), ratio=1.0,
                                    loss_warmup_epochs=1, confidence_threshold=0.0)
    assert logged["lpa3/selected_fraction_epoch"] > 0  # the last epoch's: the one after the warm-up
    assert logged["train/num_augmented"] > 0 and logged["train/loss_lpa3"] > 0
    assert logged["lpa3/label_preserved_epoch"] >= 0.99  # in the forward that trained the x'
    assert math.isfinite(logged["train/loss"])
    assert 7 * 32 <= logged["tcs_seen"] <= 4000  # the unlabeled stream's weak-view logits fed the memory


def test_pes_example_attacks_in_the_semi_phase(tmp_path):
    # one step each: early (epoch 0), refine (1), semi (2, 3)
    logged = _load("pes").main(max_epochs=4, limit_train_batches=1, default_root_dir=str(tmp_path), ratio=1.0,
                               early_epochs=1, refine_epochs=1)
    assert logged["train/unlabeled_weight"] > 0  # the last step was in the semi phase
    assert logged["lpa3/selected_fraction_epoch"] > 0
    assert logged["train/num_augmented"] > 0 and logged["train/loss_lpa3"] > 0
    assert logged["lpa3/label_preserved_epoch"] >= 0.99
    assert 0 < logged["train/labeled_share"] < 1  # the agreement split has both sides
    assert math.isfinite(logged["train/loss"])
    assert 64 <= logged["tcs_seen"] <= 4000


class _ParametersAtEpochStart(pl.Callback):
    """The module's parameters at the start of each epoch (callbacks run before the module's hook,
    so before the head is re-initialised) and at the end of the fit."""

    def __init__(self) -> None:
        self.at_start: list[dict[str, torch.Tensor]] = []
        self.at_end: dict[str, torch.Tensor] = {}

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self.at_start.append({n: p.detach().clone() for n, p in pl_module.named_parameters()})

    def on_train_end(self, trainer, pl_module) -> None:
        self.at_end = {n: p.detach().clone() for n, p in pl_module.named_parameters()}


def test_pes_example_refine_phase_trains_the_new_head_alone(tmp_path):
    example = _load("pes")
    from lpa3_lightning.data import NoisyLabelDataModule

    pl.seed_everything(0)
    datamodule = NoisyLabelDataModule("mnist5k", noise_rate=0.5, batch_size=32)
    module = example.MyPES(datamodule.num_train, datamodule.num_classes, early_epochs=1, refine_epochs=1)
    snapshots = _ParametersAtEpochStart()
    trainer = pl.Trainer(max_epochs=2, limit_train_batches=2, limit_val_batches=0, accelerator="cpu", logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[snapshots], default_root_dir=str(tmp_path))
    trainer.fit(module, datamodule=datamodule)
    head_ids = {id(p) for p in module.pes_head().parameters()}
    head = {n for n, p in module.named_parameters() if id(p) in head_ids}
    assert head == {"net.fc.weight", "net.fc.bias"}  # the mixin's default head: the last nn.Linear
    initial, early_end = snapshots.at_start
    assert any(not torch.equal(initial[n], early_end[n]) for n in early_end if n not in head)  # T1 trained the body
    for name, value in snapshots.at_end.items():
        if name in head:
            assert not torch.equal(value, early_end[name]), name  # re-initialised, then trained by Adam
        else:
            assert torch.equal(value, early_end[name]), name  # the refine phase left the rest as T1 did


def test_dividemix_example_attacks_each_network_after_the_warm_up(tmp_path):
    # epoch 0: the cross-entropy warm-up; epoch 1: co-divide and MixMatch with each network's x'
    logged = _load("dividemix").main(max_epochs=2, limit_train_batches=2, default_root_dir=str(tmp_path), ratio=1.0,
                                     warmup_epochs=1)
    assert math.isfinite(logged["train/loss"])
    for net in ("net1", "net2"):
        assert logged[f"train/{net}/unlabeled_weight"] > 0  # the last step was in the semi phase
        assert logged[f"lpa3/{net}/selected_fraction_epoch"] > 0
        assert logged[f"train/{net}/num_augmented"] > 0 and logged[f"train/{net}/loss_lpa3"] > 0
        assert logged[f"lpa3/{net}/label_preserved_epoch"] >= 0.99
        assert 64 <= logged[f"tcs_seen/{net}"] <= 4000  # each network's own memory


def test_own_fixmatch_loss_example_trains_hard_positives_from_plain_tensors(tmp_path):
    """examples/fixmatch_own_loss.py: the base mixin with its own FixMatch loss, tensors wrapped
    in LabeledDataset / UnlabeledDataset, pseudo-labels from the train-mode weak forward."""
    logged = _load("fixmatch_own_loss").main(max_epochs=2, limit_train_batches=2, default_root_dir=str(tmp_path),
                                             ratio=1.0, loss_warmup_epochs=1)
    assert logged["lpa3/selected_fraction_epoch"] > 0 and logged["train/loss_lpa3"] > 0
    assert logged["lpa3/label_preserved_epoch"] >= 0.99
    assert logged["tcs_seen"] >= 2 * 2 * 7 * 16 * 0.9  # the weak views of 2 epochs x 2 steps fed the memory
    assert math.isfinite(logged["train/loss"])


def test_tabular_example_moves_rows_inside_the_feature_box(tmp_path):
    """examples/tabular.py: an MLP on 30 standardised features; the x' keep their label as trained
    and stay within each feature's training range (re-checked here on every x')."""
    example = _load("tabular")
    seen = []

    class Records(example.LPA3Callback):
        def on_augmented(self, trainer, pl_module, augmented):
            seen.append(augmented.inputs.clone())

    original, example.LPA3Callback = example.LPA3Callback, Records
    try:
        logged = example.main(lpa3=True, seed=0, max_epochs=3, default_root_dir=str(tmp_path))
    finally:
        example.LPA3Callback = original
    features = example.tabular_data(0)[0].tensors[0]
    low, high = features.min(0).values, features.max(0).values
    rows = torch.cat(seen)
    assert len(rows) > 0 and bool(((rows >= low - 1e-6) & (rows <= high + 1e-6)).all())
    assert logged["lpa3/label_preserved_epoch"] >= 0.99 and logged["lpa3/perceptual_distance_epoch"] > 1e-3
    assert 0.8 < logged["test/acc"] <= 1.0  # (the baseline MLP reaches about 0.97)
