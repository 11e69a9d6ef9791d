"""``lpa3 show``: a PNG of x, x' and |x' - x| for a checkpoint of a ready module, or of your own
module and data module trained with ``lpa3 fit`` (which saves their classes in the checkpoint).

    lpa3 show --ckpt runs/.../last.ckpt --out lpa3_examples.png [--root DIR] [--split test]
              [--num 8] [--images first|random|per-class] [--indices I ...] [--sample-seed 0]
              [--scale auto|N] [--no-labels] [--seed 0] [--network net1] [--sigma S] [--steps N]
              [--max-step auto|none|L] [--bn-mode auto|eval|twin|batch]

Rows: the chosen images of the split (the first ``--num`` by default; ``--images random`` a
seeded sample, ``--images per-class`` one image of each class, ``--indices`` the dataset's
positions you name), their LP-A3 hard positives under the checkpoint's model, and ``|x' - x|``
on one scale for all images (white: the largest difference of the picture, its value printed
and written under the grid, so a brighter column is a larger change). Under each column: its
dataset index and class (the data module's ``class_names``, MedMNIST's label names, else the
class number), its perceptual distance ``d``, ``||x' - x||`` of the model's inputs (``L2``) and
whether the label was kept. ``--scale auto`` draws every pixel as the smallest N x N block that
makes an image at least 112 px tall. It prints the same per image.

What training made, by default: the solver's settings (sigma, steps, step bound, BatchNorm
mode, ...) are read from the checkpoint's ``LPA3Callback`` state, the data set and its
normalisation from the checkpoint's data module (your own, rebuilt from the class and arguments
``lpa3 fit`` saved), the network from the checkpoint (a ``model`` given as a class-path config is
kept there; an older checkpoint's from the run's ``config.yaml`` beside it), and the label
preserved is the one training preserves (the true label for ``LPA3Classifier``; the model's
prediction, standing in for the pseudo-label or the guess, for ``FixMatchClassifier``,
``PESClassifier`` and ``DivideMixClassifier``; your module's ``lpa3_request`` targets for your
own). A flag overrides a setting. A checkpoint whose data module or network is unknown is
refused with the fix.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from torch import nn
from torch.utils.data import Dataset, Subset, default_collate

from lpa3_lightning.callback.lpa3_callback import is_lpa3_state
from lpa3_lightning.core.attack import lpa3_attack
from lpa3_lightning.core.batch_statistics import resolve_bn_mode
from lpa3_lightning.core.dual_bn import has_dual_bn
from lpa3_lightning.core.input_box import check_max_step
from lpa3_lightning.core.model_outputs import eval_mode
from lpa3_lightning.core.visualize import difference_peak, save_comparison_grid
from lpa3_lightning.modules.classifier import NETWORK_RECORD, NetworkNotSavedError

__all__ = ["main"]

#: The package's ready modules (their checkpoints load without a saved class path).
READY = ("LPA3Classifier", "FixMatchClassifier", "PESClassifier", "DivideMixClassifier")

#: The solver's settings when the checkpoint holds none (written without LPA3Callback): its defaults.
CALLBACK_DEFAULTS: dict[str, Any] = {"sigma": 0.02, "steps": 5, "lam": 1.0, "temperature": 1.0, "max_step": "auto",
                                     "attack_bn": "auto", "project": True, "fast": False, "allow_tf32": False,
                                     "layers": None}

#: ``--scale auto``: the smallest integer scale that draws an image at least this tall.
AUTO_HEIGHT = 112

#: ``lpa3 show``'s fix for a checkpoint it cannot draw from.
OWN_CODE = ("draw x' from your own code with lpa3_lightning.core.visualize.save_comparison_grid (docs/inspect.md)")


def _saved_class(hparams: dict[str, Any]) -> type | None:
    """The class ``lpa3 fit`` (LightningCLI) saved in the hyperparameters (``_class_path``), imported."""
    return _import_class(hparams.get("_class_path"))


def _import_class(path: Any) -> type | None:
    if not isinstance(path, str) or "." not in path or path.startswith("__main__."):
        return None
    module, _, name = path.rpartition(".")
    try:
        found = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise SystemExit(f"lpa3 show: error: the checkpoint was written by {path}, which does not import here "
                         f"({exc}). Fix: run the command where that module imports (its folder, or its package "
                         "installed).") from exc
    return found if isinstance(found, type) else None


def _module_class(checkpoint: dict[str, Any]) -> type:
    """The module a checkpoint was written by: the class ``lpa3 fit`` saved, else the ready module
    told by what its state and hparams hold."""
    from lpa3_lightning import DivideMixClassifier, FixMatchClassifier, LPA3Classifier, PESClassifier

    hparams = checkpoint.get("hyper_parameters", {})
    record = checkpoint.get(NETWORK_RECORD)  # a ready module's (or its subclass's) own record of its class
    saved = _saved_class(hparams) or (_import_class(record.get("module")) if isinstance(record, dict) else None)
    if saved is not None:
        return saved
    if any(key.startswith("net1.") for key in checkpoint.get("state_dict", {})):
        return DivideMixClassifier
    if "pes" in hparams:  # each ready module keeps its settings under the method's name
        return PESClassifier
    if "fixmatch" in hparams:
        return FixMatchClassifier
    return LPA3Classifier


def _solver_settings(checkpoint: dict[str, Any], network: str | None) -> tuple[dict[str, Any], bool]:
    """The training callback's solver settings (and whether the checkpoint held them)."""
    # by the state's layout: the key names the callback's class (a subclass too) and its settings
    states = [state for state in checkpoint.get("callbacks", {}).values() if is_lpa3_state(state)]
    networks = states[0].get("networks", {}) if states else {}
    state = networks.get(network or "", networks.get("net1", {}))
    saved = state.get("settings")
    return ({**CALLBACK_DEFAULTS, **saved} if saved else dict(CALLBACK_DEFAULTS)), bool(saved)


