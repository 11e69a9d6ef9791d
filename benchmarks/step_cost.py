"""What LP-A3 costs a supervised training step: step-time ratios, a profile, host reads, the logging's share.

    python benchmarks/step_cost.py ratios  [--epochs 3] [--configs ...] [--repeats 1] [--accelerator gpu] [--json PATH]
    python benchmarks/step_cost.py profile [--steps 4] [--warm-steps 0] [--stack] [--accelerator gpu] [--json PATH]
    python benchmarks/step_cost.py reads   [--solver-steps 5] [--sites 30] [--json PATH]
    python benchmarks/step_cost.py logging [--repeats 4] [--epochs 3] [--accelerator gpu] [--json PATH]

Every measure trains ``LPA3Classifier`` (ResNet-18 with the MedMNIST 28 px stem; ``--arch small_cnn`` checks the
script quickly and is no figure) on the embedded BreastMNIST train split (546 images, 2 classes) with Adam and
``LPA3Callback(ratio=--ratio, steps=--solver-steps)``, batch ``--batch`` (128); each takes ``--threads`` and
``--json PATH`` (its result as one JSON file).

ratios   One process per configuration (so peak memory is per configuration), ratio 0.5 (the MedMNIST table's):
           baseline             LPA3Classifier without the callback (no twin BN)
           lpa3                 + LPA3Callback, the default solver
           lpa3_null            augment="null": the selected rows trained as x' = x (the extra loss term, no solver)
           lpa3_noise           augment="noise": the selected rows moved by Gaussian noise of lpa3's mean
                                lpa3/input_distance (``--noise-norm`` gives another; without it lpa3 runs too)
           lpa3_log_every_step  lpa3 with its diagnostics measured on every step (logging.every_n_steps=1; the
                                default measures the Trainer's logging steps and each epoch's first, 1 in 5 here)
           lpa3_fast            solver.fast=True
           lpa3_cached          cache.regenerate_every_n_epochs=10
           lpa3_cached_lazy     the same with cache.attack_new_selections=False (the solver in regeneration
                                epochs only)
         Epoch 0 is every LP-A3 run's warm-up (warmup_epochs=1: the memory fills, nothing is solved), so the
         measured epochs 1.. select as in steady state. Prints per configuration the median and mean step of the
         measured epochs, the median epoch and the peak memory, each also over the baseline's; for the cached
         ones the amortized epoch with K=10 ((regeneration epoch + 9 x the mean reuse epoch) / 10) and the share
         of x' the cache gave; and the floors: the baseline step + ``--solver-steps`` x (forward + input-gradient
         backward) on the selected rows + one training pass on x' for the solving configurations, the baseline
         step + that training pass for the controls. ``--repeats`` runs every configuration that many times, in
         turn, and reports the medians. On a GPU steps are timed between device synchronisations and peak memory
         is the GPU's peak allocation; on the CPU the peak resident size less the process's before the fit.
profile  torch.profiler over ``--steps`` steady LP-A3 steps (ratio 0.3). The train split is repeated to
         batch x (--warm-steps + --steps) rows (each its own dataset index), so that one epoch holds every
         profiled step: epoch 0 is the warm-up, in epoch 1 the first --warm-steps run unprofiled. Printed and
         written per step, in ms: the wall time (with the profiler's own overhead, large with --stack: where the
         time goes, not what a step costs), self CPU time by operator (top --rows, with calls) and, with
         ``--stack`` (the profiler's Python tracer), by Python function, and the five largest host places; on a
         GPU also self CUDA time by operator. Counted per step: kernel launches, cudaMalloc / cudaFree calls,
         synchronisations by call (less the one closing the window), host-to-device and device-to-host copies
         with their bytes, the GPU's busy time, and the peak GPU memory (on the CPU the CUDA counts are 0).
reads    On a GPU every read of a tensor's value on the host (.item(), bool()/int()/float() of a tensor,
         .tolist(), nonzero(), a boolean-mask index, whose result size depends on the data) waits for the
         device. Counted on the CPU, where they happen at the same places, with tests.helpers.HostReadCounter
         over one training step (the first of epoch 1, the callback's hooks around it included), without the
         callback and with it (ratio 0.3, no warm-up), beside the operators the step dispatches (profiler
         events), and each LP-A3 read's call site in the package.
logging  One process fits the same LP-A3 run (ratio 0.3, epoch 0 a warm-up) with logging.every_n_steps=1 (every
         step measured: the eval-mode forward of lpa3/label_preserved_eval, the solver's timer, the logged values
         read back) and with the default (the Trainer's log_every_n_steps, 50, and each epoch's first step),
         --repeats times each in the order A B B A A B ..., so that a slow spell of the machine or a drift over
         the process's life touches both alike (between processes the spread, 10% in ratios' medians on a shared
         2-core machine, exceeds this effect). Prints the mean and median step of the measured epochs per setting
         and their ratio.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import resource
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.harness import (  # noqa: E402
    ProfiledSteps,
    StepTimer,
    apply_threads,
    cuda_activity,
    device_label,
    median_seconds,
    on_gpu,
    run_arguments,
    run_worker,
    write_result,
)

CONFIGS = ("baseline", "lpa3", "lpa3_null", "lpa3_noise", "lpa3_log_every_step", "lpa3_fast", "lpa3_cached",
           "lpa3_cached_lazy")
#: each LP-A3 configuration's LPA3Callback arguments beside ratio, steps, warmup_epochs and seed
CALLBACK_ARGUMENTS: dict[str, dict[str, Any]] = {
    "lpa3": {},
    "lpa3_null": {"augment": "null"},
    "lpa3_noise": {"augment": "noise"},  # its noise_norm comes with the run
    "lpa3_log_every_step": {"logging": {"every_n_steps": 1}},
    "lpa3_fast": {"solver": {"fast": True}},
    "lpa3_cached": {"cache": {"regenerate_every_n_epochs": 10}},
    "lpa3_cached_lazy": {"cache": {"regenerate_every_n_epochs": 10, "attack_new_selections": False}},
}
#: the controls: x' made without the solver, trained as LP-A3 trains them
CONTROLS = ("lpa3_null", "lpa3_noise")
#: Python frames of the profiling itself, left out of the profile's ranking
OWN_FRAMES = ("torch/profiler/", "torch/autograd/profiler", "benchmarks/harness.py(", "benchmarks/callbacks.py(")


# ---------------------------------------------------------------------------------------- shared by the measures
def _module(arch: str, twin_bn: bool = True) -> Any:
    """LPA3Classifier for BreastMNIST's 2 classes: ResNet-18 (its 28 px stem) or the package's small CNN."""
    from lpa3_lightning import LPA3Classifier
    from lpa3_lightning.models.small_cnn import small_cnn

    model = small_cnn(in_channels=1, num_classes=2) if arch == "small_cnn" else None
    return LPA3Classifier(arch="resnet18", in_channels=1, num_classes=2, twin_bn=twin_bn, model=model)


def _trainer(epochs: int, accelerator: str, callbacks: list) -> Any:
    """A Trainer that trains and does nothing else: no validation, checkpoint, logger or progress bar."""
    import lightning.pytorch as pl

    return pl.Trainer(max_epochs=epochs, accelerator=accelerator, devices=1, callbacks=callbacks, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      limit_val_batches=0, num_sanity_val_steps=0)


def _breastmnist(batch: int) -> Any:
    """The embedded BreastMNIST data module (the package ships its 28 px split)."""
    from lpa3_lightning.data import MedMNISTDataModule

    return MedMNISTDataModule("breastmnist", batch_size=batch)


def _peak_rss_mb() -> float:
    """This process's peak resident size so far, in MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


