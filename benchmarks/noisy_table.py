"""Noisy labels: cross-entropy, PES, PES + LP-A3, DivideMix, DivideMix + LP-A3, clean-label test accuracy.

    python benchmarks/noisy_table.py --sources mnist5k --rates 0.8 0.5 --seeds 0 1 2
    python benchmarks/noisy_table.py --sources pneumoniamnist --rates 0.4 --root /path/to/medmnist_npz

Every run trains a small CNN for the same epochs on the same noisy labels (symmetric noise,
always a wrong label; PneumoniaMNIST: that share of the labels flipped) and reports the test
accuracy (clean labels) at the last epoch and the best over the epochs, and the training wall
time. ``ce`` is plain cross-entropy on the noisy labels with PES's optimiser (PES's first phase
for the whole run); ``pes`` / ``dividemix`` are the ready modules with the CPU configs'
schedule (``configs/noisy/``), ``*_lpa3`` the same with ``LPA3Callback`` (ratio 0.9, sigma 0.02,
5 steps, attacks from the semi-supervised phase on); ``pes_lpa3_conf90`` (not run by default)
attacks only the unlabeled samples whose guess is at least 0.9 sure (``pes.lpa3_confidence=0.9``);
``dividemix_pc`` / ``dividemix_pc_lpa3`` (not run by default) fit DivideMix's split per noisy class
(``dividemix.split_per_class=True``); ``dividemix_cp`` / ``dividemix_cp_lpa3`` (not run by default) give the
prior penalty the training set's class shares (``class_prior``; the prevalence, which a user of
an imbalanced medical set usually knows) instead of DivideMix's uniform prior;
``dividemix_st`` / ``dividemix_st_lpa3`` (not run by default) use the stratified split
(``dividemix.stratified_split=True``: the first split's labeled count, shared out by class, each class's
lowest-loss rows); ``dividemix_st_cp`` / ``dividemix_st_cp_lpa3`` (not run by default) both the
stratified split and the class-share prior; ``dividemix_pc_cp`` / ``dividemix_pc_cp_lpa3`` (not
run by default) the mixture per class and the class-share prior; ``dividemix_pc_st*`` (not run by
default) the stratified split with a mixture per class (each class keeps its first count); ``pes_lpa3_sigma002`` (not run by default) PES + LP-A3
with sigma 0.002, the LP-A3 paper's setting for its 10-class noisy-label rows (CIFAR-10).
One JSON per run in ``--out``; a finished
run is not repeated. The summary prints mean +- std per method.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.harness import Table, mean_std, sweep_main, write_result  # noqa: E402

METHODS = ("ce", "pes", "pes_lpa3", "dividemix", "dividemix_lpa3", "pes_lpa3_conf90", "dividemix_pc", "dividemix_pc_lpa3",
           "dividemix_cp", "dividemix_cp_lpa3", "dividemix_st", "dividemix_st_lpa3", "dividemix_st_cp",
           "dividemix_st_cp_lpa3", "pes_lpa3_sigma002", "dividemix_pc_cp", "dividemix_pc_cp_lpa3",
           "dividemix_pc_st", "dividemix_pc_st_lpa3", "dividemix_pc_st_cp", "dividemix_pc_st_cp_lpa3")


def result_path(out: Path, source: str, rate: float, method: str, seed: int, epochs: int) -> Path:
    return out / f"{source}_r{int(round(rate * 100))}_{method}_e{epochs}_seed{seed}.json"


def build(method: str, data, epochs: int, warmup: int, refine: int, lambda_u: float):
    """The module and its LP-A3 callback (or None) of one method."""
    import numpy as np

    from lpa3_lightning import DivideMixClassifier, LPA3Callback, PESClassifier

    common = {"arch": "small_cnn", "in_channels": data.in_channels, "num_classes": data.num_classes}
    if method == "ce":
        return PESClassifier(**common, pes={"early_epochs": epochs, "refine_epochs": 0}), None
    # A method's name is its base and its options: lpa3 (the callback; sigma002: with the paper's
    # 10-class sigma 0.002 instead of this table's 0.02), conf90 (PES: x' only of the
    # unlabeled rows whose guess is >= 0.9 sure), pc (DivideMix's mixture per noisy class), cp (the
    # prior penalty with the training set's class shares, its prevalence, which the label noise does
    # not change, instead of a uniform prior), st (the stratified split: the first split's count, by
    # class, lowest losses). The last three are ours.
    base, *options = method.split("_")
    if base == "pes":
        module = PESClassifier(**common, pes={"early_epochs": warmup, "refine_epochs": refine, "lambda_u": lambda_u,
                                              "lpa3_confidence": 0.9 if "conf90" in options else None})
        start = warmup + refine
    else:
        prior = None
        if "cp" in options:
            counts = np.bincount(np.asarray(data.clean_train_labels), minlength=data.num_classes)
            prior = (counts / counts.sum()).tolist()
        module = DivideMixClassifier(**common, dividemix={"warmup_epochs": warmup, "lambda_u": lambda_u,
                                                          "split_per_class": "pc" in options, "class_prior": prior,
                                                          "stratified_split": "st" in options})
        start = warmup
    sigma = 0.002 if "sigma002" in options else 0.02
    callback = LPA3Callback(ratio=0.9, sigma=sigma, steps=5, warmup_epochs=start, seed=0) \
        if "lpa3" in options else None
    return module, callback


def run(source: str, rate: float, method: str, seed: int, epochs: int, warmup: int, refine: int, lambda_u: float,
        batch_size: int, out: Path, root: str | None) -> dict:
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import Callback

    from lpa3_lightning.data import NoisyLabelDataModule

    path = result_path(out, source, rate, method, seed, epochs)
    if path.exists():
        return json.loads(path.read_text())
    pl.seed_everything(seed)
    data = NoisyLabelDataModule(source, root=root, noise_rate=rate, noise_mode="symmetric", noise_convention="other",
                                seed=seed, batch_size=batch_size)
    data.setup("fit")
    data.setup("test")
    actual_noise = float((data.noisy_train_labels != data.clean_train_labels).mean())
    module, lpa3 = build(method, data, epochs, warmup, refine, lambda_u)

    class Curve(Callback):
        """Clean test accuracy after every epoch and the training wall time (evaluation excluded)."""

        def __init__(self) -> None:
            self.rows: list[dict] = []
            self.seconds = 0.0

        def on_train_epoch_start(self, trainer, pl_module):
            self._start = time.perf_counter()  # includes the module's per-epoch split

        def on_train_epoch_end(self, trainer, pl_module):
            self.seconds += time.perf_counter() - self._start
            was_training = pl_module.training
            pl_module.eval()
            correct = total = 0
            with torch.no_grad():
                for x, y, _ in data.test_dataloader():
                    correct += int((pl_module(x).argmax(1) == y).sum())
                    total += len(y)
            pl_module.train(was_training)
            self.rows.append({"epoch": trainer.current_epoch, "train_seconds": self.seconds,
                              "test_acc": correct / total})

    curve = Curve()
    callbacks = [curve] + ([lpa3] if lpa3 is not None else [])
    trainer = pl.Trainer(max_epochs=epochs, accelerator="cpu", devices=1, callbacks=callbacks, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, num_sanity_val_steps=0)
    trainer.fit(module, datamodule=data)
    result = {"source": source, "rate": rate, "actual_noise": actual_noise, "method": method, "seed": seed,
              "epochs": epochs, "warmup": warmup, "refine": refine, "lambda_u": lambda_u, "batch_size": batch_size,
              "final_test_acc": curve.rows[-1]["test_acc"], "best_test_acc": max(r["test_acc"] for r in curve.rows),
              "wall_seconds": curve.seconds, "curve": curve.rows}
    write_result(path, result)
    return result


def summarize(results: list[dict]) -> str:
    lines = ["| data set | noise | method | test acc (last epoch) | test acc (best epoch) | train wall s (per run) "
             "| seeds | epochs |", "|---|---|---|---|---|---|---|---|"]
    for source, rate in sorted({(r["source"], r["rate"]) for r in results}):
        for method in METHODS:
            rs = [r for r in results if (r["source"], r["rate"], r["method"]) == (source, rate, method)]
            if rs:
                lines.append(f"| {source} | {rate:.0%} sym | {method} | {mean_std([r['final_test_acc'] for r in rs])} | "
                             f"{mean_std([r['best_test_acc'] for r in rs])} | "
                             f"{statistics.mean(r['wall_seconds'] for r in rs):.0f} | {len(rs)} | {rs[0]['epochs']} |")
    return "\n".join(lines)


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sources", nargs="+", default=["mnist5k"])
    parser.add_argument("--rates", nargs="+", type=float, default=[0.8, 0.5])
    parser.add_argument("--methods", nargs="+", default=list(METHODS[:5]), choices=METHODS)
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=10, help="PES's T1 and DivideMix's warm-up, in epochs")
    parser.add_argument("--refine", type=int, default=2, help="PES's T2")
    parser.add_argument("--lambda-u", type=float, default=25.0)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--root", default=None, help="folder of the MedMNIST npz files (mnist5k ships)")


def _runs(args: argparse.Namespace) -> list[tuple]:
    return [(s, r, m, seed) for s in args.sources for r in args.rates for seed in args.seeds for m in args.methods]


def _worker(args: argparse.Namespace, source: str, rate: float, method: str, seed: int) -> None:
    run(source, rate, method, seed, args.epochs, args.warmup, args.refine, args.lambda_u, args.batch_size, args.out,
        args.root)


TABLE = Table(script=__file__, description=__doc__.splitlines()[0],
              keys=(("source", str), ("rate", float), ("method", str), ("seed", int)), arguments=_arguments,
              runs=_runs, worker=_worker, out=ROOT / "docs" / "noisy_runs",
              result_path=lambda args, source, rate, method, seed: result_path(args.out, source, rate, method, seed,
                                                                              args.epochs),
              keep=lambda args, r: r["epochs"] == args.epochs and r["source"] in args.sources,
              summarize=lambda args, results: summarize(results))


def main(argv: list[str] | None = None) -> None:
    sweep_main(TABLE, argv)


if __name__ == "__main__":
    main()
