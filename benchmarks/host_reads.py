"""Host reads of device values and operators dispatched in one training step, plain and with LP-A3.

    python benchmarks/host_reads.py [--arch resnet18] [--batch 128] [--ratio 0.3] [--steps 5] [--json PATH]

On a GPU every read of a tensor's value on the host (``.item()``, ``bool()``/``int()``/``float()``
of a tensor, ``.tolist()``, ``nonzero()``, indexing with a boolean mask, whose result size
depends on the data) waits for the device: a synchronisation. This script counts them on the
CPU, where they cost nothing but happen at the same places, by patching those methods for the
duration of one training step (the callback's ``on_train_batch_start``, ``training_step`` and
the callback's ``on_train_batch_end``) after a warm-up epoch, and counts the operators the step
dispatches (torch profiler events). It prints them for the plain step (no callback), the
LP-A3 step on the default path and on the sync-free path (``LPA3Callback(runtime={"sync_free": True})``,
the path ``sync_free="auto"`` takes on a GPU), and each LP-A3 step's reads by call site in the
package (the counter is :class:`lpa3_lightning.core.host_reads.HostReadCounter`). ``--json PATH``
writes each step's counts.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.harness import apply_threads, run_arguments, write_result  # noqa: E402


def measure(sync_free: bool | None, args: argparse.Namespace) -> dict:
    """One step's reads and operators: no callback (``sync_free=None``) or LP-A3 on that path."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback
    from torch.profiler import ProfilerActivity, profile

    from lpa3_lightning import LPA3Callback, LPA3Classifier
    from lpa3_lightning.core.host_reads import HostReadCounter
    from lpa3_lightning.data import MedMNISTDataModule

    result: dict = {}

    class OneStep(Callback):
        """Counts over the first step of the second epoch; registered first, so it spans the LP-A3
        callback's on_train_batch_start and (as the last callback) its on_train_batch_end."""

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.current_epoch == 1 and batch_idx == 0:
                self.counter = HostReadCounter().__enter__()
                self.prof = profile(activities=[ProfilerActivity.CPU])
                self.prof.__enter__()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            pass

    class Closer(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.current_epoch == 1 and batch_idx == 0:
                one.prof.__exit__(None, None, None)
                one.counter.__exit__()
                result["reads"] = dict(one.counter.counts)
                result["sites"] = one.counter.sites.most_common(args.sites)
                result["operators"] = len([e for e in one.prof.events() if e.device_type.name == "CPU"])
                trainer.should_stop = True

    pl.seed_everything(0)
    data = MedMNISTDataModule("breastmnist", batch_size=args.batch)
    module = LPA3Classifier(arch=args.arch, num_classes=2, in_channels=1)
    one = OneStep()
    callbacks: list = [one]
    if sync_free is not None:
        callbacks.append(LPA3Callback(ratio=args.ratio, steps=args.steps, seed=0, runtime={"sync_free": sync_free}))
    callbacks.append(Closer())
    trainer = pl.Trainer(max_epochs=2, accelerator="cpu", devices=1, callbacks=callbacks, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, num_sanity_val_steps=0)
    trainer.fit(module, datamodule=data)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--arch", default="resnet18")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--ratio", type=float, default=0.3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--sites", type=int, default=30, help="call sites to list")
    run_arguments(parser, json_out=True)
    args = parser.parse_args()
    apply_threads(args.threads)
    runs = {"plain": measure(None, args), "LP-A3 (default path)": measure(False, args),
            "LP-A3 (sync_free=True)": measure(True, args)}
    print(f"\none training step, {args.arch}, batch {args.batch}, ratio {args.ratio}, {args.steps} solver steps")
    print("| step | host reads of device values | by kind | operators dispatched | operators / plain |")
    print("|---|---|---|---|---|")
    plain_ops = max(1, runs["plain"]["operators"])
    for name, r in runs.items():
        print(f"| {name} | {sum(r['reads'].values())} | {r['reads']} | {r['operators']} | "
              f"{r['operators'] / plain_ops:.1f}x |")
    for name in list(runs)[1:]:
        print(f"\n{name}: host reads by call site:")
        for site, count in runs[name]["sites"]:
            print(f"{count:5d}  {site}")
    if args.json:
        write_result(args.json, {"script": "host_reads", "arch": args.arch, "batch": args.batch, "ratio": args.ratio,
                                 "solver_steps": args.steps, "runs": runs})


if __name__ == "__main__":
    main()