@dataclass
class Split:
    """The split to draw from: its map-style dataset (items ``(x, y, index)``, or the user's data
    module's items), the data set's name, normalisation and class names (None: numbers)."""

    dataset: Any
    name: str
    normalization: Any
    class_names: list[str] | None


class _EvalView(Dataset):
    """The training images in the evaluation view, as ``(x, y, index)``."""

    def __init__(self, base: Any, transform: Any) -> None:
        self.base, self.transform = base, transform
        self.labels = getattr(base, "labels", None)

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int) -> tuple[Any, int, int]:
        image, label = self.base[i]
        return self.transform(image), label, i


def _split(checkpoint: dict[str, Any], root: str | None, split: str) -> Split:
    """The split ``lpa3 show`` draws from, as the checkpoint's data module makes it."""
    from lpa3_lightning.data import MedMNISTDataModule, NoisyLabelDataModule, SemiSupervisedDataModule
    from lpa3_lightning.data.ssl_datasets import source_facts

    data_hparams = checkpoint.get("datamodule_hyper_parameters", {})
    own = _saved_class(data_hparams)
    if own is not None and not issubclass(own, (MedMNISTDataModule, SemiSupervisedDataModule, NoisyLabelDataModule)):
        return _own_split(own, data_hparams, split, root)
    if not data_hparams:
        raise SystemExit("lpa3 show: error: the checkpoint names no data module (the fit was given loaders, or a data "
                         "module that saved no hyperparameters), so the images it was trained on are unknown. Fix: "
                         "train through a data module that calls self.save_hyperparameters() (with `lpa3 fit` its "
                         f"class is then saved too; docs/configs-and-data.md), or {OWN_CODE}.")
    root = root or data_hparams.get("root")
    if "flag" not in data_hparams and "source" not in data_hparams:
        raise SystemExit("lpa3 show: error: the checkpoint's data module hyperparameters name no MedMNIST `flag` and no "
                         f"`source` ({sorted(data_hparams)}), so the images it was trained on are unknown. Fix: train "
                         f"with `lpa3 fit` (it saves the data module's class), or {OWN_CODE}.")
    if "flag" in data_hparams:
        name = data_hparams["flag"]
        data: Any = MedMNISTDataModule(name, root=root)
        data.setup("fit" if split in ("train", "val") else "test")
        dataset = {"train": data.train_dataset, "val": data.val_dataset, "test": data.test_dataset}[split]
    else:  # the semi-supervised and noisy-label modules' image source, in its evaluation view
        name = data_hparams["source"]
        facts = source_facts(name)
        data = SemiSupervisedDataModule(name, root=root, num_labels=int(facts["num_classes"]))
        data.setup("fit" if split in ("train", "val") else "test")
        dataset = _EvalView(data.train_base, data.eval_transform()) if split == "train" else \
            {"val": data.val_dataset, "test": data.test_dataset}[split]
    return Split(dataset, name, data.normalization, _class_names(data, dataset, name))


