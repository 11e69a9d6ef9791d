"""``lpa3 show``: a PNG of x, x' and |x' - x| for a checkpoint of a ready module, or of your own
module and data module trained with ``lpa3 fit`` (which saves their classes in the checkpoint).

    lpa3 show --ckpt runs/.../last.ckpt --out lpa3_examples.png [--root DIR] [--split test]
              [--num 8] [--seed 0] [--network net1] [--sigma S] [--steps N] [--max-step auto|none|L]
              [--bn-mode auto|eval|twin|batch]

Rows: the first ``--num`` images of the split, their LP-A3 hard positives under the
checkpoint's model, and the absolute difference stretched per image. Prints the per-image
perceptual distance, the log-probability drop and whether the label was preserved.

What training made, by default: the solver's settings (sigma, steps, step bound, BatchNorm
mode, ...) are read from the checkpoint's ``LPA3Callback`` state, the data set and its
normalisation from the checkpoint's data module (your own, rebuilt from the class and arguments
``lpa3 fit`` saved), and the label preserved is the one training preserves (the true label for
``LPA3Classifier``; the model's prediction, standing in for the pseudo-label or the guess, for
``FixMatchClassifier``, ``PESClassifier`` and ``DivideMixClassifier``; your module's
``lpa3_request`` targets for your own). A flag overrides a setting. A checkpoint whose data
module is unknown is refused with the fix.
"""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import default_collate

from lpa3_lightning.callback.lpa3_callback import is_lpa3_state
from lpa3_lightning.core.attack import lpa3_attack
from lpa3_lightning.core.batch_statistics import resolve_bn_mode
from lpa3_lightning.core.dual_bn import has_dual_bn
from lpa3_lightning.core.input_box import check_max_step
from lpa3_lightning.core.model_outputs import eval_mode
from lpa3_lightning.core.visualize import save_comparison_grid

__all__ = ["main"]

#: The package's ready modules (their checkpoints load without a saved class path).
READY = ("LPA3Classifier", "FixMatchClassifier", "PESClassifier", "DivideMixClassifier")

#: The solver's settings when the checkpoint holds none (written without LPA3Callback): its defaults.
CALLBACK_DEFAULTS: dict[str, Any] = {"sigma": 0.02, "steps": 5, "lam": 1.0, "temperature": 1.0, "max_step": "auto",
                                     "attack_bn": "auto", "project": True, "fast": False, "allow_tf32": False,
                                     "layers": None}


def _saved_class(hparams: dict[str, Any]) -> type | None:
    """The class ``lpa3 fit`` (LightningCLI) saved in the hyperparameters (``_class_path``), imported."""
    path = hparams.get("_class_path")
    if not isinstance(path, str) or "." not in path:
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
    saved = _saved_class(hparams)
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


def _images(checkpoint: dict[str, Any], root: str | None, split: str, num: int) -> tuple[Any, str, dict]:
    """The first ``num`` samples of ``split`` (``(x, y)``, or the batch of the user's own data
    module), the data set's name and normalisation."""
    from lpa3_lightning.data import MedMNISTDataModule, NoisyLabelDataModule, SemiSupervisedDataModule
    from lpa3_lightning.data.ssl_sources import source_facts

    data_hparams = checkpoint.get("datamodule_hyper_parameters", {})
    own = _saved_class(data_hparams)
    if own is not None and not issubclass(own, (MedMNISTDataModule, SemiSupervisedDataModule, NoisyLabelDataModule)):
        return _own_images(own, data_hparams, split, num)
    if not data_hparams:
        raise SystemExit("lpa3 show: error: the checkpoint names no data module (the fit was given loaders, or a data "
                         "module that saved no hyperparameters), so the images it was trained on are unknown. Fix: "
                         "train through a data module that calls self.save_hyperparameters() (with `lpa3 fit` its "
                         "class is then saved too), or draw x' from your own code with "
                         "lpa3_lightning.core.visualize.save_comparison_grid.")
    root = root or data_hparams.get("root")
    if "flag" not in data_hparams and "source" not in data_hparams:
        raise SystemExit("lpa3 show: error: the checkpoint's data module hyperparameters name no MedMNIST `flag` and no "
                         f"`source` ({sorted(data_hparams)}), so the images it was trained on are unknown. Fix: train "
                         "with `lpa3 fit` (it saves the data module's class), or draw x' from your own code with "
                         "lpa3_lightning.core.visualize.save_comparison_grid.")
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
        if split == "train":
            dataset = [(data.eval_transform()(image), label, i) for i, (image, label) in
                       ((i, data.train_base[i]) for i in range(min(num, len(data.train_base))))]
        else:
            dataset = {"val": data.val_dataset, "test": data.test_dataset}[split]
    x, y, _ = default_collate([dataset[i] for i in range(min(num, len(dataset)))])
    return (x, y), name, data.normalization