# ---------------------------------------------------------------------------------------- ratios
def ratios_worker(args: argparse.Namespace) -> dict:
    """One configuration's fit, in a process of its own: its step and epoch times, peak memory and mean
    ``lpa3/input_distance``; for lpa3 also the parts of the floor."""
    import lightning.pytorch as pl
    import torch

    from lpa3_lightning import LPA3Callback

    config = args.worker
    pl.seed_everything(0)
    rss_before = _peak_rss_mb()  # imports and data, no model yet
    timer = StepTimer()
    callbacks: list = [timer]
    if config != "baseline":
        extra = dict(CALLBACK_ARGUMENTS[config])
        if config == "lpa3_noise":
            extra["noise_norm"] = args.noise_norm
        callbacks.append(LPA3Callback(ratio=args.ratio, steps=args.solver_steps, warmup_epochs=1, seed=0, **extra))
    module = _module(args.arch, twin_bn=config != "baseline")
    trainer = _trainer(args.epochs, args.accelerator, callbacks)
    trainer.fit(module, datamodule=_breastmnist(args.batch))
    measured = [e for e in timer.steps if e >= 1]
    steps = [t for e in measured for t in timer.steps[e]]
    device = trainer.strategy.root_device  # the fit's device (teardown moved the module back to the CPU)
    gpu = device.type == "cuda"
    distance = trainer.callback_metrics.get("lpa3/input_distance_epoch")  # the last epoch's mean
    result = {
        "step_s": statistics.median(steps),
        "mean_step_s": statistics.mean(steps),
        "epochs_s": {e: timer.epochs[e] for e in measured},
        "reused": timer.reused,
        "input_distance": None if distance is None else float(distance),
        "device": torch.cuda.get_device_name(device) if gpu else "cpu",
        "peak_mb": torch.cuda.max_memory_allocated(device) / 2**20 if gpu else _peak_rss_mb() - rss_before,
    }
    if config == "lpa3":
        result["attack_s"], result["x_adv_pass_s"] = _floor_parts(module.to(device), args)
        result["steps_per_epoch"] = len(timer.steps[measured[0]])
    return result


