"""Host reads of device values and operators dispatched in one training step, plain and with LP-A3.

    python benchmarks/host_reads.py [--arch resnet18] [--batch 128] [--ratio 0.3] [--steps 5]

On a GPU every read of a tensor's value on the host (``.item()``, ``bool()``/``int()``/``float()``
of a tensor, ``.tolist()``, ``nonzero()``, indexing with a boolean mask, whose result size
depends on the data) waits for the device: a synchronisation. This script counts them on the
CPU, where they cost nothing but happen at the same places, by patching those methods for the
duration of one training step (the callback's ``on_train_batch_start``, ``training_step`` and
the callback's ``on_train_batch_end``) after a warm-up epoch, and counts the operators the step
dispatches (torch profiler events). It prints both for the plain step (no callback) and the
LP-A3 step, and the LP-A3 step's reads by call site in the package.
"""

from __future__ import annotations

import argparse
import collections
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

READS = ("item", "__bool__", "__int__", "__float__", "tolist", "nonzero")


class HostReadCounter:
    """Counts host reads of tensor values while active; ``sites`` keeps the package frame of each."""

    def __init__(self) -> None:
        import torch

        self.torch = torch
        self.counts: collections.Counter[str] = collections.Counter()
        self.sites: collections.Counter[str] = collections.Counter()
        self._saved: dict[str, object] = {}

    def _site(self) -> str:
        for frame in reversed(traceback.extract_stack()[:-2]):
            if "lpa3_lightning" in frame.filename:
                return f"{Path(frame.filename).name}:{frame.lineno} {frame.line}"
        return "(outside the package)"

    def _wrap(self, name: str, original):
        counter = self

        def wrapped(tensor, *args, **kwargs):
            if not getattr(counter, "_inside", False):
                counter._inside = True
                try:
                    counter.counts[name] += 1
                    counter.sites[counter._site()] += 1
                finally:
                    counter._inside = False
            return original(tensor, *args, **kwargs)

        return wrapped

    def __enter__(self) -> "HostReadCounter":
        Tensor = self.torch.Tensor
        for name in (*READS, "__getitem__"):
            self._saved[name] = getattr(Tensor, name)
        for name in READS:
            setattr(Tensor, name, self._wrap(name, self._saved[name]))
        getitem = self._saved["__getitem__"]
        counter = self

        def masked_getitem(tensor, index):
            parts = index if isinstance(index, tuple) else (index,)
            if any(isinstance(p, counter.torch.Tensor) and p.dtype == counter.torch.bool for p in parts):
                if not getattr(counter, "_inside", False):
                    counter.counts["boolean mask index"] += 1
                    counter.sites[counter._site()] += 1
            return getitem(tensor, index)

        Tensor.__getitem__ = masked_getitem
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self._saved.items():
            setattr(self.torch.Tensor, name, original)


def measure(with_lpa3: bool, args: argparse.Namespace) -> dict:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback
    from torch.profiler import ProfilerActivity, profile

    from lpa3_lightning import LPA3Callback, LPA3Classifier
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
    if with_lpa3:
        callbacks.append(LPA3Callback(ratio=args.ratio, steps=args.steps, seed=0))
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
    args = parser.parse_args()
    plain, lpa3 = measure(False, args), measure(True, args)
    print(f"\none training step, {args.arch}, batch {args.batch}, ratio {args.ratio}, {args.steps} solver steps")
    print("| step | host reads of device values | by kind | operators dispatched |")
    print("|---|---|---|---|")
    for name, r in (("plain", plain), ("LP-A3", lpa3)):
        print(f"| {name} | {sum(r['reads'].values())} | {r['reads']} | {r['operators']} |")
    print(f"operators: LP-A3 / plain = {lpa3['operators'] / max(1, plain['operators']):.1f}x")
    print("\nLP-A3 step's host reads by call site:")
    for site, count in lpa3["sites"]:
        print(f"{count:5d}  {site}")


if __name__ == "__main__":
    main()
