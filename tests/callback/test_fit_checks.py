"""Several networks in one module: the declaration is validated and each view forwards to its network."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from lpa3_lightning import LPA3Callback, LPA3Request, convert_dual_bn
from lpa3_lightning.callback.fit_checks import NetworkView, module_networks
from lpa3_lightning.callback.hard_positives import VerifiedForward
from lpa3_lightning.methods.base import AugmentedBatch
from lpa3_lightning.core.forward_modes import running_statistics
from lpa3_lightning.mixins import LPA3ModuleMixin
from tests.helpers import indexed_images, small_cnn


class Two(LPA3ModuleMixin, nn.Module):
    def __init__(self, names=("a", "b")) -> None:
        super().__init__()
        self.names = names
        self.nets = nn.ModuleDict({"a": nn.Linear(2, 3), "b": nn.Linear(2, 3)})
        self.lpa3_num_classes = 3

    def lpa3_networks(self):
        return self.names

    def lpa3_model(self, network=None):
        return self.nets[network]


def test_a_module_without_the_declaration_has_one_network():
    assert module_networks(nn.Linear(2, 2)) is None
    assert module_networks(LPA3ModuleMixin()) is None  # the mixin's default


@pytest.mark.parametrize("names", [(), ("a", "a"), ("a", ""), ("a/b",), ("a", 3)])
def test_bad_network_names_are_refused_with_the_fix(names):
    with pytest.raises(ValueError, match="distinct non-empty names"):
        module_networks(Two(names))


def test_each_view_hands_over_to_its_own_network():
    module = Two()
    a, b = NetworkView(module, "a"), NetworkView(module, "b")
    assert a.lpa3_model() is module.nets["a"] and b.lpa3_model() is module.nets["b"]
    x = torch.randn(4, 2)
    augmented = AugmentedBatch(inputs=x, targets=torch.zeros(4, dtype=torch.long), indices=torch.arange(4),
                               mask=torch.ones(4, dtype=torch.bool))
    # the callback attaches the forward of the network it solved on (here a, in eval mode)
    augmented.verified = VerifiedForward(a.lpa3_model(), module.lpa3_logits, "eval", running_statistics(module.nets["a"]),
                                         None, False)
    a.lpa3_set_augmented(augmented)
    assert module.lpa3_take_augmented(network="b") is None and module.lpa3_take_augmented() is None
    assert module.lpa3_take_augmented(network="a") is augmented
    module.lpa3_record_predictions(torch.arange(4), torch.randn(4, 3), network="b")
    assert a.lpa3_pop_predictions() is None and b.lpa3_pop_predictions()[0].tolist() == [0, 1, 2, 3]
    logits = module.lpa3_forward_augmented(augmented)  # through the batch's own network
    assert torch.allclose(logits, module.nets["a"](x))
    assert augmented.verified.logits is not None  # (kept for lpa3/label_preserved)
    assert a.lpa3_num_classes == 3 and "network='a'" in repr(a)  # everything else is the module's


class ReadmeCoTraining(LPA3ModuleMixin, pl.LightningModule):
    """The README's module with several networks, as written there."""

    def __init__(self) -> None:
        super().__init__()
        self.net1, self.net2 = convert_dual_bn(small_cnn()), convert_dual_bn(small_cnn())
        self.lpa3_num_classes = 3
        self.trained_augmented = {"net1": 0, "net2": 0}

    def lpa3_networks(self):
        return ("net1", "net2")

    def lpa3_model(self, network=None):
        return self.net1 if network == "net1" else self.net2

    def lpa3_request(self, batch, network=None):
        x, y, idx = batch
        return LPA3Request(inputs=x, targets=y, indices=idx)

    def training_step(self, batch, batch_idx):
        x, y, idx = batch
        loss = 0
        for name in ("net1", "net2"):
            logits = self.lpa3_model(name)(x)
            self.lpa3_record_predictions(idx, logits, network=name)
            loss = loss + F.cross_entropy(logits, y)
            augmented = self.lpa3_take_augmented(network=name)
            if augmented is not None and len(augmented):
                self.trained_augmented[name] += len(augmented)
                loss = loss + F.cross_entropy(self.lpa3_forward_augmented(augmented), augmented.targets)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def test_the_readme_module_with_two_networks_trains_with_one_callback(tmp_path):
    pl.seed_everything(0)
    module, callback = ReadmeCoTraining(), LPA3Callback(ratio=0.5, steps=2, seed=0, input_range=None)
    trainer = pl.Trainer(max_epochs=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                         callbacks=[callback])
    trainer.fit(module, DataLoader(indexed_images(48), batch_size=16, shuffle=True))
    assert all(count > 0 for count in module.trained_augmented.values()), module.trained_augmented
    assert all(bool(c.tcs.seen.all()) for c in callback.networks.values())
    for name in ("net1", "net2"):
        assert float(trainer.callback_metrics[f"lpa3/{name}/label_preserved_epoch"]) == pytest.approx(1.0)
