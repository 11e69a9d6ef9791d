"""Where the host spends a steady LP-A3 training step: torch.profiler with the CPU side visible.

    python benchmarks/profile_host.py [--accelerator gpu] [--steps 20] [--json PATH]

ResNet-18 (MedMNIST stem, 28 px), batch 128, LPA3Callback(ratio=0.3, steps=5) on its default
path (``runtime.sync_free="auto"``: the sync-free path on a GPU), as the other GPU benchmarks.
The training set is the embedded BreastMNIST train split repeated to ``batch x (--warm-steps +
--steps)`` rows (each its own dataset index), so every step has a full batch and one epoch holds
every profiled step: epoch 0 is the callback's warm-up (no attack), in epoch 1 the first
``--warm-steps`` steps run unprofiled and the next ``--steps`` are profiled, with the CPU and (on
a GPU) CUDA activities and ``with_stack=True`` (the profiler's Python tracer). Printed and
written per step, in ms: the wall time (with the profiler's own overhead, large with the
tracer: for where the host's time goes, not for the step's cost; step_overhead.py times
steps), self CPU time by operator (top ``--rows``) and by Python function (top ``--rows``), the
five largest host places of either kind; and the counts of kernel launches, ``cudaMalloc`` /
``cudaFree`` calls, synchronisations by call (less the one closing the window), host-to-device
and device-to-host copies with their bytes, the GPU's busy time and the peak GPU memory. On the
CPU (``--accelerator cpu``) the CUDA counts are 0.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict
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

#: Python frames of the profiling itself, left out of the ranking
_OWN_FRAMES = ("torch/profiler/", "torch/autograd/profiler", "harness.py(")


def _training_data(batch: int, rows: int):
    """BreastMNIST's train images and labels repeated to ``rows`` rows, with indices 0..rows-1."""
    import torch
    from torch.utils.data import TensorDataset

    from lpa3_lightning.data import MedMNISTDataModule

    data = MedMNISTDataModule("breastmnist", batch_size=batch)
    data.setup("fit")
    items = [data.train_dataset[i] for i in range(len(data.train_dataset))]  # type: ignore[arg-type]
    x = torch.stack([item[0] for item in items])
    y = torch.stack([torch.as_tensor(item[1]) for item in items])
    repeat = torch.arange(rows) % len(items)
    return TensorDataset(x[repeat], y[repeat], torch.arange(rows)), data.normalization


