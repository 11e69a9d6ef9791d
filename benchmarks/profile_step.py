"""Where an LP-A3 training step spends its time: torch.profiler over a few steps.

    python benchmarks/profile_step.py [--accelerator gpu] [--fast] [--sync-free {auto,true,false}] [--cuda-graphs] \
        [--steps 4] [--json PATH]

ResNet-18 (MedMNIST stem) on the embedded BreastMNIST, batch 128, LPA3Callback(ratio=0.3,
steps=5) after one warm-up epoch; profiles ``--steps`` training steps of the second epoch
(the third with ``--cuda-graphs``, after the epoch that captured the graphs)
and prints the operators with the largest self CPU time (and self CUDA time on a GPU), the
number of kernel launches and the wall time per step. For finding overheads, not for ratios
(step_overhead.py measures those; profile_host.py profiles more steady steps, with the host's
Python functions). ``--json PATH`` writes the figures per step (wall, kernel launches,
synchronisations, GPU busy time, graph captures) and the top operators.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.harness import (  # noqa: E402
    ProfiledSteps,
    apply_threads,
    cuda_activity,
    device_label,
    on_gpu,
    run_arguments,
    write_result,
)


def main() -> None:
    parser = argparse.ArgumentParser()
    run_arguments(parser, accelerator="cpu", json_out=True)
    parser.add_argument("--fast", action="store_true")
    parser.add_argument("--sync-free", default="auto", choices=("auto", "true", "false"),
                        help="LPA3Callback(runtime={'sync_free': ...}): auto is the sync-free path on a GPU")
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="LPA3Callback(runtime={'cuda_graphs': True}): the solver replayed as a CUDA graph (needs the sync-free path)")
    parser.add_argument("--steps", type=int, default=4, help="at most 5 (one epoch of BreastMNIST)")
    parser.add_argument("--rows", type=int, default=25)
    args = parser.parse_args()
    apply_threads(args.threads)

    import lightning.pytorch as pl
    import torch

    from lpa3_lightning import LPA3Callback, LPA3Classifier
    from lpa3_lightning.data import MedMNISTDataModule

    gpu = on_gpu(args.accelerator)
    # with graphs, the first LP-A3 epoch captures them (a capture costs a few eager solves); the
    # profile is of the epoch after it, where steps replay
    profile_epoch = 2 if args.cuda_graphs else 1

    def graph_count() -> int:
        graphs = lpa3.runner().solver_graphs
        return 0 if graphs is None else graphs.captures

    class Profiled(ProfiledSteps):
        def window_opens(self, trainer, pl_module):
            self.captures = graph_count()

    pl.seed_everything(0)
    profiled = Profiled(profile_epoch, args.steps)
    lpa3 = LPA3Callback(ratio=0.3, steps=5, warmup_epochs=1, seed=0, solver={"fast": args.fast},
                        runtime={"sync_free": {"auto": "auto", "true": True, "false": False}[args.sync_free],
                                 "cuda_graphs": args.cuda_graphs})
    trainer = pl.Trainer(max_epochs=profile_epoch + 1, accelerator=args.accelerator, devices=1, logger=False,
                         callbacks=[profiled, lpa3],  # the profiler's window first: it holds whole steps
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, num_sanity_val_steps=0)
    data = MedMNISTDataModule("breastmnist", batch_size=128)
    trainer.fit(LPA3Classifier(arch="resnet18", in_channels=1, num_classes=2), datamodule=data)
    if profiled.count == 0:
        sys.exit("no step was profiled")
    n = profiled.count
    events = profiled.prof.key_averages()
    sort = "self_cuda_time_total" if gpu else "self_cpu_time_total"
    result = {"script": "profile_step", "torch": torch.__version__, "device": device_label(args.accelerator),
              "sync_free": args.sync_free, "cuda_graphs": args.cuda_graphs, "fast": args.fast, "steps": n,
              "ms_per_step": profiled.seconds / n * 1000}
    print(f"{n} LP-A3 steps profiled: {result['ms_per_step']:.1f} ms per step (with the profiler's own overhead)")
    if args.cuda_graphs:
        result["captures_before"], result["captures_during"] = profiled.captures, graph_count() - profiled.captures
        print(f"graphs captured before the profile: {profiled.captures}, during it: "
              f"{result['captures_during']} (a capture inside the window inflates it)")
    if gpu:
        activity = cuda_activity(profiled.prof.events())
        syncs = activity["synchronisations"] - 1  # less the one that closes the window
        result.update(launches_per_step=activity["kernel_launches"] / n,
                      graph_launches_per_step=activity["graph_launches"] / n, syncs_per_step=syncs / n,
                      gpu_busy_ms_per_step=activity["gpu_busy_us"] / n / 1000)
        print(f"kernel launches per step: {result['launches_per_step']:.0f}; synchronisations per step: "
              f"{result['syncs_per_step']:.1f}")
    result["top_self_cpu_ms_per_step"] = {e.key: e.self_cpu_time_total / n / 1000 for e in sorted(
        events, key=lambda e: e.self_cpu_time_total, reverse=True)[:15]}
    print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows))
    if gpu:
        result["top_self_cuda_ms_per_step"] = {e.key: e.self_device_time_total / n / 1000 for e in sorted(
            events, key=lambda e: e.self_device_time_total, reverse=True)[:15]}
        print(events.table(sort_by=sort, row_limit=args.rows))
    if args.json:
        write_result(args.json, result)


if __name__ == "__main__":
    main()