def _floor_parts(module: Any, args: argparse.Namespace) -> tuple[float, float]:
    """The least LP-A3 adds to a step beside the baseline step, in two parts, on the selected share of a
    batch: ``--solver-steps`` x (forward + backward to the input), and one twin-BN training pass of x'."""
    import torch

    from lpa3_lightning.core.dual_bn import use_twin_bn

    model, device = module.model, module.device
    selected = int(args.ratio * args.batch)
    x = torch.randn(selected, 1, 28, 28, device=device)
    y = torch.randint(0, 2, (selected,), device=device)

    def input_gradient() -> None:
        model.eval()
        inputs = x.clone().requires_grad_(True)
        torch.autograd.grad(model(inputs).logsumexp(1).sum(), inputs)

    def x_prime_pass() -> None:
        model.train()
        model.zero_grad()
        with use_twin_bn(model):
            torch.nn.functional.cross_entropy(model(x), y).backward()

    attack = args.solver_steps * median_seconds(input_gradient, device)
    x_prime = median_seconds(x_prime_pass, device)
    model.zero_grad(set_to_none=True)
    return attack, x_prime


def _ratios_command(args: argparse.Namespace, config: str, noise_norm: float | None) -> list[str]:
    """The worker process of one configuration, with this run's settings (``noise_norm``: lpa3_noise's)."""
    epochs = args.cached_epochs if config.startswith("lpa3_cached") and args.cached_epochs else args.epochs
    command = [sys.executable, __file__, "ratios", "--worker", config, "--epochs", str(epochs), "--accelerator",
               args.accelerator, "--ratio", str(args.ratio), "--batch", str(args.batch), "--arch", args.arch,
               "--solver-steps", str(args.solver_steps)]
    if args.threads:
        command += ["--threads", str(args.threads)]
    if noise_norm is not None:
        command += ["--noise-norm", str(noise_norm)]
    return command


def _median_of(runs: list[dict]) -> dict:
    """One configuration's result over its repeats: the median of each time and memory figure."""
    merged = dict(runs[0])
    for key in ("step_s", "mean_step_s", "peak_mb", "attack_s", "x_adv_pass_s"):
        if key in merged:
            merged[key] = statistics.median(r[key] for r in runs)
    merged["epochs_s"] = {e: statistics.median(r["epochs_s"][e] for r in runs) for e in runs[0]["epochs_s"]}
    merged["repeats"] = len(runs)
    return merged


