"""``lpa3 show``: a PNG of x, x' and |x' - x| for a checkpoint of a ready module, or of your own module and
data module trained with ``lpa3 fit`` (which saves their classes in the checkpoint).

It draws what training made (docs/inspect.md): the solver's settings of the checkpoint's ``LPA3Callback``, the
images of its data module, its network, the label training preserves; a flag overrides a setting.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import inspect
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from torch.utils.data import Subset, default_collate

from lpa3_lightning.callback.resume_point import is_lpa3_state
from lpa3_lightning.core.solver import lpa3_attack
from lpa3_lightning.core.forward_modes import resolve_bn_mode
from lpa3_lightning.core.dual_bn import has_dual_bn
from lpa3_lightning.core.solver import check_max_step
from lpa3_lightning.core.checks import eval_mode
from lpa3_lightning.core.visualize import difference_peak, save_comparison_grid
from lpa3_lightning.modules import DivideMixClassifier, FixMatchClassifier, LPA3Classifier, PESClassifier
from lpa3_lightning.modules.ready import NETWORK_RECORD, NetworkNotSavedError

__all__ = ["main"]

#: The solver's settings when the checkpoint holds none (written without LPA3Callback): its defaults.
CALLBACK_DEFAULTS: dict[str, Any] = {"sigma": 0.02, "steps": 5, "lam": 1.0, "temperature": 1.0, "max_step": "auto",
                                     "attack_bn": "auto", "project": True, "fast": False, "allow_tf32": False,
                                     "layers": None}
AUTO_HEIGHT = 112  # --scale auto: the smallest integer scale that draws an image at least this tall
OWN_CODE = "draw x' from your own code with lpa3_lightning.core.visualize.save_comparison_grid (docs/inspect.md)"


def _import_class(path: Any) -> type | None:
    """The class of a ``_class_path`` that ``lpa3 fit`` saved (None: none); a ``SystemExit`` if it does not import."""
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
    """The module a checkpoint was written by: the class ``lpa3 fit`` saved or the ready module's record, else
    the ready module its state and hyper-parameters tell (each keeps its settings under the method's name)."""
    hparams, record = checkpoint.get("hyper_parameters", {}), checkpoint.get(NETWORK_RECORD)
    saved = _import_class(hparams.get("_class_path")) or (_import_class(record.get("module"))
                                                           if isinstance(record, dict) else None)
    if saved is not None:
        return saved
    if any(key.startswith("net1.") for key in checkpoint.get("state_dict", {})):
        return DivideMixClassifier
    return PESClassifier if "pes" in hparams else FixMatchClassifier if "fixmatch" in hparams else LPA3Classifier


def _split(checkpoint: dict[str, Any], root: str | None, split: str) -> tuple[Any, str, Any, list[str] | None]:
    """The split as the checkpoint's data module makes it: a map-style dataset, the data's name, normalisation and
    class names (None: numbers); a ``SystemExit`` with the fix for a data module it cannot rebuild."""
    from lpa3_lightning.data import IndexedDataset, MedMNISTDataModule, NoisyLabelDataModule, SemiSupervisedDataModule
    from lpa3_lightning.data.ssl_datasets import source_facts

    hparams = checkpoint.get("datamodule_hyper_parameters", {})
    own = _import_class(hparams.get("_class_path"))
    if own is not None and not issubclass(own, (MedMNISTDataModule, SemiSupervisedDataModule, NoisyLabelDataModule)):
        return _own_split(own, hparams, split, root)
    if not hparams:
        raise SystemExit("lpa3 show: error: the checkpoint names no data module (the fit was given loaders, or one "
                         "that saved no hyperparameters), so its images are unknown. Fix: train through a data module "
                         f"that calls self.save_hyperparameters() (docs/configs-and-data.md), or {OWN_CODE}.")
    if "flag" not in hparams and "source" not in hparams:
        raise SystemExit("lpa3 show: error: the checkpoint's data module hyperparameters name no MedMNIST `flag` and "
                         f"no `source` ({sorted(hparams)}), so the images it was trained on are unknown. Fix: train "
                         f"with `lpa3 fit` (it saves the data module's class), or {OWN_CODE}.")
    root, medmnist = root or hparams.get("root"), "flag" in hparams
    name = hparams["flag" if medmnist else "source"]
    data: Any = MedMNISTDataModule(name, root=root) if medmnist else SemiSupervisedDataModule(
        name, root=root, num_labels=int(source_facts(name)["num_classes"]))  # (the noisy-label modules' source too)
    data.setup("fit" if split in ("train", "val") else "test")
    if medmnist or split != "train":
        dataset = getattr(data, f"{split}_dataset")
    else:  # the source's training images in the evaluation view, as (x, y, index)
        dataset = IndexedDataset(copy.copy(data.train_base))
        dataset.dataset.transform = data.eval_transform()
    return dataset, name, data.normalization, _class_names(data, dataset, name)


def _own_split(cls: type, hparams: dict[str, Any], split: str, root: str | None = None) -> tuple:
    """The split of the user's own data module, rebuilt from the class and arguments the checkpoint saved
    (``root`` replaces its ``root``): its loader's dataset, whose collated items the module's request reads."""
    kwargs = {key: value for key, value in hparams.items() if not key.startswith("_")}
    data = cls(**{**kwargs, "root": root} if root is not None and "root" in kwargs else kwargs)
    data.setup("fit" if split in ("train", "val") else "test")
    loader = getattr(data, f"{split}_dataloader")()
    dataset = getattr(loader, "dataset", None)
    if dataset is None or not hasattr(dataset, "__len__"):
        raise SystemExit(f"lpa3 show: error: {cls.__name__}.{split}_dataloader() returns a {type(loader).__name__} "
                         "without one map-style dataset (e.g. a CombinedLoader of labeled and unlabeled batches). Fix: "
                         f"pass --split with a split whose loader is a DataLoader, or {OWN_CODE}.")
    return dataset, cls.__name__, getattr(data, "normalization", None), _class_names(data, dataset, None)


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
    if not (isinstance(item, (tuple, list)) and len(item) >= 2 and item[1] is not None):
        raise ValueError("the items are not (x, y, ...) tuples")
    return int(np.asarray(item[1].cpu() if isinstance(item[1], torch.Tensor) else item[1]).reshape(-1)[0])


def _pick(parser: argparse.ArgumentParser, dataset: Any, args: argparse.Namespace) -> tuple[list[int], str]:
    """The dataset positions to draw, and how they were chosen (for the printout)."""
    size, num = len(dataset), args.num
    if args.indices:
        bad = [i for i in args.indices if not 0 <= i < size]
        if bad:
            parser.error(f"--indices {' '.join(map(str, bad))}: the {args.split} split holds {size} items "
                         f"(positions 0 to {size - 1}). Fix: pass positions in that range.")
        return list(args.indices), "chosen by --indices"
    if args.images == "first":
        return list(range(min(num or 8, size))), "the first"
    if args.images == "random":
        order = torch.randperm(size, generator=torch.Generator().manual_seed(args.sample_seed))[:min(num or 8, size)]
        return sorted(int(i) for i in order), f"drawn at random (--sample-seed {args.sample_seed})"
    try:
        labels = _labels_of(dataset) or [_label_of_item(dataset[i]) for i in range(size)]
    except (ValueError, TypeError, IndexError) as exc:
        parser.error(f"--images per-class needs each item's class, and the {args.split} split's items give none "
                     f"({exc}). Fix: pass --indices, or --images random.")
    by_class: dict[int, list[int]] = {}
    for position, label in enumerate(labels):
        if label >= 0:  # (-1: an unlabeled image)
            by_class.setdefault(label, []).append(position)
    num = num or len(by_class)
    picks = [by_class[label][rank] for rank in range(max(map(len, by_class.values()), default=0))
             for label in sorted(by_class) if rank < len(by_class[label])][:num]  # round-robin over the classes
    return picks, f"one per class ({len(by_class)} classes)" if num <= len(by_class) else "round-robin over the classes"


def _network_from_run_config(ckpt: Path, checkpoint: dict[str, Any], cls: type) -> tuple[dict[str, Any], str]:
    """For a checkpoint written before the network was kept in it: the ``model`` class-path config of the run's
    ``config.yaml`` (LightningCLI's, beside the checkpoints' folder) as a keyword argument, and a note."""
    hparams = checkpoint.get("hyper_parameters", {})
    path = next((f / "config.yaml" for f in (ckpt.parent, ckpt.parent.parent) if (f / "config.yaml").is_file()), None)
    if path is None or "model" in hparams or NETWORK_RECORD in checkpoint or \
            "model" not in inspect.signature(cls.__init__).parameters:
        return {}, ""
    try:
        config = (yaml.safe_load(path.read_text()) or {}).get("model") or {}
    except (yaml.YAMLError, OSError, AttributeError):
        return {}, ""
    this_run = hparams.get("_class_path") in (None, config.get("class_path"))  # (not another module's config)
    spec = (config.get("init_args") or {}).get("model") if this_run else None
    if isinstance(spec, Mapping) and isinstance(spec.get("class_path"), str):
        return {"model": dict(spec)}, f"network: {spec['class_path']} from {path}"
    return {}, ""


def _scale(text: str) -> Any:
    if text.lower() != "auto" and int(text) < 1:
        raise argparse.ArgumentTypeError("must be auto or an integer >= 1")
    return "auto" if text.lower() == "auto" else int(text)


def _max_step(text: str) -> Any:
    return "auto" if text.lower() == "auto" else None if text.lower() == "none" else float(text)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lpa3 show", description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--ckpt", required=True, type=Path, help="a checkpoint of a ready module")
    add("--out", default=Path("lpa3_examples.png"), type=Path, help="PNG to write")
    add("--root", default=None, help="the data folder (default: the checkpoint's, else the embedded data)")
    add("--split", default="test", choices=["train", "val", "test"])
    add("--num", default=None, type=int, help="images in the grid (default: 8; with --images per-class, one per class)")
    add("--images", default="first", choices=["first", "random", "per-class"],
        help="which images: the split's first --num, a seeded random sample, or one per class")
    add("--indices", default=None, type=int, nargs="+", metavar="I",
        help="these positions of the split instead (overrides --images and --num)")
    add("--sample-seed", default=0, type=int, help="seed of --images random")
    add("--scale", default="auto", type=_scale,
        help=f"draw each pixel N x N (auto: the smallest N that draws an image at least {AUTO_HEIGHT} px tall)")
    add("--no-labels", action="store_true", help="no text under the grid (index, class, distances)")
    add("--seed", default=0, type=int, help="seed of the solver's initial noise")
    add("--network", default=None, choices=["net1", "net2"], help="DivideMix: the network (net1)")
    add("--sigma", default=None, type=float, help="default: the training callback's")
    add("--steps", default=None, type=int, help="default: the training callback's")
    add("--max-step", default=None, type=_max_step, help="largest L2 length of one solver step: auto, none (the "
        "authors' unbounded step) or a number; default: the training callback's")
    add("--bn-mode", default=None, choices=["auto", "eval", "twin", "batch"], help="the solver's BatchNorm mode; "
        "default: the training callback's (auto: the twin BNs when the model has them, else its own BNs, on the "
        "shown images' batch statistics)")
    return parser


