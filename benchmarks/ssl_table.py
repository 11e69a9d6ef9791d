"""FixMatch against FixMatch + LP-A3 at few labels: paired test accuracy, how right the trained labels are, wall time.

    python benchmarks/ssl_table.py --sources mnist5k --labels 10 20 40 --seeds 0 1 2 --steps 1000
    python benchmarks/ssl_table.py --sources pneumoniamnist --labels 20 100 --root /path/to/medmnist_npz

Each run trains ``FixMatchClassifier`` (small CNN, the FixMatch recipe, batch 32 + 7 x 32
unlabeled) for the same number of steps with and without ``LPA3Callback`` (ratio 0.9, sigma
0.02, the authors' settings; the LP-A3 term after ``--lpa3-warmup`` epochs), evaluates the raw
and the EMA (``--ema-decay``) weights on the test split every ``--eval-every`` steps, tallies
against the true labels how right the pseudo-labels and ``x'`` labels it trained on were
(:class:`PseudoLabelTally`), and writes one JSON per run to ``--out`` (a finished run is not
repeated; ``--summary-only`` starts none). The summary (:func:`summarize`) gives per method the
accuracies, the tallies, the selected share, how far ``x'`` moved and the wall time; then each
LP-A3 method against FixMatch seed by seed, with the 95% t interval of the mean difference and
its verdict; and any run whose tally contradicts its accuracy. ``--plot`` draws the curves.
"""

from __future__ import annotations

import argparse
import json
import math
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

#: fixmatch_lpa3_random: the same count of rows selected at random each epoch instead of by TCS
#: (selection.criterion="random", the paper's selection ablation); fixmatch_lpa3_authors: the
#: LP-A3 authors' solver and selection (preset="authors"); fixmatch_null / fixmatch_noise: the
#: callback's controls (augment="null": x' = x, the extra term alone; augment="noise": x plus noise
#: of the norm the paired fixmatch_lpa3 run's x' reached, its JSON's mean_input_distance)
METHODS = ("fixmatch", "fixmatch_lpa3", "fixmatch_lpa3_random", "fixmatch_lpa3_authors", "fixmatch_null",
           "fixmatch_noise")


def _augment(method: str) -> str:
    """The callback's ``augment`` of a method (FixMatch alone has no callback)."""
    return {"fixmatch_null": "null", "fixmatch_noise": "noise"}.get(method, "lpa3")


def _threshold(lpa3_confidence: float | None) -> float:
    """The LP-A3 term's confidence threshold a run used: None is the module's default (0.9)."""
    return 0.9 if lpa3_confidence is None else float(lpa3_confidence)


def result_path(out: Path, source: str, labels: int, method: str, seed: int, steps: int, regenerate: int,
                solve_trained_only: bool = False, lpa3_confidence: float | None = None) -> Path:
    lpa3 = method != "fixmatch"  # (every method with the callback, the controls included)
    cache = f"_k{regenerate}" if lpa3 and regenerate != 1 else ""
    trained = "_trained" if lpa3 and solve_trained_only else ""
    # the module's default threshold (0.9, the authors') keeps the file names the earlier runs have
    confidence = (f"_c{lpa3_confidence:g}" if lpa3 and _threshold(lpa3_confidence) != 0.9
                  else "")
    return out / f"{source}_{labels}_{method}{cache}{trained}{confidence}_s{steps}_seed{seed}.json"