def ratios(args: argparse.Namespace) -> None:
    """The ``ratios`` measure: each configuration in its own process (``--worker``), then the table and floors."""
    if args.epochs < 2:
        sys.exit("--epochs must be at least 2: epoch 0 is the warm-up")
    if args.worker:
        print(json.dumps(ratios_worker(args)))
        return
    import torch

    configs = ["baseline"] + [c for c in CONFIGS[1:] if c in args.configs]
    if "lpa3_noise" in configs and args.noise_norm is None and "lpa3" not in configs:
        configs.insert(1, "lpa3")  # the noise's norm is lpa3's input distance
    where = device_label(args.accelerator)
    print(f"torch {torch.__version__}, {where}; {args.arch} 28x28, batch {args.batch}, ratio {args.ratio}, BreastMNIST "
          f"train (546), epochs 1..{args.epochs - 1} measured, one process per configuration")
    runs: dict[str, list[dict]] = {c: [] for c in configs}
    for repeat in range(args.repeats):  # in turn: a slow spell of the machine touches every configuration
        for config in configs:
            noise_norm = None
            if config == "lpa3_noise":
                # this round's lpa3 distance (lpa3 runs before), unless one is given
                noise_norm = runs["lpa3"][-1]["input_distance"] if args.noise_norm is None else args.noise_norm
                if noise_norm is None or not noise_norm > 0:
                    sys.exit(f"lpa3 measured no input distance ({noise_norm}) for lpa3_noise: give --noise-norm")
            result = run_worker(_ratios_command(args, config, noise_norm), config)
            result["epochs_s"] = {int(k): v for k, v in result["epochs_s"].items()}  # JSON made the keys strings
            result["run"], result["noise_norm"] = repeat + 1, noise_norm
            print(f"{config}: {json.dumps(result)}", flush=True)  # kept in the log should a time limit stop the run
            runs[config].append(result)
    results = {config: _median_of(rs) for config, rs in runs.items()}
    if args.json:
        write_result(args.json, {"script": "step_cost", "measure": "ratios", "torch": torch.__version__, "where": where,
                                 "arch": args.arch, "batch": args.batch, "ratio": args.ratio, "results": results})
    _print_ratios(args, results)


def _print_ratios(args: argparse.Namespace, results: dict[str, dict]) -> None:
    """The table of every configuration against the baseline, the cached ones' amortized epochs, the floors."""
    base = results["baseline"]
    base_epoch = statistics.median(base["epochs_s"].values())
    print("peak MB = peak GPU memory allocated" if on_gpu(args.accelerator) else
          "peak MB = peak resident memory of the process less its size before the fit (the training's own)")
    print(f"{'config':20} {'step s':>8} {'x base':>7} {'mean s':>8} {'x base':>7} {'epoch s':>8} {'x base':>7} "
          f"{'peak MB':>8} {'x base':>7}")
    for config, r in results.items():
        epoch = statistics.median(r["epochs_s"].values())
        print(f"{config:20} {r['step_s']:8.3f} {r['step_s'] / base['step_s']:6.2f}x {r['mean_step_s']:8.3f} "
              f"{r['mean_step_s'] / base['mean_step_s']:6.2f}x {epoch:8.2f} {epoch / base_epoch:6.2f}x "
              f"{r['peak_mb']:8.0f} {r['peak_mb'] / base['peak_mb']:6.2f}x")
    lp = results.get("lpa3")
    # the amortized epoch's floor: the baseline epoch, a training pass on x' every step, and the solver's
    # passes once every K = 10 epochs
    floor_epoch = None if lp is None else \
        base_epoch + lp["steps_per_epoch"] * (lp["x_adv_pass_s"] + lp["attack_s"] / 10)
    for config in [c for c in ("lpa3_cached", "lpa3_cached_lazy") if c in results]:
        cached = results[config]["epochs_s"]
        window = sorted(cached)[:10]  # one K=10 window: the regeneration epoch and the reuse epochs after it
        regen, reuse = cached[window[0]], [cached[e] for e in window[1:]]
        if not reuse:
            print(f"{config}: regeneration epoch {regen:.2f} s, no reuse epoch measured (--cached-epochs 3 or more)")
            continue
        # measured over every reuse epoch the run has; extrapolated to 9 only when fewer were run
        amortized = (regen + 9 * statistics.mean(reuse)) / 10
        shares = [results[config]["reused"].get(str(e), float("nan")) for e in window[1:]]
        print(f"{config}: regeneration epoch {regen:.2f} s, {len(reuse)} reuse epochs mean "
              f"{statistics.mean(reuse):.2f} s (min {min(reuse):.2f}, max {max(reuse):.2f}; x' from the cache "
              f"{min(shares):.0%} to {max(shares):.0%}) -> amortized over K=10: {amortized:.2f} s = "
              f"{amortized / base_epoch:.2f}x baseline epoch"
              + ("" if len(reuse) >= 9 else f" (extrapolated from {len(reuse)} reuse epochs: --cached-epochs 11)")
              + ("" if floor_epoch is None else f"; its floor {floor_epoch:.2f} s ({floor_epoch / base_epoch:.2f}x "
                 f"baseline): amortized / floor {amortized / floor_epoch:.2f}x"))
    if lp is None:
        return
    training_floor = base["step_s"] + lp["x_adv_pass_s"]
    floor = training_floor + lp["attack_s"]
    print(f"floor per step: the baseline step {base['step_s']:.3f} s + {args.solver_steps} x (forward + input-gradient "
          f"backward) on {int(args.ratio * args.batch)} selected rows {lp['attack_s']:.3f} s + one training pass on x' "
          f"{lp['x_adv_pass_s']:.3f} s = {floor:.3f} s ({floor / base['step_s']:.2f}x the baseline step)")
    for config in [c for c in ("lpa3", "lpa3_log_every_step", "lpa3_fast") if c in results]:
        print(f"{config}: step {results[config]['step_s'] / floor:.2f}x the floor")
    for config in [c for c in CONTROLS if c in results]:
        r = results[config]
        print(f"{config}: step {r['step_s'] / lp['step_s']:.2f}x lpa3's, {r['step_s'] / training_floor:.2f}x its floor "
              f"(the baseline step + the training pass on x', {training_floor:.3f} s)")