def _own_split(cls: type, hparams: dict[str, Any], split: str, root: str | None = None) -> Split:
    """The split of the user's own data module, rebuilt from the class and arguments the checkpoint
    saved (``root`` replaces its ``root`` argument): its loader's dataset (the module's request reads
    its collated items)."""
    kwargs = {key: value for key, value in hparams.items() if not key.startswith("_")}
    if root is not None and "root" in kwargs:
        kwargs["root"] = root
    data = cls(**kwargs)
    data.setup("fit" if split in ("train", "val") else "test")
    loader = getattr(data, {"train": "train_dataloader", "val": "val_dataloader", "test": "test_dataloader"}[split])()
    dataset = getattr(loader, "dataset", None)
    if dataset is None or not hasattr(dataset, "__len__"):
        raise SystemExit(f"lpa3 show: error: {cls.__name__}.{split}_dataloader() returns a {type(loader).__name__} "
                         "without one map-style dataset (e.g. a CombinedLoader of labeled and unlabeled batches), so "
                         "the command cannot take its images. Fix: pass --split with a split whose loader is a "
                         f"DataLoader, or {OWN_CODE}.")
    return Split(dataset, cls.__name__, getattr(data, "normalization", None), _class_names(data, dataset, None))


def _class_names(data: Any, dataset: Any, name: str | None) -> list[str] | None:
    """The data module's ``class_names``, else MedMNIST's label names, else a wrapped dataset's ``classes``."""
    names = getattr(data, "class_names", None)
    if names is None and name is not None:
        from medmnist import INFO

        labels = INFO.get(name, {}).get("label")
        names = [labels[key] for key in sorted(labels, key=int)] if isinstance(labels, dict) else None
    while names is None and dataset is not None:
        names = getattr(dataset, "classes", None)
        dataset = getattr(dataset, "dataset", getattr(dataset, "base", None))
    return [str(n) for n in names] if isinstance(names, Sequence) and not isinstance(names, str) else None


def _labels_of(dataset: Any) -> list[int] | None:
    """Every item's class without loading its image, where the dataset (or one it wraps) keeps them."""
    if isinstance(dataset, Subset):
        base = _labels_of(dataset.dataset)
        return None if base is None else [base[int(i)] for i in dataset.indices]
    for attribute in ("targets", "labels"):
        values = getattr(dataset, attribute, None)
        if values is not None and not callable(values) and len(values) == len(dataset):
            return [int(np.asarray(v).reshape(-1)[0]) for v in values]
    inner = getattr(dataset, "dataset", None)
    return _labels_of(inner) if inner is not None and len(inner) == len(dataset) else None


def _label_of_item(item: Any) -> int:
    label = item[1] if isinstance(item, (tuple, list)) and len(item) >= 2 else None
    if label is None:
        raise ValueError("the items are not (x, y, ...) tuples")
    return int(np.asarray(label.cpu() if isinstance(label, torch.Tensor) else label).reshape(-1)[0])


