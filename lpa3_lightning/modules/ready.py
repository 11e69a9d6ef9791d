"""What the ready modules share: their network (from ``arch``, or ``model``: an ``nn.Module`` or a class-path
config; recorded in the checkpoint), their checked arguments, settings and hyper-parameters (what
``load_from_checkpoint`` and ``lpa3 fit --ckpt_path`` rebuild), the data module's check, their evaluation."""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Mapping, Sequence
from types import FrameType
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.core.mixins.hparams_mixin import _given_hyperparameters
from lightning.pytorch.utilities.parsing import AttributeDict
from torch import Tensor, nn

from lpa3_lightning.core.dual_bn import convert_dual_bn
from lpa3_lightning.methods.base import split_indexed_batch
from lpa3_lightning.methods.noisy_training import adopt_training_set_size, release_twins
from lpa3_lightning.methods.settings import settings_from, settings_hparams
from lpa3_lightning.models import preact_resnet18, small_cnn, wrn28_2, wrn28_8, wrn37_2

__all__ = ["ARCHS", "NETWORK_RECORD", "NetworkNotSavedError", "ReadyModule", "build_network", "build_ssl_backbone",
           "check_datamodule_agrees", "check_network_record", "ready_hparams", "resolve_network",
           "save_network_record", "save_ready_hparams"]

#: The checkpoint key of a ready module's record of its network: its class, the module's, how it was given.
NETWORK_RECORD = "lpa3_network"
ARCHS = ("small_cnn", "wrn28_2", "wrn28_8", "wrn37_2", "preact_resnet18")


class NetworkNotSavedError(ValueError):
    """A checkpoint's network was given to its module as a Python object, which the checkpoint cannot rebuild."""


def _class_path(obj: Any) -> str:
    cls = obj if isinstance(obj, type) else type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def build_ssl_backbone(arch: str, in_channels: int, num_classes: int) -> nn.Module:
    """The paper's backbones (WRN-28-2, WRN-28-8, WRN-37-2 semi-supervised; PreAct ResNet-18 noisy labels) or a
    small CNN for CPU runs, by name (:data:`ARCHS`; another is a ``ValueError`` listing them)."""
    if arch not in ARCHS:
        raise ValueError(f"`arch` must be one of {ARCHS}, got {arch!r}. Fix: use 'wrn28_2' (CIFAR-10), 'wrn28_8' "
                         "(CIFAR-100), 'wrn37_2' (STL-10), 'preact_resnet18' (noisy labels) or 'small_cnn' (CPU runs).")
    if arch == "small_cnn":
        return small_cnn(in_channels=in_channels, num_classes=num_classes)
    builders = {"wrn28_2": wrn28_2, "wrn28_8": wrn28_8, "wrn37_2": wrn37_2, "preact_resnet18": preact_resnet18}
    return builders[arch](num_classes, in_channels=in_channels)


def build_network(spec: Mapping[str, Any], argument: str = "model") -> nn.Module:
    """The network of a class-path config (a class or function returning an ``nn.Module``, and its arguments)
    as LightningCLI builds ``model: {class_path: ...}``; a ``ValueError`` naming ``argument`` and the fix if none.

    Example:
        >>> net = build_network({"class_path": "torch.nn.Linear", "init_args": {"in_features": 2, "out_features": 3}})
        >>> type(net).__name__, net.out_features
        ('Linear', 3)
    """
    fix = (f"Fix: pass {argument}={{\"class_path\": \"<module>.<class or function>\", \"init_args\": {{...}}}} naming "
           "an importable nn.Module (e.g. \"torchvision.models.resnet18\" with init_args {\"num_classes\": 2}), or the "
           "network itself.")
    if not isinstance(spec.get("class_path"), str) or not set(spec) <= {"class_path", "init_args", "dict_kwargs"}:
        raise ValueError(f"`{argument}` as a config must be {{\"class_path\": str, \"init_args\": {{...}}}}, got "
                         f"{dict(spec)!r}. {fix}")
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--network", type=nn.Module)
    try:
        config = parser.parse_object({"network": copy.deepcopy(dict(spec))})
        instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes
        return instantiate(config).network
    except Exception as exc:  # (jsonargparse's parse errors, or the network's own constructor's)
        raise ValueError(f"`{argument}` = {dict(spec)!r} does not build a network ({type(exc).__name__}: "
                         f"{' '.join(str(exc).split())}). {fix}") from exc


def resolve_network(model: Any, build: Callable[[], nn.Module], argument: str = "model") -> tuple[nn.Module, str]:
    """``(network, how)``: ``model`` itself (``"object"``), the network of its class-path config (``"config"``),
    or for None ``build()`` (``"arch"``); a ``TypeError`` naming ``argument`` and the fix for anything else."""
    if model is None:
        return build(), "arch"
    if isinstance(model, nn.Module):
        return model, "object"
    if isinstance(model, Mapping):
        return build_network(model, argument), "config"
    example = '{"class_path": "torchvision.models.resnet18", "init_args": {"num_classes": 2}}'
    raise TypeError(f"`{argument}` must be an nn.Module or a class-path config ({{\"class_path\": ..., \"init_args\": "
                    f"{{...}}}}), got {type(model).__name__} {model!r}. Fix: pass the network, e.g. "
                    f"{argument}=torchvision.models.resnet18(num_classes=2), or its config, {argument}={example}, or "
                    "None (build `arch`).")


