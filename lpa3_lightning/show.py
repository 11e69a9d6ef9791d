"""``lpa3 show``: a PNG of x, x' and |x' - x| for a trained classifier checkpoint.

    lpa3 show --ckpt runs/.../best.ckpt --out lpa3_examples.png [--flag breastmnist]
              [--root DIR] [--split test] [--num 8] [--sigma 0.02] [--steps 5] [--seed 0]
              [--bn-mode eval|twin] [--max-step 1.0]

Rows: the first ``--num`` images of the split, their LP-A3 hard positives under the
checkpoint's model, and the absolute difference stretched per image. Prints the per-image
perceptual distance, the log-probability drop and whether the label was preserved.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch.utils.data import default_collate

from lpa3_lightning.attack import check_max_step, lpa3_attack
from lpa3_lightning.classifier import LPA3Classifier
from lpa3_lightning.data import MedMNISTDataModule
from lpa3_lightning.dual_bn import has_dual_bn
from lpa3_lightning.visualize import save_comparison_grid

__all__ = ["main"]


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(prog="lpa3 show", description=__doc__.split("\n\n")[0])
    parser.add_argument("--ckpt", required=True, type=Path, help="an LPA3Classifier checkpoint")
    parser.add_argument("--out", default=Path("lpa3_examples.png"), type=Path, help="PNG to write")
    parser.add_argument("--flag", default=None, help="MedMNIST data set (default: the one the checkpoint trained on)")
    parser.add_argument("--root", default=None, help="folder with <flag>.npz (default: the checkpoint's, else the "
                        "embedded data)")
    parser.add_argument("--bn-mode", default="eval", choices=["eval", "twin"],
                        help="eval (default): each image on its own, BN on running statistics; twin: the twin "
                        "BNs with the shown images' batch statistics (x' then depends on which images are shown)")
    parser.add_argument("--split", default="test", choices=["train", "val", "test"])
    parser.add_argument("--num", default=8, type=int, help="images in the grid")
    parser.add_argument("--sigma", default=0.02, type=float)
    parser.add_argument("--steps", default=5, type=int)
    parser.add_argument("--seed", default=0, type=int)
    parser.add_argument("--max-step", default=None, type=float,
                        help="largest L2 length of one solver step (default: unbounded, the authors' step)")
    args = parser.parse_args(argv)
    if not args.ckpt.is_file():
        parser.error(f"--ckpt {args.ckpt} does not exist. Fix: pass a checkpoint written by `lpa3 fit` "
                     "(see the run's checkpoints/ folder).")
    if args.num < 1:
        parser.error("--num must be >= 1")
    try:
        check_max_step(args.max_step)
    except ValueError as exc:
        parser.error(f"--max-step: {exc}")
    checkpoint = torch.load(args.ckpt, map_location="cpu", weights_only=False)
    data_hparams = checkpoint.get("datamodule_hyper_parameters", {})
    flag = args.flag or data_hparams.get("flag", "breastmnist")
    root = args.root or data_hparams.get("root")
    try:
        module = LPA3Classifier.load_from_checkpoint(args.ckpt, map_location="cpu")
    except (KeyError, RuntimeError, TypeError) as exc:
        parser.error(f"--ckpt {args.ckpt} is not an LPA3Classifier checkpoint ({type(exc).__name__}: {exc}). Fix: "
                     "pass a checkpoint of `lpa3 fit` with model class lpa3_lightning.LPA3Classifier, or call "
                     "lpa3_lightning.visualize.save_comparison_grid from your own code.")
    module.eval()
    if args.bn_mode == "twin" and (not has_dual_bn(module.model) or args.num < 2):
        parser.error("--bn-mode twin needs a model with twin BNs and --num >= 2 (batch statistics). Fix: use "
                     "--bn-mode eval.")
    data = MedMNISTDataModule(flag, root=root)
    data.setup("fit" if args.split in ("train", "val") else "test")
    dataset = {"train": data.train_dataset, "val": data.val_dataset, "test": data.test_dataset}[args.split]
    x, y, _ = default_collate([dataset[i] for i in range(min(args.num, len(dataset)))])
    x_adv, stats = lpa3_attack(module.model, x, y, sigma=args.sigma, steps=args.steps,
                               input_range=data.normalization, bn_mode=args.bn_mode, max_step=args.max_step,
                               generator=torch.Generator().manual_seed(args.seed), return_stats=True)
    path = save_comparison_grid(args.out, x, x_adv, data.normalization)
    print(f"wrote {path} (rows: x, x', |x' - x| stretched per image; {len(y)} {args.split} images of {flag}; "
          f"bn mode {args.bn_mode}, sigma {args.sigma}, {args.steps} steps, max step {args.max_step})")
    for i in range(len(y)):
        print(f"  image {i}: label {int(y[i])}, perceptual distance {float(stats.perceptual_distance[i]):.3f}, "
              f"log p drop {float(stats.logp_drop[i]):+.4f}, label preserved {bool(stats.preserved[i])}")
    return path