def _pick(parser: argparse.ArgumentParser, split: Split, args: argparse.Namespace) -> tuple[list[int], str]:
    """The dataset positions to draw, and how they were chosen (for the printout)."""
    size = len(split.dataset)
    if args.indices:
        bad = [i for i in args.indices if not 0 <= i < size]
        if bad:
            parser.error(f"--indices {' '.join(map(str, bad))}: the {args.split} split holds {size} items "
                         f"(positions 0 to {size - 1}). Fix: pass positions in that range.")
        return list(args.indices), "chosen by --indices"
    if args.images == "first":
        num = args.num or 8
        return list(range(min(num, size))), "the first"
    if args.images == "random":
        num = min(args.num or 8, size)
        order = torch.randperm(size, generator=torch.Generator().manual_seed(args.sample_seed))
        return sorted(int(i) for i in order[:num]), f"drawn at random (--sample-seed {args.sample_seed})"
    labels = _labels_of(split.dataset)
    if labels is None:
        try:
            labels = [_label_of_item(split.dataset[i]) for i in range(size)]
        except (ValueError, TypeError, IndexError) as exc:
            parser.error(f"--images per-class needs each item's class, and the {args.split} split's items give none "
                         f"({exc}). Fix: pass --indices, or --images random.")
    by_class: dict[int, list[int]] = {}
    for position, label in enumerate(labels):
        if label >= 0:  # (-1: an unlabeled image)
            by_class.setdefault(label, []).append(position)
    num = args.num or len(by_class)
    picks: list[int] = []
    for rank in range(max((len(v) for v in by_class.values()), default=0)):  # round-robin over the classes
        for label in sorted(by_class):
            if len(picks) < num and rank < len(by_class[label]):
                picks.append(by_class[label][rank])
    return picks, f"one per class ({len(by_class)} classes)" if num <= len(by_class) else "round-robin over the classes"


def _network_from_run_config(ckpt: Path, checkpoint: dict[str, Any], cls: type) -> tuple[dict[str, Any], str]:
    """For a checkpoint written before the network was kept in it: the ``model`` class-path config of the
    run's ``config.yaml`` (LightningCLI writes it beside the checkpoints' folder), as a keyword argument."""
    hparams = checkpoint.get("hyper_parameters", {})
    if "model" in hparams or NETWORK_RECORD in checkpoint or "model" not in inspect.signature(cls.__init__).parameters:
        return {}, ""
    for folder in (ckpt.parent, ckpt.parent.parent):
        path = folder / "config.yaml"
        if not path.is_file():
            continue
        try:
            config = (yaml.safe_load(path.read_text()) or {}).get("model") or {}
        except (yaml.YAMLError, OSError, AttributeError):
            return {}, ""
        if hparams.get("_class_path") not in (None, config.get("class_path")):
            return {}, ""  # the config of another module: not this run's
        spec = (config.get("init_args") or {}).get("model")
        if isinstance(spec, Mapping) and isinstance(spec.get("class_path"), str):
            return {"model": dict(spec)}, f"network: {spec['class_path']} from {path}"
        return {}, ""
    return {}, ""


def _scale(text: str) -> Any:
    if text.lower() == "auto":
        return "auto"
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be auto or an integer >= 1")
    return value