# ---------------------------------------------------------------------------------------- profile
def _repeated_train_split(rows: int) -> tuple[Any, Any]:
    """BreastMNIST's train images and labels repeated to ``rows`` rows, with indices 0..rows-1, and its
    normalization (the solver's input box)."""
    import torch
    from torch.utils.data import TensorDataset

    data = _breastmnist(batch=1)
    data.setup("fit")
    items = [data.train_dataset[i] for i in range(len(data.train_dataset))]
    x = torch.stack([item[0] for item in items])
    y = torch.stack([torch.as_tensor(item[1]) for item in items])
    repeat = torch.arange(rows) % len(items)
    return TensorDataset(x[repeat], y[repeat], torch.arange(rows)), data.normalization


def host_places(events: Any, steps: int, rows: int) -> dict:
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
            if not any(frame in e.name for frame in OWN_FRAMES):
                by_function[re.sub(r" at 0x[0-9a-f]+", "", e.name)] += e.self_cpu_time_total  # one key per built-in
        else:
            by_operator[e.name] += e.self_cpu_time_total
            calls[e.name] += 1

    def top(table: dict[str, float]) -> dict[str, float]:
        return {k: v / steps / 1000 for k, v in sorted(table.items(), key=lambda kv: kv[1], reverse=True)[:rows]}

    operators, functions = top(by_operator), top(by_function)
    places = sorted([(ms, "operator", name) for name, ms in operators.items()]
                    + [(ms, "python", name) for name, ms in functions.items()], reverse=True)[:5]
    return {
        "host_self_ms_per_step": (sum(by_operator.values()) + sum(by_function.values())) / steps / 1000,
        "operators_per_step": sum(calls.values()) / steps,
        "self_cpu_ms_per_step_by_operator": operators,
        "calls_per_step_by_operator": {name: calls[name] / steps for name in operators},
        "self_cpu_ms_per_step_by_python_function": functions if traced else None,
        "top_host_places": [{"kind": kind, "name": name, "ms_per_step": ms} for ms, kind, name in places],
    }


