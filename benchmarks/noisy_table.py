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
with sigma 0.002, the LP-A3 paper's setting for its 10-class noisy-label rows (CIFAR-10); ``pes_null`` /
``dividemix_null`` (not run by default) the callback's control ``augment="null"`` (``x' = x``: the LP-A3
term's rows, labels and weight without the solver). ``--noise-convention`` chooses the symmetric noise
(default ``any``, the references').
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

from benchmarks.harness import (  # noqa: E402
    Table,
    curve_mean,
    git_commit,
    mean_std_of_known,
    paired_difference,
    sweep_main,
    write_result,
)

METHODS = ("ce", "pes", "pes_lpa3", "dividemix", "dividemix_lpa3", "pes_lpa3_conf90", "dividemix_pc", "dividemix_pc_lpa3",
           "dividemix_cp", "dividemix_cp_lpa3", "dividemix_st", "dividemix_st_lpa3", "dividemix_st_cp",
           "dividemix_st_cp_lpa3", "pes_lpa3_sigma002", "dividemix_pc_cp", "dividemix_pc_cp_lpa3",
           "dividemix_pc_st", "dividemix_pc_st_lpa3", "dividemix_pc_st_cp", "dividemix_pc_st_cp_lpa3",
           "pes_null", "dividemix_null")

#: The symmetric noise of each convention (``NoisyLabelDataModule(noise_convention=...)``): ``"any"``, a uniform
#: re-draw over all classes, is both references' (PES and DivideMix; configs/noisy/make_configs.py, the paper rows),
#: so a share ``rate / C`` of the re-drawn labels stays right; ``"other"`` always draws a wrong label, which at 90% on
#: ten classes leaves the true class at 10%, tied with each wrong one (the labels carry no signal).
CONVENTIONS = ("any", "other")


def result_path(out: Path, source: str, rate: float, method: str, seed: int, epochs: int,
                convention: str = "other") -> Path:
    # (runs before the flag drew "other" and keep their names)
    tag = "" if convention == "other" else f"_{convention}"
    return out / f"{source}_r{int(round(rate * 100))}{tag}_{method}_e{epochs}_seed{seed}.json"


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
    # null: the callback's control (augment="null", x' = x): the same selected rows, guessed labels and weight
    # as the LP-A3 term, without the solver
    callback = LPA3Callback(ratio=0.9, sigma=sigma, steps=5, warmup_epochs=start, seed=0,
                            augment="null" if "null" in options else "lpa3") \
        if "lpa3" in options or "null" in options else None
    return module, callback


class NoisyTally:
    """How right the labels that train the unlabeled rows are, against the clean labels (which never reach
    the step): per epoch, ``guess_acc`` (the argmax of DivideMix's co-guess or PES's guess, over the rows
    the network treats as unlabeled), ``xprime_acc`` (the labels the ``x'`` were solved for and trained
    with), and the callback's ``selected_fraction`` and ``xprime_perceptual_distance`` (epoch means).
    It wraps the module's guess and ``lpa3_take_augmented`` without changing what they return; the
    callback's epoch means (of both networks' keys, for DivideMix) reach ``trainer.callback_metrics``
    only after every epoch-end hook, so :meth:`callback_means` reads them at the next epoch's start."""

    def __init__(self, module, clean_labels) -> None:
        import torch

        self.clean = torch.as_tensor(clean_labels)
        self.counts = dict.fromkeys(("guessed", "guessed_right", "xprime", "xprime_right"), 0)
        take = module.lpa3_take_augmented

        def recording_take(*args, **kwargs):
            augmented = take(*args, **kwargs)
            if augmented is not None and len(augmented):
                self.counts["xprime"] += len(augmented)
                self.counts["xprime_right"] += int((augmented.targets.cpu() == self.clean[augmented.indices.cpu()]).sum())
            return augmented

        module.lpa3_take_augmented = recording_take
        if hasattr(module, "dividemix_guess"):
            guess_fn = module.dividemix_guess

            def recording_guess(batch, network):
                cached = module._dm_state()["guess"].get(network)
                guess = guess_fn(batch, network)
                if cached is None or cached[1] is not guess:  # count each batch's guess once
                    idx = batch[3]
                    labeled, _ = module._dm_labeled(network, idx)
                    rows = idx[~labeled.to(idx.device)].cpu()
                    self.counts["guessed"] += len(rows)
                    self.counts["guessed_right"] += int((guess.argmax(1).cpu() == self.clean[rows]).sum())
                return guess

            module.dividemix_guess = recording_guess

    def epoch(self) -> dict:
        c, self.counts = self.counts, dict.fromkeys(self.counts, 0)
        return {"guess_acc": round(c["guessed_right"] / c["guessed"], 4) if c["guessed"] else None,
                "xprime_acc": round(c["xprime_right"] / c["xprime"], 4) if c["xprime"] else None}

    @staticmethod
    def callback_means(trainer) -> dict:
        """The LP-A3 callback's last epoch means of the selected share and the x' feature distance
        (the mean over the networks' keys), None where it logged none."""
        row = {}
        for key, name in (("selected_fraction", "selected_fraction"), ("perceptual_distance", "xprime_perceptual_distance")):
            values = [float(v) for k, v in trainer.callback_metrics.items()
                      if k.startswith("lpa3/") and k.endswith(f"{key}_epoch") and float(v) == float(v)]
            row[name] = round(statistics.mean(values), 4) if values else None
        return row


def run(source: str, rate: float, method: str, seed: int, epochs: int, warmup: int, refine: int, lambda_u: float,
        batch_size: int, out: Path, root: str | None, convention: str = "other") -> dict:
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import Callback

    from lpa3_lightning.data import NoisyLabelDataModule

    path = result_path(out, source, rate, method, seed, epochs, convention)
    if path.exists():
        return json.loads(path.read_text())
    pl.seed_everything(seed)
    data = NoisyLabelDataModule(source, root=root, noise_rate=rate, noise_mode="symmetric",
                                noise_convention=convention, seed=seed, batch_size=batch_size)
    data.setup("fit")
    data.setup("test")
    actual_noise = float((data.noisy_train_labels != data.clean_train_labels).mean())
    module, lpa3 = build(method, data, epochs, warmup, refine, lambda_u)
    tally = NoisyTally(module, data.clean_train_labels)

    class Curve(Callback):
        """Clean test accuracy after every epoch and the training wall time (evaluation excluded)."""

        def __init__(self) -> None:
            self.rows: list[dict] = []
            self.seconds = 0.0

        def on_train_epoch_start(self, trainer, pl_module):
            if self.rows:  # the previous epoch's callback means are in callback_metrics now
                self.rows[-1].update(tally.callback_means(trainer))
            self._start = time.perf_counter()  # includes the module's per-epoch split

        def on_train_end(self, trainer, pl_module):
            self.rows[-1].update(tally.callback_means(trainer))

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
                              "test_acc": correct / total, **tally.epoch()})

    curve = Curve()
    callbacks = [curve] + ([lpa3] if lpa3 is not None else [])
    trainer = pl.Trainer(max_epochs=epochs, accelerator="cpu", devices=1, callbacks=callbacks, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, num_sanity_val_steps=0)
    trainer.fit(module, datamodule=data)
    result = {"source": source, "rate": rate, "actual_noise": actual_noise, "method": method, "seed": seed,
              "epochs": epochs, "warmup": warmup, "refine": refine, "lambda_u": lambda_u, "batch_size": batch_size,
              "final_test_acc": curve.rows[-1]["test_acc"], "best_test_acc": max(r["test_acc"] for r in curve.rows),
              "wall_seconds": curve.seconds, "curve": curve.rows, "torch_threads": torch.get_num_threads(),
              "commit": git_commit(), "noise_convention": convention,
              "augment": None if lpa3 is None else lpa3.augment}
    write_result(path, result)
    return result


