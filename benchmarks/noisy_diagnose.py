"""Why LP-A3 helps PES or not: how often the labels it trains x' on are right, per epoch.

One PES + LP-A3 run (the settings of the ``docs/results.md`` runs: small CNN, batch 64, T1 = 5,
no refine phase, lambda_u 25, ratio 0.9, sigma 0.02, 5 steps) with a watcher that reads, in
each semi-supervised step, the clean labels the data module keeps for evaluation (they never
reach the training step) and prints per epoch:

- ``labeled clean``: share of the labeled rows whose noisy label is the clean one;
- ``guess right``: share of the unlabeled rows whose guessed label (argmax of the sharpened
  guess) is the clean one;
- ``x' label right``: the same over the rows the callback attacked (TCS picks the least
  time-consistent, i.e. the hardest, unlabeled samples);
- ``x' share``: attacked rows per unlabeled row; and the clean test accuracy.

Counts are per batch visit (the balanced sampler revisits the labeled set). ``--confidence``
runs the ``lpa3_confidence`` variant.

Usage::

    python benchmarks/noisy_diagnose.py --seed 0 --epochs 12 --warmup 5 --sigma 0.02 --ratio 0.9 [--source pneumoniamnist --root <npz folder>]
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
    parser.add_argument("--sigma", type=float, default=0.02)
    parser.add_argument("--ratio", type=float, default=0.9)
    parser.add_argument("--confidence", type=float, default=None, help="PESClassifier(pes={'lpa3_confidence': ...})")
    args = parser.parse_args()

    import torch
    from lightning.pytorch.callbacks import Callback

    from lpa3_lightning import LPA3Callback, PESClassifier

    data = noisy_data(args)
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
            augmented = pl_module._lpa3_augmented
            if augmented is not None and len(augmented):
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

    watched_trainer(args.epochs, [lpa3, Watch()]).fit(module, datamodule=data)


if __name__ == "__main__":
    main()