def profile_steps(args: argparse.Namespace) -> None:
    """The ``profile`` measure."""
    if args.steps < 1 or args.warm_steps < 0:
        sys.exit("--steps must be >= 1 and --warm-steps >= 0")
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader

    from lpa3_lightning import LPA3Callback

    pl.seed_everything(0)
    dataset, normalization = _repeated_train_split(args.batch * (args.warm_steps + args.steps))
    loader = DataLoader(dataset, batch_size=args.batch, shuffle=True, drop_last=True,
                        generator=torch.Generator().manual_seed(0))
    profiled = ProfiledSteps(epoch=1, steps=args.steps, first_batch=args.warm_steps, with_stack=args.stack)
    lpa3 = LPA3Callback(ratio=args.ratio, steps=args.solver_steps, warmup_epochs=1, seed=0, input_range=normalization,
                        solver={"fast": args.fast})
    trainer = _trainer(2, args.accelerator, [profiled, lpa3])  # the window first: it holds whole steps
    trainer.fit(_module(args.arch), train_dataloaders=loader)
    if profiled.count == 0:
        sys.exit("no step was profiled")
    n = profiled.count
    device = trainer.strategy.root_device
    events = profiled.prof.events()
    activity = cuda_activity(events)
    syncs = activity["synchronisations_by_call"]
    if "cudaDeviceSynchronize" in syncs:  # less the one closing the window
        syncs["cudaDeviceSynchronize"] -= 1
        activity["synchronisations"] -= 1
    copies = activity["copies"]
    gpu_ops = None
    if device.type == "cuda":
        averages = sorted(profiled.prof.key_averages(), key=lambda e: e.self_device_time_total, reverse=True)
        gpu_ops = {e.key: e.self_device_time_total / n / 1000 for e in averages[:args.rows]}
    result = {
        "script": "step_cost", "measure": "profile", "torch": torch.__version__,
        "device": device_label(args.accelerator), "arch": args.arch, "batch": args.batch, "ratio": args.ratio,
        "solver_steps": args.solver_steps, "fast": args.fast, "with_stack": args.stack, "steps": n,
        "wall_ms_per_step": profiled.seconds / n * 1000,
        **host_places(events, n, args.rows),
        "self_cuda_ms_per_step_by_operator": gpu_ops,
        "kernel_launches_per_step": activity["kernel_launches"] / n,
        "cuda_malloc_per_step": activity["cuda_malloc"] / n,
        "cuda_free_per_step": activity["cuda_free"] / n,
        "syncs_per_step": activity["synchronisations"] / n,
        "syncs_per_step_by_call": {k: v / n for k, v in syncs.items()},
        "h2d_per_step": copies["h2d"]["count"] / n,
        "h2d_bytes_per_step": None if copies["h2d"]["bytes"] is None else copies["h2d"]["bytes"] / n,
        "d2h_per_step": copies["d2h"]["count"] / n,
        "d2h_bytes_per_step": None if copies["d2h"]["bytes"] is None else copies["d2h"]["bytes"] / n,
        "gpu_busy_ms_per_step": activity["gpu_busy_us"] / n / 1000,
        "peak_mb": torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None,
    }
    print(f"torch {torch.__version__}, {result['device']}; {args.arch}, batch {args.batch}, ratio {args.ratio}, "
          f"{args.solver_steps} solver steps{', fast' if args.fast else ''}; {n} steady LP-A3 steps profiled"
          f"{' with the Python tracer' if args.stack else ''}")
    print(f"self CPU ms per step by operator (top {args.rows}):")
    for name, ms in result["self_cpu_ms_per_step_by_operator"].items():
        print(f"  {ms:8.2f}  {result['calls_per_step_by_operator'][name]:7.1f} calls  {name}")
    for title, table in ((f"self CPU ms per step by Python function (top {args.rows}):",
                          result["self_cpu_ms_per_step_by_python_function"]),
                         (f"self CUDA ms per step by operator (top {args.rows}):", gpu_ops)):
        if table is not None:
            print(title)
            for name, ms in table.items():
                print(f"  {ms:8.2f}  {name}")
    # the figures last (a GPU session shows a part's last lines)
    print("top host places (self CPU ms per step): " + "; ".join(
        f"{p['name']} ({p['kind']}) {p['ms_per_step']:.2f}" for p in result["top_host_places"]))
    print(f"per step: wall {result['wall_ms_per_step']:.1f} ms (with the profiler's overhead), host self time "
          f"{result['host_self_ms_per_step']:.1f} ms, {result['operators_per_step']:.0f} operators, GPU busy "
          f"{result['gpu_busy_ms_per_step']:.1f} ms")
    print(f"per step: {result['kernel_launches_per_step']:.0f} kernel launches, {result['syncs_per_step']:.2f} "
          f"synchronisations {result['syncs_per_step_by_call']}, cudaMalloc {result['cuda_malloc_per_step']:.2f}, "
          f"cudaFree {result['cuda_free_per_step']:.2f}, H2D copies {result['h2d_per_step']:.1f} "
          f"({_kib(result['h2d_bytes_per_step'])}), D2H copies {result['d2h_per_step']:.1f} "
          f"({_kib(result['d2h_bytes_per_step'])})"
          + (f"; peak GPU memory {result['peak_mb']:.0f} MB" if result["peak_mb"] is not None else ""))
    if args.json:
        write_result(args.json, result)


