"""Training overhead of LP-A3: time per step, per epoch (cached x'), peak memory; in one run.

    python benchmarks/step_overhead.py [--epochs 3] [--accelerator gpu] [--repeats 3]

ResNet-18 (MedMNIST stem) on the embedded BreastMNIST train split (546 images, 28x28),
batch 128, Adam, one process per configuration (so peak memory is per configuration):
  baseline        LPA3Classifier without the callback (no twin BN)
  lpa3            + LPA3Callback(ratio=--ratio (0.5, the MedMNIST table's), steps=5), default solver
                  (runtime.sync_free="auto": the sync-free per-batch path on a GPU, the default path on the CPU)
  lpa3_eager      the same with runtime.sync_free=False (the default path everywhere; on a GPU, the "before")
  lpa3_log_every_step  lpa3 with its diagnostics measured on every step (logging.every_n_steps=1, the
                  behaviour before 0.2.0; the default measures them on the Trainer's logging steps and each
                  epoch's first, here 1 step in 5)
  lpa3_graphs     the sync-free path with runtime.cuda_graphs=True (the solver replayed as a CUDA graph;
                  on the CPU the padded rows solved eagerly)
  lpa3_fast       + the same with fast=True
  lpa3_cached     + the default solver with cache.regenerate_every_n_epochs=10
  lpa3_cached_lazy  the same with cache.attack_new_selections=False (solver in regeneration epochs only)
  lpa3_cached_graphs  lpa3_cached with runtime.cuda_graphs=True
Epoch 0 is a warm-up for every LP-A3 run (warmup_epochs=1: TCS fills, no attack), so the
measured epochs select 30% as in steady state. Prints the median step time of the measured
epochs, the ratio to the baseline, the peak resident memory, the amortized epoch time with
K=10 ((regeneration epoch + 9 x the last epoch) / 10; the fraction of x' the last epoch took
from the cache is printed), and the floor: the baseline step plus 5 x (forward +
input-gradient backward) on the selected samples plus one training pass on x'. On a GPU
(``--accelerator gpu``) steps are timed after a device synchronisation and peak memory is the
GPU's peak allocated memory.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.harness import StepTimer, median_seconds, run_worker  # noqa: E402

CONFIGS = ("baseline", "lpa3", "lpa3_log_every_step", "lpa3_eager", "lpa3_graphs", "lpa3_fast", "lpa3_cached", "lpa3_cached_lazy",
           "lpa3_cached_graphs")


def _worker(config: str, epochs: int, accelerator: str, ratio: float = 0.5) -> dict:
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import Callback

    from lpa3_lightning import LPA3Callback, LPA3Classifier
    from lpa3_lightning.data import MedMNISTDataModule

    pl.seed_everything(0)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # imports, data, no model yet
    timer = StepTimer()
    callbacks: list[Callback] = [timer]
    graphs = config.endswith("_graphs")
    if config != "baseline":
        callbacks.append(LPA3Callback(ratio=ratio, steps=5, warmup_epochs=1, seed=0,
                                      solver={"fast": config == "lpa3_fast"},
                                      cache={"regenerate_every_n_epochs": 10 if config.startswith("lpa3_cached") else 1,
                                             "attack_new_selections": config != "lpa3_cached_lazy"},
                                      runtime={"sync_free": False if config == "lpa3_eager" else True if graphs else "auto",
                                               "cuda_graphs": graphs},
                                      logging={"every_n_steps": 1 if config == "lpa3_log_every_step" else None}))
    module = LPA3Classifier(arch="resnet18", in_channels=1, num_classes=2, twin_bn=config != "baseline")
    trainer = pl.Trainer(max_epochs=epochs, accelerator=accelerator, devices=1, callbacks=callbacks, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, num_sanity_val_steps=0)
    trainer.fit(module, datamodule=MedMNISTDataModule("breastmnist", batch_size=128))
    measured = [e for e in timer.steps if e >= 1]
    device = trainer.strategy.root_device  # the fit's device (teardown moved the module back to the CPU)
    on_gpu = device.type == "cuda"
    result = {
        "step_s": statistics.median([t for e in measured for t in timer.steps[e]]),
        "mean_step_s": statistics.mean([t for e in measured for t in timer.steps[e]]),
        "epochs_s": {e: timer.epochs[e] for e in measured},
        "reused": timer.reused,
        "device": torch.cuda.get_device_name(device) if on_gpu else "cpu",
        # the training's own memory: on a GPU its peak allocation; on the CPU the peak resident
        # size minus what the process held before
        "peak_mb": (torch.cuda.max_memory_allocated(device) / 2**20 if on_gpu
                    else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - rss_before),
    }
    if graphs:  # how often the solve was captured (a capture costs a few eager solves) and replayed
        solver_graphs = callbacks[-1].runner().solver_graphs  # type: ignore[attr-defined]
        result["captures"], result["replays"] = solver_graphs.captures, solver_graphs.replays
    if config == "lpa3":
        result["attack_s"], result["x_adv_pass_s"] = _floor(module.to(device), ratio)
        result["steps_per_epoch"] = len(timer.steps[measured[0]])
    return result


def _floor(module, ratio: float) -> tuple[float, float]:
    """The least LP-A3 adds to a step, in two parts: on ``ratio`` of a batch of 128, 5 x (forward +
    backward to the input), and one training forward+backward of x' (the measured baseline step
    is added by the caller)."""
    import torch

    from lpa3_lightning.core.dual_bn import use_twin_bn

    model = module.model
    device = module.device
    x = torch.randn(128, 1, 28, 28, device=device)
    y = torch.randint(0, 2, (128,), device=device)
    selected = int(ratio * 128)

    def train_pass(inputs, targets, twin=False):
        model.train()
        model.zero_grad()
        if twin:
            with use_twin_bn(model):
                torch.nn.functional.cross_entropy(model(inputs), targets).backward()
        else:
            torch.nn.functional.cross_entropy(model(inputs), targets).backward()

    def input_grad_pass():
        model.eval()
        xs = x[:selected].clone().requires_grad_(True)
        torch.autograd.grad(model(xs).logsumexp(1).sum(), xs)

    attack = 5 * median_seconds(input_grad_pass, device)
    aug = median_seconds(lambda: train_pass(x[:selected], y[:selected], twin=True), device)
    model.zero_grad(set_to_none=True)
    return attack, aug


def _median_of(runs: list[dict]) -> dict:
    """One configuration's result over its repeats: the median of each time and memory figure."""
    merged = dict(runs[0])
    for key in ("step_s", "mean_step_s", "peak_mb", "attack_s", "x_adv_pass_s"):
        if key in merged:
            merged[key] = statistics.median(r[key] for r in runs)
    merged["epochs_s"] = {e: statistics.median(r["epochs_s"][e] for r in runs) for e in runs[0]["epochs_s"]}
    merged["repeats"] = len(runs)
    return merged


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3, help="epoch 0 is warm-up; epochs 1.. are measured")
    parser.add_argument("--cached-epochs", type=int, default=None,
                        help="epochs of the cached configurations (default --epochs; 11 gives one whole K=10 window)")
    parser.add_argument("--accelerator", default="cpu", help="Lightning accelerator: cpu or gpu")
    parser.add_argument("--ratio", type=float, default=0.5, help="LP-A3 ratio (tau); the MedMNIST table uses 0.5")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS,
                        help="which configurations to run (baseline always runs: every ratio is to it)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run every configuration this many times, in turn, and report the medians")
    parser.add_argument("--json", type=Path, default=None, help="also write every configuration's result to this file")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.epochs < 2:
        sys.exit("--epochs must be at least 2: epoch 0 is the warm-up")
    if args.worker:
        print(json.dumps(_worker(args.worker, args.epochs, args.accelerator, args.ratio)))
        return
    import torch

    where = (torch.cuda.get_device_name(0) if args.accelerator in ("gpu", "cuda")
             else f"{platform.machine()}, {torch.get_num_threads()} threads")
    print(f"torch {torch.__version__}, {where}; ResNet-18 28x28, "
          f"batch 128, BreastMNIST train (546), epochs 1..{args.epochs - 1} measured, one process each")
    results = {}
    configs = ["baseline"] + [c for c in args.configs if c != "baseline"]
    runs: dict[str, list[dict]] = {c: [] for c in configs}
    for repeat in range(args.repeats):  # round robin: a slow spell of the machine touches every configuration
        for config in configs:
            epochs = args.cached_epochs if config.startswith("lpa3_cached") and args.cached_epochs else args.epochs
            result = run_worker([sys.executable, __file__, "--worker", config, "--epochs", str(epochs), "--accelerator",
                                 args.accelerator, "--ratio", str(args.ratio)], config)
            result["epochs_s"] = {int(k): v for k, v in result["epochs_s"].items()}  # JSON made the keys strings
            print(f"{config} (run {repeat + 1} of {args.repeats}): {json.dumps(result)}", flush=True)
            runs[config].append(result)
    results = {config: _median_of(rs) for config, rs in runs.items()}
    base = results["baseline"]
    base_epoch = statistics.median(base["epochs_s"].values())
    print("peak MB = peak GPU memory allocated" if args.accelerator in ("gpu", "cuda") else
          "peak MB = peak resident memory of the process minus its size after imports (the training's own)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"torch": torch.__version__, "where": where, "ratio": args.ratio,
                                         "results": results}, indent=1))
    print(f"{'config':20} {'step s':>8} {'x base':>7} {'mean s':>8} {'x base':>7} {'epoch s':>8} {'x base':>7} "
          f"{'peak MB':>8} {'x base':>7}")
    for config, r in results.items():
        epoch = statistics.median(r["epochs_s"].values())
        print(f"{config:20} {r['step_s']:8.3f} {r['step_s'] / base['step_s']:6.2f}x {r['mean_step_s']:8.3f} "
              f"{r['mean_step_s'] / base['mean_step_s']:6.2f}x {epoch:8.2f} "
              f"{epoch / base_epoch:6.2f}x {r['peak_mb']:8.0f} {r['peak_mb'] / base['peak_mb']:6.2f}x")
    lp = results.get("lpa3")
    # the amortized epoch's floor: the baseline epoch, a training pass on x' every step, and the
    # solver's 5 x (forward + input-gradient backward) once every K = 10 epochs
    floor_epoch = None if lp is None else \
        base_epoch + lp["steps_per_epoch"] * (lp["x_adv_pass_s"] + lp["attack_s"] / 10)
    for config in [c for c in ("lpa3_cached", "lpa3_cached_lazy", "lpa3_cached_graphs") if c in results]:
        cached = results[config]["epochs_s"]
        window = sorted(cached)[:10]  # one K=10 window: the regeneration epoch and the reuse epochs after it
        regen, reuse = cached[window[0]], [cached[e] for e in window[1:]]
        # measured over every reuse epoch the run has; extrapolated to 9 only when fewer were run
        amortized = (regen + 9 * statistics.mean(reuse)) / 10 if reuse else float("nan")
        shares = [results[config]["reused"].get(str(e), float("nan")) for e in window[1:]]
        print(f"{config}: regeneration epoch {regen:.2f} s, {len(reuse)} reuse epochs mean {statistics.mean(reuse):.2f} s "
              f"(min {min(reuse):.2f}, max {max(reuse):.2f}; x' from the cache {min(shares):.0%} to {max(shares):.0%})"
              f" -> amortized over K=10: {amortized:.2f} s = {amortized / base_epoch:.2f}x baseline epoch"
              + ("" if len(reuse) >= 9 else f" (extrapolated from {len(reuse)} reuse epochs: run --epochs 11)")
              + ("" if floor_epoch is None else f"; its floor {floor_epoch:.2f} s ({floor_epoch / base_epoch:.2f}x "
                 f"baseline): amortized / floor {amortized / floor_epoch:.2f}x"))
    if "lpa3" not in results:
        return
    extra = lp["attack_s"] + lp["x_adv_pass_s"]
    floor = base["step_s"] + extra
    print(f"floor per step (measured baseline step + 5 x (forward + input-gradient backward) on "
          f"{int(args.ratio * 128)} selected + one "
          f"training pass on x' = {extra:.3f} s): {floor:.3f} s; lpa3 step is {results['lpa3']['step_s'] / floor:.2f}x "
          "the floor")
    print(f"floor / baseline step: {floor / base['step_s']:.2f}x")
    for config in [c for c in ("lpa3_log_every_step", "lpa3_eager", "lpa3_graphs", "lpa3_fast") if c in results]:
        r = results[config]
        graphs = f"; {r['captures']} graphs captured, {r['replays']} solves replayed" if "captures" in r else ""
        print(f"{config}: step {r['step_s'] / floor:.2f}x the floor{graphs}")
    if "lpa3_cached_graphs" in results:
        r = results["lpa3_cached_graphs"]
        print(f"lpa3_cached_graphs: {r['captures']} graphs captured, {r['replays']} solves replayed")


if __name__ == "__main__":
    main()
