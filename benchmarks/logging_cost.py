"""What the callback's diagnostics cost a training step: measured on every step, or sampled.

    python benchmarks/logging_cost.py [--repeats 4] [--epochs 3] [--accelerator gpu] [--json PATH]

One process fits the same LP-A3 run (ResNet-18 28 px, BreastMNIST train, batch 128, ratio 0.3,
5 solver steps, epoch 0 a warm-up) in turn with ``logging.every_n_steps=1`` (every step measured:
the eval-mode preservation forward, the solver's timer, the per-step reads of the logged values;
the behaviour before 0.2.0) and with the default (the Trainer's ``log_every_n_steps``, 50, and
each epoch's first step: 1 step in 5 here), ``--repeats`` times each, in the order A B B A A B ...,
so that a slow spell of the machine, or a drift over the process's life, touches both alike. Prints the mean and median step time of the measured epochs
for each setting and their ratio. Fits in one process rather than one process each: on a shared
2-core VM the spread between processes (10% in step_overhead.py's medians) exceeds this effect.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.harness import StepTimer, apply_threads, device_label, run_arguments, write_result  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=4, help="fits of each setting, in the order A B B A ...")
    parser.add_argument("--epochs", type=int, default=3, help="epoch 0 is the warm-up; the others are measured")
    run_arguments(parser, accelerator="cpu", json_out=True)
    args = parser.parse_args()
    apply_threads(args.threads)
    import lightning.pytorch as pl

    from lpa3_lightning import LPA3Callback, LPA3Classifier
    from lpa3_lightning.data import MedMNISTDataModule

    settings = {"every step": 1, "default (sampled)": None}
    steps: dict[str, list[float]] = {name: [] for name in settings}
    for repeat in range(args.repeats):
        # ABBA: the order flips every repeat, so a drift over the process's life (the later of two fits
        # in one process ran 2% to 6% slower here, whichever it was) falls on both settings alike
        for name, every in (list(settings.items()) if repeat % 2 == 0 else list(settings.items())[::-1]):
            pl.seed_everything(0)
            timer = StepTimer()
            callback = LPA3Callback(ratio=0.3, steps=5, warmup_epochs=1, seed=0, logging={"every_n_steps": every})
            trainer = pl.Trainer(max_epochs=args.epochs, accelerator=args.accelerator, devices=1,
                                 callbacks=[timer, callback], logger=False, enable_checkpointing=False,
                                 enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                                 num_sanity_val_steps=0)
            trainer.fit(LPA3Classifier(arch="resnet18", in_channels=1, num_classes=2),
                        datamodule=MedMNISTDataModule("breastmnist", batch_size=128))
            steps[name] += [t for epoch in range(1, args.epochs) for t in timer.steps[epoch]]
    print(f"{device_label(args.accelerator)}; {args.repeats} fits of each setting, {len(steps['every step'])} steps each")
    result = {name: {"mean_step_s": statistics.mean(ts), "median_step_s": statistics.median(ts), "steps": len(ts)}
              for name, ts in steps.items()}
    for name, r in result.items():
        print(f"{name:18} mean step {r['mean_step_s']:.3f} s, median {r['median_step_s']:.3f} s")
    ratio = result["default (sampled)"]["mean_step_s"] / result["every step"]["mean_step_s"]
    print(f"default / every step (mean step): {ratio:.3f}")
    if args.json:
        write_result(args.json, {"device": device_label(args.accelerator), "repeats": args.repeats, "settings": result,
                                 "sampled_over_every_step": ratio})


if __name__ == "__main__":
    main()
