"""What the TCS memory costs under data parallelism: its per-step exchange beside a training step, and its
memory and exchange per rank, replicated against sharded, as the world grows.

    python benchmarks/ddp_cost.py exchange [--quick]   # 2 processes; the full grid takes 2 to 3 minutes on 2 cores
    python benchmarks/ddp_cost.py memory [--quick]     # N = 1,281,167, C = 1000 (ImageNet-1k) on 1, 2, 4 processes

Every measure runs CPU processes of one gloo group on 127.0.0.1 (a free port), fresh ones for each world size,
each with ``torch.set_num_threads(1)`` so that they do not fight over the cores. Absolute numbers are gloo's on
the CPU; NCCL on GPUs differs.

exchange  2 processes. For each per-rank batch size (``--batches``) and number of classes (``--classes``):
          * sync: the median wall time of the exchange of one step's predictions, the collectives
            ``TimeConsistency.update`` makes once per training step (after ``training_step``, in
            ``LPA3Callback.on_train_batch_end``) before it applies the rows: one ``exchange_sizes`` and one
            ``gather_padded`` of (indices, finiteness, probabilities, targets); after warm-up exchanges, a
            ``dist.barrier()`` before each timed one, the larger of the two ranks' medians;
          * step: the median wall time of one local forward + backward + SGD step of
            ``medmnist_resnet("resnet18", 1, 2)`` at 28x28 on the same per-rank batch, both ranks stepping at
            once (a barrier before each), after one warm-up step (none from 512 rows on, and at most 3 timed
            steps there: a step of half a minute dwarfs the first call's overheads). DDP's gradient all-reduce is
            not part of it; it is timed on its own (one all-reduce of all ResNet-18 gradients) and printed below
            the table, for scale. The step does not depend on the number of classes (only the 512 x C head
            would), so it is measured once per batch size (``--quick``: at the smallest only).
          The ratio column is sync / step.
memory    For each world size (``--worlds``) and memory layout, every process builds the memory LPA3Callback
          builds (the stored predictions, the scores, the seen flags and the per-sample epoch of the last update)
          and runs the per-step update it makes after each training step (softmax, then
          ``TimeConsistency.update``, which exchanges the step's rows between the processes and applies them) on
          synthetic predictions: each step a fresh permutation of the data set gives every rank ``--batch``
          distinct indices, with randn logits. Reported per rank:
          * memory: bytes of those tensors (the replicated ones plus this rank's rows), and the process's peak
            resident set size (``ru_maxrss``, which includes torch itself: 0.7 GB for torch 2.14);
          * bytes received per step: the payload of the collectives (all-gather of sizes and rows; for the
            sharded memory also the all-to-all and the all-reduce, counted as a ring all-reduce moves it:
            2 (W-1)/W of the vector);
          * time per step: the median over ``--steps`` steps (after ``--warmup``, a barrier before each) of the
            whole update, exchange included; the largest over the ranks.
          The replicated memory is skipped where W copies would not fit in this machine's RAM (the table says
          so). A projection to 64 GPUs follows, from the formulas, with its assumptions printed.
"""

from __future__ import annotations

import argparse
import os
import platform
import queue
import resource
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import apply_threads, free_port, max_over_ranks  # noqa: E402
from lpa3_lightning.core.distributed import bytes_per_sample, exchange_sizes, gather_padded  # noqa: E402
from lpa3_lightning.core.tcs import STORAGE_DTYPES, TimeConsistency  # noqa: E402
from lpa3_lightning.core.tcs_shards import ShardedTimeConsistency, owned_rows  # noqa: E402

GB = 1e9
#: the world of the exchange measure
EXCHANGE_WORLD = 2
#: from this many rows a ResNet-18 step on one CPU thread takes half a minute: no warm-up step, at most 3 timed
LARGE_BATCH = 512
#: what the callback keeps per sample beside the stored predictions: score (float32), seen flag (bool) and the
#: epoch of the last update (int64)
PER_SAMPLE_BYTES = 4 + 1 + 8


# ---------------------------------------------------------------------------------------- the process group
def run_group(world: int, measure: Callable[[int, int, Any], Any], config: Any) -> list[Any]:
    """``measure(rank, world, config)`` on each rank of ``world`` fresh processes (a gloo group when there are
    several, one torch thread each); returns what each rank's call returned, by rank.

    Raises:
        RuntimeError: naming the world and the exit code, when a process fails.
    """
    port = free_port()
    context = mp.get_context("spawn")
    results = context.Queue()
    processes = [context.Process(target=_rank, args=(rank, world, port, measure, config, results))
                 for rank in range(world)]
    for process in processes:
        process.start()
    returned: dict[int, Any] = {}
    while len(returned) < world:
        try:
            rank, value = results.get(timeout=5)
            returned[rank] = value
        except queue.Empty:  # a process that died never puts its result: stop waiting for it
            failed = [p.exitcode for p in processes if p.exitcode not in (None, 0)]
            if failed:
                for process in processes:
                    process.kill()
                raise RuntimeError(f"world {world}: a process exited with {failed[0]}") from None
    for process in processes:
        process.join()
    return [returned[rank] for rank in range(world)]