def save_network_record(module: pl.LightningModule, checkpoint: dict[str, Any], network: nn.Module) -> None:
    """Write :data:`NETWORK_RECORD`: the network's class, the module's, and how the network was given."""
    checkpoint[NETWORK_RECORD] = {"network": _class_path(network), "module": _class_path(module),
                                  "given": getattr(module, "_lpa3_network_given", None)}


def check_network_record(module: pl.LightningModule, checkpoint: dict[str, Any], network: nn.Module,
                         argument: str = "model") -> None:
    """Refuse a checkpoint whose ``<argument>.`` weights do not fit ``network`` (the one ``module`` built) before a
    size mismatch, naming how each was given and the fix: a :class:`NetworkNotSavedError` for a network given
    as an object where ``module`` built ``arch``, else a ``ValueError``."""
    record = checkpoint.get(NETWORK_RECORD)
    if not isinstance(record, Mapping) or not isinstance(record.get("network"), str):
        return
    own = {f"{argument}.{key}": tuple(value.shape) for key, value in network.state_dict().items()}
    if own == {key: tuple(getattr(value, "shape", ())) for key, value in checkpoint.get("state_dict", {}).items()
               if key.startswith(f"{argument}.")}:
        return
    name, saved, built = type(module).__name__, record["network"], _class_path(network)
    given = getattr(module, "_lpa3_network_given", None)
    how = {"arch": "from `arch`", "config": "from its class-path config",
           "object": "from the network you passed"}.get(given, "")
    if record.get("given") == "object" and given == "arch":
        raise NetworkNotSavedError(
            f"`{argument}`: the checkpoint's network, a {saved}, was given to {name} as an object, whose "
            f"construction a checkpoint does not keep (only its weights), and this {name} built a {built} {how}. "
            f"Fix: pass the network again, {name}.load_from_checkpoint(path, {argument}={saved.rsplit('.', 1)[-1]}"
            f"(...)) with the arguments it was built with, or train with `{argument}` given as a class-path config, "
            f"{argument}={{\"class_path\": \"{saved}\", \"init_args\": {{...}}}} (what `lpa3 fit` does with "
            f"`{argument}: {{class_path: ...}}`), which the checkpoint keeps and rebuilds.")
    raise ValueError(f"`{argument}`: the checkpoint's network is a {saved} (given {record.get('given')!r}) but this "
                     f"{name} built a {built} {how}. Fix: load it with the network it was trained with, "
                     f"{name}.load_from_checkpoint(path, {argument}=...), or without `{argument}` when the checkpoint "
                     "keeps its config.")


def save_ready_hparams(module: pl.LightningModule, own: Mapping[str, Any], settings: tuple[str, Any],
                       given: str | None = None, frame: FrameType | None = None) -> None:
    """Save a ready module's hyper-parameters: ``save_hyperparameters`` of ``frame`` (its ``__init__``; default the
    caller's) or LightningCLI's config, the network's class-path config kept (an object is left out, Lightning's
    rule), ``settings`` as ``(name, mapping of the fields)``. Of ``own``, the arguments (the settings left out),
    those a subclass being built does not take are not saved, but :func:`ready_hparams` reads them. ``given``:
    how the network was given (:func:`resolve_network`; None: no ``model`` argument)."""
    def accepts(name: str) -> bool:
        parameters = inspect.signature(type(module).__init__).parameters
        return name in parameters or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())

    cli = _given_hyperparameters.get()  # (LightningCLI's config of the module it builds; None outside)
    saved_model = cli.get("model") if cli is not None else own.get("model")
    keep_model = given == "config" or (given is not None and isinstance(saved_model, Mapping))
    module.save_hyperparameters(ignore=None if keep_model else ["model"],
                                frame=frame or inspect.currentframe().f_back)  # type: ignore[union-attr]
    extra = {key: value for key, value in own.items() if key != "model" and key not in module.hparams and accepts(key)}
    if keep_model and isinstance(own.get("model"), Mapping) and accepts("model"):
        extra["model"] = copy.deepcopy(dict(own["model"]))  # the config as given, plain values
    name, value = settings
    if accepts(name):
        extra[name] = value
    if extra:
        module.save_hyperparameters(extra)
    module._lpa3_ready_args = {**{k: v for k, v in own.items() if k != "model"}, name: value}  # type: ignore
    module._lpa3_network_given = given  # type: ignore[attr-defined]


def ready_hparams(module: pl.LightningModule) -> AttributeDict:
    """A ready module's arguments: its hyper-parameters (where a tuner may change ``lr``), else the
    arguments it received (those of a subclass's parent that LightningCLI did not save)."""
    return AttributeDict({**getattr(module, "_lpa3_ready_args", {}), **module.hparams})