def summarize(results: list[dict]) -> str:
    """Per data set and noise rate: each method's test accuracy (last and best epoch), why in numbers
    (guessed labels right, x' labels right, the selected share, how far x' moved: means over the
    epochs that have them) and the wall time; then each LP-A3 method against its base seed by seed
    (paired: the same seed is the same noise, split and initial weights), with the 95% t interval of
    the mean difference of the last-epoch accuracy and its verdict."""
    lines = ["| data set | noise | method | seeds | test acc (last epoch) | test acc (best epoch) | guessed labels right "
             "| x' labels right | selected share | x' feature distance | train wall s (per run) | epochs |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    notes: list[str] = []
    for source, rate in sorted({(r["source"], r["rate"]) for r in results}):
        by_method = {m: {r["seed"]: r for r in results if (r["source"], r["rate"], r["method"]) == (source, rate, m)}
                     for m in METHODS}
        for method, runs in by_method.items():
            rs = list(runs.values())
            if rs:
                lines.append(
                    f"| {source} | {rate:.0%} sym | {method} | {len(rs)} | {mean_std_of_known([r['final_test_acc'] for r in rs])} | "
                    f"{mean_std_of_known([r['best_test_acc'] for r in rs])} | {mean_std_of_known([curve_mean(r, 'guess_acc') for r in rs])} | "
                    f"{mean_std_of_known([curve_mean(r, 'xprime_acc') for r in rs])} | "
                    f"{mean_std_of_known([curve_mean(r, 'selected_fraction') for r in rs])} | "
                    f"{mean_std_of_known([curve_mean(r, 'xprime_perceptual_distance') for r in rs])} | "
                    f"{statistics.mean(r['wall_seconds'] for r in rs):.0f} | {rs[0]['epochs']} |")
        for method, runs in by_method.items():
            base = method.replace("_lpa3", "").replace("_null", "")
            if base == method or len(set(runs) & set(by_method.get(base, {}))) < 2:
                continue
            d = paired_difference({s: r["final_test_acc"] for s, r in by_method[base].items()},
                                  {s: r["final_test_acc"] for s, r in runs.items()})
            walls = [runs[s]["wall_seconds"] / by_method[base][s]["wall_seconds"] for s in d["seeds"]]
            notes.append(f"{source} {rate:.0%}, {method} - {base} (last-epoch test acc, seeds {d['seeds']}): per seed "
                         f"{' / '.join(f'{x:+.3f}' for x in d['diffs'])}; mean {d['mean']:+.3f} +- {d['std']:.3f}; "
                         f"95% t interval [{d['ci'][0]:+.3f}, {d['ci'][1]:+.3f}]; above on {d['above']} of {d['n']}: "
                         f"{d['verdict']}; wall time {statistics.mean(walls):.1f}x {base}'s")
    return "\n".join(lines) + ("\n\n" + "\n".join(notes) if notes else "")


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
    parser.add_argument("--noise-convention", choices=CONVENTIONS, default="any",
                        help="symmetric noise: 'any' (default; PES's and DivideMix's code: a uniform re-draw over all "
                             "classes, so some re-drawn labels stay right) or 'other' (always a wrong label; the runs "
                             "before this flag)")


def _runs(args: argparse.Namespace) -> list[tuple]:
    return [(s, r, m, seed) for s in args.sources for r in args.rates for seed in args.seeds for m in args.methods]


def _worker(args: argparse.Namespace, source: str, rate: float, method: str, seed: int) -> None:
    run(source, rate, method, seed, args.epochs, args.warmup, args.refine, args.lambda_u, args.batch_size, args.out,
        args.root, args.noise_convention)


TABLE = Table(script=__file__, description=__doc__.splitlines()[0],
              keys=(("source", str), ("rate", float), ("method", str), ("seed", int)), arguments=_arguments,
              runs=_runs, worker=_worker, out=ROOT / "docs" / "noisy_runs",
              result_path=lambda args, source, rate, method, seed: result_path(args.out, source, rate, method, seed,
                                                                              args.epochs, args.noise_convention),
              keep=lambda args, r: r["epochs"] == args.epochs and r["source"] in args.sources
              and r.get("noise_convention", "other") == args.noise_convention,
              summarize=lambda args, results: summarize(results))


def main(argv: list[str] | None = None) -> None:
    sweep_main(TABLE, argv)


if __name__ == "__main__":
    main()
