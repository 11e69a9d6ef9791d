"""Where an LP-A3 training step spends its time: torch.profiler over a few steps.

    python benchmarks/profile_step.py [--accelerator gpu] [--fast] [--sync-free {auto,true,false}] [--cuda-graphs] [--steps 4]

ResNet-18 (MedMNIST stem) on the embedded BreastMNIST, batch 128, LPA3Callback(ratio=0.3,
steps=5) after one warm-up epoch; profiles ``--steps`` training steps of the second epoch
(the third with ``--cuda-graphs``, after the epoch that captured the graphs)
and prints the operators with the largest self CPU time (and self CUDA time on a GPU), the
number of kernel launches and the wall time per step. For finding overheads, not for ratios
(step_overhead.py measures those).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--fast", action="store_true")
    parser.add_argument("--sync-free", default="auto", choices=("auto", "true", "false"),
                        help="LPA3Callback(runtime={'sync_free': ...}): auto is the sync-free path on a GPU")
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="LPA3Callback(runtime={'cuda_graphs': True}): the solver replayed as a CUDA graph (needs the sync-free path)")
    parser.add_argument("--steps", type=int, default=4, help="at most 5 (one epoch of BreastMNIST)")
    parser.add_argument("--rows", type=int, default=25)
    args = parser.parse_args()

    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import Callback
    from torch.profiler import ProfilerActivity, profile

    from lpa3_lightning import LPA3Callback, LPA3Classifier
    from lpa3_lightning.data import MedMNISTDataModule

    on_gpu = args.accelerator in ("gpu", "cuda")
    # with graphs, the first LP-A3 epoch captures them (a capture costs a few eager solves); the
    # profile is of the epoch after it, where steps replay
    profile_epoch = 2 if args.cuda_graphs else 1

    def graph_count() -> int:
        graphs = lpa3.solver_graphs
        return 0 if graphs is None else graphs.captures
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])

    class Profiled(Callback):
        def __init__(self) -> None:
            self.prof = None
            self.count = 0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.current_epoch == profile_epoch and self.prof is None:
                self.captures = graph_count()
                if on_gpu:
                    torch.cuda.synchronize()
                self.prof = profile(activities=activities)
                self.prof.__enter__()
                self.start = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if self.prof is not None and self.count < args.steps:
                self.count += 1
                if self.count == args.steps:
                    self._stop(trainer)

        def on_train_epoch_end(self, trainer, pl_module):
            if self.prof is not None and not hasattr(self, "seconds") and self.count:
                self._stop(trainer)  # the epoch ended before --steps steps

        def _stop(self, trainer):
            if on_gpu:
                torch.cuda.synchronize()
            self.seconds = time.perf_counter() - self.start
            self.prof.__exit__(None, None, None)
            trainer.should_stop = True

    pl.seed_everything(0)
    profiled = Profiled()
    lpa3 = LPA3Callback(ratio=0.3, steps=5, warmup_epochs=1, seed=0, solver={"fast": args.fast},
                        runtime={"sync_free": {"auto": "auto", "true": True, "false": False}[args.sync_free],
                                 "cuda_graphs": args.cuda_graphs})
    trainer = pl.Trainer(max_epochs=profile_epoch + 1, accelerator=args.accelerator, devices=1, logger=False,
                         callbacks=[lpa3, profiled],
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, num_sanity_val_steps=0)
    data = MedMNISTDataModule("breastmnist", batch_size=128)
    trainer.fit(LPA3Classifier(arch="resnet18", in_channels=1, num_classes=2), datamodule=data)
    if profiled.count == 0:
        sys.exit("no step was profiled")
    events = profiled.prof.key_averages()
    sort = "self_cuda_time_total" if on_gpu else "self_cpu_time_total"
    print(f"{profiled.count} LP-A3 steps profiled: {profiled.seconds / profiled.count * 1000:.1f} ms per step "
          "(with the profiler's own overhead)")
    if args.cuda_graphs:
        print(f"graphs captured before the profile: {profiled.captures}, during it: "
              f"{graph_count() - profiled.captures} (a capture inside the window inflates it)")
    if on_gpu:
        launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
        syncs = sum(e.count for e in events if "Synchronize" in e.key or e.key == "cudaStreamSynchronize")
        print(f"kernel launches per step: {launches / profiled.count:.0f}; synchronisations per step: "
              f"{syncs / profiled.count:.1f}")
    print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows))
    if on_gpu:
        print(events.table(sort_by=sort, row_limit=args.rows))


if __name__ == "__main__":
    main()
