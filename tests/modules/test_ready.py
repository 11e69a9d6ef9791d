"""The ready modules' saved network and hyper-parameters: a network given through ``model`` (as a
class-path config, by ``lpa3 fit`` or from Python, or as an object) and a subclass of a ready module
come back from their checkpoints, or fail with the fix."""

from __future__ import annotations

from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.core.mixins.hparams_mixin import _given_hyperparameters_context
from torch import nn

from lpa3_lightning import DivideMixClassifier, FixMatchClassifier, LPA3Classifier, PESClassifier
from lpa3_lightning.cli import main

NET = "tests.modules.test_ready.Net"


class Net(nn.Module):
    """A user's network with its own arguments (1x28x28 inputs)."""

    def __init__(self, in_channels: int = 1, num_classes: int = 3, width: int = 4) -> None:
        super().__init__()
        self.width = width
        self.body = nn.Sequential(nn.Conv2d(in_channels, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
                                  nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class WideClassifier(LPA3Classifier):
    """A user's subclass of a ready module: its own argument builds the network, the recipe is the parent's."""

    def __init__(self, width: int = 4) -> None:
        super().__init__(in_channels=1, num_classes=3, weight_decay=1e-4, model=Net(1, 3, width))


def _save(module: pl.LightningModule, path) -> str:
    """The checkpoint ``trainer.save_checkpoint`` writes, without a fit: weights, hyper-parameters, hooks."""
    checkpoint = {"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams),
                  "pytorch-lightning_version": pl.__version__}
    module.on_save_checkpoint(checkpoint)
    torch.save(checkpoint, path)
    return str(path)


def _same_weights(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


READY = {"LPA3Classifier": (LPA3Classifier, {}),
         "FixMatchClassifier": (FixMatchClassifier, {}),
         "PESClassifier": (PESClassifier, {"num_samples": 16})}


@pytest.mark.parametrize("name", list(READY))
def test_a_network_given_as_a_class_path_config_comes_back_from_the_checkpoint(tmp_path, name):
    cls, kwargs = READY[name]
    spec = {"class_path": NET, "init_args": {"width": 6}}
    module = cls(in_channels=1, num_classes=3, model=spec, **kwargs)
    assert isinstance(module.model, Net) and module.model.width == 6
    assert module.hparams["model"] == spec  # kept, as plain values (hparams.yaml, TensorBoard)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn_like(p))
    restored = cls.load_from_checkpoint(_save(module, tmp_path / "m.ckpt"))
    assert isinstance(restored.model, Net) and restored.model.width == 6
    assert _same_weights(restored, module)


@pytest.mark.parametrize("name", list(READY))
def test_a_network_given_as_an_object_is_asked_for_again_by_name_on_load(tmp_path, name):
    cls, kwargs = READY[name]
    module = cls(in_channels=1, num_classes=3, model=Net(width=6), **kwargs)
    assert "model" not in module.hparams  # Lightning's rule: a module object is not a hyper-parameter
    ckpt = _save(module, tmp_path / "m.ckpt")
    with pytest.raises(ValueError, match=rf"`model`.*{NET.rsplit('.', 1)[0]}\.Net.*Fix: .*load_from_checkpoint\(.*"
                                         r"model=.*class_path"):
        cls.load_from_checkpoint(ckpt)
    restored = cls.load_from_checkpoint(ckpt, model=Net(width=6))
    assert _same_weights(restored, module)


def test_a_torchvision_resnet_given_as_an_object_is_asked_for_again_though_arch_builds_the_same_class(tmp_path):
    """The issue's case from Python: ``arch`` builds torchvision's ResNet class too, so the class alone does not
    tell the networks apart (the load ended in a size mismatch)."""
    import torchvision

    from lpa3_lightning.modules.classifier import NetworkNotSavedError

    ckpt = _save(LPA3Classifier(num_classes=2, model=torchvision.models.resnet18(num_classes=2)), tmp_path / "m.ckpt")
    with pytest.raises(NetworkNotSavedError, match=r"torchvision\.models\.resnet\.ResNet, was given .* as an object"):
        LPA3Classifier.load_from_checkpoint(ckpt)


def test_a_network_object_that_arch_builds_alike_still_loads_without_being_passed_again(tmp_path):
    """An object whose weights fit the network ``arch`` builds (the same class and shapes) loads as before."""
    from lpa3_lightning.models.resnet import medmnist_resnet

    module = LPA3Classifier(num_classes=2, model=medmnist_resnet("resnet18", 1, 2))
    assert _same_weights(LPA3Classifier.load_from_checkpoint(_save(module, tmp_path / "m.ckpt")), module)


def test_a_model_that_is_neither_a_network_nor_a_config_is_refused_by_name():
    with pytest.raises(TypeError, match=r"`model` must be an nn.Module or a class-path config.*got str.*Fix"):
        LPA3Classifier(model="resnet18")
    with pytest.raises(ValueError, match=r"`model`.*no\.such\.Net.*Fix"):
        LPA3Classifier(model={"class_path": "no.such.Net"})


def _fit(tmp_path, model: list[str], *extra: str) -> str:
    """``lpa3 fit`` for two steps on the tests' own data module; the last checkpoint it wrote."""
    main(["fit", *model, "--data", "tests.cli.test_show.Digits", "--trainer.limit_train_batches=2",
          "--trainer.limit_val_batches=0", "--trainer.accelerator=cpu", f"--trainer.default_root_dir={tmp_path}",
          "--trainer.logger=false", "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
          "--trainer.callbacks+=lpa3_lightning.LPA3Callback", "--trainer.callbacks.init_args.steps=1",
          "--trainer.callbacks.init_args.input_range=null", *extra])
    return str(max(tmp_path.rglob("*.ckpt"), key=lambda p: p.stat().st_mtime))


def test_lpa3_fit_with_a_class_path_network_saves_it_and_resumes(tmp_path):
    """``model: {class_path: ...}`` in a LightningCLI config: the checkpoint rebuilds the user's network
    (it rebuilt the package's ResNet: a size mismatch), and ``lpa3 fit --ckpt_path`` resumes it."""
    model = ["--model", "lpa3_lightning.LPA3Classifier", "--model.init_args.num_classes=3",
             "--model.init_args.model", NET, "--model.init_args.model.init_args.width=5"]
    ckpt = _fit(tmp_path / "a", model, "--trainer.max_epochs=1")
    restored = LPA3Classifier.load_from_checkpoint(ckpt)
    assert isinstance(restored.model, Net) and restored.model.width == 5
    assert _same_weights(restored, LPA3Classifier.load_from_checkpoint(ckpt))
    resumed = _fit(tmp_path / "a", model, "--trainer.max_epochs=2", f"--ckpt_path={ckpt}")
    assert torch.load(resumed, weights_only=False)["epoch"] == 1


def test_a_subclass_of_a_ready_module_fits_from_the_command_line_and_its_checkpoint_loads(tmp_path):
    """``lpa3 fit --model my.Subclass``: LightningCLI saves only the subclass's arguments, and the parent's
    recipe (``num_classes``, ``weight_decay``, ...) was read from them (a KeyError)."""
    model = ["--model", "tests.modules.test_ready.WideClassifier", "--model.init_args.width=6"]
    ckpt = _fit(tmp_path, model, "--trainer.max_epochs=1")
    checkpoint = torch.load(ckpt, weights_only=False)
    assert checkpoint["optimizer_states"][0]["param_groups"][0]["weight_decay"] == 1e-4  # the parent's recipe
    restored = WideClassifier.load_from_checkpoint(ckpt)
    assert restored.model.width == 6 and _same_weights(restored, WideClassifier.load_from_checkpoint(ckpt))
    resumed = _fit(tmp_path, model, "--trainer.max_epochs=2", f"--ckpt_path={ckpt}")
    assert torch.load(resumed, weights_only=False)["epoch"] == 1


def test_a_subclass_built_from_python_loads_from_its_checkpoint(tmp_path):
    module = WideClassifier(width=6)
    restored = WideClassifier.load_from_checkpoint(_save(module, tmp_path / "m.ckpt"))
    assert restored.model.width == 6 and _same_weights(restored, module)


def _subclass(cls: type, **parent: object) -> type:
    def __init__(self, tag: int = 1) -> None:
        cls.__init__(self, in_channels=1, num_classes=3, weight_decay=1e-3, **parent)

    return type(f"Own{cls.__name__}", (cls,), {"__init__": __init__})


@pytest.mark.parametrize("cls, parent", [(LPA3Classifier, {}), (FixMatchClassifier, {}),
                                         (PESClassifier, {"num_samples": 16}),
                                         (DivideMixClassifier, {"num_samples": 16})],
                         ids=lambda v: getattr(v, "__name__", ""))
def test_each_ready_module_reads_its_recipe_when_the_cli_saved_only_a_subclasss_arguments(cls, parent):
    """What LightningCLI gives ``save_hyperparameters`` for a subclass: the subclass's own arguments. The
    hyper-parameters keep just those (so ``--ckpt_path`` re-parses them), the recipe is still the parent's."""
    own = _subclass(cls, **parent)
    given = {"_class_path": f"{own.__module__}.{own.__qualname__}", "tag": 2}
    with _given_hyperparameters_context(hparams=given, instantiator="lightning.pytorch.cli.instantiate_module"):
        module = own(tag=2)
    assert set(module.hparams) <= {"_class_path", "_instantiator", "tag"}
    datamodule = SimpleNamespace(num_classes=3, in_channels=1, num_train=16, num_unlabeled=16)
    module._trainer = SimpleNamespace(datamodule=datamodule, max_epochs=4, estimated_stepping_batches=8)
    module.setup("fit")  # compares num_classes and in_channels with the data module's (it raised a KeyError)
    optimizers = module.configure_optimizers()
    first = optimizers[0][0] if isinstance(optimizers, tuple) else optimizers["optimizer"]
    assert max(group["weight_decay"] for group in first.param_groups) == 1e-3


def test_the_backbones_by_name_and_an_unknown_arch_listing_the_choices():
    from lpa3_lightning.models import PreActResNet, SmallCNN, WideResNet
    from lpa3_lightning.modules.fixmatch_classifier import ARCHS, build_ssl_backbone  # (where they were imported from)
    from lpa3_lightning.modules.ready import build_ssl_backbone as shared

    assert shared is build_ssl_backbone
    kinds = {"small_cnn": SmallCNN, "wrn28_2": WideResNet, "wrn28_8": WideResNet, "wrn37_2": WideResNet,
             "preact_resnet18": PreActResNet}
    assert set(ARCHS) == set(kinds)
    for arch in ("small_cnn", "wrn28_2", "preact_resnet18"):
        net = build_ssl_backbone(arch, 1, 4)
        assert isinstance(net, kinds[arch]) and tuple(net(torch.zeros(2, 1, 32, 32)).shape) == (2, 4)
    with pytest.raises(ValueError, match=r"`arch` must be one of .*'wrn37_2'.*got 'vgg'.*Fix"):
        build_ssl_backbone("vgg", 1, 4)


@pytest.mark.parametrize("cls, kwargs, match", [
    (LPA3Classifier, {"lr": 0.0}, r"`lr` must be > 0, got 0.0. Fix: use 1e-3"),
    (FixMatchClassifier, {"lr": float("nan")}, r"`lr` must be > 0, got nan. Fix: use 0.03"),
    (PESClassifier, {"refine_lr": -1.0}, r"`refine_lr` must be > 0, got -1.0. Fix: use lr=0.02 and refine_lr=1e-4"),
    (PESClassifier, {"num_classes": 1}, r"`num_classes` must be an int >= 2, got 1. Fix"),
    (DivideMixClassifier, {"num_samples": True}, r"`num_samples` must be an int >= 2, got True. Fix"),
    (DivideMixClassifier, {"num_classes": None}, r"`num_classes` must be an int >= 2, got None. Fix"),
])
def test_each_ready_module_refuses_a_bad_size_or_rate_naming_it_and_the_fix(cls, kwargs, match):
    with pytest.raises(ValueError, match=match):
        cls(**kwargs)


def test_a_data_module_that_disagrees_is_refused_naming_the_ready_class_and_the_fix():
    module = WideClassifier(width=4)  # (a subclass: the fix names the ready class it takes the argument of)
    module._trainer = SimpleNamespace(datamodule=SimpleNamespace(num_classes=5, in_channels=1))
    with pytest.raises(ValueError, match=r"num_classes=5 but the model was built with num_classes=3\. Fix: pass "
                                         r"`--model.init_args.num_classes 5` \(or LPA3Classifier\(num_classes=5\)\)"):
        module.setup("fit")


def test_the_shared_names_are_still_imported_from_the_classifiers_module():
    from lpa3_lightning.modules import classifier, ready

    for name in ("NETWORK_RECORD", "NetworkNotSavedError", "build_network", "check_datamodule_agrees", "ready_hparams"):
        assert getattr(classifier, name) is getattr(ready, name)
