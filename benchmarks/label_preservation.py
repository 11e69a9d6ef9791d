"""How often the authors' unconstrained loop and the default (bisection) keep the label.

    python benchmarks/label_preservation.py [--threads 1]

Trains a small CNN to saturation on synthetic images (class = brightness), then attacks
fresh samples with no input box, the setting docs/method.md names as the authors' loop's worst
case. Prints, per sigma, the fraction of samples with log p(y|x') >= log p(y|x) - sigma, the
mean input change (L2) and the mean perceptual distance, for project=False and True.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import apply_threads, run_arguments  # noqa: E402
from lpa3_lightning import lpa3_attack  # noqa: E402
from tests.helpers import confident_batch, confident_cnn  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    run_arguments(parser)
    apply_threads(parser.parse_args().threads)
    net = confident_cnn()
    x, y = confident_batch(64)
    with torch.no_grad():
        p = net(x).softmax(1).gather(1, y[:, None]).mean()
    print(f"model: small CNN, mean p(y|x) on the batch = {float(p):.4f}, batch = {len(y)}, no input box")
    print(f"{'sigma':>7} {'mode':>22} {'preserved':>10} {'L2(x-x)':>9} {'feat dist':>10}")
    for sigma in (0.002, 0.02):
        for project in (False, True):
            _, stats = lpa3_attack(net, x, y, sigma=sigma, project=project, return_stats=True,
                                   generator=torch.Generator().manual_seed(0))
            mode = "default (bisection)" if project else "authors (project=False)"
            print(f"{sigma:>7} {mode:>22} {float(stats.preserved.float().mean()):>10.3f} "
                  f"{float(stats.l2.mean()):>9.2f} {float(stats.perceptual_distance.mean()):>10.3f}")


if __name__ == "__main__":
    main()
