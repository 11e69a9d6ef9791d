"""What the noisy-label diagnosis scripts share: their run arguments, data, trainer and test pass.

``noisy_diagnose.py`` (PES) and ``dividemix_diagnose.py`` watch one run each against the clean
labels the data module keeps for evaluation. Both follow the run of the same seed in
``noisy_table.py``, so they must build the data, seed and evaluate in the same order as it does;
that order lives here once.
"""

from __future__ import annotations

import argparse
from typing import Callable

from benchmarks.harness import apply_threads, run_arguments


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of one noisy-label run (the defaults: the ``docs/results.md`` 12-epoch table),
    with the harness's ``--seed`` and ``--threads`` (1)."""
    run_arguments(parser, seed=0, threads=1)
    parser.add_argument("--source", default="mnist5k", help="mnist5k (ships) or a MedMNIST flag with --root")
    parser.add_argument("--root", default=None, help="folder of the MedMNIST npz files")
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=5, help="PES's T1 or DivideMix's warm-up, in epochs")
    parser.add_argument("--rate", type=float, default=0.8, help="symmetric noise rate (always a wrong label)")
    parser.add_argument("--lambda-u", type=float, default=25.0)
    parser.add_argument("--batch-size", type=int, default=64)


def noisy_data(args: argparse.Namespace):
    """Sets the threads and the seed, then builds the data module set up for fitting and testing."""
    import lightning.pytorch as pl

    from lpa3_lightning.data import NoisyLabelDataModule

    apply_threads(args.threads)
    pl.seed_everything(args.seed)
    data = NoisyLabelDataModule(args.source, root=args.root, noise_rate=args.rate, noise_mode="symmetric",
                                noise_convention="other", seed=args.seed, batch_size=args.batch_size)
    data.setup("fit")
    data.setup("test")
    return data


def watched_trainer(epochs: int, callbacks: list):
    """A quiet CPU trainer with no validation (the watchers evaluate on the test split themselves)."""
    import lightning.pytorch as pl

    return pl.Trainer(max_epochs=epochs, accelerator="cpu", devices=1, callbacks=callbacks, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      limit_val_batches=0, num_sanity_val_steps=0)


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