def _max_step(text: str) -> Any:
    if text.lower() == "auto":
        return "auto"
    if text.lower() == "none":
        return None
    return float(text)


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(prog="lpa3 show", description=__doc__.split("\n\n")[0])
    parser.add_argument("--ckpt", required=True, type=Path, help="a checkpoint of a ready module")
    parser.add_argument("--out", default=Path("lpa3_examples.png"), type=Path, help="PNG to write")
    parser.add_argument("--root", default=None, help="the data folder (default: the checkpoint's, else the "
                        "embedded data)")
    parser.add_argument("--split", default="test", choices=["train", "val", "test"])
    parser.add_argument("--num", default=None, type=int, help="images in the grid (default: 8; with --images "
                        "per-class, one per class)")
    parser.add_argument("--images", default="first", choices=["first", "random", "per-class"],
                        help="which images: the split's first --num, a seeded random sample, or one per class")
    parser.add_argument("--indices", default=None, type=int, nargs="+", metavar="I",
                        help="these positions of the split instead (overrides --images and --num)")
    parser.add_argument("--sample-seed", default=0, type=int, help="seed of --images random")
    parser.add_argument("--scale", default="auto", type=_scale, help="draw each pixel N x N (auto: the smallest N "
                        f"that draws an image at least {AUTO_HEIGHT} px tall)")
    parser.add_argument("--no-labels", action="store_true", help="no text under the grid (index, class, distances)")
    parser.add_argument("--seed", default=0, type=int, help="seed of the solver's initial noise")
    parser.add_argument("--network", default=None, choices=["net1", "net2"], help="DivideMix: the network (net1)")
    parser.add_argument("--sigma", default=None, type=float, help="default: the training callback's")
    parser.add_argument("--steps", default=None, type=int, help="default: the training callback's")
    parser.add_argument("--max-step", default=None, type=_max_step,
                        help="largest L2 length of one solver step: auto, none (the authors' unbounded step) or a "
                        "number; default: the training callback's")
    parser.add_argument("--bn-mode", default=None, choices=["auto", "eval", "twin", "batch"],
                        help="the solver's BatchNorm mode; default: the training callback's (auto: the twin BNs when "
                        "the model has them, else its own BNs, on the shown images' batch statistics)")
    args = parser.parse_args(argv)
    if not args.ckpt.is_file():
        parser.error(f"--ckpt {args.ckpt} does not exist. Fix: pass a checkpoint written by `lpa3 fit` "
                     "(see the run's checkpoints/ folder).")
    if args.num is not None and args.num < 1:
        parser.error(f"--num must be >= 1, got {args.num}. Fix: e.g. --num 8.")
    checkpoint = torch.load(args.ckpt, map_location="cpu", weights_only=False)
    settings, from_checkpoint = _solver_settings(checkpoint, args.network)
    for key in ("sigma", "steps", "max_step"):
        if getattr(args, key) is not None:
            settings[key] = getattr(args, key)
    if args.bn_mode is not None:
        settings["attack_bn"] = args.bn_mode
    try:
        check_max_step(settings["max_step"])
    except ValueError as exc:
        parser.error(f"--max-step: {exc}")
    cls = _module_class(checkpoint)
    extra, network_note = _network_from_run_config(args.ckpt, checkpoint, cls)
    try:
        module = cls.load_from_checkpoint(args.ckpt, map_location="cpu", **extra)
    except NetworkNotSavedError as exc:
        parser.error(f"--ckpt {args.ckpt}: {exc} Fix for lpa3 show: train with `model` given as a class-path config "
                     "(`lpa3 fit` with `model: {class_path: ...}` under the module's init_args, or "
                     "model={\"class_path\": ..., \"init_args\": {...}} in Python), which the checkpoint keeps, or "
                     f"{OWN_CODE}.")
    except (KeyError, RuntimeError, TypeError, ValueError) as exc:
        parser.error(f"--ckpt {args.ckpt} does not load into {cls.__name__} ({type(exc).__name__}: {exc}). It may be a "
                     "checkpoint of another module, or an older one whose network has changed since (PreAct "
                     "ResNet-18 and WRN, docs/method.md section 8). Fix: pass a checkpoint of `lpa3 fit` with a ready "
                     "module (LPA3Classifier, FixMatchClassifier, PESClassifier or DivideMixClassifier) or your own "
                     f"module of this release, or {OWN_CODE}.")
    module.train()  # as in training: the solver puts the model in eval mode itself (batch mode needs the flags)
    ready = cls.__name__ in READY  # (or a subclass of one: its own training path, as theirs)
    ready = ready or any(base.__name__ in READY and base.__module__.startswith("lpa3_lightning") for base in cls.__mro__)
    networks = module.lpa3_networks() if callable(getattr(module, "lpa3_networks", None)) else None
    network = (args.network or networks[0]) if networks else None
    model: nn.Module = module.lpa3_model(network) if networks else module.lpa3_model()
    bn_mode = resolve_bn_mode(model, settings["attack_bn"])
    split = _split(checkpoint, args.root, args.split)
    picks, picked = _pick(parser, split, args)
    if bn_mode in ("twin", "batch") and (len(picks) < 2 or (bn_mode == "twin" and not has_dual_bn(model))):
        parser.error(f"--bn-mode {bn_mode} needs two images or more (batch statistics)"
                     f"{' and a model with twin BNs' if bn_mode == 'twin' else ''}. Fix: use --bn-mode eval, or "
                     "draw more images.")
    samples = default_collate([split.dataset[i] for i in picks])
    supervised = any(base.__name__ == "LPA3Classifier" for base in cls.__mro__)
    if ready:
        x, y = samples[0], samples[1]
        label = "the true label" if supervised else "the model prediction"
        if not supervised:  # the label training preserves there: the model's own (pseudo-label / guess)
            with torch.no_grad(), eval_mode(model):
                y = model(x).argmax(1)
    else:  # the user's module: the inputs and labels its own request hands the callback in training
        request = module.lpa3_request(samples, network) if networks else module.lpa3_request(samples)
        x, y = request.inputs, request.targets
        label = "the module's lpa3_request targets"
    if not (x.dim() == 4 and x.shape[1] in (1, 3)):
        parser.error(f"the {args.split} split's inputs are {tuple(x.shape)}, not images (N, 1 or 3, h, w), so there "
                     "is nothing to draw. Fix: read lpa3/perceptual_distance in the training logs instead.")
    x_adv, stats = lpa3_attack(
        model, x, y, sigma=settings["sigma"], steps=settings["steps"], lam=settings["lam"],
        temperature=settings["temperature"], layers=settings["layers"], input_range=split.normalization,
        bn_mode=bn_mode, max_step=settings["max_step"], project=settings["project"], fast=settings["fast"],
        allow_tf32=settings["allow_tf32"], generator=torch.Generator().manual_seed(args.seed), return_stats=True)
    peak = difference_peak(x, x_adv, split.normalization)
    moved = (x_adv - x).flatten(1).norm(dim=1)
    names = split.class_names

    def named(c: int) -> str:
        return names[c] if names is not None and 0 <= c < len(names) else str(c)

    kept = [bool(stats.preserved[i]) for i in range(len(y))]
    scale = max(1, math.ceil(AUTO_HEIGHT / x.shape[2])) if args.scale == "auto" else args.scale
    labels = None if args.no_labels else [
        f"#{picks[i]}\n{named(int(y[i]))}\nd {float(stats.perceptual_distance[i]):.2f}  L2 {float(moved[i]):.2f}\n"
        f"{'kept' if kept[i] else 'NOT kept'}" for i in range(len(y))]
    caption = None if args.no_labels else (
        f"rows: x, x', |x'-x| on one scale (white = {peak:.3g}, pixels in [0, 1]). #: index in the {args.split} "
        f"split; d: perceptual distance; L2: ||x'-x|| of the model's inputs; kept: log p({label}) within sigma "
        f"{settings['sigma']:g}")
    path = save_comparison_grid(args.out, x, x_adv, split.normalization, peak=peak if peak > 0 else None,
                                scale=scale, labels=labels, caption=caption)
    source = "the checkpoint's LPA3Callback" if from_checkpoint else "LPA3Callback's defaults (the checkpoint holds none)"
    if network_note:
        print(network_note)
    print(f"wrote {path} (rows: x, x', |x' - x| on one scale for all images, white = {peak:.3g} in [0, 1] pixel "
          f"units; {len(y)} {args.split} images of {split.name}, {picked}; drawn {scale}x; "
          f"{cls.__name__}; label preserved: {label}; "
          f"bn mode {bn_mode}, sigma {settings['sigma']}, {settings['steps']} steps, max step {settings['max_step']} "
          f"(settings from {source}))")
    for i in range(len(y)):
        c = int(y[i])
        print(f"  image {i} (index {picks[i]}): label {c}{f' (class {named(c)})' if names else ''}, perceptual "
              f"distance {float(stats.perceptual_distance[i]):.3f}, ||x' - x|| {float(moved[i]):.3f}, "
              f"log p drop {float(stats.logp_drop[i]):+.4f}, label preserved {kept[i]}")
    return path