def _kib(value: float | None) -> str:
    """A per-step byte count for the printout."""
    return "bytes not exposed by this torch" if value is None else f"{value / 1024:.1f} KiB"


# ---------------------------------------------------------------------------------------- reads
def count_reads(with_lpa3: bool, args: argparse.Namespace) -> dict:
    """The host reads (by kind and, in the package, by call site) and the operators of one training step: the
    first of epoch 1, with or without the callback."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback
    from torch.profiler import ProfilerActivity, profile

    from lpa3_lightning import LPA3Callback
    from tests.helpers import HostReadCounter

    window = contextlib.ExitStack()
    opened: dict[str, Any] = {}

    def counted(trainer: Any, batch_idx: int) -> bool:
        return trainer.current_epoch == 1 and batch_idx == 0

    class Opens(Callback):
        """Registered first: the window opens before the LP-A3 callback's on_train_batch_start."""

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if counted(trainer, batch_idx):
                opened["reads"] = window.enter_context(HostReadCounter())
                opened["profile"] = window.enter_context(profile(activities=[ProfilerActivity.CPU]))

    class Closes(Callback):
        """Registered last: the window closes after the LP-A3 callback's on_train_batch_end, and the fit stops."""

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if counted(trainer, batch_idx):
                window.close()
                trainer.should_stop = True

    pl.seed_everything(0)
    lpa3 = [LPA3Callback(ratio=args.ratio, steps=args.solver_steps, seed=0)] if with_lpa3 else []
    trainer = _trainer(2, "cpu", [Opens(), *lpa3, Closes()])
    trainer.fit(_module(args.arch), datamodule=_breastmnist(args.batch))
    reads = opened["reads"]
    return {"reads": dict(reads.counts), "sites": reads.sites.most_common(args.sites),
            "operators": sum(e.device_type.name == "CPU" for e in opened["profile"].events())}


def reads(args: argparse.Namespace) -> None:
    """The ``reads`` measure: one step without the callback, one with it."""
    runs = {"plain": count_reads(False, args), "LP-A3": count_reads(True, args)}
    print(f"\none training step, {args.arch}, batch {args.batch}, ratio {args.ratio}, {args.solver_steps} solver steps")
    print("| step | host reads of device values | by kind | operators dispatched | operators / plain |")
    print("|---|---|---|---|---|")
    plain_operators = max(1, runs["plain"]["operators"])
    for name, r in runs.items():
        print(f"| {name} | {sum(r['reads'].values())} | {r['reads']} | {r['operators']} | "
              f"{r['operators'] / plain_operators:.1f}x |")
    print("\nLP-A3: host reads by call site:")
    for site, count in runs["LP-A3"]["sites"]:
        print(f"{count:5d}  {site}")
    if args.json:
        write_result(args.json, {"script": "step_cost", "measure": "reads", "arch": args.arch, "batch": args.batch,
                                 "ratio": args.ratio, "solver_steps": args.solver_steps, "runs": runs})


# ---------------------------------------------------------------------------------------- logging
def logging_cost(args: argparse.Namespace) -> None:
    """The ``logging`` measure."""
    import lightning.pytorch as pl

    from lpa3_lightning import LPA3Callback

    settings = {"every step": 1, "default (sampled)": None}
    steps: dict[str, list[float]] = {name: [] for name in settings}
    for repeat in range(args.repeats):
        # A B B A: the order flips every repeat, so a drift over the process's life (the later of two fits in
        # one process ran 2% to 6% slower here, whichever it was) falls on both settings alike
        for name, every in (list(settings.items()) if repeat % 2 == 0 else list(settings.items())[::-1]):
            pl.seed_everything(0)
            timer = StepTimer()
            callback = LPA3Callback(ratio=args.ratio, steps=args.solver_steps, warmup_epochs=1, seed=0,
                                    logging={"every_n_steps": every})
            _trainer(args.epochs, args.accelerator, [timer, callback]).fit(
                _module(args.arch), datamodule=_breastmnist(args.batch))
            steps[name] += [t for epoch in range(1, args.epochs) for t in timer.steps[epoch]]
    print(f"{device_label(args.accelerator)}; {args.arch}, batch {args.batch}; {args.repeats} fits of each setting, "
          f"{len(steps['every step'])} steps each")
    result = {name: {"mean_step_s": statistics.mean(ts), "median_step_s": statistics.median(ts), "steps": len(ts)}
              for name, ts in steps.items()}
    for name, r in result.items():
        print(f"{name:18} mean step {r['mean_step_s']:.3f} s, median {r['median_step_s']:.3f} s")
    ratio = result["default (sampled)"]["mean_step_s"] / result["every step"]["mean_step_s"]
    print(f"default / every step (mean step): {ratio:.3f}")
    if args.json:
        write_result(args.json, {"script": "step_cost", "measure": "logging", "device": device_label(args.accelerator),
                                 "arch": args.arch, "batch": args.batch, "repeats": args.repeats, "settings": result,
                                 "sampled_over_every_step": ratio})


