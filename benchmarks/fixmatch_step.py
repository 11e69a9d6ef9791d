"""Cost of LP-A3 in a FixMatch step: step and epoch time against FixMatch's, and the floor; in one run.

    python benchmarks/fixmatch_step.py [--epochs 4] [--accelerator gpu] [--setting wrn28_2_32px] [--json PATH]

``FixMatchClassifier`` with one process per configuration, in one of two settings:
  mnist5k        (default) small CNN, MNIST-5k shipped in the package, 40 labels, batch 32 + 7 x 32
                 unlabeled, data loading in the main process
  wrn28_2_32px   the paper's CIFAR-10 step: WRN-28-2, 3 x 32 x 32 inputs, batch 64 + 7 x 64
                 unlabeled, on random tensors of that shape held in memory (a timing of the step
                 only: CIFAR-10 is not shipped, and the timer excludes data loading anyway);
                 8 steps an epoch
Configurations:
  fixmatch              no callback (no twin BN)
  fixmatch_lpa3_all     + LPA3Callback(ratio=0.9, steps=5), fixmatch.solve_trained_only=False: x' solved
                        for every selected sample each step (the authors' cost)
  fixmatch_lpa3         the default: x' solved only where the LP-A3 term will weigh it (pseudo-label
                        confidence >= 0.9); the same loss
  fixmatch_null         the control augment="null": the LP-A3 term's rows, labels and weights with x' = x (no
                        solver), the callback's other work (TCS, selection, the verified forward, logging) kept
  fixmatch_lpa3_cached  + cache.regenerate_every_n_epochs=10 (a cached x' is reused while its pseudo-label holds)
Epoch 0 is the callback's warm-up (TCS fills, no attack) in every LP-A3 run, so epochs 1.. are
measured; the LP-A3 term counts from epoch 1. Epoch 0's median step (its first step left out) is
printed too: FixMatch's step plus the request's pseudo-label forward, without the solver. Prints the median step time of the measured
epochs and its ratio to FixMatch's, the amortized epoch with K=10 ((regeneration epoch + 9 x the
mean reuse epoch) / 10), and the floor of each: FixMatch's step + one training pass on x'
(forward + backward, twin BN) + 5 x (forward + input-gradient backward) on the selected
samples, the last divided by K when cached (the floor of the authors' cost: the default solves
only the confident share, printed, and can go below it). Ratios are measured side by side in one run.
``--designs`` times instead, in one process and round robin (the median of ``--reps`` rounds; a
load that drifts during the run touches every design alike), the step without the solver under
each design of the request's pseudo-labels: ``reference`` (FixMatch's step: one forward of the
joint batch, its loss, the backward; the package's step without the callback), ``shared_forward``
(the package's design since 0.4.0: the request makes the step's joint forward with its graph and
the loss reuses it, so the graph is held through the solver) and ``extra_forward`` (0.3.0's design:
the same joint forward once more, without gradient, before the step; what the request still does
outside a fit). The solver's work is the same under every design (the same rows, the same labels),
so these differences are the designs' whole cost. Beside the times: the bytes the joint forward's
graph saves for its backward (what ``shared_forward`` holds while the solver runs, counted with
``torch.autograd.graph.saved_tensors_hooks``) and the bytes one solver pass (forward + input
gradient on the selected rows) saves, its own peak's main part.
``--json PATH`` writes every configuration's result and the ratios above (rewritten as each
configuration finishes, ``"complete": false`` until the last).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.harness import (  # noqa: E402
    StepTimer,
    apply_threads,
    device_label,
    median_seconds,
    on_gpu,
    run_arguments,
    run_worker,
    worker_command,
    write_result,
)

CONFIGS = ("fixmatch", "fixmatch_lpa3_all", "fixmatch_lpa3", "fixmatch_null", "fixmatch_lpa3_cached")
RATIO = 0.9
#: setting -> (arch, (channels, size), batch size, mu); the paper's CIFAR-10 rows use ratio 0.9 too
SETTINGS = {"mnist5k": ("small_cnn", (1, 28), 32, 7), "wrn28_2_32px": ("wrn28_2", (3, 32), 64, 7)}
SYNTHETIC_STEPS = 8  # steps an epoch of the in-memory setting


class _Synthetic:
    """Random labeled and unlabeled batches of the given shape, as ``SemiSupervisedDataModule`` yields them."""

    def __init__(self, shape: tuple[int, int], batch_size: int, mu: int, num_classes: int = 10) -> None:
        import torch
        from lightning.pytorch.utilities.combined_loader import CombinedLoader
        from torch.utils.data import DataLoader, TensorDataset

        g = torch.Generator().manual_seed(0)
        channels, size = shape
        self.batch_size, self.mu = batch_size, mu
        self.num_unlabeled = SYNTHETIC_STEPS * mu * batch_size
        n_lab = 4 * batch_size
        labeled = TensorDataset(torch.randn(n_lab, channels, size, size, generator=g),
                                torch.randint(0, num_classes, (n_lab,), generator=g), torch.arange(n_lab))
        weak = torch.randn(self.num_unlabeled, channels, size, size, generator=g)
        unlabeled = TensorDataset(weak, weak + 0.5 * torch.randn(weak.shape, generator=g),
                                  torch.arange(self.num_unlabeled))
        self.loaders = CombinedLoader({
            "labeled": DataLoader(labeled, batch_size=batch_size, shuffle=True, drop_last=True),
            "unlabeled": DataLoader(unlabeled, batch_size=mu * batch_size, shuffle=True, drop_last=True)},
            mode="max_size_cycle")
        self.num_steps_per_epoch = SYNTHETIC_STEPS


def _worker(config: str, epochs: int, accelerator: str, setting: str = "mnist5k") -> dict:
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import Callback

    from lpa3_lightning import FixMatchClassifier, LPA3Callback
    from lpa3_lightning.data import SemiSupervisedDataModule

    pl.seed_everything(0)
    arch, shape, batch_size, mu = SETTINGS[setting]
    if setting == "mnist5k":
        data = SemiSupervisedDataModule("mnist5k", num_labels=40, seed=0, batch_size=batch_size, mu=mu,
                                        eval_batch_size=500)
    else:
        data = _Synthetic(shape, batch_size, mu)
    timer = StepTimer()
    callbacks: list[Callback] = [timer]
    lpa3 = config != "fixmatch"
    if lpa3:
        callbacks.append(LPA3Callback(ratio=RATIO, sigma=0.02, steps=5, warmup_epochs=1, seed=0,
                                      input_range="auto" if setting == "mnist5k" else None,
                                      cache={"regenerate_every_n_epochs": 10 if config.endswith("cached") else 1},
                                      augment="null" if config == "fixmatch_null" else "lpa3"))
    module = FixMatchClassifier(arch=arch, in_channels=shape[0], num_classes=10, twin_bn=lpa3,
                   fixmatch={"lpa3_loss_warmup_epochs": 1, "solve_trained_only": config != "fixmatch_lpa3_all"})
    trainer = pl.Trainer(max_epochs=epochs, accelerator=accelerator, devices=1, callbacks=callbacks, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, num_sanity_val_steps=0)
    if isinstance(data, _Synthetic):
        module.lpa3_num_samples = data.num_unlabeled
        trainer.fit(module, train_dataloaders=data.loaders)
    else:
        trainer.fit(module, datamodule=data)
    measured = [e for e in timer.steps if e >= 1]
    device = trainer.strategy.root_device
    result = {
        "step_s": statistics.median([t for e in measured for t in timer.steps[e]]),
        "warmup_step_s": statistics.median(timer.steps[0][1:]),
        "epochs_s": {e: timer.epochs[e] for e in measured},
        "reused": timer.reused,
        "solved": {e: timer.solved[e] for e in measured if e in timer.solved},
        "steps_per_epoch": data.num_steps_per_epoch,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "peak_mb": torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else float("nan"),
    }
    if config == "fixmatch_lpa3_all":
        result["attack_s"], result["x_adv_pass_s"] = _floor_parts(module.to(device), data.mu * data.batch_size,
                                                                  shape)
    return result


def saved_bytes(fn) -> int:
    """Bytes of the tensors autograd saves for backward while ``fn()`` runs (storage counted once)."""
    import torch

    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storages.values())


def design_step_times(setting: str, reps: int) -> tuple[dict[str, float], dict[str, int], dict[str, int]]:
    """Median seconds of one FixMatch step without the solver under each design of the request's
    pseudo-labels (see the module docstring), measured round robin in this process, the forwards of
    the joint batch each design makes a step (counted on its last round), and the saved bytes of the
    joint forward's graph and of one solver pass on the selected rows."""
    import time

    import torch

    from lpa3_lightning import FixMatchClassifier

    torch.manual_seed(0)
    arch, (channels, size), batch_size, mu = SETTINGS[setting]
    # the LP-A3 term counts from the first step (no loss warm-up): the request makes its forward
    module = FixMatchClassifier(arch=arch, in_channels=channels, num_classes=10,
                                fixmatch={"lpa3_loss_warmup_epochs": 0})
    module.train()
    joint_rows = batch_size * (1 + 2 * mu)
    forwards = {"count": 0}
    module.model.register_forward_hook(
        lambda _m, inputs, _out: forwards.__setitem__("count", forwards["count"] + (inputs[0].shape[0] == joint_rows)))
    g = torch.Generator().manual_seed(0)
    weak = torch.randn(mu * batch_size, channels, size, size, generator=g)
    batch = {"labeled": (torch.randn(batch_size, channels, size, size, generator=g),
                         torch.randint(0, 10, (batch_size,), generator=g), torch.arange(batch_size)),
             "unlabeled": (weak, weak + 0.5 * torch.randn(weak.shape, generator=g), torch.arange(mu * batch_size))}

    def reference() -> None:
        module.fixmatch_loss(batch)[0].backward()
        module.zero_grad(set_to_none=True)

    def extra_forward() -> None:
        module.lpa3_request(batch)  # the package's request: the joint forward without gradient
        reference()

    def shared_forward() -> None:
        # what lpa3_request does in a fit: the joint forward with its graph, handed to the loss
        parts = module.fixmatch_forward(batch)
        module._fixmatch_shared = (weak, int(module.global_step), parts)
        module.fixmatch_pseudo_labels(parts[1])
        reference()

    designs = {"reference": reference, "shared_forward": shared_forward, "extra_forward": extra_forward}
    times: dict[str, list[float]] = {name: [] for name in designs}
    for fn in designs.values():
        fn()  # warm-up
    counts: dict[str, int] = {}
    for _ in range(reps):
        for name, fn in designs.items():
            forwards["count"] = 0
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
            counts[name] = forwards["count"]
    selected = weak[: round(RATIO * weak.shape[0])].clone().requires_grad_(True)

    def solver_pass() -> None:
        torch.autograd.grad(module.model(selected).logsumexp(1).sum(), selected)

    memory = {"joint_graph_bytes": saved_bytes(lambda: module.fixmatch_forward(batch)),
              "solver_pass_bytes": saved_bytes(solver_pass)}
    return {name: statistics.median(t) for name, t in times.items()}, counts, memory


