"""The TCS memory past one machine: memory per rank and per-step exchange, replicated vs sharded.

    python benchmarks/shard_scale.py            # N = 1,281,167, C = 1000 (ImageNet-1k), 1/2/4 processes
    python benchmarks/shard_scale.py --quick    # N = 100,000, C = 100 (well under a minute)

For each world size (CPU processes over gloo on 127.0.0.1, ``torch.set_num_threads(1)`` each)
and memory layout, every process builds the memory LPA3Callback builds (the stored predictions,
the scores, the seen flags, and the per-sample epoch of the last update) and runs the per-step
update it makes after each training step (softmax, then ``TimeConsistency.update``, which
exchanges the step's rows between the processes and applies them), on synthetic predictions:
each step a fresh permutation of the data set gives every rank ``--batch`` distinct indices,
with randn logits. Reported per rank:

* memory: bytes of those tensors (the replicated ones plus this rank's rows), and the process's
  peak resident set size (``ru_maxrss``, which includes torch itself, about 0.3-0.4 GB);
* bytes received per step: the payload of the collectives (all-gather of sizes and rows; for the
  sharded memory also the all-to-all and the all-reduce, counted as a ring all-reduce moves it:
  2 (W-1)/W of the vector);
* time per step: the median over ``--steps`` steps (after ``--warmup``, a barrier before each) of
  the whole update, exchange included; the largest over the ranks.

The replicated memory is skipped where W copies would not fit in this machine's RAM (say so in
the table). A projection to 64 GPUs follows, from the formulas, with its assumptions printed.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import apply_threads, free_port, max_over_ranks  # noqa: E402
from lpa3_lightning.core.distributed import bytes_per_sample  # noqa: E402
from lpa3_lightning.core.shard_exchange import owned_rows  # noqa: E402
from lpa3_lightning.core.tcs import STORAGE_DTYPES, TimeConsistency  # noqa: E402
from lpa3_lightning.core.tcs_shards import ShardedTimeConsistency  # noqa: E402

GB = 1e9
#: what the callback keeps per sample beside the stored predictions: score (float32), seen flag
#: (bool) and the epoch of the last update (int64)
PER_SAMPLE_BYTES = 4 + 1 + 8


def memory_bytes(num_samples: int, num_classes: int, world: int, rank: int, layout: str, dtype_bytes: int) -> int:
    """Bytes one rank holds for the memory (formula, checked against the tensors in the workers)."""
    rows = num_samples if layout == "replicated" else owned_rows(num_samples, world, rank)
    return rows * num_classes * dtype_bytes + num_samples * PER_SAMPLE_BYTES


def received_bytes(world: int, batch: int, num_classes: int, layout: str, routed_rows: int) -> int:
    """Payload bytes one rank receives in one step's update exchange (its own share included)."""
    sizes = 8 * world
    if world == 1:
        return 0
    if layout == "replicated":  # all-gathers of index, finite flag, label (8 each, one int64 gather), probs (4C)
        return sizes + world * batch * bytes_per_sample(num_classes)
    facts = world * batch * 3 * 8  # index, finite flag, label as one int64 all-gather
    reduce = int(2 * (world - 1) / world * 4 * world * batch)  # ring all-reduce of the divergences
    return sizes + facts + routed_rows * 4 * num_classes + reduce


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, layout: str, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    apply_threads(1)
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    n, c, b = args.num_samples, args.num_classes, args.batch
    kwargs = {"storage_dtype": args.dtype}
    memory = (ShardedTimeConsistency(n, c, 0.5, num_shards=world, shard=rank, **kwargs) if layout == "sharded"
              else TimeConsistency(n, c, 0.5, **kwargs))
    stored = memory.local_rows if layout == "sharded" else memory.memory
    held = sum(t.numel() * t.element_size() for t in (stored, memory.scores, memory.seen, memory.last_update_epoch))
    assert held == memory_bytes(n, c, world, rank, layout, STORAGE_DTYPES[args.dtype].itemsize)
    times, routed = [], []
    for step in range(args.warmup + args.steps):
        order = torch.randperm(n, generator=torch.Generator().manual_seed(step))[:world * b]
        indices = order[rank * b:(rank + 1) * b]
        logits = torch.randn(b, c, generator=torch.Generator().manual_seed(1000 + step))
        labels = torch.randint(0, c, (b,), generator=torch.Generator().manual_seed(2000 + step))
        routed.append(int((order % world == rank).sum()))  # the rows this rank owns this step
        if world > 1:
            dist.barrier()
        start = time.perf_counter()
        # the callback's update (NetworkRunner.finish: temperature 1, the labels a supervised module
        # records, the default path's checks); a new epoch each step: every row is applied
        memory.update(indices, torch.softmax(logits.float(), dim=1), labels, epoch=step, check_values=True)
        elapsed = time.perf_counter() - start
        if step >= args.warmup:
            times.append(elapsed)
    median = statistics.median(times)
    if world > 1:
        median = max_over_ranks(median)
        dist.destroy_process_group()
    rows = int(statistics.mean(routed)) if layout == "sharded" else b
    queue.put((rank, held, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, median, rows))


