"""Solver speed: lpa3_attack against a direct transcription of the authors' loop.

    python benchmarks/solver_speed.py [--repeats 5] [--data ../shared/data] [--device cuda] [--json PATH]

Same model, batch and initial noise, one process, median of repeated runs, on ResNet-18
(MedMNIST stem, 1x28x28, batch 64, briefly trained on BreastMNIST) and WRN-28-2 (3x32x32,
batch 64, briefly trained on MNIST-5k digits padded to 32 px and repeated over 3 channels).
Prints per solver: median seconds, speed-up over the authors' loop, the largest difference of
x' from the authors' (project=False must match bit for bit on the CPU; on CUDA rounding
differences grow through the 1/slope step), the fraction of samples whose label is preserved
(log p(y|x') >= log p(y|x) - sigma, re-evaluated by one forward of the batch in full float32,
1e-5 allowed for rounding), the largest excess of the drop over sigma and the mean
perceptual distance. On a GPU the whole benchmark runs with TF32 off (lpa3_attack always
computes in full float32, see its docstring) and deterministic cuDNN kernels, so that the
authors' x' can be compared with ours: both are otherwise amplified by the 1/slope step.

The transcription follows docs/method.md, written here: loss.backward() through every parameter
(filling .grad, zeroed each step) and a finite-difference forward at every step. All solvers
run the model in eval mode (BN on running statistics) so that their x' can be compared; the
authors run it in train mode through twin BNs, which costs the same passes. ``--json PATH``
writes every row of the tables.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import apply_threads, device_label, run_arguments, sync, write_result  # noqa: E402
from lpa3_lightning import lpa3_attack  # noqa: E402
from lpa3_lightning.core.features import PerceptualFeatures  # noqa: E402
from lpa3_lightning.core.forward_modes import full_float32, label_logp  # noqa: E402
from lpa3_lightning.models import medmnist_resnet, wrn28_2  # noqa: E402

SIGMA = 0.02


def authors_loop(model: nn.Module, x: torch.Tensor, y: torch.Tensor, noise: torch.Tensor, low: float, high: float,
                 sigma: float = SIGMA, steps: int = 5, lam: float = 1.0) -> torch.Tensor:
    """docs/method.md's loop with the authors' costs (backward through the parameters), in eval mode."""
    feats = PerceptualFeatures(model)
    with torch.no_grad():
        logits0, phi0 = feats(x)
        logp0 = label_logp(logits0, y, 1.0)
    delta = (x + (2 * noise - 1) * 0.01).clamp(low, high) - x
    for t in range(steps):
        step = sigma * 0.1 ** (t / steps)
        lam_t = lam * 0.1 ** (1 - t / steps)
        delta = delta.detach().requires_grad_(True)
        logits, phi = feats(x + delta)
        logp = label_logp(logits, y, 1.0)
        loss = -(phi - phi0).norm(dim=1).mean() + lam_t * F.relu(logp0 - logp - sigma).mean()
        model.zero_grad()
        loss.backward()
        g = delta.grad
        g_hat = g / (g.flatten(1).norm(dim=1).view(-1, *[1] * (x.dim() - 1)) + 1e-8)
        with torch.no_grad():
            logp_fd = label_logp(model(x + delta - 0.1 * g_hat), y, 1.0)
            slope = (logp.detach() - logp_fd).abs() / 0.1
            delta = (x + delta - g_hat * (step / (slope + 1e-4)).view(-1, *[1] * (x.dim() - 1))).clamp(low, high) - x
    model.zero_grad(set_to_none=True)
    return (x + delta).detach()


def _train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int) -> None:
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    model.train()
    for _ in range(steps):
        idx = torch.randint(0, len(x), (64,), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()
    model.eval()


def _data(root: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    breast = np.load(root / "medmnist" / "breastmnist.npz")
    xb = torch.from_numpy(breast["train_images"]).float().div(255).sub(0.5).div(0.5)[:, None]
    yb = torch.from_numpy(breast["train_labels"]).long().flatten()
    digits = np.load(root / "mnist5k" / "mnist5k.npz")
    xd = torch.from_numpy(digits["images"]).float().div(255).sub(0.5).div(0.5)[:, None]
    xd = F.pad(xd, (2, 2, 2, 2), value=-1.0).repeat(1, 3, 1, 1)
    yd = torch.from_numpy(digits["labels"]).long()
    return {"resnet18": (xb, yb), "wrn28_2": (xd, yd)}


def _time_interleaved(runs: dict, repeats: int, device: torch.device) -> dict[str, tuple[list[float], torch.Tensor]]:
    """Every solver once per round, ``repeats`` rounds: drifts of the machine hit all alike."""
    times: dict[str, list[float]] = {label: [] for label in runs}
    outs: dict[str, torch.Tensor] = {}
    if device.type == "cuda":
        for fn in runs.values():
            fn()  # CUDA/cuDNN initialisation and kernel selection are not the solver's cost
    for _ in range(repeats):
        for label, fn in runs.items():
            sync(device)
            start = time.perf_counter()
            outs[label] = fn()
            sync(device)
            times[label].append(time.perf_counter() - start)
    return {label: (times[label], outs[label]) for label in runs}


def _quality(model: nn.Module, x: torch.Tensor, y: torch.Tensor, x_adv: torch.Tensor) -> tuple[float, float, float]:
    """Fraction preserved (a fresh forward of the whole batch, TF32 off, 1e-5 for rounding),
    the largest excess of the drop of log p(y|x) over sigma, and the mean perceptual distance."""
    feats = PerceptualFeatures(model)
    with torch.no_grad(), full_float32(x.device):
        logits0, phi0 = feats(x)
        logits1, phi1 = feats(x_adv)
    drop = label_logp(logits0, y, 1.0) - label_logp(logits1, y, 1.0)
    return (float((drop <= SIGMA + 1e-5).float().mean()), float((drop - SIGMA).max()),
            float((phi1 - phi0).norm(dim=1).mean()))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--only", default=None, help="run only solvers whose label contains this (and the authors')")
    parser.add_argument("--train-steps", type=int, default=30)
    parser.add_argument("--data", type=Path, default=Path(__file__).resolve().parents[2] / "shared" / "data")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--channels-last", action="store_true",
                        help="models and inputs in channels-last memory format, for every solver")
    run_arguments(parser, json_out=True)
    args = parser.parse_args()
    apply_threads(args.threads)
    device = torch.device(args.device)
    # The authors' loop runs as a user would run it: the backends' default settings (TF32
    # convolutions on NVIDIA GPUs, non-deterministic cuDNN). lpa3_attack turns TF32 off inside
    # itself (allow_tf32=False, its default), which is part of its cost.
    _benchmark(args, device)


def _benchmark(args: argparse.Namespace, device: torch.device) -> None:
    if not (args.data / "medmnist" / "breastmnist.npz").exists():
        sys.exit(f"data not found under {args.data}: pass --data <folder with medmnist/ and mnist5k/>")
    torch.manual_seed(0)
    where = device_label(str(device)) + (", backend defaults (the authors' loop with TF32 convolutions)"
                                         if device.type == "cuda" else "")
    layout = ", channels-last" if args.channels_last else ""
    print(f"torch {torch.__version__}, {where}; median (min-max) of "
          f"{args.repeats} interleaved rounds; sigma {SIGMA}, 5 steps, batch 64, models in eval mode{layout}")
    data = _data(args.data)
    summary: dict = {"script": "solver_speed", "torch": torch.__version__, "device": where, "repeats": args.repeats,
                     "sigma": SIGMA, "channels_last": args.channels_last, "models": {}}
    builders = {"resnet18": lambda: medmnist_resnet("resnet18", 1, 2), "wrn28_2": lambda: wrn28_2(10)}
    for name, build in builders.items():
        model = build()
        x_all, y_all = data[name]
        _train(model, x_all, y_all, args.train_steps)  # on the CPU: the same weights on every device
        fmt = torch.channels_last if args.channels_last else torch.contiguous_format
        model.to(device, memory_format=fmt)
        x, y = x_all[:64].to(device).contiguous(memory_format=fmt), y_all[:64].to(device)
        # the noise lpa3_attack draws first from a generator seeded 1 on x's device
        noise = torch.rand(x.shape, generator=torch.Generator(device).manual_seed(1), device=device)
        low, high = -1.0, 1.0

        def ours(**kwargs):
            return lpa3_attack(model, x, y, sigma=SIGMA, input_range=(low, high),
                               generator=torch.Generator(device).manual_seed(1), **kwargs)

        runs = {
            "authors' loop (transcription)": lambda: authors_loop(model, x, y, noise, low, high),
            "lpa3_attack(project=False)": lambda: ours(project=False, max_step=None),  # the authors' x'
            "lpa3_attack() default": lambda: ours(),
            "lpa3_attack(fast=True)": lambda: ours(fast=True),
        }
        chosen = {label: fn for label, fn in runs.items()
                  if args.only is None or args.only in label or "authors" in label}
        results = _time_interleaved(chosen, args.repeats, device)
        base_times, base_x = results["authors' loop (transcription)"]
        base_t = statistics.median(base_times)
        print(f"\n{name}: input {tuple(x.shape)}")
        print(f"{'solver':32} {'median s':>9} {'min-max s':>15} {'speed-up':>9} {'max|dx| vs authors':>19} "
              f"{'preserved':>10} {'max excess':>11} {'feat dist':>10}")
        rows = summary["models"][name] = {}
        for label, (times, x_adv) in results.items():
            t = statistics.median(times)
            preserved, excess, dist = _quality(model, x, y, x_adv)
            diff = float((x_adv - base_x).abs().max())
            spread = f"{min(times):.3f}-{max(times):.3f}"
            print(f"{label:32} {t:9.3f} {spread:>15} {base_t / t:8.2f}x {diff:19.2e} {preserved:10.3f} "
                  f"{excess:11.2e} {dist:10.4f}")
            rows[label] = {"median_s": t, "min_s": min(times), "max_s": max(times), "speedup": base_t / t,
                           "max_dx_vs_authors": diff, "preserved": preserved, "max_excess": excess,
                           "feat_dist": dist}
    if args.json:
        write_result(args.json, summary)


if __name__ == "__main__":
    main()
