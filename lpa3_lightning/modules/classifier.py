"""A ready MedMNIST classifier trained with LP-A3 (or without, as the baseline)."""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.parsing import AttributeDict
from torch import Tensor, nn
from torchmetrics import MetricCollection
from torchmetrics.classification import MulticlassAccuracy, MulticlassAUROC

from lpa3_lightning.core.dual_bn import convert_dual_bn
from lpa3_lightning.methods.settings import SupervisedSettings, settings_from, settings_hparams
from lpa3_lightning.methods.supervised import SupervisedLPA3Mixin, split_indexed_batch
from lpa3_lightning.models.resnet import medmnist_resnet

__all__ = ["NETWORK_RECORD", "LPA3Classifier", "NetworkNotSavedError", "build_network", "check_datamodule_agrees",
           "ready_hparams"]

#: The checkpoint key of a ready module's record of its network: its class, the module's class, and how
#: the network was given (``"arch"`` built from ``arch``, ``"config"`` a class-path config, ``"object"``).
NETWORK_RECORD = "lpa3_network"


class NetworkNotSavedError(ValueError):
    """A checkpoint's network was given to its module as a Python object, which the checkpoint cannot rebuild."""


def _class_path(obj: Any) -> str:
    cls = obj if isinstance(obj, type) else type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def build_network(spec: Mapping[str, Any], argument: str = "model") -> nn.Module:
    """The network of a class-path config, built as LightningCLI builds ``model: {class_path: ...}``.

    Args:
        spec: ``{"class_path": "torchvision.models.resnet18", "init_args": {"num_classes": 2}}``: a class
            or a function returning an ``nn.Module``, and its arguments.
        argument: the argument's name in the messages.

    Returns:
        The network.

    Raises:
        ValueError: for a config that names no importable network or whose arguments it refuses, naming
            ``argument`` and the fix.

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
    """A ready module's network and how it was given: ``model`` itself (``"object"``), built from its
    class-path config (``"config"``), or ``build()`` from the module's ``arch`` when ``model`` is None.

    Raises:
        TypeError: for a ``model`` that is neither, naming the argument and the fix.
        ValueError: for a config that builds no network (:func:`build_network`).
    """
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


def _accepts(cls: type, name: str) -> bool:
    parameters = inspect.signature(cls.__init__).parameters
    return name in parameters or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())


def _cli_given_hparams() -> Mapping[str, Any] | None:
    """The hyper-parameters LightningCLI hands the module it is building (its config), None outside."""
    try:
        from lightning.pytorch.core.mixins.hparams_mixin import _given_hyperparameters
    except ImportError:  # (a Lightning without it: the CLI's network config is then not kept)
        return None
    return _given_hyperparameters.get()


def save_ready_hparams(module: pl.LightningModule, own: Mapping[str, Any], settings: tuple[str, Any],
                       given: str | None = None) -> None:
    """A ready module's hyper-parameters: what ``load_from_checkpoint`` and ``lpa3 fit --ckpt_path`` rebuild it from.

    Lightning's ``save_hyperparameters`` (the arguments of the constructors called, or LightningCLI's config
    of the class it builds), with the network's class-path config kept (``model``, when given as one, by
    ``lpa3 fit`` or from Python; a network object is left out, as Lightning recommends, and asked for
    again on load) and the effective ``settings`` mapping; the module's own arguments that the class
    being built does not take (a subclass LightningCLI builds from its own arguments) are not saved, so
    its checkpoint re-parses, but :func:`ready_hparams` reads them.

    Args:
        module: the ready module, in its ``__init__``.
        own: its arguments as received (``model`` included).
        settings: ``(name, mapping)``: the method's settings argument and its effective fields.
        given: how the network was given (:func:`resolve_network`); None: no ``model`` argument.
    """
    frame = inspect.currentframe().f_back  # type: ignore[union-attr]  # the ready module's __init__
    cli = _cli_given_hparams()
    saved_model = cli.get("model") if cli is not None else own.get("model")
    keep_model = given == "config" or (given is not None and isinstance(saved_model, Mapping))
    module.save_hyperparameters(ignore=None if keep_model else ["model"], frame=frame)
    cls = type(module)
    extra = {key: value for key, value in own.items()
             if key != "model" and key not in module.hparams and _accepts(cls, key)}
    if keep_model and isinstance(own.get("model"), Mapping) and _accepts(cls, "model"):
        extra["model"] = copy.deepcopy(dict(own["model"]))  # the config as given, plain values
    name, value = settings
    if _accepts(cls, name):
        extra[name] = value
    if extra:
        module.save_hyperparameters(extra)
    module._lpa3_ready_args = {**{k: v for k, v in own.items() if k != "model"}, name: value}  # type: ignore
    module._lpa3_network_given = given  # type: ignore[attr-defined]


def ready_hparams(module: pl.LightningModule) -> AttributeDict:
    """A ready module's arguments: its hyper-parameters (where a tuner may change ``lr``), else the
    arguments it received (those of a subclass's parent that LightningCLI did not save)."""
    return AttributeDict({**getattr(module, "_lpa3_ready_args", {}), **module.hparams})


def save_network_record(module: pl.LightningModule, checkpoint: dict[str, Any], network: nn.Module) -> None:
    """Write :data:`NETWORK_RECORD`: the network's class, the module's, and how the network was given."""
    checkpoint[NETWORK_RECORD] = {"network": _class_path(network), "module": _class_path(module),
                                  "given": getattr(module, "_lpa3_network_given", None)}


def _weights_fit(network: nn.Module, state: Mapping[str, Any], prefix: str) -> bool:
    """Whether the checkpoint's ``prefix`` weights have the network's names and shapes."""
    own = {f"{prefix}{key}": tuple(value.shape) for key, value in network.state_dict().items()}
    saved = {key: tuple(getattr(value, "shape", ())) for key, value in state.items() if key.startswith(prefix)}
    return own == saved


def check_network_record(module: pl.LightningModule, checkpoint: dict[str, Any], network: nn.Module,
                         argument: str = "model") -> None:
    """Refuse a checkpoint whose network's weights do not fit the network ``module`` built (``module.<argument>``),
    naming how it was given and the fix, before they fail to load as a size mismatch.

    Raises:
        NetworkNotSavedError: the checkpoint's network was given as an object, and ``module`` built ``arch``.
        ValueError: another network, naming the fix.
    """
    record = checkpoint.get(NETWORK_RECORD)
    if not isinstance(record, Mapping) or not isinstance(record.get("network"), str):
        return
    if _weights_fit(network, checkpoint.get("state_dict", {}), f"{argument}."):
        return  # (an object that `arch` builds alike loads as it always did)
    name, saved, built = type(module).__name__, record["network"], _class_path(network)
    given = getattr(module, "_lpa3_network_given", None)
    how = {"arch": "from `arch`", "config": "from its class-path config",
           "object": "from the network you passed"}.get(given, "")
    short = saved.rsplit(".", 1)[-1]
    if record.get("given") == "object" and given == "arch":
        raise NetworkNotSavedError(
            f"`{argument}`: the checkpoint's network, a {saved}, was given to {name} as an object, whose "
            f"construction a checkpoint does not keep (only its weights), and this {name} built a {built} {how}. "
            f"Fix: pass the network again, {name}.load_from_checkpoint(path, {argument}={short}(...)) with the "
            f"arguments it was built with, or train with `{argument}` given as a class-path config, "
            f"{argument}={{\"class_path\": \"{saved}\", \"init_args\": {{...}}}} (what `lpa3 fit` does with "
            f"`{argument}: {{class_path: ...}}`), which the checkpoint keeps and rebuilds.")
    raise ValueError(f"`{argument}`: the checkpoint's network is a {saved} (given {record.get('given')!r}) but this "
                     f"{name} built a {built} {how}. Fix: load it with the network it was trained with, "
                     f"{name}.load_from_checkpoint(path, {argument}=...), or without `{argument}` when the checkpoint "
                     "keeps its config.")


def check_datamodule_agrees(module: pl.LightningModule, names: Sequence[str], class_name: str) -> Any:
    """Refuse a data module whose ``names`` (e.g. ``num_classes``) differ from the module's hyper-parameters.

    The CLI takes model and data arguments separately; a mismatch would otherwise surface deep
    inside the first step (a channel error or a label out of bounds). Returns the data module.

    Raises:
        ValueError: naming the argument and the fix.
    """
    datamodule = getattr(module.trainer, "datamodule", None) if module._trainer is not None else None
    built = ready_hparams(module)
    for name in names:
        expected = getattr(datamodule, name, None)
        if isinstance(expected, int) and expected != built[name]:
            raise ValueError(
                f"The data module has {name}={expected} but the model was built with {name}={built[name]}. "
                f"Fix: pass `--model.init_args.{name} {expected}` (or {class_name}({name}={expected}))."
            )
    return datamodule


class LPA3Classifier(SupervisedLPA3Mixin, pl.LightningModule):
    """ResNet classifier with the MedMNIST recipe; add ``LPA3Callback`` to train with LP-A3.

    Without the callback it is the plain baseline (the same module, the same recipe).
    Metrics are the MedMNIST benchmark's: accuracy and AUC (macro one-vs-rest; for two
    classes this equals the binary AUC), from torchmetrics, logged as ``val/acc``,
    ``val/auc``, ``test/acc``, ``test/auc``.

    Args:
        arch: ``"resnet18"`` or ``"resnet50"`` (MedMNIST 28 px stem).
        in_channels: image channels.
        num_classes: classes.
        lr: Adam learning rate (MedMNIST recipe: 1e-3).
        milestones: epochs at which the learning rate is multiplied by ``lr_gamma``
            (recipe: 50 and 75 of 100).
        lr_gamma: learning-rate decay factor.
        weight_decay: Adam weight decay.
        twin_bn: give every BatchNorm a twin for the augmented samples (authors' choice).
        supervised: the mixin's settings (:class:`~lpa3_lightning.methods.settings.SupervisedSettings`:
            ``weight`` of the loss on the hard positives, ``train_forward``), or a mapping of its
            fields; None: the defaults. In a YAML config, ``supervised:`` with the fields under it.
        model: use this network instead of building ``arch`` (any ``nn.Module`` returning logits),
            or its class-path config, ``{"class_path": "torchvision.models.resnet18", "init_args":
            {"num_classes": 2}}`` (``model: {class_path: ...}`` in a ``lpa3 fit`` config): a config is kept
            in the hyper-parameters, so ``load_from_checkpoint`` and ``lpa3 show`` rebuild the network; an
            object is not (Lightning's rule), so loading asks for it again by name
            (``load_from_checkpoint(path, model=...)``). With ``twin_bn`` its BatchNorms are converted in
            place.

    Example:
        >>> module = LPA3Classifier(in_channels=1, num_classes=2)
        >>> module.lpa3_num_classes
        2
    """

    def __init__(
        self,
        arch: str = "resnet18",
        in_channels: int = 1,
        num_classes: int = 2,
        lr: float = 1e-3,
        milestones: Sequence[int] = (50, 75),
        lr_gamma: float = 0.1,
        weight_decay: float = 0.0,
        twin_bn: bool = True,
        supervised: SupervisedSettings | None = None,
        model: nn.Module | None = None,
    ) -> None:
        super().__init__()
        if lr <= 0:
            raise ValueError(f"`lr` must be > 0, got {lr}. Fix: use 1e-3 (the MedMNIST recipe).")
        self.lpa3_settings = settings_from(SupervisedSettings, supervised, "supervised")
        self.model, given = resolve_network(model, lambda: medmnist_resnet(arch, in_channels, num_classes))
        # the effective settings as a mapping of their fields (None: the defaults), for hparams.yaml,
        # TensorBoard and load_from_checkpoint (which rebuilds the dataclass from it)
        save_ready_hparams(self, {"arch": arch, "in_channels": in_channels, "num_classes": num_classes, "lr": lr,
                                  "milestones": milestones, "lr_gamma": lr_gamma, "weight_decay": weight_decay,
                                  "twin_bn": twin_bn, "model": model},
                           ("supervised", settings_hparams(self.lpa3_settings)), given)
        if twin_bn:
            convert_dual_bn(self.model)
        self.lpa3_num_classes = num_classes
        metrics = MetricCollection(
            {"acc": MulticlassAccuracy(num_classes, average="micro"), "auc": MulticlassAUROC(num_classes)}
        )
        self.val_metrics = metrics.clone(prefix="val/")
        self.test_metrics = metrics.clone(prefix="test/")

    def setup(self, stage: str) -> None:
        check_datamodule_agrees(self, ("num_classes", "in_channels"), "LPA3Classifier")

    def lpa3_model(self) -> nn.Module:
        return self.model

    def forward(self, x: Tensor) -> Tensor:
        return self.model(x)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss, _, parts = self.lpa3_supervised_loss(batch)
        batch_size = int(batch[0].shape[0]) if isinstance(batch, (list, tuple)) else None
        self.log("train/loss", loss, prog_bar=True, batch_size=batch_size)
        self.log("train/loss_clean", parts["loss_clean"], batch_size=batch_size)
        self.log("train/loss_aug", parts["loss_aug"], batch_size=batch_size)
        return loss

    def _evaluate(self, batch: Any, metrics: MetricCollection) -> None:
        x, y, _ = split_indexed_batch(batch)
        probs = self.model(x).softmax(dim=1)
        metrics.update(probs, y)
        self.log_dict(metrics, prog_bar=True, batch_size=int(x.shape[0]))

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._evaluate(batch, self.val_metrics)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self._evaluate(batch, self.test_metrics)

    def configure_optimizers(self) -> Any:
        hp = ready_hparams(self)
        optimizer = torch.optim.Adam(self.parameters(), lr=hp.lr, weight_decay=hp.weight_decay)
        scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=list(hp.milestones), gamma=hp.lr_gamma)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "epoch"}}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        save_network_record(self, checkpoint, self.model)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        check_network_record(self, checkpoint, self.model)
