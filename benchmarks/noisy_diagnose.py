"""How right are the labels a noisy-label run trains on? One PES or DivideMix run, watched against the clean labels.

    python benchmarks/noisy_diagnose.py --seed 0 --epochs 12 --warmup 5                      # PES + LP-A3
    python benchmarks/noisy_diagnose.py --method dividemix --seed 2 --epochs 12 --warmup 5 [--lpa3] [--per-class]
    python benchmarks/noisy_diagnose.py --method dividemix --source pneumoniamnist --root <npz folder> --rate 0.4

The run has the settings of the ``docs/results.md`` noisy-label table (MNIST-5k, symmetric noise
that always changes the label, small CNN, batch 64, warm-up 5, lambda_u 25; LP-A3 ratio 0.9,
sigma 0.02, 5 steps, from the semi-supervised phase on) and follows ``noisy_table.py``'s run of
the same seed: it builds the data, seeds and evaluates in the same order. A watcher reads the
clean labels the data module keeps for evaluation (they never reach the training step) and
prints one line per epoch, with the clean test accuracy.

``--method pes`` (PES + LP-A3; ``--confidence`` runs the ``lpa3_confidence`` variant), after
LP-A3 prepared each semi-supervised step: ``labeled clean`` (share of the labeled rows whose
noisy label is the clean one), ``guess right`` (share of the unlabeled rows whose guessed label,
the argmax of the sharpened guess, is the clean one), ``x' label right`` (the same over the rows
LP-A3 attacked: TCS picks the least time-consistent, the hardest) and ``x' share`` (attacked
rows per unlabeled row). Counts are per batch visit (the balanced sampler revisits the labeled set).

``--method dividemix`` (LP-A3 with ``--lpa3``), after every epoch, per network, its clean
probabilities ``w`` (the GMM split the epoch trained on) against the clean labels: ``labeled``
(share with ``w`` above the threshold: the labeled set the *other* network trains on),
``precision`` (share of those whose noisy label is clean), ``recall`` (share of the clean labels
in it), ``AUROC`` (how well ``w`` ranks clean above noisy); the test accuracy of each network and
of their sum (the module's prediction). Trials of the split (not options of the package; each
reads only what training sees, except ``--oracle-split``): ``--oracle-split`` replaces the split
by the truth, to test the semi-supervised phase alone; ``--balanced-split`` keeps the GMM's
labeled count but spreads it evenly over the noisy classes (each class's lowest-loss rows);
``--freeze-count`` holds that count at the first split's; ``--reference-epoch-length`` ends each
semi-supervised epoch as the reference code does. ``--stratified-split`` is the package's
option that grew out of the balanced split. What these runs found: ``docs/notes/noisy-label-diagnoses.md``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.harness import apply_threads, run_arguments  # noqa: E402


def _arguments() -> tuple[argparse.ArgumentParser, dict[str, argparse._ArgumentGroup]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--method", choices=("pes", "dividemix"), default="pes", help="the run to watch")
    run_arguments(parser, seed=0, threads=1)
    parser.add_argument("--source", default="mnist5k", help="mnist5k (ships) or a MedMNIST flag with --root")
    parser.add_argument("--root", default=None, help="folder of the MedMNIST npz files")
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=5, help="PES's T1 or DivideMix's warm-up, in epochs")
    parser.add_argument("--rate", type=float, default=0.8, help="symmetric noise rate (always a wrong label)")
    parser.add_argument("--lambda-u", type=float, default=25.0)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--sigma", type=float, default=0.02, help="LPA3Callback's sigma")
    parser.add_argument("--ratio", type=float, default=0.9, help="LPA3Callback's ratio (the share TCS selects)")
    parser.add_argument("--limit-train-batches", type=int, default=None,
                        help="at most this many training batches an epoch (a smoke run of the script, not a result)")
    pes = parser.add_argument_group("pes", "with --method pes")
    pes.add_argument("--confidence", type=float, default=None, help="PESClassifier(pes={'lpa3_confidence': ...})")
    dm = parser.add_argument_group("dividemix", "with --method dividemix")
    dm.add_argument("--lpa3", action="store_true", help="add LPA3Callback(ratio=--ratio, sigma=--sigma, steps=5)")
    dm.add_argument("--guess-bn-updates", action="store_true",
                    help="DivideMixSettings.guess_bn_updates=True (the authors' BatchNorm handling)")
    dm.add_argument("--lr-drop-epoch", type=int, default=None,
                    help="DivideMixClassifier(lr_drop_epoch=): None drops at half the epochs, -1 never")
    dm.add_argument("--threshold", type=float, default=0.5,
                    help="DivideMixSettings.threshold: clean probability above which a label is trusted")
    dm.add_argument("--alpha", type=float, default=4.0, help="mixup's Beta parameter (DivideMix: 4)")
    dm.add_argument("--prior-weight", type=float, default=1.0, help="DivideMixSettings.prior_weight")
    dm.add_argument("--class-prior", type=float, nargs="+", default=None,
                    help="DivideMixSettings.class_prior: the prior penalty's class frequencies")
    dm.add_argument("--split-per-class", action="store_true",
                    help="DivideMixSettings.split_per_class=True: one Gaussian mixture per noisy class")
    dm.add_argument("--stratified-split", action="store_true",
                    help="DivideMixSettings.stratified_split=True: the first split's count, by class, lowest losses")
    dm.add_argument("--reference-epoch-length", action="store_true",
                    help="end each semi-supervised epoch after one pass over the labeled set (the reference's "
                         "epoch length) instead of a pass over the whole set")
    dm.add_argument("--per-class", action="store_true",
                    help="also print, per class, the labeled set's size (by noisy label) and the test recall")
    dm.add_argument("--oracle-split", action="store_true",
                    help="replace each network's GMM split by the true clean/noisy indicator (w = 1 on a clean "
                         "label, 0 on a noisy one): a check of the semi-supervised phase alone, given a perfect split")
    dm.add_argument("--balanced-split", action="store_true",
                    help="a trial, not a library option: after the GMM, keep as labeled the same number of rows "
                         "per noisy class (the GMM's labeled count / classes), each class's lowest-loss rows, "
                         "with w = 1 (the others w = 0)")
    dm.add_argument("--freeze-count", action="store_true",
                    help="with --balanced-split: the per-class count is the first split's, never raised after")
    return parser, {"pes": pes, "dividemix": dm}


def _check(parser: argparse.ArgumentParser, groups: dict[str, argparse._ArgumentGroup],
           args: argparse.Namespace) -> None:
    """Refuse a flag of the other method (it would be silently ignored) and splits that exclude each other."""
    for method, group in groups.items():
        if method == args.method:
            continue
        given = [max(a.option_strings, key=len) for a in group._group_actions if getattr(args, a.dest) != a.default]
        if given:
            one = len(given) == 1
            parser.error(f"{', '.join(given)} only appl{'ies' if one else 'y'} to --method {method}: add "
                         f"--method {method}, or leave {'it' if one else 'them'} out")
    if args.freeze_count and not args.balanced_split:
        parser.error("--freeze-count needs --balanced-split (it fixes the balanced split's per-class count)")
    splits = [flag for flag, on in (("--oracle-split", args.oracle_split), ("--balanced-split", args.balanced_split),
                                    ("--stratified-split", args.stratified_split)) if on]
    if len(splits) > 1:
        parser.error(f"{' and '.join(splits)} are different splits: pass one")


def noisy_data(args: argparse.Namespace):
    """Sets the threads and the seed, then builds the data module set up for fitting and testing
    (in noisy_table.py's order, so that the watched run follows the table's run of this seed)."""
    import lightning.pytorch as pl

    from lpa3_lightning.data import NoisyLabelDataModule

    apply_threads(args.threads)
    pl.seed_everything(args.seed)
    data = NoisyLabelDataModule(args.source, root=args.root, noise_rate=args.rate, noise_mode="symmetric",
                                noise_convention="other", seed=args.seed, batch_size=args.batch_size)
    data.setup("fit")
    data.setup("test")
    return data


def predict_test_split(pl_module, data, forwards: dict[str, Callable]):
    """The test labels and each forward's predicted class, from one pass over one test loader in eval mode.

    One pass, as ``noisy_table.py`` evaluates: a loader's iterator draws from the global RNG, so a
    watched run follows the table's run of the same seed only if it draws the same.
    """
    import torch

    labels, predicted = [], {name: [] for name in forwards}
    was_training = pl_module.training
    pl_module.eval()
    with torch.no_grad():
        for x, y, _ in data.test_dataloader():
            labels.append(y)
            for name, forward in forwards.items():
                predicted[name].append(forward(x).argmax(1))
    pl_module.train(was_training)
    return torch.cat(labels), {name: torch.cat(values) for name, values in predicted.items()}


def pes_run(args: argparse.Namespace, data) -> tuple:
    """PES + LP-A3 and the watcher of the labels its steps train on."""
    import torch
    from lightning.pytorch.callbacks import Callback

    from lpa3_lightning import LPA3Callback, PESClassifier

    clean = torch.as_tensor(data.clean_train_labels)
    noisy = torch.as_tensor(data.noisy_train_labels)
    module = PESClassifier(arch="small_cnn", in_channels=data.in_channels, num_classes=data.num_classes,
                           pes={"early_epochs": args.warmup, "refine_epochs": 0, "lambda_u": args.lambda_u,
                                "lpa3_confidence": args.confidence})
    lpa3 = LPA3Callback(ratio=args.ratio, sigma=args.sigma, steps=5, warmup_epochs=args.warmup, seed=0)

    class Watch(Callback):
        """Counts, after LPA3Callback prepared the step (so before training_step), against the clean labels."""

        def __init__(self) -> None:
            self.counts: dict[str, float] = {}

        def on_train_epoch_start(self, trainer, pl_module):
            self.counts = dict.fromkeys(("lab", "lab_clean", "unl", "guess_right", "adv", "adv_right"), 0.0)

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if pl_module.noisy_split_mask() is None:
                return
            idx = batch[3].cpu()
            labeled = pl_module.noisy_split_mask().cpu()[idx]
            c = self.counts
            c["lab"] += float(labeled.sum())
            c["lab_clean"] += float((noisy[idx][labeled] == clean[idx][labeled]).sum())
            guess = pl_module._pes_guess  # made for this batch by the request (LPA3Callback runs first)
            if guess is not None:
                if guess[0] is not batch[0]:
                    raise RuntimeError("the guess read is not this batch's: put LPA3Callback before the watcher")
                right = guess[1].argmax(1).cpu() == clean[idx[~labeled]]
                c["unl"] += float((~labeled).sum())
                c["guess_right"] += float(right.sum())
            made = lpa3.runner().last  # this batch's hard positives (None without x')
            if made is not None and len(made.augmented):
                augmented = made.augmented
                c["adv"] += len(augmented)
                c["adv_right"] += float((augmented.targets.cpu() == clean[augmented.indices.cpu()]).sum())

        def on_train_epoch_end(self, trainer, pl_module):
            c = self.counts
            labels, predicted = predict_test_split(pl_module, data, {"model": pl_module})
            accuracy = float((predicted["model"] == labels).float().mean())
            share = lambda a, b: f"{c[a] / c[b]:.3f}" if c[b] else "-"  # noqa: E731
            print(f"epoch {trainer.current_epoch:2d}: labeled clean {share('lab_clean', 'lab')}, guess right "
                  f"{share('guess_right', 'unl')}, x' label right {share('adv_right', 'adv')}, x' share "
                  f"{share('adv', 'unl')}, test acc {accuracy:.3f}", flush=True)

    return module, [lpa3, Watch()]


def dividemix_module_class(args: argparse.Namespace, is_clean, noisy_labels) -> type:
    """DivideMixClassifier, or a subclass with the trials of the split and of the epoch length asked for."""
    import torch

    from lpa3_lightning import DivideMixClassifier

    class ReferenceEpochLength(DivideMixClassifier):
        """Ends each semi-supervised epoch after as many steps as the reference code's epoch: one
        pass over the larger of the two labeled sets at half a batch of labeled rows a step."""

        def on_train_batch_start(self, batch, batch_idx):
            if self.dividemix_phase(self.current_epoch) != "semi":
                return None
            threshold = self.lpa3_settings.threshold
            labeled = max(int((w > threshold).sum()) for w in self._dm_state()["clean_prob"].values())
            return -1 if batch_idx >= -(-labeled // (args.batch_size // 2)) else None  # -1: Lightning ends the epoch

    module_class = ReferenceEpochLength if args.reference_epoch_length else DivideMixClassifier
    if args.oracle_split:
        base_class = module_class

        class OracleSplit(base_class):  # type: ignore[valid-type, misc]
            """The split a perfect co-divide would give: the clean labels the data module keeps for evaluation."""

            def dividemix_refresh_split(self, loader):
                super().dividemix_refresh_split(loader)  # keeps the loss history and labels as a real run does
                truth = is_clean.float()
                state = self._dm_state()
                for name in self.lpa3_networks():
                    state["clean_prob"][name] = truth.clone()
                return dict(state["clean_prob"])

        module_class = OracleSplit
    if args.balanced_split:
        base_balanced = module_class

        class BalancedSplit(base_balanced):  # type: ignore[valid-type, misc]
            """As many labeled rows per noisy class, each class's lowest-loss ones."""

            def dividemix_refresh_split(self, loader):
                super().dividemix_refresh_split(loader)
                state = self._dm_state()
                classes = self.lpa3_num_classes
                for name in self.lpa3_networks():
                    loss = torch.stack(state["history"][name]).mean(0)
                    per_class = -(-int((state["clean_prob"][name] > self.lpa3_settings.threshold).sum()) // classes)
                    if args.freeze_count:
                        per_class = state.setdefault("first_count", {}).setdefault(name, per_class)
                    w = torch.zeros_like(loss)
                    for c in range(classes):
                        rows = (noisy_labels == c).nonzero().flatten()
                        w[rows[loss[rows].argsort()[:per_class]]] = 1.0
                    state["clean_prob"][name] = w
                return dict(state["clean_prob"])

        module_class = BalancedSplit
    return module_class


def dividemix_run(args: argparse.Namespace, data) -> tuple:
    """DivideMix (+ LP-A3 with --lpa3) and the watcher of each network's split."""
    import torch
    from lightning.pytorch.callbacks import Callback
    from torchmetrics.functional.classification import binary_auroc

    from lpa3_lightning import LPA3Callback

    is_clean = torch.as_tensor(data.noisy_train_labels == data.clean_train_labels)
    noisy_labels = torch.as_tensor(data.noisy_train_labels)
    module_class = dividemix_module_class(args, is_clean, noisy_labels)
    module = module_class(arch="small_cnn", in_channels=data.in_channels, num_classes=data.num_classes,
                          lr_drop_epoch=args.lr_drop_epoch,
                          dividemix={"warmup_epochs": args.warmup, "lambda_u": args.lambda_u, "alpha": args.alpha,
                                     "threshold": args.threshold, "split_per_class": args.split_per_class,
                                     "stratified_split": args.stratified_split,
                                     "guess_bn_updates": args.guess_bn_updates, "prior_weight": args.prior_weight,
                                     "class_prior": args.class_prior})
    callbacks: list[Callback] = []
    if args.lpa3:
        callbacks.append(LPA3Callback(ratio=args.ratio, sigma=args.sigma, steps=5, warmup_epochs=args.warmup, seed=0))

    class Watch(Callback):
        def on_train_epoch_end(self, trainer, pl_module):
            parts = []
            for name in pl_module.lpa3_networks():
                w = pl_module._dm_state()["clean_prob"].get(name)
                if w is None:
                    continue
                labeled = w.cpu() > pl_module.lpa3_settings.threshold
                kept = int(labeled.sum())
                precision = float(is_clean[labeled].float().mean()) if kept else float("nan")
                recall = float(labeled[is_clean].float().mean())
                auroc = float(binary_auroc(w.cpu().float(), is_clean.long()))
                parts.append(f"{name}: labeled {kept / len(w):.3f} precision {precision:.3f} recall {recall:.3f} "
                             f"AUROC {auroc:.3f}")
            labels, predicted = predict_test_split(pl_module, data, {  # "sum": the module's own prediction
                "net1": pl_module.net1, "net2": pl_module.net2, "sum": pl_module})
            accuracy = {key: float((value == labels).float().mean()) for key, value in predicted.items()}
            classes = pl_module.lpa3_num_classes
            hits = torch.bincount(labels[predicted["sum"] == labels], minlength=classes).float()
            seen = torch.bincount(labels, minlength=classes).float()
            split = "; ".join(parts) if parts else "warm-up (no split)"
            print(f"epoch {trainer.current_epoch:2d}: {split}; test acc net1 {accuracy['net1']:.3f} net2 "
                  f"{accuracy['net2']:.3f} sum {accuracy['sum']:.3f}", flush=True)
            if args.per_class:
                for name in pl_module.lpa3_networks():
                    w = pl_module._dm_state()["clean_prob"].get(name)
                    if w is not None:
                        labeled = w.cpu() > pl_module.lpa3_settings.threshold
                        counts = torch.bincount(noisy_labels[labeled], minlength=classes).tolist()
                        clean = torch.bincount(noisy_labels[labeled & is_clean], minlength=classes).tolist()
                        print(f"    {name} labeled per class {counts}, of them clean {clean}", flush=True)
                print(f"    test recall per class {[round(v, 2) for v in (hits / seen.clamp_min(1)).tolist()]}",
                      flush=True)

    print(f"clean labels: {int(is_clean.sum())} of {len(is_clean)}", flush=True)
    return module, [*callbacks, Watch()]


def main(argv: list[str] | None = None) -> None:
    parser, groups = _arguments()
    args = parser.parse_args(argv)
    _check(parser, groups, args)

    import lightning.pytorch as pl

    data = noisy_data(args)
    module, callbacks = (pes_run if args.method == "pes" else dividemix_run)(args, data)
    # no validation: the watchers evaluate on the test split themselves
    trainer = pl.Trainer(max_epochs=args.epochs, accelerator="cpu", devices=1, callbacks=callbacks, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, num_sanity_val_steps=0, limit_train_batches=args.limit_train_batches)
    trainer.fit(module, datamodule=data)


if __name__ == "__main__":
    main()