def check_datamodule_agrees(module: pl.LightningModule, names: Sequence[str], class_name: str) -> Any:
    """Return the trainer's data module, or refuse one whose ``names`` (e.g. ``num_classes``) differ from the
    module's hyper-parameters (a mismatch would surface deep inside the first step): a ``ValueError`` naming
    the argument and the fix."""
    datamodule = getattr(module.trainer, "datamodule", None) if module._trainer is not None else None
    built = ready_hparams(module)
    for name in names:
        expected = getattr(datamodule, name, None)
        if isinstance(expected, int) and expected != built[name]:
            raise ValueError(f"The data module has {name}={expected} but the model was built with {name}="
                             f"{built[name]}. Fix: pass `--model.init_args.{name} {expected}` (or {class_name}({name}="
                             f"{expected})).")
    return datamodule


class ReadyModule:
    """The ready modules' shared part, first among their bases (DivideMix's after its mixin, whose ``lpa3_model``
    names a network): :meth:`ready_init`; ``self.model``'s forward, attack and checkpoint record; the data module's
    check; ``<stage>/acc`` of ``<stage>_acc`` (or ``<stage>_metrics``, on probabilities); the twins' release."""

    def ready_init(self, settings: str, lr_fix: str, build: Callable[[], nn.Module] | None = None) -> nn.Module | None:
        """In the module's ``__init__``, whose arguments it reads from its frame (as ``save_hyperparameters``):
        check them, set ``lpa3_settings`` (from the argument named ``settings``), ``lpa3_num_classes`` (and
        ``lpa3_num_samples`` where ``num_samples`` is taken) and the hyper-parameters, and return the network:
        ``model``, the one its config builds or ``build()``, with twins under ``twin_bn`` (None without ``build``).

        Raises:
            ValueError: for ``num_classes`` or ``num_samples`` not an int >= 2, a learning rate (``lr``, ``*_lr``)
                not > 0 (``lr_fix``: the fix named), bad settings or a bad ``model`` config.
            TypeError: for unknown settings or a ``model`` that is neither a network nor a config.
        """
        frame = inspect.currentframe().f_back  # type: ignore[union-attr]
        names, _, _, values = inspect.getargvalues(frame)  # type: ignore[arg-type]
        own = {name: values[name] for name in names[1:] if name != settings}
        for name in ("num_classes", "num_samples") if "num_samples" in own else ():  # (PES, DivideMix)
            value = own[name]
            if (value is not None or name == "num_classes") and (
                    isinstance(value, bool) or not isinstance(value, int) or value < 2):
                raise ValueError(f"`{name}` must be an int >= 2, got {value!r}. Fix: e.g. num_classes=10, "
                                 "num_samples=<training set size>.")
        for name in (name for name in own if name == "lr" or name.endswith("_lr")):
            if not own[name] > 0:
                raise ValueError(f"`{name}` must be > 0, got {own[name]!r}. Fix: {lr_fix}.")
        self.lpa3_settings = settings_from(self.lpa3_settings_class, values[settings], settings)  # type: ignore
        network, given = resolve_network(own["model"], build) if build is not None else (None, None)
        save_ready_hparams(self, own, (settings, settings_hparams(self.lpa3_settings)), given, frame)  # type: ignore
        if network is not None and own["twin_bn"]:
            convert_dual_bn(network)
        self.lpa3_num_classes = own["num_classes"]
        if "num_samples" in own:
            self.lpa3_num_samples = own["num_samples"]
        return network

    def setup(self, stage: str) -> None:
        ready = next(c for c in type(self).__mro__ if c.__module__.startswith("lpa3_lightning.modules."))
        datamodule = check_datamodule_agrees(self, ("num_classes", "in_channels"), ready.__name__)  # type: ignore
        if "num_samples" in self._lpa3_ready_args:  # type: ignore[attr-defined]  (PES, DivideMix)
            adopt_training_set_size(self, datamodule)  # type: ignore[arg-type]

    def forward(self, x: Tensor) -> Tensor:
        return self.model(x)

    def lpa3_model(self, network: str | None = None) -> nn.Module:
        return self.model

    def on_fit_end(self) -> None:
        release_twins(getattr(self, "_anchored", []))  # (PES and DivideMix anchor them without the callback)

    def _ready_evaluate(self, batch: Any, stage: str) -> None:
        x, y, _ = split_indexed_batch(batch)
        collection = getattr(self, f"{stage}_metrics", None)  # (LPA3Classifier's: accuracy and AUC, of probabilities)
        if collection is not None:
            collection.update(self(x).softmax(dim=1), y)
            return self.log_dict(collection, prog_bar=True, batch_size=int(x.shape[0]))  # type: ignore[attr-defined]
        metric = getattr(self, f"{stage}_acc")
        metric.update(self(x), y)  # type: ignore[operator]
        self.log(f"{stage}/acc", metric, prog_bar=True, batch_size=int(x.shape[0]))  # type: ignore[attr-defined]

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._ready_evaluate(batch, "val")

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self._ready_evaluate(batch, "test")

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        save_network_record(self, checkpoint, self.model)  # type: ignore[arg-type]

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        check_network_record(self, checkpoint, self.model)  # type: ignore[arg-type]