def _floor_parts(module, unlabeled_batch: int, shape: tuple[int, int] = (1, 28)) -> tuple[float, float]:
    """(5 x (forward + input-gradient backward), one twin-BN training pass) on the selected share."""
    import torch

    from lpa3_lightning.core.dual_bn import use_twin_bn

    model = module.model
    device = module.device
    selected = round(RATIO * unlabeled_batch)
    x = torch.randn(selected, shape[0], shape[1], shape[1], device=device)
    y = torch.randint(0, 10, (selected,), device=device)

    def input_grad_pass():
        model.eval()
        xs = x.clone().requires_grad_(True)
        torch.autograd.grad(model(xs).logsumexp(1).sum(), xs)

    def x_adv_pass():
        model.train()
        model.zero_grad()
        with use_twin_bn(model):
            torch.nn.functional.cross_entropy(model(x), y).backward()

    attack = 5 * median_seconds(input_grad_pass, device, reps=5)
    x_adv = median_seconds(x_adv_pass, device, reps=5)
    model.zero_grad(set_to_none=True)
    return attack, x_adv


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=4, help="epoch 0 is the warm-up; 1.. are measured")
    run_arguments(parser, accelerator="cpu", json_out=True)
    parser.add_argument("--setting", default="mnist5k", choices=list(SETTINGS),
                        help="mnist5k (small CNN, the shipped data) or wrn28_2_32px (the CIFAR-10 step's shapes)")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS,
                        help="which configurations to run (fixmatch and fixmatch_lpa3_all always run: the ratios "
                             "and the floor use them)")
    parser.add_argument("--designs", action="store_true",
                        help="time the step without the solver under each design of the request's pseudo-labels, "
                             "round robin in one process, instead of the configurations")
    parser.add_argument("--reps", type=int, default=20, help="rounds of --designs")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.epochs < 3:
        sys.exit("--epochs must be at least 3: epoch 0 is the warm-up, epoch 1 regenerates, 2.. reuse")
    apply_threads(args.threads)
    if args.worker:
        print(json.dumps(_worker(args.worker, args.epochs, args.accelerator, args.setting)))
        return
    import torch

    if args.designs:
        times, counts, memory = design_step_times(args.setting, args.reps)
        print(f"torch {torch.__version__}, {device_label('cpu')}; FixMatch step without the solver, {args.setting}, "
              f"median of {args.reps} rounds (round robin, one process)")
        for name, seconds in times.items():
            print(f"{name:15} {seconds:8.4f} s  {seconds / times['reference']:.2f}x the reference step "
                  f"({counts[name]} forward{'s' if counts[name] > 1 else ''} of the joint batch)")
        print(f"saved for backward: the joint forward's graph (held through the solver by shared_forward) "
              f"{memory['joint_graph_bytes'] / 2**20:.1f} MiB; one solver pass on the {RATIO:.0%} selected rows "
              f"{memory['solver_pass_bytes'] / 2**20:.1f} MiB")
        if args.json:
            write_result(args.json, {"script": "fixmatch_step", "designs": times, "forwards": counts, **memory,
                                     "setting": args.setting,
                                     "reps": args.reps, "torch": torch.__version__})
        return

    where = device_label(args.accelerator)
    arch, (channels, size), batch_size, mu = SETTINGS[args.setting]
    what = "MNIST-5k" if args.setting == "mnist5k" else "random tensors"
    print(f"torch {torch.__version__}, {where}; FixMatch {arch}, {what} {channels}x{size}x{size}, batch {batch_size} + "
          f"{mu * batch_size} unlabeled, ratio {RATIO}, epochs 1..{args.epochs - 1} measured, one process each")
    results = {}
    summary = {"script": "fixmatch_step", "torch": torch.__version__, "device": where, "setting": args.setting,
               "arch": arch, "ratio": RATIO, "epochs": args.epochs, "complete": False, "configs": results}
    for config in [c for c in CONFIGS if c in args.configs or c in ("fixmatch", "fixmatch_lpa3_all")]:
        result = run_worker(worker_command(__file__, [config], {
            "--epochs": args.epochs, "--accelerator": args.accelerator, "--setting": args.setting,
            "--threads": args.threads}), config)
        result["epochs_s"] = {int(k): v for k, v in result["epochs_s"].items()}
        print(f"{config}: {json.dumps(result)}", flush=True)  # kept if a time limit stops the run later
        results[config] = result
        if args.json:
            write_result(args.json, summary)
    base, lp = results["fixmatch"], results["fixmatch_lpa3_all"]
    floor_step = base["step_s"] + lp["x_adv_pass_s"] + lp["attack_s"]
    summary["floor_step_s"] = floor_step
    for config, r in results.items():
        r["step_x_fixmatch"] = r["step_s"] / base["step_s"]
        r["epoch_x_fixmatch"] = statistics.mean(r["epochs_s"].values()) / statistics.mean(base["epochs_s"].values())
        if config != "fixmatch":
            r["step_x_floor"] = r["step_s"] / floor_step
        if on_gpu(args.accelerator):
            r["peak_x_fixmatch"] = r["peak_mb"] / base["peak_mb"]
    print(f"steps per epoch: {base['steps_per_epoch']}")
    print(f"{'config':22} {'step s':>8} {'x FixMatch':>11} {'floor s':>8} {'x floor':>8} {'x solved (share of batch)':>26}")
    print(f"{'fixmatch':22} {base['step_s']:8.3f} {1:10.2f}x")
    for config in [c for c in ("fixmatch_lpa3_all", "fixmatch_lpa3", "fixmatch_null") if c in results]:
        step, solved = results[config]["step_s"], list(results[config]["solved"].values())
        share = f"{min(solved):.2f} to {max(solved):.2f}" if solved else "n/a"
        print(f"{config:22} {step:8.3f} {step / base['step_s']:10.2f}x {floor_step:8.3f} {step / floor_step:7.2f}x "
              f"{share:>26}")
    print("epoch 0 (no solver; LP-A3 runs: FixMatch's step + the request's pseudo-labels): " + ", ".join(
        f"{c} {r['warmup_step_s']:.3f} s ({r['warmup_step_s'] / base['warmup_step_s']:.2f}x)" for c, r in results.items()))
    print(f"floor parts: FixMatch step {base['step_s']:.3f} s + x' training pass {lp['x_adv_pass_s']:.3f} s + "
          f"5 x (forward + input-gradient backward) {lp['attack_s']:.3f} s")
    if base["peak_mb"] == base["peak_mb"]:  # not NaN: a GPU run
        print("peak GPU memory allocated: " + ", ".join(
            f"{c} {r['peak_mb']:.0f} MB ({r['peak_mb'] / base['peak_mb']:.2f}x)" for c, r in results.items()))
    base_epoch = statistics.mean(base["epochs_s"].values())
    for config in [c for c in ("fixmatch_lpa3_all", "fixmatch_lpa3") if c in results]:
        epoch = statistics.mean(results[config]["epochs_s"].values())
        print(f"fixmatch epoch {base_epoch:.2f} s; {config} epoch {epoch:.2f} s ({epoch / base_epoch:.2f}x)")
    summary["complete"] = True
    if "fixmatch_lpa3_cached" not in results:
        if args.json:
            write_result(args.json, summary)
        return
    cached = results["fixmatch_lpa3_cached"]["epochs_s"]
    window = sorted(cached)[:10]
    regen, reuse = cached[window[0]], [cached[e] for e in window[1:]]
    amortized = (regen + 9 * statistics.mean(reuse)) / 10
    steps = base["steps_per_epoch"]
    floor_epoch = base_epoch + steps * (lp["x_adv_pass_s"] + lp["attack_s"] / 10)
    shares = [results["fixmatch_lpa3_cached"]["reused"].get(str(e), float("nan")) for e in window[1:]]
    print(f"fixmatch_lpa3_cached (K=10): regeneration epoch {regen:.2f} s, {len(reuse)} reuse epochs mean "
          f"{statistics.mean(reuse):.2f} s (x' from the cache {min(shares):.0%} to {max(shares):.0%}); amortized epoch "
          f"{amortized:.2f} s = {amortized / base_epoch:.2f}x FixMatch; floor {floor_epoch:.2f} s "
          f"({floor_epoch / base_epoch:.2f}x); amortized / floor {amortized / floor_epoch:.2f}x")
    results["fixmatch_lpa3_cached"].update(amortized_epoch_s=amortized, amortized_x_fixmatch=amortized / base_epoch,
                                           amortized_x_floor=amortized / floor_epoch)
    if args.json:
        write_result(args.json, summary)


if __name__ == "__main__":
    main()