def _measure(world: int, args: argparse.Namespace, layout: str) -> list[tuple]:
    port = free_port()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, world, port, args, layout, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = sorted(queue.get() for _ in procs)
    for p in procs:
        p.join()
        if p.exitcode != 0:
            raise RuntimeError(f"world {world} {layout}: a worker exited with {p.exitcode}")
    return results


def _ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-samples", type=int, default=1_281_167)
    parser.add_argument("--num-classes", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=256, help="rows per rank and step")
    parser.add_argument("--worlds", default="1,2,4")
    parser.add_argument("--dtype", default="float32", choices=sorted(STORAGE_DTYPES))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="N = 100,000, C = 100, 10 steps")
    args = parser.parse_args()
    if args.quick:
        args.num_samples, args.num_classes, args.steps = 100_000, 100, 10
    n, c, b = args.num_samples, args.num_classes, args.batch
    dtype_bytes = STORAGE_DTYPES[args.dtype].itemsize
    print(f"{time.strftime('%Y-%m-%d')}, {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"{_ram_bytes() / GB:.0f} GB RAM, torch {torch.__version__}, gloo on 127.0.0.1, 1 thread per process")
    print(f"N = {n:,} samples, C = {c} classes, {args.dtype} storage, {b} rows per rank and step; "
          f"median of {args.steps} steps after {args.warmup}")
    print(f"{'world':>5} {'layout':>10} {'memory/rank GB':>15} {'peak RSS GB':>12} {'recv/rank/step':>15} "
          f"{'ms/step':>8}")
    for world in (int(w) for w in args.worlds.split(",")):
        for layout in ("replicated", "sharded"):
            need = world * memory_bytes(n, c, world, 0, layout, dtype_bytes)
            if need > 0.7 * _ram_bytes():
                print(f"{world:>5} {layout:>10} {memory_bytes(n, c, world, 0, layout, dtype_bytes) / GB:>15.3f} "
                      f"{'skipped: ' + format(need / GB, '.1f') + ' GB for all ranks > 70% of RAM':>36}")
                continue
            results = _measure(world, args, layout)
            held = max(r[1] for r in results)
            rss = max(r[2] for r in results)
            routed = max(r[4] for r in results)
            recv = received_bytes(world, b, c, layout, routed)
            print(f"{world:>5} {layout:>10} {held / GB:>15.3f} {rss / GB:>12.2f} {recv:>15,} "
                  f"{results[0][3] * 1000:>8.2f}")
    print("\nProjection (formulas above; ImageNet-1k N = 1,281,167, C = 1000, 256 rows per GPU and step):")
    print(f"{'GPUs':>5} {'replicated GB/GPU':>18} {'sharded fp32 GB':>16} {'sharded bf16 GB':>16} "
          f"{'replicated recv MB':>19} {'sharded recv MB':>16}")
    for gpus in (8, 16, 32, 64):
        rep = memory_bytes(1_281_167, 1000, gpus, 0, "replicated", 4) / GB
        s32 = memory_bytes(1_281_167, 1000, gpus, 0, "sharded", 4) / GB
        s16 = memory_bytes(1_281_167, 1000, gpus, 0, "sharded", 2) / GB
        r_rep = received_bytes(gpus, 256, 1000, "replicated", 256) / 1e6
        r_sh = received_bytes(gpus, 256, 1000, "sharded", 256) / 1e6  # on average each rank owns 256 rows
        print(f"{gpus:>5} {rep:>18.2f} {s32:>16.3f} {s16:>16.3f} {r_rep:>19.1f} {r_sh:>16.2f}")


if __name__ == "__main__":
    main()