class PseudoLabelTally:
    """How right the labels that train the unlabeled images are, against the true labels.

    Measurement only (the unlabeled set of MNIST-5k and MedMNIST has its true labels; they never
    reach the training step): it reads the pseudo-labels and confidences that the module's
    FixMatch loss trained on (``fixmatch_last_pseudo_labels``), and the ``x'`` the loss took from
    the callback, by wrapping ``lpa3_take_augmented`` without changing what it returns. Per interval:
    ``mask_rate`` (pseudo-labels >= 0.95, FixMatch's term), ``masked_acc`` (their accuracy),
    ``xprime_per_step`` (``x'`` trained per step), ``xprime_kept_rate`` (share with confidence
    >= 0.9, the LP-A3 term's threshold), ``xprime_kept_acc`` (accuracy of the labels those kept
    ``x'`` were solved for and trained with).
    """

    def __init__(self, module, true_labels) -> None:
        import torch

        self.true_labels = torch.as_tensor(true_labels)
        self.module = module
        self.seen: dict = {}
        self.totals = dict.fromkeys(("steps", "unlabeled", "masked", "masked_right", "xprime", "kept", "kept_right"), 0)
        take_augmented = module.lpa3_take_augmented

        def recording_take_augmented():
            augmented = take_augmented()
            self.seen["augmented"] = augmented
            return augmented

        module.lpa3_take_augmented = recording_take_augmented

    def count(self, batch) -> None:
        from lpa3_lightning.methods.fixmatch import split_semi_supervised_batch

        if self.module.fixmatch_last_pseudo_labels is None:
            return
        confidence, pseudo = self.module.fixmatch_last_pseudo_labels  # what the loss trained on
        self.module.fixmatch_last_pseudo_labels = None
        truth = self.true_labels[split_semi_supervised_batch(batch)[5].cpu()]
        right = pseudo.cpu() == truth
        masked = confidence.cpu() >= self.module.lpa3_settings.threshold
        t = self.totals
        t["steps"] += 1
        t["unlabeled"] += len(truth)
        t["masked"] += int(masked.sum())
        t["masked_right"] += int((masked & right).sum())
        augmented = self.seen.pop("augmented", None)
        if augmented is not None and len(augmented):
            positions = augmented.positions().cpu()
            kept = confidence.cpu()[positions] >= self.module.lpa3_settings.lpa3_confidence_threshold
            t["xprime"] += len(augmented)
            t["kept"] += int(kept.sum())
            t["kept_right"] += int((kept & (augmented.targets.cpu() == truth[positions])).sum())

    def interval(self) -> dict:
        """The rates since the last call (None where nothing was counted), and a fresh tally."""
        t, self.totals = self.totals, dict.fromkeys(self.totals, 0)

        def rate(num: str, den: str):
            return round(t[num] / t[den], 4) if t[den] else None

        return {"mask_rate": rate("masked", "unlabeled"), "masked_count": t["masked"],
                "masked_acc": rate("masked_right", "masked"),
                "xprime_per_step": round(t["xprime"] / t["steps"], 1) if t["steps"] else None,
                "xprime_kept_rate": rate("kept", "xprime"), "xprime_kept_acc": rate("kept_right", "kept")}


class XPrimeDiagnostics:
    """Per interval, the callback's own per-step diagnostics (logged every step in these runs):
    ``selected_fraction`` (share of the unlabeled batch selected), ``perceptual_distance`` (how far
    the ``x'`` moved in the model's feature space: the hardness measure) and ``label_preserved``
    (share of trained ``x'`` keeping their label in the forward that trains them), NaN-ignoring means."""

    KEYS = ("selected_fraction", "perceptual_distance", "label_preserved", "input_distance")

    def __init__(self) -> None:
        self.values: dict[str, list[float]] = {k: [] for k in self.KEYS}
        self.input_distances: list[float] = []  # every step's, over the run (the noise control's norm)

    def count(self, trainer) -> None:
        for key in self.KEYS:
            value = trainer.callback_metrics.get(f"lpa3/{key}_step")
            if value is not None and math.isfinite(float(value)):
                self.values[key].append(float(value))
                if key == "input_distance":
                    self.input_distances.append(float(value))

    def interval(self) -> dict:
        values, self.values = self.values, {k: [] for k in self.KEYS}
        return {f"xprime_{k}" if k != "selected_fraction" else k: (round(statistics.mean(v), 4) if v else None)
                for k, v in values.items()}


