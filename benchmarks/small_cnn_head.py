"""How fast the small CNN learns digits with a global-average head and with a 4 x 4 grid head.

    python benchmarks/small_cnn_head.py [--epochs 2]

Cross-entropy on the clean MNIST-5k training set (one weak view, batch 64, SGD 0.02 with
momentum 0.9 and weight decay 5e-4, the noisy-label modules' optimiser), test accuracy after
every epoch, for ``small_cnn(pool_size=1)`` (the head before 2026-11-26) and ``small_cnn()``
(``pool_size=4``), each from the same seed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.harness import apply_threads, run_arguments  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=2)
    run_arguments(parser)
    args = parser.parse_args()
    apply_threads(args.threads)

    import torch
    import torch.nn.functional as F

    from lpa3_lightning.data import NoisyLabelDataModule
    from lpa3_lightning.models.small_cnn import small_cnn

    data = NoisyLabelDataModule("mnist5k", noise_rate=0.0, seed=0, batch_size=64)
    data.setup("fit")
    data.setup("test")
    for pool_size in (1, 4):
        torch.manual_seed(0)
        model = small_cnn(in_channels=1, num_classes=10, pool_size=pool_size)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9, weight_decay=5e-4)
        accuracies = []
        for _ in range(args.epochs):
            model.train()
            for x, _, y, _ in data.train_dataloader():
                loss = F.cross_entropy(model(x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            model.eval()
            correct = total = 0
            with torch.no_grad():
                for x, y, _ in data.test_dataloader():
                    correct += int((model(x).argmax(1) == y).sum())
                    total += len(y)
            accuracies.append(round(correct / total, 3))
        print(f"small_cnn(pool_size={pool_size}): test accuracy after each epoch {accuracies}")


if __name__ == "__main__":
    main()