def _rank(rank: int, world: int, port: int, measure: Callable[[int, int, Any], Any], config: Any,
          results: Any) -> None:
    """One process of :func:`run_group`: joins the group, runs its part, puts ``(rank, what it returned)``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    apply_threads(1)
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        results.put((rank, measure(rank, world, config)))
    finally:
        if world > 1:
            dist.destroy_process_group()


def _barrier(world: int) -> None:
    """``dist.barrier()`` when there is a group to wait for."""
    if world > 1:
        dist.barrier()


# ---------------------------------------------------------------------------------------- exchange
def exchange_predictions(indices: torch.Tensor, probs: torch.Tensor, targets: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's rows of one step, as ``TimeConsistency.update`` gathers them (its collectives only: the
    rows are not applied to a memory)."""
    finite = torch.isfinite(probs).all(dim=1)
    return gather_padded([indices, finite.long(), probs, targets], exchange_sizes(int(indices.numel())))


def _median_seconds(world: int, fn: Callable[[], Any], warmup: int, reps: int) -> float:
    """The median of ``reps`` timed calls of ``fn`` after ``warmup`` untimed ones, a barrier before each; the
    largest over the ranks."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        _barrier(world)
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return max_over_ranks(statistics.median(times))


def _exchange_seconds(rank: int, world: int, batch: int, num_classes: int, warmup: int, reps: int) -> float:
    """The median exchange of ``batch`` rows of ``num_classes`` predictions per rank (its shapes checked first)."""
    gen = torch.Generator().manual_seed(1000 * rank + batch + num_classes)
    indices = torch.arange(rank * batch, (rank + 1) * batch, dtype=torch.long)  # disjoint, as a sampler gives
    probs = torch.softmax(torch.randn(batch, num_classes, generator=gen), dim=1)
    targets = torch.randint(0, num_classes, (batch,), generator=gen)
    every = exchange_predictions(indices, probs, targets)
    assert every[0].shape[0] == world * batch and every[2].shape == (world * batch, num_classes)
    return _median_seconds(world, lambda: exchange_predictions(indices, probs, targets), warmup, reps)


def _resnet18() -> torch.nn.Module:
    """The MedMNIST ResNet-18 (1 channel, 2 classes); its module is imported here, so that the memory
    measure's processes do not hold torchvision in their resident size."""
    from lpa3_lightning.models import medmnist_resnet

    return medmnist_resnet("resnet18", 1, 2)


def _step_seconds(world: int, batch: int, reps: int) -> tuple[float, int, int]:
    """The median local ResNet-18 training step, with the warm-up steps and timed steps it took."""
    torch.manual_seed(0)
    model = _resnet18()
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(batch, 1, 28, 28)
    y = torch.randint(0, 2, (batch,))

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    warmup, reps = (0, min(reps, 3)) if batch >= LARGE_BATCH else (1, reps)
    return _median_seconds(world, step, warmup, reps), warmup, reps


def _grad_allreduce_seconds(world: int, reps: int) -> tuple[float, int]:
    """The median all-reduce of a flat vector of ResNet-18's parameter count, and that count."""
    numel = sum(p.numel() for p in _resnet18().parameters())
    flat = torch.randn(numel)
    return _median_seconds(world, lambda: dist.all_reduce(flat), 1, reps), numel