def _own_images(cls: type, hparams: dict[str, Any], split: str, num: int) -> tuple[Any, str, dict]:
    """The first ``num`` samples of ``split`` of the user's own data module, rebuilt from the class
    and arguments the checkpoint saved: its collated batch (the module's request reads it)."""
    data = cls(**{key: value for key, value in hparams.items() if not key.startswith("_")})
    data.setup("fit" if split in ("train", "val") else "test")
    loader = getattr(data, {"train": "train_dataloader", "val": "val_dataloader", "test": "test_dataloader"}[split])()
    dataset = getattr(loader, "dataset", None)
    if dataset is None or not hasattr(dataset, "__len__"):
        raise SystemExit(f"lpa3 show: error: {cls.__name__}.{split}_dataloader() returns a {type(loader).__name__} "
                         "without one map-style dataset (e.g. a CombinedLoader of labeled and unlabeled batches), so "
                         "the command cannot take its first images. Fix: pass --split with a split whose loader is a "
                         "DataLoader, or draw x' from your own code with "
                         "lpa3_lightning.core.visualize.save_comparison_grid.")
    return default_collate([dataset[i] for i in range(min(num, len(dataset)))]), cls.__name__, \
        getattr(data, "normalization", None)


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
    parser.add_argument("--num", default=8, type=int, help="images in the grid")
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
    if args.num < 1:
        parser.error("--num must be >= 1")
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
    try:
        module = cls.load_from_checkpoint(args.ckpt, map_location="cpu")
    except (KeyError, RuntimeError, TypeError, ValueError) as exc:
        parser.error(f"--ckpt {args.ckpt} does not load into {cls.__name__} ({type(exc).__name__}: {exc}). It may be a "
                     "checkpoint of another module, or an older one whose network has changed since (PreAct "
                     "ResNet-18 and WRN, docs/method.md section 8). Fix: pass a checkpoint of `lpa3 fit` with a ready "
                     "module (LPA3Classifier, FixMatchClassifier, PESClassifier or DivideMixClassifier) of this "
                     "release, or call lpa3_lightning.core.visualize.save_comparison_grid from your own code.")
    module.train()  # as in training: the solver puts the model in eval mode itself (batch mode needs the flags)
    ready = cls.__name__ in READY  # (or a subclass of one: its own training path, as theirs)
    ready = ready or any(base.__name__ in READY and base.__module__.startswith("lpa3_lightning") for base in cls.__mro__)
    networks = module.lpa3_networks() if callable(getattr(module, "lpa3_networks", None)) else None
    network = (args.network or networks[0]) if networks else None
    model: nn.Module = module.lpa3_model(network) if networks else module.lpa3_model()
    bn_mode = resolve_bn_mode(model, settings["attack_bn"])
    if bn_mode in ("twin", "batch") and (args.num < 2 or (bn_mode == "twin" and not has_dual_bn(model))):
        parser.error(f"--bn-mode {bn_mode} needs --num >= 2 (batch statistics){' and a model with twin BNs' if bn_mode == 'twin' else ''}. "
                     "Fix: use --bn-mode eval.")
    samples, name, normalization = _images(checkpoint, args.root, args.split, args.num)
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
    x_adv, stats = lpa3_attack(
        model, x, y, sigma=settings["sigma"], steps=settings["steps"], lam=settings["lam"],
        temperature=settings["temperature"], layers=settings["layers"], input_range=normalization, bn_mode=bn_mode,
        max_step=settings["max_step"], project=settings["project"], fast=settings["fast"],
        allow_tf32=settings["allow_tf32"], generator=torch.Generator().manual_seed(args.seed), return_stats=True)
    path = save_comparison_grid(args.out, x, x_adv, normalization)
    source = "the checkpoint's LPA3Callback" if from_checkpoint else "LPA3Callback's defaults (the checkpoint holds none)"
    print(f"wrote {path} (rows: x, x', |x' - x| stretched per image; {len(y)} {args.split} images of {name}; "
          f"{cls.__name__}; label preserved: {label}; "
          f"bn mode {bn_mode}, sigma {settings['sigma']}, {settings['steps']} steps, max step {settings['max_step']} "
          f"(settings from {source}))")
    for i in range(len(y)):
        print(f"  image {i}: label {int(y[i])}, perceptual distance {float(stats.perceptual_distance[i]):.3f}, "
              f"log p drop {float(stats.logp_drop[i]):+.4f}, label preserved {bool(stats.preserved[i])}")
    return path