def contradiction(row: dict, num_classes: int, minimum: int = 50) -> str | None:
    """A tally that contradicts the accuracy beside it: the pseudo-labels the loss trained on near
    chance (below 1.5 / classes right) while the test accuracy is far above chance (at least 3 /
    classes), or the reverse, over an interval with at least ``minimum`` confident pseudo-labels. Such a
    row is a defect until its cause is found (it was once: the weak view forwarded alone), so the
    summary flags it."""
    tally, accuracy = row.get("masked_acc"), row.get("raw_test_acc")
    if tally is None or accuracy is None or row.get("masked_count", minimum) < minimum:
        return None
    chance = 1.0 / num_classes
    if tally < 1.5 * chance <= accuracy and accuracy >= min(3 * chance, 0.9):
        return f"pseudo-labels {tally:.2f} right (near chance) beside test accuracy {accuracy:.2f}"
    if accuracy < 1.5 * chance and tally >= min(3 * chance, 0.9):
        return f"test accuracy {accuracy:.2f} (near chance) beside pseudo-labels {tally:.2f} right"
    return None


def run(source: str, labels: int, method: str, seed: int, steps: int, eval_every: int, out: Path, root: str | None,
        lpa3_warmup: int, regenerate: int, num_workers: int = 0, solve_trained_only: bool = False,
        lpa3_confidence: float | None = None, ema_decay: float = 0.999) -> dict:
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import Callback

    from lpa3_lightning import FixMatchClassifier, LPA3Callback
    from lpa3_lightning.core.solver import AUTO_MAX_STEP_FRACTION
    from lpa3_lightning.data import SemiSupervisedDataModule
    from lpa3_lightning.methods.fixmatch_ema import FixMatchEMA

    path = result_path(out, source, labels, method, seed, steps, regenerate, solve_trained_only, lpa3_confidence)
    if path.exists():
        return json.loads(path.read_text())
    noise_norm = None
    if method == "fixmatch_noise":
        paired = result_path(out, source, labels, "fixmatch_lpa3", seed, steps, regenerate, solve_trained_only,
                             lpa3_confidence)
        if not paired.exists() or json.loads(paired.read_text()).get("mean_input_distance") is None:
            raise FileNotFoundError(f"fixmatch_noise takes its noise norm from the paired LP-A3 run {paired}, which "
                                    "is missing or has no mean_input_distance. Fix: run fixmatch_lpa3 with the same "
                                    "flags and seed first.")
        noise_norm = json.loads(paired.read_text())["mean_input_distance"]
    pl.seed_everything(seed)
    data = SemiSupervisedDataModule(source, root=root, num_labels=labels, seed=seed, batch_size=32, mu=7,
                                    eval_batch_size=500, num_workers=num_workers)
    data.setup("fit")
    data.setup("test")
    module = FixMatchClassifier(arch="small_cnn", in_channels=data.in_channels, num_classes=data.num_classes,
                                fixmatch={"lpa3_loss_warmup_epochs": lpa3_warmup,
                                          "solve_trained_only": solve_trained_only,
                                          "lpa3_confidence_threshold": _threshold(lpa3_confidence)})
    # FixMatch's EMA: parameters averaged, BatchNorm buffers copied (runs before 2026-11-29 used Lightning's
    # EMAWeightAveraging, which averages the buffers too: measured on PneumoniaMNIST, seed 0, step 300,
    # 0.662 against 0.873 with the buffers copied)
    ema = FixMatchEMA(decay=ema_decay)
    diagnostics = XPrimeDiagnostics()
    pseudo_labels = PseudoLabelTally(module, data.train_base.labels)

    class Curve(Callback):
        """EMA test accuracy every ``eval_every`` optimizer steps, with the training wall time."""

        def __init__(self) -> None:
            self.rows: list[dict] = []
            self.seconds = 0.0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self._start = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.seconds += time.perf_counter() - self._start
            pseudo_labels.count(batch)  # after the timer: measurement, not training
            diagnostics.count(trainer)
            step = trainer.global_step
            if step % eval_every == 0 or step == steps:
                ema_model = ema._average_model.module.model if ema._average_model is not None else pl_module.model
                # the EMA weights (what FixMatch reports, at --ema-decay) and the raw weights (the measure
                # of short runs, where an EMA of 0.999 still carries the first steps' weights)
                self.rows.append({"step": step, "train_seconds": self.seconds, "test_acc": self._accuracy(ema_model),
                                  "raw_test_acc": self._accuracy(pl_module.model), **pseudo_labels.interval(),
                                  **diagnostics.interval()})

        @staticmethod
        def _accuracy(model: torch.nn.Module) -> float:
            was_training = model.training
            model.eval()
            correct = total = 0
            with torch.no_grad():
                for x, y, _ in data.test_dataloader():
                    correct += int((model(x).argmax(1) == y).sum())
                    total += len(y)
            model.train(was_training)
            return correct / total

    curve = Curve()
    # the curve callback first: its timer includes the LP-A3 callback's work in on_train_batch_start
    callbacks: list[Callback] = [curve, ema]
    if method != "fixmatch":
        callbacks.insert(1, LPA3Callback(ratio=0.9, sigma=0.02, steps=5, seed=seed,
                                         preset="authors" if method == "fixmatch_lpa3_authors" else "package",
                                         selection={"criterion": "random"} if method == "fixmatch_lpa3_random" else None,
                                         cache={"regenerate_every_n_epochs": regenerate},
                                         augment=_augment(method), noise_norm=noise_norm,
                                         logging={"every_n_steps": 1}))  # the diagnostics of every step
    trainer = pl.Trainer(max_steps=steps, max_epochs=-1, accelerator="cpu", devices=1, callbacks=callbacks,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0)
    trainer.fit(module, datamodule=data)
    result = {"source": source, "labels": labels, "method": method, "seed": seed, "steps": steps,
              "final_test_acc": curve.rows[-1]["test_acc"], "wall_seconds": curve.seconds, "curve": curve.rows,
              "steps_per_epoch": data.num_steps_per_epoch, "lpa3_warmup_epochs": lpa3_warmup,
              "regenerate_every_n_epochs": regenerate, "final_raw_test_acc": curve.rows[-1]["raw_test_acc"],
              "num_workers": num_workers, "auto_max_step_fraction": AUTO_MAX_STEP_FRACTION,
              "solve_trained_only": solve_trained_only, "ema_decay": ema_decay,
              "ema": f"{type(ema).__name__}, buffers {'copied' if ema.copy_buffers else 'averaged'}",
              "torch_threads": torch.get_num_threads(), "commit": git_commit(),
              "lpa3_confidence": module.lpa3_settings.lpa3_confidence_threshold if method != "fixmatch" else None,
              "augment": _augment(method) if method != "fixmatch" else None, "noise_norm": noise_norm,
              "mean_input_distance": (statistics.mean(diagnostics.input_distances) if diagnostics.input_distances
                                      else None),
              "eval_every": eval_every}
    write_result(path, result)
    return result