# ---------------------------------------------------------------------------------------- the command line
def _measure(measures: Any, name: str, summary: str, run: Any, ratio: float, accelerator: bool = True) -> Any:
    """One measure's parser, with the arguments every measure takes."""
    parser = measures.add_parser(name, help=summary, description=summary)
    run_arguments(parser, accelerator="cpu" if accelerator else None, json_out=True)
    parser.add_argument("--arch", default="resnet18", choices=("resnet18", "small_cnn"),
                        help="small_cnn: a quick check of the script, not a figure")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--ratio", type=float, default=ratio, help=f"LPA3Callback(ratio=...) (default {ratio})")
    parser.add_argument("--solver-steps", type=int, default=5, help="LPA3Callback(steps=...): solver iterations")
    parser.set_defaults(run=run)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog="Each measure's --help says more.")
    measures = parser.add_subparsers(dest="measure", required=True, metavar="MEASURE")

    ratios_parser = _measure(measures, "ratios", "step and epoch time and peak memory of each configuration "
                             "against the baseline and the floors, one process each", ratios, ratio=0.5)
    ratios_parser.add_argument("--epochs", type=int, default=3, help="epoch 0 is the warm-up; epochs 1.. are measured")
    ratios_parser.add_argument("--cached-epochs", type=int, default=None, help="epochs of the cached configurations "
                               "(default --epochs; 11 gives one whole K=10 window)")
    ratios_parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS,
                               help="the configurations to run (baseline always runs: every ratio is to it)")
    ratios_parser.add_argument("--noise-norm", type=float, default=None,
                               help="lpa3_noise's L2 norm (default: lpa3's mean lpa3/input_distance in the same round)")
    ratios_parser.add_argument("--repeats", type=int, default=1,
                               help="run every configuration this many times, in turn, and report the medians")
    ratios_parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)

    profile_parser = _measure(measures, "profile", "torch.profiler over steady LP-A3 steps: where the host and the "
                              "GPU spend them", profile_steps, ratio=0.3)
    profile_parser.add_argument("--steps", type=int, default=4, help="steady LP-A3 steps profiled")
    profile_parser.add_argument("--warm-steps", type=int, default=0,
                                help="LP-A3 steps run before the profile, in its epoch")
    profile_parser.add_argument("--stack", action="store_true", help="with the Python tracer (the by-function table)")
    profile_parser.add_argument("--fast", action="store_true", help="solver.fast=True")
    profile_parser.add_argument("--rows", type=int, default=15, help="rows of each table")

    reads_parser = _measure(measures, "reads", "host reads of device values and operators of one step, plain and "
                            "with LP-A3 (on the CPU)", reads, ratio=0.3, accelerator=False)
    reads_parser.add_argument("--sites", type=int, default=30, help="call sites to list")

    logging_parser = _measure(measures, "logging", "the step with the diagnostics measured on every step against "
                              "sampled", logging_cost, ratio=0.3)
    logging_parser.add_argument("--repeats", type=int, default=4, help="fits of each setting, in the order A B B A ...")
    logging_parser.add_argument("--epochs", type=int, default=3, help="epoch 0 is the warm-up; the others are measured")

    args = parser.parse_args(argv)
    apply_threads(args.threads)
    args.run(args)


if __name__ == "__main__":
    main()
