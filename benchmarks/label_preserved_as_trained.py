"""Does x' keep its label in the forward that trains on it? Before/after, re-measured independently.

    python benchmarks/label_preserved_as_trained.py [--epochs 4] [--batches 3]

The issue's setting: ResNet-18 with twin BatchNorms trained on the embedded BreastMNIST for
``--epochs`` (the callback's warm-up, no attack), then ``--batches`` training batches of 64 are
attacked (sigma 0.02, ratio 0.5) and the logits of x' that the loss uses are recorded. The
reference log p(y|x) is recomputed without the package's normalisation code (see
``tests/test_label_preserved_as_trained.py``). Printed per training forward: the share of x'
with log p(y|x') >= log p(y|x) - sigma in that forward, and in the deployed model (eval mode,
main BN). ``batch_stats`` is the authors' forward (twins in train mode on the x' batch's own
statistics), ``verified`` this package's default.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning.pytorch as pl  # noqa: E402

from benchmarks.harness import apply_threads, run_arguments  # noqa: E402
from lpa3_lightning import LPA3Callback  # noqa: E402
from lpa3_lightning.data import MedMNISTDataModule  # noqa: E402
from lpa3_lightning.models.resnet import medmnist_resnet  # noqa: E402
from tests.test_label_preserved_as_trained import SIGMA, StopAfter, independent_shares  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batches", type=int, default=3)
    run_arguments(parser)
    args = parser.parse_args()
    apply_threads(args.threads)
    print(f"ResNet-18 + twin BN, BreastMNIST, {args.epochs} epochs of training, then {args.batches} attacked "
          f"batches of 64 (sigma {SIGMA}, ratio 0.5)")
    print(f"{'training forward':18} {'kept as trained':>16} {'kept in deployed model':>23} {'x prime':>8}")
    for forward in ("batch_stats", "verified"):
        pl.seed_everything(0)
        module = StopAfter(medmnist_resnet("resnet18", 1, 2), 2, lr=1e-3, twin_bn=True, train_forward=forward,
                           n=args.batches)
        trainer = pl.Trainer(max_epochs=args.epochs + 1, accelerator="cpu", devices=1, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             callbacks=[LPA3Callback(ratio=0.5, sigma=SIGMA, warmup_epochs=args.epochs, seed=0)])
        trainer.fit(module, datamodule=MedMNISTDataModule("breastmnist", batch_size=64))
        kept, kept_eval, _ = independent_shares(module.records, twin_bn=True)
        count = sum(len(r["y"]) for r in module.records)
        print(f"{forward:18} {kept:16.3f} {kept_eval:23.3f} {count:8d}")


if __name__ == "__main__":
    main()