def summarize(results: list[dict]) -> str:
    """Per data set and label count: each method's raw-weights test accuracy (the measure of these short
    runs), the EMA's, why in numbers (the pseudo-labels the loss trained on that were right at the last
    interval and over the run, the x' labels right, the selected share, how far x' moved) and the wall
    time; then every LP-A3 method against FixMatch seed by seed (paired: the same seed is the same split
    and initial weights), with the 95% t interval of the mean difference and its verdict; and any run
    whose tally contradicts its accuracy."""
    lines = ["| data set | labels | method | seeds | raw test acc (final) | EMA test acc (final) | pseudo-labels right "
             "(last interval / run) | x' labels right (run) | selected share | x' feature distance | train wall s "
             "(per run) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    notes: list[str] = []
    for source, labels in sorted({(r["source"], r["labels"]) for r in results}):
        by_method = {m: {r["seed"]: r for r in results if (r["source"], r["labels"], r["method"]) == (source, labels, m)}
                     for m in METHODS}
        for method, runs in by_method.items():
            rs = list(runs.values())
            if not rs:
                continue
            lines.append(
                f"| {source} | {labels} | {method} | {len(rs)} | {mean_std_of_known([r['final_raw_test_acc'] for r in rs])} | "
                f"{mean_std_of_known([r['final_test_acc'] for r in rs])} | {mean_std_of_known([r['curve'][-1].get('masked_acc') for r in rs])} / "
                f"{mean_std_of_known([curve_mean(r, 'masked_acc') for r in rs])} | {mean_std_of_known([curve_mean(r, 'xprime_kept_acc') for r in rs])} | "
                f"{mean_std_of_known([curve_mean(r, 'selected_fraction') for r in rs])} | "
                f"{mean_std_of_known([curve_mean(r, 'xprime_perceptual_distance') for r in rs])} | "
                f"{statistics.mean(r['wall_seconds'] for r in rs):.0f} |")
            for r in rs:
                classes = 2 if source in ("pneumoniamnist", "breastmnist") else 10
                flagged = [f"step {row['step']}: {why}" for row in r["curve"] if (why := contradiction(row, classes))]
                if flagged:
                    notes.append(f"CONTRADICTION {source} {labels} {method} seed {r['seed']}: " + "; ".join(flagged))
        base = {seed: r["final_raw_test_acc"] for seed, r in by_method["fixmatch"].items()}
        for method in METHODS[1:]:
            other = {seed: r["final_raw_test_acc"] for seed, r in by_method[method].items()}
            if len(set(base) & set(other)) < 2:
                continue
            d = paired_difference(base, other)
            walls = [by_method[method][s]["wall_seconds"] / by_method["fixmatch"][s]["wall_seconds"] for s in d["seeds"]]
            notes.append(f"{source} {labels} labels, {method} - fixmatch (raw test acc, seeds {d['seeds']}): per seed "
                         f"{' / '.join(f'{x:+.3f}' for x in d['diffs'])}; mean {d['mean']:+.3f} +- {d['std']:.3f}; "
                         f"95% t interval [{d['ci'][0]:+.3f}, {d['ci'][1]:+.3f}]; above on {d['above']} of {d['n']}: "
                         f"{d['verdict']}; wall time {statistics.mean(walls):.1f}x FixMatch's")
    return "\n".join(lines) + "\n\n" + "\n".join(notes)


def plot_convergence(results: list[dict], path: Path) -> Path:
    """Test accuracy against steps and against training seconds, one line per method and seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["source"], r["labels"]) for r in results})
    fig, axes = plt.subplots(len(groups), 2, figsize=(10, 3.2 * len(groups)), squeeze=False)
    for row, (source, labels) in enumerate(groups):
        for r in (r for r in results if (r["source"], r["labels"]) == (source, labels)):
            color = {"fixmatch": "tab:blue", "fixmatch_lpa3": "tab:red", "fixmatch_lpa3_random": "tab:green",
                     "fixmatch_lpa3_authors": "tab:orange", "fixmatch_null": "tab:gray",
                     "fixmatch_noise": "tab:purple"}[r["method"]]
            for col, x_key in enumerate(("step", "train_seconds")):
                xs = [c[x_key] for c in r["curve"]]
                axes[row][col].plot(xs, [c["raw_test_acc"] for c in r["curve"]], color=color, alpha=0.8,
                                    label=f"{r['method']} seed {r['seed']} (raw weights)")
                axes[row][col].plot(xs, [c["test_acc"] for c in r["curve"]], color=color, alpha=0.4, linestyle=":")
        for col, x_label in enumerate(("optimizer step", "training seconds")):
            axes[row][col].set_xlabel(x_label)
            axes[row][col].set_ylabel(f"{source} {labels} labels: test accuracy")
        axes[row][0].legend(fontsize=6)
    fig.suptitle("solid: raw weights, dotted: EMA 0.999; blue FixMatch, red + LP-A3, green + LP-A3 with random "
                 "selection, orange + LP-A3 preset authors")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sources", nargs="+", default=["mnist5k"])
    parser.add_argument("--labels", nargs="+", type=int, default=[10, 20, 40])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--lpa3-warmup", type=int, default=2,
                        help="passes over the unlabeled set before the LP-A3 term counts (2.3%% of 1000 steps, "
                             "the authors' share of their run)")
    parser.add_argument("--regenerate", type=int, default=1, help="regenerate_every_n_epochs (K) of the callback")
    parser.add_argument("--num-workers", type=int, default=0, help="data loader workers of each run")
    parser.add_argument("--solve-trained-only", action="store_true",
                        help="fixmatch.solve_trained_only=True, the package's default: solve only "
                             "the x' the LP-A3 term weighs (the same loss). Without it the authors' cost, as the "
                             "tables in docs/results.md ran")
    parser.add_argument("--lpa3-confidence", type=float, default=None,
                        help="fixmatch.lpa3_confidence_threshold: the x' term's pseudo-label confidence "
                             "threshold; None: the module's default (0.9, the authors')")
    parser.add_argument("--ema-decay", type=float, default=0.999,
                        help="decay of the EMA weights evaluated beside the raw ones (FixMatch's 0.999 suits its 2^20 "
                             "steps; over 300 steps it still carries the first weights: the raw weights are the measure)")
    parser.add_argument("--root", default=None, help="folder of the MedMNIST npz files (mnist5k ships)")
    parser.add_argument("--plot", type=Path, default=None, help="write the convergence plot (PNG) here")


def _runs(args: argparse.Namespace) -> list[tuple]:
    return [(s, n, m, seed) for s in args.sources for n in args.labels for seed in args.seeds for m in args.methods]


def _result_path(args: argparse.Namespace, source: str, labels: int, method: str, seed: int) -> Path:
    return result_path(args.out, source, labels, method, seed, args.steps, args.regenerate, args.solve_trained_only,
                       args.lpa3_confidence)


def _worker(args: argparse.Namespace, source: str, labels: int, method: str, seed: int) -> None:
    run(source, labels, method, seed, args.steps, args.eval_every, args.out, args.root, args.lpa3_warmup,
        args.regenerate, args.num_workers, args.solve_trained_only, args.lpa3_confidence, args.ema_decay)


def _this_sweep(args: argparse.Namespace, r: dict) -> bool:
    """The runs of these settings in --out, every seed there; the fixmatch rows are shared by every LP-A3 setting."""
    return r["steps"] == args.steps and r["source"] in args.sources and r["labels"] in args.labels and (
        r["method"] == "fixmatch" or (r["regenerate_every_n_epochs"] == args.regenerate
                                      and r.get("solve_trained_only", False) == args.solve_trained_only
                                      and _threshold(r.get("lpa3_confidence")) == _threshold(args.lpa3_confidence)))


def _summary(args: argparse.Namespace, results: list[dict]) -> str:
    text = summarize(results)
    if args.plot and results:
        text += f"\nplot: {plot_convergence(results, args.plot)}"
    return text


TABLE = Table(script=__file__, description=__doc__.splitlines()[0],
              keys=(("source", str), ("labels", int), ("method", str), ("seed", int)), arguments=_arguments,
              runs=_runs, result_path=_result_path, worker=_worker, summarize=_summary, out=ROOT / "docs" / "ssl_runs",
              keep=_this_sweep)


def main(argv: list[str] | None = None) -> None:
    sweep_main(TABLE, argv)


if __name__ == "__main__":
    main()
