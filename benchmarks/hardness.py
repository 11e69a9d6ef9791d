"""How hard are the hard positives? Per network, the distribution over an epoch of how far ``x'`` move.

    python benchmarks/hardness.py [--models small_cnn resnet18 ...] [--presets package authors] \
        [--seeds 0 1 2] [--samples 1024] [--jobs 2 --threads 1] [--out runs/hardness]

Each run trains one network on the first ``--samples`` MNIST-5k training digits (embedded in the
package; 10 classes, normalised with MNIST's mean and std) for one plain epoch (the callback's
warm-up: the TCS memory fills) and then one epoch with LP-A3 (ratio 0.5, sigma 0.02, 5 steps),
batch 64, Adam 1e-3, and records every ``x'`` of that epoch:

* the perceptual distance ``||phi(x') - phi(x)||`` the solver maximises (its own feature layers);
* ``|x' - x|``: the L2 norm per sample, and its RMS per input element over the data's std (1.0
  would be a change as large as the data's own spread);
* the share the bisection pulled back (``projected``), the share that barely moved (perceptual
  distance below 1e-3, the callback's warning threshold), and the share whose label is kept in the
  forward that trains on them (``lpa3/label_preserved_epoch``, measured in that forward);
* the LP-A3 epoch's wall time over the plain epoch's (one process, the same run).

Networks: the package's ``small_cnn`` (28 px, 1 channel, twin BatchNorms as the ready modules
make them), ``resnet18`` (the MedMNIST ResNet-18, 28 px, twins), ``wrn28_2`` and ``preact18``
(32 px, twins), and two torchvision networks as a user brings them, without twins, on the digits
padded to 32 px and repeated to 3 channels: ``tv_resnet18`` (``torchvision.models.resnet18``)
and ``tv_mobilenet`` (``mobilenet_v3_small``). Presets: ``package`` (the defaults) and
``authors`` (``preset="authors"``). Ends with the table by network and preset (mean over seeds).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.harness import Table, mean_std, sweep_main, write_result  # noqa: E402

MODELS = ("small_cnn", "resnet18", "wrn28_2", "preact18", "tv_resnet18", "tv_mobilenet")
PRESETS = ("package", "authors")
MEAN, STD = 0.1307, 0.3081  # MNIST's


def _network(name: str):
    """(network, input channels, side in pixels, twin BatchNorms)"""
    import torchvision

    from lpa3_lightning.models import medmnist_resnet, preact_resnet18, small_cnn, wrn28_2

    return {
        "small_cnn": lambda: (small_cnn(1, 10), 1, 28, True),
        "resnet18": lambda: (medmnist_resnet("resnet18", 1, 10), 1, 28, True),
        "wrn28_2": lambda: (wrn28_2(10, 1), 1, 32, True),
        "preact18": lambda: (preact_resnet18(10, 1), 1, 32, True),
        "tv_resnet18": lambda: (torchvision.models.resnet18(num_classes=10), 3, 32, False),
        "tv_mobilenet": lambda: (torchvision.models.mobilenet_v3_small(num_classes=10), 3, 32, False),
    }[name]()


def _worker(model: str, preset: str, seed: int, samples: int, out: Path) -> None:
    import lightning.pytorch as pl
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset

    from benchmarks.harness import StepTimer
    from lpa3_lightning import LPA3Callback, LPA3Classifier
    from lpa3_lightning.data import IndexedDataset, load_mnist5k

    pl.seed_everything(seed)
    net, channels, side, twins = _network(model)
    digits = load_mnist5k()
    x = (torch.from_numpy(digits["train_images"][:samples]).float() / 255 - MEAN) / STD
    x = F.pad(x, [(side - 28) // 2] * 4, value=-MEAN / STD).unsqueeze(1).repeat(1, channels, 1, 1)
    y = torch.from_numpy(digits["train_labels"][:samples]).long()
    loader = DataLoader(IndexedDataset(TensorDataset(x, y)), batch_size=64, shuffle=True,
                        generator=torch.Generator().manual_seed(seed))
    rows: dict[str, list[float]] = {"perceptual": [], "l2": [], "rms": [], "projected": []}

    class Records(LPA3Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self._clean = batch[0]
            super().on_train_batch_start(trainer, pl_module, batch, batch_idx)

        def on_augmented(self, trainer, pl_module, augmented):
            made = self.runner().last  # this batch's hard positives: the solver's diagnostics and its forward
            if made.forward is not None:
                self.bn_mode = made.forward.bn_mode  # the normalisation the solver resolved ("auto" picks it)
            if made.stats is None or not len(augmented):
                return
            delta = (augmented.inputs - self._clean[augmented.mask]).flatten(1)
            rows["perceptual"] += made.stats.perceptual_distance.tolist()
            rows["projected"] += made.stats.projected.float().tolist()
            rows["l2"] += delta.norm(dim=1).tolist()
            rows["rms"] += (delta.pow(2).mean(1).sqrt() / x.std()).tolist()

    callback = Records(ratio=0.5, sigma=0.02, steps=5, warmup_epochs=1, seed=seed, preset=preset,
                       input_range={"mean": [MEAN] * channels, "std": [STD] * channels},
                       logging={"every_n_steps": 1})
    timer = StepTimer()
    module = LPA3Classifier(model=net, in_channels=channels, num_classes=10, twin_bn=twins)
    trainer = pl.Trainer(max_epochs=2, accelerator="cpu", devices=1, callbacks=[timer, callback], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         deterministic=True)
    start = time.perf_counter()
    trainer.fit(module, loader)
    moved = rows["perceptual"]
    result = {
        "model": model, "preset": preset, "seed": seed, "samples": samples, "side": side, "twins": twins,
        "bn_mode": getattr(callback, "bn_mode", None),
        "x_prime": len(moved),
        "perceptual_median": statistics.median(moved), "perceptual_p10": _quantile(moved, 0.1),
        "perceptual_p90": _quantile(moved, 0.9),
        "l2_median": statistics.median(rows["l2"]), "rms_over_std_median": statistics.median(rows["rms"]),
        "projected": statistics.mean(rows["projected"]),
        "barely_moved": sum(d < 1e-3 for d in moved) / len(moved),
        "label_preserved": float(trainer.callback_metrics["lpa3/label_preserved_epoch"]),
        "lpa3_epoch_over_plain": timer.epochs[1] / timer.epochs[0],
        "wall_s": time.perf_counter() - start,
    }
    write_result(out / f"{model}_{preset}_{seed}.json", result)


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--presets", nargs="+", default=list(PRESETS), choices=PRESETS)
    parser.add_argument("--samples", type=int, default=1024, help="MNIST-5k training digits per run")


COLUMNS = ("perceptual_median", "l2_median", "rms_over_std_median", "projected", "barely_moved", "label_preserved",
           "lpa3_epoch_over_plain", "wall_s")


def summarize(args: argparse.Namespace, results: list[dict]) -> str:
    lines = [f"{'network':13} {'preset':8} {'BN':5} {'seeds':>5} " + " ".join(f"{c:>24}" for c in COLUMNS)]
    for model in args.models:
        for preset in args.presets:
            mine = [r for r in results if r["model"] == model and r["preset"] == preset]
            if mine:
                lines.append(f"{model:13} {preset:8} {mine[0]['bn_mode']:5} {len(mine):5d} "
                             + " ".join(f"{mean_std([r[c] for r in mine]):>24}" for c in COLUMNS))
    return "\n".join(lines)


def _runs(args: argparse.Namespace) -> list[tuple]:
    return [(m, p, s) for m in args.models for p in args.presets for s in args.seeds]


TABLE = Table(script=__file__, description=__doc__.splitlines()[0],
              keys=(("model", str), ("preset", str), ("seed", int)), arguments=_arguments,
              runs=_runs,
              result_path=lambda args, m, p, s: args.out / f"{m}_{p}_{s}.json",
              worker=lambda args, m, p, s: _worker(m, p, s, args.samples, args.out),
              keep=lambda args, r: (r["model"], r["preset"], r["seed"]) in _runs(args),
              summarize=summarize, out=ROOT / "runs" / "hardness")


def main(argv: list[str] | None = None) -> None:
    sweep_main(TABLE, argv)


if __name__ == "__main__":
    main()
