"""Write the semi-supervised configs of this folder (run it after changing a setting here).

    python configs/ssl/make_configs.py

One YAML per paper row (Yang et al., NeurIPS 2022, Table 1: FixMatch and FixMatch + LP-A3 on
CIFAR-10 40/250/4000 labels, CIFAR-100 400/2500/10000, STL-10 1000), with the settings of the LP-A3
authors' FixMatch code and its run commands (CausalLearning/LPA3, ``FixMatch/fixmatch.py`` and
``FixMatch/fixmatch_LPA3.py``, README lines 25-41), which is kekmodel/FixMatch-pytorch with LP-A3
added: 2^18 steps for both (the paper's appendix says the same; FixMatch's own code runs 2^20),
batch 64 (4 GPUs x 16), mu 7, SGD Nesterov 0.03, cosine 7pi/16, weight decay 5e-4 (1e-3 on
CIFAR-100), EMA 0.999 with the BatchNorm buffers copied (FixMatchEMA), threshold 0.95, FixMatch's
RandAugment with its Cutout of size 16, WRN-28-2 / WRN-28-8 / WRN-37-2; LP-A3 sigma 0.002 for CIFAR-10
and STL-10, 0.02 for CIFAR-100, ratio 0.9, lam 1, 5 steps, the LP-A3 term with pseudo-label
confidence >= 0.9 once the warm-up is over. ``tests/test_paper_rows.py`` checks every value
against the reference, file and line. Plus CPU rows on MNIST-5k (shipped) and PneumoniaMNIST.

STL-10: this row is the paper's and FixMatch's (1,000 labels, 96 px images, the 105,000 train +
unlabeled images as the unlabeled set) on the paper's WRN-37-2. The LP-A3 authors' code departs
from it: it labels all 5,000 training images, takes the 100,000 unlabeled ones alone and trains
on 48 px crops of the 96 px images (``FixMatch/dataset/make_data.py`` lines 57-76); the published
row does not say which was run.

Epochs: here an epoch is one pass over the unlabeled set (the TCS threshold is refreshed after
each, as in the authors' code). The authors' public FixMatch code counts its epochs in blocks
of 1024 steps and adds the LP-A3 term once more than 5 of them have passed (from step 6144 of
2^18 steps, 2.3% of the run); ``fixmatch.lpa3_loss_warmup_epochs`` below is that many steps in passes
(paper rows) or the same 2.3% share of the run (CPU rows).
"""

from __future__ import annotations

import math
from pathlib import Path

HERE = Path(__file__).resolve().parent

PAPER = {  # source -> (arch, classes, channels, sigma, weight decay, label counts, unlabeled set size)
    "cifar10": ("wrn28_2", 10, 3, 0.002, 5e-4, (40, 250, 4000), 50000),
    "cifar100": ("wrn28_8", 100, 3, 0.02, 1e-3, (400, 2500, 10000), 50000),
    "stl10": ("wrn37_2", 10, 3, 0.002, 5e-4, (1000,), 105000),
}
CPU = {  # source -> (arch, classes, channels, sigma, label counts, batch, max_steps, unlabeled set size)
    "mnist5k": ("small_cnn", 10, 1, 0.02, (10, 20, 40), 32, 1000, 4000),
    "pneumoniamnist": ("small_cnn", 2, 1, 0.02, (20, 100), 32, 1000, 4708),
}
AUTHORS_WARMUP_STEPS = 6 * 1024  # the LP-A3 term counts when epoch > 5, an epoch being 1024 steps
AUTHORS_TOTAL_STEPS = 2**18


def warmup_passes(warmup_steps: float, unlabeled: int, batch: int, mu: int = 7) -> int:
    return max(1, math.ceil(warmup_steps / math.ceil(unlabeled / (mu * batch))))


