"""Why plain FixMatch learns slowly here: test accuracy under three BatchNorm normalisations.

    python benchmarks/fixmatch_diagnose.py --labels 40 --steps 300

Trains ``FixMatchClassifier`` (small CNN, the FixMatch recipe, no LP-A3) on MNIST-5k, then
prints the final training metrics (mask rate: the share of unlabeled samples whose pseudo-label
passes the 0.95 threshold) and the test accuracy of the raw weights (a) in eval mode on the
running statistics, (b) in train mode on each test batch's own statistics, (c) in eval mode
after recomputing the running statistics on weak views of the unlabeled set. FixMatch's
running statistics here come from the labeled + strong forward only (the weak forward leaves
them alone), so (a) far below (c) would blame the statistics of the strong views.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.harness import apply_threads, run_arguments  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--labels", type=int, default=40)
    parser.add_argument("--steps", type=int, default=300)
    run_arguments(parser, seed=0)
    args = parser.parse_args()
    apply_threads(args.threads)

    import lightning.pytorch as pl
    import torch
    from torch.nn.modules.batchnorm import _BatchNorm

    from lpa3_lightning import FixMatchClassifier
    from lpa3_lightning.data import SemiSupervisedDataModule

    pl.seed_everything(args.seed)
    data = SemiSupervisedDataModule("mnist5k", num_labels=args.labels, seed=args.seed, batch_size=32, mu=7,
                                    eval_batch_size=500)
    data.setup("fit")
    data.setup("test")
    module = FixMatchClassifier(arch="small_cnn", in_channels=1, num_classes=10)
    trainer = pl.Trainer(max_steps=args.steps, max_epochs=-1, accelerator="cpu", logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, num_sanity_val_steps=0)
    start = time.perf_counter()
    trainer.fit(module, datamodule=data)
    print(f"{args.steps} steps in {time.perf_counter() - start:.0f} s; last step: "
          + ", ".join(f"{k} {float(v):.3f}" for k, v in trainer.callback_metrics.items()))

    def accuracy(model: torch.nn.Module, train_mode: bool = False) -> float:
        model.train(train_mode)
        correct = total = 0
        with torch.no_grad():
            for x, y, _ in data.test_dataloader():
                correct += int((model(x).argmax(1) == y).sum())
                total += len(y)
        return correct / total

    model = module.model
    recomputed = copy.deepcopy(model)
    for norm in recomputed.modules():
        if isinstance(norm, _BatchNorm):
            norm.reset_running_stats()
            norm.momentum = None  # a plain average over the batches below
    recomputed.train()
    with torch.no_grad():
        loader = torch.utils.data.DataLoader(data.unlabeled_dataset, batch_size=224, shuffle=True)
        for k, (x_weak, _, _) in enumerate(loader):
            recomputed(x_weak)
            if k == 10:
                break
    print(f"test accuracy, (a) eval mode, running statistics: {accuracy(model):.3f}")
    print(f"test accuracy, (b) train mode, each test batch's statistics: {accuracy(copy.deepcopy(model), True):.3f}")
    print(f"test accuracy, (c) eval mode, statistics recomputed on weak unlabeled views: {accuracy(recomputed):.3f}")


if __name__ == "__main__":
    main()
