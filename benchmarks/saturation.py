"""How many x' the solver turns into clipped noise, with and without ``max_step``.

    make demo   # writes runs/demo_breastmnist_lpa3/version_0/checkpoints/last.ckpt
    python benchmarks/saturation.py --ckpt runs/demo_breastmnist_lpa3/version_0/checkpoints/last.ckpt

Takes the first shuffled training batch (128 images, seed 0) of the checkpoint's MedMNIST data
set, runs lpa3_attack on it in both BN modes with ``max_step`` None (the authors' unbounded
step), "auto" (the default: 2% of the input box's diagonal, 1.12 here), 1.0 and 0.5, and prints
the L2 distance quantiles of x' from x, the samples with more than a tenth of their pixels
newly at the edge of the pixel box ("saturated"), the same counting only pixels that were at
least 0.1 from the edge before ("from far": a dark background pixel at -0.995 reaching -1 is not
noise), the mean perceptual distance and the share kept / pulled back.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import apply_threads, run_arguments  # noqa: E402
from lpa3_lightning import LPA3Classifier, lpa3_attack  # noqa: E402
from lpa3_lightning.data import MedMNISTDataModule  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", type=Path, required=True)
    parser.add_argument("--batch-size", type=int, default=128)
    run_arguments(parser)
    args = parser.parse_args()
    apply_threads(args.threads)
    if not args.ckpt.is_file():
        sys.exit(f"--ckpt {args.ckpt} does not exist: run `make demo` first, or pass an LPA3Classifier checkpoint")
    checkpoint = torch.load(args.ckpt, map_location="cpu", weights_only=False)
    hparams = checkpoint.get("datamodule_hyper_parameters", {})
    module = LPA3Classifier.load_from_checkpoint(args.ckpt, map_location="cpu")
    data = MedMNISTDataModule(hparams.get("flag", "breastmnist"), root=hparams.get("root"), batch_size=args.batch_size)
    data.setup("fit")
    torch.manual_seed(0)
    x, y, _ = next(iter(data.train_dataloader()))
    model = module.model.train()
    print(f"{args.ckpt}: {len(y)} training images of {data.flag}")
    print(f"{'bn mode':8} {'max_step':>8} {'L2 median':>10} {'L2 p90':>7} {'L2 max':>7} {'saturated':>14} {'from far':>9} "
          f"{'feat dist':>10} {'kept':>5} {'pulled back':>12}")
    for bn_mode in ("twin", "eval"):
        for max_step in (None, "auto", 1.0, 0.5):
            x_adv, stats = lpa3_attack(model, x, y, bn_mode=bn_mode, input_range=data.normalization,
                                       max_step=max_step, return_stats=True,
                                       generator=torch.Generator().manual_seed(0))
            # pixels at the box edge in x' that were not there in x; [-1, 1] after the MedMNIST normalisation
            newly = ((x_adv.abs() >= 0.999) & (x.abs() < 0.999)).flatten(1).float().mean(1)
            q = torch.quantile(stats.l2, torch.tensor([0.5, 0.9, 1.0]))
            saturated = int((newly > 0.1).sum())
            # the same, counting only pixels pushed to the edge from at least 0.1 away (a dark
            # background pixel at -0.995 reaching -1 is not noise; a mid-grey one jumping there is)
            far = ((x_adv.abs() >= 0.999) & (x.abs() < 0.9)).flatten(1).float().mean(1)
            saturated_far = int((far > 0.1).sum())
            print(f"{bn_mode:8} {max_step!s:>8} {q[0]:10.2f} {q[1]:7.2f} {q[2]:7.2f} "
                  f"{f'{saturated}/{len(y)} {saturated / len(y):.1%}':>14} {f'{saturated_far}/{len(y)}':>9} "
                  f"{float(stats.perceptual_distance.mean()):10.3f} "
                  f"{float(stats.preserved.float().mean()):5.2f} {float(stats.projected.float().mean()):12.2f}")


if __name__ == "__main__":
    main()