def _yaml(name: str, *, source: str, arch: str, classes: int, channels: int, wd: float, labels: int, batch: int,
          max_steps: int, sigma: float | None, root: str | None, download: bool, note: str, warmup: int,
          steps_note: str = "") -> str:
    lpa3 = "" if sigma is None else f"""    - class_path: lpa3_lightning.LPA3Callback
      init_args:
        ratio: 0.9
        sigma: {sigma}
        steps: 5
        solver:
          lam: 1.0
"""
    root_line = f"    root: {root}\n" if root else ""
    return f"""# {note}
# Written by configs/ssl/make_configs.py; `lpa3 fit --config configs/ssl/{name}.yaml`.
seed_everything: 0
test_after_fit: true
trainer:
  max_steps: {max_steps}{steps_note}
  max_epochs: -1
  accelerator: auto
  devices: 1
  default_root_dir: runs/ssl/{name}
  logger:
    class_path: lightning.pytorch.loggers.TensorBoardLogger
    init_args:
      save_dir: runs/ssl/{name}
      name: ""
  callbacks:
{lpa3}    - class_path: lpa3_lightning.FixMatchEMA
      init_args:
        decay: 0.999
        copy_buffers: true  # FixMatch's reference EMA: parameters averaged, BN buffers copied
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args:
        save_last: true
model:
  class_path: lpa3_lightning.FixMatchClassifier
  init_args:
    arch: {arch}
    in_channels: {channels}
    num_classes: {classes}
    lr: 0.03
    momentum: 0.9
    weight_decay: {wd}
    fixmatch:  # FixMatchSettings: FixMatch's loss and the LP-A3 term
      threshold: 0.95
      lambda_u: 1.0
      temperature: 1.0
      lpa3_confidence_threshold: 0.9
      lpa3_weight: 1.0
      lpa3_loss_warmup_epochs: {warmup}
      solve_trained_only: true  # false: solve every selected row, the authors' cost (the same loss)
    twin_bn: true
data:
  class_path: lpa3_lightning.data.SemiSupervisedDataModule
  init_args:
    source: {source}
{root_line}    num_labels: {labels}
    seed: 0
    split_file: runs/ssl/{name}/labeled_split.json
    batch_size: {batch}
    mu: 7
    strong_augment: fixmatch  # FixMatch's RandAugment (2 ops, p 0.5, magnitude 1-9) + Cutout(16); or torchvision
    download: {str(download).lower()}
"""


def main() -> None:
    written = []
    for source, (arch, classes, channels, sigma, wd, counts, unlabeled) in PAPER.items():
        for labels in counts:
            for with_lpa3 in (False, True):
                name = f"{source}_{labels}_{'fixmatch_lpa3' if with_lpa3 else 'fixmatch'}"
                note = (f"Paper row: {source.upper()} with {labels} labels, FixMatch{' + LP-A3' if with_lpa3 else ''}"
                        f" ({arch}); downloads the data set to data/ (needs internet).")
                if source == "stl10":
                    note += (" The LP-A3 authors' code labels all 5,000 training images and trains on 48 px crops "
                             "instead (configs/ssl/make_configs.py says more).")
                written.append((name, _yaml(name, source=source, arch=arch, classes=classes, channels=channels, wd=wd,
                                            labels=labels, batch=64, max_steps=AUTHORS_TOTAL_STEPS,
                                            sigma=sigma if with_lpa3 else None, root="data", download=True,
                                            note=note, warmup=warmup_passes(AUTHORS_WARMUP_STEPS, unlabeled, 64),
                                            steps_note="  # 2^18, the LP-A3 authors' (FixMatch's own code: 2^20)")))
    for source, (arch, classes, channels, sigma, counts, batch, steps, unlabeled) in CPU.items():
        root = None if source == "mnist5k" else "data/medmnist"
        warmup = warmup_passes(steps * AUTHORS_WARMUP_STEPS / AUTHORS_TOTAL_STEPS, unlabeled, batch)
        for labels in counts:
            for with_lpa3 in (False, True):
                name = f"{source}_{labels}_{'fixmatch_lpa3' if with_lpa3 else 'fixmatch'}"
                note = (f"CPU row: {source} with {labels} labels, FixMatch{' + LP-A3' if with_lpa3 else ''} "
                        f"({arch}, {steps} steps of batch {batch} + 7 x {batch} unlabeled)"
                        + ("; MNIST-5k ships in the package" if source == "mnist5k" else
                           "; --data.init_args.root: the folder holding pneumoniamnist.npz"))
                written.append((name, _yaml(name, source=source, arch=arch, classes=classes, channels=channels,
                                            wd=5e-4, labels=labels, batch=batch, max_steps=steps,
                                            sigma=sigma if with_lpa3 else None, root=root, download=False,
                                            note=note, warmup=warmup)))
    for name, text in written:
        (HERE / f"{name}.yaml").write_text(text)
    print(f"wrote {len(written)} configs to {HERE}")


if __name__ == "__main__":
    main()
