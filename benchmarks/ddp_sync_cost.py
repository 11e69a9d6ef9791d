"""Cost of LPA3Callback's per-step prediction sync next to a ResNet-18 training step.

    python benchmarks/ddp_sync_cost.py            # full grid (about 2-3 minutes on 2 cores)
    python benchmarks/ddp_sync_cost.py --quick    # smaller grid (well under a minute)

Spawns 2 CPU processes with the gloo backend (MASTER_ADDR=127.0.0.1, a free port), each
with ``torch.set_num_threads(1)`` so the two processes do not fight over 2 cores. For each
per-rank batch size and number of classes it measures, in the same run:

* sync: the median wall time of the exchange of one step's predictions: one
  ``exchange_sizes`` and one ``gather_padded`` of (indices, finiteness, probabilities, targets),
  the collectives ``TimeConsistency.update`` makes once per training step (after
  ``training_step``, in ``LPA3Callback.on_train_batch_end``) before it applies the rows, after
  warm-up, with a ``dist.barrier()`` before each timed call; the larger of the two ranks'
  medians is reported;
* step: the median wall time of one local forward + backward + SGD step of
  ``medmnist_resnet("resnet18", 1, 2)`` at 28x28 on the same per-rank batch, both ranks
  stepping at the same time (a barrier before each). DDP's gradient all-reduce is NOT part
  of this step; it is timed separately (one all-reduce of all ResNet-18 gradients) and
  printed below the table, for scale. The step does not depend on the number of classes
  (only the 512 x C head would), so it is measured once per batch size. To stay within about
  4 minutes the 512 step has no warm-up step (a 30 s step dwarfs first-call overheads).

The ratio column is sync / step. Absolute numbers are for gloo on CPU; NCCL on GPUs differs.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import apply_threads, free_port, max_over_ranks  # noqa: E402
from lpa3_lightning.core.distributed import bytes_per_sample, exchange_sizes, gather_padded  # noqa: E402
from lpa3_lightning.models import medmnist_resnet  # noqa: E402

WORLD_SIZE = 2


def exchange_predictions(indices: torch.Tensor, probs: torch.Tensor, targets: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's rows of one step, as ``TimeConsistency.update`` gathers them (its collectives
    only: the rows are not applied to a memory)."""
    finite = torch.isfinite(probs).all(dim=1)
    return gather_padded([indices, finite.long(), probs, targets], exchange_sizes(int(indices.numel())))


def _time_sync(rank: int, batch: int, num_classes: int, warmup: int, reps: int) -> float:
    gen = torch.Generator().manual_seed(1000 * rank + batch + num_classes)
    indices = torch.arange(rank * batch, (rank + 1) * batch, dtype=torch.long)  # disjoint, as a sampler gives
    probs = torch.softmax(torch.randn(batch, num_classes, generator=gen), dim=1)
    targets = torch.randint(0, num_classes, (batch,), generator=gen)
    for _ in range(warmup):
        out = exchange_predictions(indices, probs, targets)
    assert out[0].shape[0] == WORLD_SIZE * batch and out[2].shape == (WORLD_SIZE * batch, num_classes)
    times = []
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        exchange_predictions(indices, probs, targets)
        times.append(time.perf_counter() - start)
    return max_over_ranks(statistics.median(times))


def _time_step(batch: int, warmup: int, reps: int) -> float:
    torch.manual_seed(0)
    model = medmnist_resnet("resnet18", 1, 2)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(batch, 1, 28, 28)
    y = torch.randint(0, 2, (batch,))
    times = []
    for i in range(warmup + reps):
        dist.barrier()
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return max_over_ranks(statistics.median(times))


def _time_grad_allreduce(reps: int) -> tuple[float, int]:
    numel = sum(p.numel() for p in medmnist_resnet("resnet18", 1, 2).parameters())
    flat = torch.randn(numel)
    dist.all_reduce(flat)  # warm-up
    times = []
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(flat)
        times.append(time.perf_counter() - start)
    return max_over_ranks(statistics.median(times)), numel


def _worker(rank: int, port: int, cfg: dict) -> None:
    apply_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
    try:
        t0 = time.perf_counter()
        sync = {(b, c): _time_sync(rank, b, c, cfg["sync_warmup"], cfg["sync_reps"])
                for b in cfg["batches"] for c in cfg["classes"]}
        step = {}
        for b in cfg["batches"]:
            reps = cfg["step_reps"].get(b, 0)
            if reps:
                step[b] = (_time_step(b, cfg["step_warmup"].get(b, 0), reps), reps)
        grad_ms, numel = _time_grad_allreduce(cfg["grad_reps"])
        if rank == 0:
            _report(cfg, sync, step, grad_ms, numel, time.perf_counter() - t0)
    finally:
        dist.destroy_process_group()


def _report(cfg: dict, sync: dict, step: dict, grad_s: float, numel: int, elapsed: float) -> None:
    print(f"torch {torch.__version__}, {platform.machine()}, os.cpu_count()={os.cpu_count()}, backend gloo (CPU), "
          f"{WORLD_SIZE} processes on 127.0.0.1, torch.set_num_threads(1) in each worker")
    print(f"sync: median of {cfg['sync_reps']} exchanges of a step's predictions (exchange_sizes + gather_padded, "
          f"as TimeConsistency.update makes) after {cfg['sync_warmup']} warm-up, dist.barrier() before each, "
          "max over ranks")
    print("step: median local forward+backward+SGD step of medmnist_resnet('resnet18', 1, 2) at 28x28, "
          "both ranks at once, no gradient all-reduce; [reps, warm-up steps] per batch")
    header = (f"{'world':>5} {'batch':>6} {'classes':>7} {'bytes/rank/step':>15} {'recv/rank/step':>14} "
              f"{'sync ms':>9} {'step ms':>14} {'sync/step':>10}")
    print(header)
    print("-" * len(header))
    for (b, c), s in sync.items():
        sent = b * bytes_per_sample(c)
        recv = WORLD_SIZE * sent
        if b in step:
            st, reps = step[b]
            warm = cfg["step_warmup"].get(b, 0)
            step_txt, ratio_txt = f"{st * 1e3:>8.0f} [{reps},{warm}]", f"{s / st:>10.2e}"
        else:
            step_txt, ratio_txt = f"{'skipped':>14}", f"{'-':>10}"
        print(f"{WORLD_SIZE:>5} {b:>6} {c:>7} {sent:>15,d} {recv:>14,d} {s * 1e3:>9.3f} {step_txt:>14} {ratio_txt}")
    print(f"for scale: DDP's gradient all-reduce of ResNet-18 ({numel:,} float32 = {4 * numel / 1e6:.1f} MB) "
          f"takes {grad_s * 1e3:.1f} ms median ({cfg['grad_reps']} reps) on the same setup")
    print(f"measured in {elapsed:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller grid: batches 32, 128; classes 2, 10")
    args = parser.parse_args()
    if args.quick:
        cfg = {"batches": (32, 128), "classes": (2, 10), "sync_warmup": 5, "sync_reps": 30,
               "step_warmup": {32: 1}, "step_reps": {32: 3}, "grad_reps": 3}
    else:
        cfg = {"batches": (32, 128, 512), "classes": (2, 10, 100), "sync_warmup": 10, "sync_reps": 50,
               "step_warmup": {32: 1, 128: 1}, "step_reps": {32: 5, 128: 5, 512: 3}, "grad_reps": 5}
    mp.spawn(_worker, args=(free_port(), cfg), nprocs=WORLD_SIZE, join=True)


if __name__ == "__main__":
    main()
