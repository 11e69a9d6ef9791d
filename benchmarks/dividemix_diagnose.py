"""Whether DivideMix's co-divide finds the clean labels: per epoch, per network, against the clean labels.

One DivideMix run (optionally + LP-A3) with the settings of the ``docs/results.md`` noisy-label
table (MNIST-5k, symmetric noise that always changes the label, small CNN, batch 64, warm-up 5,
lambda_u 25). After every epoch a watcher compares each network's clean probabilities ``w``
(the GMM split this epoch trained on) with the clean labels the data module keeps for evaluation
(they never reach the training step) and prints:

- ``labeled``: share of the training set with ``w`` above the threshold (the labeled set the
  *other* network trains on);
- ``precision``: share of those whose noisy label is the clean one;
- ``recall``: share of the clean-labeled samples that are in it;
- ``AUROC``: how well ``w`` ranks clean above noisy labels (torchmetrics);
- the clean test accuracy of each network and of their sum (the module's prediction).

Trials of the split (not options of the package; each reads only what training sees, except
``--oracle-split``): ``--oracle-split`` replaces the split by the truth, to test the
semi-supervised phase alone; ``--balanced-split`` keeps the GMM's labeled count but spreads it
evenly over the noisy classes (each class's lowest-loss rows); ``--freeze-count`` holds that
count at the first split's. ``--stratified-split`` is the package's option that grew out of the
last two (``DivideMixClassifier(dividemix={"stratified_split": True})``).

Usage::

    python benchmarks/dividemix_diagnose.py --seed 2 --epochs 12 --warmup 5 [--lpa3]
    python benchmarks/dividemix_diagnose.py --seed 2 --epochs 16 --warmup 10 --guess-bn-updates --oracle-split
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.noisy_setup import add_run_arguments, noisy_data, predict_test_split, watched_trainer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_run_arguments(parser)
    parser.add_argument("--lpa3", action="store_true", help="add LPA3Callback(ratio=0.9, sigma=0.02, steps=5)")
    parser.add_argument("--guess-bn-updates", action="store_true",
                        help="DivideMixSettings.guess_bn_updates=True (the authors' BatchNorm handling)")
    parser.add_argument("--lr-drop-epoch", type=int, default=None,
                        help="DivideMixClassifier(lr_drop_epoch=): None drops at half the epochs, -1 never")
    parser.add_argument("--threshold", type=float, default=0.5,
                        help="DivideMixSettings.threshold: clean probability above which a label is trusted")
    parser.add_argument("--alpha", type=float, default=4.0, help="mixup's Beta parameter (DivideMix: 4)")
    parser.add_argument("--prior-weight", type=float, default=1.0, help="DivideMixSettings.prior_weight")
    parser.add_argument("--class-prior", type=float, nargs="+", default=None,
                        help="DivideMixSettings.class_prior: the prior penalty's class frequencies")
    parser.add_argument("--split-per-class", action="store_true",
                        help="DivideMixSettings.split_per_class=True: one Gaussian mixture per noisy class")
    parser.add_argument("--stratified-split", action="store_true",
                        help="DivideMixSettings.stratified_split=True: the first split's count, by class, lowest losses")
    parser.add_argument("--reference-epoch-length", action="store_true",
                        help="end each semi-supervised epoch after one pass over the labeled set (the reference's "
                             "epoch length) instead of a pass over the whole set")
    parser.add_argument("--per-class", action="store_true",
                        help="also print, per class, the labeled set's size (by noisy label) and the test recall")
    parser.add_argument("--oracle-split", action="store_true",
                        help="replace each network's GMM split by the true clean/noisy indicator (w = 1 on a clean "
                             "label, 0 on a noisy one): a check of the semi-supervised phase alone, given a perfect split")
    parser.add_argument("--balanced-split", action="store_true",
                        help="a trial, not a library option: after the GMM, keep as labeled the same number of rows "
                             "per noisy class (the GMM's labeled count / classes), each class's lowest-loss rows, "
                             "with w = 1 (the others w = 0)")
    parser.add_argument("--freeze-count", action="store_true",
                        help="with --balanced-split: the per-class count is the first split's, never raised after")
    args = parser.parse_args()
    if args.freeze_count and not args.balanced_split:
        parser.error("--freeze-count needs --balanced-split (it fixes the balanced split's per-class count)")
    splits = [flag for flag, on in (("--oracle-split", args.oracle_split), ("--balanced-split", args.balanced_split),
                                    ("--stratified-split", args.stratified_split)) if on]
    if len(splits) > 1:
        parser.error(f"{' and '.join(splits)} are different splits: pass one")

    import torch
    from lightning.pytorch.callbacks import Callback
    from torchmetrics.functional.classification import binary_auroc

    from lpa3_lightning import DivideMixClassifier, LPA3Callback

    data = noisy_data(args)
    is_clean = torch.as_tensor(data.noisy_train_labels == data.clean_train_labels)
    noisy_labels = torch.as_tensor(data.noisy_train_labels)
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
    module = module_class(arch="small_cnn", in_channels=data.in_channels, num_classes=data.num_classes,
                          lr_drop_epoch=args.lr_drop_epoch,
                          dividemix={"warmup_epochs": args.warmup, "lambda_u": args.lambda_u, "alpha": args.alpha,
                                     "threshold": args.threshold, "split_per_class": args.split_per_class,
                                     "stratified_split": args.stratified_split,
                                     "guess_bn_updates": args.guess_bn_updates, "prior_weight": args.prior_weight,
                                     "class_prior": args.class_prior})
    callbacks: list[Callback] = []
    if args.lpa3:
        callbacks.append(LPA3Callback(ratio=0.9, sigma=0.02, steps=5, warmup_epochs=args.warmup, seed=0))

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
    watched_trainer(args.epochs, [*callbacks, Watch()]).fit(module, datamodule=data)

if __name__ == "__main__":
    main()