def measure_exchange(rank: int, world: int, cfg: dict) -> dict:
    """One rank's part of the exchange measure; every rank returns the same figures (maxima over the ranks)."""
    start = time.perf_counter()
    sync = {(b, c): _exchange_seconds(rank, world, b, c, cfg["reps"] // 5, cfg["reps"])
            for b in cfg["batches"] for c in cfg["classes"]}
    step = {b: _step_seconds(world, b, cfg["step_reps"]) for b in cfg["step_batches"]}
    grad, numel = _grad_allreduce_seconds(world, cfg["step_reps"])
    return {"sync": sync, "step": step, "grad": grad, "numel": numel, "seconds": time.perf_counter() - start}


def exchange_table(args: argparse.Namespace) -> None:
    """The ``exchange`` measure and its table."""
    batches = args.batches or ([32, 128] if args.quick else [32, 128, 512])
    cfg = {"batches": batches, "classes": args.classes or ([2, 10] if args.quick else [2, 10, 100]),
           "reps": 30 if args.quick else 50, "step_reps": 3 if args.quick else 5,
           "step_batches": [min(batches)] if args.quick else batches}
    figures = run_group(EXCHANGE_WORLD, measure_exchange, cfg)[0]
    print(f"torch {torch.__version__}, {platform.machine()}, os.cpu_count()={os.cpu_count()}, backend gloo (CPU), "
          f"{EXCHANGE_WORLD} processes on 127.0.0.1, torch.set_num_threads(1) in each")
    print(f"sync: median of {cfg['reps']} exchanges of a step's predictions (exchange_sizes + gather_padded, as "
          f"TimeConsistency.update makes) after {cfg['reps'] // 5} warm-up, dist.barrier() before each, max over ranks")
    print("step: median local forward+backward+SGD step of medmnist_resnet('resnet18', 1, 2) at 28x28, both ranks "
          "at once, no gradient all-reduce; [timed steps, warm-up steps] per batch")
    header = (f"{'world':>5} {'batch':>6} {'classes':>7} {'bytes/rank/step':>15} {'recv/rank/step':>14} "
              f"{'sync ms':>9} {'step ms':>14} {'sync/step':>10}")
    print(header)
    print("-" * len(header))
    for (b, c), sync in figures["sync"].items():
        sent = b * bytes_per_sample(c)
        if b in figures["step"]:
            step, warmup, reps = figures["step"][b]
            step_text, ratio_text = f"{step * 1e3:>8.0f} [{reps},{warmup}]", f"{sync / step:>10.2e}"
        else:
            step_text, ratio_text = f"{'skipped':>14}", f"{'-':>10}"
        print(f"{EXCHANGE_WORLD:>5} {b:>6} {c:>7} {sent:>15,d} {EXCHANGE_WORLD * sent:>14,d} {sync * 1e3:>9.3f} "
              f"{step_text:>14} {ratio_text}")
    numel = figures["numel"]
    print(f"for scale: DDP's gradient all-reduce of ResNet-18 ({numel:,} float32 = {4 * numel / 1e6:.1f} MB) takes "
          f"{figures['grad'] * 1e3:.1f} ms median ({cfg['step_reps']} reps) on the same setup")
    print(f"measured in {figures['seconds']:.0f} s")


# ---------------------------------------------------------------------------------------- memory
def memory_bytes(num_samples: int, num_classes: int, world: int, rank: int, layout: str, dtype_bytes: int) -> int:
    """Bytes one rank holds for the memory (formula, checked against the tensors in the workers)."""
    rows = num_samples if layout == "replicated" else owned_rows(num_samples, world, rank)
    return rows * num_classes * dtype_bytes + num_samples * PER_SAMPLE_BYTES


def received_bytes(world: int, batch: int, num_classes: int, layout: str, routed_rows: int) -> int:
    """Payload bytes one rank receives in one step's update exchange (its own share included)."""
    if world == 1:
        return 0
    sizes = 8 * world
    if layout == "replicated":  # all-gathers of index, finite flag, label (8 each, one int64 gather), probs (4C)
        return sizes + world * batch * bytes_per_sample(num_classes)
    facts = world * batch * 3 * 8  # index, finite flag, label as one int64 all-gather
    reduce = int(2 * (world - 1) / world * 4 * world * batch)  # ring all-reduce of the divergences
    return sizes + facts + routed_rows * 4 * num_classes + reduce


def measure_memory(rank: int, world: int, cfg: dict) -> tuple[int, int, float, int]:
    """One rank's memory in bytes, its peak resident size in bytes, the median update in seconds (the largest
    over the ranks) and the rows it owned in a step (mean; the batch for a replicated memory)."""
    n, c, b = cfg["num_samples"], cfg["num_classes"], cfg["batch"]
    layout = cfg["layout"]
    memory = (ShardedTimeConsistency(n, c, 0.5, num_shards=world, shard=rank, storage_dtype=cfg["dtype"])
              if layout == "sharded" else TimeConsistency(n, c, 0.5, storage_dtype=cfg["dtype"]))
    stored = memory.local_rows if layout == "sharded" else memory.memory
    held = sum(t.numel() * t.element_size() for t in (stored, memory.scores, memory.seen, memory.last_update_epoch))
    assert held == memory_bytes(n, c, world, rank, layout, STORAGE_DTYPES[cfg["dtype"]].itemsize)
    times, routed = [], []
    for step in range(cfg["warmup"] + cfg["steps"]):
        order = torch.randperm(n, generator=torch.Generator().manual_seed(step))[:world * b]
        indices = order[rank * b:(rank + 1) * b]
        logits = torch.randn(b, c, generator=torch.Generator().manual_seed(1000 + step))
        labels = torch.randint(0, c, (b,), generator=torch.Generator().manual_seed(2000 + step))
        routed.append(int((order % world == rank).sum()))  # the rows this rank owns this step
        _barrier(world)
        start = time.perf_counter()
        # the callback's update (NetworkRunner.finish: temperature 1, the labels a supervised module records);
        # a new epoch each step: every row is applied
        memory.update(indices, torch.softmax(logits.float(), dim=1), labels, epoch=step)
        if step >= cfg["warmup"]:
            times.append(time.perf_counter() - start)
    median = statistics.median(times)
    if world > 1:
        median = max_over_ranks(median)
    rows = int(statistics.mean(routed)) if layout == "sharded" else b
    return held, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, median, rows


def _ram_bytes() -> int:
    """This machine's physical memory."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def memory_table(args: argparse.Namespace) -> None:
    """The ``memory`` measure's table per world and layout, then the projection."""
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
            per_rank = memory_bytes(n, c, world, 0, layout, dtype_bytes)
            if world * per_rank > 0.7 * _ram_bytes():
                print(f"{world:>5} {layout:>10} {per_rank / GB:>15.3f} "
                      f"{'skipped: ' + format(world * per_rank / GB, '.1f') + ' GB for all ranks > 70% of RAM':>36}")
                continue
            cfg = {"num_samples": n, "num_classes": c, "batch": b, "dtype": args.dtype, "layout": layout,
                   "steps": args.steps, "warmup": args.warmup}
            ranks = run_group(world, measure_memory, cfg)
            held, rss, seconds = max(r[0] for r in ranks), max(r[1] for r in ranks), ranks[0][2]
            received = received_bytes(world, b, c, layout, max(r[3] for r in ranks))
            print(f"{world:>5} {layout:>10} {held / GB:>15.3f} {rss / GB:>12.2f} {received:>15,} "
                  f"{seconds * 1000:>8.2f}")
    print("\nProjection (formulas above; ImageNet-1k N = 1,281,167, C = 1000, 256 rows per GPU and step):")
    print(f"{'GPUs':>5} {'replicated GB/GPU':>18} {'sharded fp32 GB':>16} {'sharded bf16 GB':>16} "
          f"{'replicated recv MB':>19} {'sharded recv MB':>16}")
    for gpus in (8, 16, 32, 64):
        replicated = memory_bytes(1_281_167, 1000, gpus, 0, "replicated", 4) / GB
        sharded32 = memory_bytes(1_281_167, 1000, gpus, 0, "sharded", 4) / GB
        sharded16 = memory_bytes(1_281_167, 1000, gpus, 0, "sharded", 2) / GB
        received_replicated = received_bytes(gpus, 256, 1000, "replicated", 256) / 1e6
        received_sharded = received_bytes(gpus, 256, 1000, "sharded", 256) / 1e6  # on average each rank owns 256 rows
        print(f"{gpus:>5} {replicated:>18.2f} {sharded32:>16.3f} {sharded16:>16.3f} {received_replicated:>19.1f} "
              f"{received_sharded:>16.2f}")


# ---------------------------------------------------------------------------------------- the command line
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog="Each measure's --help says more.")
    measures = parser.add_subparsers(dest="measure", required=True, metavar="MEASURE")

    exchange_parser = measures.add_parser("exchange", help="2 processes: the exchange of a step's predictions beside "
                                          "a ResNet-18 step and DDP's gradient all-reduce")
    exchange_parser.add_argument("--quick", action="store_true",
                                 help="smaller grid: batches 32, 128; classes 2, 10; the step at batch 32 only")
    exchange_parser.add_argument("--batches", nargs="+", type=int, default=None,
                                 help="rows per rank and step (default 32 128 512)")
    exchange_parser.add_argument("--classes", nargs="+", type=int, default=None, help="classes (default 2 10 100)")
    exchange_parser.set_defaults(run=exchange_table)

    memory_parser = measures.add_parser("memory", help="memory and exchange per rank of the replicated and the "
                                        "sharded memory, on 1, 2, 4 processes")
    memory_parser.add_argument("--num-samples", type=int, default=1_281_167)
    memory_parser.add_argument("--num-classes", type=int, default=1000)
    memory_parser.add_argument("--batch", type=int, default=256, help="rows per rank and step")
    memory_parser.add_argument("--worlds", default="1,2,4")
    memory_parser.add_argument("--dtype", default="float32", choices=sorted(STORAGE_DTYPES))
    memory_parser.add_argument("--steps", type=int, default=20)
    memory_parser.add_argument("--warmup", type=int, default=3)
    memory_parser.add_argument("--quick", action="store_true", help="N = 100,000, C = 100, 10 steps")
    memory_parser.set_defaults(run=memory_table)

    args = parser.parse_args(argv)
    args.run(args)


if __name__ == "__main__":
    main()