def host_places(events, steps: int, rows: int) -> dict:
    """Self CPU time per step (ms) by operator and by Python function, from raw profiler events."""
    by_operator: dict[str, float] = defaultdict(float)
    by_function: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    traced = False
    for e in events:
        if e.device_type.name != "CPU" or e.is_async or e.is_user_annotation:
            continue
        if getattr(e, "is_python_function", False):
            traced = True
            if not any(frame in e.name for frame in _OWN_FRAMES):
                by_function[re.sub(r" at 0x[0-9a-f]+", "", e.name)] += e.self_cpu_time_total  # one key per built-in
        else:
            by_operator[e.name] += e.self_cpu_time_total
            calls[e.name] += 1

    def top(table: dict[str, float]) -> dict[str, float]:
        return {k: v / steps / 1000 for k, v in sorted(table.items(), key=lambda kv: kv[1], reverse=True)[:rows]}

    ops, functions = top(by_operator), top(by_function)
    places = sorted([(ms, "operator", name) for name, ms in ops.items()]
                    + [(ms, "python", name) for name, ms in functions.items()], reverse=True)[:5]
    return {
        "host_self_ms_per_step": (sum(by_operator.values()) + sum(by_function.values())) / steps / 1000,
        "operators_per_step": sum(calls.values()) / steps,
        "self_cpu_ms_per_step_by_operator": ops,
        "calls_per_step_by_operator": {name: calls[name] / steps for name in ops},
        "self_cpu_ms_per_step_by_python_function": functions if traced else None,
        "top_host_places": [{"kind": kind, "name": name, "ms_per_step": ms} for ms, kind, name in places],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    run_arguments(parser, accelerator="cpu", json_out=True)
    parser.add_argument("--steps", type=int, default=20, help="steady LP-A3 steps profiled")
    parser.add_argument("--warm-steps", type=int, default=3, help="LP-A3 steps run before the profile, in its epoch")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--ratio", type=float, default=0.3)
    parser.add_argument("--solver-steps", type=int, default=5)
    parser.add_argument("--arch", default="resnet18", choices=("resnet18", "small_cnn"),
                        help="small_cnn: a quick check of the script, not a figure")
    parser.add_argument("--sync-free", default="auto", choices=("auto", "true", "false"),
                        help="LPA3Callback(runtime={'sync_free': ...}); auto: the sync-free path on a GPU")
    parser.add_argument("--no-stack", action="store_true", help="without the Python tracer (no by-function table)")
    parser.add_argument("--rows", type=int, default=15)
    args = parser.parse_args()
    if args.steps < 1 or args.warm_steps < 0:
        sys.exit("--steps must be >= 1 and --warm-steps >= 0")
    apply_threads(args.threads)

    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader

    from lpa3_lightning import LPA3Callback, LPA3Classifier
    from lpa3_lightning.models.small_cnn import small_cnn

    gpu = on_gpu(args.accelerator)
    pl.seed_everything(0)
    dataset, normalization = _training_data(args.batch, args.batch * (args.warm_steps + args.steps))
    loader = DataLoader(dataset, batch_size=args.batch, shuffle=True, drop_last=True,
                        generator=torch.Generator().manual_seed(0))
    profiled = ProfiledSteps(epoch=1, steps=args.steps, first_batch=args.warm_steps, with_stack=not args.no_stack)
    lpa3 = LPA3Callback(ratio=args.ratio, steps=args.solver_steps, warmup_epochs=1, seed=0, input_range=normalization,
                        runtime={"sync_free": {"auto": "auto", "true": True, "false": False}[args.sync_free]})
    model = small_cnn(in_channels=1, num_classes=2) if args.arch == "small_cnn" else None
    module = LPA3Classifier(arch="resnet18", in_channels=1, num_classes=2, model=model)
    trainer = pl.Trainer(max_epochs=2, accelerator=args.accelerator, devices=1, logger=False,
                         callbacks=[profiled, lpa3],  # the window first: it holds whole steps
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, num_sanity_val_steps=0)
    trainer.fit(module, train_dataloaders=loader)
    if profiled.count == 0:
        sys.exit("no step was profiled")
    n = profiled.count
    device = trainer.strategy.root_device
    events = profiled.prof.events()
    activity = cuda_activity(events)
    if gpu:
        activity["synchronisations"] -= 1  # the one closing the window
        calls = activity["synchronisations_by_call"]
        calls["cudaDeviceSynchronize"] = calls.get("cudaDeviceSynchronize", 1) - 1
    copies = activity["copies"]
    result = {
        "script": "profile_host", "torch": torch.__version__, "device": device_label(args.accelerator),
        "arch": args.arch, "batch": args.batch, "ratio": args.ratio, "solver_steps": args.solver_steps,
        "sync_free": args.sync_free, "with_stack": not args.no_stack, "steps": n,
        "wall_ms_per_step": profiled.seconds / n * 1000,
        **host_places(events, n, args.rows),
        "kernel_launches_per_step": activity["kernel_launches"] / n,
        "graph_launches_per_step": activity["graph_launches"] / n,
        "cuda_malloc_per_step": activity["cuda_malloc"] / n,
        "cuda_free_per_step": activity["cuda_free"] / n,
        "syncs_per_step": activity["synchronisations"] / n,
        "syncs_per_step_by_call": {k: v / n for k, v in activity["synchronisations_by_call"].items()},
        "h2d_per_step": copies["h2d"]["count"] / n,
        "h2d_bytes_per_step": None if copies["h2d"]["bytes"] is None else copies["h2d"]["bytes"] / n,
        "d2h_per_step": copies["d2h"]["count"] / n,
        "d2h_bytes_per_step": None if copies["d2h"]["bytes"] is None else copies["d2h"]["bytes"] / n,
        "gpu_busy_ms_per_step": activity["gpu_busy_us"] / n / 1000,
        "peak_mb": torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None,
    }
    print(f"torch {torch.__version__}, {result['device']}; {args.arch}, batch {args.batch}, ratio {args.ratio}, "
          f"{args.solver_steps} solver steps, sync_free={args.sync_free}; {n} steady LP-A3 steps profiled"
          f"{' with the Python tracer' if not args.no_stack else ''}")
    print(f"self CPU ms per step by operator (top {args.rows}):")
    for name, ms in result["self_cpu_ms_per_step_by_operator"].items():
        print(f"  {ms:8.2f}  {result['calls_per_step_by_operator'][name]:7.1f} calls  {name}")
    if result["self_cpu_ms_per_step_by_python_function"] is not None:
        print(f"self CPU ms per step by Python function (top {args.rows}):")
        for name, ms in result["self_cpu_ms_per_step_by_python_function"].items():
            print(f"  {ms:8.2f}  {name}")
    # the figures last (a session shows a part's last lines)
    print("top host places (self CPU ms per step): " + "; ".join(
        f"{p['name']} ({p['kind']}) {p['ms_per_step']:.2f}" for p in result["top_host_places"]))
    print(f"per step: wall {result['wall_ms_per_step']:.1f} ms (with the profiler's overhead), host self time "
          f"{result['host_self_ms_per_step']:.1f} ms, {result['operators_per_step']:.0f} operators, GPU busy "
          f"{result['gpu_busy_ms_per_step']:.1f} ms")
    print(f"per step: {result['kernel_launches_per_step']:.0f} kernel launches "
          f"({result['graph_launches_per_step']:.1f} graph launches), {result['syncs_per_step']:.2f} synchronisations "
          f"{result['syncs_per_step_by_call']}, cudaMalloc {result['cuda_malloc_per_step']:.2f}, cudaFree "
          f"{result['cuda_free_per_step']:.2f}, H2D copies {result['h2d_per_step']:.1f} "
          f"({_bytes(result['h2d_bytes_per_step'])}), D2H copies {result['d2h_per_step']:.1f} "
          f"({_bytes(result['d2h_bytes_per_step'])})"
          + (f"; peak GPU memory {result['peak_mb']:.0f} MB" if result["peak_mb"] is not None else ""))
    if args.json:
        write_result(args.json, result)


def _bytes(value: float | None) -> str:
    return "bytes not exposed by this torch" if value is None else f"{value / 1024:.1f} KiB"


if __name__ == "__main__":
    main()
