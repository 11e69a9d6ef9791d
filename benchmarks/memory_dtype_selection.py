"""How 16-bit storage of the TCS memory changes the selections, on the predictions of a real run.

    python benchmarks/memory_dtype_selection.py                 # BreastMNIST (embedded), 6 epochs
    python benchmarks/memory_dtype_selection.py --flag pneumoniamnist --root ../data --epochs 4

Trains LPA3Classifier (ResNet-18, 28 px) with LPA3Callback (ratio 0.5, sigma 0.02, 5 steps,
float32 memory) and records every update the memory received: (epoch, indices, probabilities).
The recorded stream is then replayed into three memories, float32, bfloat16 and float16
storage, each selecting every recorded batch before its update and refreshing its threshold at
each epoch's end, as the callback does. Replaying one stream isolates the storage: in a run of
its own, a changed selection would also change the training and every later prediction.

Reported: per epoch with a threshold, the rows whose selection differs from float32's (a row is
one sample's decision at one step); the largest score difference at the end.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import apply_threads, run_arguments  # noqa: E402
from lpa3_lightning import LPA3Callback, LPA3Classifier  # noqa: E402
from lpa3_lightning.core.tcs import TimeConsistency  # noqa: E402
from lpa3_lightning.data import MedMNISTDataModule  # noqa: E402

DTYPES = ("float32", "bfloat16", "float16")


def record_run(args: argparse.Namespace) -> tuple[list[tuple[int, torch.Tensor, torch.Tensor]], int, int]:
    """Train once; return every memory update (epoch, indices, probs) and the memory's size.

    The update applies a row once an epoch (the first of its index; finite probabilities): a
    replay with the same epochs applies the same rows."""
    stream: list[tuple[int, torch.Tensor, torch.Tensor]] = []
    original = TimeConsistency.update

    def recording(self, indices, probs, targets=None, *, epoch=None, **kwargs):
        stream.append((epoch, indices.detach().cpu().clone(), probs.detach().float().cpu().clone()))
        return original(self, indices, probs, targets, epoch=epoch, **kwargs)

    pl.seed_everything(0)
    data = MedMNISTDataModule(args.flag, root=args.root, batch_size=args.batch_size) if args.root else \
        MedMNISTDataModule(args.flag, batch_size=args.batch_size)
    callback = LPA3Callback(ratio=0.5, sigma=0.02, steps=5, seed=0)
    trainer = pl.Trainer(max_epochs=args.epochs, accelerator="cpu", devices=1, callbacks=[callback], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, num_sanity_val_steps=0)
    TimeConsistency.update = recording
    try:
        trainer.fit(LPA3Classifier(num_classes=args.num_classes, in_channels=1), datamodule=data)
    finally:
        TimeConsistency.update = original
    return stream, callback.runner().tcs.num_samples, callback.runner().tcs.num_classes


def replay(stream, num_samples: int, num_classes: int, dtype: str
           ) -> tuple[dict[int, list[torch.Tensor]], TimeConsistency]:
    memory = TimeConsistency(num_samples, num_classes, 0.5, storage_dtype=dtype, seed=0)
    selections: dict[int, list[torch.Tensor]] = {}
    epoch_now = 0
    for epoch, indices, probs in stream:
        if epoch != epoch_now:
            memory.refresh_threshold()
            epoch_now = epoch
        if memory.has_threshold:
            selections.setdefault(epoch, []).append(memory.select(indices, epoch))
        memory.update(indices, probs, epoch=epoch)
    return selections, memory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flag", default="breastmnist")
    parser.add_argument("--root", default=None, help="folder with <flag>.npz (default: the embedded BreastMNIST)")
    parser.add_argument("--num-classes", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=32)
    run_arguments(parser)
    args = parser.parse_args()
    apply_threads(args.threads)
    start = time.perf_counter()
    stream, n, c = record_run(args)
    print(f"{time.strftime('%Y-%m-%d')}: {args.flag}, N = {n}, C = {c}, {args.epochs} epochs of a real LP-A3 run "
          f"(ratio 0.5, ResNet-18, batch {args.batch_size}), {len(stream)} memory updates recorded in "
          f"{time.perf_counter() - start:.0f} s; torch {torch.__version__}")
    results = {dtype: replay(stream, n, c, dtype) for dtype in DTYPES}
    reference, ref_memory = results["float32"]
    print(f"{'epoch':>5} {'rows':>6} {'selected fp32':>14} " + " ".join(f"{d + ' changed':>18}" for d in DTYPES[1:]))
    totals = {d: [0, 0] for d in DTYPES[1:]}
    for epoch, masks in sorted(reference.items()):
        rows = sum(m.numel() for m in masks)
        line = f"{epoch:>5} {rows:>6} {sum(int(m.sum()) for m in masks):>14} "
        for dtype in DTYPES[1:]:
            changed = sum(int((a != b).sum()) for a, b in zip(masks, results[dtype][0][epoch]))
            totals[dtype][0] += changed
            totals[dtype][1] += rows
            line += f"{changed:>8} ({100 * changed / rows:5.2f} %) "
        print(line)
    for dtype in DTYPES[1:]:
        changed, rows = totals[dtype]
        score_gap = float((results[dtype][1].scores - ref_memory.scores).abs().max())
        print(f"{dtype}: {changed} of {rows} selection decisions differ from float32 ({100 * changed / rows:.2f} %); "
              f"largest score difference at the end {score_gap:.2e}")


if __name__ == "__main__":
    main()