def _load_module(parser: argparse.ArgumentParser, path: Path, checkpoint: dict[str, Any]) -> tuple[Any, type, str]:
    """The checkpoint's module (in train mode, as in training: the solver sets eval mode itself), its class and
    the note on a network from the run's config; a refusal naming the fix if it does not load."""
    cls = _module_class(checkpoint)
    extra, note = _network_from_run_config(path, checkpoint, cls)
    try:
        return cls.load_from_checkpoint(path, map_location="cpu", **extra).train(), cls, note
    except NetworkNotSavedError as exc:
        parser.error(f"--ckpt {path}: {exc} Fix for lpa3 show: train with `model` given as a class-path config "
                     "(`model: {class_path: ...}` under the module's init_args), which the checkpoint keeps, or "
                     f"{OWN_CODE}.")
    except (KeyError, RuntimeError, TypeError, ValueError) as exc:
        parser.error(f"--ckpt {path} does not load into {cls.__name__} ({type(exc).__name__}: {exc}): a checkpoint of "
                     "another module, or an older one whose network changed since (docs/method.md section 8). Fix: "
                     f"pass a checkpoint of `lpa3 fit` with a ready module or your own of this release, or {OWN_CODE}.")


def main(argv: list[str] | None = None) -> Path:
    """Run ``lpa3 show`` with ``argv``; returns the PNG written (argparse's ``SystemExit`` on a refusal)."""
    parser = _parser()
    args = parser.parse_args(argv)
    if not args.ckpt.is_file():
        parser.error(f"--ckpt {args.ckpt} does not exist. Fix: pass a checkpoint of `lpa3 fit` (its checkpoints/).")
    if args.num is not None and args.num < 1:
        parser.error(f"--num must be >= 1, got {args.num}. Fix: e.g. --num 8.")
    checkpoint = torch.load(args.ckpt, map_location="cpu", weights_only=False)
    # the training callback's solver settings (its state found by its layout, a subclass's too), else its defaults
    states = [state for state in checkpoint.get("callbacks", {}).values() if is_lpa3_state(state)]
    networks = states[0].get("networks", {}) if states else {}
    saved = networks.get(args.network or "", networks.get("net1", {})).get("settings")
    given = {"sigma": args.sigma, "steps": args.steps, "max_step": args.max_step, "attack_bn": args.bn_mode}
    settings = {**CALLBACK_DEFAULTS, **(saved or {}), **{key: val for key, val in given.items() if val is not None}}
    try:
        check_max_step(settings["max_step"])
    except ValueError as exc:
        parser.error(f"--max-step: {exc}")
    module, cls, network_note = _load_module(parser, args.ckpt, checkpoint)
    networks = module.lpa3_networks() if callable(getattr(module, "lpa3_networks", None)) else None
    network = (args.network or networks[0]) if networks else None
    model = module.lpa3_model(network) if networks else module.lpa3_model()
    bn_mode = resolve_bn_mode(model, settings["attack_bn"])
    dataset, data_name, normalization, names = _split(checkpoint, args.root, args.split)
    picks, picked = _pick(parser, dataset, args)
    if bn_mode in ("twin", "batch") and (len(picks) < 2 or (bn_mode == "twin" and not has_dual_bn(model))):
        parser.error(f"--bn-mode {bn_mode} needs two images or more (batch statistics)"
                     f"{' and a model with twin BNs' if bn_mode == 'twin' else ''}. Fix: use --bn-mode eval, or "
                     "draw more images.")
    samples = default_collate([dataset[i] for i in picks])
    # a ready module (or a subclass of one, trained as theirs) preserves the true label or the model's own
    if issubclass(cls, (LPA3Classifier, FixMatchClassifier, PESClassifier, DivideMixClassifier)):
        supervised = issubclass(cls, LPA3Classifier)
        x, y, label = samples[0], samples[1], "the true label" if supervised else "the model prediction"
        if not supervised:  # (the pseudo-label or the guess, in training)
            with torch.no_grad(), eval_mode(model):
                y = model(x).argmax(1)
    else:  # the user's module: the inputs and labels its own request hands the callback in training
        request = module.lpa3_request(samples, network) if networks else module.lpa3_request(samples)
        x, y, label = request.inputs, request.targets, "the module's lpa3_request targets"
    if not (x.dim() == 4 and x.shape[1] in (1, 3)):
        parser.error(f"the {args.split} split's inputs are {tuple(x.shape)}, not images (N, 1 or 3, h, w), so there "
                     "is nothing to draw. Fix: read lpa3/perceptual_distance in the training logs instead.")
    solver = {key: settings[key] for key in CALLBACK_DEFAULTS if key != "attack_bn"}
    x_adv, stats = lpa3_attack(model, x, y, input_range=normalization, bn_mode=bn_mode, return_stats=True,
                               generator=torch.Generator().manual_seed(args.seed), **solver)
    peak, moved = difference_peak(x, x_adv, normalization), (x_adv - x).flatten(1).norm(dim=1)
    named = [names[c] if names is not None and 0 <= c < len(names) else str(c) for c in map(int, y)]
    kept = [bool(stats.preserved[i]) for i in range(len(y))]
    scale = max(1, math.ceil(AUTO_HEIGHT / x.shape[2])) if args.scale == "auto" else args.scale
    labels = None if args.no_labels else [
        f"#{picks[i]}\n{named[i]}\nd {float(stats.perceptual_distance[i]):.2f}  L2 {float(moved[i]):.2f}\n"
        f"{'kept' if kept[i] else 'NOT kept'}" for i in range(len(y))]
    caption = None if args.no_labels else (
        f"rows: x, x', |x'-x| on one scale (white = {peak:.3g}, pixels in [0, 1]). #: index in the {args.split} "
        f"split; d: perceptual distance; L2: ||x'-x|| of the model's inputs; kept: log p({label}) within sigma "
        f"{settings['sigma']:g}")
    path = save_comparison_grid(args.out, x, x_adv, normalization, peak=peak if peak > 0 else None, scale=scale,
                                labels=labels, caption=caption)
    source = "the checkpoint's LPA3Callback" if saved else \
        "LPA3Callback's defaults (the checkpoint holds none)"
    if network_note:
        print(network_note)
    print(f"wrote {path} (rows: x, x', |x' - x| on one scale for all images, white = {peak:.3g} in [0, 1] pixel "
          f"units; {len(y)} {args.split} images of {data_name}, {picked}; drawn {scale}x; {cls.__name__}; label "
          f"preserved: {label}; bn mode {bn_mode}, sigma {settings['sigma']}, {settings['steps']} steps, max step "
          f"{settings['max_step']} (settings from {source}))")
    for i in range(len(y)):
        print(f"  image {i} (index {picks[i]}): label {int(y[i])}{f' (class {named[i]})' if names else ''}, "
              f"perceptual distance {float(stats.perceptual_distance[i]):.3f}, ||x' - x|| {float(moved[i]):.3f}, "
              f"log p drop {float(stats.logp_drop[i]):+.4f}, label preserved {kept[i]}")
    return path
